"""Hand-checkable decisions of power_of_two, consistent_hash, prefix_hash, affinity_only, hybrid.

Replica views are built by hand: a load, an assignment count and a cache holding a set of block
keys. Each test states one behaviour and the number a reader can check.
"""

from __future__ import annotations

import hashlib
import math
import random

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy


class HeldKeys:
    """A cache view that holds exactly the given block keys."""

    def __init__(self, *keys):
        self.keys = set(keys)

    def match(self, keys) -> int:
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n


def replica(index, load=0, assignments=0, holds=()):
    return ReplicaView(index=index, in_flight=load, assignments=assignments,
                       cache=HeldKeys(*holds))


def request(keys=("k0",), routing_key=None, tokens=None, block_size=16, rid="r"):
    num_tokens = len(tokens) if tokens is not None else len(keys) * block_size
    return RequestView(request_id=rid, num_tokens=num_tokens, block_size=block_size,
                       block_keys=list(keys), token_ids=tokens, routing_key=routing_key)


# -- power_of_two ------------------------------------------------------------------------------

def test_power_of_two_with_two_replicas_always_takes_the_lighter_one():
    policy = create_policy("power_of_two", seed=5)
    views = [replica(0, load=3), replica(1, load=1)]
    assert {policy.route(request(), views).replica for _ in range(20)} == {1}


def test_power_of_two_compares_the_two_candidates_its_seeded_draw_names():
    # The policy draws random.Random(seed).sample(range(n), 2); loads 4, 3, 2, 1 make the higher
    # index of the pair win every time.
    rng = random.Random(11)
    policy = create_policy("power_of_two", seed=11)
    views = [replica(i, load=4 - i) for i in range(4)]
    for _ in range(10):
        pair = rng.sample(range(4), 2)
        decision = policy.route(request(), views)
        assert decision.replica == max(pair)
        assert set(decision.scores) == set(pair)


def test_power_of_two_never_picks_the_single_most_loaded_replica():
    policy = create_policy("power_of_two", seed=0)
    views = [replica(0, load=1), replica(1, load=9), replica(2, load=2)]
    assert all(policy.route(request(), views).replica != 1 for _ in range(50))


def test_power_of_two_ties_go_to_the_lower_index():
    policy = create_policy("power_of_two", seed=3)
    views = [replica(4, load=2), replica(7, load=2)]
    assert policy.route(request(), views).replica == 4


def test_power_of_two_with_one_candidate_returns_it():
    policy = create_policy("power_of_two")
    assert policy.route(request(), [replica(6, load=9)]).replica == 6


# -- consistent_hash ---------------------------------------------------------------------------

def test_consistent_hash_sends_one_session_to_one_replica():
    policy = create_policy("consistent_hash")
    views = [replica(i) for i in range(4)]
    first = policy.route(request(routing_key="session-42"), views).replica
    assert all(policy.route(request(keys=(f"other{i}",), routing_key="session-42"),
                            views).replica == first for i in range(10))


def test_consistent_hash_without_routing_key_uses_the_first_block_key():
    policy = create_policy("consistent_hash")
    views = [replica(i) for i in range(4)]
    a = policy.route(request(keys=("system", "tenant-a", "turn-1")), views).replica
    b = policy.route(request(keys=("system", "tenant-b", "turn-7")), views).replica
    assert a == b
    assert policy.route(request(keys=("system",)), views).branch == "ring"


def test_consistent_hash_removing_a_replica_moves_only_its_keys():
    policy = create_policy("consistent_hash", bounded=False)
    five = [replica(i) for i in range(5)]
    four = [r for r in five if r.index != 2]
    moved_from_others = 0
    owned_by_2 = 0
    for k in range(1000):
        req = request(routing_key=f"session-{k}")
        before = policy.route(req, five).replica
        after = policy.route(req, four).replica
        if before == 2:
            owned_by_2 += 1
            assert after != 2
        elif after != before:
            moved_from_others += 1
    assert moved_from_others == 0
    assert 100 < owned_by_2 < 300  # about 1/5 of 1,000 keys with 160 points per replica


def test_consistent_hash_keys_spread_over_every_replica():
    policy = create_policy("consistent_hash", bounded=False)
    views = [replica(i) for i in range(4)]
    counts = [0] * 4
    for k in range(2000):
        counts[policy.route(request(routing_key=f"s{k}"), views).replica] += 1
    assert min(counts) > 2000 / 4 * 0.7  # 160 virtual nodes: each share within 30% of 500


def _home(policy, key, views):
    return policy.route(request(routing_key=key), [replica(r.index) for r in views]).replica


