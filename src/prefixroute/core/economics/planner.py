"""The fleet planner: the design scenario (docs/concepts.md), answered by running the library
rather than by prose.

A multi-tenant assistant: ``tenants`` prefixes of ``prefix_tokens`` tokens, one hot tenant, a
Zipf tail that recurs less than hourly, ``requests_per_day`` requests over ``replicas`` shared
GPUs, a ``provider_share`` of the traffic on a provider with a write premium, and prompts that
today start with a timestamp. :func:`make_plan` answers, section by section:

``layout``
    static first, volatile last; the timestamp moved out of the static region, with the token
    hit rate *measured* by simulating the timestamp-at-top variant and the fixed one;
``keys_and_salts``
    what each request carries: trust-group salt (HMAC), the compatibility key's fields, the
    adapter, a ``prompt_cache_key``-style routing key, and the provider breakpoint;
``metrics``
    the Prometheus series for token hit rate and cost multiplier (per prefix class);
``routing``
    a few policies simulated on the scenario with the given replica count; the pick follows
    :data:`ROUTING_RULE`;
``ttl``
    per prefix class (hot tenant, regular, rare), the cheapest provider option over the class
    from :func:`~prefixroute.core.economics.advice.advise_ttl` at each prefix's provider rate;
``kv_memory``
    bytes per token ``2 x layers x kv_heads x head_dim x dtype bytes`` (FP8 halves it), the
    working set, per replica and fleet, replicated and partitioned, and the measured effect of
    FP8 on the hit rate;
``provider_accounting``
    exact replay (:mod:`.accounting`) of a sample of the provider's traffic under the current
    layout, a breakpoint at the end of the prompt only, and one at the end of the static region;
``cost_per_day``
    self-hosted prefill GPU time saved (from the simulated cached tokens and the engine's
    service-time model) plus the provider bill with the write premium.

Everything is pure: the simulator and the accounting run in memory; the CLI
(:mod:`prefixroute.edges.cli.plan`) reads files and writes the report. Simulator runs are small
(``sim_requests`` requests, time compressed by ``compress``) so a plan takes about a minute on
two cores.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

from prefixroute.core.economics.accounting import (
    DEFAULT_MIN_CACHEABLE_TOKENS,
    CacheModel,
    account_policies,
    growing_conversation_demo,
    parse_breakpoints,
)
from prefixroute.core.economics.advice import NO_CACHE, PREWARM_SUFFIX, advise_ttl
from prefixroute.core.economics.formulas import (
    HOURS_PER_DAY,
    SECONDS_PER_HOUR,
    TOKENS_PER_MTOK,
    require_non_negative,
)
from prefixroute.core.economics.presets import FIVE_MINUTE, ONE_HOUR, CachePolicy
from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.identity import CacheIdentity, derive_trust_group_salt
from prefixroute.core.identity.model_config import DTYPE_BYTES, MODEL_PRESETS, ModelConfig
from prefixroute.core.replica.service_time import DEFAULT_PROFILE, ServiceTimeModel, get_profile
from prefixroute.core.routing.registry import create_policy, policy_names
from prefixroute.core.simulator.generators import SECONDS_PER_DAY, design_scenario, zipf_weights
from prefixroute.core.simulator.simulation import (
    FleetConfig,
    PolicyRun,
    PreparedWorkload,
    prepare_workload,
    simulate_policy,
)

GIB = 1 << 30

# Candidate policies when the caller names none: load-only baselines, a bounded-load hash, the
# The hybrid baseline at two skew caps, SGLang's cache-aware router, and our default when it is
# registered. Seven runs of a couple of seconds each.
DEFAULT_CANDIDATES: tuple[str, ...] = (
    "round_robin", "least_loaded", "consistent_hash", "hybrid:max_skew=1", "hybrid:max_skew=8",
    "sglang_cache_aware", "prefixroute",
)
DEFAULT_MAX_LOAD_RATIO = 1.25  # ours: the busiest replica at most 25% busier than the mean
HIT_RATE_TIE = 0.005  # ours: hit rates within half a point are a tie, broken by TTFT p99
ROUTING_RULE = (
    "Among the policies whose busiest replica is busy at most {cap:g}x the mean replica's busy "
    "time, the highest token hit rate wins; hit rates within {tie:.1f} points of the best "
    "are a tie, broken by the lowest TTFT p99. If no policy stays within the cap, the lowest "
    "max/mean load wins."
)

ACTIVE_WINDOW_S = SECONDS_PER_HOUR  # working set: prefixes expected to recur within an hour
RARE_PER_HOUR = 1.0  # the design scenario: "some prefixes recur less than hourly"
TTL_TIE = 0.01  # ours: options within 1% of the cheapest cost the same for planning purposes
TTL_RULE = (
    "Prefixes are classed by the rate the provider sees (hot: the hot tenant; rare: fewer than "
    "{rare:g} request per hour; regular: the rest). Each class gets the option with the lowest "
    "total cost per day over its prefixes (advise_ttl at each prefix's provider rate); options "
    "within {tie:.0%} of the cheapest are a tie, won by no caching, then no pre-warming, then "
    "the lower write premium, then the shorter TTL."
)

# The example secret the report derives a salt from; real deployments read theirs from a file.
_DEMO_SECRET = b"prefixroute-plan-demo-secret-not-for-production!!"


@dataclass(frozen=True)
class PlanInputs:
    """Everything the planner needs; defaults are the design scenario and the presets they
    cite.

    Scenario: the design scenario of docs/concepts.md (200 tenants x 10,000 tokens, 50,000
    requests/day, 8 replicas) and the shape of
    :func:`~prefixroute.core.simulator.generators.design_scenario` (hot tenant 25% of traffic, Zipf
    1.2 tail, 100-600 user tokens, 50-400 output tokens). The rest is ours and stated:
    ``kv_memory_gib`` 20 (a share of a shared 80 GB GPU), ``provider_share`` 0.25,
    ``gpu_usd_per_hour`` 2.50 (an on-demand H100 in the style of Oct 2026 cloud price lists),
    ``compress`` 4 (the simulated hour is a peak at 4x the daily mean rate).
    """

    tenants: int = 200
    prefix_tokens: int = 10_000
    requests_per_day: float = 50_000
    hot_tenant_share: float = 0.25
    zipf_exponent: float = 1.2
    user_tokens_min: int = 100
    user_tokens_max: int = 600
    output_tokens_min: int = 50
    output_tokens_max: int = 400
    timestamp_at_top: bool = True  # how prompts are laid out today
    replicas: int = 8
    model: ModelConfig = MODEL_PRESETS["llama-3-8b"]
    kv_memory_gib: float = 20.0
    engine_profile: ServiceTimeModel = field(default_factory=lambda: get_profile(DEFAULT_PROFILE))
    gpu_usd_per_hour: float = 2.5
    block_size: int = 16
    provider_share: float = 0.25
    price_per_mtok: float = 3.0
    provider_policies: tuple[CachePolicy, ...] = (FIVE_MINUTE, ONE_HOUR)
    min_cacheable_tokens: int = DEFAULT_MIN_CACHEABLE_TOKENS
    allow_prewarm: bool = True
    sim_requests: int = 2000
    compress: float = 4.0
    policies: tuple[str, ...] = ()
    max_load_ratio: float = DEFAULT_MAX_LOAD_RATIO
    accounting_requests: int = 2000
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("tenants", "prefix_tokens", "user_tokens_min", "user_tokens_max",
                     "output_tokens_min", "output_tokens_max", "replicas", "block_size",
                     "sim_requests", "accounting_requests"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("requests_per_day", "kv_memory_gib", "compress", "max_load_ratio"):
            value = require_non_negative(name, getattr(self, name))
            if value == 0:
                raise ConfigError(f"{name} must be positive, got 0")
        for name in ("gpu_usd_per_hour", "price_per_mtok", "zipf_exponent"):
            require_non_negative(name, getattr(self, name))
        if not 0 <= self.hot_tenant_share < 1:
            raise ConfigError(f"hot_tenant_share must be in [0, 1), got {self.hot_tenant_share!r}")
        if not 0 <= self.provider_share <= 1:
            raise ConfigError(f"provider_share must be in [0, 1], got {self.provider_share!r}")
        if self.user_tokens_max < self.user_tokens_min:
            raise ConfigError("user_tokens_max must be at least user_tokens_min")
        if self.output_tokens_max < self.output_tokens_min:
            raise ConfigError("output_tokens_max must be at least output_tokens_min")
        if self.max_load_ratio < 1:
            raise ConfigError(f"max_load_ratio must be at least 1 (the mean), got "
                              f"{self.max_load_ratio!r}")
        if not self.provider_policies:
            raise ConfigError("provider_policies: name at least one cache policy")
        if isinstance(self.min_cacheable_tokens, bool) or self.min_cacheable_tokens < 0:
            raise ConfigError(f"min_cacheable_tokens must be non-negative, got "
                              f"{self.min_cacheable_tokens!r}")

    def as_dict(self) -> dict:
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "model":
                value = {"name": value.name, "num_layers": value.num_layers,
                         "num_kv_heads": value.num_kv_heads, "head_dim": value.head_dim,
                         "kv_dtype": value.kv_dtype}
            elif f.name == "engine_profile":
                value = value.name
            elif f.name == "provider_policies":
                value = [p.name for p in value]
            elif f.name == "policies":
                value = list(value)
            out[f.name] = value
        return out


# -- per-prefix traffic -------------------------------------------------------------------------
def prefix_weights(tenants: int, hot_tenant_share: float, zipf_exponent: float) -> list[float]:
    """Share of the traffic of each tenant prefix, tenant 0 the hot one: the same popularity
    :func:`~prefixroute.core.simulator.generators.design_scenario` draws from (``hot`` for
    tenant 0, the rest Zipf over the others)."""
    if tenants == 1:
        return [1.0]
    return [hot_tenant_share] + [w * (1 - hot_tenant_share)
                                 for w in zipf_weights(tenants - 1, zipf_exponent)]


def prefix_rates_per_hour(inputs: PlanInputs) -> list[float]:
    """Requests per hour of each tenant prefix over the whole fleet, steady over the day."""
    per_hour = inputs.requests_per_day / HOURS_PER_DAY
    return [w * per_hour for w in prefix_weights(inputs.tenants, inputs.hot_tenant_share,
                                                 inputs.zipf_exponent)]


# -- simulation ---------------------------------------------------------------------------------
def _workload(inputs: PlanInputs, *, timestamp_at_top: bool, requests: int, compress: float,
              requests_per_day: float | None = None) -> PreparedWorkload:
    generated = design_scenario(
        requests=requests, tenants=inputs.tenants, prefix_tokens=inputs.prefix_tokens,
        requests_per_day=requests_per_day or inputs.requests_per_day, compress=compress,
        zipf_exponent=inputs.zipf_exponent, hot_tenant_share=inputs.hot_tenant_share,
        user_tokens_min=inputs.user_tokens_min, user_tokens_max=inputs.user_tokens_max,
        output_tokens_min=inputs.output_tokens_min, output_tokens_max=inputs.output_tokens_max,
        timestamp_at_top=timestamp_at_top, block_size=inputs.block_size, seed=inputs.seed)
    return prepare_workload(generated, info={"name": "design-scenario",
                                             "timestamp_at_top": timestamp_at_top})


def _fleet(inputs: PlanInputs, model: ModelConfig) -> FleetConfig:
    blocks = model.blocks_for_memory(inputs.kv_memory_gib * GIB, inputs.block_size)
    if blocks < 1:
        raise ConfigError(f"kv_memory_gib {inputs.kv_memory_gib:g} holds no {inputs.block_size}"
                          f"-token block of {model.name}")
    return FleetConfig(inputs.replicas, blocks, inputs.block_size, inputs.engine_profile)


def candidate_policies(inputs: PlanInputs) -> list[str]:
    """The caller's policies, or :data:`DEFAULT_CANDIDATES` that are registered."""
    if inputs.policies:
        return list(inputs.policies)
    registered = set(policy_names())
    return [spec for spec in DEFAULT_CANDIDATES if spec.partition(":")[0] in registered]


