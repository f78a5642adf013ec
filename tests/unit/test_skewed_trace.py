"""The worked examples' skewed routing trace through the real policies, and its exercises.

Arrivals by position (0-based): 0A 1A 2B 3A 4C 5A 6B 7D 8A 9A 10C 11B 12A 13D 14A 15B 16C 17A
18B 19A; lengths A=1000, B=800, C=600, D=400; 3 replicas of 2 families each (LRU).
"""

from __future__ import annotations

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.skewed_trace import run_skewed_trace, skewed_trace_exercises


@pytest.fixture(scope="module")
def exercises():
    return skewed_trace_exercises()


# -- the trace itself --------------------------------------------------

@pytest.mark.parametrize("policy, reused, assignments, final_skew, evictions", [
    ("round_robin", 10_000, [7, 7, 6], 1, 2),
    ("affinity_only", 13_800, [10, 5, 5], 5, 0),
    ("hybrid", 12_000, [7, 7, 6], 1, 0),
])
def test_skewed_trace_gives_the_worked_example_numbers(policy, reused, assignments, final_skew,
                                               evictions):
    run = run_skewed_trace(policy)
    assert run["reused_prefix_tokens"] == reused
    assert run["assignments"] == assignments
    assert run["max_assignment_skew"] == final_skew
    assert run["evictions"] == evictions
    assert run["reused_prefix_tokens"] + run["fresh_prefill_tokens"] == 16_600


def test_skewed_trace_total_prompt_tokens_is_16600():
    # 10 A x 1000 + 5 B x 800 + 3 C x 600 + 2 D x 400, counted from the arrivals string.
    run = run_skewed_trace("round_robin")
    assert run["total_prompt_tokens"] == 10 * 1000 + 5 * 800 + 3 * 600 + 2 * 400 == 16_600


def test_hybrid_skew_reaches_two_mid_run_and_ends_at_one():
    run = run_skewed_trace("hybrid")
    assert run["peak_assignment_skew"] == 2
    assert run["assignment_skew_over_time"][-1] == 1


def test_round_robin_cycles_0_1_2():
    assert run_skewed_trace("round_robin")["choices"] == [0, 1, 2] * 6 + [0, 1]


def test_affinity_only_never_refuses_a_holder():
    assert "skew_cap" not in run_skewed_trace("affinity_only")["branches"]


def test_round_robin_waits_behind_nobody_under_the_queue_model():
    # Window = replicas - 1 = 2 previous arrivals, which round robin sent elsewhere.
    run = run_skewed_trace("round_robin")
    assert (run["queue_window"], run["queued_ahead"], run["queue_penalty_tokens"]) == (2, 0, 0)


def test_max_skew_argument_is_set_on_the_spec():
    assert run_skewed_trace("hybrid", max_skew=2)["policy"] == "hybrid:max_skew=2"


def test_max_skew_on_a_policy_without_it_is_a_config_error():
    with pytest.raises(ConfigError, match="max_skew"):
        run_skewed_trace("round_robin", max_skew=1)


def test_unknown_family_is_a_config_error():
    with pytest.raises(ConfigError, match="Z"):
        run_skewed_trace("round_robin", arrivals="AZ")


# -- exercises ---------------------------------------------------------------------------------

def test_capacity_1_round_robin(exercises):
    # Replica 0 serves 0A 3A 6B 9A 12A 15B 18B: hits at 3 (A), 12 (A), 18 (B) = 2,800, evicts 3.
    # Replica 1 serves 1A 4C 7D 10C 13D 16C 19A: never the same family twice in a row: 0, 6.
    # Replica 2 serves 2B 5A 8A 11B 14A 17A: hits at 8 (A), 17 (A) = 2,000, evicts 3.
    run = exercises["capacity_1"]["round_robin"]
    assert (run["reused_prefix_tokens"], run["evictions"]) == (4_800, 12)
    assert run["assignments"] == [7, 7, 6]


