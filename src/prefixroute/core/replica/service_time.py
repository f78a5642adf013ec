"""How long one engine step takes: the service-time model of a replica.

A continuous-batching engine runs *steps* (one forward pass each). A step computes some prompt
tokens (prefill chunks) and one token for each request in decode. Its duration is

    step_time = a + b * P + c * sum(n_i * ctx_i) + d1 * D + d2 * sum(ctx_j)

``a`` (``step_overhead_s``)
    paid by every forward pass: reading the weights once, kernel launches, scheduling;
``b`` (``prefill_s_per_token``)
    the linear (GEMM) cost of each of the ``P`` prompt tokens in the step;
``c`` (``attention_s_per_token_context``)
    the quadratic attention term: a chunk of ``n_i`` new tokens that extends its sequence to
    ``ctx_i`` tokens costs ``c * n_i * ctx_i`` (``c`` absorbs the causal one-half);
``d1`` (``decode_s_per_seq``)
    per request in the decode batch (``D`` requests): its GEMM share, sampling, bookkeeping;
``d2`` (``decode_s_per_context_token``)
    reading the KV of every context token of every decoding request (decode is memory-bound).

So a lone prefill of ``u`` uncached tokens extending a sequence to ``context`` tokens takes
``a + b*u + c*u*context`` (:meth:`ServiceTimeModel.prefill_time`), and a pure decode step of
``D`` requests with ``C`` context tokens in total takes ``a + d1*D + d2*C``
(:meth:`ServiceTimeModel.decode_step_time`). Cached prompt tokens cost nothing: a hit skips
their prefill and does not speed up decode.

``o`` (``request_overhead_s``, default 0)
    per request, outside engine steps: HTTP, tokenizing and detokenizing, inter-process hops.
    It delays when a request *enters* the engine (its time to first token grows by ``o``), not
    how long a step takes, so it costs latency but no engine capacity. Presets leave it at 0
    (their numbers are GPU step times); ``prefixroute calibrate`` measures it as the
    difference between the TTFT and decode-step intercepts.

Presets are *derived* from published hardware and model figures with stated efficiencies, not
measured; ``prefixroute calibrate`` fits a profile to a live engine and writes it as a
dict that :func:`profile_from_dict` loads. Every field can be overridden.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Mapping

from prefixroute.core.errors import ConfigError


@dataclass(frozen=True, slots=True)
class ServiceTimeModel:
    """Step durations of one replica (seconds), plus the KV memory it has by default."""

    name: str
    step_overhead_s: float
    prefill_s_per_token: float
    attention_s_per_token_context: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    # Default KV capacity when the caller states none: the model shape (a preset name of
    # prefixroute.core.identity.model_config.MODEL_PRESETS) and the memory left for KV.
    model: str = "llama-3-8b"
    kv_memory_gib: float = 50.0
    source: str = ""
    # Per request, outside the engine's steps (HTTP, tokenization): delays its entry.
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in ("name", "model", "source"):
                if not isinstance(value, str):
                    raise ConfigError(f"engine profile {self.name!r}: {f.name} must be a string")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not math.isfinite(value) or value < 0:
                raise ConfigError(f"engine profile {self.name!r}: {f.name} must be a "
                                  f"non-negative number, got {value!r}")

    # -- the model ----------------------------------------------------------------------------
    def prefill_time(self, uncached_tokens: int, context_tokens: int) -> float:
        """A step that only prefills ``uncached_tokens`` new tokens, extending the sequence to
        ``context_tokens`` (cached prefix + the new tokens)."""
        if uncached_tokens <= 0:
            return 0.0
        return (self.step_overhead_s + self.prefill_s_per_token * uncached_tokens
                + self.attention_s_per_token_context * uncached_tokens * context_tokens)

    def decode_step_time(self, batch: int, context_tokens: int) -> float:
        """A step that decodes one token for each of ``batch`` requests holding
        ``context_tokens`` tokens of KV in total."""
        if batch <= 0:
            return 0.0
        return (self.step_overhead_s + self.decode_s_per_seq * batch
                + self.decode_s_per_context_token * context_tokens)

    def step_time(self, prefill_tokens: int, prefill_token_context: int, decode_batch: int,
                  decode_context_tokens: int) -> float:
        """A mixed step: ``prefill_tokens`` prompt tokens whose chunks sum ``n_i * ctx_i`` to
        ``prefill_token_context``, and ``decode_batch`` decoding requests with
        ``decode_context_tokens`` context tokens in total. Empty steps take no time."""
        if prefill_tokens <= 0 and decode_batch <= 0:
            return 0.0
        return (self.step_overhead_s + self.prefill_s_per_token * prefill_tokens
                + self.attention_s_per_token_context * prefill_token_context
                + self.decode_s_per_seq * decode_batch
                + self.decode_s_per_context_token * decode_context_tokens)

    # -- variants -----------------------------------------------------------------------------
    def scaled(self, factor: float) -> "ServiceTimeModel":
        """Every duration multiplied by ``factor`` (0 turns the time model off)."""
        if not math.isfinite(factor) or factor < 0:
            raise ConfigError(f"time scale must be a non-negative number, got {factor!r}")
        return replace(self, name=f"{self.name}x{factor:g}",
                       step_overhead_s=self.step_overhead_s * factor,
                       prefill_s_per_token=self.prefill_s_per_token * factor,
                       attention_s_per_token_context=self.attention_s_per_token_context * factor,
                       decode_s_per_seq=self.decode_s_per_seq * factor,
                       decode_s_per_context_token=self.decode_s_per_context_token * factor,
                       request_overhead_s=self.request_overhead_s * factor)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_FIELDS = {f.name for f in fields(ServiceTimeModel)}
_OPTIONAL = ("model", "kv_memory_gib", "source", "request_overhead_s")  # fields with defaults


def profile_from_dict(data: Mapping[str, Any], where: str = "engine profile") -> ServiceTimeModel:
    """Build a profile from a mapping (a calibration result, a YAML/JSON file).

    ``base`` names a preset to start from; any other key overrides that preset's field. Unknown
    keys are an error, so a typo never silently keeps a default.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of profile fields")
    data = dict(data)
    base_name = data.pop("base", None)
    unknown = sorted(set(data) - _FIELDS)
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(unknown)}; known: "
                          f"base, {', '.join(sorted(_FIELDS))}")
    if base_name is not None:
        base = get_profile(str(base_name))
        data.setdefault("name", f"{base.name}-custom")
        try:
            return replace(base, **data)
        except TypeError as exc:
            raise ConfigError(f"{where}: {exc}") from None
    missing = sorted(f.name for f in fields(ServiceTimeModel)
                     if f.name not in data and f.name not in _OPTIONAL)
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)} (or give 'base' to "
                          f"start from a preset: {', '.join(PRESETS)})")
    return ServiceTimeModel(**data)