def _max_over_mean(values: Sequence[float]) -> float | None:
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else None


def _run_row(run: PolicyRun) -> dict:
    """One policy's figures. Load is busy time (the fraction of the run each replica spent in
    engine steps), not request counts: a replica that serves a hot prefix from cache does less
    work per request, and busy time is what builds queues. Request counts are kept beside it."""
    s = run.summary
    busy = _max_over_mean(s["utilisation"])
    requests = _max_over_mean(s["assignments"])
    return {
        "policy": run.name,
        "token_hit_rate": s["token_hit_rate"],
        "ttft_p50_s": s["ttft_p50_s"],
        "ttft_p99_s": s["ttft_p99_s"],
        "max_mean_load": busy if busy is not None else requests,
        "max_mean_requests": requests,
        "assignments": s["assignments"],
        "utilisation": s["utilisation"],
        "evictions": s["evictions"],
        "completed": s["completed"],
    }


def choose_policy(rows: Sequence[dict], max_load_ratio: float,
                  tie: float = HIT_RATE_TIE) -> tuple[dict, str]:
    """Apply :data:`ROUTING_RULE` to per-policy rows; returns the winner and why."""
    if not rows:
        raise ConfigError("no routing policy to choose from")
    within = [r for r in rows if r["max_mean_load"] is not None
              and r["max_mean_load"] <= max_load_ratio + 1e-9]
    if not within:
        best = min(rows, key=lambda r: (r["max_mean_load"] or math.inf, r["policy"]))
        return best, (f"no policy kept the busiest replica within {max_load_ratio:g}x the mean; "
                      f"{best['policy']} has the lowest max/mean load "
                      f"({best['max_mean_load']:.2f})")
    top = max(r["token_hit_rate"] for r in within)
    tied = [r for r in within if r["token_hit_rate"] >= top - tie]
    best = min(tied, key=lambda r: (r["ttft_p99_s"] if r["ttft_p99_s"] is not None else math.inf,
                                    -r["token_hit_rate"]))
    excluded = [r["policy"] for r in rows if r not in within]
    why = (f"{best['policy']}: token hit rate {best['token_hit_rate']:.1%} and TTFT p99 "
           f"{best['ttft_p99_s']:.3f} s with max/mean load {best['max_mean_load']:.2f} "
           f"(cap {max_load_ratio:g})")
    if len(tied) > 1:
        why += f"; tied on hit rate with {', '.join(r['policy'] for r in tied if r is not best)}"
    if excluded:
        why += f"; over the load cap: {', '.join(excluded)}"
    return best, why


