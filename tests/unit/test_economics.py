"""Provider prompt-cache economics: the formulas and the worked example's numbers.

Expected values are written so they can be checked by hand: e.g. break-even of the 5-minute
preset is (1.25 - 1) / (1.25 - 0.1) = 0.25 / 1.15 = 0.2174.
"""

from __future__ import annotations

import math

import pytest

from prefixroute.core.economics.advice import NO_CACHE, advise_ttl
from prefixroute.core.economics.formulas import (
    break_even_hit_rate,
    cost_multiplier,
    poisson_hit_probability,
    prefix_cost_per_day,
    storage_cost,
)
from prefixroute.core.economics.presets import (
    EXPLICIT_OBJECT,
    FIVE_MINUTE,
    NO_WRITE_PREMIUM,
    ONE_HOUR,
    PRESETS,
    RATE_TABLE_POLICIES,
    CachePolicy,
    custom_policy,
    format_ttl,
    parse_ttl,
    preset,
)
from prefixroute.core.economics.repro import WorkedExample, economics_report, repro_economics
from prefixroute.core.errors import ConfigError

# --- formulas -----------------------------------------------------------------------------------


def test_cost_multiplier_is_reads_for_hits_and_writes_for_misses():
    # 0.5 * 0.1 + 0.5 * 1.25 = 0.675
    assert cost_multiplier(0.5, write=1.25, read=0.1) == pytest.approx(0.675)


def test_cost_multiplier_without_hits_is_the_write_premium():
    assert cost_multiplier(0.0, write=2.0, read=0.1) == 2.0


def test_break_even_five_minute_is_21_7_percent():
    assert break_even_hit_rate(1.25, 0.1) == pytest.approx(0.25 / 1.15)
    assert round(break_even_hit_rate(1.25, 0.1), 3) == 0.217


def test_break_even_one_hour_is_52_6_percent():
    assert round(break_even_hit_rate(2.0, 0.1), 3) == 0.526  # 1.0 / 1.9


def test_break_even_without_write_premium_is_zero():
    assert break_even_hit_rate(1.0, 0.1) == 0.0


def test_break_even_is_infinite_when_reads_cost_as_much_as_premium_writes():
    assert break_even_hit_rate(1.5, 1.5) == math.inf


def test_poisson_p_hit_at_one_request_per_ttl_is_one_minus_one_over_e():
    # 12 requests/hour with a 5-minute TTL: lambda*T = 1
    assert poisson_hit_probability(12, 300) == pytest.approx(1 - math.exp(-1))


def test_poisson_p_hit_is_zero_without_traffic():
    assert poisson_hit_probability(0, 300) == 0.0


def test_prefix_cost_per_day_counts_prefix_tokens_at_the_base_price():
    # 50,000 requests x 10,000 tokens = 500 Mtok at $3 = $1,500
    assert prefix_cost_per_day(50_000, 10_000, 3.0) == pytest.approx(1500.0)


def test_prefix_cost_per_day_scales_with_the_multiplier():
    assert prefix_cost_per_day(50_000, 10_000, 3.0, multiplier=0.1) == pytest.approx(150.0)


def test_storage_cost_is_per_million_tokens_per_hour():
    # 10,000 tokens = 0.01 Mtok, at $1 per Mtok-hour for 24 hours = $0.24
    assert storage_cost(10_000, 1.0, 24) == pytest.approx(0.24)


@pytest.mark.parametrize("call", [
    lambda: cost_multiplier(0.5, write=-1.0, read=0.1),
    lambda: cost_multiplier(0.5, write=1.25, read=-0.1),
    lambda: cost_multiplier(1.5, write=1.25, read=0.1),
    lambda: poisson_hit_probability(-1, 300),
    lambda: poisson_hit_probability(1, 0),
    lambda: prefix_cost_per_day(10, 10_000, -3.0),
    lambda: break_even_hit_rate(1.25, math.nan),
], ids=["negative write", "negative read", "hit rate above 1", "negative rate", "zero TTL",
        "negative price", "NaN read"])
def test_formulas_reject_impossible_inputs(call):
    with pytest.raises(ConfigError):
        call()


def test_read_above_write_is_rejected_with_both_numbers_named():
    with pytest.raises(ConfigError, match="read multiplier 2 is above write multiplier 1.25"):
        break_even_hit_rate(1.25, 2.0)


# --- presets and TTL parsing ----------------------------------------------------------------------


@pytest.mark.parametrize("text, seconds", [("5m", 300), ("1h", 3600), ("300s", 300),
                                           ("1.5h", 5400), ("2 min", 120), ("1d", 86400)])
