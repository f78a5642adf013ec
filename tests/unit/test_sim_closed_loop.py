"""Closed-loop replay (``prepare_workload(closed_loop=True)``, ``simulate --closed-loop``): a
session's next turn is sent its think time after the previous turn ends, as kv-cache-tester's
trace replay sends it. Times are checkable by hand on a toy engine."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.service_time import ServiceTimeModel
from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import FleetConfig, prepare_workload, simulate_policy
from prefixroute.edges.traces import read_trace

# 10 ms per prompt token, 100 ms per decode step of one request, nothing else.
TOY = ServiceTimeModel(name="toy", step_overhead_s=0.0, prefill_s_per_token=0.01,
                       attention_s_per_token_context=0.0, decode_s_per_seq=0.1,
                       decode_s_per_context_token=0.0)


def turn(rid, t, n, out, session="s", think=None):
    # Turn k of a session extends turn k-1's prompt: ids 0 .. n/16 - 1.
    return Request(rid, t, n, out, 16, hash_ids=list(range(n // 16)), session=session,
                   think_s=think)


def run(requests, replicas=1, cache_blocks=1000, **options):
    workload = prepare_workload(requests, **options)
    return simulate_policy(workload, FleetConfig(replicas, cache_blocks, 16, TOY),
                           "round_robin")


def test_the_next_turn_is_sent_its_think_time_after_the_previous_one_ends():
    # Turn 0: 160 tokens at t=0 -> 1.6 s prefill (first token at 1.6), 10 more decode steps
    # -> finished at 2.6. Turn 1 thinks 3 s -> arrives at 5.6, though recorded at 0.5.
    requests = [turn("a", 0.0, 160, 11), turn("b", 0.5, 320, 1, think=3.0)]
    closed = run(requests, closed_loop=True)
    assert closed.arrival_s == pytest.approx([0.0, 5.6])
    assert closed.finish_s[0] == pytest.approx(2.6)
    # Turn 1 reuses turn 0's 160 tokens (10 blocks) and computes 160: 1.6 s.
    assert closed.summary["reused_prefix_tokens"] == 160
    assert closed.ttft_s == pytest.approx([1.6, 1.6])
    # Open loop (the default): turn 1 arrives at its recorded 0.5 s and waits in the queue.
    open_ = run([turn("a", 0.0, 160, 11), turn("b", 0.5, 320, 1, think=3.0)])
    assert open_.arrival_s == pytest.approx([0.0, 0.5])


def test_time_scale_scales_think_times_and_max_think_caps_them():
    # Think 100 s, capped at 60, then times 0.5: 30 s after turn 0 ends at 2.6.
    requests = [turn("a", 0.0, 160, 11), turn("b", 200.0, 320, 1, think=100.0)]
    scaled = run(requests, closed_loop=True, time_scale=0.5)
    assert scaled.arrival_s == pytest.approx([0.0, 32.6])
    uncapped = run([turn("a", 0.0, 160, 11), turn("b", 200.0, 320, 1, think=100.0)],
                   closed_loop=True, max_think_s=float("inf"))
    assert uncapped.arrival_s == pytest.approx([0.0, 102.6])


def test_without_a_think_time_the_recorded_interval_is_the_wait():
    # Recorded 4 s apart: turn 1 is sent 4 s after turn 0 ends (2.6 + 4).
    result = run([turn("a", 0.0, 160, 11), turn("b", 4.0, 320, 1)], closed_loop=True)
    assert result.arrival_s == pytest.approx([0.0, 6.6])


def test_a_rejected_turn_still_sends_the_next_one():
    # 20 blocks of KV: turn 0 (400 tokens = 25 blocks) is rejected at once at t=0; turn 1
    # (160 tokens) is sent 1 s later and runs.
    requests = [turn("a", 0.0, 400, 1), turn("b", 9.0, 160, 1, think=1.0)]
    result = run(requests, cache_blocks=20, closed_loop=True)
    assert result.summary["rejected"] == 1
    assert result.arrival_s == pytest.approx([0.0, 1.0])
    assert result.finish_s[1] == pytest.approx(2.6)


def test_sessions_run_side_by_side_and_requests_without_one_keep_their_time():
    requests = [turn("a0", 0.0, 160, 11, session="a"), turn("b0", 0.0, 160, 11, session="b"),
                Request("x", 1.0, 32, 1, 16, hash_ids=[100, 101]),
                turn("a1", 2.0, 320, 1, session="a", think=1.0)]
    result = run(requests, replicas=3, closed_loop=True)
    # Round robin: a0, b0, x on replicas 0, 1, 2; a0 ends at 2.6, so a1 arrives at 3.6.
    assert result.arrival_s == pytest.approx([0.0, 0.0, 1.0, 3.6])


def test_interleaved_sessions_each_follow_their_own_previous_turn():
    # a0 (long: 3.2 s prefill, ends 4.2) and b0 (short: 0.32 s, ends 1.32) on replicas 0, 1;
    # a1 and b1 think 1 s: b1 follows b0's end (2.32, to replica 2), a1 a0's (5.2), though
    # a1 comes first in the list.
    requests = [turn("a0", 0.0, 320, 11, session="a"), turn("b0", 0.0, 32, 11, session="b"),
                turn("a1", 1.0, 480, 1, session="a", think=1.0),
                turn("b1", 1.0, 64, 1, session="b", think=1.0)]
    result = run(requests, replicas=3, closed_loop=True)
    assert result.finish_s[:2] == pytest.approx([4.2, 1.32])
    assert result.arrival_s == pytest.approx([0.0, 0.0, 5.2, 2.32])


def test_busy_up_to_a_share_of_arrivals_is_the_busy_up_to_that_arrival():
    requests = [turn("a", 0.0, 160, 11), turn("b", 0.5, 320, 1, think=3.0)]
    workload = prepare_workload(requests, closed_loop=True)
    result = simulate_policy(workload, FleetConfig(1, 1000, 16, TOY), "round_robin",
                             busy_quantile=1.0)
    # The second (last) arrival is at 5.6; the replica was busy 0 .. 2.6 before it.
    assert result.busy_until_at == pytest.approx(5.6)
    assert result.busy_until_s == pytest.approx([2.6])
    with pytest.raises(ConfigError, match="busy_until or busy_quantile"):
        simulate_policy(workload, FleetConfig(1, 1000, 16, TOY), "round_robin",
                        busy_until=1.0, busy_quantile=0.5)


def test_scaling_a_prepared_workload_scales_its_gaps():
    requests = [turn("a", 0.0, 160, 11), turn("b", 10.0, 320, 1, think=4.0)]
    workload = prepare_workload(requests, closed_loop=True)
    half = workload.scaled(0.5)
    assert list(half.gap_s) == [0.0, 2.0] and list(workload.gap_s) == [0.0, 4.0]
    assert [r.arrival_s for r in half.requests] == [0.0, 5.0]
    assert half.info["time_scale"] == 0.5 and half.closed_loop


def test_a_negative_max_think_is_refused():
    with pytest.raises(ConfigError, match="longest think time"):
        prepare_workload([turn("a", 0.0, 160, 11)], closed_loop=True, max_think_s=-1.0)


def test_kvtester_think_times_are_read_for_every_turn_but_the_first(tmp_path):
    (tmp_path / "s.json").write_text(json.dumps({"block_size": 64, "requests": [
        {"t": 0.0, "in": 130, "out": 5, "hash_ids": [1, 2], "think_time": 0.0},
        {"t": 19.0, "in": 200, "out": 5, "hash_ids": [1, 2, 3], "think_time": 12.0,
         "api_time": 7.0},
        {"t": 40.0, "in": 260, "out": 5, "hash_ids": [1, 2, 3, 4]}]}))
    requests = list(read_trace(tmp_path, "kvtester"))
    assert [r.think_s for r in requests] == [None, 12.0, None]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 2),            # session
                          st.integers(1, 40),           # prompt blocks
                          st.integers(1, 30),           # output tokens
                          st.floats(0, 5)),             # think time
                min_size=1, max_size=14))
def test_a_session_never_has_two_turns_in_flight(turns):
    requests = []
    for i, (session, blocks, out, think) in enumerate(turns):
        requests.append(Request(f"r{i}", float(i), blocks * 16, out, 16,
                                hash_ids=list(range(blocks)), session=f"s{session}",
                                think_s=think))
    workload = prepare_workload(requests, closed_loop=True)
    result = simulate_policy(workload, FleetConfig(2, 30, 16, TOY), "least_loaded")
    last_end: dict[str, float] = {}
    for i, request in enumerate(workload.requests):
        arrival = result.arrival_s[i]
        if request.session in last_end:  # exactly its think time after its previous turn
            assert arrival == pytest.approx(last_end[request.session] + workload.gap_s[i])
        else:  # a session's first turn keeps its recorded time
            assert arrival == request.arrival_s
        # A rejected turn (over 30 blocks) ends when it arrives.
        end = result.finish_s[i] if result.finish_s[i] >= 0 else arrival
        last_end[request.session] = end
    assert result.summary["completed"] + result.summary["rejected"] == len(requests)