def _prefill_seconds(service: ServiceTimeModel, workload: PreparedWorkload,
                     cached: Sequence[int] | None) -> float:
    """GPU seconds of prefill for every request of ``workload`` (uncached tokens only when
    ``cached`` gives each request's cached tokens; -1 = not completed, counted uncached)."""
    total = 0.0
    for index, request in enumerate(workload.requests):
        hit = max(0, cached[index]) if cached is not None else 0
        total += service.prefill_time(request.input_tokens - hit, request.input_tokens)
    return total


# -- the plan -----------------------------------------------------------------------------------
Progress = Callable[[str, int, int], None]


def make_plan(inputs: PlanInputs, progress: Progress | None = None) -> dict:
    """Every section of the plan as a JSON-ready dict (see the module docstring)."""
    rates = prefix_rates_per_hour(inputs)
    specs = candidate_policies(inputs)
    for spec in specs:  # bad policy names fail before the first run
        create_policy(spec, seed=inputs.seed, num_replicas=inputs.replicas,
                      block_size=inputs.block_size)
    steps = len(specs) + 2 + (inputs.model.kv_dtype not in _FP8) + 1
    done = 0

    def step(label: str) -> None:
        nonlocal done
        if progress is not None:
            progress(label, done, steps)
        done += 1

    fixed = _workload(inputs, timestamp_at_top=False, requests=inputs.sim_requests,
                      compress=inputs.compress)
    fleet = _fleet(inputs, inputs.model)
    runs: dict[str, PolicyRun] = {}
    for spec in specs:
        step(f"simulate {spec}")
        runs[spec] = simulate_policy(fixed, fleet, spec, seed=inputs.seed)
    rows = [_run_row(run) for run in runs.values()]
    chosen, why = choose_policy(rows, inputs.max_load_ratio)
    chosen_run = runs[chosen["policy"]]

    step("simulate the timestamp-at-top layout")
    stamped = _workload(inputs, timestamp_at_top=True, requests=inputs.sim_requests,
                        compress=inputs.compress)
    stamped_run = simulate_policy(stamped, fleet, chosen["policy"], seed=inputs.seed)

    fp8_run = None
    fp8_model = replace(inputs.model, kv_dtype="fp8")
    if inputs.model.kv_dtype not in _FP8:
        step("simulate FP8 KV")
        fp8_run = simulate_policy(fixed, _fleet(inputs, fp8_model), chosen["policy"],
                                  seed=inputs.seed)

    step("replay the provider's traffic")
    accounting = _provider_accounting(inputs)
    step("cost")

    layout = _layout(inputs, fixed, chosen_run, stamped, stamped_run)
    layout["growing_conversation"] = growing_conversation_demo(
        policy=inputs.provider_policies[0], price_per_mtok=inputs.price_per_mtok)
    ttl = _ttl_classes(inputs, rates)
    kv = _kv_memory(inputs, rates, fleet, chosen_run, fp8_model, fp8_run)
    cost = _cost_per_day(inputs, fixed, chosen_run, stamped, stamped_run, ttl, accounting)
    _price_on_the_day(accounting, cost["provider"]["no_cache_usd_per_day"])
    # The inputs as run: the candidate policies actually simulated, not the empty default.
    used_inputs = inputs.as_dict()
    used_inputs["policies"] = list(specs)
    plan = {
        "inputs": used_inputs,
        "summary": {},
        "layout": layout,
        "keys_and_salts": _keys_and_salts(inputs),
        "metrics": _metrics(),
        "routing": {
            "rule": ROUTING_RULE.format(cap=inputs.max_load_ratio, tie=HIT_RATE_TIE * 100),
            "simulation": {"requests": inputs.sim_requests, "compress": inputs.compress,
                           "duration_s": fixed.describe()["duration_s"],
                           "ideal_token_hit_rate": fixed.ideal_token_hit_rate,
                           "fleet": fleet.describe(), "seed": inputs.seed},
            "policies": rows,
            "chosen": chosen["policy"],
            "why": why,
        },
        "ttl": ttl,
        "kv_memory": kv,
        "provider_accounting": accounting,
        "cost_per_day": cost,
    }
    plan["summary"] = _summary(plan)
    if progress is not None:
        progress("done", steps, steps)
    return plan


