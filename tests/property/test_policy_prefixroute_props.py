"""Invariants of ``prefixroute`` over random fleets and request streams.

The decision always names one of the offered candidates (also when candidate indices have
gaps, change between requests, or replicas report nothing), its scores cover exactly the
candidates, the predicted hit never exceeds what the engine could reuse, and two fresh
policies make the same decisions on the same stream (the policy has no randomness).
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy
from tests.helpers.policy_views import CountingCache

BLOCK = 4
SPECS = ["prefixroute",
         # the options off by default, so their branches are exercised too
         "prefixroute:replicate=true,balance_cap=1.25,max_copy=1",
         "prefixroute:externality=false,learn_speed=false,feedback=false,follow_inflight=false,"
         "survival_width=0,tie_tolerance=0,tie_s=0"]


replica_st = st.fixed_dictionaries({
    "load": st.integers(0, 60), "running": st.integers(0, 30),
    "kv_usage": st.floats(0.0, 1.0), "pending": st.integers(0, 5000),
    "capacity": st.sampled_from([0, 4, 16, 1000]), "held": st.integers(0, 8),
    "rate": st.sampled_from([None, 1e-5, 1e-3]),
})

step_st = st.fixed_dictionaries({
    # candidate indices: any non-empty subset of 0..11, so gaps are common
    "indices": st.sets(st.integers(0, 11), min_size=1, max_size=6),
    "replicas": st.lists(replica_st, min_size=6, max_size=6),
    "family": st.integers(0, 3),
    "shared": st.integers(0, 8),
    "fresh": st.integers(0, 4),
    "extra": st.integers(0, BLOCK - 1),
    "dt": st.floats(0.0, 20.0),
    "complete": st.booleans(),
    "reported": st.integers(0, 40),
})


def build(step, i, now):
    keys = tuple(("fam", step["family"], j) for j in range(step["shared"])) + tuple(
        ("req", i, j) for j in range(step["fresh"]))
    num_tokens = max(1, len(keys) * BLOCK + step["extra"])
    request = RequestView(str(i), num_tokens, BLOCK, keys, now=now)
    views = []
    for index, fields in zip(sorted(step["indices"]), step["replicas"]):
        views.append(ReplicaView(index, in_flight=fields["load"], running=fields["running"],
                                 kv_usage=fields["kv_usage"],
                                 pending_prefill_tokens=fields["pending"],
                                 capacity_blocks=fields["capacity"],
                                 cache=CountingCache(fields["held"]),
                                 prefill_s_per_token=fields["rate"]))
    return request, views


def run(spec, steps):
    policy = create_policy(spec, seed=0, num_replicas=12, block_size=BLOCK)
    now = 0.0
    out = []
    for i, step in enumerate(steps):
        now += step["dt"]
        request, views = build(step, i, now)
        decision = policy.route(request, views)
        policy.on_routed(request, decision)
        if step["complete"]:
            policy.on_completed(request, decision.replica, step["reported"] * BLOCK)
        out.append((decision, request, {v.index for v in views}))
    return out


@settings(max_examples=80, deadline=None)
@given(spec=st.sampled_from(SPECS), steps=st.lists(step_st, min_size=1, max_size=30))
def test_every_decision_names_an_offered_candidate(spec, steps):
    for decision, request, offered in run(spec, steps):
        assert decision.replica in offered
        assert isinstance(decision.branch, str) and decision.branch
        assert decision.reason
        assert set(decision.scores) == offered
        limit = max(0, (request.num_tokens - 1) // BLOCK) * BLOCK
        assert 0 <= decision.predicted_cached_tokens <= limit
        for score in decision.scores.values():
            assert score["cost_s"] >= 0
            assert 0 <= score["expected_cached_tokens"] <= limit


@settings(max_examples=50, deadline=None)
@given(spec=st.sampled_from(SPECS), steps=st.lists(step_st, min_size=1, max_size=25))
def test_same_stream_same_decisions(spec, steps):
    first = [(d.replica, d.branch, d.scores) for d, _, _ in run(spec, steps)]
    second = [(d.replica, d.branch, d.scores) for d, _, _ in run(spec, steps)]
    assert first == second
