"""Invariants of the peer routers over random fleets and request streams.

For every peer policy: the decision names one of the offered candidates (also when the
candidate indices have gaps or change between requests), and two fresh policies built with the
same seed make the same decisions on the same stream.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy
from tests.helpers.policy_views import CountingCache

PEERS = ["sglang_cache_aware", "ray_prefix_affinity", "llmd_weighted", "dynamo_kv_cost",
         "aibrix_prefix_cache", "preble_e2",
         # the non-default variants, so their branches are exercised too
         "sglang_cache_aware:low_match=smallest_tree,max_tree_size=8,eviction_interval_secs=5",
         "ray_prefix_affinity:do_eviction=true,eviction_threshold_chars=8,"
         "eviction_target_chars=4,eviction_interval_secs=5",
         "llmd_weighted:prefix_source=precise,lru_capacity_per_server=4",
         "dynamo_kv_cost:router_temperature=0.5,use_kv_events=false",
         "aibrix_prefix_cache:load_gate=abs,block_number=6",
         "preble_e2:window_s=10,eviction_cost=false"]
BLOCK = 4


replica_st = st.fixed_dictionaries({
    "load": st.integers(0, 120), "queued": st.integers(0, 20),
    "kv_usage": st.floats(0.0, 1.0), "pending": st.integers(0, 500),
    "capacity": st.sampled_from([0, 4, 16, 1000]), "held": st.integers(0, 6),
    "rate": st.sampled_from([None, 1e-4, 1e-3]),
})

step_st = st.fixed_dictionaries({
    # candidate indices: any non-empty subset of 0..11, so gaps are common
    "indices": st.sets(st.integers(0, 11), min_size=1, max_size=6),
    "replicas": st.lists(replica_st, min_size=6, max_size=6),
    "family": st.integers(0, 3),
    "shared": st.integers(0, 6),
    "fresh": st.integers(0, 4),
    "with_tokens": st.booleans(),
    "output": st.one_of(st.none(), st.integers(0, 200)),
    "dt": st.floats(0.0, 8.0),
    "complete": st.booleans(),
})


def build(step, i, now):
    keys = tuple(("fam", step["family"], j) for j in range(step["shared"])) + tuple(
        ("req", i, j) for j in range(step["fresh"]))
    num_tokens = max(1, len(keys) * BLOCK + 1)
    tokens = None
    if step["with_tokens"]:
        tokens = [step["family"] * 1000 + j for j in range(step["shared"] * BLOCK)] + [
            -(i * 100 + j) for j in range(num_tokens - step["shared"] * BLOCK)]
    request = RequestView(str(i), num_tokens, BLOCK, keys, token_ids=tokens, now=now,
                          output_tokens_hint=step["output"])
    views = []
    for index, fields in zip(sorted(step["indices"]), step["replicas"]):
        views.append(ReplicaView(index, in_flight=fields["load"], queued=fields["queued"],
                                 kv_usage=fields["kv_usage"],
                                 pending_prefill_tokens=fields["pending"],
                                 capacity_blocks=fields["capacity"],
                                 cache=CountingCache(fields["held"]),
                                 prefill_s_per_token=fields["rate"]))
    return request, views


def run(spec, steps, seed):
    policy = create_policy(spec, seed=seed, num_replicas=12, block_size=BLOCK)
    now = 0.0
    out = []
    for i, step in enumerate(steps):
        now += step["dt"]
        request, views = build(step, i, now)
        decision = policy.route(request, views)
        policy.on_routed(request, decision)
        if step["complete"]:
            policy.on_completed(request, decision.replica, 0)
        out.append((decision, {v.index for v in views}))
    return out


@settings(max_examples=60, deadline=None)
@given(spec=st.sampled_from(PEERS), steps=st.lists(step_st, min_size=1, max_size=25),
       seed=st.integers(0, 2 ** 16))
def test_every_decision_names_an_offered_candidate(spec, steps, seed):
    for decision, offered in run(spec, steps, seed):
        assert decision.replica in offered
        assert isinstance(decision.branch, str) and decision.branch
        assert set(decision.scores) <= offered
        assert decision.predicted_cached_tokens >= 0


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(PEERS), steps=st.lists(step_st, min_size=1, max_size=20),
       seed=st.integers(0, 2 ** 16))
def test_same_seed_same_stream_same_decisions(spec, steps, seed):
    first = [(d.replica, d.branch, d.scores) for d, _ in run(spec, steps, seed)]
    second = [(d.replica, d.branch, d.scores) for d, _ in run(spec, steps, seed)]
    assert first == second
