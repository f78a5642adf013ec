"""Invariants of the fleet simulation, over random small workloads and fleets."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.replica.service_time import INSTANT, LLAMA3_8B_H100
from prefixroute.core.simulator.generators import hot_burst, seed_fleet
from prefixroute.core.simulator.simulation import FleetConfig, prepare_workload, simulate_policy

POLICIES = ["round_robin", "random", "least_loaded", "affinity_only", "hybrid"]
fleets = st.builds(lambda replicas, blocks, fast: FleetConfig(
    replicas, blocks, 16, INSTANT if fast else LLAMA3_8B_H100),
    st.integers(1, 4), st.integers(140, 600), st.booleans())


def workload(seed: int, n: int):
    return prepare_workload(hot_burst(duration_s=20, families=3, family_tokens=300,
                                      base_rate=3, hot_tokens=400, bursts=1, burst_size=n,
                                      burst_window_s=1, user_tokens=20, output_tokens=8,
                                      seed=seed))


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10 ** 6), fleet=fleets, policy=st.sampled_from(POLICIES))
def test_a_seed_gives_the_same_run_twice(seed, fleet, policy):
    first = simulate_policy(workload(seed, 10), fleet, policy, seed=seed)
    again = simulate_policy(workload(seed, 10), fleet, policy, seed=seed)
    assert first.summary == again.summary
    assert first.cached_tokens == again.cached_tokens


@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 10 ** 6), fleet=fleets, policy=st.sampled_from(POLICIES))
def test_no_request_hits_more_than_the_ideal_cache(seed, fleet, policy):
    prepared = workload(seed, 12)
    run = simulate_policy(prepared, fleet, policy, seed=seed)
    for cached, ideal in zip(run.cached_tokens, prepared.ideal_cached):
        assert cached <= ideal
    assert run.summary["recomputed_prefill_tokens"] >= 0


@settings(max_examples=15, deadline=None)
@given(n=st.integers(5, 60), fleet=fleets, policy=st.sampled_from(POLICIES))
def test_reused_plus_fresh_is_every_input_token(n, fleet, policy):
    prepared = prepare_workload(seed_fleet(requests=n))
    run = simulate_policy(prepared, fleet, policy)
    s = run.summary
    assert s["completed"] + s["rejected"] == n
    assert s["reused_prefix_tokens"] + s["fresh_prefill_tokens"] == s["input_tokens"]
    assert sum(s["assignments"]) == n
