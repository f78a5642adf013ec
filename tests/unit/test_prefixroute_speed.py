"""The prefill speed the default policy prices work at: one estimate per kind of replica,
held within twice its anchor (the stated speed, else the policy's 4e-5 s per token), so
queueing and machine noise learned as "speed" can neither run away nor tell two replicas
of one engine apart."""

import pytest

from prefixroute.core.routing.base import Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.prefixroute import PrefixRoute
from prefixroute.core.routing.policies.prefixroute.speed import SPEED_BAND, SpeedEstimate

ANCHOR = 4.0e-5   # the policy's default prefill_s_per_token
PRIOR = 8192      # the prior counts as one chunk of work done at the anchor: 0.32768 s


def test_the_band_is_twice_the_anchor_either_way():
    assert SPEED_BAND == 2.0


def test_a_learned_speed_inside_the_band_is_the_ratio_of_busy_time_to_work():
    speed = SpeedEstimate(ANCHOR, PRIOR, learns=True)
    # (0.32768 + 0.58192) s / (8,192 + 10,000) token-equivalents = 5.0e-5 s.
    speed.learn(0.58192, 10_000, forget=1.0)
    assert speed.value == pytest.approx(5.0e-5)


def test_busy_time_that_is_not_prefill_cannot_run_the_speed_away():
    speed = SpeedEstimate(ANCHOR, PRIOR, learns=True)
    # A first byte 0.3 s after dispatch for 211 token-equivalents of predicted work (a hit:
    # the engine's fixed work and others' decode steps in the wait), 50 times over:
    for _ in range(50):
        speed.learn(0.3, 211, forget=0.99)
    assert speed.unbounded > 9.0e-4   # 900 us per token, as the gateway once learned
    assert speed.value == pytest.approx(8.0e-5)   # held at twice the anchor


def test_nor_run_it_below_half_the_anchor():
    speed = SpeedEstimate(ANCHOR, PRIOR, learns=True)
    speed.learn(0.0, 100_000, forget=1.0)  # work credited with no time (a deeper hit)
    assert speed.value == pytest.approx(2.0e-5)


def test_a_stated_speed_is_kept():
    speed = SpeedEstimate(3.3e-5, PRIOR, learns=False)
    speed.learn(10.0, 1, forget=1.0)
    assert speed.value == 3.3e-5


def _request(rid, blocks, now, family):
    keys = tuple((family, i) for i in range(blocks))
    return RequestView(rid, blocks * 32, 32, keys, now=now)


class _Holds:
    """A cache view that confirms whatever the router believes."""

    def match(self, keys):
        return len(keys)


def test_two_replicas_of_one_engine_share_one_speed_and_cannot_drift_apart():
    """Replica 0 serves a hot tenant's cache hits (32 new tokens of 608), replica 1 cold
    608-token prompts; each has its previous request pending when the next comes, 0.3 s
    later (the first byte's fixed latency, alike for both). Learned per replica, each speed
    went to 0.3 s over its own work done: 1.7 ms per token for the hits, 0.34 ms for the
    cold prompts, so the replica holding the hot prefix looked five times slower."""
    policy = PrefixRoute()

    def fleet(pending):
        return [ReplicaView(i, capacity_blocks=1000, pending_prefill_tokens=pending[i],
                            cache=_Holds()) for i in (0, 1)]

    now, pending = 0.0, (0, 0)
    for k in range(40):
        hot = _request(f"h{k}", 19, now, "hot")
        policy.route(hot, fleet(pending))
        policy.on_routed(hot, Decision(0, "fixture"))
        cold = _request(f"c{k}", 19, now, f"cold{k}")
        policy.route(cold, fleet(pending))
        policy.on_routed(cold, Decision(1, "fixture"))
        now, pending = now + 0.3, (32 if k else 608, 608)
    scores = policy.route(_request("last", 1, now, "probe"), fleet(pending)).scores
    assert scores[0]["s_per_token"] == scores[1]["s_per_token"] == pytest.approx(2 * ANCHOR)
