"""Per-tenant rate limits enforced across every instance, atomically, in Redis.

A limit is the gateway's token bucket (:class:`prefixroute.edges.gateway.tenants.TokenBucket`)
with the same meaning: ``rate`` tokens a second up to ``burst``, starting full; a request takes
``cost`` tokens (one per request for a request limit, its prompt tokens for a prompt-token
limit) or is refused with the seconds until it could. Only the place of the bucket changes:
one hash per tenant and limit in Redis, ``{tokens, at}``, changed only by a Lua script, so a
take by any instance is one atomic step (Redis runs a script to the end before any other
command) and the tenant's rate holds for the fleet, not per instance. The script reads Redis's
own clock (``TIME``), so instances need no synchronised clocks.

Instances do not ask the script for every request: each holds a small slice of the bucket, a
lease (:mod:`~prefixroute.edges.shared_state.lease`, where the bound and what stays on the
request's path are explained), and spends it locally. The script both gives slices and takes
back the unspent rest of lapsed ones, so one call does both.

Redis unavailable: the check falls back to the instance's local bucket (the limit then holds
per instance, not for the fleet) and no request fails because of it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Sequence

from prefixroute.edges.eager import in_task
from prefixroute.edges.shared_state.lease import LEASE_TTL_S, Lease
from prefixroute.edges.shared_state.link import REDIS_ERRORS, RedisLink

# KEYS[1]: the bucket's hash. ARGV: rate, burst, give (unspent tokens coming back, less what was
# admitted on credit: the level may go below zero and refills from there), need (grant
# at least this or nothing), want (grant up to this), expiry margin in ms. Returns
# {granted, level after}: strings, since Lua numbers would be truncated to integers.
LEASE_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local rate = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local give = tonumber(ARGV[3])
local need = tonumber(ARGV[4])
local want = tonumber(ARGV[5])
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local have = tonumber(state[1])
local at = tonumber(state[2])
if have == nil or at == nil then have = burst; at = now end
if now > at then have = math.min(burst, have + (now - at) * rate) end
have = math.min(burst, have + give)
local grant = 0
if need > 0 and have >= need then
  grant = math.min(have, math.max(need, want))
  have = have - grant
end
redis.call('HSET', KEYS[1], 'tokens', string.format('%.17g', have),
           'at', string.format('%.17g', now))
redis.call('PEXPIRE', KEYS[1], math.ceil(burst / rate * 1000) + tonumber(ARGV[6]))
return {string.format('%.17g', grant), string.format('%.17g', have)}
"""

EXPIRY_MARGIN_MS = 60_000  # a bucket left alone this long after refilling is deleted (full)
# Shared script calls a request on the path waits for before it asks for itself alone.
SHARED_TRIES = 3


