"""benchmarks/real_engines.py without engines: the workloads it sends, the closed loop the
simulator replays, and what it reads from our gateway's routing decisions."""

import sys
from pathlib import Path

import pytest

from prefixroute.edges.tokenization import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import real_engines  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return load_tokenizer(tiny_tokenizer_dir)


def test_a_lane_interleaves_its_conversations_turn_by_turn(tokenizer):
    maker = real_engines.TextMaker(tokenizer)
    workload = real_engines.session_workload(maker, seed=0, conversations=8, turns=3, lanes=4)
    # Lane 1 holds conversations 1 and 5: turn 0 of both, then turn 1 of both, then turn 2.
    lane = workload.lanes[1]
    assert [(job.conversation, job.turn) for job in lane] == [
        (1, 0), (5, 0), (1, 1), (5, 1), (1, 2), (5, 2)]
    # Each turn sends the previous turn's messages, the reply, and a new user message.
    first, second = lane[0], lane[2]
    assert second.messages[:len(first.messages)] == first.messages
    assert [m["role"] for m in second.messages] == ["system", "user", "assistant", "user"]


def test_the_simulated_closed_loop_sends_each_request_after_its_lane_predecessor(tokenizer):
    maker = real_engines.TextMaker(tokenizer)
    workload = real_engines.tenant_workload(maker, seed=0, requests=10, lanes=4)
    requests, after = real_engines.simulated_requests(workload, tokenizer)
    # Lanes hold requests 0,4,8 / 1,5,9 / 2,6 / 3,7; listed by round: 0 1 2 3 4 5 6 7 8 9.
    assert list(after) == [-1, -1, -1, -1, 0, 1, 2, 3, 4, 5]
    assert all(r.token_ids == tokenizer.encode_chat(job.messages)
               for r, job in zip(requests, workload.ordered()))


def test_the_tenants_workload_gives_the_top_tenant_about_forty_percent(tokenizer):
    maker = real_engines.TextMaker(tokenizer)
    workload = real_engines.tenant_workload(maker, seed=1, requests=400, lanes=4,
                                            document_tokens=40, user_tokens=4)
    jobs = [job for lane in workload.lanes for job in lane]
    share = sum(job.tenant == "t0" for job in jobs) / len(jobs)
    assert 0.33 < share < 0.47  # 1 / sum(k^-1.1, k=1..8) = 0.398


def decision(time, replica, expected, predicted, reported, branch="cache_affinity"):
    return {"time": time, "replica": replica, "branch": branch, "num_tokens": 640,
            "predicted_cached_tokens": predicted, "reported_cached_tokens": reported,
            "candidates": [{"replica": name, "scores": {
                "s_per_token": 4e-5 * (1 + time), "expected_cached_tokens": cached,
                "wait_s": 0.01 * (name == "a")}} for name, cached in expected.items()]}


def test_the_decision_summary_counts_spills_and_prediction_errors():
    decisions = [
        decision(0, "a", {"a": 0, "b": 0}, 0, 0, "cold_spread"),
        # b holds 576 tokens, but the request went to a (holding 0): 576 given up.
        decision(1, "a", {"a": 0, "b": 576}, 0, 0, "spill"),
        # Predicted cold, hit 480: an under-prediction of the cold kind.
        decision(2, "b", {"a": 0, "b": 576}, 0, 480),
        # Predicted 320, hit 576: a partial under-prediction of 256; then an over-prediction.
        decision(3, "b", {"a": 576, "b": 576}, 320, 576),
        decision(4, "b", {"a": 0, "b": 576}, 576, 544),
    ]
    summary = real_engines.decision_summary(decisions)
    assert summary["left_prefix_holder"] == 1
    assert summary["left_prefix_tokens"] == 576
    assert summary["under_predicted_cold"] == [1, 480]
    assert summary["under_predicted_partial"] == [1, 256]
    assert summary["over_predicted"] == [1, 32]
    assert summary["s_per_token_us"]["a"] == {"first": 40.0, "last": 200.0, "max": 200.0}
    assert summary["branches"] == {"cold_spread": 1, "spill": 1, "cache_affinity": 3}


def _prepared_sessions(tokenizer, conversations=8, turns=4):
    from array import array

    from prefixroute.core.simulator.simulation import PreparedWorkload, prepare_workload
    maker = real_engines.TextMaker(tokenizer)
    workload = real_engines.session_workload(maker, seed=0, conversations=conversations,
                                             turns=turns, lanes=4)
    requests, after = real_engines.simulated_requests(workload, tokenizer)
    prepared = prepare_workload(requests, block_size=real_engines.BLOCK_SIZE,
                                keep_token_ids=True)
    return workload, PreparedWorkload(prepared.requests, prepared.block_size,
                                      prepared.ideal_cached, prepared.info,
                                      prepared.prompt_keys, after,
                                      array("d", [0.0]) * len(requests))


def test_jitter_delays_first_requests_and_every_later_turn(tokenizer):
    import random
    _, prepared = _prepared_sessions(tokenizer, conversations=40, turns=5)
    out = real_engines.jittered(prepared, 0.1, random.Random(0))
    assert list(out.after) == list(prepared.after)  # the closed loop is the same
    firsts = [r.arrival_s for r, a in zip(out.requests, out.after) if a < 0]
    assert len(firsts) == 4 and all(t > 0 for t in firsts)
    later = [g for g, a in zip(out.gap_s, out.after) if a >= 0]
    assert all(g > 0 for g in later)
    assert sum(later) / len(later) == pytest.approx(0.1, rel=0.25)  # exponential, mean 0.1
    assert [r.token_ids for r in out.requests] == [r.token_ids for r in prepared.requests]
    still = real_engines.jittered(prepared, 0.0, random.Random(0))
    assert set(still.gap_s) == {0.0}


def test_round_robin_keeps_lanes_on_one_replica_only_without_jitter(tokenizer):
    """Four closed-loop lanes over two replicas in a deterministic simulator fall into
    lockstep: round robin then sends each lane, so each conversation, to one replica, a
    session affinity the real engines' timing noise does not give."""
    import random

    from prefixroute.core.replica.service_time import get_profile
    from prefixroute.core.simulator.simulation import FleetConfig, simulate_policy
    workload, prepared = _prepared_sessions(tokenizer)
    fleet = FleetConfig(replicas=2, cache_blocks=400, block_size=real_engines.BLOCK_SIZE,
                        service=get_profile("llama-3-8b-h100"))
    lockstep = simulate_policy(prepared, fleet, "round_robin").summary["token_hit_rate"]
    jittered = [simulate_policy(real_engines.jittered(prepared, 0.05, random.Random(d)), fleet,
                                "round_robin").summary["token_hit_rate"] for d in range(8)]
    # No evictions (400 blocks): lockstep loses almost nothing to the ideal (66.2% of 69.7%);
    # with delays each draw scatters conversations over both replicas (52% to 60%).
    assert lockstep > prepared.ideal_token_hit_rate - 0.05
    assert max(jittered) < lockstep - 0.05
