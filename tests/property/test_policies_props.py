"""Invariants of the routing policies, over random fleets and traces (hypothesis).

* every policy answers with an index from the candidates it was given, also when the candidates
  are a subset of the fleet with gaps in their indices;
* a policy built twice with the same seed makes the same decisions on the same input;
* hybrid's assignment skew never exceeds ``max_skew + 1`` on any trace.

Covers the three baseline policies and the five of this module set; the peer-router policies
carry their own tests.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy
from prefixroute.core.routing.skewed_trace import run_skewed_trace

POLICIES = ["round_robin", "random", "least_loaded", "power_of_two", "consistent_hash",
            "prefix_hash", "affinity_only", "hybrid", "hybrid:max_skew=0",
            "consistent_hash:bounded=false", "prefix_hash:prefix_blocks=2",
            "prefix_hash:prefix_tokens=8,hash_token_ids=true"]

KEYS = st.sampled_from(["k0", "k1", "k2", "k3", "k4", "k5"])


class HeldKeys:
    def __init__(self, keys):
        self.keys = set(keys)

    def match(self, keys) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n


@st.composite
def replica_sets(draw):
    """A non-empty candidate set: distinct indices in 0..11 (gaps allowed), random loads,
    assignments and cached keys; given in a random order."""
    indices = draw(st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    views = [ReplicaView(index=i, in_flight=draw(st.integers(0, 20)),
                         assignments=draw(st.integers(0, 30)),
                         cache=HeldKeys(draw(st.lists(KEYS, max_size=4))))
             for i in indices]
    return draw(st.permutations(views))


@st.composite
def requests(draw, number=0):
    keys = draw(st.lists(KEYS, max_size=5))
    block_size = draw(st.sampled_from([1, 4, 16]))
    tokens = draw(st.one_of(st.none(), st.lists(st.integers(0, 50), min_size=1, max_size=40)))
    routing_key = draw(st.one_of(st.none(), st.sampled_from(["s1", "s2", "s3"])))
    return RequestView(request_id=f"r{number}", num_tokens=max(1, len(keys) * block_size),
                       block_size=block_size, block_keys=keys, token_ids=tokens,
                       routing_key=routing_key)


@settings(max_examples=150, deadline=None)
@given(spec=st.sampled_from(POLICIES), seed=st.integers(0, 1000),
       steps=st.lists(st.tuples(requests(), replica_sets()), min_size=1, max_size=8))
def test_every_policy_answers_with_a_candidate_index(spec, seed, steps):
    policy = create_policy(spec, seed=seed)
    for request, replicas in steps:
        decision = policy.route(request, replicas)
        assert decision.replica in {r.index for r in replicas}
        policy.on_routed(request, decision)


@settings(max_examples=100, deadline=None)
@given(spec=st.sampled_from(POLICIES), seed=st.integers(0, 1000),
       steps=st.lists(st.tuples(requests(), replica_sets()), min_size=1, max_size=8))
def test_same_seed_same_decisions(spec, seed, steps):
    first, second = create_policy(spec, seed=seed), create_policy(spec, seed=seed)
    for request, replicas in steps:
        a, b = first.route(request, replicas), second.route(request, replicas)
        assert (a.replica, a.branch) == (b.replica, b.branch)
        first.on_routed(request, a)
        second.on_routed(request, b)


@settings(max_examples=150, deadline=None)
@given(arrivals=st.text(alphabet="ABCDEF", min_size=1, max_size=60),
       replicas=st.integers(1, 5), capacity=st.integers(0, 4), max_skew=st.integers(0, 4))
def test_hybrid_skew_never_exceeds_max_skew_plus_one(arrivals, replicas, capacity, max_skew):
    lengths = {family: 100 * (i + 1) for i, family in enumerate("ABCDEF")}
    run = run_skewed_trace("hybrid", arrivals=arrivals, lengths=lengths, replicas=replicas,
                             capacity=capacity, max_skew=max_skew)
    assert run["peak_assignment_skew"] <= max_skew + 1
    assert sum(run["assignments"]) == len(arrivals)


@settings(max_examples=100, deadline=None)
@given(arrivals=st.text(alphabet="ABCD", min_size=1, max_size=40),
       spec=st.sampled_from(POLICIES))
def test_skewed_trace_replay_accounts_for_every_prompt_token(arrivals, spec):
    lengths = {"A": 1000, "B": 800, "C": 600, "D": 400}
    run = run_skewed_trace(spec, arrivals=arrivals, lengths=lengths)
    total = sum(lengths[family] for family in arrivals)
    assert run["reused_prefix_tokens"] + run["fresh_prefill_tokens"] == total
    assert run["max_assignment_skew"] <= run["peak_assignment_skew"]