def test_parse_ttl_reads_number_and_unit(text, seconds):
    assert parse_ttl(text) == seconds


def test_parse_ttl_rejects_unknown_unit():
    with pytest.raises(ConfigError, match="unknown TTL unit 'x'"):
        parse_ttl("5x")


def test_parse_ttl_requires_a_unit():
    with pytest.raises(ConfigError, match="no unit"):
        parse_ttl("300")


def test_format_ttl_uses_the_largest_whole_unit():
    assert [format_ttl(s) for s in (300, 3600, 90, 5400)] == ["5m", "1h", "90s", "90m"]


def test_presets_carry_their_spec_multipliers():
    def terms(p):
        return p.ttl_seconds, p.write_multiplier, p.read_multiplier

    assert terms(FIVE_MINUTE) == (300, 1.25, 0.1)
    assert terms(ONE_HOUR) == (3600, 2.0, 0.1)
    assert terms(NO_WRITE_PREMIUM) == (300, 1.0, 0.1)


def test_every_preset_has_a_date_and_a_source():
    for policy in PRESETS.values():
        assert policy.as_of == "Oct 2026"
        assert "not a quote" in policy.source


def test_explicit_cache_object_bills_hourly_storage():
    assert EXPLICIT_OBJECT.explicit and EXPLICIT_OBJECT.storage_usd_per_mtok_hour > 0


def test_rate_table_policies_are_the_three_spec_columns_in_order():
    assert [p.name for p in RATE_TABLE_POLICIES] == ["5m_1.25x", "1h_2x", "5m_1.0x"]


def test_preset_fields_can_be_overridden():
    assert preset("1h_2x", read_multiplier=0.05).read_multiplier == 0.05


def test_overriding_a_preset_is_validated():
    with pytest.raises(ConfigError):
        preset("5m_1.25x", read_multiplier=2.0)


def test_unknown_preset_name_is_a_config_error():
    with pytest.raises(ConfigError, match="unknown cache policy preset"):
        preset("7m_9x")


def test_custom_policy_with_a_preset_ttl_and_write_reprices_that_preset():
    policies = custom_policy(300, 1.25, 0.05)
    assert [p.name for p in policies] == ["5m_1.25x", "1h_2x", "5m_1.0x"]
    assert policies[0].read_multiplier == 0.05


def test_custom_policy_otherwise_is_appended_under_a_derived_name():
    policies = custom_policy(600, 1.5, 0.1)
    assert policies[-1].name == "10m_1.5x"
    assert len(policies) == 4


def test_cache_policy_rejects_read_above_write():
    with pytest.raises(ConfigError):
        CachePolicy("bad", ttl_seconds=300, write_multiplier=1.0, read_multiplier=1.5)


# --- the worked example's report -------------------------------------------------------------


def _cell(report, rate, policy):
    row = next(r for r in report["rates"] if r["requests_per_hour"] == rate)
    return round(row[policy]["p_hit"], 2), round(row[policy]["multiplier"], 2)


def test_report_break_even_lines():
    report = repro_economics()
    assert {k: round(v, 3) for k, v in report["break_even"].items()} == {
        "5m_1.25x": 0.217, "1h_2x": 0.526, "5m_1.0x": 0.0}


def test_report_one_request_per_hour():
    report = repro_economics()
    assert _cell(report, 1, "5m_1.25x") == (0.08, 1.16)
    assert _cell(report, 1, "1h_2x") == (0.63, 0.80)
    assert _cell(report, 1, "5m_1.0x") == (0.08, 0.93)


def test_report_six_requests_per_hour():
    report = repro_economics()
    assert _cell(report, 6, "5m_1.25x") == (0.39, 0.80)
    assert _cell(report, 6, "1h_2x") == (1.00, 0.10)
    assert _cell(report, 6, "5m_1.0x") == (0.39, 0.65)


def test_report_twelve_requests_per_hour():
    report = repro_economics()
    assert _cell(report, 12, "5m_1.25x") == (0.63, 0.52)
    assert _cell(report, 12, "1h_2x") == (1.00, 0.10)
    assert _cell(report, 12, "5m_1.0x") == (0.63, 0.43)


def test_report_sixty_requests_per_hour():
    report = repro_economics()
    assert _cell(report, 60, "5m_1.25x") == (0.99, 0.11)
    assert _cell(report, 60, "1h_2x") == (1.00, 0.10)
    assert _cell(report, 60, "5m_1.0x") == (0.99, 0.11)


