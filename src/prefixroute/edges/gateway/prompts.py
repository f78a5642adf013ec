"""From a request body to the block keys the router matches: tokens, then vLLM block hashes.

With a tokenizer directory the gateway tokenizes exactly as vLLM does (completions with the
tokenizer's special tokens, chat through the chat template without them;
:mod:`prefixroute.edges.tokenization`) and hashes with the ``vllm`` profile and the trust
group's salt, so its keys are the 64-bit ids the engine's KV events carry and an event-driven
view matches them directly. Token-id prompts need no tokenizer at all.

Without a tokenizer, *character blocks*: the text is cut into blocks of ``block_size *
CHARS_PER_TOKEN`` characters and hashed with the ``native`` profile (salt in the seed). Equal
prefixes still give equal keys, so affinity works, but the keys cannot match engine events and
token counts are estimates; the approximate view (the gateway's own routing history) is then
the only cache view.

With ``tokenization: backend`` the token ids come from a replica's render endpoint
(:mod:`prefixroute.edges.gateway.render`): the engine's own template, tokenizer and
multimodal processor, so keys match the engine's for any model, media included (the render
answer places each item and gives its hash, which enters the block keys as vLLM's extra keys).
A render that fails (no replica, timeout, an error answer) routes that request on the local
fallback instead, the tokenizer if one is configured, else character blocks, with
``fallback_reason`` set; failed renders are not cached.

Media in the local modes: the gateway does not run the engine's processor, so it cannot know
how many tokens an item becomes. Each media part instead contributes a *routing identity* at
its place: a digest of the trust group's salt and the part's ``uuid`` (set by the gateway for
inline media) or its payload (a URL as written). With character blocks it is text in the
routing text; with a tokenizer it is one placeholder token carrying the digest as a
multimodal extra key. Two requests with different media thus never look like one prefix, and
equal media still share; but blocks from the first media item on cannot equal the engine's
(its placeholder run is longer and its hash is of the media bytes), and token counts are
short by the media's tokens.

Results are cached by a digest of (salt, adapter, prompt): retries and repeated prompts skip
rendering, tokenizing and hashing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Awaitable, Callable, Sequence

from prefixroute.core.errors import PrefixRouteError
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import Adapter, CacheIdentity, MediaItem
from prefixroute.core.identity.media_parts import TEXT_PART_TYPES, media_part_type
from prefixroute.edges.gateway.config import HashingConfig
from prefixroute.edges.gateway.render import Rendered, RenderError
from prefixroute.edges.gateway.sanitize import CHAT, CheckedRequest, encode_json

# "One token is about 4 characters of English text": OpenAI's tokenizer rule of thumb.
CHARS_PER_TOKEN = 4
# Entries hold token ids as 4-byte arrays: 1,024 prompts of 10,000 tokens are 40 MB.
PREPARED_CACHE_SIZE = 1024
# Block digests remembered by their hash input (BlockHasher's memo): a new prompt on a known
# prefix hashes only its own blocks. 65,536 blocks: about 1M tokens of distinct prefixes at
# block 16; at most two generations of about 17 MB (block 16) to 20 MB (block 32) each.
HASH_MEMO_BLOCKS = 65_536

TOKENIZER, TOKEN_IDS, CHARS, BACKEND = "tokenizer", "token_ids", "chars", "backend"
MODES = (TOKENIZER, BACKEND, CHARS)

# A private-use character standing for a media item while a chat template renders.
_MEDIA_MARK = "\U000F0000"
MEDIA_PLACEHOLDER_ID = 0  # the one token a media item takes in tokenizer mode
# Request fields that change what the engine renders; render calls carry only these.
_CHAT_RENDER_FIELDS = (
    "messages", "tools", "tool_choice", "add_generation_prompt", "continue_final_message",
    "add_special_tokens", "documents", "chat_template", "chat_template_kwargs",
    "reasoning_effort", "response_format", "mm_processor_kwargs", "media_io_kwargs",
    "truncate_prompt_tokens", "truncation_side")
_COMPLETION_RENDER_FIELDS = ("add_special_tokens", "truncate_prompt_tokens", "truncation_side")

RenderFn = Callable[[str, dict, Sequence[Any]], Awaitable[Rendered]]


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """What routing needs of a prompt. ``block_keys[i]`` is the 64-bit key of full block i
    (``num_tokens // block_size`` of them with real tokens); ``mode`` says how it was made."""

    num_tokens: int
    block_keys: tuple[int, ...]
    token_ids: Sequence[int] | None
    mode: str
    fallback_reason: str | None = None  # why the configured mode could not be used


class PromptPreparer:
    """``mode`` is ``tokenizer``, ``backend`` or ``chars`` (default: ``tokenizer`` when a
    tokenizer is given, else ``chars``); in ``backend`` mode ``render`` (set by the gateway when
    it starts) asks a replica, and ``tokenizer``, if given, is the fallback."""

    def __init__(self, hashing: HashingConfig, tokenizer: Any | None = None,
                 cache_size: int = PREPARED_CACHE_SIZE, *, mode: str | None = None,
                 render: RenderFn | None = None):
        mode = mode or (TOKENIZER if tokenizer is not None else CHARS)
        if mode not in MODES:
            raise ValueError(f"unknown tokenization mode {mode!r}")
        if mode == TOKENIZER and tokenizer is None:
            raise ValueError("tokenizer mode needs a tokenizer")
        self._mode = mode
        self.block_size = hashing.block_size
        self.tokenizer = tokenizer if mode != CHARS else None
        self.render = render
        self._hasher = BlockHasher("vllm", hashing.algo, hashing.block_size,
                                   none_hash_seed=hashing.none_hash_seed,
                                   memo_blocks=HASH_MEMO_BLOCKS)
        self._char_hasher = BlockHasher("native", block_size=hashing.block_size * CHARS_PER_TOKEN)
        self._cache: OrderedDict[bytes, PreparedPrompt] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # large prompts are prepared on a worker thread

    @property
    def mode(self) -> str:
        return self._mode

    async def prepare_async(self, request: CheckedRequest, adapter: Adapter | None = None,
                            backends: Sequence[Any] = (), *, offload: bool = False
                            ) -> PreparedPrompt:
        """:meth:`prepare`, with ``backend`` mode's render call; ``offload`` runs the CPU work
        (tokenizing, hashing) on a worker thread."""
        body = _render_body(request) if self._mode == BACKEND else None
        if body is None:  # a local mode, or token ids (nothing to render)
            if offload:
                return await asyncio.to_thread(self.prepare, request, adapter)
            return self.prepare(request, adapter)
        identity = CacheIdentity(cache_salt=request.body.get("cache_salt"), adapter=adapter)
        key = _digest(identity, adapter, ["render", request.endpoint, body])
        cached = self._cached(key)
        if cached is not None:
            return cached
        try:
            if self.render is None:
                raise RenderError("no_replica", "the gateway has not started")
            rendered = await self.render(request.endpoint, body, backends)
        except RenderError as exc:
            # Route this request on the local fallback; the next one asks again.
            if offload:
                local = await asyncio.to_thread(self.prepare, request, adapter)
            else:
                local = self.prepare(request, adapter)
            return replace(local, fallback_reason=f"render failed: {exc}")
        if offload:
            prepared = await asyncio.to_thread(self._from_tokens, rendered.token_ids, identity,
                                               BACKEND, rendered.media)
        else:
            prepared = self._from_tokens(rendered.token_ids, identity, BACKEND, rendered.media)
        self._store(key, prepared)
        return prepared

    def _cached(self, key: bytes) -> PreparedPrompt | None:
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
            return cached

    def _store(self, key: bytes, prepared: PreparedPrompt) -> None:
        with self._lock:
            self._cache[key] = prepared
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)

    def prepare(self, request: CheckedRequest, adapter: Adapter | None = None) -> PreparedPrompt:
        """Keys from local work only: token ids, the tokenizer, or character blocks (what
        ``backend`` mode falls back to)."""
        body = request.body
        identity = CacheIdentity(cache_salt=body.get("cache_salt"), adapter=adapter)
        if request.endpoint == CHAT:
            part = ["chat", body["messages"], body.get("tools"),
                    body.get("add_generation_prompt", True), body.get("add_special_tokens")]
        else:
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
                prompt = prompt[0]  # a batch: route by its first prompt
            part = ["completions", prompt, body.get("add_special_tokens", True)]
        key = _digest(identity, adapter, part)
        cached = self._cached(key)
        if cached is not None:
            return cached
        prepared = self._prepare(part, identity)
        self._store(key, prepared)
        return prepared

    # -- local modes ----------------------------------------------------------------------

    def _prepare(self, part: list, identity: CacheIdentity) -> PreparedPrompt:
        if part[0] == "completions" and isinstance(part[1], list):
            return self._from_tokens(part[1], identity, TOKEN_IDS)
        if self.tokenizer is None:
            return self._from_chars(self._routing_text(part, identity.cache_salt), identity)
        try:
            media: list[MediaItem] = []
            if part[0] == "chat" and _has_media(part[1]):
                token_ids, media = self._chat_tokens_with_media(part, identity.cache_salt)
            elif part[0] == "chat":
                text = self.tokenizer.apply_chat_template(
                    _text_only(part[1]), add_generation_prompt=bool(part[3]),
                    tools=part[2] if isinstance(part[2], list) else None)
                token_ids = self.tokenizer.encode_array(
                    text, add_special_tokens=bool(part[4]), partition=identity.cache_salt)
            else:
                token_ids = self.tokenizer.encode_array(
                    part[1], add_special_tokens=bool(part[2]), partition=identity.cache_salt)
        except PrefixRouteError as exc:
            # The engine may still accept what our template cannot render; route on characters
            # rather than refuse a request the engine would serve.
            prepared = self._from_chars(self._routing_text(part, identity.cache_salt), identity)
            return PreparedPrompt(prepared.num_tokens, prepared.block_keys, None, CHARS,
                                  str(exc))
        return self._from_tokens(token_ids, identity, TOKENIZER, media)

    def _chat_tokens_with_media(self, part: list, salt: str | None
                                ) -> tuple[list[int], list[MediaItem]]:
        """The template rendered with a mark where each media part sits; text between marks
        tokenized piecewise, each mark one placeholder token carrying the media's routing
        identity. A template that drops or repeats marks: the text alone, media left out."""
        digests: list[str] = []
        messages = _text_only(part[1], salt, digests, _MEDIA_MARK)
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=bool(part[3]),
            tools=part[2] if isinstance(part[2], list) else None)
        pieces = text.split(_MEDIA_MARK)
        if len(pieces) != len(digests) + 1:
            return self.tokenizer.encode(text.replace(_MEDIA_MARK, ""),
                                         add_special_tokens=bool(part[4]), partition=salt), []
        token_ids: list[int] = []
        media: list[MediaItem] = []
        for i, piece in enumerate(pieces):
            if piece or i == 0:
                token_ids.extend(self.tokenizer.encode(
                    piece, add_special_tokens=bool(part[4]) and i == 0, partition=salt))
            if i < len(digests):
                media.append(MediaItem(digests[i], len(token_ids), 1))
                token_ids.append(MEDIA_PLACEHOLDER_ID)
        return token_ids, media

    def _from_tokens(self, token_ids: Sequence[int], identity: CacheIdentity,
                     mode: str, media: Sequence[MediaItem] = ()) -> PreparedPrompt:
        compact: Sequence[int]
        if isinstance(token_ids, array):  # the tokenizer's own, not shared with anyone
            compact = token_ids
        else:
            try:
                compact = array("I", token_ids)
            except (OverflowError, TypeError):  # ids outside uint32: the engine refuses them
                compact = tuple(token_ids)
        digests = self._hasher.block_hashes(
            compact if isinstance(compact, array) else list(token_ids), identity, media)
        event_id = self._hasher.event_block_hash
        return PreparedPrompt(len(compact), tuple(map(event_id, digests)), compact, mode)

    def _from_chars(self, text: str, identity: CacheIdentity) -> PreparedPrompt:
        codes = array("I")  # code points, straight from UTF-32 in C
        codes.frombytes(text.encode("utf-32-le", "surrogatepass"))
        keys = self._char_hasher.block_hashes(codes, identity)
        num_tokens = -(-len(text) // CHARS_PER_TOKEN)
        return PreparedPrompt(num_tokens, tuple(keys), None, CHARS)

    @staticmethod
    def _routing_text(part: list, salt: str | None = None) -> str:
        """A prefix-stable text of the prompt: appending a message appends text. Media parts
        appear as their routing identity between ``\x1d`` marks."""
        if part[0] != "chat":
            return part[1]
        pieces = []
        if part[2]:
            pieces.append(json.dumps(part[2], ensure_ascii=False) + "\x1e")
        for message in _text_only(part[1], salt, None, None):
            pieces.append(f"{message.get('role')}\x1f{message.get('content') or ''}\x1e")
        return "".join(pieces)


def _digest(identity: CacheIdentity, adapter: Adapter | None, part: list) -> bytes:
    """The preparation cache's key: salt, adapter and what was prepared."""
    return hashlib.sha256(encode_json(
        [identity.cache_salt, adapter and [adapter.name, adapter.path], part],
        default=str)).digest()


def _render_body(request: CheckedRequest) -> dict | None:
    """The render call for ``request``: the fields that decide the engine's tokens, without
    the salt (tokens do not depend on it; the gateway adds it when hashing), and media as
    hashes and placements only. ``None`` for token-id prompts (nothing to render)."""
    body = request.body
    if request.endpoint == CHAT:
        fields = _CHAT_RENDER_FIELDS
        out = {"model": request.model}
    else:
        prompt = body["prompt"]
        if isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], int) or isinstance(prompt[0], list):
                return None  # token ids (a batch of them routes by its first, as ids too)
            prompt = prompt[0]  # a batch of texts: route by its first prompt
        fields = _COMPLETION_RENDER_FIELDS
        out = {"model": request.model, "prompt": prompt}
    for name in fields:
        if body.get(name) is not None:
            out[name] = body[name]
    out["mm_payload"] = "none"
    return out


