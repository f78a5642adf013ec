"""The peer routers (SGLang, Ray Serve, llm-d, Dynamo, AIBrix, Preble), as specifications.

Each scenario is small enough to check by hand: the loads, the cached blocks and the expected
replica and branch are written out. ``prime`` tells a policy "this request went there" the way
a runner does after a decision (``on_routed``), so router-side trees fill without routing.
"""

from __future__ import annotations

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import Decision, ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy

B = 16  # block size in every scenario


def blocks(family: str, n: int, start: int = 0) -> list[tuple]:
    return [(family, i) for i in range(start, start + n)]


def req(keys, rid="r", now=0.0, token_ids=None, output=None, num_tokens=None):
    return RequestView(rid, num_tokens if num_tokens is not None else len(keys) * B, B,
                       tuple(keys), token_ids=token_ids, now=now, output_tokens_hint=output)


def prime(policy, replica: int, keys, rid="prime", now=0.0, token_ids=None, output=None):
    policy.on_routed(req(keys, rid, now, token_ids, output), Decision(replica, "primed"))


def reps(*loads, **fields):
    """Replicas 0..n-1 with these in-flight loads; keyword lists set other fields per replica."""
    out = []
    for i, load in enumerate(loads):
        extra = {k: v[i] for k, v in fields.items()}
        out.append(ReplicaView(i, in_flight=load, **extra))
    return out


class FakeCache:
    """A runner's cache view that believes ``n`` leading blocks are cached, of ``size`` total."""

    def __init__(self, n: int, size: int = 0):
        self.n, self.size = n, size

    def match(self, keys):
        return min(self.n, len(keys))

    def __len__(self):
        return self.size


# ---------------------------------------------------------------------------------------------
# SGLang cache_aware: cache_threshold 0.3, balance_abs_threshold 64, balance_rel_threshold 1.5
# ---------------------------------------------------------------------------------------------

def test_sglang_defaults_are_the_launcher_defaults():
    policy = create_policy("sglang_cache_aware")
    assert (policy.cache_threshold, policy.balance_abs_threshold,
            policy.balance_rel_threshold) == (0.3, 64, 1.5)
    assert (policy.eviction_interval_secs, policy.max_tree_size) == (120.0, 2 ** 26)
    assert policy.low_match == "min_load"


def test_sglang_imbalanced_load_goes_to_the_shortest_queue_despite_a_cache_hit():
    policy = create_policy("sglang_cache_aware")
    prime(policy, 0, blocks("A", 10))
    # 100 - 10 = 90 > 64 and 100 > 1.5 x 10 = 15: imbalanced
    decision = policy.route(req(blocks("A", 10)), reps(100, 10))
    assert (decision.replica, decision.branch) == (1, "imbalanced_shortest_queue")


def test_sglang_a_large_absolute_gap_alone_is_not_imbalance():
    policy = create_policy("sglang_cache_aware")
    prime(policy, 0, blocks("A", 10))
    # 300 - 230 = 70 > 64 but 300 <= 1.5 x 230 = 345: balanced, so the cache decides
    decision = policy.route(req(blocks("A", 10)), reps(300, 230))
    assert (decision.replica, decision.branch) == (0, "cache_hit")


def test_sglang_match_above_threshold_goes_to_the_matching_worker():
    policy = create_policy("sglang_cache_aware")
    prime(policy, 0, blocks("A", 10))
    # 5 of 10 blocks = 50% > 30%: replica 0, although replica 1 is less loaded
    decision = policy.route(req(blocks("A", 5) + blocks("new", 5)), reps(5, 4))
    assert (decision.replica, decision.branch) == (0, "cache_hit")
    assert decision.scores[0]["match_rate"] == 0.5
    assert decision.predicted_cached_tokens == 5 * B


def test_sglang_match_below_threshold_goes_to_the_least_loaded_worker():
    policy = create_policy("sglang_cache_aware")
    prime(policy, 0, blocks("A", 10))
    # 2 of 10 blocks = 20% <= 30%: least loaded (current source, PR #14650)
    decision = policy.route(req(blocks("A", 2) + blocks("new", 8)), reps(5, 4))
    assert (decision.replica, decision.branch) == (1, "low_match_min_load")