_FP8 = {name for name, size in DTYPE_BYTES.items() if size == 1}


def _layout(inputs: PlanInputs, fixed: PreparedWorkload, chosen: PolicyRun,
            stamped: PreparedWorkload, stamped_run: PolicyRun) -> dict:
    fixed_rate = chosen.summary["token_hit_rate"]
    stamped_rate = stamped_run.summary["token_hit_rate"]
    return {
        "order": [
            "tool definitions (serialised deterministically: sorted keys, fixed order)",
            "system prompt (pinned with the model, tokenizer and chat-template revisions)",
            f"the tenant's long-lived documents ({inputs.prefix_tokens:,} tokens; the end of "
            f"the static region: the provider breakpoint goes here)",
            "conversation history (append only; earlier turns are never rewritten)",
            "the new user turn, then volatile values: the current time, request ids, user names",
        ],
        "rules": [
            "no timestamp, request id, user name or random few-shot order in the static region",
            "the timestamp moves from the top of the prompt to the new user turn (or a "
            "date-only line after the documents, if the model needs it)",
            "tool schemas and JSON serialised deterministically",
            "with breakpoint APIs, a breakpoint at the end of the static region",
        ],
        "timestamp_measured": {
            "policy": chosen.name,
            "timestamp_at_top_token_hit_rate": stamped_rate,
            "fixed_token_hit_rate": fixed_rate,
            "difference": fixed_rate - stamped_rate,
            "timestamp_at_top_ideal_token_hit_rate": stamped.ideal_token_hit_rate,
            "fixed_ideal_token_hit_rate": fixed.ideal_token_hit_rate,
            "note": "same requests except the leading timestamp token; the timestamp has one-"
                    "second resolution, so only requests in the same second share a prefix",
        },
    }