def media_routing_id(part: dict, salt: str | None) -> str:
    """A media part's routing identity in the local modes: the trust group's salt with the
    part's ``uuid`` (the gateway's HMAC for inline media) or its payload as written."""
    media = media_part_type(part)
    kind = media.type if media is not None else part.get("type")
    payload = part.get(media.payload) if media is not None else None
    uuid = part.get("uuid")
    material = uuid if isinstance(uuid, str) else json.dumps(
        payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    text = f"prefixroute-route-media/v1\x00{salt or ''}\x00{kind}\x00{material}"
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _has_media(messages: list) -> bool:
    return any(isinstance(p, dict) and media_part_type(p) is not None
               for m in messages if isinstance(m.get("content"), list) for p in m["content"])


def _text_only(messages: list, salt: str | None = None, digests: list[str] | None = None,
               mark: str | None = None) -> list[dict]:
    """Messages with content-part lists reduced to their text parts (joined by newlines, the
    "string" content format vLLM renders for text-only templates). Media parts become
    ``\x1d<routing identity>\x1d`` (character blocks), or with ``digests`` (a list to fill)
    ``mark``, their identities appended in order. Text-only messages come out the same
    either way."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = []
            for p in content:
                if not isinstance(p, dict):
                    continue
                kind = p.get("type")
                if kind in TEXT_PART_TYPES and isinstance(p.get("text"), str):
                    texts.append(p["text"])
                elif media_part_type(p) is not None:
                    identity = media_routing_id(p, salt)
                    if digests is not None:
                        digests.append(identity)
                        texts.append(mark or "")
                    else:
                        texts.append(f"\x1d{identity}\x1d")
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out
