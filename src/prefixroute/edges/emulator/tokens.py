"""Prompts to token ids, and the emulator's deterministic dummy output.

The emulator tokenizes like vLLM when it has the model's tokenizer directory
(:func:`prefixroute.edges.tokenization.load_tokenizer`): a completions prompt with the
tokenizer's special tokens (BOS), a chat request by rendering the chat template and tokenizing
the result without them. Without a directory it uses :class:`FallbackTokenizer`, a
deterministic stand-in documented below, so the emulator runs anywhere; its token counts are
plausible (about one token per word or punctuation run) but its ids match no real model.

Multimodal content parts (every type of
:data:`~prefixroute.core.identity.media_parts.MEDIA_PART_TYPES`) become a run of
``mm_item_tokens`` placeholder tokens at their place in the rendered prompt, with a cache
identity: the part's ``uuid`` when the caller gave one (vLLM uses a
caller-supplied UUID instead of hashing the media), else the SHA-256 of the part's payload
(vLLM hashes the decoded media bytes; the emulator never fetches or decodes media, so two
URLs of the same picture are two identities here).

Tokenizing is cached per trust group. A text cache keyed by the text alone is a timing side
channel: a tenant whose prompt another tenant sent moments ago would be answered measurably
faster (a cache lookup instead of tokenizing), which tells them someone else sent it, even
though their distinct ``cache_salt`` keeps them apart in the prefix cache. So every cache here
is keyed by the request's ``cache_salt`` as well (``partition``): only requests that may share
KV blocks may share tokenizations. Unsalted requests share one partition, as they share
blocks.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from functools import lru_cache, partial
from pathlib import Path
from typing import Sequence

from prefixroute.core.errors import InputError
from prefixroute.core.identity.identity import MediaItem
from prefixroute.core.identity.media_parts import MEDIA_PART_TYPES, TEXT_PART_TYPES, MediaPartType

# Multimodal defaults. 64 placeholder tokens per item: a 224x224 image in Qwen2-VL
# (14-pixel patches, 16x16 = 256 patches, merged 2x2 -> 64 tokens).
DEFAULT_MM_ITEM_TOKENS = 64
# A private-use character marks where a media item sits in the rendered chat text.
_MEDIA_MARK = "\U000F0000"

# The dummy reply: a fixed text, tokenized once, repeated as long as the reply needs.
DUMMY_TEXT = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
              "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis "
              "nostrud exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. ")


class FallbackTokenizer:
    """A deterministic tokenizer for running without the model's tokenizer directory.

    Text is cut GPT-2 style into words with their leading space, digit runs of up to three,
    punctuation runs and whitespace; each piece's id is ``FIRST_ID + blake2b(piece) mod
    (vocab_size - FIRST_ID)``, so equal texts always give equal ids on every machine. Ids below
    ``FIRST_ID`` are reserved: ``BOS_ID`` (put in front of completions prompts, as a BOS
    post-processor does), ``EOS_ID``, ``MEDIA_ID`` (multimodal placeholders) and one id per
    chat role. The chat template writes ``<|role|>`` + content + newline per message, then
    ``<|assistant|>`` (the template of the project's tiny test model). ``decode`` only knows
    pieces this tokenizer produced. Texts are cached per ``partition`` (a trust group's cache
    salt; see the module docstring for why).
    """

    BOS_ID = 1
    EOS_ID = 2
    MEDIA_ID = 3
    ROLE_IDS = {"system": 4, "user": 5, "assistant": 6, "tool": 7, "developer": 8}
    OTHER_ROLE_ID = 9
    NEWLINE_ID = 10
    FIRST_ID = 16
    _PIECES = re.compile(r" ?[^\W\d_]+| ?\d{1,3}| ?[^\s\w]+|\s+(?!\S)|\s+")

    def __init__(self, vocab_size: int = 32_000):
        self.vocab_size = vocab_size
        self._text_of: dict[int, str] = {self.NEWLINE_ID: "\n"}
        self.path = None

    def _piece_id(self, piece: str) -> int:
        digest = hashlib.blake2b(piece.encode(), digest_size=8).digest()
        token = self.FIRST_ID + int.from_bytes(digest, "little") % (self.vocab_size
                                                                     - self.FIRST_ID)
        self._text_of.setdefault(token, piece)
        return token

    @lru_cache(maxsize=4096)  # noqa: B019 - one instance per server, bounded
    def _encode_text(self, text: str, partition: str | None) -> tuple[int, ...]:
        # ``partition`` only keys the cache: one trust group never reuses another's entry.
        return tuple(self._piece_id(p) for p in self._PIECES.findall(text))

    def encode(self, text: str, add_special_tokens: bool = True, *,
               partition: str | None = None) -> list[int]:
        ids = list(self._encode_text(text, partition))
        return [self.BOS_ID, *ids] if add_special_tokens else ids

    def encode_chat_pieces(self, messages: Sequence[dict], *, partition: str | None = None
                           ) -> list[int | str]:
        """The chat prompt as ids, media marks left in place as strings (see PromptEncoder)."""
        encode = partial(self.encode, partition=partition)
        out: list[int | str] = []
        for message in messages:
            out.append(self.ROLE_IDS.get(message["role"], self.OTHER_ROLE_ID))
            out.extend(_split_marks(message["content"], encode))
            out.append(self.NEWLINE_ID)
        out.append(self.ROLE_IDS["assistant"])
        return out

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(self._text_of.get(t, "") for t in token_ids)


def _split_marks(text: str, encode) -> list[int | str]:
    """Encode ``text`` piecewise around media marks; each mark stays as the string itself."""
    if _MEDIA_MARK not in text:
        return list(encode(text, add_special_tokens=False))
    out: list[int | str] = []
    pieces = text.split(_MEDIA_MARK)
    for i, piece in enumerate(pieces):
        if piece:
            out.extend(encode(piece, add_special_tokens=False))
        if i < len(pieces) - 1:
            out.append(_MEDIA_MARK)
    return out


@dataclass(slots=True)
class EncodedPrompt:
    """A prompt as the engine runs it: token ids, its multimodal items (sorted by offset) with
    the modality of each, and its text (when the request had text; ``echo`` returns it)."""

    token_ids: list[int]
    media: list[MediaItem] = field(default_factory=list)
    text: str | None = None
    modalities: list[str] = field(default_factory=list)  # parallel to ``media``


class PromptEncoder:
    """Turns OpenAI request prompts into :class:`EncodedPrompt` with one tokenizer."""

    def __init__(self, tokenizer_dir: str | Path | None = None, *,
                 mm_item_tokens: int = DEFAULT_MM_ITEM_TOKENS):
        if tokenizer_dir is not None:
            from prefixroute.edges.tokenization import load_tokenizer

            self.tokenizer = load_tokenizer(tokenizer_dir)
            self.fallback = False
        else:
            self.tokenizer = FallbackTokenizer()
            self.fallback = True
        self.mm_item_tokens = mm_item_tokens
        self.media_token_id = self._media_token_id()

    def _media_token_id(self) -> int:
        if self.fallback:
            return FallbackTokenizer.MEDIA_ID
        # A real tokenizer: its pad token if it has one, else id 0 (any fixed id would do:
        # media blocks are told apart by their identities, not their placeholder ids).
        added = self.tokenizer.tokenizer.get_added_tokens_decoder()
        for token_id, token in sorted(added.items()):
            if "pad" in token.content.lower():
                return token_id
        return 0

    @property
    def description(self) -> str:
        return "fallback (deterministic word hashing)" if self.fallback \
            else f"tokenizer directory {self.tokenizer.path}"

    # -- completions ------------------------------------------------------------------------
    def encode_text(self, text: str, add_special_tokens: bool = True, *,
                    cache_salt: str | None = None) -> EncodedPrompt:
        """``text`` as token ids; ``cache_salt`` picks the trust group's tokenizing cache."""
        ids = self.tokenizer.encode(text, add_special_tokens, partition=cache_salt)
        return EncodedPrompt(list(ids), [], text)

    # -- chat -------------------------------------------------------------------------------
    def encode_chat(self, messages: Sequence[dict], tools: list | None = None,
                    add_generation_prompt: bool = True, *,
                    cache_salt: str | None = None) -> EncodedPrompt:
        """Render ``messages`` (already validated) and tokenize; media parts become runs of
        placeholder tokens with identities. ``cache_salt`` as in :meth:`encode_text`."""
        flat, identities, modalities = _flatten_messages(messages)
        if self.fallback:
            pieces = self.tokenizer.encode_chat_pieces(flat, partition=cache_salt)
            text = None
        else:
            text = self.tokenizer.apply_chat_template(flat, add_generation_prompt, tools)
            pieces = _split_marks(text, partial(self.tokenizer.encode, partition=cache_salt))
        if not identities:
            return EncodedPrompt(pieces, [], text)  # type: ignore[arg-type]
        token_ids: list[int] = []
        media: list[MediaItem] = []
        items = iter(identities)
        for piece in pieces:
            if piece == _MEDIA_MARK:
                identifier = next(items, None)
                if identifier is None:  # the template dropped a message: cannot place items
                    raise InputError("the chat template does not keep every media part")
                media.append(MediaItem(identifier, len(token_ids), self.mm_item_tokens))
                token_ids.extend([self.media_token_id] * self.mm_item_tokens)
            else:
                token_ids.append(piece)  # type: ignore[arg-type]
        if len(media) != len(identities):
            raise InputError("the chat template does not keep every media part")
        return EncodedPrompt(token_ids, media, text, modalities)

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(token_ids))


