"""Invariants of ``prefixroute`` over random fleets and request streams.

The decision always names one of the offered candidates (also when candidate indices have
gaps, change between requests, or replicas report nothing), its scores cover exactly the
candidates, the predicted hit never exceeds what the engine could reuse, and two fresh
policies make the same decisions on the same stream (the policy has no randomness). A
balance rule moves a request only within its bounds.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.policies.prefixroute.balance import (Candidate, ColdBalance,
                                                                  SessionMove)
from prefixroute.core.routing.registry import create_policy
from tests.helpers.policy_views import CountingCache

BLOCK = 4
SPECS = ["prefixroute",
         # the balance rules at any load, so their branches are exercised often
         "prefixroute:cold_rho_max=1,move_floor=0,survival_width=0",
         # no balance rules, no delay to others, no priority hints
         "prefixroute:move_cap=0,cold_cap=0,max_externality=0,priority_slack=0"]


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


candidate_st = st.builds(
    lambda index, cost, held, load, occupancy, long_load: Candidate(
        index, cost, held, load, occupancy, long_load),
    st.integers(0, 11), st.floats(0.0, 50.0), st.sampled_from([0.0, 16.0, 500.0, 1000.0]),
    st.sampled_from([0.0, 0.0, 1.0, 3.0]), st.floats(0.0, 1.0), st.floats(0.0, 100.0))


@settings(max_examples=200, deadline=None)
@given(candidates=st.lists(candidate_st, min_size=1, max_size=8,
                           unique_by=lambda c: c.index),
       cap=st.floats(1.0, 3.0), floor=st.floats(0.0, 1.0), max_s=st.floats(0.0, 20.0))
def test_a_session_moves_only_to_an_idle_replica_below_the_mean_within_max_s(
        candidates, cap, floor, max_s):
    chosen = min(candidates, key=lambda c: (c.cost_s, c.index))
    move = SessionMove(cap, floor, max_s, 300.0).move(chosen, candidates, 1000, 0.0)
    if move is None:
        return
    mean = sum(c.occupancy for c in candidates) / len(candidates)
    other = next(c for c in candidates if c.index == move.replica)
    assert chosen.occupancy > max(cap * mean, floor)
    assert other.load == 0 and other.occupancy < mean
    assert other.cost_s - chosen.cost_s <= max_s


@settings(max_examples=200, deadline=None)
@given(candidates=st.lists(candidate_st, min_size=1, max_size=8,
                           unique_by=lambda c: c.index),
       cap=st.floats(1.0, 3.0), free_share=st.floats(0.0, 1.0), cold_share=st.floats(0.0, 1.0))
def test_cold_balance_moves_only_a_cold_request_to_a_replica_below_the_cap(
        candidates, cap, free_share, cold_share):
    chosen = min(candidates, key=lambda c: (c.cost_s, c.index))
    best_hit = max(c.expected_cached_tokens for c in candidates)
    move = ColdBalance(cap, free_share, cold_share, 300.0).move(chosen, candidates, 1000,
                                                                best_hit)
    if move is None:
        return
    mean = sum(c.long_load_s for c in candidates) / len(candidates)
    other = next(c for c in candidates if c.index == move.replica)
    assert best_hit <= cold_share * 1000
    assert chosen.long_load_s > cap * mean >= other.long_load_s
    assert other.expected_cached_tokens >= chosen.expected_cached_tokens - free_share * 1000
