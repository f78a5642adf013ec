"""A key-level LRU cache with an optional time-to-live: provider prompt caches and prefix families.

Each key is cached or not on its own (no blocks, no pinning). Two uses:

* provider prompt caching: an entry lives ``ttl`` seconds after its last write, or after its
  last hit when ``refresh_on_hit`` (Anthropic-style 5-minute and 1-hour caches refresh on every
  read);
* the routing examples of docs/concepts.md: a replica that holds at most N prefix families
  (the skewed routing trace), or an LRU of 400 blocks where "hit blocks move to the recent end;
  missed blocks are inserted one by one, evicting the oldest" (the fleet hit rates):
  :meth:`access` does exactly that.

Time comes from the ``now`` argument (seconds), never from a clock of its own.

**Invisible to the cycle collector.** The order lives in a
:class:`~prefixroute.core.caches.recency.RecencyOrder` (plain dicts of keys and numbers,
which CPython does not track), not an ``OrderedDict``: a router's view of a replica holds
tens of thousands of keys for as long as it runs, and the collector would walk them all in
every full collection.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from prefixroute.core.caches.base import CacheEventListener, CacheStats, cacheable_blocks
from prefixroute.core.caches.recency import RecencyOrder
from prefixroute.core.errors import ConfigError


class KeyLRUCache:
    """LRU over keys, capacity in entries, optional TTL with optional refresh on hit."""

    def __init__(self, capacity: int, ttl: float | None = None, refresh_on_hit: bool = True,
                 block_size: int = 1, listener: CacheEventListener | None = None):
        if not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"capacity must be a non-negative integer, got {capacity!r}")
        if ttl is not None and ttl <= 0:
            raise ConfigError(f"ttl must be positive seconds, got {ttl!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block size must be an integer of at least 1, got {block_size!r}")
        self.capacity = capacity
        self.ttl = ttl
        self.refresh_on_hit = refresh_on_hit
        self.block_size = block_size
        self.listener = listener
        self.stats = CacheStats()
        self.evictions = 0  # entries pushed out by capacity (expiries are counted apart)
        self.expirations = 0
        self._order = RecencyOrder()  # least recently used first
        # Expiry times (only with a TTL; without one nothing expires).
        self._expiry: dict[Hashable, float] = {}

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._order

    @property
    def capacity_blocks(self) -> int:
        return self.capacity

    @property
    def cached_blocks(self) -> int:
        return len(self._order)

    def keys(self) -> list[Hashable]:
        """Cached keys, least recently used first."""
        return self._order.keys()

    def _pop_oldest(self) -> Hashable:
        key = self._order.pop_oldest()
        if self._expiry:
            self._expiry.pop(key, None)
        return key

    def _live(self, key: Hashable, now: float) -> bool:
        if key not in self._order:
            return False
        return self.ttl is None or self._expiry[key] > now

    # -- single keys --------------------------------------------------------------------------
    def lookup(self, key: Hashable, now: float = 0.0) -> bool:
        """Is ``key`` live at ``now``? A hit becomes most recent (and refreshes the TTL when
        ``refresh_on_hit``); an expired entry is dropped."""
        if key not in self._order.rank:
            return False
        if self.ttl is not None:
            if self._expiry[key] <= now:
                self._drop(key, expired=True)
                return False
            if self.refresh_on_hit:
                self._expiry[key] = now + self.ttl
        self._order.touch(key)
        return True

    def put(self, key: Hashable, now: float = 0.0) -> list[Hashable]:
        """Write ``key`` (most recent, fresh TTL); returns the keys evicted to make room."""
        if self.capacity == 0:
            return []
        if self.ttl is not None:
            self._expiry[key] = now + self.ttl
        self._order.touch(key)
        return self._evict_over_capacity()

    def put_many(self, keys: Sequence[Hashable], now: float = 0.0) -> list[Hashable]:
        """:meth:`put` each of ``keys`` in order, trimming to capacity once at the end.

        The cache ends as after one ``put`` at a time (the ``capacity`` most recently written
        keys), but a key of ``keys`` is never evicted and written again on the way, so the
        keys returned as evicted are only ones that are really gone."""
        if self.capacity == 0:
            return []
        if self.ttl is not None:
            self._expiry.update(dict.fromkeys(keys, now + self.ttl))
        self._order.update_order(keys)
        return self._evict_over_capacity()

    def resize(self, capacity: int) -> list[Hashable]:
        """Hold at most ``capacity`` entries from now on; returns the least recently used
        keys evicted to get there."""
        if not isinstance(capacity, int) or capacity < 0:
            raise ConfigError(f"capacity must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        return self._evict_over_capacity()

    def _evict_over_capacity(self) -> list[Hashable]:
        over = len(self._order) - self.capacity
        if over <= 0:
            return []
        pop = self._pop_oldest
        evicted = [pop() for _ in range(over)]
        self.evictions += over
        self.stats.evicted_blocks += over
        if self.listener is not None:
            self.listener.on_removed(evicted)
        return evicted

    def peek(self, key: Hashable, now: float = 0.0) -> bool:
        return self._live(key, now)

    def expire(self, now: float) -> int:
        """Drop every entry whose TTL ran out by ``now``, least recently used first."""
        expiry = self._expiry
        if not expiry:  # no TTL (or nothing held): nothing expires
            return 0
        dead = [k for k in self._order.keys() if expiry[k] <= now]
        for key in dead:
            self._drop(key, expired=True)
        return len(dead)

    # -- sequences of chained keys ------------------------------------------------------------
    def access(self, keys: Sequence[Hashable], now: float = 0.0) -> int:
        """Serve one request: the longest live prefix of ``keys`` hits; every key is then
        touched or inserted in order. Returns the number of leading keys that hit."""
        if self.ttl is None and self.listener is None:
            return self._access_no_ttl(keys)
        hits = 0
        prefix = True
        for key in keys:
            if self.lookup(key, now):
                if prefix:
                    hits += 1
            else:
                prefix = False
                self.put(key, now)
        if self.listener is not None and hits < len(keys):
            self.listener.on_stored(list(keys[hits:]), keys[hits - 1] if hits else None, None)
        self.stats.queried_tokens += len(keys) * self.block_size
        self.stats.hit_tokens += hits * self.block_size
        self.stats.stored_blocks += len(keys) - hits
        return hits

    def _access_no_ttl(self, keys: Sequence[Hashable]) -> int:
        """:meth:`access` without expiry or listener: the hot loop of the fleet exercises and
        of routers' approximate views.

        The common shapes run as a few C-level passes (``map`` over the dicts' own methods)
        instead of one Python step per key: *distinct leading hits, then keys that are all
        absent and distinct*, which covers a cold prompt, a warm prefix with a new tail and a
        full hit. Then the result is the same as one key at a time: the hits move to the
        recent end in order, the new keys follow in order, and the entries evicted are the
        oldest ones, in order, whenever each insertion overflows (the oldest entry is never a
        key of this request before its turn, because every hit was touched before the first
        insertion). Any other shape (a miss followed by a present key, a key twice) takes the
        key-at-a-time loop, where eviction interleaves with insertion: a later key of the
        same request may be the oldest entry, and evicting it first turns its touch into a
        miss."""
        rank = self._order.rank
        n = len(keys)
        present = list(map(rank.__contains__, keys))
        hits = present.index(False) if False in present else n
        if (hits == n or not any(present[hits:])) and len(set(keys)) == n:
            return self._access_bulk(keys, hits)
        return self._access_stepwise(keys)

    def _access_bulk(self, keys: Sequence[Hashable], hits: int) -> int:
        n = len(keys)
        order = self._order
        if hits:
            order.touch_held(keys[:hits] if hits < n else keys)
        inserted = 0
        if hits < n and self.capacity:
            order.add_new(keys[hits:] if hits else keys)
            inserted = n - hits
            over = len(order) - self.capacity
            if over > 0:
                order.pop_oldest_many(over)
                self.evictions += over
                self.stats.evicted_blocks += over
        self.stats.queried_tokens += n * self.block_size
        self.stats.hit_tokens += hits * self.block_size
        self.stats.stored_blocks += inserted
        return hits

    def _access_stepwise(self, keys: Sequence[Hashable]) -> int:
        rank = self._order.rank
        touch = self._order.touch
        pop = self._order.pop_oldest
        capacity = self.capacity
        hits = inserted = evicted = 0
        prefix = True
        for key in keys:
            if key in rank:
                touch(key)
                if prefix:
                    hits += 1
            else:
                prefix = False
                if capacity == 0:
                    continue
                touch(key)
                inserted += 1
                if len(rank) > capacity:
                    pop()
                    evicted += 1
        if evicted:
            self.evictions += evicted
            self.stats.evicted_blocks += evicted
        self.stats.queried_tokens += len(keys) * self.block_size
        self.stats.hit_tokens += hits * self.block_size
        self.stats.stored_blocks += inserted
        return hits

    # -- the common PrefixCache interface -------------------------------------------------------
    def match(self, keys: Sequence[Hashable], now: float = 0.0) -> int:
        n = 0
        if self.ttl is None:  # nothing expires: membership is the answer (routers' hot path)
            rank = self._order.rank
            for key in keys:
                if key not in rank:
                    break
                n += 1
            return n
        entries = self._expiry
        for key in keys:
            expiry = entries.get(key)
            if expiry is None or expiry <= now:
                break
            n += 1
        return n

    def admit(self, owner: Hashable, keys: Sequence[Hashable], num_tokens: int,
              now: float = 0.0) -> int:
        """Key caches cannot run out of room for a request: hits are counted and touched."""
        limit = cacheable_blocks(num_tokens, self.block_size)
        hits = 0
        for key in keys[:limit]:
            if not self.lookup(key, now):
                break
            hits += 1
        self.stats.queried_tokens += num_tokens
        self.stats.hit_tokens += hits * self.block_size
        return hits * self.block_size

    def commit(self, owner: Hashable, keys: Sequence[Hashable], computed_tokens: int,
               now: float = 0.0) -> None:
        n = min(len(keys), computed_tokens // self.block_size)
        new = [k for k in keys[:n] if k not in self._order.rank]
        for key in keys[:n]:
            self.put(key, now)
        self.stats.stored_blocks += len(new)
        if new and self.listener is not None:
            self.listener.on_stored(new, None, None)

    def release(self, owner: Hashable) -> None:
        pass  # nothing is pinned

    def evict(self, num_blocks: int) -> int:
        n = min(num_blocks, len(self._order))
        pop = self._pop_oldest
        gone = [pop() for _ in range(n)]
        if gone:
            self.evictions += n
            self.stats.evicted_blocks += n
            if self.listener is not None:
                self.listener.on_removed(gone)
        return n

    def reset(self) -> bool:
        self._order.clear()
        self._expiry.clear()
        if self.listener is not None:
            self.listener.on_cleared()
        return True

    def _drop(self, key: Hashable, expired: bool) -> None:
        self._order.discard(key)
        if self._expiry:
            self._expiry.pop(key, None)
        if expired:
            self.expirations += 1
        if self.listener is not None:
            self.listener.on_removed([key])