def test_sglang_legacy_low_match_rule_picks_the_smallest_tree():
    policy = create_policy("sglang_cache_aware:low_match=smallest_tree")
    prime(policy, 0, blocks("A", 10))   # tree sizes: replica 0 holds 10 blocks,
    prime(policy, 1, blocks("C", 3))    # replica 1 holds 3
    # 20% match; replica 0 is less loaded, but replica 1 has the smaller tree
    decision = policy.route(req(blocks("A", 2) + blocks("new", 8)), reps(4, 5))
    assert (decision.replica, decision.branch) == (1, "low_match_smallest_tree")


def test_sglang_matches_token_ids_when_the_router_has_them():
    policy = create_policy("sglang_cache_aware")
    prime(policy, 1, blocks("x", 1), token_ids=list(range(100)))
    tokens = list(range(50)) + list(range(1000, 1050))   # 50 of 100 tokens match
    decision = policy.route(req(blocks("y", 6), token_ids=tokens, num_tokens=100), reps(0, 0))
    assert (decision.replica, decision.branch) == (1, "cache_hit")
    assert decision.scores[1]["matched_units"] == 50
    assert decision.predicted_cached_tokens == 48   # whole 16-token blocks of the 50


def test_sglang_tenant_that_is_not_a_candidate_falls_back_to_the_first_healthy():
    policy = create_policy("sglang_cache_aware")
    prime(policy, 2, blocks("A", 10))
    decision = policy.route(req(blocks("A", 10)), reps(3, 0))   # replica 2 is not offered
    assert (decision.replica, decision.branch) == (0, "fallback_first_healthy")
    policy.on_routed(req(blocks("A", 10)), decision)
    assert policy.tree_size(0) == 0   # the source does not insert on this path


def test_sglang_evicts_least_recent_leaves_down_to_max_tree_size_every_interval():
    policy = create_policy("sglang_cache_aware:max_tree_size=5,eviction_interval_secs=10")
    policy.route(req(blocks("z", 1), now=0.0), reps(0))        # starts the eviction clock
    prime(policy, 0, blocks("A", 4) + blocks("B", 6), now=1.0)
    prime(policy, 0, blocks("A", 4) + blocks("C", 6), now=2.0)
    assert policy.tree_size(0) == 16                            # A(4) -> B(6), C(6)
    policy.route(req(blocks("z", 1), now=5.0), reps(0))         # 5 s < 10 s: no eviction
    assert policy.tree_size(0) == 16
    policy.route(req(blocks("z", 1), now=11.0), reps(0))        # evict 11: B then C go
    assert policy.tree_size(0) == 4


def test_sglang_rejects_an_unknown_low_match_rule():
    with pytest.raises(ConfigError):
        create_policy("sglang_cache_aware:low_match=random")


# ---------------------------------------------------------------------------------------------
# Ray Serve PrefixCacheAffinityRouter: imbalanced_threshold 10, match_rate_threshold 0.1
# ---------------------------------------------------------------------------------------------

def test_ray_defaults_are_initialize_state_defaults():
    policy = create_policy("ray_prefix_affinity")
    assert (policy.imbalanced_threshold, policy.match_rate_threshold) == (10, 0.1)
    assert (policy.do_eviction, policy.eviction_threshold_chars,
            policy.eviction_target_chars, policy.eviction_interval_secs) == (
        False, 400_000, 360_000, 10.0)


def test_ray_imbalanced_queues_fall_back_to_power_of_two():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 0, blocks("A", 10))
    # 15 - 2 = 13 > 10; with two replicas the pair is both, the shorter queue wins
    decision = policy.route(req(blocks("A", 10)), reps(15, 2))
    assert (decision.replica, decision.branch) == (1, "imbalanced_power_of_two")