def test_consistent_hash_walks_past_a_full_home_replica():
    # 4 replicas, 8 requests in flight: capacity = ceil(1.25 * (8 + 1) / 4) = ceil(2.8125) = 3.
    policy = create_policy("consistent_hash")
    idle = [replica(i) for i in range(4)]
    home = _home(policy, "hot-session", idle)
    others = [i for i in range(4) if i != home]
    loads = {home: 3, others[0]: 2, others[1]: 2, others[2]: 1}
    decision = policy.route(request(routing_key="hot-session"),
                            [replica(i, load=loads[i]) for i in range(4)])
    assert decision.branch == "bounded_walk"
    assert decision.replica != home
    assert decision.scores[home] == {"load": 3.0, "capacity": 3.0}


def test_consistent_hash_stays_home_while_the_home_has_room():
    # 7 in flight: capacity = ceil(1.25 * 8 / 4) = ceil(2.5) = 3; home at 2 may take a third.
    policy = create_policy("consistent_hash")
    home = _home(policy, "hot-session", [replica(i) for i in range(4)])
    others = [i for i in range(4) if i != home]
    loads = {home: 2, others[0]: 2, others[1]: 2, others[2]: 1}
    decision = policy.route(request(routing_key="hot-session"),
                            [replica(i, load=loads[i]) for i in range(4)])
    assert (decision.replica, decision.branch) == (home, "ring")


def test_consistent_hash_bounded_loads_never_exceed_ceil_c_times_mean():
    # One hot key, requests never finish: after m requests no replica holds more than
    # ceil(1.25 * m / 4).
    policy = create_policy("consistent_hash")
    loads = [0] * 4
    for m in range(1, 101):
        views = [replica(i, load=loads[i]) for i in range(4)]
        loads[policy.route(request(routing_key="hot"), views).replica] += 1
        assert max(loads) <= math.ceil(1.25 * m / 4)
    assert max(loads) == 32  # ceil(1.25 * 100 / 4): the hot key fills replicas up to the bound


def test_consistent_hash_with_capacity_factor_one_balances_a_hot_key_exactly():
    # c = 1: capacity ceil((m + 1) / 4), so 100 requests of one key end 25 per replica.
    policy = create_policy("consistent_hash:capacity_factor=1")
    loads = [0] * 4
    for _ in range(100):
        views = [replica(i, load=loads[i]) for i in range(4)]
        loads[policy.route(request(routing_key="hot"), views).replica] += 1
    assert loads == [25, 25, 25, 25]


def test_consistent_hash_rejects_a_capacity_factor_below_one():
    with pytest.raises(ConfigError, match="capacity_factor"):
        create_policy("consistent_hash:capacity_factor=0.9")


# -- prefix_hash -------------------------------------------------------------------------------

def _spec_rule(tokens, n):
    return int(hashlib.md5(" ".join(tokens[:1280]).encode()).hexdigest(), 16) % n


def test_prefix_hash_reproduces_the_spec_prefix_aware_rule():
    # The worked examples' fleet: int(md5(' '.join(first 1,280 tokens)).hexdigest(), 16) % 4.
    policy = create_policy("prefix_hash:prefix_tokens=1280,hash_token_ids=true")
    views = [replica(i) for i in range(4)]
    for tenant in "ABCDEFGH":
        tokens = [f"sys{i}" for i in range(1200)] + [f"{tenant}{i}" for i in range(800)]
        assert policy.route(request(tokens=tokens), views).replica == _spec_rule(tokens, 4)


def test_prefix_hash_ignores_everything_after_the_prefix():
    policy = create_policy("prefix_hash:prefix_blocks=2")
    views = [replica(i) for i in range(8)]
    a = policy.route(request(keys=("b0", "b1", "x2", "x3")), views).replica
    b = policy.route(request(keys=("b0", "b1", "y2")), views).replica
    assert a == b


def test_prefix_hash_default_covers_64_tokens():
    policy = create_policy("prefix_hash")
    assert policy.blocks_hashed(16) == 4  # 64 / 16
    assert policy.blocks_hashed(512) == 1  # a Mooncake block is longer than the prefix
    views = [replica(i) for i in range(8)]
    keys = [f"b{i}" for i in range(4)]
    a = policy.route(request(keys=keys + ["tail-a"]), views).replica
    b = policy.route(request(keys=keys + ["tail-b", "tail-c"]), views).replica
    assert a == b


def test_prefix_hash_takes_the_slot_among_candidates_sorted_by_index():
    # Candidates 3, 5, 9: the hash modulo 3 picks position 0, 1 or 2 of that list.
    policy = create_policy("prefix_hash:prefix_tokens=1280,hash_token_ids=true")
    tokens = [f"t{i}" for i in range(100)]
    views = [replica(9), replica(3), replica(5)]
    assert policy.route(request(tokens=tokens), views).replica == [3, 5, 9][_spec_rule(tokens, 3)]


