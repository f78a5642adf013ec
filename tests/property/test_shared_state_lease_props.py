"""Invariant of leased rate limits: however requests fall over the instances, and whatever
slices lapse and go back, the fleet never spends more than one bucket allows,
burst + rate x elapsed, plus at most one request per instance admitted on credit
(edges/shared_state/lease.py).

The fleet bucket here is a model of the Lua script in edges/shared_state/ratelimit.py (refill,
give back, grant at least ``need`` up to ``want`` or nothing); the script itself is exercised
against a real Redis in tests/integration/test_shared_state_redis.py.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.edges.shared_state.lease import Lease


class BucketModel:
    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens, self.at = burst, 0.0

    def call(self, now: float, give: float, need: float, want: float) -> tuple[float, float]:
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens = min(self.burst, self.tokens + give)
        grant = 0.0
        if need > 0 and self.tokens >= need:
            grant = min(self.tokens, max(need, want))
            self.tokens -= grant
        return grant, self.tokens


def fetch(bucket: BucketModel, lease: Lease, cost: float, now: float, ahead: bool) -> None:
    give = lease.lapse(now) - lease.owed
    lease.owed = 0.0
    need, want = lease.request(cost, now, ahead)
    lease.granted(*bucket.call(now, give, need, want), now)


def take(bucket: BucketModel, lease: Lease, cost: float, now: float, answered: bool) -> bool:
    """What SharedRateLimiter does for one check. ``answered``: the fetch a credit started
    has its answer before this check (else the check waits for it: the same end)."""
    if lease.owed and answered:
        fetch(bucket, lease, cost, now, ahead=True)
    if lease.spend(cost, now):
        if lease.wants_prefetch(cost):
            fetch(bucket, lease, cost, now, ahead=True)
        return True
    wait = lease.known_wait(cost, now)
    if wait == 0 and lease.may_admit_on_credit(cost, now):
        lease.credit(cost)  # its fetch is answered later (or awaited by the next check)
        return True
    if wait > 0:
        return False
    if lease.owed:  # the next check waits for the credit's fetch
        fetch(bucket, lease, cost, now, ahead=True)
        if lease.spend(cost, now):
            return True
        if lease.known_wait(cost, now) > 0:
            return False
    fetch(bucket, lease, cost, now, ahead=False)
    return lease.spend(cost, now)


@settings(max_examples=200, deadline=None)
@given(rate=st.sampled_from([1.0, 10.0, 100.0, 5000.0]),
       burst_seconds=st.sampled_from([0.1, 1.0, 2.0]),
       instances=st.integers(1, 6),
       steps=st.lists(st.tuples(st.floats(0.0, 0.5), st.integers(0, 5), st.floats(0.05, 1.0),
                                st.booleans(), st.booleans()), min_size=1, max_size=300))
def test_the_fleet_spends_at_most_one_bucket_s_worth_and_a_credit_each(rate, burst_seconds,
                                                                       instances, steps):
    burst = max(1.0, rate * burst_seconds)
    bucket = BucketModel(rate, burst)
    leases = [Lease(rate, burst, ttl_s=1.0) for _ in range(instances)]
    now = spent = largest = 0.0
    for dt, who, size, sweep, answered in steps:
        now += dt
        cost = max(1.0, round(size * burst))
        lease = leases[who % instances]
        if take(bucket, lease, cost, now, answered):
            spent += cost
            largest = max(largest, cost)
        if sweep:  # the background sweep gives back every lapsed slice
            for other in leases:
                tokens = other.lapse(now)
                if tokens:
                    bucket.call(now, tokens, 0.0, 0.0)
        # Credit: at most one request per instance beyond the bucket, while it was half full.
        assert spent <= burst + rate * now + instances * largest + 1e-6
        assert all(lease.tokens >= 0 for lease in leases)
