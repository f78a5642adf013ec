"""``prefixroute plan``: the capacity and cost plan for the design scenario (a multi-tenant
assistant).

Inputs come from defaults (the design scenario), a YAML file (``--config plan.yaml``, see
``examples/plan.yaml``) and flags, each overriding the one before. The plan itself is
:func:`prefixroute.core.economics.planner.make_plan` (it runs the simulator and the accounting);
this module reads the file, renders the Markdown report and its PNG plots, and writes them.

Output: the Markdown report on standard output, or with ``--out DIR`` ``DIR/plan.md`` and the
plots beside it (everything rendered in memory first, then each file written atomically, so an
error leaves nothing half-written); ``--json`` prints the plan as JSON instead.

A malformed file is one line naming the file, the line and the field (``plan.yaml:7: expected a
number, got 'many' (field 'fleet.replicas')``), exit code 2.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from prefixroute.core.economics.accounting import min_cacheable_tokens
from prefixroute.core.economics.planner import (
    DEFAULT_CANDIDATES,
    PlanInputs,
    make_plan,
    prefix_rates_per_hour,
)
from prefixroute.core.economics.presets import PRESETS
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.identity.model_config import DTYPE_BYTES, MODEL_PRESETS
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          write_atomic)

_DEFAULTS = PlanInputs.__dataclass_fields__

# YAML section -> {key: PlanInputs field}. One table, read by the loader and the docs.
CONFIG_SCHEMA: dict[str, dict[str, str]] = {
    "scenario": {
        "tenants": "tenants", "prefix_tokens": "prefix_tokens",
        "requests_per_day": "requests_per_day", "hot_tenant_share": "hot_tenant_share",
        "zipf_exponent": "zipf_exponent", "user_tokens_min": "user_tokens_min",
        "user_tokens_max": "user_tokens_max", "output_tokens_min": "output_tokens_min",
        "output_tokens_max": "output_tokens_max", "timestamp_at_top": "timestamp_at_top",
    },
    "fleet": {
        "replicas": "replicas", "model": "model", "kv_dtype": "kv_dtype",
        "kv_memory_gib": "kv_memory_gib", "engine_profile": "engine_profile",
        "gpu_usd_per_hour": "gpu_usd_per_hour", "block_size": "block_size",
    },
    "provider": {
        "share": "provider_share", "price_per_mtok": "price_per_mtok",
        "policies": "provider_policies", "min_cacheable_tokens": "min_cacheable_tokens",
        "prewarm": "allow_prewarm",
    },
    "simulation": {
        "requests": "sim_requests", "compress": "compress", "policies": "policies",
        "max_load_ratio": "max_load_ratio", "seed": "seed",
        "accounting_requests": "accounting_requests",
    },
}
_INTEGERS = {"tenants", "prefix_tokens", "user_tokens_min", "user_tokens_max",
             "output_tokens_min", "output_tokens_max", "replicas", "block_size", "sim_requests",
             "accounting_requests"}
_POSITIVE = {"requests_per_day", "kv_memory_gib", "compress", "max_load_ratio"}
_NON_NEGATIVE = {"hot_tenant_share", "zipf_exponent", "gpu_usd_per_hour", "provider_share",
                 "price_per_mtok"}


# -- the subcommand ------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan", help="plan a fleet for the design scenario: layout, keys, metrics, "
                     "routing, TTLs, KV memory and cost, from simulator runs",
        description=__doc__.split("\n\n")[0].replace("``", "") + " Defaults are the design "
                    "scenario: 200 tenant "
                    "prefixes of 10,000 tokens, 50,000 requests/day, 8 replicas, one hot "
                    "tenant, a Zipf tail, a provider share with a write premium, and prompts "
                    "that start with a timestamp.")
    parser.add_argument("--config", metavar="FILE", help="plan inputs as YAML (examples/plan.yaml)")
    scenario = parser.add_argument_group("scenario (override the file)")
    scenario.add_argument("--tenants", type=int, metavar="N", help="tenant prefixes (200)")
    scenario.add_argument("--prefix-tokens", type=int, metavar="N",
                          help="tokens per tenant prefix (10,000)")
    scenario.add_argument("--requests-per-day", type=float, metavar="N",
                          help="requests per day over the fleet and the provider (50,000)")
    scenario.add_argument("--hot-tenant-share", type=float, metavar="F",
                          help="share of traffic of the hot tenant (0.25)")
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument("--replicas", type=int, metavar="N", help="self-hosted replicas (8)")
    fleet.add_argument("--model", metavar="NAME|FILE",
                       help=f"model shape for KV bytes per token: {', '.join(MODEL_PRESETS)} or "
                            f"a JSON/YAML config (llama-3-8b)")
    fleet.add_argument("--kv-dtype", choices=sorted(DTYPE_BYTES), help="KV cache dtype (bf16)")
    fleet.add_argument("--kv-memory-gib", type=float, metavar="X",
                       help="KV memory per replica this service may use on the shared GPUs (20)")
    fleet.add_argument("--gpu-usd-per-hour", type=float, metavar="USD",
                       help="cost of one replica's GPU time per hour (2.50)")
    provider = parser.add_argument_group("provider")
    provider.add_argument("--provider-share", type=float, metavar="F",
                          help="share of requests sent to the hosted provider (0.25)")
    provider.add_argument("--price-per-mtok", type=float, metavar="USD",
                          help="provider base input price per million tokens (3)")
    provider.add_argument("--provider-policy", action="append", metavar="NAME",
                          help=f"provider cache option, repeatable: {', '.join(PRESETS)} "
                               f"(default 5m_1.25x and 1h_2x)")
    provider.add_argument("--min-cacheable-tokens", metavar="N|MODEL",
                          help="provider's minimum cacheable prefix (1,024)")
    provider.add_argument("--no-prewarm", action="store_true",
                          help="do not consider keep-alive pre-warming")
    simulation = parser.add_argument_group("simulation")
    simulation.add_argument("--policy", action="append", metavar="NAME[:k=v,...]",
                            help=f"routing policy to simulate, repeatable (default: "
                                 f"{', '.join(DEFAULT_CANDIDATES)}, those registered)")
    simulation.add_argument("--sim-requests", type=int, metavar="N",
                            help="requests per simulator run (2,000)")
    simulation.add_argument("--compress", type=float, metavar="F",
                            help="simulate F times the daily mean rate, a peak (4)")
    simulation.add_argument("--accounting-requests", type=int, metavar="N",
                            help="provider requests replayed through the exact accounting "
                                 "(2,000)")
    simulation.add_argument("--seed", type=int, metavar="N", help="seed (0)")
    parser.add_argument("--out", metavar="DIR", help="write plan.md and PNG plots to DIR")
    add_json_argument(parser, "the plan")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_json_destination(args.json)
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise ConfigError(f"--out: {args.out} exists and is not a directory")
    inputs = build_inputs(args)
    plan = _with_progress(inputs, enabled=not args.no_progress and sys.stderr.isatty())
    # Render everything before writing anything.
    outputs: dict[str, str | bytes] = {}
    if args.out:
        plots = render_plots(plan, inputs)
        outputs["plan.md"] = render_markdown(plan, plots=list(plots))
        outputs["plan.json"] = json.dumps(plan, indent=2) + "\n"
        outputs.update(plots)
    for name, data in outputs.items():
        write_atomic(Path(args.out) / name, data, make_parents=True)
    if args.json:
        emit_json(plan, args.json)
    elif args.out:
        for name in outputs:
            print(f"wrote {Path(args.out) / name}")
        for key, text in _summary_items(plan):
            print(f"{key}: {text}")
    else:
        sys.stdout.write(render_markdown(plan, plots=[]))
    return 0


def _with_progress(inputs: PlanInputs, enabled: bool) -> dict:
    if not enabled:
        return make_plan(inputs)
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    # MofNCompleteColumn shows "0/?" until the planner states its number of steps.
    with Progress(TextColumn("{task.description:<40}"), BarColumn(),
                  MofNCompleteColumn(), TimeElapsedColumn(),
                  console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("plan", total=None)

        def update(label: str, done: int, total: int) -> None:
            progress.update(task, description=label, completed=done, total=total)

        return make_plan(inputs, progress=update)


# -- inputs: defaults <- file <- flags ---------------------------------------------------------
def build_inputs(args: argparse.Namespace) -> PlanInputs:
    values: dict[str, Any] = {}
    where: dict[str, tuple[str, str]] = {}  # field -> (file:line, yaml path), for later errors
    if args.config:
        values, where = load_config(args.config)
    flags = {
        "tenants": args.tenants, "prefix_tokens": args.prefix_tokens,
        "requests_per_day": args.requests_per_day, "hot_tenant_share": args.hot_tenant_share,
        "replicas": args.replicas, "kv_memory_gib": args.kv_memory_gib,
        "gpu_usd_per_hour": args.gpu_usd_per_hour, "provider_share": args.provider_share,
        "price_per_mtok": args.price_per_mtok, "sim_requests": args.sim_requests,
        "compress": args.compress, "seed": args.seed,
        "accounting_requests": args.accounting_requests,
    }
    for name, value in flags.items():
        if value is not None:
            values[name] = value
            where.pop(name, None)
    if args.model is not None:
        values["model"] = _model(args.model)
        where.pop("model", None)
    if args.kv_dtype is not None:
        values["kv_dtype"] = args.kv_dtype
        where.pop("kv_dtype", None)
    if args.provider_policy:
        values["provider_policies"] = tuple(_preset(name, "--provider-policy")
                                            for name in args.provider_policy)
        where.pop("provider_policies", None)
    if args.min_cacheable_tokens is not None:
        try:
            values["min_cacheable_tokens"] = min_cacheable_tokens(args.min_cacheable_tokens)
        except ConfigError as exc:
            raise ConfigError(f"--min-cacheable-tokens: {exc}") from None
        where.pop("min_cacheable_tokens", None)
    if args.no_prewarm:
        values["allow_prewarm"] = False
    if args.policy:
        values["policies"] = tuple(args.policy)
        where.pop("policies", None)
    return make_inputs(values, where)


def make_inputs(values: dict[str, Any], where: dict[str, tuple[str, str]] | None = None) -> PlanInputs:
    """:class:`PlanInputs` from loose values (``kv_dtype`` applies to the model); a
    :class:`ConfigError` about a field read from a file is re-raised naming its file:line."""
    where = where or {}
    values = dict(values)
    dtype = values.pop("kv_dtype", None)
    try:
        if dtype is not None:
            from dataclasses import replace
            base = values.get("model", _DEFAULTS["model"].default)
            values["model"] = replace(base, kv_dtype=dtype)
        return PlanInputs(**values)
    except ConfigError as exc:
        message = str(exc)
        named = [name for name in where if message.startswith(name)] or \
            [name for name in where if f" {name} " in f" {message} "]
        if named:
            location, path = where[named[0]]
            raise InputError(message, where=location, field=path) from None
        raise


def _preset(name: str, flag: str):
    if name not in PRESETS:
        raise ConfigError(f"{flag}: unknown cache policy {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def _model(text: str):
    from prefixroute.edges.profiles import load_model_config
    return load_model_config(text, "model")


def load_config(path: str) -> tuple[dict[str, Any], dict[str, tuple[str, str]]]:
    """Read ``plan.yaml``: (PlanInputs values, field -> (file:line, YAML path)).

    Every error is an :class:`InputError` naming the file, the line and the field. The
    line-aware YAML reader is :mod:`prefixroute.edges.yaml_reader`, shared with the gateway."""
    from prefixroute.edges.yaml_reader import ConfigReader, load_yaml

    data = load_yaml(path, "plan")
    top = ConfigReader(path, data, "", 1)
    values: dict[str, Any] = {}
    where: dict[str, tuple[str, str]] = {}
    for section_name, keys in CONFIG_SCHEMA.items():
        section = top.section(section_name)
        for key, name in keys.items():
            if not section.has(key):
                section.raw(key)  # known, even when absent
                continue
            location = f"{path}:{section.lines.get(key, section.line)}"
            where[name] = (location, section.child_path(key))
            values[name] = _read_value(section, key, name)
        section.finish()
    top.finish()
    return values, where


def _read_value(section, key: str, name: str) -> Any:
    if name in _INTEGERS:
        return section.integer(key, None, minimum=1)
    if name == "seed":
        return section.integer(key, None, minimum=0)
    if name in _POSITIVE:
        return section.number(key, None)
    if name in _NON_NEGATIVE:
        value = section.number(key, None, non_negative=True)
        if name in ("hot_tenant_share", "provider_share") and value > 1:
            section.fail(f"a share is at most 1, got {value:g}", key)
        return value
    if name in ("timestamp_at_top", "allow_prewarm"):
        return section.boolean(key, True)
    if name == "kv_dtype":
        return section.string(key, choices=tuple(sorted(DTYPE_BYTES)))
    if name == "engine_profile":
        from prefixroute.edges.profiles import load_profile
        text = section.string(key)
        try:
            return load_profile(text, "engine_profile")
        except (ConfigError, InputError) as exc:
            section.fail(str(exc), key)
    if name == "model":
        raw = section.raw(key)
        if isinstance(raw, str) and raw not in MODEL_PRESETS and not os.path.exists(raw):
            section.fail(f"no model preset or file {raw!r}; presets: "
                         f"{', '.join(MODEL_PRESETS)}", key)
        try:
            if isinstance(raw, str):
                return _model(raw)
            if isinstance(raw, dict):
                from prefixroute.core.identity.model_config import ModelConfig
                return ModelConfig.from_dict(dict(raw), where="model")
        except (ConfigError, InputError) as exc:
            section.fail(str(exc), key)
        section.fail("expected a preset name, a file, or a mapping with num_layers, "
                     "num_kv_heads, head_dim and kv_dtype", key)
    if name == "min_cacheable_tokens":
        raw = section.raw(key)
        if isinstance(raw, bool) or not isinstance(raw, (int, str)):
            section.fail("expected a number of tokens or a model family", key)
        try:
            return min_cacheable_tokens(raw)
        except ConfigError as exc:
            section.fail(str(exc), key)
    if name == "provider_policies":
        items = section.sequence(key)
        if not items:
            section.fail("name at least one cache policy", key)
        out = []
        for item in items:
            if not isinstance(item, str) or item not in PRESETS:
                section.fail(f"unknown cache policy {item!r}; known: {', '.join(PRESETS)}", key)
            out.append(PRESETS[item])
        return tuple(out)
    if name == "policies":
        items = section.sequence(key)
        from prefixroute.core.routing.registry import create_policy
        for item in items:
            if not isinstance(item, str):
                section.fail(f"expected policy specs (strings), got {item!r}", key)
            try:
                create_policy(item, seed=0, num_replicas=1, block_size=16)
            except ConfigError as exc:
                section.fail(str(exc), key)
        return tuple(items)
    raise AssertionError(name)  # every schema field is handled above


# -- the Markdown report -----------------------------------------------------------------------
def _pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}%}"


def _usd(x: float | None) -> str:
    return "-" if x is None else f"${x:,.2f}"


def _rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 10 else f"{x:.1f}" if x >= 1 else f"{x:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |",
           "|" + "|".join("---" if i == 0 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def _summary_items(plan: dict) -> list[tuple[str, str]]:
    """The plan's summary as (key, text) lines; a per-class choice reads "hot: 5m_1.25x, ..."."""
    out = []
    for key, text in plan["summary"].items():
        if isinstance(text, dict):
            text = ", ".join(f"{k}: {v}" for k, v in text.items())
        out.append((key, str(text)))
    return out


