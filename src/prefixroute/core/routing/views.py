"""Router views of replica caches: what a router believes each replica holds.

* :class:`ApproximateView`: inferred from the router's own routing history (the blocks it
  sent there), optionally capacity-aware (an LRU of the replica's size, so it forgets what the
  replica must have evicted), corrected by the ``cached_tokens`` the replica reports.
* :class:`EventView`: built from the replica's KV events (block stored / removed / all
  cleared), as vLLM publishes them; exact up to event delay.
* :class:`OracleView`: the replica's actual cache, for upper bounds in simulation.

A view is a hint: the engine validates every block and may have evicted a predicted hit.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from prefixroute.core.caches.key_lru import KeyLRUCache


class ApproximateView:
    """Blocks this router routed to the replica, LRU-bounded when ``capacity_blocks`` is set."""

    observes_engine = False  # it knows only what this router sent (see CacheView)

    def __init__(self, capacity_blocks: int | None = None):
        self.capacity_blocks = capacity_blocks
        self._lru = KeyLRUCache(capacity_blocks if capacity_blocks is not None else 1 << 62)

    def match(self, keys: Sequence[Hashable]) -> int:
        return self._lru.match(keys)

    def record(self, keys: Sequence[Hashable]) -> None:
        """The request with ``keys`` ran here: its blocks are (believed) cached now. A prompt
        of more blocks than the replica holds is rejected, not cached: it changes nothing
        (recorded, it would push every other block out of the view)."""
        if self.capacity_blocks is not None and len(keys) > self.capacity_blocks:
            return
        self._lru.put_many(keys)

    def correct(self, keys: Sequence[Hashable], reported_blocks: int) -> None:
        """The replica said only ``reported_blocks`` leading blocks hit: forget the blocks we
        predicted beyond that (they were evicted), so the next prediction is honest."""
        predicted = self._lru.match(keys)
        if reported_blocks < predicted:
            for key in keys[reported_blocks:predicted]:
                if key in self._lru:
                    self._lru._drop(key, expired=False)

    def resize(self, capacity_blocks: int) -> None:
        """Bound the view at ``capacity_blocks``, forgetting the least recently routed blocks
        beyond it."""
        self.capacity_blocks = capacity_blocks
        self._lru.resize(capacity_blocks)

    def __len__(self) -> int:
        return len(self._lru)


class EventView:
    """Keys the replica announced in KV events; implements the cache listener protocol, so a
    simulated cache can feed it directly and the gateway's ZMQ subscriber through a decoder."""

    observes_engine = True

    def __init__(self) -> None:
        self._keys: set[Hashable] = set()

    def match(self, keys: Sequence[Hashable]) -> int:
        held = self._keys
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n

    def on_stored(self, keys: Sequence[Hashable], parent: Hashable | None,
                  token_ids: Sequence[int] | None) -> None:
        self._keys.update(keys)

    def on_removed(self, keys: Sequence[Hashable]) -> None:
        self._keys.difference_update(keys)

    def on_cleared(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


class OracleView:
    """The replica's cache itself (simulation only: no real router can see this)."""

    observes_engine = True

    def __init__(self, cache) -> None:
        self._cache = cache

    def match(self, keys: Sequence[Hashable]) -> int:
        return self._cache.match(keys)
