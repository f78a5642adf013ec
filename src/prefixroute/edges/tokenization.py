"""A Hugging Face tokenizer directory, read without ``transformers``: ``tokenizer.json`` through
the ``tokenizers`` library and the Jinja chat template from ``tokenizer_config.json`` (or a
``chat_template.jinja`` beside it, where newer ``transformers`` saves it).

It tokenizes the way vLLM does: a ``/v1/completions`` prompt with the tokenizer's special tokens
(the post-processor's BOS), a chat request by rendering the template (``messages``,
``add_generation_prompt=True``, ``tools``, the special tokens by name) and tokenizing the result
without adding special tokens. The template environment mirrors ``transformers``: a sandboxed,
immutable Jinja environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, ``tojson`` that keeps key order and non-ASCII text, ``raise_exception`` and
``strftime_now``.

Texts go through a segment cache. The ``tokenizers`` library cuts a text at its added tokens
(``<|user|>``...) before normalising and splitting what lies between, so the ids of a text are the
ids of its pieces, joined. Pieces repeat across requests (system prompts, tools, earlier turns):
each distinct piece is encoded once, and a gateway request with a known system prompt encodes only
its new turn (the library's encoding was the largest part of the gateway's CPU per request:
benchmarks/results/gateway_chat_shape.md). The ids are the library's own for every piece, so the joined ids equal the whole text's:
nothing is guessed or approximated. The cut is used only for tokenizers whose added tokens match
raw text exactly (no strip, single-word or normalised flags) and that pass a self-check at load;
any other tokenizer encodes whole texts.

Single texts (:meth:`LoadedTokenizer.encode`, the gateway's and the emulator's path) look pieces
up in the cache partition of their trust group only: a cache shared across trust groups would
answer one tenant faster because another sent the same text, a timing side channel the cache
salt is meant to close.
"""

from __future__ import annotations

import json
import re
import threading
from array import array
from collections import OrderedDict
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Sequence

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from prefixroute.core.diagnostics.prompts import CHAT, Prompt, PromptRequest, flatten_content
from prefixroute.core.errors import InputError

# Whole texts, for tokenizers that cannot be cut at their added tokens: the gateway
# re-tokenizes the same prompt on retries.
TEXT_CACHE_SIZE = 1024
# Pieces between added tokens (system prompts, tools, turns), at most this many and this many
# characters in all. A cached character costs about 2.5 bytes for English text (the string
# and its ids) and up to 20 for CJK or emoji (4-byte characters, a token for nearly each), so
# 4M characters are 10-80 MB: some thousand tenants' system prompts. The count bounds the
# per-entry overhead of many short pieces.
SEGMENT_CACHE_SIZE = 65_536
SEGMENT_CACHE_CHARS = 4_000_000
# The self-check text: pieces with and without leading spaces after an added token (some
# pre-tokenizers treat a piece's start differently), whitespace runs, non-ASCII, digits.
_PROBE = "x<|a|> y\n\n z {x}\t<|b|>  ÿ€ 12 345<|a|>Word\n<|b|><|a|>"