def test_ray_a_gap_of_exactly_the_threshold_is_still_balanced():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 0, blocks("A", 10))
    decision = policy.route(req(blocks("A", 10)), reps(12, 2))   # 10 is not > 10
    assert (decision.replica, decision.branch) == (0, "prefix_match")


def test_ray_prefix_match_goes_to_the_holder():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 0, blocks("A", 10))
    decision = policy.route(req(blocks("A", 5) + blocks("new", 5)), reps(3, 0))
    assert (decision.replica, decision.branch) == (0, "prefix_match")
    assert decision.scores[0]["match_rate"] == 0.5


def test_ray_match_rate_equal_to_the_threshold_counts_as_a_match():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 1, blocks("A", 10))
    decision = policy.route(req(blocks("A", 1) + blocks("new", 9)), reps(0, 5))   # 1/10
    assert (decision.replica, decision.branch) == (1, "prefix_match")


def test_ray_several_holders_the_shortest_queue_wins():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 0, blocks("A", 10))
    prime(policy, 2, blocks("A", 10))
    decision = policy.route(req(blocks("A", 10)), reps(4, 0, 3))
    assert (decision.replica, decision.branch) == (2, "prefix_match")


def test_ray_weak_match_goes_to_the_smallest_trees_then_the_shortest_queue():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 0, blocks("A", 10))
    prime(policy, 1, blocks("B", 3))
    prime(policy, 2, blocks("C", 3))
    # no match: smallest trees are replicas 1 and 2 (3 blocks); replica 2 has the shorter queue
    decision = policy.route(req(blocks("new", 10)), reps(0, 2, 1))
    assert (decision.replica, decision.branch) == (2, "low_match_smallest_tree")


def test_ray_a_replica_that_leaves_the_candidates_loses_its_tree():
    policy = create_policy("ray_prefix_affinity")
    prime(policy, 1, blocks("A", 10))
    policy.route(req(blocks("x", 1)), reps(0, 0)[:1])   # replica 1 is gone (update_replicas)
    decision = policy.route(req(blocks("A", 10)), reps(0, 0))
    assert policy.tree_size(1) == 0
    assert decision.branch == "low_match_smallest_tree"


# ---------------------------------------------------------------------------------------------
# llm-d default profile: queue 2, kv-cache utilisation 2, prefix 3, max-score picker
# ---------------------------------------------------------------------------------------------

def test_llmd_defaults_are_the_default_profile_weights():
    policy = create_policy("llmd_weighted")
    assert (policy.queue_weight, policy.kv_cache_weight, policy.prefix_weight) == (2, 2, 3)
    assert (policy.max_prefix_blocks, policy.lru_capacity_per_server) == (256, 31250)


def test_llmd_queue_and_kv_scores_follow_the_scorer_formulas():
    policy = create_policy("llmd_weighted")
    replicas = reps(0, 0, 0, queued=[0, 5, 10], kv_usage=[0.5, 0.1, 0.0])
    decision = policy.route(req(blocks("A", 4)), replicas)
    # queue (max-q)/(max-min): 1.0, 0.5, 0.0; kv 1-usage: 0.5, 0.9, 1.0; no prefix yet
    assert [decision.scores[i]["queue"] for i in range(3)] == [1.0, 0.5, 0.0]
    assert [decision.scores[i]["kv_cache"] for i in range(3)] == [0.5, 0.9, 1.0]
    # totals: 2+1 = 3.0, 1+1.8 = 2.8, 0+2 = 2.0
    assert [round(decision.scores[i]["total"], 6) for i in range(3)] == [3.0, 2.8, 2.0]
    assert (decision.replica, decision.branch) == (0, "max_score")


def test_llmd_equal_queues_score_one_each():
    policy = create_policy("llmd_weighted")
    decision = policy.route(req(blocks("A", 4)), reps(0, 0, queued=[3, 3], kv_usage=[0.2, 0.0]))
    assert decision.scores[0]["queue"] == decision.scores[1]["queue"] == 1.0
    assert decision.replica == 1   # kv 0.8 vs 1.0


