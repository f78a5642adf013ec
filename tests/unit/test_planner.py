"""The fleet planner: its rules checked by hand, and one small plan end to end."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from prefixroute.core.economics.planner import (
    PlanInputs,
    choose_policy,
    make_plan,
    prefix_rates_per_hour,
    prefix_weights,
)
from prefixroute.core.economics.presets import FIVE_MINUTE, ONE_HOUR
from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.model_config import MODEL_PRESETS
from prefixroute.core.simulator.generators import design_scenario

# --- per-prefix traffic --------------------------------------------------------------------------


def test_the_hot_tenant_gets_its_share_and_the_rest_is_zipf():
    weights = prefix_weights(4, 0.25, 1.0)
    # Zipf over 3 tenants with exponent 1: 1, 1/2, 1/3 normalised by 11/6, times 0.75.
    assert weights == pytest.approx([0.25, 0.75 * 6 / 11, 0.75 * 3 / 11, 0.75 * 2 / 11])


def test_the_planner_uses_the_generators_popularity():
    counts = Counter(r.tenant for r in design_scenario(
        requests=6000, tenants=5, prefix_tokens=16, user_tokens_min=1, user_tokens_max=1))
    weights = prefix_weights(5, 0.25, 1.2)
    for index, weight in enumerate(weights):
        assert counts[f"tenant-{index:03d}"] / 6000 == pytest.approx(weight, abs=0.02)


def test_prefix_rates_of_the_spec_scenario():
    rates = prefix_rates_per_hour(PlanInputs())
    assert sum(rates) == pytest.approx(50_000 / 24)
    assert rates[0] == pytest.approx(0.25 * 50_000 / 24)  # the hot tenant: 520.8 per hour
    assert min(rates) < 1  # "some prefixes recur less than hourly"


# --- the routing rule ----------------------------------------------------------------------------


def row(policy, hit, p99, load):
    return {"policy": policy, "token_hit_rate": hit, "ttft_p99_s": p99, "max_mean_load": load}


def test_the_highest_hit_rate_within_the_load_cap_wins():
    rows = [row("round_robin", 0.60, 0.50, 1.00), row("affinity", 0.90, 0.90, 2.10),
            row("hybrid", 0.85, 0.52, 1.08)]
    chosen, why = choose_policy(rows, 1.25)
    assert chosen["policy"] == "hybrid"
    assert "over the load cap: affinity" in why


def test_hit_rates_within_half_a_point_are_a_tie_broken_by_ttft_p99():
    rows = [row("a", 0.850, 0.60, 1.1), row("b", 0.847, 0.50, 1.1), row("c", 0.80, 0.10, 1.0)]
    chosen, _ = choose_policy(rows, 1.25)
    assert chosen["policy"] == "b"


def test_without_a_policy_inside_the_cap_the_least_loaded_wins():
    rows = [row("a", 0.9, 0.5, 1.6), row("b", 0.8, 0.5, 1.4)]
    chosen, why = choose_policy(rows, 1.25)
    assert chosen["policy"] == "b"
    assert "no policy" in why


# --- inputs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("changes", [
    {"replicas": 0}, {"provider_share": 1.5}, {"hot_tenant_share": 1.0},
    {"user_tokens_min": 500, "user_tokens_max": 100}, {"max_load_ratio": 0.9},
    {"price_per_mtok": -1.0}, {"kv_memory_gib": 0.0}, {"provider_policies": ()},
])
def test_bad_inputs_are_config_errors(changes):
    with pytest.raises(ConfigError):
        PlanInputs(**changes)


# --- one small plan -------------------------------------------------------------------------------

SMALL = PlanInputs(tenants=12, prefix_tokens=1024, requests_per_day=20_000, replicas=4,
                   kv_memory_gib=0.5, sim_requests=240, accounting_requests=120,
                   policies=("round_robin", "hybrid:max_skew=8"),
                   provider_policies=(FIVE_MINUTE, ONE_HOUR))


@pytest.fixture(scope="module")
def small_plan() -> dict:
    return make_plan(SMALL)


def test_a_plan_has_every_section(small_plan):
    assert list(small_plan) == ["inputs", "summary", "layout", "keys_and_salts", "metrics",
                                "routing", "ttl", "kv_memory", "provider_accounting",
                                "cost_per_day"]
    assert set(small_plan["summary"]) == {"layout", "routing", "ttl", "kv_memory",
                                          "cost_per_day"}


def test_the_timestamp_at_the_top_measurably_lowers_the_hit_rate(small_plan):
    measured = small_plan["layout"]["timestamp_measured"]
    assert measured["fixed_token_hit_rate"] > measured["timestamp_at_top_token_hit_rate"] + 0.3
    assert measured["difference"] == pytest.approx(
        measured["fixed_token_hit_rate"] - measured["timestamp_at_top_token_hit_rate"])


def test_routing_reports_every_policy_run_and_follows_the_rule(small_plan):
    routing = small_plan["routing"]
    assert [r["policy"] for r in routing["policies"]] == ["round_robin", "hybrid:max_skew=8"]
    chosen, _ = choose_policy(routing["policies"], SMALL.max_load_ratio)
    assert routing["chosen"] == chosen["policy"]
    for r in routing["policies"]:
        assert 0 <= r["token_hit_rate"] <= 1 and r["ttft_p99_s"] > 0 and r["max_mean_load"] >= 1


def test_kv_bytes_per_token_and_fp8_halving(small_plan):
    kv = small_plan["kv_memory"]
    # llama-3-8b: 2 x 32 layers x 8 KV heads x 128 x 2 bytes = 131,072; FP8 65,536.
    assert kv["by_dtype"]["bf16"]["bytes_per_token"] == 131_072
    assert kv["by_dtype"]["fp8"]["bytes_per_token"] == 65_536
    assert kv["by_dtype"]["fp8"]["all_prefixes_gib"] == pytest.approx(
        kv["by_dtype"]["bf16"]["all_prefixes_gib"] / 2)
    # 12 prefixes x 1,024 tokens x 128 KiB = 1.5 GiB in bf16.
    assert kv["by_dtype"]["bf16"]["all_prefixes_gib"] == pytest.approx(1.5)
    assert set(kv["measured"]) == {"bf16", "fp8"}
    assert kv["measured"]["fp8"]["cache_blocks"] == 2 * kv["measured"]["bf16"]["cache_blocks"]


def test_the_partitioned_working_set_counts_the_hot_tenant_on_several_replicas(small_plan):
    kv = small_plan["kv_memory"]
    # Hot share 0.25 of 4 replicas: ceil(1.0) = 1 copy.
    assert kv["hot_tenant_copies"] == 1
    assert kv["per_replica_partitioned_tokens"] == pytest.approx(kv["working_set_tokens"] / 4)
    rates = prefix_rates_per_hour(SMALL)
    expected = sum(1 - math.exp(-r) for r in rates) * 1024  # rate per hour x 1 hour
    assert kv["working_set_tokens"] == pytest.approx(expected)


def test_ttl_classes_cover_every_prefix_once(small_plan):
    classes = small_plan["ttl"]["classes"]
    assert sum(c["prefixes"] for c in classes.values()) == SMALL.tenants
    assert classes["hot"]["prefixes"] == 1
    for c in classes.values():  # the cheapest option, or one within the 1% tie
        assert c["usd_per_day"] <= 1.01 * min(c["usd_per_day_by_option"].values())


def test_the_hot_tenant_takes_the_shorter_ttl_when_it_costs_the_same():
    # 520 requests/hour at the provider: both TTLs always hit; 5 minutes has the lower premium.
    plan = make_plan(replace(SMALL, tenants=2, provider_share=1.0, hot_tenant_share=0.5,
                             requests_per_day=25_000, sim_requests=60, accounting_requests=40))
    assert plan["ttl"]["classes"]["hot"]["choice"] == "5m_1.25x"


def test_without_prewarming_rare_prefixes_are_not_cached():
    plan = make_plan(replace(SMALL, tenants=40, requests_per_day=800, allow_prewarm=False,
                             sim_requests=60, accounting_requests=40))
    rare = plan["ttl"]["classes"]["rare"]
    assert rare["choice"] == "no_cache"
    assert not any(name.endswith("+prewarm") for name in rare["usd_per_day_by_option"])


def test_provider_accounting_shows_the_breakpoint_failure_and_fix(small_plan):
    layouts = small_plan["provider_accounting"]["layouts"]
    end = layouts["breakpoint_at_end"]["policies"]["5m_1.25x"]
    static = layouts["breakpoint_at_static_end"]["policies"]["5m_1.25x"]
    assert end["read_tokens"] == 0  # the breakpoint after the unique user turn never reads
    assert static["read_tokens"] > 0
    assert static["usd_per_day"] < end["usd_per_day"]


def test_cost_per_day_adds_up(small_plan):
    cost = small_plan["cost_per_day"]
    provider, self_hosted = cost["provider"], cost["self_hosted"]
    assert provider["planned_usd_per_day"] == pytest.approx(
        provider["prefix_usd_per_day"] + provider["suffix_usd_per_day"])
    assert provider["planned_usd_per_day"] < provider["no_cache_usd_per_day"]
    assert self_hosted["prefill_gpu_hours_planned"] < self_hosted["prefill_gpu_hours_no_cache"]
    assert cost["total_usd_per_day"] == pytest.approx(
        self_hosted["fleet_usd_per_day"] + provider["planned_usd_per_day"])
    # 4 replicas x 24 h x $2.50.
    assert self_hosted["fleet_usd_per_day"] == pytest.approx(240.0)


def test_the_growing_conversation_demo_is_part_of_the_layout(small_plan):
    demo = small_plan["layout"]["growing_conversation"]
    assert demo["layouts"]["end"]["read_tokens"] == 0
    assert demo["layouts"]["static,end"]["read_tokens"] == 5 * 2048


def test_an_unknown_policy_fails_before_any_run():
    with pytest.raises(ConfigError):
        make_plan(replace(SMALL, policies=("round_robin", "nosuch")))


def test_a_model_shape_comes_from_presets():
    assert PlanInputs().model == MODEL_PRESETS["llama-3-8b"]