def render_markdown(plan: dict, plots: list[str]) -> str:
    inputs = plan["inputs"]
    lines: list[str] = []
    add = lines.append
    add("# Fleet plan: multi-tenant assistant")
    add("")
    add(f"{inputs['tenants']} tenant prefixes of {inputs['prefix_tokens']:,} tokens, "
        f"{inputs['requests_per_day']:,.0f} requests/day, {inputs['replicas']} replicas "
        f"({inputs['model']['name']}, {inputs['kv_memory_gib']:g} GiB KV each), "
        f"{inputs['provider_share']:.0%} of the traffic on a provider at "
        f"${inputs['price_per_mtok']:g} per million input tokens. Every number below comes from "
        f"a simulator run or a formula of this library; `prefixroute plan --json` has them all.")
    add("")
    add("## Summary")
    add("")
    for key, text in _summary_items(plan):
        add(f"- **{key.replace('_', ' ')}**: {text}")
    add("")

    layout = plan["layout"]
    add("## 1. Prompt layout")
    add("")
    for i, item in enumerate(layout["order"], 1):
        add(f"{i}. {item}")
    add("")
    for rule in layout["rules"]:
        add(f"- {rule}")
    add("")
    measured = layout["timestamp_measured"]
    add(f"Measured with `{measured['policy']}` on the same requests "
        f"({plan['routing']['simulation']['requests']:,} per run):")
    add("")
    lines += _table(["layout", "token hit rate", "ideal (one infinite cache)"], [
        ["timestamp at the top (today)", _pct(measured["timestamp_at_top_token_hit_rate"]),
         _pct(measured["timestamp_at_top_ideal_token_hit_rate"])],
        ["timestamp after the static region", _pct(measured["fixed_token_hit_rate"]),
         _pct(measured["fixed_ideal_token_hit_rate"])],
    ])
    add("")
    add(f"Difference: {measured['difference'] * 100:+.1f} points. {measured['note']}.")
    add("")
    demo = layout.get("growing_conversation")
    if demo:
        d = demo["inputs"]
        add(f"**Breakpoints in a growing conversation** ({d['turns']} turns, "
            f"{d['system_tokens']:,}-token static region, +{d['growth_tokens_per_turn']} tokens "
            f"a turn = {d['growth_blocks_per_turn']:g} blocks of {d['block_size']}, lookback "
            f"{d['lookback_blocks']} blocks, {d['policy']}):")
        add("")
        rows = []
        for spec, entry in demo["layouts"].items():
            rows.append([f"`{spec}`", entry["meaning"],
                         " ".join(f"{w:,}" for w in entry["written_by_turn"]),
                         f"{entry['written_tokens']:,}", f"{entry['read_tokens']:,}",
                         f"x{entry['input_multiplier']:.3f}"])
        lines += _table(["breakpoints", "", "written by turn", "written", "read",
                         "cost vs uncached"], rows)
        add("")
        add("With the only breakpoint at the end, a turn that adds more than the lookback's 20 "
            "blocks cannot reach the previous write, so every turn writes the whole "
            "conversation again at the write premium; a breakpoint at the end of the static "
            "region fixes the static part, and one at the end of the previous turn the history.")
        add("")

    keys = plan["keys_and_salts"]
    add("## 2. Keys and salts each request carries")
    add("")
    add(f"- **cache salt**: {keys['cache_salt']['what']} (example with a demo secret: "
        f"`{keys['cache_salt']['example_with_demo_secret']}`). Why: {keys['cache_salt']['why']}.")
    add(f"- **compatibility key**: {keys['compatibility_key']['what']}. Fields: "
        + ", ".join(f"`{f}`" for f in keys["compatibility_key"]["fields"]) + ".")
    add(f"- **adapter**: {keys['adapter']}.")
    add(f"- **routing key**: {keys['routing_key']['what']}.")
    add(f"- **provider breakpoint**: {keys['provider_breakpoint']['what']}; minimum cacheable "
        f"{keys['provider_breakpoint']['min_cacheable_tokens']:,} tokens.")
    add(f"- **media**: {keys['media']}.")
    add("")

    metrics = plan["metrics"]
    add("## 3. Metrics to watch")
    add("")
    add(f"- token hit rate (engines): `{metrics['token_hit_rate']['engine']}`")
    add(f"- token hit rate (gateway): `{metrics['token_hit_rate']['gateway']}`")
    add(f"- router prediction vs reality: {metrics['token_hit_rate']['router_prediction']}")
    add(f"- per prefix class: {metrics['per_prefix']['what']}; "
        + ", ".join(f"`{s}`" for s in metrics["per_prefix"]["proposed_series"])
        + f" ({metrics['per_prefix']['status']})")
    add(f"- cost multiplier: {metrics['per_prefix']['cost_multiplier']}")
    add("- load: " + ", ".join(f"`{m}`" for m in metrics["load"]))
    add("- latency: " + ", ".join(f"`{m}`" for m in metrics["latency"]))
    add("")

    routing = plan["routing"]
    sim = routing["simulation"]
    add("## 4. Routing policy")
    add("")
    add(f"Simulated: {sim['requests']:,} requests of the design scenario at {sim['compress']:g}x "
        f"the daily mean rate ({sim['duration_s']:.0f} s), {sim['fleet']['replicas']} replicas x "
        f"{sim['fleet']['cache_blocks']:,} blocks of {sim['fleet']['block_size']} tokens, engine "
        f"profile {sim['fleet']['engine_profile']}, seed {sim['seed']}; ideal token hit rate "
        f"{_pct(sim['ideal_token_hit_rate'])} (one infinite cache, warm-up included).")
    add("")
    rows = []
    for row in routing["policies"]:
        name = f"**{row['policy']}**" if row["policy"] == routing["chosen"] else row["policy"]
        rows.append([name, _pct(row["token_hit_rate"]),
                     "-" if row["ttft_p99_s"] is None else f"{row['ttft_p99_s']:.3f} s",
                     "-" if row["max_mean_load"] is None else f"{row['max_mean_load']:.2f}",
                     "-" if row["max_mean_requests"] is None else f"{row['max_mean_requests']:.2f}",
                     f"{row['evictions']:,}"])
    lines += _table(["policy", "token hit rate", "TTFT p99", "max/mean busy time",
                     "max/mean requests", "evictions"], rows)
    add("")
    add(f"Rule: {routing['rule']}")
    add("")
    add(f"Chosen: {routing['why']}.")
    add("")
    if "routing.png" in plots:
        add("![routing](routing.png)")
        add("")

    ttl = plan["ttl"]
    add("## 5. TTL per prefix class (provider)")
    add("")
    add(ttl["rule"])
    add("")
    rows = []
    for name, c in ttl["classes"].items():
        rate = c["provider_requests_per_hour"]
        rows.append([name, str(c["prefixes"]), f"{_rate(rate['min'])} - {_rate(rate['max'])}",
                     f"`{c['choice']}`", f"`{c['choice_without_prewarm']}`",
                     _usd(c["usd_per_day"]), _usd(c["no_cache_usd_per_day"]),
                     ", ".join(f"{k} {v}" for k, v in c["per_prefix_best"].items())])
    lines += _table(["class", "prefixes", "provider req/h", "choice", "without pre-warming",
                     "USD/day", "uncached USD/day", "cheapest per prefix"], rows)
    add("")
    add("`+prewarm` keeps the prefix alive with one keep-alive request per TTL (billed as a "
        "read) plus one write a day; without a pinger, use the other column.")
    add("")
    if "prefix_rates.png" in plots:
        add("![prefix rates](prefix_rates.png)")
        add("")

    kv = plan["kv_memory"]
    add("## 6. KV memory")
    add("")
    add(f"{kv['formula']}. {kv['model']['name']}: {kv['model']['num_layers']} layers x "
        f"{kv['model']['num_kv_heads']} KV heads x {kv['model']['head_dim']} head dim.")
    add("")
    rows = []
    for dtype, d in kv["by_dtype"].items():
        rows.append([dtype, f"{d['bytes_per_token']:,}", f"{d['all_prefixes_gib']:.1f}",
                     f"{d['working_set_gib']:.1f}", f"{d['per_replica_replicated_gib']:.1f}",
                     f"{d['per_replica_partitioned_gib']:.1f}",
                     f"{d['fleet_partitioned_gib']:.1f}",
                     "yes" if d["fits_partitioned"] else "no"])
    lines += _table(["KV dtype", "bytes/token", "all prefixes GiB", "working set GiB",
                     "per replica, replicated", "per replica, partitioned",
                     "fleet, partitioned", f"fits {kv['kv_memory_gib_per_replica']:g} GiB"],
                    rows)
    add("")
    add(f"Working set: {kv['working_set_tokens']:,.0f} tokens ({kv['active_prefixes_per_hour']:.1f} "
        f"prefixes expected within an hour). {kv['note']}.")
    add("")
    measured_rows = [[dtype, f"{m['cache_blocks']:,}", _pct(m["token_hit_rate"]),
                      f"{m['evictions']:,}"] for dtype, m in kv["measured"].items()]
    add(f"Measured with `{kv['measured_policy']}`:")
    add("")
    lines += _table(["KV dtype", "blocks per replica", "token hit rate", "evictions"],
                    measured_rows)
    add("")
    add(f"Verdict: {kv['verdict']}.")
    add("")
    if "kv_memory.png" in plots:
        add("![kv memory](kv_memory.png)")
        add("")

    accounting = plan["provider_accounting"]
    add("## 7. Provider traffic, replayed exactly")
    add("")
    if accounting.get("layouts"):
        add(f"{accounting['requests']:,} provider requests at the provider's real rate, replayed "
            f"through the provider cache (refresh-on-hit TTL) and billed token by token; "
            f"Poisson is the steady-state approximation P(hit) = 1 - exp(-rate x TTL) at each prefix's rate. "
            f"{accounting['note']}.")
        add("")
        rows = []
        for name, entry in accounting["layouts"].items():
            for policy, p in entry["policies"].items():
                rows.append([name.replace("_", " "), policy, f"{p['written_tokens']:,}",
                             f"{p['read_tokens']:,}", f"{p['uncached_tokens']:,}",
                             f"x{p['input_multiplier']:.2f}",
                             "-" if p["poisson_multiplier"] is None
                             else f"x{p['poisson_multiplier']:.2f}",
                             _usd(p["usd_per_day"])])
        lines += _table(["layout", "policy", "written", "read", "uncached", "cost vs uncached",
                         "Poisson (cacheable part)", "USD/day"], rows)
        add("")
        no_cache = plan["cost_per_day"]["provider"]["no_cache_usd_per_day"]
        add(f"USD/day is the cost multiplier times the day's no-caching bill, "
            f"{_usd(no_cache)} (section 8); `--json` keeps the sample's own dollars.")
        add("")
        add("Where the exact figure is far above the Poisson one, the approximation's assumption "
            "fails: with the only breakpoint after the unique user turn, no request ever finds "
            "an entry within 20 blocks of its breakpoint, so every prompt is written at the "
            "premium although the prefix recurs; a timestamp at the top makes every prompt "
            "unique. The breakpoint at the end of the static region is the layout to ship.")
        add("")
    else:
        add(accounting.get("note", ""))
        add("")

    cost = plan["cost_per_day"]
    self_hosted = cost["self_hosted"]
    provider = cost["provider"]
    add("## 8. Cost per day")
    add("")
    lines += _table(["item", "no caching",
                     f"today (timestamp at the top, {provider['timestamp_at_top_policy']})",
                     "planned"], [
        ["self-hosted prefill GPU-hours", f"{self_hosted['prefill_gpu_hours_no_cache']:.2f}",
         f"{self_hosted['prefill_gpu_hours_timestamp_at_top']:.2f}",
         f"{self_hosted['prefill_gpu_hours_planned']:.2f}"],
        ["provider USD", _usd(provider["no_cache_usd_per_day"]),
         _usd(provider["timestamp_at_top_usd_per_day"]), _usd(provider["planned_usd_per_day"])],
    ])
    add("")
    add(f"- self-hosted: {self_hosted['requests_per_day']:,.0f} requests/day; prefill time saved "
        f"{_usd(self_hosted['saved_usd_per_day_vs_no_cache'])}/day against no caching "
        f"({_usd(self_hosted['saved_usd_per_day_vs_timestamp_at_top'])} against today) at "
        f"${self_hosted['gpu_usd_per_hour']:g} per GPU-hour; the fleet itself costs "
        f"{_usd(self_hosted['fleet_usd_per_day'])}/day. {self_hosted['note']}.")
    add(f"- provider: {provider['requests_per_day']:,.0f} requests/day; "
        + ", ".join(f"{name} `{c['choice']}` {_usd(c['usd_per_day'])}"
                    for name, c in provider["by_class"].items())
        + f", user tokens {_usd(provider['suffix_usd_per_day'])}. {provider['note']}.")
    add(f"- total {_usd(cost['total_usd_per_day'])}/day; saved {_usd(cost['saved_usd_per_day'])}"
        f"/day. {cost['explain']}.")
    add("")
    if "costs.png" in plots:
        add("![costs](costs.png)")
        add("")
    add("## Inputs")
    add("")
    add("```json")
    add(json.dumps(inputs, indent=2))
    add("```")
    add("")
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    import matplotlib.pyplot as plt
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def render_plots(plan: dict, inputs: PlanInputs) -> dict[str, bytes]:
    """PNG bytes by file name: routing, prefix rates with TTL classes, KV memory, costs."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out: dict[str, bytes] = {}
    routing = plan["routing"]
    rows = routing["policies"]
    names = [r["policy"] for r in rows]
    colours = ["tab:orange" if n == routing["chosen"] else "tab:blue" for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    panels = (("token hit rate", [r["token_hit_rate"] for r in rows]),
              ("TTFT p99 (s)", [r["ttft_p99_s"] or 0 for r in rows]),
              ("max/mean busy time", [r["max_mean_load"] or 0 for r in rows]))
    for ax, (title, values) in zip(axes, panels):
        ax.bar(range(len(names)), values, color=colours)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
        ax.set_title(title)
        ax.grid(True, axis="y", alpha=0.3)
    axes[2].axhline(inputs.max_load_ratio, color="red", linestyle="--", linewidth=1,
                    label=f"cap {inputs.max_load_ratio:g}")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"Routing policies on the design scenario (chosen: {routing['chosen']})")
    fig.tight_layout()
    out["routing.png"] = _png(fig)

    rates = prefix_rates_per_hour(inputs)
    share = inputs.provider_share
    ttl = plan["ttl"]["classes"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    ranks = list(range(1, len(rates) + 1))
    provider_rates = [r * share for r in rates]
    ax.plot(ranks, rates, color="tab:gray", linewidth=1, label="fleet rate per prefix")
    if share > 0:
        rare = plan["ttl"]["rare_below_per_hour"]
        groups = {"hot": [0] if "hot" in ttl else [],
                  "rare": [i for i in range(len(rates)) if i > 0 and provider_rates[i] < rare],
                  "regular": [i for i in range(len(rates)) if i > 0 and provider_rates[i] >= rare]}
        for name, members in groups.items():
            if members and name in ttl:
                ax.scatter([ranks[i] for i in members], [provider_rates[i] for i in members],
                           s=10, label=f"{name} prefixes: TTL {ttl[name]['choice']}")
        ax.axhline(rare, color="red", linestyle="--", linewidth=1,
                   label=f"rare below {rare:g} per hour")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("prefix rank")
    ax.set_ylabel("requests per hour (dots: provider's share)")
    ax.set_title("Per-prefix request rate and the provider TTL per class")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    out["prefix_rates.png"] = _png(fig)

    kv = plan["kv_memory"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    dtypes = list(kv["by_dtype"])
    width = 0.38
    replicated = [kv["by_dtype"][d]["per_replica_replicated_gib"] for d in dtypes]
    partitioned = [kv["by_dtype"][d]["per_replica_partitioned_gib"] for d in dtypes]
    xs = range(len(dtypes))
    ax.bar([x - width / 2 for x in xs], replicated, width, label="per replica, replicated")
    ax.bar([x + width / 2 for x in xs], partitioned, width, label="per replica, partitioned")
    ax.axhline(kv["kv_memory_gib_per_replica"], color="red", linestyle="--", linewidth=1,
               label=f"available {kv['kv_memory_gib_per_replica']:g} GiB")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(dtypes)
    ax.set_ylabel("GiB")
    ax.set_title("KV memory for the working set")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    out["kv_memory.png"] = _png(fig)

    cost = plan["cost_per_day"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = ["no caching", "today", "planned"]
    sh = cost["self_hosted"]
    axes[0].bar(labels, [sh["prefill_gpu_hours_no_cache"], sh["prefill_gpu_hours_timestamp_at_top"],
                         sh["prefill_gpu_hours_planned"]], color="tab:blue")
    axes[0].set_title("self-hosted prefill GPU-hours per day")
    pr = cost["provider"]
    axes[1].bar(labels, [pr["no_cache_usd_per_day"], pr["timestamp_at_top_usd_per_day"],
                         pr["planned_usd_per_day"]], color="tab:green")
    axes[1].set_title("provider USD per day")
    for ax in axes:
        ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    out["costs.png"] = _png(fig)
    return out