def _keys_and_salts(inputs: PlanInputs) -> dict:
    example = derive_trust_group_salt(_DEMO_SECRET, "tenant-000")
    identity_fields = [f.name for f in fields(CacheIdentity)]
    return {
        "cache_salt": {
            "what": "per trust group: HMAC-SHA256(server_secret, 'prefixroute-salt/v1/' + "
                    "trust_group), 64 hex characters, injected by the gateway as vLLM's "
                    "cache_salt; caller-supplied salts are rejected or stripped",
            "example_with_demo_secret": example[:16] + "...",
            "why": "an unsalted shared cache leaks through TTFT whether another tenant sent the "
                   "same prefix; only requests with the identical salt can match",
        },
        "compatibility_key": {
            "fields": identity_fields,
            "what": "model and its revision, tokenizer and chat-template revisions, adapter "
                    "(LoRA name and path), attention/position config, KV dtype and layout, and "
                    "the salt, bound into every block key (native hashing profile): a release "
                    "that changes any of them starts cold on purpose",
            "kv_dtype": inputs.model.kv_dtype,
        },
        "adapter": "the tenant's LoRA adapter, if any, as ('lora', name, path) on every block; "
                   "requests with different adapters never share blocks",
        "routing_key": {
            "what": "prompt_cache_key = '<trust group>/<prefix id>@<prefix revision>' (e.g. "
                    "'tenant-007/docs@v12'): sent to the provider as prompt_cache_key and read "
                    "by the gateway as the request's routing key, so requests of one prefix "
                    "land together without the router hashing 10,000 tokens",
            "example": "tenant-007/docs@v12",
        },
        "provider_breakpoint": {
            "what": "cache_control at the end of the static region (after the tenant's "
                    "documents); with a growing conversation, one more at the end of the "
                    "previous turn (up to 4 per request, each looking back 20 blocks)",
            "min_cacheable_tokens": inputs.min_cacheable_tokens,
        },
        "media": "multimodal items get gateway-assigned, trust-group-scoped identifiers; "
                 "caller media UUIDs are rejected",
    }


def _metrics() -> dict:
    return {
        "token_hit_rate": {
            "engine": "sum(rate(vllm:prefix_cache_hits_total[5m])) / "
                      "sum(rate(vllm:prefix_cache_queries_total[5m]))",
            "gateway": "sum(rate(prefixroute_gateway_reported_cached_tokens_total[5m])) / "
                       "sum(rate(prefixroute_gateway_prompt_tokens_total[5m]))",
            "router_prediction": "sum(rate(prefixroute_gateway_predicted_cached_tokens_total"
                                 "[5m])) against the reported series: a gap means the "
                                 "router's view is stale (see "
                                 "prefixroute_gateway_kv_event_missing_total)",
        },
        "per_prefix": {
            "what": "token hit rate and cost multiplier per prefix class (hot, regular, rare): "
                    "low-cardinality labels; tenants are never labels",
            "proposed_series": [
                "prefixroute_gateway_prompt_tokens_total{prefix_class}",
                "prefixroute_gateway_reported_cached_tokens_total{prefix_class}",
                "prefixroute_provider_cache_write_tokens_total{prefix_class}",
                "prefixroute_provider_cache_read_tokens_total{prefix_class}",
            ],
            "status": "proposed: the gateway exports the first two without the prefix_class "
                      "label today; the provider series come from the usage fields "
                      "cache_creation_input_tokens and cache_read_input_tokens",
            "cost_multiplier": "(w * write + r * read + uncached) / (write + read + uncached) "
                               "over the provider series; alert when it rises above 1 (caching "
                               "costs more than it saves)",
        },
        "load": ["vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "prefixroute_gateway_replica_in_flight",
                 "prefixroute_gateway_decisions_total{policy,branch}"],
        "latency": ["prefixroute_gateway_ttft_seconds (p99 per replica)",
                    "prefixroute_gateway_request_latency_seconds"],
    }


def _cheapest(totals: dict[str, float], policies: Sequence[CachePolicy]) -> str:
    """:data:`TTL_RULE`: the cheapest option; options within :data:`TTL_TIE` of it are a tie,
    won by no caching, then no pre-warming, then the lowest write multiplier, then the shortest
    TTL (a cheaper miss when traffic stops, less kept alive for nothing)."""
    by_name = {p.name: p for p in policies}
    floor = min(totals.values())

    def preference(name: str) -> tuple:
        policy = by_name.get(name.removesuffix(PREWARM_SUFFIX))
        if policy is None:  # no_cache
            return (0, 0, 0.0, 0.0)
        return (1, name.endswith(PREWARM_SUFFIX), policy.write_multiplier, policy.ttl_seconds)

    tied = [name for name, usd in totals.items() if usd <= floor * (1 + TTL_TIE) + 1e-12]
    return min(tied, key=preference)


