"""Fit a :class:`ServiceTimeModel` to what a live engine was measured doing.

Two kinds of probe (``prefixroute calibrate`` takes them over HTTP; this module only fits):

Prefill probes: a request alone on an idle engine with ``u`` uncached prompt tokens and no
cached prefix. Its time to first token is one prefill step plus the round trip,

    ttft(u) = a + b*u + c*u*u            (context = u)

so least squares over several sizes gives the step overhead ``a`` (which absorbs the HTTP
round trip: the emulator's own overhead is far smaller), the per-token cost ``b`` and the
attention term ``c``.

The attention term is kept only where the probes show it. On a small model, or prompts far
shorter than the model's width, ``c*u*u`` is lost in the noise of the measured times, and
three free coefficients then fit the noise: one probe slowed by a busy machine bends the
curve, the unconstrained optimum wants ``b < 0``, and the non-negative fit answers ``b = 0``
with all of the growth in ``c``. Such a profile prices short prompts as free and long ones
as too dear, tells a router that uncached tokens cost nothing, and gives every request of a
simulated run nearly the same duration. A per-token cost always exists (every token passes
every layer's weights), so :func:`fit_prefill` keeps ``c`` only when the full fit keeps
``b > 0`` too and predicts each probe left out of it better (leave-one-out error) than the
straight line ``a + b*u``; otherwise it returns the straight line.

Decode probes: ``B`` requests decoding together, ``C`` context tokens in total; the time
between their tokens is one decode step,

    itl(B, C) = a' + d1*B + d2*C

fitted with its own intercept ``a'``. The two intercepts differ on a real server: the time
to first token also holds the per-request work outside the engine's steps (HTTP, tokenizing,
detokenizing, inter-process hops: about 10 ms for vLLM on this CPU machine). Putting it into
every step would make each decode step that much slower and the emulated engine's capacity
far too low, so when decode probes exist the profile's ``step_overhead_s`` is the decode
intercept ``a'`` and the difference ``a - a'`` becomes the profile's ``request_overhead_s``
(a delay before the request enters the engine, paid once); without decode probes the split is
unknown, so ``step_overhead_s`` is the prefill intercept and ``request_overhead_s`` is 0.

Every coefficient must be non-negative (the model rejects negative durations), so the fits
are non-negative least squares, solved exactly for these two or three unknowns by trying
every subset of free coefficients (the optimum of an NNLS problem is the unconstrained
optimum on some subset, with the rest at zero). Pure: no I/O, no clock.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.service_time import ServiceTimeModel, get_profile


@dataclass(frozen=True, slots=True)
class PrefillSample:
    """One prefill probe: uncached prompt tokens and the measured time to first token."""

    uncached_tokens: int
    ttft_s: float


@dataclass(frozen=True, slots=True)
class DecodeSample:
    """One decode probe: requests decoding together, their total context tokens, and the
    measured time per decode step (inter-token latency)."""

    batch: int
    context_tokens: int
    itl_s: float


@dataclass(frozen=True, slots=True)
class Fit:
    """Coefficients in the order of the design matrix's columns, and the fit's quality."""

    coefficients: tuple[float, ...]
    r_squared: float
    rms_error_s: float


def nonnegative_least_squares(design: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||design @ x - target|| subject to x >= 0, by enumerating supports (exact for
    the handful of columns used here; 2^k small solves)."""
    columns = design.shape[1]
    if columns > 8:
        raise ConfigError("nonnegative_least_squares enumerates supports: at most 8 columns")
    best = np.zeros(columns)
    best_error = float(np.sum(target ** 2))
    for size in range(1, columns + 1):
        for support in itertools.combinations(range(columns), size):
            sub = design[:, support]
            solution, *_ = np.linalg.lstsq(sub, target, rcond=None)
            if np.any(solution < 0):
                continue
            error = float(np.sum((sub @ solution - target) ** 2))
            if error < best_error - 1e-18:
                best_error = error
                best = np.zeros(columns)
                best[list(support)] = solution
    return best


def _quality(design: np.ndarray, target: np.ndarray, x: np.ndarray) -> tuple[float, float]:
    residual = design @ x - target
    ss_res = float(np.sum(residual ** 2))
    ss_tot = float(np.sum((target - target.mean()) ** 2))
    r_squared = 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0
    return r_squared, math.sqrt(ss_res / len(target))


