"""The fleet's working set against its total cache, and the copy price it sets, as
specifications (``prefixroute``'s :mod:`.fleet`)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.prefixroute import PrefixRoute, PrefixRouteParams
from prefixroute.core.routing.policies.prefixroute.fleet import (PRESSURE_RHO_MAX,
                                                                 WorkingSet, copy_factor)
from prefixroute.core.routing.registry import create_policy

B = 16
MS = 1e-3
LINEAR = dict(attention_context_tokens=1e12, step_overhead_tokens=0, max_externality=0)


def blocks(family: str, n: int) -> tuple:
    return tuple((family, i) for i in range(n))


def test_the_working_set_counts_each_block_once_within_the_window():
    working = WorkingSet(horizon_s=300.0)
    working.touch(blocks("A", 10), 0.0)
    working.touch(blocks("A", 10) + blocks("B", 5), 100.0)  # A again, B new
    assert working.blocks(100.0) == 15
    working.touch(blocks("A", 4), 200.0)                    # A's first 4 once more
    # At 400 s the window starts at 100 s: everything was seen at 100 s or later.
    assert working.blocks(400.0) == 15
    # At 401 s the blocks last seen at 100 s (A 4-9 and B) have left; A 0-3 stay till 500 s.
    assert working.blocks(401.0) == 4
    assert working.blocks(501.0) == 0


def test_a_late_reference_counts_at_the_windows_latest_time():
    working = WorkingSet(horizon_s=10.0)
    working.touch(blocks("A", 3), 20.0)
    working.touch(blocks("B", 2), 5.0)  # reported late: counted at 20 s, not 5 s
    assert working.blocks(30.0) == 5
    assert working.blocks(30.5) == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 50.0), st.lists(st.integers(0, 30), max_size=12)),
                max_size=40),
       st.floats(0.0, 80.0))
def test_the_working_set_is_the_distinct_keys_seen_within_the_horizon(steps, later):
    """Against a brute-force count: each key's latest reference within the window."""
    horizon = 25.0
    working = WorkingSet(horizon)
    latest: dict[int, float] = {}
    now = 0.0
    for dt, keys in steps:
        now += dt
        working.touch(keys, now)
        for key in keys:
            latest[key] = now
        assert working.blocks(now) == sum(1 for t in latest.values() if t >= now - horizon)
    end = now + later
    assert working.blocks(end) == sum(1 for t in latest.values() if t >= end - horizon)


@pytest.mark.parametrize("working, capacity, factor", [
    (150, 200, 1.0),   # it fits: the copy costs its recompute
    (200, 200, 1.0),   # exactly full still fits
    (201, 200, 5.0),   # one block over: five times
    (300, 0, 1.0),     # no capacity known
])
def test_the_copy_costs_more_once_the_working_set_overflows(working, capacity, factor):
    assert copy_factor(working, capacity, 5.0) == factor


def fleet(capacity: int, pending=(0, 0)) -> list[ReplicaView]:
    return [ReplicaView(i, capacity_blocks=capacity, prefill_s_per_token=MS,
                        pending_prefill_tokens=pending[i]) for i in range(2)]


def route_after_fillers(policy: PrefixRoute, capacity: int = 100, busy: bool = False
                        ) -> Decision:
    """Replica 1 holds A (10 blocks) and has a 200-token prompt queued; replica 0 was sent
    278 other blocks (completed): 300 distinct blocks over a fleet of 2 x ``capacity``.
    ``busy``: then each replica computes a 960-token prompt (0.96 s) in the second before
    the request (not counted among the 300 blocks' fleet: 420 distinct blocks)."""
    replicas = fleet(capacity)

    def send(keys, rid, replica, extra=0, complete=True, view=replicas):
        request = RequestView(rid, len(keys) * B + extra, B, tuple(keys), now=0.0)
        policy.route(request, view)
        policy.on_routed(request, Decision(replica, "fixture"))
        if complete:
            policy.on_completed(request, replica, 0)

    send(blocks("A", 10), "warm", 1)
    send(blocks("C", 12), "short", 1, extra=8, complete=False)
    for family, n in (("F", 90), ("G", 90), ("H", 98)):
        send(blocks(family, n), family, 0)
    now = 0.0
    if busy:
        send(blocks("Y", 60), "Y", 1, complete=False)
        send(blocks("X", 60), "X", 0, complete=False, view=fleet(capacity, pending=(0, 960)))
        now = 1.0
    keys = blocks("A", 10) + blocks("B", 2)
    return policy.route(RequestView("r", len(keys) * B, B, keys, now=now),
                        fleet(capacity, pending=(0, 0 if busy else 200)))


def test_an_overflowing_fleet_prices_the_copy_higher():
    # Without the pressure, replica 0 pays 0.192 s prefill + 0.160 s copy of the 160 tokens
    # it lacks: 0.352 s; the holder 0.2 s wait + 0.032 s.
    calm = route_after_fillers(PrefixRoute(PrefixRouteParams(**LINEAR, copy_pressure=1.0),
                                           rules=()))
    assert calm.scores[0]["copy_s"] == pytest.approx(0.160)
    # 300 blocks over 200 (a quiet fleet): the copy costs 5 times as much, 0.8 s.
    pressed = route_after_fillers(PrefixRoute(PrefixRouteParams(**LINEAR), rules=()))
    assert pressed.scores[0]["copy_s"] == pytest.approx(0.800)
    assert pressed.scores[0]["cost_s"] == pytest.approx(0.192 + 0.800)
    assert pressed.scores[1]["copy_s"] == 0.0  # the holder copies nothing
    assert (pressed.replica, pressed.branch) == (1, "cache_affinity")


def test_a_fleet_whose_working_set_fits_keeps_the_plain_price():
    # The same requests on replicas of 150 blocks: 300 blocks fit in 2 x 150.
    policy = PrefixRoute(PrefixRouteParams(**LINEAR), rules=())
    assert route_after_fillers(policy, capacity=150).scores[0]["copy_s"] == pytest.approx(0.160)


def test_the_pressure_acts_below_half_the_prefill_utilisation_only():
    assert PRESSURE_RHO_MAX == 0.5
    # Both replicas computed for 0.96 s of the last second: the fleet's prefill utilisation
    # (the mean of the replicas' shown in the scores) is over one half, so the copy keeps
    # the price it has without the pressure.
    busy = route_after_fillers(PrefixRoute(PrefixRouteParams(**LINEAR), rules=()), busy=True)
    assert sum(busy.scores[i]["prefill_busy"] for i in (0, 1)) / 2 > 0.9
    plain = route_after_fillers(PrefixRoute(PrefixRouteParams(**LINEAR, copy_pressure=1.0),
                                            rules=()), busy=True)
    assert busy.scores[0]["copy_s"] == plain.scores[0]["copy_s"] > 0.1


def test_the_pressure_is_a_parameter_and_refuses_nonsense():
    assert create_policy("prefixroute").params.copy_pressure == 5.0
    assert create_policy("prefixroute:copy_pressure=2").params.copy_pressure == 2.0
    for bad in ("0.5", "-1", "inf", "nan"):
        with pytest.raises(ConfigError, match="copy_pressure"):
            create_policy(f"prefixroute:copy_pressure={bad}")
