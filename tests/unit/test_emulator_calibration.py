"""Fitting a service-time profile to probes (core/replica/calibration.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.calibration import (
    DecodeSample,
    PrefillSample,
    calibrated_profile,
    fit_decode,
    fit_prefill,
    nonnegative_least_squares,
)
from prefixroute.core.replica.service_time import profile_from_dict

A, B, C = 0.01, 1e-4, 2e-8
D1, D2 = 2e-3, 1e-6


def prefill_samples():
    return [PrefillSample(u, A + B * u + C * u * u) for u in (16, 128, 512, 1024, 4000)]


def decode_samples(step=A):
    return [DecodeSample(b, ctx, step + D1 * b + D2 * ctx)
            for b, ctx in ((1, 144), (1, 2016), (4, 576), (4, 8064))]


def test_exact_prefill_timings_give_back_the_coefficients():
    fit = fit_prefill(prefill_samples())
    assert fit.coefficients == pytest.approx((A, B, C), rel=1e-6)
    assert fit.r_squared == pytest.approx(1.0)


def test_exact_decode_timings_give_back_the_coefficients():
    assert fit_decode(decode_samples()).coefficients == pytest.approx((A, D1, D2), rel=1e-6)
    assert fit_decode(decode_samples(), A).coefficients == pytest.approx((A, D1, D2), rel=1e-6)


def test_per_request_overhead_outside_steps_stays_out_of_the_step_overhead():
    # A server whose TTFT carries 10 ms of HTTP and tokenizing on top of a 2 ms step.
    prefill = [PrefillSample(s.uncached_tokens, s.ttft_s + 0.002 - A) for s in prefill_samples()]
    prefill = [PrefillSample(s.uncached_tokens, s.ttft_s + 0.010) for s in prefill]
    profile, summary = calibrated_profile("fitted", prefill, decode_samples(step=0.002))
    assert profile.step_overhead_s == pytest.approx(0.002)
    assert summary["prefill"]["request_overhead_s"] == pytest.approx(0.010)
    assert profile.request_overhead_s == pytest.approx(0.010)  # written into the profile
    assert profile.prefill_s_per_token == pytest.approx(B)
    # The profile's TTFT for a lone prefill is the measured one again: o + a' + b*u + c*u^2.
    for sample in prefill:
        u = sample.uncached_tokens
        assert profile.request_overhead_s + profile.prefill_time(u, u) == \
            pytest.approx(sample.ttft_s)


def test_without_decode_probes_the_overhead_stays_in_the_step():
    profile, summary = calibrated_profile("fitted", prefill_samples())
    assert profile.step_overhead_s == pytest.approx(A)
    assert profile.request_overhead_s == 0.0 and "request_overhead_s" not in summary["prefill"]


def test_coefficients_are_never_negative():
    # TTFT falling with size would need b < 0; the fit clamps b at 0 instead.
    samples = [PrefillSample(u, 0.05 - 1e-6 * u) for u in (10, 100, 1000)]
    assert min(fit_prefill(samples).coefficients) >= 0


def test_nnls_matches_the_unconstrained_optimum_when_that_is_feasible():
    rng = np.random.default_rng(0)
    design = rng.random((20, 3))
    truth = np.array([0.5, 1.5, 2.0])
    assert nonnegative_least_squares(design, design @ truth) == pytest.approx(truth)


def test_a_prefill_fit_needs_three_sizes():
    with pytest.raises(ConfigError, match="three or more"):
        fit_prefill([PrefillSample(10, 0.1), PrefillSample(20, 0.2), PrefillSample(20, 0.2)])


def test_the_profile_round_trips_through_profile_from_dict():
    profile, summary = calibrated_profile("fitted", prefill_samples(), decode_samples(),
                                          source="test")
    assert (profile.step_overhead_s, profile.decode_s_per_seq) == pytest.approx((A, D1))
    assert summary["prefill"]["samples"] == 5 and "decode" in summary
    loaded = profile_from_dict(json.loads(json.dumps(profile.to_dict())))
    assert loaded == profile


def test_without_decode_probes_the_decode_terms_come_from_the_base():
    profile, summary = calibrated_profile("fitted", prefill_samples(), base="llama-3-8b-h100")
    assert profile.decode_s_per_seq == 5.0e-5 and "decode" not in summary


# A small model on a CPU: 22 ms outside the steps plus 10 us per token, no visible attention
# term up to 1,843 tokens (the probe sizes of a 2,048-token context).
SMALL_A, SMALL_B = 0.022, 1e-5
SMALL_SIZES = (16, 64, 128, 256, 512, 1024, 1843)


def noisy_line_samples(seed: int, noise_s: float = 0.002, slow_probe: int | None = None):
    rng = np.random.default_rng(seed)
    samples = []
    for u in SMALL_SIZES:
        ttft = SMALL_A + SMALL_B * u + rng.normal(0.0, noise_s)
        if u == slow_probe:
            ttft += 0.015  # a spell of load on a shared machine
        samples.append(PrefillSample(u, ttft))
    return samples


def test_a_noisy_straight_line_keeps_its_per_token_cost():
    # 2 ms of noise per median: now and then the noise looks curved enough to keep a small
    # c, but the per-token cost never vanishes and the curve stays on the line.
    straight = 0
    for seed in range(40):
        a, b, c = fit_prefill(noisy_line_samples(seed)).coefficients
        assert b > 0
        straight += c == 0.0
        for u in SMALL_SIZES:
            assert a + b * u + c * u * u == pytest.approx(SMALL_A + SMALL_B * u, abs=0.005)
        if c == 0.0:
            assert b == pytest.approx(SMALL_B, rel=0.4)
    assert straight >= 36


@pytest.mark.parametrize("slow_probe", [64, 128, 256])
def test_one_slow_short_probe_does_not_turn_the_per_token_cost_into_attention(slow_probe):
    a, b, c = fit_prefill(noisy_line_samples(1, noise_s=0.001,
                                             slow_probe=slow_probe)).coefficients
    assert (b, c) == (pytest.approx(SMALL_B, rel=0.4), 0.0)


def test_the_medians_of_a_loaded_two_core_machine_give_a_per_token_cost():
    # Measured on real vLLM CPU (tiny model, load average ~6): the three-coefficient fit
    # answered b = 0, c = 7.3e-9 s/token^2; the straight line through them is 12.4 us/token.
    measured = [(16, 0.02132), (64, 0.04058), (128, 0.02764), (256, 0.02849), (512, 0.02688),
                (1024, 0.03196), (1843, 0.05423)]
    a, b, c = fit_prefill([PrefillSample(u, t) for u, t in measured]).coefficients
    assert c == 0.0
    assert b == pytest.approx(1.24e-5, rel=0.01)
    assert a == pytest.approx(0.0262, rel=0.01)


def test_a_real_attention_term_is_kept_through_noise():
    # A larger model to 8k tokens: c*u^2 is 1.3 s at the top, far above 5 ms of noise.
    rng = np.random.default_rng(3)
    sizes = (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
    samples = [PrefillSample(u, A + B * u + C * u * u + rng.normal(0.0, 0.005)) for u in sizes]
    a, b, c = fit_prefill(samples).coefficients
    assert b == pytest.approx(B, rel=0.2)
    assert c == pytest.approx(C, rel=0.05)