def test_report_six_hundred_requests_per_hour_is_all_reads():
    report = repro_economics()
    for policy in ("5m_1.25x", "1h_2x", "5m_1.0x"):
        assert _cell(report, 600, policy) == (1.00, 0.10)


def test_worked_example_rate_is_about_10_4_per_hour_per_prefix():
    assert WorkedExample().requests_per_hour_per_prefix == pytest.approx(50_000 / 200 / 24)


def test_worked_example_costs():
    worked = repro_economics()["worked_example"]
    assert round(worked["no_caching_usd_per_day"]) == 1500
    assert (round(worked["5m_1.25x"]["p_hit"], 2), round(worked["5m_1.25x"]["usd_per_day"])) == (0.58, 874)
    assert (round(worked["1h_2x"]["p_hit"], 2), round(worked["1h_2x"]["usd_per_day"])) == (1.00, 150)
    assert (round(worked["5m_1.0x"]["p_hit"], 2), round(worked["5m_1.0x"]["usd_per_day"])) == (0.58, 717)


def test_report_rejects_duplicate_policy_names():
    with pytest.raises(ConfigError, match="unique"):
        economics_report((FIVE_MINUTE, FIVE_MINUTE))


def test_report_rejects_negative_rates():
    with pytest.raises(ConfigError):
        economics_report(rates_per_hour=(-1,))


def test_worked_example_needs_at_least_one_prefix():
    with pytest.raises(ConfigError):
        WorkedExample(prefixes=0)


# --- per-prefix TTL advice ------------------------------------------------------------------------


def test_advice_says_do_not_cache_when_every_option_is_below_break_even():
    # 1 request/hour on the 5-minute premium preset alone: P(hit) 8% < 21.7% break-even
    advice = advise_ttl(1, 10_000, 3.0, policies=(FIVE_MINUTE,))
    assert advice.best.name == NO_CACHE
    assert advice.notes[0].startswith("do not cache")
    assert "below the 21.7% break-even" in advice.option("5m_1.25x").note


def test_advice_picks_the_one_hour_ttl_for_the_worked_example_rate():
    # 10.4 requests/hour: 1h P(hit) ~100% at x0.10 = $0.75/day against $7.50 uncached
    advice = advise_ttl(50_000 / 200 / 24, 10_000, 3.0)
    assert advice.best.name == "1h_2x"
    assert advice.best.usd_per_day == pytest.approx(0.75, abs=0.001)
    assert advice.no_cache_usd_per_day == pytest.approx(7.50)


def test_prewarm_costs_one_read_per_ttl_period_plus_one_write_a_day():
    # 1h TTL: 24 keep-alive reads x 0.1 + 1 write x 2.0 = 4.4 prefix-equivalents of $0.03
    option = advise_ttl(1, 10_000, 3.0).option("1h_2x+prewarm")
    assert option.overhead_usd_per_day == pytest.approx(4.4 * 0.03)
    assert option.p_hit == 1.0


def test_prewarm_pays_for_a_prefix_that_misses_often():
    # 1 request/hour on 1h_2x: plain $0.575/day; pre-warmed 24 x $0.003 + $0.132 = $0.204/day
    advice = advise_ttl(1, 10_000, 3.0, policies=(ONE_HOUR,))
    assert advice.best.name == "1h_2x+prewarm"
    assert advice.best.usd_per_day == pytest.approx(0.204)
    assert advice.notes[1].startswith("pre-warming 1h_2x pays")


def test_prewarm_does_not_pay_for_a_cold_prefix():
    # 1 request/day: pre-warming costs $0.132/day, caching saves at most $0.03
    advice = advise_ttl(1 / 24, 10_000, 3.0, policies=(ONE_HOUR,))
    assert advice.best.name == NO_CACHE
    assert "does not pay" in advice.notes[1]


def test_prewarm_is_not_needed_for_a_prefix_already_hot():
    advice = advise_ttl(600, 10_000, 3.0, policies=(FIVE_MINUTE,))
    assert advice.best.name == "5m_1.25x"
    assert "already hot" in advice.notes[1]


def test_explicit_object_pays_storage_for_the_hours_it_is_alive():
    # 1 request/hour, 1h TTL: alive 63.2% of 24 h; 0.01 Mtok x $1 x 15.17 h = $0.152
    option = advise_ttl(1, 10_000, 3.0).option("explicit_1h")
    assert option.overhead_usd_per_day == pytest.approx(0.01 * 24 * (1 - math.exp(-1)))


def test_advice_without_traffic_is_do_not_cache():
    assert advise_ttl(0, 10_000, 3.0).best.name == NO_CACHE