def test_llmd_prefix_score_is_matched_blocks_over_total_and_weighs_three():
    policy = create_policy("llmd_weighted")
    prime(policy, 2, blocks("A", 4))
    replicas = reps(0, 0, 0, queued=[0, 5, 10], kv_usage=[0.5, 0.1, 0.0])
    decision = policy.route(req(blocks("A", 2) + blocks("new", 2)), replicas)
    assert decision.scores[2]["prefix"] == 0.5
    # replica 2: 2 x 0 + 2 x 1.0 + 3 x 0.5 = 3.5 beats replica 0's 3.0
    assert decision.scores[2]["total"] == 3.5
    assert (decision.replica, decision.branch) == (2, "max_score")


def test_llmd_equal_top_scores_are_broken_at_random_among_the_leaders():
    policy = create_policy("llmd_weighted:seed=3")
    decision = policy.route(req(blocks("A", 4)), reps(0, 0, 0, kv_usage=[0.0, 0.0, 0.5]))
    assert decision.branch == "max_score_random_tiebreak"
    assert decision.replica in (0, 1)


def test_llmd_indexer_forgets_blocks_beyond_its_lru_capacity():
    policy = create_policy("llmd_weighted:lru_capacity_per_server=2,auto_tune=false")
    prime(policy, 0, blocks("A", 4))        # only A2, A3 stay; the walk stops at A0
    decision = policy.route(req(blocks("A", 4)), reps(0, 0))
    assert decision.scores[0]["prefix"] == 0.0


def test_llmd_auto_tune_sizes_the_lru_from_the_replica_capacity():
    policy = create_policy("llmd_weighted")
    policy.route(req(blocks("x", 1)), reps(0, capacity_blocks=[2]))   # replica 0: 2 blocks
    prime(policy, 0, blocks("A", 4))
    decision = policy.route(req(blocks("A", 4)), reps(0, capacity_blocks=[2]))
    assert decision.scores[0]["prefix"] == 0.0


def test_llmd_precise_prefix_reads_the_runners_cache_view():
    policy = create_policy("llmd_weighted:prefix_source=precise")
    replicas = reps(0, 0, cache=[FakeCache(0), FakeCache(3)])
    decision = policy.route(req(blocks("A", 4)), replicas)
    assert decision.scores[1]["prefix"] == 0.75
    assert decision.replica == 1


# ---------------------------------------------------------------------------------------------
# Dynamo KV router: cost = overlap_score_weight x prefill blocks + decode blocks
# ---------------------------------------------------------------------------------------------

def test_dynamo_defaults_are_kv_router_config_defaults():
    policy = create_policy("dynamo_kv_cost")
    assert (policy.overlap_score_weight, policy.router_temperature) == (1.0, 0.0)
    assert (policy.use_kv_events, policy.router_ttl_secs) == (True, 120.0)


def test_dynamo_lowest_cost_wins():
    policy = create_policy("dynamo_kv_cost")
    prime(policy, 1, blocks("other", 3), rid="busy")   # 3 active blocks on replica 1
    replicas = reps(0, 1, 0, cache=[FakeCache(6), FakeCache(0), FakeCache(8)],
                    pending_prefill_tokens=[0, 0, 160])
    decision = policy.route(req(blocks("A", 8)), replicas)   # 8 blocks, 128 tokens
    # replica 0: (128 - 96)/16 = 2 prefill + 8 decode = 10
    # replica 1: 128/16 = 8 prefill + (3 + 8) decode = 19
    # replica 2: (160 + 0)/16 = 10 prefill + 8 decode = 18
    assert [decision.scores[i]["logit"] for i in range(3)] == [10.0, 19.0, 18.0]
    assert (decision.replica, decision.branch) == (0, "lowest_cost")
    assert decision.predicted_cached_tokens == 96