def get_profile(name: str) -> ServiceTimeModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown engine profile {name!r}; presets: {', '.join(PRESETS)} "
                          f"(or a profile file)") from None


# -- presets ----------------------------------------------------------------------------------
# Llama-3-8B (8.03e9 parameters, 32 layers, hidden 4096, 8 KV heads x 128, bf16) on one
# H100 SXM (989 TFLOPS dense bf16, 3.35 TB/s HBM3, 80 GB):
# * a  = weights read once per pass: 16.06 GB / (3.35 TB/s x 75% achieved) = 6.4 ms -> 6 ms.
# * b  = 2 x 8.03e9 FLOPs per token / (989e12 x 40% MFU) = 4.06e-5 s -> 4.0e-5 (25k tok/s).
# * c  = attention 4 x 32 layers x 4096 = 524k FLOPs per (token, context token), causal half,
#        at ~30% of peak: 524e3 / 2 / 297e12 = 8.8e-10 -> 9e-10. (10k fresh tokens: 0.5 s.)
# * d1 = per decoding request: its GEMM share 16 GFLOP at ~40% MFU plus sampling ~= 5e-5 s.
# * d2 = KV bytes per token 2 x 32 x 8 x 128 x 2 = 128 KiB at 2.5 TB/s = 5.2e-8 s.
# * KV memory: 80 GB x 0.9 (vLLM gpu_memory_utilization default) - 16 GB weights - ~6 GB
#   activations and CUDA graphs ~= 50 GiB -> 409,600 tokens.
LLAMA3_8B_H100 = ServiceTimeModel(
    name="llama-3-8b-h100",
    step_overhead_s=6.0e-3,
    prefill_s_per_token=4.0e-5,
    attention_s_per_token_context=9.0e-10,
    decode_s_per_seq=5.0e-5,
    decode_s_per_context_token=5.2e-8,
    model="llama-3-8b",
    kv_memory_gib=50.0,
    source="derived from H100 SXM datasheet (989 TFLOPS bf16, 3.35 TB/s) and the "
           "Llama-3-8B config.json with 40% MFU / 75% bandwidth; not measured",
)

# Llama-3-70B (70.6e9 parameters, 80 layers, hidden 8192, 8 KV heads x 128) with tensor
# parallelism over 4 H100 SXM: a = 141 GB / (4 x 2.5 TB/s) = 14 ms; b = 141 GFLOP /
# (4 x 989e12 x 40%) = 8.9e-5 s; c = 4 x 80 x 8192 / 2 / (4 x 297e12) = 1.1e-9;
# d2 = 320 KiB / (4 x 2.5 TB/s) = 3.3e-8; KV 4 x 72 GB - 141 GB - 17 GB ~= 120 GiB.
LLAMA3_70B_4XH100 = ServiceTimeModel(
    name="llama-3-70b-4xh100",
    step_overhead_s=1.4e-2,
    prefill_s_per_token=8.9e-5,
    attention_s_per_token_context=1.1e-9,
    decode_s_per_seq=1.0e-4,
    decode_s_per_context_token=3.3e-8,
    model="llama-3-70b",
    kv_memory_gib=120.0,
    source="derived from H100 SXM datasheet and the Llama-3-70B config.json, TP=4, "
           "40% MFU / 75% bandwidth; not measured",
)

# Every step takes no time: the time model off (cache behaviour only; emulator tests).
INSTANT = ServiceTimeModel(
    name="instant", step_overhead_s=0.0, prefill_s_per_token=0.0,
    attention_s_per_token_context=0.0, decode_s_per_seq=0.0, decode_s_per_context_token=0.0,
    source="time model off")

PRESETS: dict[str, ServiceTimeModel] = {p.name: p for p in (LLAMA3_8B_H100, LLAMA3_70B_4XH100,
                                                             INSTANT)}
DEFAULT_PROFILE = LLAMA3_8B_H100.name
