"""Applying other instances' bookings to this instance's lifecycle runner.

Each remote :class:`~prefixroute.edges.shared_state.codec.Routed` becomes
:meth:`LifecycleRunner.book_remote` (the policy's ``on_routed``, the replica's in-flight and
assignment counts, the router's cache view), and its end the runner's
:meth:`~LifecycleRunner.completed` or :meth:`~LifecycleRunner.ended` on that booking: the same
calls, in the same order, as for a local request, so every instance's policy state reflects
the whole fleet's traffic. The bookings are marked remote (``Booking.remote``).

Pending prefill. A replica's pending prefill is what a gateway measures itself: the uncached
tokens of the requests it sent there whose first byte has not come back
(``ReplicaView.pending_prefill_tokens``). The policy reconciles its record of a replica's
queue with that figure at every decision, taking the entries beyond it as done; so without
the others' share a remote booking left the queue record at this instance's next decision and
its prefill never counted in the wait there: each instance priced the queues at its own
share of the traffic. Each open remote booking therefore counts its
uncached tokens (the prompt less what its router predicted cached, the figure that router
counts) in :meth:`RemoteBookings.pending_prefill_tokens` of its replica, from its
:class:`~prefixroute.edges.shared_state.codec.Routed` to its
:class:`~prefixroute.edges.shared_state.codec.Prefilled`, its end, or until this instance sees
the replica with nothing waiting after it was routed (:meth:`RemoteBookings.scheduled`: a
non-streamed answer has no first byte before its end); the body adds that to what it
measures.

Invariants: a booking is applied once (a repeated message, e.g. after a bootstrap overlaps the
live stream, changes nothing); an end without its booking (its ``Routed`` is older than what
this instance read) is ignored; a remote booking whose end never arrives (its instance died)
is ended as run when its instance is known to be gone (:meth:`RemoteBookings.forget_instance`)
or at the latest after ``stale_after_s``, so it does not hold the replica's in-flight count.
Pure: no I/O; time comes in the calls.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from prefixroute.core.routing.base import Decision, RequestView
from prefixroute.core.routing.lifecycle import Booking, LifecycleRunner
from prefixroute.edges.shared_state.codec import Completed, Ended, Event, Prefilled, Routed

# A remote request that has not ended after this long is taken as ended (its instance went
# away without telling): the gateway's default read timeout is 600 s, so no live request
# is older.
DEFAULT_STALE_AFTER_S = 900.0


class RemoteBookings:
    """Other instances' bookings on one runner.

    ``replica_index(name)``: the runner's index of a replica name, ``None`` if this instance
    does not route to it. ``local_time(wall_time)``: a wall-clock time on the runner's clock.
    """

    def __init__(self, runner: LifecycleRunner, instance: str,
                 replica_index: Callable[[str], int | None],
                 local_time: Callable[[float], float],
                 stale_after_s: float = DEFAULT_STALE_AFTER_S,
                 now: Callable[[], float] | None = None):
        self.runner = runner
        self.instance = instance
        self._replica_index = replica_index
        self._local_time = local_time
        self._now = now  # this instance's clock (local time), for when a booking arrived
        self.stale_after_s = stale_after_s
        # (instance, request_id) -> (booking, local time booked); oldest first.
        self.open: OrderedDict[tuple[str, str], tuple[Booking, float]] = OrderedDict()
        # Uncached tokens of the open bookings whose prefill is not over, by replica index
        # and by booking (module docstring).
        self._pending: dict[int, int] = {}
        self._prefilling: dict[tuple[str, str], int] = {}
        # When each of those became known here: a scrape can speak only for bookings that
        # were made (and had time to reach the engine) before it, on either host's clock.
        self._arrived: dict[tuple[str, str], float] = {}
        self.applied = {"routed": 0, "prefilled": 0, "completed": 0, "ended": 0,
                        "expired": 0, "ignored": 0}

    def pending_prefill_tokens(self, index: int) -> int:
        """Uncached tokens the other instances sent to replica ``index`` whose prefill is not
        known to be over."""
        return self._pending.get(index, 0)

    def scheduled(self, index: int, before: float) -> int:
        """Replica ``index`` was seen with nothing waiting: the other instances' requests
        routed there, and known here, at or before ``before`` (local time; the later of the
        two, so a peer whose clock runs behind releases nothing early) have been scheduled
        and, at one chunk per step, prefilled. The same rule ends a gateway's own
        non-streamed requests' prefill, whose first byte is the whole answer; for the other
        instances' it is the only sign before their end. Returns how many were released."""
        done = []
        for key in self._prefilling:
            entry = self.open.get(key)
            if entry is not None and entry[0].replica == index \
                    and max(entry[0].request.now, self._arrived.get(key, 0.0)) <= before:
                done.append((key, entry[0]))
        for key, booking in done:
            self._prefill_over(key, booking)
        return len(done)

    def _prefill_over(self, key: tuple[str, str], booking: Booking) -> None:
        tokens = self._prefilling.pop(key, 0)
        self._arrived.pop(key, None)
        if tokens:
            self._pending[booking.replica] -= tokens

    def apply(self, event: Event) -> bool:
        """Apply one event; False if it changed nothing (our own, a duplicate, an unknown
        replica, an end whose booking this instance never saw)."""
        if event.instance == self.instance:
            return False
        key = (event.instance, event.request_id)
        if isinstance(event, Routed):
            if key in self.open:
                return self._ignored()
            index = self._replica_index(event.replica)
            if index is None:
                return self._ignored()
            now = self._local_time(event.wall_time)
            request = RequestView(request_id=f"{event.instance}/{event.request_id}",
                                  num_tokens=event.num_tokens, block_size=event.block_size,
                                  block_keys=event.block_keys, tenant=event.tenant, now=now)
            priority = None
            if event.priority_wall_ms is not None:
                priority = round(self._local_time(event.priority_wall_ms / 1000.0) * 1000.0)
            decision = Decision(index, event.branch, "routed by another instance",
                                predicted_cached_tokens=event.predicted_cached_tokens,
                                priority=priority)
            booking = self.runner.book_remote(request, decision)
            if booking is None:
                return self._ignored()
            self.open[key] = (booking, now)
            uncached = max(0, event.num_tokens - event.predicted_cached_tokens)
            if uncached:
                self._prefilling[key] = uncached
                if self._now is not None:
                    self._arrived[key] = self._now()
                self._pending[index] = self._pending.get(index, 0) + uncached
            self.applied["routed"] += 1
            return True
        if isinstance(event, Prefilled):
            entry = self.open.get(key)
            if entry is None:
                return self._ignored()
            self._prefill_over(key, entry[0])  # (nothing to release when all was cached)
            self.applied["prefilled"] += 1
            return True
        entry = self.open.pop(key, None)
        if entry is None:
            return self._ignored()
        booking = entry[0]
        self._prefill_over(key, booking)
        if isinstance(event, Completed):
            self.runner.completed(booking, event.cached_tokens)
            self.applied["completed"] += 1
        else:
            assert isinstance(event, Ended)
            self.runner.ended(booking, ran=event.ran)
            self.applied["ended"] += 1
        return True

    def expire(self, now: float) -> int:
        """End (as run) the remote bookings older than ``stale_after_s`` at ``now`` (the
        runner's clock); returns how many."""
        expired = 0
        limit = now - self.stale_after_s
        while self.open:
            key, (booking, booked_at) = next(iter(self.open.items()))
            if booked_at > limit:
                break
            del self.open[key]
            self._prefill_over(key, booking)
            self.runner.ended(booking, ran=True)
            expired += 1
        self.applied["expired"] += expired
        return expired

    def instances(self) -> set[str]:
        """The other instances with bookings open here."""
        return {instance for instance, _ in self.open}

    def forget_instance(self, instance: str) -> int:
        """``instance`` is gone (it stopped saying it is alive): its open bookings end as
        run, as :meth:`expire` would end them later; returns how many."""
        keys = [key for key in self.open if key[0] == instance]
        for key in keys:
            booking, _ = self.open.pop(key)
            self._prefill_over(key, booking)
            self.runner.ended(booking, ran=True)
        self.applied["expired"] += len(keys)
        return len(keys)

    def _ignored(self) -> bool:
        self.applied["ignored"] += 1
        return False
