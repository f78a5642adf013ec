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
