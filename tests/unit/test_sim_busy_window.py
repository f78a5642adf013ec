"""Per-replica busy seconds up to a given time (``simulate_policy(busy_until=...)``): a
two-replica toy where every step's time is known by hand."""

import pytest

from prefixroute.core.replica.service_time import ServiceTimeModel
from prefixroute.core.simulator.metrics import max_over_mean
from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import FleetConfig, prepare_workload, simulate_policy

# 10 ms per prompt token, 100 ms per decode step of one request, nothing else.
TOY = ServiceTimeModel(name="toy", step_overhead_s=0.0, prefill_s_per_token=0.01,
                       attention_s_per_token_context=0.0, decode_s_per_seq=0.1,
                       decode_s_per_context_token=0.0)


def toy_run(busy_until):
    # Round robin: request a -> replica 0, b -> replica 1.
    # a: 100 prompt tokens at t=0 -> one 1.0 s prefill step (first token at 1.0), then 10
    #    decode steps of 0.1 s (one decode run): busy [0, 2.0].
    # b: 300 prompt tokens at t=5, one output token -> one 3.0 s step: busy [5, 8].
    requests = [Request("a", 0.0, 100, 11, 16, hash_ids=list(range(7))),
                Request("b", 5.0, 300, 1, 16, hash_ids=list(range(100, 119)))]
    workload = prepare_workload(requests)
    return simulate_policy(workload, FleetConfig(2, 1000, 16, TOY), "round_robin",
                           busy_until=busy_until)


@pytest.mark.parametrize("until, expected", [
    (0.5, [0.5, 0.0]),    # inside a's prefill step
    (1.55, [1.55, 0.0]),  # inside a's decode run
    (3.0, [2.0, 0.0]),    # a done, b not yet arrived
    (6.0, [2.0, 1.0]),    # inside b's prefill step
    (8.0, [2.0, 3.0]),
    (100.0, [2.0, 3.0]),  # after every event
    (-1.0, [0.0, 0.0]),   # before the first arrival
])
def test_busy_seconds_up_to_a_time_are_computable_by_hand(until, expected):
    run = toy_run(until)
    assert run.busy_until_s == pytest.approx(expected, abs=1e-9)
    assert run.busy_s == pytest.approx([2.0, 3.0], abs=1e-9)


def test_asking_for_the_window_changes_nothing_else():
    plain, windowed = toy_run(None), toy_run(1.55)
    assert plain.busy_until_s is None
    assert plain.summary == windowed.summary
    assert plain.ttft_s == windowed.ttft_s
    assert plain.summary["ttft_p50_s"] == pytest.approx(2.0)  # a 1.0 s, b 3.0 s


def test_max_over_mean():
    assert max_over_mean([1.0, 2.0, 3.0]) == pytest.approx(1.5)
    assert max_over_mean([2.0, 3.0]) == pytest.approx(1.2)
    assert max_over_mean([]) == 1.0
    assert max_over_mean([0.0, 0.0]) == 1.0
