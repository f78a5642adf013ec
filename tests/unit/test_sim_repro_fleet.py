"""The worked examples' four-replica fleet, exactly, through the library's caches and routing."""

from prefixroute.core.simulator.repro_fleet import repro_fleet


def test_fleet_hit_rates_random_prefix_aware_and_timestamp_at_top():
    result = repro_fleet()
    assert round(result["random"], 3) == 0.837
    assert round(result["prefix_aware"], 3) == 0.968
    assert result["timestamp_at_top"] == 0.0
    # The exact fractions of the worked example's random stream: hit blocks x 16 / 4,120,000 tokens.
    assert round(result["random"] * 4_120_000) == 3_447_200
    assert round(result["prefix_aware"] * 4_120_000) == 3_988_800
