"""benchmarks/late_binding.py: one FCFS queue at the router, each head to the first replica
with no prefill left. Checked against the simulator's own engines on cases small enough to
follow: where nothing waits it must give what the engines give alone, and where it holds a
request the wait must be the prefill it waited for."""

import sys
from pathlib import Path

import pytest

from prefixroute.core.replica.service_time import DEFAULT_PROFILE, PRESETS
from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import (FleetConfig, prepare_workload,
                                                   simulate_policy)

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import late_binding  # noqa: E402

SERVICE = PRESETS[DEFAULT_PROFILE]


def fleet(replicas):
    return FleetConfig(replicas, 4000, 16, SERVICE)


def request(rid, at, tokens, ids, session=None, think=None):
    return Request(rid, at, tokens, 4, 16, hash_ids=ids, session=session, think_s=think)


def alone(req, replicas=1):
    """TTFT of one request on an idle fleet, from the simulator (any policy will do)."""
    run = simulate_policy(prepare_workload([req]), fleet(replicas), "round_robin")
    return run.ttft_s[0]


def test_requests_far_apart_get_what_each_gets_alone():
    reqs = [request("a", 0.0, 4000, list(range(250))),
            request("b", 100.0, 8000, list(range(1000, 1500)))]
    got = late_binding.late_binding(prepare_workload(reqs), fleet(2), 0)
    expected = [alone(r) for r in reqs]
    assert got["completed"] == 2
    assert got["ttft_mean_s"] == pytest.approx(sum(expected) / 2)
    assert got["token_hit_rate"] == 0.0


def test_two_at_once_on_two_replicas_do_not_wait_for_each_other():
    reqs = [request("a", 0.0, 8000, list(range(500))),
            request("b", 0.0, 8000, list(range(1000, 1500)))]
    got = late_binding.late_binding(prepare_workload(reqs), fleet(2), 0)
    assert got["ttft_p99_s"] == pytest.approx(alone(reqs[0]))


def test_a_held_request_goes_to_the_first_replica_to_free_up():
    # p (4,000 tokens) runs alone on replica 0 and stays cached there. At 50 s a (16,000
    # tokens) and b (4,000) come together: a takes replica 0 (both free, neither holds it:
    # the lowest index), b replica 1; c repeats p but finds both busy and waits at the
    # router. b's replica frees first (a quarter of a's prefill), so c goes there and
    # reuses nothing, where a router sending it at once would have queued it behind a on
    # the replica holding p. Its TTFT: b's prefill, then its own.
    p_ids, a_ids, b_ids = list(range(250)), list(range(1000, 2000)), list(range(3000, 3250))
    reqs = [request("p", 0.0, 4000, p_ids),
            request("a", 50.0, 16000, a_ids),
            request("b", 50.0, 4000, b_ids),
            request("c", 50.0, 4000, p_ids)]
    got = late_binding.late_binding(prepare_workload(reqs), fleet(2), 0)
    assert got["completed"] == 4
    assert got["token_hit_rate"] == 0.0
    short, long_ = alone(reqs[0]), alone(reqs[1])
    c_ttft = 4 * got["ttft_mean_s"] - 2 * short - long_
    assert c_ttft == pytest.approx(2 * short, rel=0.05)
    assert c_ttft < long_


def test_the_free_replica_holding_the_prompt_takes_it():
    # c repeats b's prompt; both replicas are free when it comes, and the one that ran b
    # (replica 1: a took replica 0) holds all of it but the last token's block: 4,000 - 16
    # tokens reused. Without the cache read the lowest index, replica 0, would take it.
    reqs = [request("a", 0.0, 4000, list(range(250))),
            request("b", 0.0, 4000, list(range(1000, 1250))),
            request("c", 50.0, 4000, list(range(1000, 1250)))]
    got = late_binding.late_binding(prepare_workload(reqs), fleet(2), 0)
    assert got["token_hit_rate"] == pytest.approx((4000 - 16) / 12000)


def test_a_rejected_prompt_counts_nowhere_but_still_sends_the_next_turn():
    # t1 is longer than a replica's KV (4,000 blocks of 16 tokens): rejected at once, it is
    # not completed and its 70,000 tokens are not in the hit rate's denominator; the
    # session's next turn still comes 5 s later (not at its recorded 1,000 s), and the one
    # after it reuses t2's 250 blocks: 4,000 of 8,100 tokens.
    t2_ids = list(range(5000, 5250))
    reqs = [request("t1", 0.0, 70000, list(range(4375)), session="s"),
            request("t2", 1000.0, 4000, t2_ids, session="s", think=5.0),
            request("t3", 2000.0, 4100, t2_ids + [9], session="s", think=5.0)]
    got = late_binding.late_binding(prepare_workload(reqs, closed_loop=True), fleet(1), 0)
    assert got["completed"] == 2
    assert 10.0 < got["last_first_token_s"] < 20.0
    assert got["token_hit_rate"] == pytest.approx(4000 / 8100)


def test_a_closed_loop_sends_the_next_turn_its_think_time_after_the_reply():
    # One session, two turns 1,000 s apart as recorded but 5 s of think time: the second
    # turn comes 5 s after the first one's reply, well before 1,000 s, and gets what the
    # simulator's closed loop gives it.
    reqs = [request("t1", 0.0, 4000, list(range(250)), session="s"),
            request("t2", 1000.0, 4100, list(range(250)) + [7], session="s", think=5.0)]
    workload = prepare_workload(reqs, closed_loop=True)
    got = late_binding.late_binding(workload, fleet(1), 0)
    sim = simulate_policy(workload, fleet(1), "round_robin")
    assert got["completed"] == 2
    assert 5.0 < got["last_first_token_s"] < 10.0
    assert got["last_first_token_s"] == pytest.approx(max(sim.arrival_s) + sim.ttft_s[1])
    assert got["ttft_mean_s"] == pytest.approx(sum(sim.ttft_s) / 2)
    assert got["token_hit_rate"] == pytest.approx(sim.summary["token_hit_rate"], abs=1e-6)