def test_dynamo_blocks_already_active_on_a_worker_are_not_counted_twice():
    policy = create_policy("dynamo_kv_cost")
    prime(policy, 0, blocks("A", 5), rid="first")
    decision = policy.route(req(blocks("A", 8)), reps(1, 0))
    assert decision.scores[0]["decode_blocks"] == 8   # 5 active + 3 new
    assert decision.scores[1]["decode_blocks"] == 8   # 0 active + 8 new


def test_dynamo_a_request_that_ends_without_a_report_is_no_longer_active():
    # The gateway tells the policy of a refused or failed request (no usage comes back): its
    # 5 blocks leave replica 0's active set, as a completion's would.
    policy = create_policy("dynamo_kv_cost")
    prime(policy, 0, blocks("A", 5), rid="first")
    policy.on_unreported(req(blocks("A", 5), "first"), 0, ran=False)
    decision = policy.route(req(blocks("B", 8)), reps(1, 0))
    assert decision.scores[0]["decode_blocks"] == 8   # 0 active + 8 new


def test_dynamo_ties_go_to_the_smaller_tree():
    policy = create_policy("dynamo_kv_cost:overlap_score_weight=0")
    replicas = reps(0, 0, cache=[FakeCache(0, size=50), FakeCache(0, size=20)])
    decision = policy.route(req(blocks("A", 4)), replicas)
    assert (decision.replica, decision.branch) == (1, "lowest_cost_tree_size_tiebreak")


def test_dynamo_ties_with_equal_trees_are_random():
    policy = create_policy("dynamo_kv_cost:seed=5")
    decision = policy.route(req(blocks("A", 4)), reps(0, 0, 0))
    assert decision.branch == "lowest_cost_random_tiebreak"
    assert decision.replica in (0, 1, 2)


def test_dynamo_completion_frees_the_active_blocks():
    policy = create_policy("dynamo_kv_cost")
    request = req(blocks("A", 4), rid="a")
    decision = policy.route(request, reps(0, 0))
    policy.on_routed(request, decision)
    busy = decision.replica
    again = policy.route(req(blocks("B", 4)), reps(1, 1))
    assert again.scores[busy]["decode_blocks"] == 8      # 4 active + 4 new
    policy.on_completed(request, busy, 0)
    freed = policy.route(req(blocks("B", 4)), reps(1, 1))
    assert freed.scores[busy]["decode_blocks"] == 4


def test_dynamo_near_zero_temperature_samples_the_lowest_cost():
    policy = create_policy("dynamo_kv_cost:router_temperature=0.001,seed=1")
    replicas = reps(0, 0, cache=[FakeCache(0), FakeCache(4)])
    picks = {policy.route(req(blocks("A", 4)), replicas).replica for _ in range(20)}
    assert picks == {1}


def test_dynamo_temperature_spreads_choices_and_names_the_branch():
    policy = create_policy("dynamo_kv_cost:router_temperature=10,seed=1")
    replicas = reps(0, 0, cache=[FakeCache(0), FakeCache(4)])
    decisions = [policy.route(req(blocks("A", 4)), replicas) for _ in range(200)]
    assert {d.branch for d in decisions} == {"softmax_sample"}
    assert {d.replica for d in decisions} == {0, 1}


def test_dynamo_without_kv_events_predicts_from_routing_with_a_ttl():
    policy = create_policy("dynamo_kv_cost:use_kv_events=false")
    prime(policy, 1, blocks("A", 4), now=0.0)
    hit = policy.route(req(blocks("A", 4), now=60.0), reps(1, 1))
    assert hit.scores[1]["overlap_blocks"] == 4
    expired = policy.route(req(blocks("A", 4), now=121.0), reps(1, 1))
    assert expired.scores[1]["overlap_blocks"] == 0


# ---------------------------------------------------------------------------------------------
# AIBrix prefix-cache: load gate, mean + k x stddev, least-request fallback
# ---------------------------------------------------------------------------------------------

