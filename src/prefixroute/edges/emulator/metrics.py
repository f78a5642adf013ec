"""``/metrics`` under vLLM 0.32's names, labels and histogram buckets.

Names and help texts come from ``vllm/v1/metrics/loggers.py`` and the buckets from
``vllm/v1/metrics/buckets.py``; every sample carries ``model_name`` and ``engine="0"`` as
vLLM's do. Values are read from the engine at scrape time (gauges, prefix-cache counters) or
kept in plain Python numbers by the server (request counters and histograms), and exposed
through a ``prometheus_client`` collector, so recording a request costs a few additions and no
locks.

``vllm:cache_config_info`` is vLLM's info-style gauge (always 1) whose labels are every field of
its ``CacheConfig`` as a string (``CacheConfig.metrics_info()``, logged by
``PrometheusStatLogger.log_metrics_info``); :func:`cache_config_info` fills the same label set
with the emulator's values, taken from a real ``vllm serve`` 0.32 scrape.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Iterable

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from prefixroute.core.replica.engine import ReplicaEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# vllm/v1/metrics/buckets.py
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                               1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISHED_REASONS = ("stop", "length", "abort", "error", "repetition")
CACHE_CONFIG_INFO = "vllm:cache_config_info"

# vLLM 0.32 CacheConfig fields the emulator has no counterpart for, at the values a
# `vllm serve MODEL --enable-prefix-caching --block-size B` of a plain decoder model exports.
_CACHE_CONFIG_FIXED = {
    "_block_size_resolved": "True",
    "cache_dtype": "auto",
    "cache_hit_alignment_tokens": "None",
    "enable_mamba_shared_prefix_checkpoint": "False",
    "gpu_memory_utilization": "0.92",
    "hash_block_size": "None",
    "is_attention_free": "False",
    "kv_cache_dtype_skip_layers": "[]",
    "kv_cache_layout": "None",
    "kv_offloading_backend": "native",
    "kv_offloading_size": "None",
    "kv_sharing_fast_prefill": "False",
    "mamba_block_size": "None",
    "mamba_cache_dtype": "auto",
    "mamba_cache_mode": "none",
    "mamba_page_size_padded": "None",
    "num_cpu_blocks": "None",
    "prefix_cache_retention_interval": "0",
    "prefix_match_unit": "None",
    "replayssm_buffer_len": "16",
    "skip_page_size_padded": "None",
    "sliding_window": "None",
    "swa_bounded_replay": "True",
    "use_kda_recoverssm": "False",
    "use_replayssm": "False",
    # The emulator's block size is always its own --block-size (default 16).
    "user_specified_block_size": "True",
}


# vLLM 0.32 architectures whose config class sets the SSM state cache dtype from the model's
# config when the server was given none (vllm/model_executor/models/config.py,
# MODELS_CONFIG_MAP): NemotronH reads ``mamba_ssm_cache_dtype`` (default float32, "the only
# dtype known to have no accuracy issues"), Qwen3.5 reads ``mamba_ssm_dtype`` of its text
# config (no default: the value stays "auto").
_SSM_DTYPE_FROM_CONFIG = {
    "NemotronHForCausalLM": ("mamba_ssm_cache_dtype", "float32"),
    "NemotronHPuzzleForCausalLM": ("mamba_ssm_cache_dtype", "float32"),
    "NemotronH_Nano_VL_V2": ("mamba_ssm_cache_dtype", "float32"),
    "Qwen3_5ForCausalLM": ("mamba_ssm_dtype", "auto"),
    "Qwen3_5ForConditionalGeneration": ("mamba_ssm_dtype", "auto"),
    "Qwen3_5MoeForCausalLM": ("mamba_ssm_dtype", "auto"),
    "Qwen3_5MoeForConditionalGeneration": ("mamba_ssm_dtype", "auto"),
    "ColQwen3_5": ("mamba_ssm_dtype", "auto"),
}


def mamba_ssm_cache_dtype(hf_config: dict | None) -> str:
    """The ``mamba_ssm_cache_dtype`` a vLLM 0.32 GPU server reports for a model whose
    ``config.json`` is ``hf_config`` (None: unknown model) and no ``--mamba-ssm-cache-dtype``.

    "auto" unless the architecture's config class reads it from the model's config (see
    ``_SSM_DTYPE_FROM_CONFIG``); multimodal configs keep it in ``text_config`` (vLLM's
    ``hf_text_config``). vLLM's CPU build on a host with AVX-512 BF16 replaces "auto" with
    "float32" for every model (``CpuPlatform.check_and_update_config``); the emulator
    reports what a GPU server does."""
    if not hf_config:
        return "auto"
    architectures = hf_config.get("architectures") or []
    rule = next((_SSM_DTYPE_FROM_CONFIG[a] for a in architectures
                 if a in _SSM_DTYPE_FROM_CONFIG), None)
    if rule is None:
        return "auto"
    field_name, default = rule
    value = (hf_config.get("text_config") or hf_config).get(field_name)
    return value if isinstance(value, str) and value else default


def cache_config_info(*, block_size: int, num_gpu_blocks: int, max_model_len: int,
                      hash_algo: str = "sha256", num_gpu_blocks_override: int | None = None,
                      kv_cache_memory_bytes: int | None = None,
                      hf_config: dict | None = None) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info`` (without ``engine``), as vLLM 0.32 exports
    them: ``str()`` of each ``CacheConfig`` field, ``"None"`` when unset. ``hf_config`` is the
    served model's ``config.json``, for the fields vLLM derives from it.

    ``num_gpu_blocks`` counts the reserved null block (vLLM's count);
    ``kv_cache_size_tokens`` is ``num_gpu_blocks * block_size`` and
    ``kv_cache_max_concurrency`` is ``num_gpu_blocks / ceil(max_model_len / block_size)``
    (``get_max_concurrency_for_kv_cache_config``), e.g. 80 blocks of 32 at 2,048 tokens:
    ``"2560"`` and ``"1.25"``.
    """
    labels = dict(_CACHE_CONFIG_FIXED)
    labels.update({
        "block_size": str(block_size),
        "effective_attention_block_size": str(block_size),
        "enable_prefix_caching": "True",
        "kv_cache_max_concurrency": str(num_gpu_blocks / -(-max_model_len // block_size)),
        "kv_cache_memory_bytes": str(kv_cache_memory_bytes),
        "kv_cache_size_tokens": str(num_gpu_blocks * block_size),
        "mamba_ssm_cache_dtype": mamba_ssm_cache_dtype(hf_config),
        "num_gpu_blocks": str(num_gpu_blocks),
        "num_gpu_blocks_override": str(num_gpu_blocks_override),
        "prefix_caching_hash_algo": hash_algo,
    })
    return labels


def request_tokens_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM ``build_1_2_5_buckets(max_model_len)``: 1, 2, 5, 10, 20, 50, ... up to the limit."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exponent += 1


class _Histogram:
    __slots__ = ("bounds", "counts", "total", "count")

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1

    def family(self, name: str, documentation: str, labels: list[str]) -> HistogramMetricFamily:
        family = HistogramMetricFamily(name, documentation, labels=["engine", "model_name"])
        buckets = []
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            buckets.append((_float_text(bound), running))
        buckets.append(("+Inf", self.count))
        family.add_metric(labels, buckets, self.total)
        return family


def _float_text(value: float) -> str:
    return repr(float(value))


class EmulatorMetrics(Collector):
    """Request-level counters and histograms, plus the engine's gauges at scrape time."""

    def __init__(self, engine: ReplicaEngine, model_name: str, max_model_len: int,
                 cache_info: dict[str, str] | None = None):
        self.engine = engine
        self.labels = ["0", model_name]
        # vllm:cache_config_info: vLLM's labels are sorted by name in its exposition.
        info = dict(cache_info) if cache_info is not None else cache_config_info(
            block_size=engine.block_size, num_gpu_blocks=engine.pool.num_blocks,
            max_model_len=max_model_len)
        info["engine"] = "0"
        self._cache_info = sorted(info.items())
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        token_buckets = request_tokens_buckets(max_model_len)
        self.ttft = _Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        self.e2e = _Histogram(REQUEST_LATENCY_BUCKETS)
        self.request_prompt_tokens = _Histogram(token_buckets)
        self.request_generation_tokens = _Histogram(token_buckets)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    # -- recording ---------------------------------------------------------------------------
    def first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def finished(self, prompt_tokens: int, generation_tokens: int, e2e_s: float,
                 reason: str) -> None:
        self.prompt_tokens += prompt_tokens
        self.generation_tokens += generation_tokens
        self.success[reason] = self.success.get(reason, 0) + 1
        self.e2e.observe(e2e_s)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(generation_tokens)

    # -- exposition --------------------------------------------------------------------------
    def render(self) -> bytes:
        return generate_latest(self.registry)

    def collect(self) -> Iterable:
        labels = self.labels
        names = ["engine", "model_name"]
        engine = self.engine
        stats = engine.pool.stats

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=names)
            family.add_metric(labels, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=names)
            family.add_metric(labels, value)
            return family

        info = GaugeMetricFamily(CACHE_CONFIG_INFO, "Information of the LLMEngine CacheConfig",
                                 labels=[k for k, _ in self._cache_info])
        info.add_metric([v for _, v in self._cache_info], 1.0)
        yield info
        yield gauge("vllm:num_requests_running",
                    "Number of requests in model execution batches.", engine.running)
        yield gauge("vllm:num_requests_waiting",
                    "Number of requests waiting to be processed.", engine.waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    engine.kv_usage)
        yield counter("vllm:prefix_cache_queries",
                      "Prefix cache queries, in terms of number of queried tokens.",
                      stats.queried_tokens)
        yield counter("vllm:prefix_cache_hits",
                      "Prefix cache hits, in terms of number of cached tokens.",
                      stats.hit_tokens)
        yield counter("vllm:num_preemptions",
                      "Cumulative number of preemption from the engine.", engine.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                      self.prompt_tokens)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.",
                      self.generation_tokens)
        success = CounterMetricFamily("vllm:request_success",
                                      "Count of successfully processed requests.",
                                      labels=["engine", "finished_reason", "model_name"])
        for reason, value in self.success.items():
            success.add_metric([labels[0], reason, labels[1]], value)
        yield success
        yield self.request_prompt_tokens.family(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", labels)
        yield self.request_generation_tokens.family(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", labels)
        yield self.ttft.family("vllm:time_to_first_token_seconds",
                               "Histogram of time to first token in seconds.", labels)
        yield self.e2e.family("vllm:e2e_request_latency_seconds",
                              "Histogram of e2e request latency in seconds.", labels)