def test_prefix_hash_without_a_prefix_takes_the_least_loaded_replica():
    policy = create_policy("prefix_hash")
    decision = policy.route(request(keys=()), [replica(0, load=2), replica(1, load=1)])
    assert (decision.replica, decision.branch) == (1, "no_prefix")


def test_prefix_hash_rejects_a_zero_prefix():
    with pytest.raises(ConfigError, match="prefix_tokens"):
        create_policy("prefix_hash:prefix_tokens=0")


# -- affinity_only -----------------------------------------------------------------------------

def test_affinity_only_picks_the_holder_with_fewest_assignments():
    policy = create_policy("affinity_only")
    views = [replica(0, assignments=1), replica(1, assignments=9, holds=["A"]),
             replica(2, assignments=5, holds=["A"])]
    decision = policy.route(request(keys=["A"], block_size=1000), views)
    assert (decision.replica, decision.branch) == (2, "affinity")


def test_affinity_only_predicts_no_more_than_the_engine_serves_from_cache():
    # 3 blocks of 16 tokens, all held: the engine recomputes the 48th token, so at most
    # floor(47 / 16) = 2 blocks, 32 tokens, come from cache (as every other policy predicts).
    views = [replica(0, holds=["b0", "b1", "b2"])]
    for name in ("affinity_only", "hybrid"):
        decision = create_policy(name).route(request(keys=["b0", "b1", "b2"]), views)
        assert (decision.branch, decision.predicted_cached_tokens) == ("affinity", 32)


def test_affinity_only_on_a_miss_picks_the_least_assigned_lowest_index():
    policy = create_policy("affinity_only")
    views = [replica(0, assignments=3), replica(1, assignments=2), replica(2, assignments=2)]
    decision = policy.route(request(keys=["Z"]), views)
    assert (decision.replica, decision.branch) == (1, "miss_least_assigned")


def test_affinity_only_prefers_the_longest_match_over_fewer_assignments():
    policy = create_policy("affinity_only")
    views = [replica(0, assignments=0, holds=["b0"]),
             replica(1, assignments=8, holds=["b0", "b1", "b2"])]
    assert policy.route(request(keys=["b0", "b1", "b2", "b3"]), views).replica == 1


def test_affinity_only_holder_ties_go_to_the_lowest_index():
    policy = create_policy("affinity_only")
    views = [replica(5, assignments=2, holds=["A"]), replica(3, assignments=2, holds=["A"])]
    assert policy.route(request(keys=["A"]), views).replica == 3


# -- hybrid ------------------------------------------------------------------------------------

def test_hybrid_takes_a_holder_at_exactly_least_plus_max_skew():
    # least = 4, max_skew = 1: a holder with 5 assignments is allowed.
    policy = create_policy("hybrid")
    views = [replica(0, assignments=4), replica(1, assignments=5, holds=["A"])]
    decision = policy.route(request(keys=["A"]), views)
    assert (decision.replica, decision.branch) == (1, "affinity")


def test_hybrid_refuses_a_holder_above_least_plus_max_skew():
    # least = 4, max_skew = 1: a holder with 6 assignments loses to the least-assigned replica.
    policy = create_policy("hybrid")
    views = [replica(0, assignments=6, holds=["A"]), replica(1, assignments=4),
             replica(2, assignments=4)]
    decision = policy.route(request(keys=["A"]), views)
    assert (decision.replica, decision.branch) == (1, "skew_cap")


def test_hybrid_with_max_skew_zero_only_follows_holders_tied_for_least():
    policy = create_policy("hybrid:max_skew=0")
    views = [replica(0, assignments=3), replica(1, assignments=4, holds=["A"])]
    assert policy.route(request(keys=["A"]), views).replica == 0
    views = [replica(0, assignments=3), replica(1, assignments=3, holds=["A"])]
    assert policy.route(request(keys=["A"]), views).replica == 1


def test_hybrid_prefers_a_shorter_match_within_the_cap_to_a_cold_replica():
    policy = create_policy("hybrid")
    views = [replica(0, assignments=0), replica(1, assignments=1, holds=["b0"]),
             replica(2, assignments=9, holds=["b0", "b1"])]
    decision = policy.route(request(keys=["b0", "b1"]), views)
    assert (decision.replica, decision.predicted_cached_tokens) == (1, 16)


def test_hybrid_rejects_a_negative_max_skew():
    with pytest.raises(ConfigError, match="max_skew"):
        create_policy("hybrid:max_skew=-1")