def _ttl_classes(inputs: PlanInputs, rates: Sequence[float]) -> dict:
    share = inputs.provider_share
    classes: dict[str, list[int]] = {"hot": [], "regular": [], "rare": []}
    for index, rate in enumerate(rates):
        provider_rate = rate * share
        if index == 0 and inputs.hot_tenant_share > 0:
            classes["hot"].append(index)
        elif provider_rate < RARE_PER_HOUR:
            classes["rare"].append(index)
        else:
            classes["regular"].append(index)
    out: dict = {"rule": TTL_RULE.format(rare=RARE_PER_HOUR, tie=TTL_TIE),
                 "provider_share": share, "allow_prewarm": inputs.allow_prewarm,
                 "policies": [p.as_dict() for p in inputs.provider_policies],
                 "rare_below_per_hour": RARE_PER_HOUR, "classes": {}}
    if share == 0:
        out["note"] = "no traffic on the provider"
    for name, members in classes.items():
        if not members:
            continue
        advices = [advise_ttl(rates[i] * share, inputs.prefix_tokens, inputs.price_per_mtok,
                              inputs.provider_policies) for i in members]
        totals: dict[str, float] = {}
        for advice in advices:
            for option in advice.options:
                if option.prewarm and not inputs.allow_prewarm:
                    continue
                totals[option.name] = totals.get(option.name, 0.0) + option.usd_per_day
        best = _cheapest(totals, inputs.provider_policies)
        plain = {n: v for n, v in totals.items() if not n.endswith(PREWARM_SUFFIX)}
        best_plain = _cheapest(plain, inputs.provider_policies)
        per_prefix_best: dict[str, int] = {}
        for advice in advices:
            pick = _cheapest({o.name: o.usd_per_day for o in advice.options
                              if inputs.allow_prewarm or not o.prewarm}, inputs.provider_policies)
            per_prefix_best[pick] = per_prefix_best.get(pick, 0) + 1
        provider_rates = [rates[i] * share for i in members]
        out["classes"][name] = {
            "prefixes": len(members),
            "provider_requests_per_hour": {"min": min(provider_rates),
                                           "max": max(provider_rates)},
            "fleet_requests_per_hour": {"min": min(rates[i] for i in members),
                                        "max": max(rates[i] for i in members)},
            "choice": best,
            "choice_without_prewarm": best_plain,
            "usd_per_day": totals[best],
            "no_cache_usd_per_day": totals[NO_CACHE],
            "usd_per_day_by_option": totals,
            "per_prefix_best": per_prefix_best,
            "example": advices[0].as_dict() | {"notes": list(advices[0].notes)},
        }
    return out


def _gib(tokens: float, model: ModelConfig) -> float:
    return tokens * model.kv_bytes_per_token / GIB


def _kv_memory(inputs: PlanInputs, rates: Sequence[float], fleet: FleetConfig,
               chosen: PolicyRun, fp8_model: ModelConfig, fp8_run: PolicyRun | None) -> dict:
    all_tokens = inputs.tenants * inputs.prefix_tokens
    active = sum(1 - math.exp(-rate * ACTIVE_WINDOW_S / SECONDS_PER_HOUR) for rate in rates)
    active_tokens = active * inputs.prefix_tokens
    # The hot tenant alone is hot_share of the traffic: spread over enough replicas to stay
    # near the mean load, it is held ceil(hot_share x replicas) times.
    hot_copies = max(1, math.ceil(inputs.hot_tenant_share * inputs.replicas))
    partitioned_tokens = (active_tokens + (hot_copies - 1) * inputs.prefix_tokens) \
        / inputs.replicas
    models = {inputs.model.kv_dtype: inputs.model}
    models.setdefault("fp8", fp8_model)
    by_dtype = {}
    for dtype, model in models.items():
        per_replica_partitioned = _gib(partitioned_tokens, model)
        by_dtype[dtype] = {
            "bytes_per_token": model.kv_bytes_per_token,
            "all_prefixes_gib": _gib(all_tokens, model),
            "working_set_gib": _gib(active_tokens, model),
            "per_replica_replicated_gib": _gib(active_tokens, model),
            "per_replica_partitioned_gib": per_replica_partitioned,
            "fleet_partitioned_gib": per_replica_partitioned * inputs.replicas,
            "fits_partitioned": per_replica_partitioned <= inputs.kv_memory_gib,
            "fits_replicated": _gib(active_tokens, model) <= inputs.kv_memory_gib,
            "capacity_tokens_per_replica": model.blocks_for_memory(
                inputs.kv_memory_gib * GIB, inputs.block_size) * inputs.block_size,
        }
    given = by_dtype[inputs.model.kv_dtype]
    if given["fits_partitioned"]:
        verdict = (f"{inputs.model.kv_dtype} fits: {given['per_replica_partitioned_gib']:.1f} "
                   f"GiB per replica with affinity routing, within {inputs.kv_memory_gib:g} GiB")
    elif by_dtype["fp8"]["fits_partitioned"]:
        verdict = (f"{inputs.model.kv_dtype} needs {given['per_replica_partitioned_gib']:.1f} "
                   f"GiB per replica, more than {inputs.kv_memory_gib:g}; an FP8 KV cache "
                   f"halves it to {by_dtype['fp8']['per_replica_partitioned_gib']:.1f} GiB and "
                   f"fits")
    else:
        verdict = (f"even FP8 needs {by_dtype['fp8']['per_replica_partitioned_gib']:.1f} GiB "
                   f"per replica, more than {inputs.kv_memory_gib:g}: add replicas or KV memory, "
                   f"or accept misses on the rarest prefixes")
    measured = {inputs.model.kv_dtype: {"cache_blocks": fleet.cache_blocks,
                                        "token_hit_rate": chosen.summary["token_hit_rate"],
                                        "evictions": chosen.summary["evictions"]}}
    if fp8_run is not None:
        measured["fp8"] = {"cache_blocks": fp8_model.blocks_for_memory(
                               inputs.kv_memory_gib * GIB, inputs.block_size),
                           "token_hit_rate": fp8_run.summary["token_hit_rate"],
                           "evictions": fp8_run.summary["evictions"]}
    return {
        "formula": "bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes",
        "model": {"name": inputs.model.name, "num_layers": inputs.model.num_layers,
                  "num_kv_heads": inputs.model.num_kv_heads, "head_dim": inputs.model.head_dim},
        "kv_memory_gib_per_replica": inputs.kv_memory_gib,
        "prefix_tokens_all": all_tokens,
        "active_prefixes_per_hour": active,
        "working_set_tokens": active_tokens,
        "hot_tenant_copies": hot_copies,
        "per_replica_partitioned_tokens": partitioned_tokens,
        "by_dtype": by_dtype,
        "verdict": verdict,
        "measured_policy": chosen.name,
        "measured": measured,
        "note": "working set: the prefixes expected to recur within an hour (sum over prefixes "
                "of 1 - exp(-rate x 1 h)); replicated = every replica holds it (round robin); "
                "partitioned = affinity routing splits it, the hot tenant held on "
                f"{hot_copies} replicas; in-flight requests' own tokens come on top",
    }


