"""Shared routing state for several router instances: the piece a router body plugs in.

A body (the gateway, an Envoy Endpoint Picker) creates one :class:`SharedState` beside its
:class:`~prefixroute.core.routing.lifecycle.LifecycleRunner`, tells it each local booking, the
end of its prefill and its end (:meth:`routed`, :meth:`prefilled`, :meth:`completed`,
:meth:`ended`), adds the other instances' pending prefill to each replica's own
(:meth:`pending_prefill_tokens`) when it fills in the views for a decision, asks it for rate
limits (:meth:`take`), and starts and stops it with itself. Everything else (the booking stream,
applying the other instances' bookings to the runner, bootstrap, outages) happens inside.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable, Sequence

from prometheus_client import CollectorRegistry

from prefixroute.core.routing.lifecycle import Booking, LifecycleRunner
from prefixroute.edges.shared_state.apply import DEFAULT_STALE_AFTER_S, RemoteBookings
from prefixroute.edges.shared_state.codec import Completed, Ended, Prefilled, Routed
from prefixroute.edges.shared_state.link import REDIS_ERRORS, RedisLink, SharedStateMetrics
from prefixroute.edges.shared_state.ratelimit import SharedRateLimiter
from prefixroute.edges.shared_state.stream import SharedBookings

DEFAULT_NAMESPACE = "prefixroute"
BOOTSTRAP_S = 2.0

log = logging.getLogger("prefixroute.shared_state")


class SharedState:
    """``runner``: this instance's runner; ``now``: its clock (what ``RequestView.now``
    uses); ``wall``: wall-clock seconds, shared by the instances."""

    def __init__(self, url: str, runner: LifecycleRunner, registry: CollectorRegistry, *,
                 now: Callable[[], float], wall: Callable[[], float] = time.time,
                 namespace: str = DEFAULT_NAMESPACE, instance: str | None = None,
                 stale_after_s: float = DEFAULT_STALE_AFTER_S):
        self.instance = instance or os.urandom(8).hex()
        self.registry = registry
        self.metrics = SharedStateMetrics(registry)
        self.link = RedisLink(url, self.metrics)
        self._now = now
        self._wall = wall
        self.runner = runner
        self.remote = RemoteBookings(runner, self.instance, self._replica_index,
                                     self.local_time, stale_after_s, now=now)
        self.bookings = SharedBookings(self.link, self.remote, namespace=namespace, now=now)
        self.limiter = SharedRateLimiter(self.link, namespace, now=now)
        self._booking_time = self.metrics.path.labels("booking")
        self._limit_time = self.metrics.path.labels("ratelimit")
        self._limit_wait = self.metrics.path.labels("limits_wait")

    def local_time(self, wall_time: float) -> float:
        return wall_time - (self._wall() - self._now())

    def wall_time(self, local_time: float) -> float:
        return local_time + (self._wall() - self._now())

    def _replica_index(self, name: str) -> int | None:
        """The index of the fleet's current replica named ``name`` (a replica that left and
        came back under the same name has a new index; the runner keeps the old view)."""
        replicas = self.runner.replicas
        for index in self.runner.states:
            if replicas[index].name == name:
                return index
        return None

    # -- the body's events ---------------------------------------------------------------

    def routed(self, booking: Booking, predicted_cached_tokens: int) -> None:
        request, decision = booking.request, booking.decision
        priority = None
        if decision.priority is not None:
            priority = round(self.wall_time(decision.priority / 1000.0) * 1000.0)
        wall_time = self.wall_time(request.now)
        self.bookings.decided(wall_time, booking.view.name, decision.branch)
        self._publish(Routed(
            self.instance, request.request_id, booking.view.name, request.tenant,
            request.num_tokens, request.block_size, tuple(request.block_keys),
            wall_time, decision.branch, predicted_cached_tokens, priority))

    def prefilled(self, booking: Booking) -> None:
        """The booking's prefill is over (its first byte came back)."""
        self._publish(Prefilled(self.instance, booking.request.request_id))

    def scheduled(self, index: int, before: float) -> None:
        """This instance saw replica ``index`` with nothing waiting: the other instances'
        requests routed there by ``before`` (local time) are past their prefill
        (:meth:`RemoteBookings.scheduled`)."""
        self.remote.scheduled(index, before)

    def pending_prefill_tokens(self, index: int) -> int:
        """Uncached tokens the other instances sent to replica ``index`` whose prefill is not
        known to be over (:mod:`~prefixroute.edges.shared_state.apply`)."""
        return self.remote.pending_prefill_tokens(index)

    def completed(self, booking: Booking, cached_tokens: int) -> None:
        self._publish(Completed(self.instance, booking.request.request_id, cached_tokens))

    def ended(self, booking: Booking, ran: bool) -> None:
        self._publish(Ended(self.instance, booking.request.request_id, ran))

    def _publish(self, event) -> None:
        """Queue an event; a booking that cannot be encoded (a block key that is not a
        64-bit integer, say) is logged and left local: no request fails over shared state."""
        started = time.perf_counter()
        try:
            self.bookings.publish(event)
        except Exception as exc:
            log.error("booking not shared", extra={"fields": {
                "event": "shared_state_encode_error", "request_id": event.request_id,
                "error": f"{type(exc).__name__}: {exc}"}})
        self._booking_time.observe(time.perf_counter() - started)

    async def take(self, tenant: str,
                   buckets: Sequence[tuple[str, float, float, float]]) -> float | None:
        """The fleet-wide rate limit (:meth:`SharedRateLimiter.try_take`); ``None``: use the
        local bucket."""
        started = time.perf_counter()
        try:
            return await self.limiter.try_take(tenant, buckets)
        finally:
            self._limit_time.observe(time.perf_counter() - started)

    def take_local(self, tenant: str,
                   buckets: Sequence[tuple[str, float, float, float]]) -> float | None:
        """The fleet-wide rate limit when this instance's slices decide it without Redis
        (:meth:`SharedRateLimiter.take_local`); ``None``: await :meth:`take`."""
        started = time.perf_counter()
        wait = self.limiter.take_local(tenant, buckets)
        if wait is not None:
            self._limit_time.observe(time.perf_counter() - started)
        return wait

    def warm(self, tenant: str, limit: str, rate: float, burst: float) -> None:
        """Start fetching a slice of a limit whose cost is not known yet
        (:meth:`SharedRateLimiter.warm`)."""
        self.limiter.warm(tenant, limit, rate, burst)

    def observe_limit_wait(self, seconds: float) -> None:
        """A request waited ``seconds`` for its fleet rate-limit checks once its own work was
        done: what the limits added to its path (the body glue measures it, since a check
        may run beside the request's own work)."""
        self._limit_wait.observe(seconds)

    # -- lifetime ------------------------------------------------------------------------

    async def start(self, bootstrap_s: float = BOOTSTRAP_S) -> None:
        """Read the fleet's recent bookings (for up to ``bootstrap_s``: a Redis that does not
        answer delays no start; the read loop bootstraps when it returns), then follow."""
        try:
            await asyncio.wait_for(self.bookings.bootstrap(), bootstrap_s)
        except (asyncio.TimeoutError, *REDIS_ERRORS) as exc:
            self.link.failed("bootstrap", exc)
        self.bookings.start()
        self.limiter.start()

    async def stop(self) -> None:
        await self.limiter.stop()
        await self.bookings.stop()
        await self.link.aclose()
