"""Invariant of leased rate limits: however requests fall over the instances, and whatever
slices lapse and go back, the fleet never spends more than one bucket allows,
burst + rate x elapsed (edges/shared_state/lease.py).

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


def take(bucket: BucketModel, lease: Lease, cost: float, now: float) -> bool:
    """What SharedRateLimiter does for one check, with the round trip made at once."""
    if lease.spend(cost, now):
        if lease.wants_prefetch(cost):
            need, want = lease.request(cost, now, ahead=True)
            lease.granted(*bucket.call(now, lease.lapse(now), need, want), now)
        return True
    if lease.known_wait(cost, now) > 0:
        return False
    give = lease.lapse(now)
    need, want = lease.request(cost, now)
    lease.granted(*bucket.call(now, give, need, want), now)
    return lease.spend(cost, now)


@settings(max_examples=200, deadline=None)
@given(rate=st.sampled_from([1.0, 10.0, 100.0, 5000.0]),
       burst_seconds=st.sampled_from([0.1, 1.0, 2.0]),
       instances=st.integers(1, 6),
       steps=st.lists(st.tuples(st.floats(0.0, 0.5), st.integers(0, 5), st.floats(0.05, 1.0),
                                st.booleans()), min_size=1, max_size=300))
def test_the_fleet_spends_at_most_one_bucket_s_worth(rate, burst_seconds, instances, steps):
    burst = max(1.0, rate * burst_seconds)
    bucket = BucketModel(rate, burst)
    leases = [Lease(rate, burst, ttl_s=1.0) for _ in range(instances)]
    now = spent = 0.0
    for dt, who, size, sweep in steps:
        now += dt
        cost = max(1.0, round(size * burst))
        lease = leases[who % instances]
        if take(bucket, lease, cost, now):
            spent += cost
        if sweep:  # the background sweep gives back every lapsed slice
            for other in leases:
                tokens = other.lapse(now)
                if tokens:
                    bucket.call(now, tokens, 0.0, 0.0)
        assert spent <= burst + rate * now + 1e-6
        held = sum(lease.tokens for lease in leases)
        assert held >= 0 and bucket.tokens >= -1e-9