class _GenerationTag(Extension):
    """``{% generation %}...{% endgeneration %}`` as ``transformers`` accepts it (it marks the
    assistant's tokens for training masks); rendering keeps the body unchanged."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller):  # type: ignore[no-untyped-def]
        return caller()


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # transformers' filter: keeps the caller's key order, which is why key order reaches tokens.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string, or an AddedToken dict."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read {path.name}: {exc}", where=str(path)) from None
    except json.JSONDecodeError as exc:
        raise InputError(f"not valid JSON ({exc.msg} at line {exc.lineno})",
                         where=str(path)) from None


class SegmentCache:
    """Token ids of text pieces, per partition (a trust group's cache salt; ``None`` for
    batch work outside any tenant), least recently used first out, bounded in entries and in
    characters. Thread-safe: the gateway prepares large prompts on worker threads.

    ``encoded`` counts the pieces stored so far, each one the library had to encode (tests
    read it to show that one trust group never reuses another's pieces). No state is kept
    per partition beyond the entries themselves: partitions are salts, which callers may be
    allowed to choose."""

    def __init__(self, max_entries: int, max_chars: int):
        self.max_entries = max_entries
        self.max_chars = max_chars
        self.chars = 0
        self._entries: OrderedDict[tuple[str | None, str], array] = OrderedDict()
        self._lock = threading.Lock()
        self.encoded = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, partition: str | None, piece: str) -> array | None:
        key = (partition, piece)
        with self._lock:
            ids = self._entries.get(key)
            if ids is not None:
                self._entries.move_to_end(key)
            return ids

    def put(self, partition: str | None, piece: str, ids: array) -> None:
        key = (partition, piece)
        with self._lock:
            self.encoded += 1
            if len(piece) > self.max_chars:
                return  # larger than the whole cache: not kept
            old = self._entries.pop(key, None)
            if old is not None:
                self.chars -= len(piece)
            self._entries[key] = ids
            self.chars += len(piece)
            entries = self._entries
            while len(entries) > self.max_entries or self.chars > self.max_chars:
                (_, evicted), _ids = entries.popitem(last=False)
                self.chars -= len(evicted)


class LoadedTokenizer:
    """A tokenizer and chat template loaded from one directory; implements
    :class:`prefixroute.core.diagnostics.prompts.PromptEncoder`."""

    def __init__(self, tokenizer: Any, chat_template: str | None,
                 special_tokens: dict[str, str], path: Path):
        self.path = path
        # A tokenizer.json may carry truncation or padding settings; transformers turns both
        # off for every encode that does not ask for them, so vLLM neither truncates nor pads
        # a prompt: nor do we.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tokenizer = tokenizer
        self.chat_template_source = chat_template
        self.special_tokens = special_tokens
        self._template = None
        if chat_template is not None:
            try:
                self._template = _environment().from_string(chat_template)
            except TemplateError as exc:
                raise InputError(f"chat template does not compile: {exc}",
                                 where=str(path)) from None
        added = tokenizer.get_added_tokens_decoder()
        self._added_ids = {token.content: token_id for token_id, token in added.items()}
        self._special_prefix, self._special_suffix = self._special_ids()
        self._splitter = self._added_token_splitter(added.values())
        self.segments = SegmentCache(SEGMENT_CACHE_SIZE, SEGMENT_CACHE_CHARS)
        self._encode_cached = lru_cache(maxsize=TEXT_CACHE_SIZE)(self._encode_uncached)

    # -- encoding ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True, *,
               partition: str | None = None) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the post-processor's (BOS...).

        ``partition`` names the trust group (a cache salt) whose cached pieces this call may
        reuse: a cache shared across trust groups would answer one tenant faster because
        another sent the same text, a timing side channel the salt is meant to close."""
        return list(self.encode_array(text, add_special_tokens, partition=partition))

    def encode_array(self, text: str, add_special_tokens: bool = True, *,
                     partition: str | None = None) -> Sequence[int]:
        """:meth:`encode` as compact ``array('I')`` (or a tuple for a tokenizer that cannot
        be cut at its added tokens): no Python int per token."""
        splitter = self._splitter
        if splitter is None:
            return self._encode_cached(text, add_special_tokens, partition)
        return self._join(splitter.split(text), add_special_tokens, partition)

    def _join(self, pieces: Sequence[str], add_special_tokens: bool,
              partition: str | None) -> array:
        """The ids of a text cut into ``pieces`` (odd: an added token; even: the text between
        two), each piece's from the cache of ``partition`` or encoded and cached now."""
        ids = array("I", self._special_prefix if add_special_tokens else ())
        segments = self.segments
        added_ids = self._added_ids
        for i, piece in enumerate(pieces):
            if i % 2:
                ids.append(added_ids[piece])
            elif piece:
                segment = segments.get(partition, piece)
                if segment is None:  # new, or evicted by the batch that encoded it
                    segment = array("I", self.tokenizer.encode(
                        piece, add_special_tokens=False).ids)
                    segments.put(partition, piece, segment)
                ids.extend(segment)
        if add_special_tokens:
            ids.extend(self._special_suffix)
        return ids

    def _encode_uncached(self, text: str, add_special_tokens: bool,
                         partition: str | None) -> tuple[int, ...]:
        return tuple(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of many texts at once (parallel, with the segment cache)."""
        return [list(ids) for ids in self.encode_arrays(texts, add_special_tokens)]

    def encode_arrays(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[array]:
        """Like :meth:`encode_batch`, as compact ``array('I')`` (4 bytes a token instead of a
        Python int each): the form the lint keeps for thousands of long prompts."""
        if self._splitter is None:
            encodings = self.tokenizer.encode_batch_fast(list(texts),
                                                         add_special_tokens=add_special_tokens)
            return [array("I", e.ids) for e in encodings]
        segments = self.segments
        pieces_per_text = [self._splitter.split(text) for text in texts]
        missing: dict[str, None] = {}
        for pieces in pieces_per_text:
            for piece in pieces[0::2]:  # even: text between added tokens; odd: added tokens
                if piece and piece not in missing and segments.get(None, piece) is None:
                    missing[piece] = None
        if missing:
            fresh = list(missing)
            encodings = self.tokenizer.encode_batch_fast(fresh, add_special_tokens=False)
            for piece, encoding in zip(fresh, encodings):
                segments.put(None, piece, array("I", encoding.ids))
        return [self._join(pieces, add_special_tokens, None) for pieces in pieces_per_text]

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # -- chat -------------------------------------------------------------------------------

    def apply_chat_template(self, messages: Sequence[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str:
        """The text of a chat request, as vLLM renders it before tokenizing."""
        if self._template is None:
            raise InputError("the tokenizer has no chat_template (tokenizer_config.json or "
                             "chat_template.jinja); give the prompt as text or token ids",
                             where=str(self.path))
        flat = []
        for message in messages:
            message = dict(message)
            message["content"] = flatten_content(message.get("content"))
            flat.append(message)
        try:
            return self._template.render(messages=flat, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt,
                                         **self.special_tokens)
        except TemplateError as exc:
            raise InputError(f"chat template failed: {exc}", where=str(self.path)) from None

    def encode_chat(self, messages: Sequence[dict], tools: list | None = None) -> list[int]:
        """Token ids of a chat request: rendered, then tokenized without special tokens."""
        return self.encode(self.apply_chat_template(messages, tools=tools),
                           add_special_tokens=False)

    # -- PromptEncoder ----------------------------------------------------------------------

    def render(self, request: PromptRequest) -> Prompt:
        if request.kind == CHAT:
            return Prompt(self.apply_chat_template(request.messages or (), tools=request.tools),
                          add_special_tokens=False)
        if request.prompt is None:
            raise InputError("token-id prompts have no text to render", where=request.where)
        return Prompt(request.prompt, add_special_tokens=True)

    def encode_prompts(self, prompts: Sequence[Prompt]) -> list[array]:
        out: list[array | None] = [None] * len(prompts)
        for flag in (True, False):
            index = [i for i, p in enumerate(prompts) if p.add_special_tokens is flag]
            if index:
                encoded = self.encode_arrays([prompts[i].text for i in index], flag)
                for i, ids in zip(index, encoded):
                    out[i] = ids
        return out  # type: ignore[return-value]

    # -- set-up -----------------------------------------------------------------------------

    def _special_ids(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The ids the post-processor puts before and after a text (BOS, EOS...), found by
        encoding a short text with and without them. A text that encodes to no ids at all
        cannot show where the text sits between them, so the first of a few that encodes to
        some is used; the self-check at load compares the result with the library anyway."""
        for text in ("x", "a", "0", "hello", " "):
            bare = self.tokenizer.encode(text, add_special_tokens=False).ids
            if bare:
                break
        full = self.tokenizer.encode(text, add_special_tokens=True).ids
        for start in range(len(full) - len(bare) + 1):
            if full[start:start + len(bare)] == bare:
                return tuple(full[:start]), tuple(full[start + len(bare):])
        return (), ()

    def _added_token_splitter(self, added_tokens: Any) -> re.Pattern | None:
        tokens = list(added_tokens)
        if not tokens:
            return None
        if any(t.lstrip or t.rstrip or t.single_word or t.normalized for t in tokens):
            return None  # the library would not cut at the raw text; encode whole texts
        contents = sorted({t.content for t in tokens}, key=len, reverse=True)
        splitter = re.compile("(" + _trie_pattern(contents) + ")")
        probe = _PROBE.replace("<|a|>", contents[0]).replace("<|b|>", contents[-1])
        for special in (False, True):  # with special tokens: BOS before, EOS after, once
            whole = self.tokenizer.encode(probe, add_special_tokens=special).ids
            joined: list[int] = list(self._special_prefix) if special else []
            for i, piece in enumerate(splitter.split(probe)):
                if i % 2:
                    joined.append(self._added_ids[piece])
                elif piece:
                    joined.extend(self.tokenizer.encode(piece, add_special_tokens=False).ids)
            if special:
                joined.extend(self._special_suffix)
            if joined != whole:
                return None
        return splitter


def _trie_pattern(literals: Sequence[str]) -> str:
    """A regular expression matching any of ``literals``, the longest where several match at
    one position (the library's rule for added tokens), built as a trie so that a position
    costs the length of one token however many there are: a plain alternation tries every
    token at every position, and tokenizers with thousands of reserved tokens made that
    seconds of CPU per large request. Within a node the branches that go on come before the
    one that ends, so the search prefers the longer match."""
    trie: dict = {}
    for literal in literals:
        node = trie
        for char in literal:
            node = node.setdefault(char, {})
        node[""] = {}

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items())
                    if char]
        if not branches:
            return ""
        if "" in node:
            branches.append("")
        if len(branches) == 1:
            return branches[0]
        return "(?:" + "|".join(branches) + ")"

    return pattern(trie)