def test_aibrix_defaults_are_the_gateway_defaults():
    policy = create_policy("aibrix_prefix_cache")
    assert (policy.standard_deviation_factor, policy.load_imbalance_factor,
            policy.load_imbalance_min_gap) == (1.0, 2.0, 8)
    assert (policy.block_number, policy.eviction_duration_s) == (200_000, 1200.0)


def test_aibrix_matching_pod_within_mean_plus_one_stddev_wins():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 1, blocks("A", 4))
    decision = policy.route(req(blocks("A", 4)), reps(2, 2, 2))   # limit 2 + 1 x 0
    assert (decision.replica, decision.branch) == (1, "prefix_match")
    assert decision.scores[1]["prefix_match_percent"] == 100


def test_aibrix_matching_pod_above_the_limit_is_skipped_for_the_least_loaded():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 1, blocks("A", 4))
    # loads 2, 3, 2: mean 2.33, sample stddev 0.577, limit 2.91 < 3
    decision = policy.route(req(blocks("A", 4)), reps(2, 3, 2))
    assert decision.branch == "prefix_match_skipped"
    assert decision.replica in (0, 2)


def test_aibrix_percent_is_the_integer_share_of_leading_blocks():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 0, blocks("A", 2))
    decision = policy.route(req(blocks("A", 3)), reps(0, 0))
    assert decision.scores[0]["prefix_match_percent"] == 66   # 2 x 100 // 3
    assert decision.predicted_cached_tokens == 2 * B


def test_aibrix_longer_match_beats_lighter_load():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 0, blocks("A", 2))
    prime(policy, 1, blocks("A", 4))
    decision = policy.route(req(blocks("A", 4)), reps(1, 2, 2))   # limit 1.67 + 0.58 = 2.24
    assert (decision.replica, decision.branch) == (1, "prefix_match")


def test_aibrix_no_match_goes_to_the_least_loaded():
    policy = create_policy("aibrix_prefix_cache")
    decision = policy.route(req(blocks("A", 4)), reps(3, 1, 2))
    assert (decision.replica, decision.branch) == (1, "least_request_fallback")


def test_aibrix_load_gate_restricts_matching_to_the_least_loaded():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 0, blocks("A", 4))
    # loads 20, 0, 1, 1: mean 5.5, 20 > 2 x 6.5 = 13 and gap 20 >= 8: only replica 1 matches
    decision = policy.route(req(blocks("A", 4)), reps(20, 0, 1, 1))
    assert (decision.replica, decision.branch) == (1, "imbalanced_least_request")
    prime(policy, 1, blocks("A", 4))
    decision = policy.route(req(blocks("A", 4)), reps(20, 0, 1, 1))
    assert (decision.replica, decision.branch) == (1, "imbalanced_prefix_match")


def test_aibrix_gate_needs_both_the_factor_and_the_gap():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 0, blocks("A", 4))
    # loads 10, 2: mean 6, 10 <= 2 x 7 = 14: no gate; limit 6 + 5.66 = 11.66 >= 10
    decision = policy.route(req(blocks("A", 4)), reps(10, 2))
    assert (decision.replica, decision.branch) == (0, "prefix_match")


def test_aibrix_legacy_absolute_gate_takes_a_least_loaded_pod_without_matching():
    policy = create_policy("aibrix_prefix_cache:load_gate=abs")
    prime(policy, 0, blocks("A", 4))
    decision = policy.route(req(blocks("A", 4)), reps(10, 1))   # 9 > 8
    assert (decision.replica, decision.branch) == (1, "imbalanced_least_request")


def test_aibrix_index_entries_expire_twenty_minutes_after_their_last_write():
    policy = create_policy("aibrix_prefix_cache")
    prime(policy, 0, blocks("A", 4), now=0.0)
    assert policy.route(req(blocks("A", 4), now=1200.0), reps(0, 0)).branch == "prefix_match"
    late = policy.route(req(blocks("A", 4), now=1201.0), reps(0, 0))
    assert late.branch == "least_request_fallback"


# ---------------------------------------------------------------------------------------------
# Preble E2: exploit when cached > uncached, else lowest load + eviction + prefill cost
# ---------------------------------------------------------------------------------------------