def media_identity(part: dict, media: MediaPartType) -> str:
    """A media item's cache identity: its ``uuid``, else the SHA-256 of its payload."""
    uuid = part.get("uuid")
    if isinstance(uuid, str) and uuid:
        return uuid
    kind = media.type
    payload = part.get(media.payload)
    if isinstance(payload, dict) and isinstance(payload.get("url"), str):
        material = payload["url"]
    elif media.by_url and isinstance(payload, str):  # input_image: the URL itself
        material = payload
    else:
        material = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{kind}\x00{material}".encode()).hexdigest()


def _flatten_messages(messages: Sequence[dict]) -> tuple[list[dict], list[str], list[str]]:
    """Messages with string contents (text parts joined by newlines, vLLM's "string" content
    format), and the identities and modalities of their media parts, marked in place."""
    flat = []
    identities: list[str] = []
    modalities: list[str] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                kind = part["type"]
                if kind in TEXT_PART_TYPES:
                    texts.append(part["text"])
                else:
                    media = MEDIA_PART_TYPES[kind]
                    identities.append(media_identity(part, media))
                    modalities.append(media.modality)  # render answers key items by it
                    texts.append(_MEDIA_MARK)
            content = "\n".join(texts)
        elif content is None:
            content = ""
        message = dict(message)
        message["content"] = content
        flat.append(message)
    return flat, identities, modalities


