"""Router views of replica caches: what a router believes each replica holds.

* :class:`ApproximateView`: inferred from the router's own routing history (the blocks it
  sent there), optionally capacity-aware (an LRU of the replica's size, so it forgets what the
  replica must have evicted), corrected by the ``cached_tokens`` the replica reports.
* :class:`EventView`: built from the replica's KV events (block stored / removed / all
  cleared), as vLLM publishes them; exact up to event delay.
* :class:`LiveEventView`: an :class:`EventView` plus what a router knows before the events
  come (the blocks of requests in flight there, and for a grace period those of requests that
  ended there). The gateway runs it over ZMQ, the simulator over its replicas' pools.
* :class:`OracleView`: the replica's actual cache, for upper bounds in simulation.

A view is a hint: the engine validates every block and may have evicted a predicted hit.

Views that learn from the router's own traffic take two calls from the lifecycle runner
(:mod:`prefixroute.core.routing.lifecycle`): ``on_booked(keys, booking)`` when a request is
sent there (the view sets ``booking.held_blocks``, the leading blocks it held for the request
just before) and ``on_ended(keys, booking, ran)`` when the request leaves without a report of
cached tokens. A view without them is read only.
"""

from __future__ import annotations

import weakref

from collections import Counter
from typing import Any, Callable, Hashable, Iterable, Sequence

from prefixroute.core.caches.base import UNKNOWN_CAPACITY_BLOCKS
from prefixroute.core.caches.key_lru import KeyLRUCache
from prefixroute.core.clock import Clock
from prefixroute.core.identity.hashing import vllm_event_block_hash
from prefixroute.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored

# How long an ended request's blocks count as held before its KV events confirm them (see
# LiveEventView). vLLM publishes a step's events after the step, and on a loaded machine they
# can reach the router after the answer; they normally arrive within milliseconds, and a
# BlockRemoved ends the grace early, so a generous grace costs nothing when the events come.
EVENT_GRACE_S = 5.0
# Media whose blocks serve prefix hits: the GPU prefix cache (events without a medium are
# from engines that had no other tier). Offloaded copies (CPU, disk) do not.
_GPU_MEDIA = (None, "GPU")
_LOW64 = (1 << 64) - 1


