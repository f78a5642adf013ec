"""A paged KV block pool with vLLM v1's prefix-caching semantics.

Follows ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py`` (vLLM 0.32):

* ``num_blocks`` physical blocks; block 0 is the reserved null block, so N - 1 are usable.
* A block is *cached* once it is full and its key is registered; cached blocks stay in the
  pool after their request ends and are reused by key.
* Every block has a reference count. Blocks with count 0 sit in the free queue in eviction
  order (front first); allocating a new block pops the front and, if that block was cached,
  evicts its key (a ``BlockRemoved`` event). A block in use (count > 0) is never evicted.
* A hit ("touch") on a free cached block takes it out of the free queue.
* A finished request frees its blocks in reverse order, so the tail of a chain reaches the
  front of the free queue first and is evicted before the shared head (``free``:
  ``reversed(blocks)``). Freed blocks without a key go to the front of the queue instead, so
  they are reused before any cached block is evicted (``free_blocks``: prepended).
* Like vLLM's ``BlockHashToBlockMap``, the map does not de-duplicate: two running requests
  that compute the same block each register their own physical block under the same key
  (vLLM's NOTE: block tables are append-only, so a block cannot be swapped for the older copy).
* The last prompt token is always recomputed: at most ``floor((n - 1) / B)`` blocks hit.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

from mypy_extensions import mypyc_attr

from prefixroute.core.caches.base import CacheEventListener, CacheStats, cacheable_blocks
from prefixroute.core.errors import ConfigError

NULL_BLOCK = 0


class _Owner:
    __slots__ = ("blocks", "num_cached", "num_tokens")

    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_cached = 0  # leading blocks of ``blocks`` that are registered in the map
        self.num_tokens = 0


# (The engine emulator's pool subclasses it to observe admissions and commits.)
@mypyc_attr(allow_interpreted_subclasses=True)
class PagedBlockPool:
    """vLLM-style block pool: ref counts, an LRU free queue, keys registered per full block."""

    # (The sizes are typed ``object`` and checked here, so that a wrong one gets its
    # ConfigError compiled too: a compiled ``int`` parameter refuses a float first.)
    def __init__(self, num_blocks: object, block_size: object,
                 listener: CacheEventListener | None = None):
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ConfigError(f"a paged pool needs at least 2 blocks (block 0 is reserved), "
                              f"got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block size must be an integer of at least 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.listener = listener
        self.stats = CacheStats()
        self._ref = [0] * num_blocks
        self._key: list[Hashable | None] = [None] * num_blocks
        self._block_of: dict[Hashable, int] = {}  # key -> one physical block holding it
        self._duplicates: dict[Hashable, list[int]] = {}  # further blocks with the same key
        # Free queue in eviction order; OrderedDict gives O(1) popleft/remove/append.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._owners: dict[Hashable, _Owner] = {}

    # -- sizes --------------------------------------------------------------------------------
    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def cached_blocks(self) -> int:
        return len(self._block_of) + sum(len(v) for v in self._duplicates.values())

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by running requests (``vllm:kv_cache_usage_perc``)."""
        return 1.0 - len(self._free) / (self.num_blocks - 1)

    def holds(self, key: Hashable) -> bool:
        return key in self._block_of

    # -- lookups ------------------------------------------------------------------------------
    def match(self, keys: Sequence[Hashable]) -> int:
        """Leading keys that are cached, without touching anything."""
        block_of = self._block_of
        n = 0
        for key in keys:
            if key not in block_of:
                break
            n += 1
        return n

    # -- request lifecycle --------------------------------------------------------------------
    def admit(self, owner: Hashable, keys: Sequence[Hashable], num_tokens: int) -> int | None:
        """Start a request of ``num_tokens`` prompt tokens whose full blocks have ``keys``.

        Touches the longest cached prefix (capped by the last-token rule) and allocates blocks
        for the rest of the prompt. Returns the cached tokens, or ``None`` (and changes
        nothing) when too few blocks are free, as vLLM's ``allocate_slots`` returns None.
        """
        if owner in self._owners:
            raise ConfigError(f"request {owner!r} is already admitted")
        block_size = self.block_size
        limit = min(len(keys), cacheable_blocks(num_tokens, block_size))
        block_of = self._block_of
        hits: list[int] = []
        for i in range(limit):
            block = block_of.get(keys[i])
            if block is None:
                break
            hits.append(block)
        needed = -(-num_tokens // block_size) - len(hits)
        # Hit blocks that sit in the free queue stop being allocatable once touched.
        free_after_touch = len(self._free) - sum(1 for b in hits if self._ref[b] == 0)
        if needed > free_after_touch:
            return None
        self._touch(hits)
        state = _Owner()
        state.blocks = hits + self._allocate(needed)
        state.num_cached = len(hits)
        state.num_tokens = num_tokens
        self._owners[owner] = state
        cached_tokens = len(hits) * block_size
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += cached_tokens
        return cached_tokens

    def grow(self, owner: Hashable, num_tokens: int) -> bool:
        """Make room for a request that now holds ``num_tokens`` (decode appends); False if
        the pool is out of free blocks (vLLM would preempt)."""
        state = self._owners[owner]
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed > len(self._free):
            return False
        if needed > 0:
            state.blocks.extend(self._allocate(needed))
        state.num_tokens = max(state.num_tokens, num_tokens)
        return True

    def commit(self, owner: Hashable, keys: Sequence[Hashable], computed_tokens: int,
               token_ids: Sequence[int] | None = None) -> None:
        """Register the full blocks among the first ``computed_tokens`` (``cache_full_blocks``).

        ``keys`` must cover those blocks; ``token_ids`` (optional) ride along in the
        ``BlockStored`` notification as vLLM's event does.
        """
        state = self._owners[owner]
        if computed_tokens > state.num_tokens and not self.grow(owner, computed_tokens):
            raise ConfigError(f"request {owner!r}: no free block for token {computed_tokens}")
        num_full = min(computed_tokens // self.block_size, len(keys), len(state.blocks))
        start = state.num_cached
        if num_full <= start:
            return
        block_of = self._block_of
        for i in range(start, num_full):
            block = state.blocks[i]
            key = keys[i]
            self._key[block] = key
            if key in block_of:
                self._duplicates.setdefault(key, []).append(block)
            else:
                block_of[key] = block
        state.num_cached = num_full
        self.stats.stored_blocks += num_full - start
        if self.listener is not None:
            parent = keys[start - 1] if start > 0 else None
            tokens = None
            if token_ids is not None:
                tokens = token_ids[start * self.block_size:num_full * self.block_size]
            self.listener.on_stored(list(keys[start:num_full]), parent, tokens)

    def release(self, owner: Hashable) -> None:
        """The request finished or was aborted: free its blocks, tail first.

        As vLLM's ``BlockPool.free_blocks``: freed blocks that hold a cached key join the back
        of the free queue (LRU: reused last), while blocks without a key (the partial tail, or
        blocks never filled) go to the *front*, so the next allocation takes them before it
        evicts anything cached.
        """
        state = self._owners.pop(owner)
        ref = self._ref
        key = self._key
        free = self._free
        uncached = []
        for block in reversed(state.blocks):
            ref[block] -= 1
            if ref[block] == 0:
                if key[block] is None:
                    uncached.append(block)
                else:
                    free[block] = None
        # vLLM prepends them keeping their (reversed) order: the first one ends up in front.
        for block in reversed(uncached):
            free[block] = None
            free.move_to_end(block, last=False)

    # -- eviction and reset -------------------------------------------------------------------
    def evict(self, num_blocks: int) -> int:
        """Drop up to ``num_blocks`` cached keys from the front of the free queue."""
        dropped: list[int] = []
        for block in self._free:
            if len(dropped) >= num_blocks:
                break
            if self._key[block] is not None:
                dropped.append(block)
        for block in dropped:
            self._uncache(block)
        return len(dropped)

    def reset(self) -> bool:
        """vLLM's ``reset_prefix_cache``: refuse while requests hold blocks, else forget every
        key (one ``AllBlocksCleared``)."""
        if self._owners:
            return False
        self._block_of.clear()
        self._duplicates.clear()
        self._key = [None] * self.num_blocks
        self._free = OrderedDict.fromkeys(range(1, self.num_blocks))
        if self.listener is not None:
            self.listener.on_cleared()
        return True

    # -- internals ----------------------------------------------------------------------------
    def _touch(self, blocks: list[int]) -> None:
        ref = self._ref
        free = self._free
        for block in blocks:
            if ref[block] == 0:
                del free[block]
            ref[block] += 1

    def _allocate(self, n: int) -> list[int]:
        out = []
        free = self._free
        ref = self._ref
        for _ in range(n):
            block, _ = free.popitem(last=False)
            if self._key[block] is not None:
                self._uncache(block)
            ref[block] = 1
            out.append(block)
        return out

    def _uncache(self, block: int) -> None:
        key = self._key[block]
        self._key[block] = None
        if self._block_of.get(key) == block:
            extra = self._duplicates.get(key)
            if extra:
                self._block_of[key] = extra.pop()
                if not extra:
                    del self._duplicates[key]
            else:
                del self._block_of[key]
        else:
            extra = self._duplicates[key]
            extra.remove(block)
            if not extra:
                del self._duplicates[key]
        self.stats.evicted_blocks += 1
        if self.listener is not None:
            self.listener.on_removed([key])
