"""An LRU over small integer block ids, kept in numpy: replays of many prompts' blocks.

Same answers as :meth:`KeyLRUCache.access <prefixroute.core.caches.key_lru.KeyLRUCache.access>`
without a TTL (the longest live prefix of a request's blocks hits; every block is then touched
or inserted in order, each insertion past the capacity evicting the least recently used), for
callers that hold many requests' keys as arrays and have numbered them ``0 .. n_ids - 1``
(``numpy.unique(keys, return_inverse=True)``): the fleet worked example replays 6,000
prompts of 128 blocks each.

Representation. Every access of a block gets the next *tick*; ``last[id]`` is the tick of
the block's latest access and ``alive[tick]`` says whether a tick is still some block's
latest. The cache holds the ``capacity`` most recently used blocks, so it is exactly the
blocks whose latest tick is at or after ``cut``, the oldest live tick (dead ticks in between
are skipped: a touched block's old tick dies). Evicting ``k`` blocks moves ``cut`` past the
next ``k`` live ticks. A request is then a few array operations per *run* of present or
absent blocks instead of one dictionary operation per block:

* a run of present blocks is touched at once (their old ticks die, new ticks follow);
* a run of absent blocks is inserted at once and the overflow evicted oldest first: that is
  what inserting them one at a time does, since every block the run evicts is older than the
  run (a block of the run itself goes only when the old ones are used up, oldest first,
  as one at a time would);
* presence of the rest is read again after each insertion run: an insertion may have
  evicted a block the request uses later, which then counts as absent, as in the
  key-at-a-time loop.

A request naming a block twice (a hash collision, never in chained keys otherwise) takes the
block-at-a-time loop. Memory: 8 bytes per id and one byte per block access served (ticks
are never reused), which suits replays of a known batch, not an unbounded stream.
"""

from __future__ import annotations

import numpy as np

from prefixroute.core.errors import ConfigError


class IdLRU:
    """LRU of at most ``capacity`` block ids out of ``n_ids`` (module docstring)."""

    __slots__ = ("capacity", "last", "alive", "tick", "cut", "live", "evictions")

    def __init__(self, capacity: int, n_ids: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"capacity must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self.last = np.full(n_ids, -1, dtype=np.int64)  # id -> its latest tick (-1: never)
        self.alive = np.zeros(1024, dtype=bool)         # tick -> still some id's latest
        self.tick = 0        # the next tick
        self.cut = 0         # cached: latest tick >= cut
        self.live = 0        # ids cached
        self.evictions = 0

    def __len__(self) -> int:
        return self.live

    def __contains__(self, block_id: int) -> bool:
        return bool(self.last[block_id] >= self.cut)

    def keys(self) -> list[int]:
        """Cached ids, least recently used first."""
        cached = np.flatnonzero(self.last >= self.cut)
        return cached[np.argsort(self.last[cached])].tolist()

    def access(self, ids: np.ndarray, distinct: bool = False) -> int:
        """Serve one request's block ids (int array, in prompt order): returns how many
        leading blocks hit; every block is then the most recent, the first last touched.
        ``distinct``: the caller knows the request names no id twice (its ids were numbered
        from distinct keys), so the check for a repeated id is skipped."""
        n = len(ids)
        if n == 0:
            return 0
        self._room(n)
        last, alive = self.last, self.alive
        before = last[ids]
        present = before >= self.cut
        # The common shape, in a few operations: leading hits, then only new distinct blocks
        # (as many present blocks as leading hits).
        held = np.count_nonzero(present)
        hits = n if held == n else 0 if held == 0 else int(present.argmin())
        if held == hits:
            tick = self.tick
            ticks = np.arange(tick, tick + n)
            last[ids] = ticks
            if not distinct and np.count_nonzero(last[ids] == ticks) != n:  # an id twice
                last[ids] = before
                return self._access_stepwise(ids)
            if hits:
                alive[before[:hits]] = False
            if self.capacity == 0:
                last[ids] = before  # nothing is ever cached
                return 0
            alive[tick:tick + n] = True
            self.tick = tick + n
            self._grow(n - hits)
            return hits
        if np.unique(ids).size != n:
            return self._access_stepwise(ids)
        return self._access_runs(ids, before)

    def _access_runs(self, ids: np.ndarray, before: np.ndarray) -> int:
        """Runs of present and absent blocks in turn (module docstring)."""
        last, alive = self.last, self.alive
        n = len(ids)
        hits = 0
        leading = True
        pos = 0
        while pos < n:
            present = before[pos:] >= self.cut
            if present[0]:
                run = len(present) if present.all() else int(present.argmin())
                alive[before[pos:pos + run]] = False
                if leading:
                    hits += run
            else:
                run = int(present.argmax()) if present.any() else len(present)
                leading = False
                if self.capacity == 0:
                    pos += run
                    continue
            tick = self.tick
            last[ids[pos:pos + run]] = np.arange(tick, tick + run)
            alive[tick:tick + run] = True
            self.tick = tick + run
            if not present[0]:
                self._grow(run)
            pos += run
        return hits

    def _access_stepwise(self, ids: np.ndarray) -> int:
        """One block at a time (a request that names a block twice)."""
        last, alive, capacity = self.last, self.alive, self.capacity
        hits = 0
        leading = True
        for block_id in ids.tolist():
            previous = last[block_id]
            if previous >= self.cut:
                alive[previous] = False
                if leading:
                    hits += 1
            else:
                leading = False
                if capacity == 0:
                    continue
            last[block_id] = self.tick
            alive[self.tick] = True
            self.tick += 1
            if previous < self.cut:
                self._grow(1)
        return hits

    def _room(self, n: int) -> None:
        """Ticks for ``n`` more accesses."""
        size = len(self.alive)
        if self.tick + n > size:
            grown = np.zeros(max(2 * size, self.tick + n), dtype=bool)
            grown[:size] = self.alive
            self.alive = grown

    def _grow(self, inserted: int) -> None:
        """``inserted`` new blocks are cached: evict the oldest beyond the capacity."""
        self.live += inserted
        over = self.live - self.capacity
        if over <= 0:
            return
        alive, cut = self.alive, self.cut
        # Touched blocks leave dead ticks behind: look well ahead (a scan of a few thousand
        # flags costs about what one more numpy call does).
        width = 16 * over + 4096
        while True:
            found = alive[cut:cut + width].nonzero()[0]
            if len(found) >= over:
                break
            width *= 4
        end = cut + int(found[over - 1]) + 1
        alive[cut:end] = False
        self.cut = end
        self.live = self.capacity
        self.evictions += over