def _cost_per_day(inputs: PlanInputs, fixed: PreparedWorkload, chosen: PolicyRun,
                  stamped: PreparedWorkload, stamped_run: PolicyRun, ttl: dict,
                  accounting: dict) -> dict:
    service = inputs.engine_profile
    self_hosted_per_day = inputs.requests_per_day * (1 - inputs.provider_share)
    scale = self_hosted_per_day / len(fixed.requests)
    none_s = _prefill_seconds(service, fixed, None) * scale
    with_s = _prefill_seconds(service, fixed, chosen.cached_tokens) * scale
    stamped_scale = self_hosted_per_day / len(stamped.requests)
    stamped_s = _prefill_seconds(service, stamped, stamped_run.cached_tokens) * stamped_scale
    gpu = inputs.gpu_usd_per_hour / SECONDS_PER_HOUR
    self_hosted = {
        "requests_per_day": self_hosted_per_day,
        "prefill_gpu_hours_no_cache": none_s / SECONDS_PER_HOUR,
        "prefill_gpu_hours_timestamp_at_top": stamped_s / SECONDS_PER_HOUR,
        "prefill_gpu_hours_planned": with_s / SECONDS_PER_HOUR,
        "saved_usd_per_day_vs_no_cache": (none_s - with_s) * gpu,
        "saved_usd_per_day_vs_timestamp_at_top": (stamped_s - with_s) * gpu,
        "fleet_usd_per_day": inputs.replicas * HOURS_PER_DAY * inputs.gpu_usd_per_hour,
        "gpu_usd_per_hour": inputs.gpu_usd_per_hour,
        "note": f"prefill GPU time from the engine profile {service.name} over the simulated "
                f"requests' cached tokens ({chosen.name}), scaled to a day; the simulated sample "
                f"includes its own warm-up, so the saving is a lower bound",
    }
    provider_per_day = inputs.requests_per_day * inputs.provider_share
    per_token = inputs.price_per_mtok / TOKENS_PER_MTOK
    mean_user = (inputs.user_tokens_min + inputs.user_tokens_max) / 2
    suffix_usd = provider_per_day * mean_user * per_token
    classes = ttl["classes"]
    prefix_planned = sum(c["usd_per_day"] for c in classes.values())
    prefix_none = sum(c["no_cache_usd_per_day"] for c in classes.values())
    # Today: the exact replay of the timestamp-at-top layout under the first provider policy
    # (nothing is read, the premium is paid on every write).
    today_policy = inputs.provider_policies[0].name
    today = accounting.get("layouts", {}).get("timestamp_at_top", {}).get("policies", {}) \
        .get(today_policy, {}).get("input_multiplier")
    provider = {
        "requests_per_day": provider_per_day,
        "no_cache_usd_per_day": prefix_none + suffix_usd,
        "timestamp_at_top_usd_per_day": (prefix_none + suffix_usd) * (today or 1.0),
        "timestamp_at_top_policy": today_policy,
        "planned_usd_per_day": prefix_planned + suffix_usd,
        "prefix_usd_per_day": prefix_planned,
        "suffix_usd_per_day": suffix_usd,
        "by_class": {name: {"choice": c["choice"], "usd_per_day": c["usd_per_day"]}
                     for name, c in classes.items()},
        "note": "planned: prefix tokens per class at the chosen TTL (Poisson P(hit) at each "
                "prefix's provider rate, write premium included), user tokens at the base "
                f"price; today: no caching times the exact replay's cost multiplier of the "
                f"timestamp-at-top layout under {today_policy} (nothing is read, every write "
                f"pays the premium)",
    }
    provider_saved = provider["no_cache_usd_per_day"] - provider["planned_usd_per_day"]
    return {
        "self_hosted": self_hosted,
        "provider": provider,
        "total_usd_per_day": self_hosted["fleet_usd_per_day"] + provider["planned_usd_per_day"],
        "saved_usd_per_day": provider_saved + self_hosted["saved_usd_per_day_vs_no_cache"],
        "explain": "total = the self-hosted fleet's GPUs for a day plus the provider bill; "
                   "saved = the provider bill avoided plus the self-hosted prefill GPU time "
                   "freed, both against no caching",
    }