class DummyOutput:
    """The deterministic reply every request gets: ``DUMMY_TEXT`` tokenized once and repeated,
    starting ``seed`` tokens in. A request's ``allowed_token_ids`` (a vLLM sampling option)
    replaces it: token ``i`` is ``allowed[i % len(allowed)]``, which for one allowed id is
    exactly what any vLLM model generates, so the emulator and a real engine cache the same
    decode blocks."""

    def __init__(self, encoder: PromptEncoder, seed: int = 0):
        self.encoder = encoder
        ids = encoder.tokenizer.encode(DUMMY_TEXT, add_special_tokens=False)
        if not ids:  # pragma: no cover - every tokenizer encodes the dummy text to something
            raise InputError("the tokenizer encodes the dummy text to nothing")
        start = seed % len(ids)
        self.cycle = list(ids[start:]) + list(ids[:start])
        # Text of each cycle position, so a reply's text is a join (no decode per request).
        self.pieces = [encoder.decode([t]) for t in self.cycle]
        self._text_cache: dict[int, str] = {}

    def token_ids(self, count: int, allowed: Sequence[int] | None = None) -> list[int]:
        if allowed:
            return [allowed[i % len(allowed)] for i in range(count)]
        cycle = self.cycle
        n = len(cycle)
        if count <= n:
            return cycle[:count]
        return [cycle[i % n] for i in range(count)]

    def text(self, count: int, allowed: Sequence[int] | None = None) -> str:
        if allowed:
            return self.encoder.decode(self.token_ids(count, allowed))
        text = self._text_cache.get(count)
        if text is None:
            pieces = self.pieces
            n = len(pieces)
            text = "".join(pieces[i % n] for i in range(count))
            if len(self._text_cache) < 4096:
                self._text_cache[count] = text
        return text

    def piece_texts(self, start: int, stop: int, allowed: Sequence[int] | None = None
                    ) -> list[str]:
        """Text of output tokens ``start..stop-1`` one by one (for streaming)."""
        if allowed:
            return [self.encoder.decode([t]) for t in self.token_ids(stop, allowed)[start:]]
        pieces = self.pieces
        n = len(pieces)
        return [pieces[i % n] for i in range(start, stop)]
