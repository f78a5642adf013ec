"""The balance rules of ``prefixroute`` on their own, each on the case it exists for.

A rule sees the cheapest candidate and all candidates (cost, tokens expected cached, requests
in flight, occupancy, prefill seconds routed over the balance horizon) and may name another.
"""

from __future__ import annotations

from prefixroute.core.routing.policies.prefixroute import (ColdBalance, PrefixRouteParams,
                                                          SessionMove, default_rules)
from prefixroute.core.routing.policies.prefixroute.balance import Candidate

MOVE = SessionMove(cap=1.1, floor=0.7, max_s=10.0, horizon_s=300.0)
COLD = ColdBalance(cap=1.1, free_share=0.1, cold_share=0.5, horizon_s=300.0)


def c(index, cost, held=0.0, load=0.0, occupancy=0.0, long_load=0.0):
    return Candidate(index, cost, held, load, occupancy, long_load)


def test_session_move_takes_a_session_off_a_replica_that_always_has_work():
    # Sessions ended unevenly: replica 0 had work 90% of the time, replicas 1 and 2 30% and
    # 0% (mean 40%). 0.9 > 1.1 x 0.4 and > the floor 0.7. Replica 2 is idle and least
    # occupied; it costs 2 s more than the holder, within 10 s.
    holder = c(0, 0.5, held=900, load=2, occupancy=0.9)
    fleet = [holder, c(1, 2.5, occupancy=0.3), c(2, 2.5, occupancy=0.0)]
    move = MOVE.move(holder, fleet, 1000, 900)
    assert move.replica == 2
    assert "2.000 s more cost" in move.reason


def test_session_move_leaves_a_lightly_loaded_fleet_alone():
    # Replica 0 has work 60% of the time, 3 x the mean 20%, but not most of the time (0.7).
    holder = c(0, 0.5, held=900, load=1, occupancy=0.6)
    assert MOVE.move(holder, [holder, c(1, 2.5), c(2, 2.5)], 1000, 900) is None


def test_cold_balance_spreads_new_sessions_away_from_a_loaded_replica():
    # A new session (nobody holds it): replica 0 is cheapest by 50 ms but got 10 s of prefill
    # lately against 1 s and 1 s (mean 4 s, cap 4.4 s). Replica 1, under the cap and holding
    # no less of the prompt, takes it.
    cheapest = c(0, 0.10, long_load=10.0)
    fleet = [cheapest, c(1, 0.15, long_load=1.0), c(2, 0.20, long_load=1.0)]
    move = COLD.move(cheapest, fleet, 1000, 0.0)
    assert move.replica == 1
    assert "0.050 s more cost" in move.reason


def test_cold_balance_leaves_a_request_with_its_cache():
    # Replica 0 holds 600 of its 1,000 tokens: more than cold_share (50%), not cold.
    cheapest = c(0, 0.10, held=600, long_load=10.0)
    assert COLD.move(cheapest, [cheapest, c(1, 0.7, long_load=1.0)], 1000, 600) is None
    # 300 tokens held is cold, but replica 1 holds 300 less: beyond free_share (100 tokens).
    cheapest = c(0, 0.10, held=300, long_load=10.0)
    assert COLD.move(cheapest, [cheapest, c(1, 0.4, long_load=1.0)], 1000, 300) is None


def test_the_rules_come_from_the_parameters_in_order_and_a_cap_of_zero_drops_one():
    assert [r.branch for r in default_rules(PrefixRouteParams())] == ["session_move",
                                                                      "cold_balance"]
    assert [r.branch for r in default_rules(PrefixRouteParams(move_cap=0))] == ["cold_balance"]
    assert default_rules(PrefixRouteParams(move_cap=0, cold_cap=0)) == []
