"""What every local prefix cache offers, and how capacity is stated.

Three structures implement :class:`PrefixCache`, each with its engine's semantics:
:class:`~prefixroute.core.caches.paged_pool.PagedBlockPool` (vLLM),
:class:`~prefixroute.core.caches.radix_tree.RadixCache` (SGLang) and
:class:`~prefixroute.core.caches.key_lru.KeyLRUCache` (provider TTL / key-level LRU).
The simulator's replicas and the engine emulator use them through this one interface:

``match(keys)``
    leading blocks cached, without side effects (what a router's oracle view asks);
``admit(owner, keys, num_tokens)``
    start a request: pin the cached prefix, reserve room for the rest; returns cached tokens,
    or ``None`` when the cache cannot make room now (the caller queues the request);
``commit(owner, keys, computed_tokens)``
    the first ``computed_tokens`` now have KV: their full blocks become cached;
``release(owner)``
    the request finished: unpin; its blocks become evictable;
``evict(num_blocks)`` / ``reset()``.

Block keys come from :mod:`prefixroute.core.identity.hashing` (or a trace's block ids).
Changes are reported to an optional :class:`CacheEventListener`, in the order the engine would
publish them as KV events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Protocol, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.model_config import ModelConfig


class CacheEventListener(Protocol):
    def on_stored(self, keys: Sequence[Hashable], parent: Hashable | None,
                  token_ids: Sequence[int] | None) -> None: ...

    def on_removed(self, keys: Sequence[Hashable]) -> None: ...

    def on_cleared(self) -> None: ...


@dataclass(slots=True)
class CacheStats:
    """Counters in vLLM's units: ``queried_tokens`` and ``hit_tokens`` match
    ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    stored_blocks: int = 0
    evicted_blocks: int = 0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class PrefixCache(Protocol):
    block_size: int
    stats: CacheStats

    def match(self, keys: Sequence[Hashable]) -> int: ...

    def admit(self, owner: Hashable, keys: Sequence[Hashable], num_tokens: int) -> int | None: ...

    def commit(self, owner: Hashable, keys: Sequence[Hashable], computed_tokens: int) -> None: ...

    def release(self, owner: Hashable) -> None: ...

    def evict(self, num_blocks: int) -> int: ...

    def reset(self) -> bool: ...

    @property
    def capacity_blocks(self) -> int: ...

    @property
    def cached_blocks(self) -> int: ...


def capacity_in_blocks(block_size: int, *, blocks: int | None = None, tokens: int | None = None,
                       memory_bytes: float | None = None,
                       model: ModelConfig | None = None) -> int:
    """Turn one capacity statement (blocks, tokens, or bytes with a model) into blocks."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError(f"block size must be an integer of at least 1, got {block_size!r}")
    given = [x for x in (blocks, tokens, memory_bytes) if x is not None]
    if len(given) != 1:
        raise ConfigError("state capacity exactly one way: blocks, tokens, or memory bytes")
    if given[0] < 0:
        raise ConfigError(f"capacity must not be negative, got {given[0]}")
    if blocks is not None:
        return int(blocks)
    if tokens is not None:
        return int(tokens) // block_size
    if model is None:
        raise ConfigError("a capacity in bytes needs a model config (layers, kv heads, head dim, "
                          "dtype) to convert to tokens")
    return model.blocks_for_memory(memory_bytes, block_size)


# The most blocks a router remembers of a replica whose KV size it does not know (none
# configured, none reported), the least recently sent forgotten first. It bounds the router's
# memory, since a gateway runs for weeks; it is no estimate of the replica. 65,536 blocks of 16
# tokens are a million tokens, more than most single replicas hold (an 8-billion-parameter
# model on an 80 GB GPU has room for about 430,000); state a larger replica's size.
UNKNOWN_CAPACITY_BLOCKS = 1 << 16


def fits_kv(prompt_tokens: int, output_tokens: int, capacity_blocks: int,
            block_size: int) -> bool:
    """Whether a request can ever run on a KV of ``capacity_blocks`` (0 or less: unknown, so
    yes): its prompt and output less the last sampled token, which never gets KV, in whole
    blocks. An engine rejects a request that does not fit at once (our replica engine, and
    vLLM refuses a prompt beyond what its KV can hold); a router that does not know the
    output length passes 1."""
    if capacity_blocks <= 0:
        return True
    return -(-(prompt_tokens + max(1, output_tokens) - 1) // block_size) <= capacity_blocks


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Blocks a request of ``num_tokens`` prompt tokens may hit: at most ``floor((n - 1) / B)``.

    The engine needs the logits of the prompt's last token to sample, so it recomputes that
    token even when every block of the prompt is cached (vLLM ``get_computed_blocks``:
    ``max_cache_hit_length = num_tokens - 1``; SGLang matches ``input_ids[:-1]``). A prompt of
    exactly ``k * B`` tokens therefore hits at most ``k - 1`` blocks. This is the one place the
    rule is written; caches, policies, metrics, diagnostics and the gateway import it."""
    return (num_tokens - 1) // block_size if num_tokens > 0 else 0


def cacheable_tokens(num_tokens: int, block_size: int) -> int:
    """Prompt tokens a request may be served from cache: :func:`cacheable_blocks` whole blocks,
    ``floor((n - 1) / B) * B`` tokens (what vLLM reports as ``cached_tokens`` at best)."""
    return cacheable_blocks(num_tokens, block_size) * block_size
