"""A slice of a fleet-wide token bucket, held by one instance and spent locally: a lease.

Asking Redis on every request puts a round trip on every request's path: 0.2-0.3 ms on an
idle loopback, several milliseconds on a busy host. Instead an instance takes a *slice* of the
tenant's bucket in one atomic step (the Lua script in
:mod:`~prefixroute.edges.shared_state.ratelimit`) and spends it locally, request by request;
what it has not spent when the lease lapses (``ttl_s``) goes back to the bucket.

**The bound is the single bucket's.** Every token an instance spends was taken from the fleet
bucket, and a token given back was taken and not spent, so the tokens the whole fleet spends
from the bucket's creation to time t are at most ``burst + rate * t``: exactly what one
bucket allows, whatever the number of instances, their clocks or their crashes (a crashed
instance's slice is lost, never spent twice). Leasing changes only *when* a token is spent: a
slice taken at t may be spent until t + ``ttl_s``, so a short window that opens with every
instance holding a full slice can see up to ``instances * slice`` more than
``burst + rate * window``. The slice is therefore small: at most a quarter of the burst and a
quarter second of the rate (:data:`LEASE_SHARE`, :data:`LEASE_S`), never less than the request
at hand.

**What is left on a request's path.** A request the slice covers costs no round trip. When
the slice runs low, the next one is fetched in the background (:meth:`Lease.wants_prefetch`),
but only when a slice holds at least two requests: a slice of one request fetched ahead of
need would sit on the fleet's only token while another instance's request is refused. A
refusal is remembered: Redis answers with the bucket's level, and since the other instances
only take from the bucket meanwhile (slices given back aside), until that level could have
refilled to the request's cost at the tenant's rate the answer is known, and this instance
refuses locally with the same Retry-After (:meth:`Lease.known_wait`). So a round trip is left
on the path only when a request finds its slice empty, the bucket may hold its cost and no
credit applies (below): about once per refill interval for a tenant above its limit.

**Admission on credit.** A tenant well within its limit, seen rarely by each instance (many
tenants, several instances), would still find its slice empty or lapsed at almost every
request. When this instance estimates the fleet bucket at least half full beyond the request
(from Redis's last answer plus the refill since, or full when it never asked), it admits the
request at once and charges it with the next fetch, started in the background, or pays it
from the slice of a fetch already on its way (:meth:`Lease.may_admit_on_credit`,
:meth:`Lease.granted`): a tenant's first request at an instance finds its prompt-token
slice being fetched (it was asked for before the prompt was tokenized) and would otherwise
wait for that round trip, which on a busy host is the slowest part of its path. One
request at a time per instance: until that charge is paid, the next request waits for it. The charge is taken even from an emptied bucket (it
goes below zero and refills from there), so the fleet's long-run rate is unchanged; what
credit adds to the bound is at most one request per instance, and only while the bucket was
estimated half full: a request limit with a burst of 1, or a tenant at its limit, never gets
credit.

Pure: no I/O; time comes in the calls.
"""

from __future__ import annotations

import math

LEASE_S = 0.25  # a slice covers at most a quarter second of the tenant's rate ...
LEASE_SHARE = 0.25  # ... and at most a quarter of its burst
LEASE_TTL_S = 2.0  # a slice's unspent tokens go back to the fleet bucket after this


