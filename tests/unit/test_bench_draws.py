"""benchmarks/draws.py: the own draw split into windows of arrivals, on workloads small
enough to count by hand."""

import sys
from pathlib import Path

from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import prepare_workload

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import draws  # noqa: E402
import policy_comparison  # noqa: E402


def request(rid, at, ids, session=None, think=None):
    return Request(rid, at, len(ids) * 16, 4, 16, hash_ids=ids, session=session, think_s=think)


def split(name, requests, width_s, closed_loop=False):
    policy_comparison._BASE[name] = prepare_workload(requests, closed_loop=closed_loop)
    try:
        return draws.windows(name, 1.0, 1, "round_robin", width_s)
    finally:
        del policy_comparison._BASE[name]


def test_open_loop_windows_count_each_request_once_by_its_arrival():
    # Arrivals at 0, 5 and 25 s in 10 s windows: two in the first, none in the second, one
    # in the third; the third repeats the first one's 10 blocks but its last (the last
    # token is never reused): 9 x 16 = 144 of 160 tokens cached, for both policies.
    reqs = [request("a", 0.0, list(range(10))), request("b", 5.0, list(range(100, 110))),
            request("c", 25.0, list(range(10)))]
    rows = split("draws-test-open", reqs, 10.0)
    assert [r["from_s"] for r in rows] == [0.0, 10.0, 20.0]
    for spec in ("prefixroute", "round_robin"):
        assert [r[f"{spec}_requests"] for r in rows] == [2, 0, 1]
        assert [r[f"{spec}_tokens"] for r in rows] == [320, 0, 160]
        assert [r[f"{spec}_cached"] for r in rows] == [0, 0, 144]
        assert rows[1][f"{spec}_ttft_s"] == 0.0 and rows[0][f"{spec}_ttft_s"] > 0


def test_closed_loop_turns_fall_in_the_window_of_their_own_run():
    # The second turn comes 30 s after the first one's reply, not at its recorded 500 s:
    # its window is the fourth of 10 s (30 s and some service), in both runs.
    reqs = [request("t1", 0.0, list(range(10)), session="s"),
            request("t2", 500.0, list(range(20)), session="s", think=30.0)]
    rows = split("draws-test-closed", reqs, 10.0, closed_loop=True)
    assert len(rows) == 4
    for spec in ("prefixroute", "round_robin"):
        assert [r[f"{spec}_requests"] for r in rows] == [1, 0, 0, 1]