class SharedRateLimiter:
    """This instance's leases on the fleet's buckets, ``{namespace}:ratelimit:TENANT:LIMIT``.

    ``now``: a monotonic clock for the leases (Redis keeps the buckets' time itself).
    """

    def __init__(self, link: RedisLink, namespace: str, *,
                 now: Callable[[], float] = time.monotonic, ttl_s: float = LEASE_TTL_S):
        self.link = link
        self.namespace = namespace
        self.ttl_s = ttl_s
        self._now = now
        self._script = link.client.register_script(LEASE_SCRIPT)
        self.leases: dict[str, Lease] = {}
        self._fetching: dict[str, asyncio.Task] = {}
        self._demand: dict[str, float] = {}  # costs of the requests waiting for a key's answer
        self._giving: set[asyncio.Task] = set()
        self._sweeper: asyncio.Task | None = None
        # How checks were decided (tests read them): from the slice or a known refusal
        # (local), by a round trip on the request's path, on credit; and the calls made off
        # the path (slices fetched ahead, slices given back).
        # "alone": a request asked for its own cost after the shared calls' answers went to
        # other requests.
        self.counts = {"local": 0, "path": 0, "prefetch": 0, "credit": 0, "give_back": 0,
                       "alone": 0}

    def key(self, tenant: str, limit: str = "requests") -> str:
        return f"{self.namespace}:ratelimit:{tenant}:{limit}"

    async def try_take(self, tenant: str,
                       buckets: Sequence[tuple[str, float, float, float]]) -> float | None:
        """Take ``cost`` from each ``(limit, rate, burst, cost)`` bucket of ``tenant``, all or
        none: 0.0 on success, else the seconds until possible (``math.inf``: never, the cost
        exceeds the burst); ``None`` when Redis could not answer (the caller uses its local
        bucket)."""
        if not self.link.usable():
            self.link.metrics.local_limits.inc()
            return None
        taken: list[tuple[Lease, float]] = []
        for name, rate, burst, cost in buckets:
            key = self.key(tenant, name)
            wait = await self._take(key, float(rate), float(burst), float(cost))
            if wait != 0.0:
                for lease, spent in taken:  # all or none
                    lease.refund(spent)
                if wait is None:
                    self.link.metrics.local_limits.inc()
                return wait
            taken.append((self.leases[key], float(cost)))
        return 0.0

    def warm(self, tenant: str, limit: str, rate: float, burst: float) -> None:
        """Fetch a slice of ``tenant``'s ``limit`` bucket in the background, before the cost
        of the request at hand is known (its prompt is not tokenized yet): the check that
        follows then finds the slice held, or this fetch under way, instead of starting a
        round trip on the request's path. Asks for the last cost seen (1 at first), up to a
        slice; nothing when the slice already covers that, a refusal is known, or Redis is
        down."""
        if not self.link.usable():
            return
        key = self.key(tenant, limit)
        lease = self._lease(key, float(rate), float(burst))
        now = self._now()
        cost = lease.last_cost
        if (key in self._fetching or lease.known_wait(cost, now) > 0
                or (now < lease.expires_at and lease.tokens >= cost)):
            return
        self.counts["prefetch"] += 1
        self._start_fetch(key, lease, cost, ahead=False)

    def _lease(self, key: str, rate: float, burst: float) -> Lease:
        lease = self.leases.get(key)
        if lease is None or (lease.rate, lease.burst) != (rate, burst):
            # A new limit (or a reload changed it): a fresh lease; the old one's tokens go
            # back.
            if lease is not None:
                self._give_back_later(key, lease)
            lease = self.leases[key] = Lease(rate, burst, self.ttl_s)
        return lease

    def take_local(self, tenant: str,
                   buckets: Sequence[tuple[str, float, float, float]]) -> float | None:
        """:meth:`try_take` when this instance decides it alone, without suspending: tokens
        its slice holds, a refusal known from Redis's last answer, or credit
        (:meth:`Lease.may_admit_on_credit`; the charge is sent in the background). ``None``
        when Redis must be asked (the caller then awaits :meth:`try_take`)."""
        if not self.link.usable():
            return None
        now = self._now()
        taken: list[tuple[Lease, float]] = []
        for name, rate, burst, cost in buckets:
            key = self.key(tenant, name)
            lease = self._lease(key, float(rate), float(burst))
            lease.last_cost = min(float(cost), lease.burst)
            if lease.spend(cost, now):
                taken.append((lease, float(cost)))
                self._maybe_prefetch(key, lease, float(cost))
                continue
            wait = lease.known_wait(cost, now)
            if wait == 0 and lease.may_admit_on_credit(cost, now):
                # Charged by a fetch off the path: the one on its way pays it from its slice
                # (Lease.granted) or, if it cannot, starts a call that charges it (_fetch);
                # else one started now.
                lease.credit(cost)
                self.counts["credit"] += 1
                if key not in self._fetching:
                    self._start_fetch(key, lease, cost, ahead=True)
                taken.append((lease, 0.0))
                continue
            for held, spent in taken:
                held.refund(spent)
            if wait > 0:
                self.counts["local"] += 1
                return wait
            return None
        self.counts["local"] += 1
        return 0.0

    async def _take(self, key: str, rate: float, burst: float, cost: float) -> float | None:
        if cost <= 0:
            return 0.0  # nothing to take (and a zero cost must not count as demand below)
        lease = self._lease(key, rate, burst)
        lease.last_cost = min(cost, burst)
        if lease.spend(cost, self._now()):
            self.counts["local"] += 1
            self._maybe_prefetch(key, lease, cost)
            return 0.0
        wait = lease.known_wait(cost, self._now())
        if wait > 0:
            self.counts["local"] += 1
            return wait
        # One script call per key at a time: a request that finds a slice on its way waits for
        # it rather than taking a second slice; one that finds none starts the call the
        # others then share. Its answer either covers the cost, or tells the bucket's level
        # (a refusal with its wait), or went to other requests: then ask again, a few times.
        # The costs waiting are asked for together (a fetch asks for their sum), so one call
        # usually serves every request waiting for it.
        self._demand[key] = self._demand.get(key, 0.0) + cost
        try:
            for _ in range(SHARED_TRIES):
                task = self._fetching.get(key)
                if task is None:
                    self.counts["path"] += 1
                    task = self._start_fetch(key, lease, cost, ahead=False)
                if not await asyncio.shield(task):
                    return None
                now = self._now()
                if lease.spend(cost, now):
                    return 0.0
                wait = lease.known_wait(cost, now)
                if wait > 0:
                    return wait
        finally:
            left = self._demand.pop(key, 0.0) - cost
            if left > 1e-9:
                self._demand[key] = left
        # Every shared answer went to other requests (many at once on a small slice) and the
        # bucket may still hold the cost: ask for this request alone.
        return await self._take_alone(key, lease, cost)

    async def _take_alone(self, key: str, lease: Lease, cost: float) -> float | None:
        """One script call that takes ``cost`` for this request only (not into the slice,
        where another request could spend it first): the script grants it or refuses it in
        one atomic step, so a refusal means the fleet bucket lacked the cost at that moment,
        and its wait comes from the level Redis answered with. ``None``: Redis did not
        answer."""
        self.counts["alone"] += 1
        await in_task()  # (called inline from a request's path; the Redis client needs one)
        try:
            granted, level = await self._script(
                keys=[key], args=[lease.rate, lease.burst, 0, cost, cost, EXPIRY_MARGIN_MS])
        except REDIS_ERRORS as exc:
            self.link.failed("ratelimit", exc)
            return None
        self.link.metrics.operations.labels("ratelimit").inc()
        self.link.ok()
        now = self._now()
        lease.granted(0.0, float(level), now)  # the level only: the tokens are this request's
        if float(granted) >= cost or lease.spend(cost, now):
            # Granted, or refused while another fetch refilled this instance's slice.
            return 0.0
        # A wait of at least a microsecond (a level that rounding left a hair below the cost).
        return max(lease.known_wait(cost, now), 1e-6)

    def _maybe_prefetch(self, key: str, lease: Lease, cost: float) -> None:
        if lease.wants_prefetch(cost) and key not in self._fetching and self.link.usable():
            self.counts["prefetch"] += 1
            self._start_fetch(key, lease, cost, ahead=True)

    def _start_fetch(self, key: str, lease: Lease, cost: float, ahead: bool) -> asyncio.Task:
        task = asyncio.create_task(self._fetch(key, lease, cost, ahead=ahead))
        self._fetching[key] = task
        task.add_done_callback(lambda t: self._fetching.pop(key, None)
                               if self._fetching.get(key) is t else None)
        return task

    async def _fetch(self, key: str, lease: Lease, cost: float, ahead: bool = False) -> bool:
        """One script call: give back a lapsed slice's rest and ask for a slice covering
        ``cost``. False when Redis did not answer."""
        now = self._now()
        # Unspent tokens of a lapsed slice go back; what was admitted on credit is charged
        # (even below zero).
        owed = lease.owed
        give = lease.lapse(now) - owed
        lease.owed = 0.0
        lease.charging += owed
        need, want = lease.request(cost, now, ahead, self._demand.get(key, 0.0))
        try:
            granted, level = await self._script(
                keys=[key], args=[lease.rate, lease.burst, give, need, want, EXPIRY_MARGIN_MS])
        except REDIS_ERRORS as exc:
            lease.owed += owed  # the credited requests are charged on the next call
            self.link.failed("ratelimit", exc)
            return False
        except asyncio.CancelledError:
            lease.owed += owed
            raise
        finally:
            lease.charging -= owed
        self.link.metrics.operations.labels("ratelimit").inc()
        self.link.ok()
        lease.granted(float(granted), float(level), self._now())
        if lease.owed > 0 and self.leases.get(key) is lease:
            # Credit given while this call was on its way that its slice could not pay:
            # charge it now, off the path, rather than at the tenant's next request here.
            self._start_fetch(key, lease, lease.last_cost, ahead=True)
        return True

    # -- giving back ----------------------------------------------------------------------

    def _give_back_later(self, key: str, lease: Lease) -> None:
        tokens = lease.release()
        if tokens > 0:  # the loop keeps only weak references to tasks: hold this one
            task = asyncio.create_task(self._give(key, lease, tokens))
            self._giving.add(task)
            task.add_done_callback(self._giving.discard)

    async def _give(self, key: str, lease: Lease, tokens: float) -> None:
        try:
            await self._script(keys=[key], args=[lease.rate, lease.burst, tokens, 0, 0,
                                                 EXPIRY_MARGIN_MS])
            self.link.metrics.operations.labels("ratelimit").inc()
            self.counts["give_back"] += 1
        except REDIS_ERRORS as exc:  # lost: the fleet admits less, never more
            self.link.failed("ratelimit", exc)

    async def sweep(self) -> int:
        """Give back the unspent rest of every lapsed slice, in one pipelined round trip
        (a busy instance holds slices of many tenants: one round trip each would wake this
        instance and Redis once per slice, every sweep); returns how many slices."""
        now = self._now()
        gives = []
        for key, lease in list(self.leases.items()):
            if key in self._fetching:
                continue
            tokens = lease.lapse(now)
            if tokens > 0:
                gives.append((key, lease, tokens))
        if not gives:
            return 0
        try:
            # The context gives the pipeline's connection back to the pool whatever happens
            # (a failed execute, or the script check it sends first, would otherwise keep
            # it, and a pool drained that way fails every later call).
            async with self.link.client.pipeline(transaction=False) as pipe:
                for key, lease, tokens in gives:
                    # Queued, not sent: execute sends them (loading the script if Redis
                    # lost it).
                    await self._script(keys=[key], args=[lease.rate, lease.burst, tokens, 0,
                                                         0, EXPIRY_MARGIN_MS], client=pipe)
                await pipe.execute()
        except REDIS_ERRORS as exc:  # lost: the fleet admits less, never more
            self.link.failed("ratelimit", exc)
            return 0
        self.link.metrics.operations.labels("ratelimit").inc(len(gives))
        self.counts["give_back"] += len(gives)
        return len(gives)

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(self.ttl_s / 2)
            if self.link.usable():
                await self.sweep()

    def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="shared-state-leases")

    async def stop(self, timeout_s: float = 1.0) -> None:
        """Stop sweeping and give every slice's unspent tokens back."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.wait([self._sweeper], timeout=timeout_s)
            self._sweeper = None
        for task in list(self._fetching.values()):
            task.cancel()
        if not self.link.usable():
            return
        gives = [(key, lease, lease.release()) for key, lease in self.leases.items()]
        try:
            await asyncio.wait_for(asyncio.gather(*(self._give(k, lease, tokens)
                                                    for k, lease, tokens in gives
                                                    if tokens > 0)), timeout_s)
        except asyncio.TimeoutError:
            pass