def test_capacity_1_keeps_the_ranking_affinity_then_hybrid_then_round_robin(exercises):
    reused = {name: run["reused_prefix_tokens"] for name, run in exercises["capacity_1"].items()}
    assert reused == {"round_robin": 4_800, "affinity_only": 11_400, "hybrid": 9_600}
    evictions = {name: run["evictions"] for name, run in exercises["capacity_1"].items()}
    assert evictions == {"round_robin": 12, "affinity_only": 5, "hybrid": 7}


def test_capacity_1_affinity_only_skew_is_unchanged(exercises):
    # The replay ends with the same assignments as with two families per replica.
    run = exercises["capacity_1"]["affinity_only"]
    assert (run["assignments"], run["max_assignment_skew"]) == ([10, 5, 5], 5)


@pytest.mark.parametrize("max_skew, reused, assignments, final_skew, peak_skew, evictions", [
    (0, 11_400, [7, 6, 7], 1, 1, 1),
    (1, 12_000, [7, 7, 6], 1, 2, 0),
    (2, 12_800, [8, 7, 5], 3, 3, 0),
])
def test_hybrid_max_skew_sweep(exercises, max_skew, reused, assignments, final_skew, peak_skew,
                               evictions):
    run = exercises["hybrid_max_skew"][f"hybrid:max_skew={max_skew}"]
    assert run["reused_prefix_tokens"] == reused
    assert run["assignments"] == assignments
    assert (run["max_assignment_skew"], run["peak_assignment_skew"]) == (final_skew, peak_skew)
    assert run["evictions"] == evictions
    assert run["peak_assignment_skew"] <= max_skew + 1


def test_hot_burst_round_robin(exercises):
    # E arrives at 20..27 -> replicas 2,0,1,2,0,1,2,0: three misses (one per replica, each
    # evicting into a full cache), five hits of 1,200: 10,000 + 6,000.
    run = exercises["hot_burst"]["round_robin"]
    assert (run["reused_prefix_tokens"], run["evictions"]) == (16_000, 2 + 3)
    assert run["assignments"] == [10, 9, 9]


def test_hot_burst_affinity_only_piles_on_one_replica(exercises):
    # After the trace [10, 5, 5]: E misses to replica 1 (least, lowest index), then 7 hits there.
    run = exercises["hot_burst"]["affinity_only"]
    assert run["reused_prefix_tokens"] == 13_800 + 7 * 1_200
    assert run["assignments"] == [10, 5 + 8, 5]
    assert run["max_assignment_skew"] == 8


def test_hot_burst_hybrid_spreads_the_hot_prefix(exercises):
    # After the trace [7, 7, 6]: E miss -> 2 (7,7,7); hit 2 (7,7,8); hit 2 (7,7,9); 2 is above
    # 7 + 1, miss -> 0 (8,7,9); hit 0 (9,7,9); holders 0 and 2 at 9 > 7 + 1, miss -> 1 (9,8,9);
    # hit 1 (9,9,9); hit 0 (10,9,9). Five hits of 1,200 and three misses into full caches.
    run = exercises["hot_burst"]["hybrid"]
    assert run["reused_prefix_tokens"] == 12_000 + 5 * 1_200
    assert run["assignments"] == [10, 9, 9]
    assert (run["max_assignment_skew"], run["peak_assignment_skew"], run["evictions"]) == (1, 2, 3)


def test_hot_burst_queue_penalty_shows_the_hot_replica(exercises):
    runs = exercises["hot_burst"]
    assert runs["round_robin"]["queued_ahead"] == 0
    assert runs["affinity_only"]["queued_ahead"] > runs["hybrid"]["queued_ahead"] > 0


def test_every_exercise_run_reports_the_queue_estimate(exercises):
    runs = [run for exercise in exercises.values() for run in exercise.values()]
    for run in runs:
        saved = run["reused_prefix_tokens"] - run["queue_penalty_tokens"]
        assert run["net_prefill_saved_tokens"] == saved
        assert "choices" not in run
