"""One Redis connection shared by the shared-state components, and whether it is up.

Redis is an accelerator, never a dependency of a request: every caller catches
:data:`REDIS_ERRORS`, tells the link (:meth:`RedisLink.failed`) and carries on with local
state. The link logs each change (one line "unavailable", one "available again"), shows it in
``prefixroute_shared_state_up`` and, while down, lets callers skip Redis for ``retry_s``
instead of paying a failing round trip on every request.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

log = logging.getLogger("prefixroute.shared_state")

REDIS_ERRORS = (RedisError, RedisConnectionError, RedisTimeoutError, OSError)

# A loopback round trip is ~0.1 ms; a Redis that does not answer in this long is treated as
# down for the request at hand (the request goes on with local state).
DEFAULT_TIMEOUT_S = 0.25
DEFAULT_RETRY_S = 0.5
# What shared state adds to a request's path is tens of microseconds when it stays local and
# a loopback round trip (0.1-0.5 ms) when it does not: buckets fine enough to tell them apart.
PATH_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005,
                0.01, 0.025, 0.1)


class SharedStateMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.up = Gauge("prefixroute_shared_state_up",
                        "1 while the shared-state Redis answers, 0 while this instance runs "
                        "on local state only", registry=registry)
        self.operations = Counter("prefixroute_shared_state_redis_operations",
                                  "Redis commands sent, by operation", ["op"],
                                  registry=registry)
        self.errors = Counter("prefixroute_shared_state_redis_errors",
                              "Redis commands that failed (the instance used local state)",
                              ["op"], registry=registry)
        self.remote_events = Counter("prefixroute_shared_state_remote_events",
                                     "Other instances' booking events applied, by kind",
                                     ["kind"], registry=registry)
        self.published = Counter("prefixroute_shared_state_published_events",
                                 "This instance's booking events written to Redis",
                                 registry=registry)
        self.dropped = Counter("prefixroute_shared_state_dropped_events",
                               "Booking events dropped because the outbox was full during "
                               "an outage", registry=registry)
        self.path = Histogram("prefixroute_shared_state_path_seconds",
                              "Time in shared state on a request's way: sharing a "
                              "booking event (op=booking), a fleet rate-limit check "
                              "(op=ratelimit, one per limit, possibly beside the request's "
                              "own work), and what a request waited for its limit checks "
                              "once its own work was done (op=limits_wait, one per "
                              "limited request)", ["op"],
                              buckets=PATH_BUCKETS, registry=registry)
        self.remote_lag = Histogram("prefixroute_shared_state_remote_lag_seconds",
                                    "From another instance routing a request to this one "
                                    "applying its booking (wall clocks)",
                                    buckets=PATH_BUCKETS + (0.25, 1.0), registry=registry)
        self.blind_decisions = Counter(
            "prefixroute_shared_state_blind_decisions",
            "This instance's routing decisions made after another instance had booked a "
            "request on the same replica but before that booking arrived here (the policy "
            "decided without it), once per such booking, by the local decision's branch",
            ["branch"],
            registry=registry)
        self.local_limits = Counter("prefixroute_shared_state_local_rate_checks",
                                    "Rate-limit checks made on the local bucket because "
                                    "Redis was unavailable", registry=registry)


class RedisLink:
    def __init__(self, url: str, metrics: SharedStateMetrics, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, retry_s: float = DEFAULT_RETRY_S,
                 now: Callable[[], float] = time.monotonic):
        self.url = url
        self.metrics = metrics
        self.retry_s = retry_s
        self._now = now
        self.client = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                              socket_connect_timeout=timeout_s,
                                              health_check_interval=0)
        # Blocking reads wait longer than a command's timeout: a client of their own.
        self.reader = aioredis.Redis.from_url(url, socket_timeout=timeout_s + 2.0,
                                              socket_connect_timeout=timeout_s)
        self.up = True
        self._down_until = 0.0
        metrics.up.set(1)

    def usable(self) -> bool:
        """False while a recent failure says to skip Redis (for ``retry_s``)."""
        return self.up or self._now() >= self._down_until

    def ok(self) -> None:
        if not self.up:
            self.up = True
            self.metrics.up.set(1)
            log.warning("shared state available again; resynchronising", extra={"fields": {
                "event": "shared_state_up", "redis": self._safe_url()}})

    def failed(self, op: str, exc: BaseException) -> None:
        self.metrics.errors.labels(op).inc()
        self._down_until = self._now() + self.retry_s
        if self.up:
            self.up = False
            self.metrics.up.set(0)
            log.warning("shared state unavailable; routing and rate limits use this "
                        "instance's local state until it returns", extra={"fields": {
                            "event": "shared_state_down", "redis": self._safe_url(),
                            "op": op, "error": f"{type(exc).__name__}: {exc}"}})

    def _safe_url(self) -> str:
        """The URL without a password."""
        scheme, sep, rest = self.url.partition("://")
        if "@" in rest:
            rest = "***@" + rest.rsplit("@", 1)[1]
        return scheme + sep + rest

    async def aclose(self) -> None:
        for client in (self.client, self.reader):
            try:
                await client.aclose()
            except REDIS_ERRORS:
                pass
