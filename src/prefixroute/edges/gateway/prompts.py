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

Multimodal content parts are left out of the routing text (the gateway does not run the
engine's processor, so it cannot place their tokens); such requests route on their text only.

Results are cached by a digest of (salt, adapter, prompt): retries and repeated prompts skip
rendering, tokenizing and hashing.
"""

from __future__ import annotations

import hashlib
import json
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Sequence

from prefixroute.core.errors import PrefixRouteError
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import Adapter, CacheIdentity
from prefixroute.edges.gateway.config import HashingConfig
from prefixroute.edges.gateway.sanitize import CHAT, CheckedRequest

# "One token is about 4 characters of English text": OpenAI's tokenizer rule of thumb.
CHARS_PER_TOKEN = 4
# Entries hold token ids as 4-byte arrays: 1,024 prompts of 10,000 tokens are 40 MB.
PREPARED_CACHE_SIZE = 1024

TOKENIZER, TOKEN_IDS, CHARS = "tokenizer", "token_ids", "chars"


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    """What routing needs of a prompt. ``block_keys[i]`` is the 64-bit key of full block i
    (``num_tokens // block_size`` of them with real tokens); ``mode`` says how it was made."""

    num_tokens: int
    block_keys: tuple[int, ...]
    token_ids: Sequence[int] | None
    mode: str
    fallback_reason: str | None = None  # why a tokenizer request fell back to characters


class PromptPreparer:
    def __init__(self, hashing: HashingConfig, tokenizer: Any | None = None,
                 cache_size: int = PREPARED_CACHE_SIZE):
        self.block_size = hashing.block_size
        self.tokenizer = tokenizer
        self._hasher = BlockHasher("vllm", hashing.algo, hashing.block_size,
                                   none_hash_seed=hashing.none_hash_seed)
        self._char_hasher = BlockHasher("native", block_size=hashing.block_size * CHARS_PER_TOKEN)
        self._cache: OrderedDict[bytes, PreparedPrompt] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # large prompts are prepared on a worker thread
        self.cache_hits = 0
        self.cache_misses = 0

    @property
    def mode(self) -> str:
        return TOKENIZER if self.tokenizer is not None else CHARS

    def prepare(self, request: CheckedRequest, adapter: Adapter | None = None) -> PreparedPrompt:
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
        key = hashlib.sha256(json.dumps(
            [identity.cache_salt, adapter and [adapter.name, adapter.path], part],
            separators=(",", ":"), ensure_ascii=False, default=str).encode()).digest()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return cached
            self.cache_misses += 1
        prepared = self._prepare(part, identity)
        with self._lock:
            self._cache[key] = prepared
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return prepared

    # -- the three modes ------------------------------------------------------------------

    def _prepare(self, part: list, identity: CacheIdentity) -> PreparedPrompt:
        if part[0] == "completions" and isinstance(part[1], list):
            return self._from_tokens(part[1], identity, TOKEN_IDS)
        if self.tokenizer is None:
            return self._from_chars(self._routing_text(part), identity)
        try:
            if part[0] == "chat":
                text = self.tokenizer.apply_chat_template(
                    _text_only(part[1]), add_generation_prompt=bool(part[3]),
                    tools=part[2] if isinstance(part[2], list) else None)
                token_ids = self.tokenizer.encode(text, add_special_tokens=bool(part[4]))
            else:
                token_ids = self.tokenizer.encode(part[1], add_special_tokens=bool(part[2]))
        except PrefixRouteError as exc:
            # The engine may still accept what our template cannot render; route on characters
            # rather than refuse a request the engine would serve.
            prepared = self._from_chars(self._routing_text(part), identity)
            return PreparedPrompt(prepared.num_tokens, prepared.block_keys, None, CHARS,
                                  str(exc))
        return self._from_tokens(token_ids, identity, TOKENIZER)

    def _from_tokens(self, token_ids: Sequence[int], identity: CacheIdentity,
                     mode: str) -> PreparedPrompt:
        digests = self._hasher.block_hashes(list(token_ids), identity)
        event_id = self._hasher.event_block_hash
        try:
            compact: Sequence[int] = array("I", token_ids)
        except (OverflowError, TypeError):  # ids outside uint32: the engine will refuse them
            compact = tuple(token_ids)
        return PreparedPrompt(len(token_ids), tuple(event_id(d) for d in digests), compact, mode)

    def _from_chars(self, text: str, identity: CacheIdentity) -> PreparedPrompt:
        codes = array("I")  # code points, straight from UTF-32 in C
        codes.frombytes(text.encode("utf-32-le", "surrogatepass"))
        keys = self._char_hasher.block_hashes(codes, identity)
        num_tokens = -(-len(text) // CHARS_PER_TOKEN)
        return PreparedPrompt(num_tokens, tuple(keys), None, CHARS)

    @staticmethod
    def _routing_text(part: list) -> str:
        """A prefix-stable text of the prompt: appending a message appends text."""
        if part[0] != "chat":
            return part[1]
        pieces = []
        if part[2]:
            pieces.append(json.dumps(part[2], ensure_ascii=False) + "\x1e")
        for message in _text_only(part[1]):
            pieces.append(f"{message.get('role')}\x1f{message.get('content') or ''}\x1e")
        return "".join(pieces)


def _text_only(messages: list) -> list[dict]:
    """Messages with content-part lists reduced to their text parts (joined by newlines, the
    "string" content format vLLM renders for text-only templates)."""
    out = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, list):
            texts = [p.get("text", "") for p in content
                     if isinstance(p, dict) and p.get("type") in ("text", "input_text")
                     and isinstance(p.get("text"), str)]
            message = {**message, "content": "\n".join(texts)}
        out.append(message)
    return out