class ApproximateView:
    """Blocks this router routed to the replica, LRU-bounded by ``capacity_blocks`` (while
    that is unknown, by :data:`~prefixroute.core.caches.base.UNKNOWN_CAPACITY_BLOCKS`).

    Recording is deferred: :meth:`record` (and :meth:`on_booked`) queue the keys, applied in
    order the first time the view is read, so answers are those of applying them at once,
    and a policy that never reads the view (load-only, hash policies) pays no LRU update per
    block. A booking's ``held_blocks`` is set when its keys are applied. The queue is applied
    once it holds :attr:`MAX_QUEUED` entries even if nobody reads: applying is in order, so
    the answers are the same, and a long run under a policy that never reads the view does
    not keep every booking (and its decision) alive; bookings are held weakly for the same
    reason (one that ended and was dropped needs no answer).

    Order. A request's blocks are recorded tail first, so its head is the most recent block
    of its chain and the last the LRU forgets: vLLM frees a finished request's blocks in
    reverse order, so its free queue evicts a prompt's tail first and keeps the head, which
    every later request of the prefix needs. Recorded head first, a full view would drop the
    head and predict no hit for prefixes the engine still serves. Sized at the replica's
    usable blocks (vLLM's ``num_gpu_blocks`` less its reserved null block), the view then
    forgets what the engine evicts."""

    observes_engine = False  # it knows only what this router sent (see CacheView)
    MAX_QUEUED = 1024

    def __init__(self, capacity_blocks: int | None = None):
        self.capacity_blocks = capacity_blocks
        self._lru = KeyLRUCache(capacity_blocks if capacity_blocks is not None
                                else UNKNOWN_CAPACITY_BLOCKS)
        self._queued: list[tuple[Sequence[Hashable], Any]] = []

    def match(self, keys: Sequence[Hashable]) -> int:
        if self._queued:
            self._apply_queued()
        return self._lru.match(keys)

    def record(self, keys: Sequence[Hashable]) -> None:
        """The request with ``keys`` ran here: its blocks are (believed) cached now. A prompt
        of more blocks than the replica holds is rejected, not cached: it changes nothing
        (recorded, it would push every other block out of the view)."""
        self._queued.append((keys, None))
        if len(self._queued) >= self.MAX_QUEUED:
            self._apply_queued()

    def on_booked(self, keys: Sequence[Hashable], booking: Any) -> None:
        """A request with ``keys`` was sent here: record them, and set
        ``booking.held_blocks`` to what the view held for them before."""
        entry: Callable[[], Any]
        try:  # held weakly: a booking that ended and was dropped needs no answer
            entry = weakref.ref(booking)
        except TypeError:
            entry = lambda: booking  # noqa: E731  (an object without weak references)
        self._queued.append((keys, entry))
        if len(self._queued) >= self.MAX_QUEUED:
            self._apply_queued()

    def on_ended(self, keys: Sequence[Hashable], booking: Any, ran: bool) -> None:
        """The request left without a report; if it did not run, nothing it brought is
        cached: take back what its booking added (:meth:`correct` to the blocks held
        before it)."""
        if not ran:
            if self._queued:
                self._apply_queued()  # sets booking.held_blocks
            self.correct(keys, booking.held_blocks)

    def _apply_queued(self) -> None:
        lru = self._lru
        capacity = lru.capacity
        for keys, entry in self._queued:
            booking = entry() if entry is not None else None
            if booking is not None:
                booking.held_blocks = lru.match(keys)
            if len(keys) <= capacity:
                lru.put_many(keys[::-1])  # tail first: see the class docstring
        self._queued.clear()

    def correct(self, keys: Sequence[Hashable], reported_blocks: int) -> None:
        """The replica said only ``reported_blocks`` leading blocks hit: forget the blocks we
        predicted beyond that (they were evicted), so the next prediction is honest."""
        predicted = self.match(keys)
        if reported_blocks < predicted:
            for key in keys[reported_blocks:predicted]:
                if key in self._lru:
                    self._lru._drop(key, expired=False)

    def resize(self, capacity_blocks: int) -> None:
        """Bound the view at ``capacity_blocks``, forgetting the least recently routed blocks
        beyond it."""
        if self._queued:
            self._apply_queued()
        self.capacity_blocks = capacity_blocks
        self._lru.resize(capacity_blocks)

    def on_cleared(self) -> None:
        """The replica's cache is empty (it restarted): forget everything routed there.
        Bookings still queued get ``held_blocks`` 0, which is what the empty cache holds."""
        for _, entry in self._queued:
            booking = entry() if entry is not None else None
            if booking is not None:
                booking.held_blocks = 0
        self._queued.clear()
        self._lru = KeyLRUCache(self._lru.capacity)

    def __len__(self) -> int:
        if self._queued:
            self._apply_queued()
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


