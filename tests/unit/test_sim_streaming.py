"""Generated Mooncake-format sessions, and the streamed simulation that replays them."""

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.service_time import DEFAULT_PROFILE, PRESETS
from prefixroute.core.simulator.generators import diurnal_rate, mooncake_sessions
from prefixroute.core.simulator.simulation import FleetConfig, prepare_workload, simulate_policy
from prefixroute.core.simulator.streaming import simulate_stream


def test_sessions_repeat_for_a_seed_and_arrive_in_order():
    a = [(r.arrival_s, r.hash_ids) for r in mooncake_sessions(300, seed=4)]
    b = [(r.arrival_s, r.hash_ids) for r in mooncake_sessions(300, seed=4)]
    c = [(r.arrival_s, r.hash_ids) for r in mooncake_sessions(300, seed=5)]
    assert a == b and a != c
    assert all(x[0] <= y[0] for x, y in zip(a, a[1:]))


def test_each_turn_extends_the_previous_prompt_and_sessions_share_system_prompts():
    requests = list(mooncake_sessions(400, seed=1, mean_turns=3.0))
    by_session = {}
    for r in requests:
        assert len(r.hash_ids) == -(-r.input_tokens // 512)  # Mooncake's ceil rule
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for before, after in zip(turns, turns[1:]):
            assert after.input_tokens > before.input_tokens + before.output_tokens - 1
            full = before.input_tokens // 512
            assert after.hash_ids[:full] == before.hash_ids[:full]  # full blocks kept
            if before.input_tokens % 512:  # its partial block grew: a new id
                assert after.hash_ids[full] != before.hash_ids[full]
    same_system = [r for r in requests if r.turn == 0 and r.tenant == requests[0].tenant]
    assert len(same_system) > 1
    assert same_system[0].hash_ids[0] == same_system[1].hash_ids[0]


def test_diurnal_rate_peaks_at_14h_and_is_lowest_at_2h():
    assert diurnal_rate(14 * 3600, 10.0, 0.5) == pytest.approx(15.0)
    assert diurnal_rate(2 * 3600, 10.0, 0.5) == pytest.approx(5.0)
    assert diurnal_rate(123.0, 10.0, 0.0) == 10.0


def test_generator_refuses_bad_parameters():
    with pytest.raises(ConfigError):
        next(mooncake_sessions(10, diurnal_amplitude=1.0))
    with pytest.raises(ConfigError):
        next(mooncake_sessions(10, rate=0))


FLEET = FleetConfig(4, 120, 512, PRESETS[DEFAULT_PROFILE])


@pytest.mark.parametrize("spec", ["round_robin", "prefixroute", "prefix_hash"])
def test_streamed_run_reports_what_the_held_run_reports(spec):
    held = simulate_policy(prepare_workload(mooncake_sessions(600, seed=3, rate=30)),
                           FLEET, spec).summary
    streamed = simulate_stream(mooncake_sessions(600, seed=3, rate=30), FLEET, spec)
    assert streamed["token_hit_rate"] > 0
    for key, value in streamed.items():
        assert held[key] == value, key