def _provider_accounting(inputs: PlanInputs) -> dict:
    """Exact replay of a sample of the provider's traffic (real time, the provider's share of
    the rate) under three layouts, for each provider policy."""
    out: dict = {"requests": inputs.accounting_requests, "layouts": {}}
    if inputs.provider_share == 0:
        out["note"] = "no traffic on the provider"
        return out
    per_day = inputs.requests_per_day * inputs.provider_share
    layouts = {
        "timestamp_at_top": (True, "auto", "today: the timestamp first, automatic caching"),
        "breakpoint_at_end": (False, "end", "fixed prompt, one breakpoint at the end of the "
                                            "prompt (after the user turn)"),
        "breakpoint_at_static_end": (False, "static", "fixed prompt, a breakpoint at the end "
                                                      "of the static region"),
    }
    for name, (stamp, spec, meaning) in layouts.items():
        requests = design_scenario(
            requests=inputs.accounting_requests, tenants=inputs.tenants,
            prefix_tokens=inputs.prefix_tokens, requests_per_day=per_day, compress=1.0,
            zipf_exponent=inputs.zipf_exponent, hot_tenant_share=inputs.hot_tenant_share,
            user_tokens_min=inputs.user_tokens_min, user_tokens_max=inputs.user_tokens_max,
            output_tokens_min=inputs.output_tokens_min,
            output_tokens_max=inputs.output_tokens_max, timestamp_at_top=stamp,
            block_size=inputs.block_size, seed=inputs.seed)
        model = CacheModel(parse_breakpoints(spec), min_cacheable_tokens=inputs.min_cacheable_tokens)
        results = account_policies(requests, inputs.provider_policies, model)
        entry: dict = {"meaning": meaning, "cache_model": model.as_dict(), "policies": {}}
        for policy_name, result in results.items():
            report = result.as_dict(inputs.price_per_mtok)
            totals = report["totals"]
            days = report["duration_s"] / SECONDS_PER_DAY
            entry["policies"][policy_name] = {
                "written_tokens": totals["written_tokens"],
                "read_tokens": totals["read_tokens"],
                "uncached_tokens": totals["uncached_tokens"],
                "input_multiplier": totals["input_multiplier"],
                "poisson_multiplier": totals["poisson"]["multiplier"],
                "usd_per_day": totals["usd"] / days if days > 0 else None,
                "no_cache_usd_per_day": totals["no_cache_usd"] / days if days > 0 else None,
            }
            entry["duration_s"] = report["duration_s"]
        out["layouts"][name] = entry
    out["note"] = ("a sample from the start of the day: every prefix starts cold, so the "
                   "figures include warm-up writes that a steady day amortises")
    return out


def _price_on_the_day(accounting: dict, no_cache_usd_per_day: float) -> None:
    """Price each replayed layout on the plan's one no-caching day.

    The replay's own dollars scale a 2,000-request sample to a day, so its no-caching bill
    differs from the cost section's expected one by the sample's draw of prefixes and user
    turns (a few percent); two "no caching" figures for one day read as a contradiction. The
    replay's measured cost multiplier is what it contributes: ``usd_per_day`` is that
    multiplier times the day's no-caching bill, the same product the cost section uses for
    "today". The sample's own figures stay, as ``sample_usd_per_day`` and
    ``sample_no_cache_usd_per_day``.
    """
    for entry in accounting.get("layouts", {}).values():
        for result in entry["policies"].values():
            result["sample_usd_per_day"] = result.pop("usd_per_day")
            result["sample_no_cache_usd_per_day"] = result.pop("no_cache_usd_per_day")
            result["usd_per_day"] = result["input_multiplier"] * no_cache_usd_per_day
            result["no_cache_usd_per_day"] = no_cache_usd_per_day


def _summary(plan: dict) -> dict:
    layout = plan["layout"]["timestamp_measured"]
    ttl = plan["ttl"]["classes"]
    kv = plan["kv_memory"]
    cost = plan["cost_per_day"]
    return {
        "layout": f"move the timestamp out of the static region: token hit rate "
                  f"{layout['timestamp_at_top_token_hit_rate']:.1%} -> "
                  f"{layout['fixed_token_hit_rate']:.1%} ({layout['policy']}, simulated)",
        "routing": plan["routing"]["why"],
        "ttl": {name: c["choice"] for name, c in ttl.items()},
        "kv_memory": kv["verdict"],
        "cost_per_day": (f"provider ${cost['provider']['planned_usd_per_day']:,.0f}/day "
                         f"(no caching ${cost['provider']['no_cache_usd_per_day']:,.0f}); "
                         f"self-hosted prefill saved "
                         f"${cost['self_hosted']['saved_usd_per_day_vs_no_cache']:,.0f}/day "
                         f"({cost['self_hosted']['prefill_gpu_hours_no_cache']:.1f} -> "
                         f"{cost['self_hosted']['prefill_gpu_hours_planned']:.1f} GPU-hours)"),
    }
