"""The fleet simulation: the worked examples' behaviours through replicas, policies and metrics."""

import pytest

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.replica.service_time import INSTANT, LLAMA3_8B_H100
from prefixroute.core.simulator.generators import (five_turn_conversation, seed_fleet,
                                                   universal_prefix)
from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import (FleetConfig, prepare_workload, simulate,
                                                   simulate_policy, split_view)


def test_five_turn_conversation_reuses_496_784_1136_1488_through_the_engine():
    workload = prepare_workload(five_turn_conversation())
    run = simulate_policy(workload, FleetConfig(1, 1000, 16, LLAMA3_8B_H100), "round_robin")
    assert run.cached_tokens == [0, 496, 784, 1136, 1488]
    assert run.summary["reused_prefix_tokens"] == 3904
    assert run.summary["fresh_prefill_tokens"] == 1296
    assert run.summary["recomputed_prefill_tokens"] == 0  # one replica is the ideal cache


def test_universal_prefix_round_robin_pays_warm_up_on_every_replica():
    workload = prepare_workload(universal_prefix())
    fleet = FleetConfig(5, 1000, 16, LLAMA3_8B_H100)
    round_robin = simulate_policy(workload, fleet, "round_robin")
    pinned = simulate_policy(workload, fleet, "affinity_only")
    # 200-token prompt = 12 full blocks = 192 cacheable tokens.
    assert sum(1 for c in round_robin.cached_tokens if c >= 192) == 45
    assert sum(1 for c in pinned.cached_tokens if c >= 192) == 49
    assert (pinned.summary["reused_prefix_tokens"]
            - round_robin.summary["reused_prefix_tokens"]) == 4 * 192


def test_finish_times_are_per_request_and_minus_one_for_a_rejected_prompt():
    # Instant engine: a request ends when it arrives.
    workload = prepare_workload(five_turn_conversation())
    run = simulate_policy(workload, FleetConfig(1, 1000, 16, INSTANT), "round_robin")
    assert run.finish_s == [0.0, 60.0, 120.0, 180.0, 240.0]
    # 400 tokens need 25 blocks; a 10-block replica rejects the prompt at once.
    workload = prepare_workload([Request("a", 0.0, 32, 2, 16, hash_ids=[1, 2]),
                                 Request("b", 1.0, 400, 2, 16, hash_ids=list(range(3, 28)))])
    run = simulate_policy(workload, FleetConfig(1, 10, 16, INSTANT), "round_robin")
    assert run.finish_s == [0.0, -1.0]


def test_report_has_the_issue_keys_and_the_ideal_hit_rate():
    workload = prepare_workload(seed_fleet(requests=60))
    result = simulate(workload, FleetConfig(4, 400, 16, LLAMA3_8B_H100),
                      ["round_robin", "hybrid"])["report"]
    assert set(result) >= {"workload", "ideal_token_hit_rate", "policies"}
    for summary in result["policies"].values():
        for key in ("token_hit_rate", "request_hit_rate", "reused_prefix_tokens", "ttft_p50_s",
                    "ttft_p90_s", "ttft_p99_s", "assignments", "max_assignment_skew",
                    "evictions", "recomputed_prefill_tokens", "utilisation"):
            assert key in summary
        assert sum(summary["assignments"]) == 60
        assert summary["token_hit_rate"] <= result["ideal_token_hit_rate"]


@pytest.mark.parametrize("view", ["approximate", "events", "oracle"])
def test_every_view_runs_and_repeats(view):
    workload = prepare_workload(seed_fleet(requests=40))
    fleet = FleetConfig(4, 400, 16, LLAMA3_8B_H100)
    first = simulate_policy(workload, fleet, f"affinity_only:view={view}")
    again = simulate_policy(workload, fleet, "affinity_only", view=view)
    assert first.summary["view"] == view
    assert first.cached_tokens == again.cached_tokens


def test_split_view_strips_the_view_parameter():
    assert split_view("hybrid:max_skew=2,view=oracle") == ("hybrid:max_skew=2", "oracle")
    assert split_view("round_robin") == ("round_robin", "approximate")
    with pytest.raises(ConfigError, match="unknown view"):
        split_view("hybrid:view=psychic")


def test_time_scale_below_one_compresses_arrivals():
    requests = prepare_workload(seed_fleet(requests=5), time_scale=0.5).requests
    original = prepare_workload(seed_fleet(requests=5)).requests
    assert [r.arrival_s for r in requests] == [r.arrival_s / 2 for r in original]


def test_mixed_block_sizes_and_disordered_arrivals_are_input_errors():
    a = Request("a", 1.0, 32, 1, 16, hash_ids=[1, 2])
    b = Request("b", 0.5, 32, 1, 16, hash_ids=[1, 2])
    with pytest.raises(InputError, match="before the previous"):
        prepare_workload([a, b])
    c = Request("c", 2.0, 64, 1, 64, hash_ids=[1])
    with pytest.raises(InputError, match="block size"):
        prepare_workload([Request("a", 1.0, 32, 1, 16, hash_ids=[1, 2]), c])


def test_unknown_policy_and_bad_fleet_are_config_errors():
    workload = prepare_workload(seed_fleet(requests=3))
    with pytest.raises(ConfigError, match="unknown policy"):
        simulate_policy(workload, FleetConfig(2, 400, 16, INSTANT), "teleport")
    with pytest.raises(ConfigError, match="replicas"):
        FleetConfig(0, 400, 16, INSTANT)


def test_every_registered_policy_runs_through_the_simulator():
    from prefixroute.core.routing.registry import expand_specs
    workload = prepare_workload(seed_fleet(requests=30))
    fleet = FleetConfig(4, 400, 16, LLAMA3_8B_H100)
    for spec in expand_specs(["all"]):
        summary = simulate_policy(workload, fleet, spec).summary
        assert summary["completed"] == 30, spec


def test_priority_engines_let_prefixroute_put_a_short_prompt_ahead_of_a_long_one():
    # One replica (8,192-token steps). "a" (40,000 tokens) starts at once; "b" (40,000) and
    # "c" (160) queue behind it. First come, first served, c waits for b's whole prefill
    # (about 1.6 s more); under priority scheduling prefixroute sends deadlines (arrival +
    # twice the own prefill: c's is due first) and c goes as soon as a is done.
    workload = prepare_workload([
        Request("a", 0.00, 40_000, 2, 16, hash_ids=list(range(0, 2500))),
        Request("b", 0.01, 40_000, 2, 16, hash_ids=list(range(2500, 5000))),
        Request("c", 0.02, 160, 2, 16, hash_ids=list(range(5000, 5010)))])
    ttft = {}
    for scheduling in ("fcfs", "priority"):
        fleet = FleetConfig(1, 10_000, 16, LLAMA3_8B_H100, scheduling_policy=scheduling)
        for spec in ("prefixroute", "round_robin"):
            ttft[scheduling, spec] = simulate_policy(workload, fleet, spec).ttft_s
    a, b, c = ttft["priority", "prefixroute"]
    fa, fb, fc = ttft["fcfs", "prefixroute"]
    assert fc - c > 1.5 and c < a + 0.05  # c right after a instead of after b
    assert b > fb                           # b waits for c, a step or so
    assert fb == pytest.approx(b, abs=0.05)
    # A policy that sends no priority is first come, first served on either engine.
    assert ttft["priority", "round_robin"] == ttft["fcfs", "round_robin"] == [fa, fb, fc]


def test_a_bad_scheduling_policy_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduling policy must be one of fcfs, priority"):
        FleetConfig(1, 10, 16, LLAMA3_8B_H100, scheduling_policy="sjf")