def load_tokenizer(directory: str | Path) -> LoadedTokenizer:
    """Load ``tokenizer.json`` and the chat template of a Hugging Face tokenizer directory.

    Raises :class:`InputError` naming the path when the directory or ``tokenizer.json`` is
    missing or unreadable. A missing ``tokenizer_config.json`` or chat template is allowed:
    such a tokenizer encodes text but refuses chat requests.
    """
    from tokenizers import Tokenizer

    path = Path(directory)
    if not path.is_dir():
        # The absolute path: "tokenizer: tokenizer directory not found" for ./tokenizer
        # reads as if the word were the problem.
        raise InputError("tokenizer directory not found", where=str(path.absolute()))
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise InputError("no tokenizer.json in the tokenizer directory (only fast, "
                         "tokenizers-library tokenizers are supported)", where=str(path))
    try:
        tokenizer = Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the library raises a bare Exception on any parse failure
        raise InputError(f"not a valid tokenizer.json: {exc}", where=str(tokenizer_file)) from None
    config: dict = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        config = _read_json(config_file)
        if not isinstance(config, dict):
            raise InputError("expected a JSON object", where=str(config_file))
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
        template = jinja_file.read_text(encoding="utf-8")
    if template is not None and not isinstance(template, str):
        raise InputError("chat_template must be a string", where=str(config_file),
                         field="chat_template")
    special = {}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        text = _token_text(config.get(name))
        if text is not None:
            special[name] = text
    return LoadedTokenizer(tokenizer, template, special, path)
