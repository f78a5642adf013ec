"""The plots' data handling: long timelines are binned, and the sweep plot puts the grid's
longest dimension on the x axis so that lines have points to join."""

from __future__ import annotations

import pytest

from prefixroute.edges.cli.simulate import binned_load, render_plots
from prefixroute.edges.cli.sweep import render_sweep_plot, sweep_axes


def test_binned_load_is_the_mean_per_bin_per_replica():
    # Times 0..3 in 2 bins [0, 1.5) and [1.5, 3]: replica 0 has 1, 3 | 5, 7; replica 1 0, 0 | 2, 2.
    t, load = binned_load([0, 1, 2, 3], [[1, 0], [3, 0], [5, 2], [7, 2]], bins=2)
    assert list(t) == [0.75, 2.25]
    assert load.tolist() == [[2.0, 0.0], [6.0, 2.0]]


def test_an_empty_bin_repeats_the_level_before_it():
    t, load = binned_load([0, 0.1, 9.9, 10], [[4], [4], [1], [1]], bins=4)
    assert load[:, 0].tolist() == [4.0, 4.0, 4.0, 1.0]


def test_a_long_timeline_becomes_a_fixed_number_of_points():
    times = [i * 0.01 for i in range(50_000)]
    t, load = binned_load(times, [[i % 7, i % 3] for i in range(50_000)], bins=300)
    assert load.shape == (300, 2) and len(t) == 300


@pytest.mark.parametrize("replicas, blocks, expected", [
    ([2, 4, 8], [400], ("replicas", None)),
    ([4], [200, 400, 800], ("cache_blocks", None)),
    ([2, 4], [200, 400, 800], ("cache_blocks", "replicas")),
    ([4], [400], ("policy", None)),
])
def test_the_sweep_plot_varies_what_the_grid_varies(replicas, blocks, expected):
    assert sweep_axes({"replicas": replicas, "cache_blocks": blocks}) == expected


def test_every_sweep_shape_renders_a_png():
    rows = [{"replicas": r, "cache_blocks": 400, "policy": p, "token_hit_rate": 0.5,
             "ttft_p99_s": 0.1} for r in (2, 4) for p in ("a", "b")]
    result = {"grid": {"replicas": [2, 4], "cache_blocks": [400], "policies": ["a", "b"]},
              "results": rows, "ideal_token_hit_rate": 0.9, "workload": {"requests": 10}}
    assert render_sweep_plot(result).startswith(b"\x89PNG")
    one = dict(result, grid={"replicas": [2], "cache_blocks": [400], "policies": ["a", "b"]},
               results=rows[:2])
    assert render_sweep_plot(one).startswith(b"\x89PNG")


def test_simulate_plots_render_for_a_small_run():
    from prefixroute.core.simulator.generators import make_workload
    from prefixroute.core.simulator.simulation import prepare_workload
    from prefixroute.edges.cli.simulate import DEFAULT_PROFILE, FleetConfig, run_policies
    from prefixroute.edges.profiles import load_profile

    workload = prepare_workload(make_workload("universal-prefix", {}), info={})
    fleet = FleetConfig(5, 1000, workload.block_size, load_profile(DEFAULT_PROFILE))
    runs = run_policies(workload, fleet, ["round_robin", "least_loaded", "random", "hybrid"])
    plots = render_plots(workload, runs)
    assert sorted(plots) == ["hit_rates.png", "load_over_time.png", "ttft_cdf.png"]