class LiveEventView:
    """An engine's KV-event view, plus the keys of requests in flight on it and, until
    ``grace_s`` after they ended, of requests it ran (their events may still be on the way).

    Without the in-flight keys, a burst of requests sharing a new prefix would scatter before
    the first one's ``BlockStored`` arrives; without the grace, a conversation's next turn,
    sent as soon as the answer came, could find its prefix nowhere because the step's events
    reach the router after the answer. A ``BlockRemoved`` ends the grace for its blocks.
    It is the engine's cache listener (a simulated pool feeds it directly) and reads decoded
    vLLM event batches (:meth:`apply`)."""

    observes_engine = True  # see CacheView

    def __init__(self, events: EventView, clock: Clock, grace_s: float = EVENT_GRACE_S):
        self.events = events
        self._clock = clock
        self._grace_s = grace_s
        self._pending: Counter[Hashable] = Counter()
        self._ended: dict[Hashable, float] = {}  # key -> held until
        self._purge_at = 0.0  # when the expired entries of _ended are dropped next

    def match(self, keys: Sequence[Hashable]) -> int:
        n = self.events.match(keys)
        if n == len(keys) or not (self._pending or self._ended):
            return n
        pending, ended, events = self._pending, self._ended, self.events
        now = self._clock.now()
        for key in keys[n:]:
            if key in pending or ended.get(key, -1.0) >= now or events.match((key,)):
                n += 1
            else:
                break
        return n

    def on_booked(self, keys: Sequence[Hashable], booking: Any) -> None:
        booking.held_blocks = self.match(keys)
        self.add_pending(keys)

    def on_ended(self, keys: Sequence[Hashable], booking: Any, ran: bool) -> None:
        self.remove_pending(keys, ran=ran)

    def add_pending(self, keys: Sequence[Hashable]) -> None:
        self._pending.update(keys)

    def remove_pending(self, keys: Sequence[Hashable], *, ran: bool = False) -> None:
        """The request left; ``ran``: the engine computed it, so its blocks are cached there
        and count as held for the grace period."""
        pending = self._pending
        for key in keys:
            left = pending[key] - 1
            if left > 0:
                pending[key] = left
            else:
                pending.pop(key, None)
        if not ran:
            return
        now = self._clock.now()
        self._ended.update(dict.fromkeys(keys, now + self._grace_s))
        if now >= self._purge_at:  # once per grace period, so entries live at most two
            self._ended = {key: until for key, until in self._ended.items() if until >= now}
            self._purge_at = now + self._grace_s

    # -- the engine's events (cache listener protocol) -------------------------------------

    def on_stored(self, keys: Sequence[Hashable], parent: Hashable | None,
                  token_ids: Sequence[int] | None) -> None:
        self.events.on_stored(keys, parent, token_ids)

    def on_removed(self, keys: Sequence[Hashable]) -> None:
        """The engine evicted ``keys``: they are gone whatever the grace says."""
        self.events.on_removed(keys)
        for key in keys:
            self._ended.pop(key, None)

    def on_cleared(self) -> None:
        self.events.on_cleared()
        self._ended.clear()

    def apply(self, events: Iterable[Any]) -> Counter[str]:
        """Decoded vLLM events (:mod:`prefixroute.core.kvevents`), in order; returns how many
        of each kind (``stored``, ``removed``, ``cleared``) changed the view. Blocks on other
        media than the GPU prefix cache are skipped: only it serves hits."""
        applied: Counter[str] = Counter()
        for event in events:
            if isinstance(event, BlockStored):
                if event.medium in _GPU_MEDIA:
                    parent = event.parent_block_hash
                    self.on_stored([event_key(h) for h in event.block_hashes],
                                   None if parent is None else event_key(parent),
                                   event.token_ids)
                    applied["stored"] += 1
            elif isinstance(event, BlockRemoved):
                if event.medium in _GPU_MEDIA:
                    self.on_removed([event_key(h) for h in event.block_hashes])
                    applied["removed"] += 1
            elif isinstance(event, AllBlocksCleared):
                self.on_cleared()
                applied["cleared"] += 1
        return applied

    def __len__(self) -> int:
        return len(self.events)


def event_key(value: int | bytes | bytearray) -> int:
    """An event's block id as the router's key: the unsigned low 64 bits of the digest
    (raw digest bytes, and old engines' signed ``hash()``, read the same way)."""
    if isinstance(value, (bytes, bytearray)):
        return vllm_event_block_hash(bytes(value))
    return value & _LOW64


class OracleView:
    """The replica's cache itself (simulation only: no real router can see this)."""

    observes_engine = True

    def __init__(self, cache) -> None:
        self._cache = cache

    def match(self, keys: Sequence[Hashable]) -> int:
        return self._cache.match(keys)
