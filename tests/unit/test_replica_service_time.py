"""The service-time model: step durations a reader can check by hand."""

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.service_time import (INSTANT, LLAMA3_8B_H100, PRESETS,
                                                   ServiceTimeModel, get_profile,
                                                   profile_from_dict)

# a = 10 ms per step, b = 0.1 ms per prompt token, c = 1e-8 s per token x context,
# d1 = 1 ms per decoding request, d2 = 1e-6 s per context token.
MODEL = ServiceTimeModel("hand", step_overhead_s=0.01, prefill_s_per_token=1e-4,
                         attention_s_per_token_context=1e-8, decode_s_per_seq=1e-3,
                         decode_s_per_context_token=1e-6)


def test_prefill_time_is_overhead_plus_linear_plus_quadratic_attention():
    # 1,000 uncached tokens after a 3,000-token cached prefix: context 4,000.
    # 0.01 + 1e-4 * 1000 + 1e-8 * 1000 * 4000 = 0.01 + 0.1 + 0.04 = 0.15 s
    assert MODEL.prefill_time(1000, 4000) == pytest.approx(0.15)


def test_a_fully_cached_prompt_costs_no_prefill():
    assert MODEL.prefill_time(0, 4000) == 0.0


def test_decode_step_time_grows_with_batch_and_context():
    # 8 requests holding 16,000 context tokens: 0.01 + 8 * 1e-3 + 16000 * 1e-6 = 0.034 s
    assert MODEL.decode_step_time(8, 16_000) == pytest.approx(0.034)


def test_a_mixed_step_pays_the_overhead_once():
    # 100 prompt tokens (context 100) + 2 decodes with 300 context tokens:
    # 0.01 + 0.01 + 1e-8 * 100 * 100 + 2e-3 + 3e-4 = 0.0224 s
    assert MODEL.step_time(100, 100 * 100, 2, 300) == pytest.approx(0.0224)
    assert MODEL.step_time(0, 0, 0, 0) == 0.0


def test_llama3_8b_h100_prefills_10k_fresh_tokens_in_about_half_a_second():
    # 6e-3 + 4e-5 * 10,000 + 9e-10 * 10,000 * 10,000 = 0.006 + 0.4 + 0.09 = 0.496 s
    assert LLAMA3_8B_H100.prefill_time(10_000, 10_000) == pytest.approx(0.496)
    assert LLAMA3_8B_H100.source  # every preset says where its numbers come from


def test_scaled_multiplies_every_duration_and_zero_turns_time_off():
    assert MODEL.scaled(2).prefill_time(1000, 4000) == pytest.approx(0.3)
    assert MODEL.scaled(0).decode_step_time(8, 16_000) == 0.0
    assert INSTANT.prefill_time(10_000, 10_000) == 0.0


def test_the_request_overhead_defaults_to_zero_scales_and_round_trips():
    from dataclasses import replace

    assert MODEL.request_overhead_s == 0.0 and LLAMA3_8B_H100.request_overhead_s == 0.0
    with_overhead = replace(MODEL, request_overhead_s=0.015)
    assert with_overhead.scaled(2).request_overhead_s == pytest.approx(0.03)
    assert with_overhead.scaled(0).request_overhead_s == 0.0
    assert with_overhead.to_dict()["request_overhead_s"] == 0.015
    assert profile_from_dict(with_overhead.to_dict()) == with_overhead
    # Step durations do not include it.
    assert with_overhead.prefill_time(1000, 1000) == MODEL.prefill_time(1000, 1000)
    # Profiles written before the field existed load with 0.
    old = {k: v for k, v in MODEL.to_dict().items() if k != "request_overhead_s"}
    assert profile_from_dict(old) == MODEL
    with pytest.raises(ConfigError, match="non-negative"):
        profile_from_dict({"base": "instant", "request_overhead_s": -0.1})


def test_profile_from_dict_overrides_a_preset():
    profile = profile_from_dict({"base": "llama-3-8b-h100", "prefill_s_per_token": 5e-5})
    assert profile.prefill_s_per_token == 5e-5
    assert profile.step_overhead_s == LLAMA3_8B_H100.step_overhead_s


def test_profile_from_dict_round_trips_a_calibration_result():
    assert profile_from_dict(MODEL.to_dict()) == MODEL


def test_profile_from_dict_rejects_unknown_and_missing_fields():
    with pytest.raises(ConfigError, match="unknown field.*prefil_s_per_token"):
        profile_from_dict({"base": "instant", "prefil_s_per_token": 1.0})
    with pytest.raises(ConfigError, match="missing field"):
        profile_from_dict({"name": "x", "step_overhead_s": 0.01})


def test_negative_durations_are_refused():
    with pytest.raises(ConfigError, match="non-negative"):
        profile_from_dict({"base": "instant", "decode_s_per_seq": -1})


def test_unknown_preset_names_the_presets():
    with pytest.raises(ConfigError, match="llama-3-8b-h100"):
        get_profile("h200")
    assert set(PRESETS) >= {"llama-3-8b-h100", "llama-3-70b-4xh100", "instant"}