class Lease:
    """This instance's slice of one fleet bucket (``rate`` tokens a second up to ``burst``).

    ``tokens``: what the slice still holds; spendable until ``expires_at``.
    """

    def __init__(self, rate: float, burst: float, ttl_s: float = LEASE_TTL_S):
        if rate <= 0 or burst <= 0:
            raise ValueError(f"a bucket needs a positive rate and burst, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self.ttl_s = ttl_s
        self.tokens = 0.0
        self.expires_at = -math.inf
        self.last_cost = 1.0  # the last request's cost: what a fetch ahead of one asks for
        self.owed = 0.0  # admitted on credit, not yet charged to the fleet bucket
        self.charging = 0.0  # credit charged by a script call not answered yet
        # The fleet bucket's level after the last answer from Redis, and when it came.
        self._level: float | None = None
        self._level_at = 0.0

    def slice(self, cost: float) -> float:
        """How many tokens to hold for a request of ``cost``."""
        return max(cost, min(self.burst * LEASE_SHARE, self.rate * LEASE_S))

    def spend(self, cost: float, now: float) -> bool:
        """Take ``cost`` from the slice if it holds that much and has not lapsed."""
        if now < self.expires_at and self.tokens >= cost:
            self.tokens -= cost
            return True
        return False

    def refund(self, cost: float) -> None:
        """Put back what :meth:`spend` took (a request refused by another of its limits)."""
        self.tokens += cost

    def wants_prefetch(self, cost: float) -> bool:
        """Fetch the next slice now, off the path: the slice holds at least two requests of
        ``cost`` and less than half of it is left."""
        whole = self.slice(cost)
        return whole >= 2 * cost and self.tokens < whole / 2

    def request(self, cost: float, now: float, ahead: bool = False,
                demand: float = 0.0) -> tuple[float, float]:
        """``(need, want)`` to ask the bucket for: at least ``need`` or nothing, up to
        ``want`` (a full slice, or more when the requests waiting for this answer, ``demand``
        in all, need more: many at once on a small slice would otherwise see one answer
        after another go to the others). Now: the slice must cover ``cost``; ``ahead`` (a
        prefetch): it must gain at least one more ``cost``."""
        held = self.tokens if now < self.expires_at else 0.0
        need = cost if ahead else max(0.0, cost - held)
        return need, max(need, self.slice(cost) - held, demand - held)

    def granted(self, tokens: float, level: float, now: float) -> None:
        """Redis gave ``tokens`` and left the bucket at ``level``. Credit given while the
        answer was on its way (the fetch had been sent before it) is paid from the slice
        it brings; what the slice cannot pay stays owed, and the limiter charges it with a
        call of its own."""
        if tokens > 0:
            if now >= self.expires_at:
                self.tokens = 0.0
            self.tokens += tokens
            self.expires_at = now + self.ttl_s
            paid = min(self.owed, self.tokens)
            self.tokens -= paid
            self.owed -= paid
        self._level = level
        self._level_at = now

    def known_wait(self, cost: float, now: float) -> float:
        """Seconds the fleet bucket is known to need before it, with the slice, could cover
        ``cost`` (from Redis's last answer and the rate); 0.0: it may already, ask Redis.
        ``math.inf`` for a cost above the burst, which no bucket state ever covers."""
        if cost > self.burst:
            return math.inf
        if self._level is None:
            return 0.0
        held = self.tokens if now < self.expires_at else 0.0
        level = min(self.burst, self._level + (now - self._level_at) * self.rate)
        short = cost - held - level
        return short / self.rate if short > 1e-9 else 0.0

    def estimated_level(self, now: float) -> float:
        """The fleet bucket's level as far as this instance knows: Redis's last answer plus
        the refill since, less what it owes or is charging; full when it never asked."""
        unpaid = self.owed + self.charging
        if self._level is None:
            return self.burst - unpaid
        return min(self.burst, self._level + (now - self._level_at) * self.rate) - unpaid

    def may_admit_on_credit(self, cost: float, now: float) -> bool:
        """Admit ``cost`` now and charge it later: nothing owed or being charged (so at most
        one request per instance is uncharged at any time), and the bucket estimated at least
        half full beyond it."""
        return (self.owed == 0 and self.charging == 0
                and self.estimated_level(now) - cost >= self.burst / 2)

    def credit(self, cost: float) -> None:
        self.owed += cost

    def lapse(self, now: float) -> float:
        """The unspent tokens of a lapsed slice, to give back; the slice is then empty."""
        if self.tokens > 0 and now >= self.expires_at:
            tokens, self.tokens = self.tokens, 0.0
            return tokens
        return 0.0

    def release(self) -> float:
        """Every unspent token, to give back (this instance stops)."""
        tokens, self.tokens = self.tokens, 0.0
        self.expires_at = -math.inf
        return tokens