def leave_one_out_error(design: np.ndarray, target: np.ndarray) -> float:
    """Sum of squared errors of predicting each row from a non-negative fit to the others."""
    total = 0.0
    for i in range(len(target)):
        rest = np.arange(len(target)) != i
        x = nonnegative_least_squares(design[rest], target[rest])
        total += float((design[i] @ x - target[i]) ** 2)
    return total


def fit_prefill(samples: Sequence[PrefillSample]) -> Fit:
    """(a, b, c) of ``ttft = a + b*u + c*u^2``, with ``c`` 0 unless the probes show it (the
    module doc); needs at least three distinct sizes."""
    if len({s.uncached_tokens for s in samples}) < 3:
        raise ConfigError("a prefill fit needs probes at three or more prompt sizes")
    u = np.array([s.uncached_tokens for s in samples], dtype=float)
    design = np.column_stack([np.ones_like(u), u, u * u])
    target = np.array([s.ttft_s for s in samples], dtype=float)
    line = np.concatenate([nonnegative_least_squares(design[:, :2], target), [0.0]])
    x = line
    full = nonnegative_least_squares(design, target)
    # Leave-one-out needs three sizes left after dropping any one probe.
    if full[1] > 0 and full[2] > 0 and len(set(u.tolist())) >= 4 and \
            leave_one_out_error(design, target) < leave_one_out_error(design[:, :2], target):
        x = full
    r_squared, rms = _quality(design, target, x)
    return Fit(tuple(float(v) for v in x), r_squared, rms)


def fit_decode(samples: Sequence[DecodeSample], step_overhead_s: float | None = None) -> Fit:
    """(a', d1, d2) of ``itl = a' + d1*B + d2*C``; with ``step_overhead_s`` given, ``a'`` is
    held at it and only (d1, d2) are fitted (returned as (a', d1, d2) all the same)."""
    if len({(s.batch, s.context_tokens) for s in samples}) < (2 if step_overhead_s is not None
                                                              else 3):
        raise ConfigError("a decode fit needs probes at three or more (batch, context) points "
                          "(two with a fixed step overhead)")
    design = np.array([[1.0, s.batch, s.context_tokens] for s in samples], dtype=float)
    target = np.array([s.itl_s for s in samples], dtype=float)
    if step_overhead_s is None:
        x = nonnegative_least_squares(design, target)
    else:
        rest = nonnegative_least_squares(design[:, 1:], target - step_overhead_s)
        x = np.concatenate([[step_overhead_s], rest])
    r_squared, rms = _quality(design, target, x)
    return Fit(tuple(float(v) for v in x), r_squared, rms)


def calibrated_profile(name: str, prefill: Sequence[PrefillSample],
                       decode: Sequence[DecodeSample] = (), *, base: str = "instant",
                       model: str | None = None, kv_memory_gib: float | None = None,
                       source: str = "") -> tuple[ServiceTimeModel, dict]:
    """The fitted profile (decode terms from ``base`` when there are no decode probes) and a
    summary of both fits."""
    prefill_fit = fit_prefill(prefill)
    a, b, c = prefill_fit.coefficients
    profile = replace(get_profile(base), name=name, step_overhead_s=a, prefill_s_per_token=b,
                      attention_s_per_token_context=c, source=source, request_overhead_s=0.0)
    summary: dict = {"prefill": {"step_overhead_s": a, "prefill_s_per_token": b,
                                 "attention_s_per_token_context": c,
                                 "r_squared": prefill_fit.r_squared,
                                 "rms_error_s": prefill_fit.rms_error_s,
                                 "samples": len(prefill)}}
    if decode:
        decode_fit = fit_decode(decode)
        step, d1, d2 = decode_fit.coefficients
        step = min(step, a)
        profile = replace(profile, step_overhead_s=step, decode_s_per_seq=d1,
                          decode_s_per_context_token=d2, request_overhead_s=a - step)
        summary["prefill"]["request_overhead_s"] = a - step
        summary["decode"] = {"step_overhead_s": step, "decode_s_per_seq": d1,
                             "decode_s_per_context_token": d2,
                             "r_squared": decode_fit.r_squared,
                             "rms_error_s": decode_fit.rms_error_s, "samples": len(decode)}
    if model is not None:
        profile = replace(profile, model=model)
    if kv_memory_gib is not None:
        profile = replace(profile, kv_memory_gib=kv_memory_gib)
    return profile, summary