# One millisecond per prefill token and 10 ms per output token keep the seconds readable.
PREBLE = "preble_e2:prefill_s_per_token=0.001,tpot_s=0.01"


def test_preble_defaults():
    policy = create_policy("preble_e2")
    assert (policy.window_s, policy.default_output_tokens) == (180.0, 45)
    assert policy.eviction_cost is True


def test_preble_explore_picks_the_least_loaded_when_nothing_is_cached():
    policy = create_policy(PREBLE)
    prime(policy, 0, blocks("old", 10), output=100, now=0.0)   # 0.16 s prefill + 1.0 s decode
    decision = policy.route(req(blocks("A", 10), now=1.0), reps(0, 0))
    assert decision.scores[0]["load_s"] == pytest.approx(1.16)
    assert decision.scores[1]["load_s"] == 0.0
    assert decision.scores[1]["prefill_s"] == pytest.approx(0.16)   # 160 tokens x 1 ms
    assert (decision.replica, decision.branch) == (1, "explore_lowest_cost")


def test_preble_exploits_the_longest_prefix_when_cached_exceeds_uncached():
    policy = create_policy(PREBLE)
    prime(policy, 0, blocks("A", 8), output=1000, now=0.0)   # replica 0 is busy: 10.128 s
    # 8 of 10 blocks cached: 128 cached > 32 uncached, so replica 0 despite its load
    decision = policy.route(req(blocks("A", 8) + blocks("new", 2), now=1.0), reps(0, 0))
    assert (decision.replica, decision.branch) == (0, "exploit_longest_prefix")
    assert decision.predicted_cached_tokens == 128


def test_preble_equal_cached_and_uncached_explores():
    policy = create_policy(PREBLE)
    prime(policy, 0, blocks("A", 5), output=1000, now=0.0)
    decision = policy.route(req(blocks("A", 5) + blocks("new", 5), now=1.0), reps(0, 0))
    # 80 cached == 80 uncached: explore; replica 0 carries 10.08 s of load
    assert (decision.replica, decision.branch) == (1, "explore_lowest_cost")


def test_preble_load_leaves_the_window_after_three_minutes():
    policy = create_policy(PREBLE)
    prime(policy, 0, blocks("old", 10), output=100, now=0.0)
    decision = policy.route(req(blocks("A", 10), now=181.0), reps(0, 0))
    assert decision.scores[0]["load_s"] == 0.0
    assert decision.replica == 0   # all costs equal again: lowest index


def test_preble_eviction_cost_counts_victims_used_in_the_window():
    policy = create_policy(PREBLE)
    full = reps(0, 0, capacity_blocks=[10, 10])
    policy.route(req(blocks("X", 1)), full)                 # learn the capacities
    prime(policy, 0, blocks("X", 10), rid="x1", output=0)
    prime(policy, 0, blocks("X", 10), rid="x2", output=0)  # every X block used twice
    decision = policy.route(req(blocks("new", 5), now=1.0), full)
    # replica 0 is full: 5 victims x 2 uses x 16 tokens x 1 ms = 0.16 s; replica 1 is empty
    assert decision.scores[0]["eviction_s"] == pytest.approx(0.16)
    assert decision.scores[1]["eviction_s"] == 0.0
    assert decision.replica == 1


def test_preble_unknown_capacity_assumes_a_full_gpu():
    policy = create_policy(PREBLE)
    prime(policy, 0, blocks("X", 10), output=0)
    decision = policy.route(req(blocks("new", 3), now=1.0), reps(0, 0))
    assert decision.scores[0]["eviction_s"] == pytest.approx(3 * 16 * 0.001)


def test_preble_replica_prefill_rate_overrides_the_default():
    policy = create_policy(PREBLE)
    decision = policy.route(req(blocks("A", 10)), reps(0, 0, prefill_s_per_token=[None, 0.01]))
    assert decision.scores[1]["prefill_s"] == pytest.approx(1.6)
    assert decision.replica == 0
