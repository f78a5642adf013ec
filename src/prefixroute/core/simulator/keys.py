"""A request's block keys: the one function that turns a prompt into the keys caches use.

Every key comes from :class:`~prefixroute.core.identity.hashing.BlockHasher` (``native``
profile), so keys from a generator, a trace and the gateway agree:

* **token ids**: the chained keys of the prompt's full blocks, bound to the request's
  :class:`~prefixroute.core.identity.identity.CacheIdentity` (model, adapter, salt, ...);
* **block ids** (Mooncake, agentic-session traces): one key per *full* block, chaining the
  trace's ids (as one-token blocks) onto a seed made of the identity and the request's
  ``namespace``. Trace ids already say "same prefix up to here"; chaining them again binds the
  identity and keeps ids that are only unique within one file apart from another file's.

A trailing partial block gets no key, as in vLLM. When a generator knows the reply
(``output_token_ids``), keys continue over the prompt and the reply but its last token: the
last sampled token is never fed back through the model, so it never has KV.
"""

from __future__ import annotations

from array import array
from typing import Any, Hashable, Sequence

from prefixroute.core.errors import InputError
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import DEFAULT_IDENTITY, CacheIdentity
from prefixroute.core.simulator.request import Request

MAX_BLOCK_ID = (1 << 32) - 1  # block ids are hashed as uint32 tokens


class BlockKeyer:
    """Computes :attr:`Request.block_keys`; memoises what repeats (hashers per block size,
    namespace seeds, shared group prefixes)."""

    def __init__(self) -> None:
        self._hashers: dict[int, BlockHasher] = {}
        self._id_hasher = BlockHasher("native", block_size=1)
        self._seeds: dict[tuple[str, CacheIdentity], Any] = {}
        self._prefixes: dict[tuple, list] = {}

    def hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hashers.get(block_size)
        if hasher is None:
            hasher = self._hashers[block_size] = BlockHasher("native", block_size=block_size)
        return hasher

    def keys(self, request: Request) -> list[Hashable]:
        """Keys of ``request``'s full blocks (prompt, then reply when known)."""
        if request.token_ids is not None:
            return self._token_keys(request, request.token_ids)
        if request.hash_ids is not None:
            return self._id_keys(request, request.hash_ids)
        raise InputError(f"request {request.request_id!r} has neither token_ids nor hash_ids",
                         field="token_ids")

    def fill(self, request: Request) -> Request:
        request.block_keys = self.keys(request)
        return request

    # -- token ids ------------------------------------------------------------------------------
    def _token_keys(self, request: Request, tokens: Sequence[int]) -> list[Hashable]:
        block_size = request.block_size
        hasher = self.hasher(block_size)
        identity = request.identity
        prefix_blocks = 0
        keys: list = []
        if request.prefix_group is not None and request.prefix_tokens >= block_size:
            prefix_blocks = min(request.prefix_tokens, len(tokens)) // block_size
            memo_key = (block_size, identity, request.prefix_group, prefix_blocks)
            memo = self._prefixes.get(memo_key)
            if memo is None:
                memo = hasher.block_hashes(tokens[:prefix_blocks * block_size], identity)
                self._prefixes[memo_key] = memo
            keys = list(memo)
        parent = keys[-1] if keys else None
        keys += hasher.block_hashes(tokens, identity, parent=parent,
                                    start=prefix_blocks * block_size)
        output = request.output_token_ids
        if output is not None and len(output) > 1:
            full = len(tokens) // block_size
            sequence = array("I", tokens)
            sequence.extend(output[:-1])
            keys += hasher.block_hashes(sequence, identity, parent=keys[-1] if keys else None,
                                        start=full * block_size)
        return keys

    # -- block ids ------------------------------------------------------------------------------
    def _id_keys(self, request: Request, hash_ids: Sequence[int]) -> list[Hashable]:
        full = request.input_tokens // request.block_size
        ids = hash_ids[:full]
        if not ids:
            return []
        seed_key = (request.namespace, request.identity)
        seed = self._seeds.get(seed_key)
        if seed is None:
            material = list(request.namespace.encode()) or [0]
            seed = self._id_hasher.block_hashes([len(material)] + material, request.identity)[-1]
            self._seeds[seed_key] = seed
        return self._id_hasher.block_hashes(ids, request.identity, parent=seed)


_DEFAULT = BlockKeyer()


def block_keys(request: Request, keyer: BlockKeyer | None = None) -> list[Hashable]:
    """The block keys of ``request`` (module-level keyer unless one is given)."""
    return (keyer or _DEFAULT).keys(request)


def token_block_keys(token_ids: Sequence[int], block_size: int,
                     identity: CacheIdentity = DEFAULT_IDENTITY,
                     keyer: BlockKeyer | None = None) -> list[Hashable]:
    """Keys of a tokenized prompt's full blocks: what a gateway that tokenized a request
    hashes before asking a policy (same keys as the simulator's for the same tokens)."""
    return (keyer or _DEFAULT).hasher(block_size).block_hashes(token_ids, identity)


def fill_block_keys(request: Request, keyer: BlockKeyer | None = None) -> Request:
    request.block_keys = (keyer or _DEFAULT).keys(request)
    return request


def prompt_block_count(request: Request) -> int:
    """How many of ``request.block_keys`` belong to the prompt (the rest cover the reply)."""
    return min(len(request.block_keys), request.input_tokens // request.block_size)
