"""``prefixroute simulate``: replay a workload through replicas under several routing policies.

A workload is generated (``--workload NAME[:key=value,...]``) or read from a trace
(``--trace FILE``, format detected or given by ``--trace-format``). Every policy (repeat
``--policy``; ``all`` is every registered one) gets fresh replicas over the same requests; the
table and ``--json`` report token and request hit rates, reused prefill and what one infinite
cache would also have reused (lost to routing and finite caches), TTFT and end-to-end
percentiles, assignments and skew, utilisation and evictions, next to the workload's ideal
token hit rate (one infinite cache). ``--plot DIR`` draws a TTFT CDF per
policy, the hit rates, and each replica's load over time.

A gateway's recording (``serve`` with ``record``) also brings what the live router did: the
report then sets each policy's counterfactual beside the live hit rate and TTFT
(:mod:`prefixroute.edges.cli.live_compare`).

This module only parses, reads files and formats; the simulation is
:mod:`prefixroute.core.simulator.simulation`. Bad input (unknown policy or parameter, a trace
line with a missing field, time going backwards, a block-size mismatch) is one line naming the
file:line and field, exit code 2, and nothing written.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import sys
from pathlib import Path
from typing import Any, Callable

from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.model_config import MODEL_PRESETS
from prefixroute.core.replica.engine import SCHEDULING_POLICIES
from prefixroute.core.replica.service_time import DEFAULT_PROFILE, PRESETS
from prefixroute.core.routing.registry import expand_specs, parse_spec
from prefixroute.core.simulator.generators import WORKLOADS, make_workload, workload_parameters
from prefixroute.core.simulator.simulation import (DEFAULT_MAX_THINK_S, DEFAULT_VIEW, VIEWS,
                                                   FleetConfig, PolicyRun,
                                                   PreparedWorkload, prepare_workload, report,
                                                   simulate_policy)
from prefixroute.edges.profiles import load_model_config, load_profile
from prefixroute.edges.cli.columns import (POLICY_COLUMNS, SIMULATE_DEFAULT, add_table_arguments,
                                           choose_columns, metrics_epilog, pct, print_rows, secs)
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, print_json,
                                          stdout_console, write_atomic)

DEFAULT_TRACE_REPLICAS = 8  # the benchmark fleet of the design scenario
GIB = 1 << 30


# -- arguments shared with `sweep` ----------------------------------------------------------------
def add_workload_arguments(parser: argparse.ArgumentParser, *, grid: bool = False) -> None:
    """Workload and fleet flags; with ``grid`` (``sweep``) ``--cache-blocks`` takes a list."""
    source = parser.add_argument_group("workload (one of)")
    source.add_argument("--workload", metavar="NAME[:k=v,...]",
                        help=f"a generated workload: {', '.join(WORKLOADS)} (default seed-fleet)")
    source.add_argument("--trace", metavar="FILE", help="a trace file (kvtester: a file or a "
                        "directory of session files; a recording: a file or its directory)")
    source.add_argument("--trace-format",
                        choices=("mooncake", "kvtester", "jsonl", "azure", "recording"),
                        help="format of --trace (default: detected from the first record; "
                             "docs/trace-format.md)")
    source.add_argument("--trace-block-size", type=int, metavar="N",
                        help="block size of the trace's block ids (default: the format's: "
                             "mooncake 512, kvtester from the file, jsonl from the file or 16, "
                             "azure 16); must agree with the ids")
    source.add_argument("--azure-prefixes", metavar="k=v,...", default="",
                        help="prefix families given to an azure trace: prefixes, prefix_tokens, "
                             "max_prefix_fraction, zipf_exponent (defaults 20, 1000, 0.8, 1.0)")
    source.add_argument("--session-copies", type=int, default=1, metavar="N",
                        help="kvtester: replay every session N times as different users' "
                             "sessions, each keeping its own pacing (default 1)")
    source.add_argument("--copy-interval", type=float, default=0.0, metavar="S",
                        help="kvtester: copy c of each session starts c x S seconds later "
                             "(default 0; --time-scale scales it with every arrival)")
    source.add_argument("--closed-loop", action="store_true",
                        help="send each turn of a session when the previous one has completed, "
                             "after the client's think time (kvtester: think_time, at most "
                             "--max-think; else the recorded interval), as kv-cache-tester "
                             "replays its traces; --time-scale scales the think times")
    source.add_argument("--max-think", type=float, default=None, metavar="S",
                        help=f"with --closed-loop: think times longer than S seconds count as S "
                             f"(default {DEFAULT_MAX_THINK_S:g}, kv-cache-tester's --max-delay)")
    source.add_argument("--requests", type=int, metavar="N",
                        help="replay only the first N requests")
    source.add_argument("--time-scale", type=float, default=1.0, metavar="F",
                        help="multiply arrival times (with --closed-loop, think times) by F: "
                             "below 1 replays faster (more load), above 1 slower (default 1)")
    source.add_argument("--router-token-ids", action="store_true",
                        help="keep token ids and show them to routers (policies that can hash "
                             "tokens, e.g. prefix_hash:hash_token_ids=true); costs 4 bytes per "
                             "prompt token of memory")
    source.add_argument("--block-size", type=int, metavar="N",
                        help="block size of generated workloads (default 16, vLLM's)")
    source.add_argument("--seed", type=int, metavar="N",
                        help="seed of generated workloads and randomised policies (default: "
                             "each generator's own, e.g. 3 for seed-fleet; "
                             "policies 0)")
    fleet = parser.add_argument_group("fleet")
    if grid:
        fleet.add_argument("--cache-blocks", metavar="N,N,...",
                           help="usable KV blocks per replica, comma-separated grid values "
                                "(default: the workload's, else from the KV memory)")
    else:
        fleet.add_argument("--cache-blocks", type=int, metavar="N",
                           help="usable KV blocks per replica (default: the workload's, else "
                                "from --kv-memory-gib or the engine profile's memory)")
    fleet.add_argument("--kv-memory-gib", type=float, metavar="X",
                       help="KV memory per replica in GiB, with --model-config")
    fleet.add_argument("--model-config", metavar="FILE|NAME",
                       help=f"model shape for KV bytes per token: a JSON/YAML file (ours or a "
                            f"Hugging Face config.json) or a preset: {', '.join(MODEL_PRESETS)} "
                            f"(default: the engine profile's model)")
    fleet.add_argument("--engine-profile", default=DEFAULT_PROFILE, metavar="NAME|FILE",
                       help=f"service-time profile: {', '.join(PRESETS)} or a JSON/YAML file "
                            f"(default %(default)s)")
    fleet.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                       help="token budget per engine step (default 8192, vLLM's)")
    fleet.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                       help="running requests per replica at most (default 256, vLLM's)")
    fleet.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                       help="each replica's waiting-queue order, as vllm serve "
                            "--scheduling-policy: fcfs (vLLM's default) or priority (by the "
                            "priority a policy gives each request, lower first; prefixroute "
                            "sends deadlines, the others none); default %(default)s")
    fleet.add_argument("--view", choices=VIEWS, default=DEFAULT_VIEW,
                       help="router's view of replica caches for every policy (per policy: "
                            "view=... in its spec); default %(default)s")


def _key_values(text: str, flag: str) -> dict[str, str]:
    if not text:
        return {}
    _, params = parse_spec(f"x:{text}")
    return params


def _positive(value, flag: str):
    if value is not None and value < 1:
        raise ConfigError(f"{flag}: must be at least 1, got {value}")
    return value


def load_workload(args: argparse.Namespace) -> tuple[PreparedWorkload, dict[str, Any]]:
    """The requests (with keys) and what the fleet defaults to for this workload."""
    requests, info, defaults, max_think = open_requests(args)
    prepared = prepare_workload(requests, limit=args.requests, time_scale=args.time_scale,
                                keep_token_ids=getattr(args, "router_token_ids", False),
                                info=info, closed_loop=args.closed_loop,
                                max_think_s=max_think)
    if args.closed_loop and all(before < 0 for before in prepared.after):
        raise ConfigError("--closed-loop: the workload has no session with two turns or more")
    return prepared, defaults


def open_requests(args: argparse.Namespace):
    """The request stream (not read yet), its description, the fleet defaults and the
    longest think time, after checking the workload arguments."""
    _positive(args.requests, "--requests")
    _positive(args.trace_block_size, "--trace-block-size")
    _positive(args.block_size, "--block-size")
    if not math.isfinite(args.time_scale) or args.time_scale < 0:
        raise ConfigError(f"--time-scale: must be a non-negative number, got {args.time_scale}")
    if args.trace and args.workload:
        raise ConfigError("give --workload or --trace, not both")
    defaults: dict[str, Any] = {}
    if args.trace:
        from prefixroute.edges.traces import read_trace, resolve_format
        args.trace_format = resolve_format(args.trace, args.trace_format)
        if args.azure_prefixes and args.trace_format != "azure":
            raise ConfigError("--azure-prefixes applies to --trace-format azure only")
        prefixes = _key_values(args.azure_prefixes, "--azure-prefixes")
        typed: dict[str, Any] = {}
        for key, value in prefixes.items():
            if key not in ("prefixes", "prefix_tokens", "max_prefix_fraction", "zipf_exponent"):
                raise ConfigError(f"--azure-prefixes: unknown key {key!r}")
            try:
                typed[key] = float(value) if key in ("max_prefix_fraction",
                                                     "zipf_exponent") else int(value)
            except ValueError:
                raise ConfigError(f"--azure-prefixes: {key} expects a number, got "
                                  f"{value!r}") from None
        copies, interval = args.session_copies, args.copy_interval
        requests = read_trace(args.trace, args.trace_format, args.trace_block_size,
                              prefixes=typed, seed=args.seed or 0, copies=copies,
                              copy_interval_s=interval)
        info = {"source": "trace", "trace": str(args.trace), "format": args.trace_format}
        if copies != 1:
            info.update(session_copies=copies, copy_interval_s=interval)
        defaults["replicas"] = DEFAULT_TRACE_REPLICAS
        if args.trace_format == "recording":  # the live fleet's size and KV by default
            _recording_defaults(requests, defaults)
    else:
        for flag, value in (("--trace-format", args.trace_format),
                            ("--trace-block-size", args.trace_block_size),
                            ("--azure-prefixes", args.azure_prefixes),
                            ("--session-copies", args.session_copies != 1),
                            ("--copy-interval", args.copy_interval)):
            if value:
                raise ConfigError(f"{flag} needs --trace")
        spec = args.workload or "seed-fleet"
        name, params = parse_spec(spec)
        if name not in WORKLOADS:
            raise ConfigError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
        workload = WORKLOADS[name]
        requests = make_workload(name, params, seed=args.seed, block_size=args.block_size)
        info = {"source": "generator", "name": name, "params": params}
        defaults["replicas"] = workload.replicas
        defaults["cache_blocks"] = workload.cache_blocks
    if args.max_think is not None and not args.closed_loop:
        raise ConfigError("--max-think needs --closed-loop")
    max_think = DEFAULT_MAX_THINK_S if args.max_think is None else args.max_think
    if math.isnan(max_think) or max_think < 0:
        raise ConfigError(f"--max-think: must be a non-negative number of seconds, got "
                          f"{max_think}")
    if args.closed_loop:
        info.update(closed_loop=True, max_think_s=max_think)
    return requests, info, defaults, max_think


def _recording_defaults(recording: Any, defaults: dict[str, Any]) -> None:
    """A recording's fleet (from its headers) as the replay's defaults, and the recording
    itself, whose live outcomes the report compares with (``live_compare``)."""
    if recording.replicas is not None:
        defaults["replicas"] = recording.replicas
    if recording.cache_blocks is not None:
        defaults["cache_blocks"] = recording.cache_blocks
    defaults["recording"] = recording


def resolve_fleet(args: argparse.Namespace, workload: PreparedWorkload,
                  defaults: dict[str, Any], *, replicas: int | None = None,
                  cache_blocks: int | None = None) -> FleetConfig:
    service = load_profile(args.engine_profile)
    if replicas is None and isinstance(args.replicas, int):
        replicas = args.replicas
    if replicas is None:  # (0 is an error below, not "unset")
        replicas = defaults.get("replicas") or DEFAULT_TRACE_REPLICAS
    _positive(replicas, "--replicas")
    block_size = workload.block_size
    if cache_blocks is None and isinstance(args.cache_blocks, int):
        cache_blocks = args.cache_blocks
    if args.kv_memory_gib is not None and cache_blocks is not None:
        raise ConfigError("give --cache-blocks or --kv-memory-gib, not both")
    if cache_blocks is None:
        if args.kv_memory_gib is not None or args.model_config is not None:
            memory = args.kv_memory_gib if args.kv_memory_gib is not None \
                else service.kv_memory_gib
            if not math.isfinite(memory) or memory <= 0:
                raise ConfigError(f"--kv-memory-gib: must be positive, got {memory}")
            model = load_model_config(args.model_config or service.model)
            cache_blocks = model.blocks_for_memory(memory * GIB, block_size)
        elif defaults.get("cache_blocks"):
            cache_blocks = defaults["cache_blocks"]
        else:
            model = load_model_config(service.model)
            cache_blocks = model.blocks_for_memory(service.kv_memory_gib * GIB, block_size)
    _positive(cache_blocks, "--cache-blocks")
    kwargs = {}
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = _positive(args.max_num_batched_tokens,
                                                     "--max-num-batched-tokens")
    if args.max_num_seqs is not None:
        kwargs["max_num_seqs"] = _positive(args.max_num_seqs, "--max-num-seqs")
    return FleetConfig(replicas, cache_blocks, block_size, service,
                       scheduling_policy=args.scheduling_policy, **kwargs)


def describe(doc: str) -> str:
    """A module docstring's first two paragraphs as plain help text."""
    import textwrap
    text = " ".join(doc.split("\n\n")[:2]).replace("``", "")
    return textwrap.fill(" ".join(text.split()), width=78)


def workloads_epilog() -> str:
    import textwrap
    lines = ["workloads and their parameters (NAME:key=value,...):"]
    for name, workload in WORKLOADS.items():
        params = ", ".join(f"{k}={v}" for k, v in workload_parameters(name).items())
        lines.append(f"  {name}: {workload.description}")
        lines.extend(textwrap.wrap(params, width=78, initial_indent="      ",
                                   subsequent_indent="      "))
    return "\n".join(lines)


# -- the subcommand ------------------------------------------------------------------------------
def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay a workload or trace through replicas under routing policies",
        description=describe(__doc__),
        epilog=workloads_epilog() + "\n\n" + metrics_epilog(
            [c for c in POLICY_COLUMNS if c.name not in ("replicas", "cache blocks")]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser)
    parser.add_argument("--replicas", type=int, metavar="N",
                        help="replicas (default: the workload's; traces 8)")
    parser.add_argument("--policy", action="append", metavar="NAME[:k=v,...]",
                        help="a routing policy, repeatable; 'all' is every registered policy "
                             "(default all)")
    parser.add_argument("--jobs", type=int, default=1, metavar="N",
                        help="run policies in N worker processes (default 1)")
    add_json_argument(parser, "the report")
    add_table_arguments(parser, POLICY_COLUMNS, SIMULATE_DEFAULT)
    parser.add_argument("--plot", metavar="DIR", help="write PNG plots to DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--stream", action="store_true",
                        help="stream the trace: memory bounded by live requests, not trace "
                             "length (open loop; summary metrics only, no plots)")
    parser.set_defaults(handler=run)


def _progress(enabled: bool, console) -> tuple[Any, Callable[[str, int, int], None] | None]:
    if not enabled:
        return None, None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    progress = Progress(TextColumn("{task.description:<24}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"), TimeElapsedColumn(),
                        console=console, transient=True)
    tasks: dict[str, Any] = {}

    def update(spec: str, done: int, total: int) -> None:
        task = tasks.get(spec)
        if task is None:
            task = tasks[spec] = progress.add_task(spec, total=total)
        progress.update(task, completed=done)

    return progress, update


def check_output_paths(json_path: str | None, plot_dir: str | None) -> None:
    """Refuse unwritable destinations before any work, so a failure writes nothing."""
    check_json_destination(json_path)
    if plot_dir:
        for ancestor in (Path(plot_dir).resolve(), *Path(plot_dir).resolve().parents):
            if ancestor.exists():
                if not ancestor.is_dir():
                    raise ConfigError(f"--plot: {ancestor} is not a directory")
                break


def write_outputs(outputs: list[tuple[str, str | bytes]]) -> None:
    """Write rendered files; a ``.png`` goes into the ``--plot`` directory, created if needed
    (the JSON file's directory was checked to exist before the run)."""
    for path, data in outputs:
        try:
            write_atomic(path, data, make_parents=path.endswith(".png"))
        except OSError as exc:
            raise ConfigError(f"cannot write {path}: {exc.strerror or exc}") from None


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    specs = expand_specs(args.policy or ["all"])
    choose_columns(args.columns, POLICY_COLUMNS, SIMULATE_DEFAULT)  # a typo fails first
    check_output_paths(args.json, args.plot)
    if args.stream:
        return run_stream(args, specs)
    workload, defaults = load_workload(args)
    fleet = resolve_fleet(args, workload, defaults)
    # Check every policy spec before the first (possibly long) run.
    from prefixroute.core.routing.registry import create_policy
    from prefixroute.core.simulator.simulation import split_view
    for spec in specs:
        name, _ = split_view(spec, args.view)
        create_policy(name, seed=args.seed or 0, num_replicas=fleet.replicas,
                      block_size=fleet.block_size)

    if args.jobs < 1:
        raise ConfigError(f"--jobs: must be at least 1, got {args.jobs}")
    err = Console(stderr=True, highlight=False)
    show_progress = not args.no_progress and sys.stderr.isatty()
    progress, update = _progress(show_progress, err)
    if progress is not None:
        progress.start()
    try:
        runs = run_policies(workload, fleet, specs, view=args.view, seed=args.seed or 0,
                            jobs=args.jobs, progress=update)
    finally:
        if progress is not None:
            progress.stop()
    result = report(workload, fleet, runs, seed=args.seed or 0)
    if defaults.get("recording") is not None:
        from prefixroute.edges.cli.live_compare import add_live
        add_live(result, defaults["recording"], len(workload.requests), args.time_scale)

    # Render everything first, then write: a failure leaves nothing half-written.
    outputs: list[tuple[str, str | bytes]] = []
    if args.json and args.json != "-":
        outputs.append((args.json, json.dumps(result, indent=2) + "\n"))
    if args.plot:
        outputs.extend((str(Path(args.plot) / name), data)
                       for name, data in render_plots(workload, runs).items())
    write_outputs(outputs)
    if args.json == "-":
        print_json(result)
    else:
        print_table(result, stdout_console(), args.table_format, args.columns)
        if "live" in result and args.table_format == "table":
            from prefixroute.edges.cli.live_compare import print_live
            print_live(result, stdout_console())
        for path, _ in outputs:
            print(f"wrote {path}")
    return 0


# Set in the parent before worker processes fork, so each inherits the prepared workload.
_SHARED: dict[str, Any] = {}


def _run_shared(spec: str) -> PolicyRun:
    return simulate_policy(_SHARED["workload"], _SHARED["fleet"], spec, view=_SHARED["view"],
                           seed=_SHARED["seed"])


def run_policies(workload: PreparedWorkload, fleet: FleetConfig, specs: list[str], *,
                 view: str = DEFAULT_VIEW, seed: int = 0, jobs: int = 1,
                 progress: Callable[[str, int, int], None] | None = None
                 ) -> dict[str, PolicyRun]:
    """Every policy over the same workload, in order; with ``jobs`` > 1 in forked worker
    processes (each inherits the prepared workload, so nothing is re-read or re-hashed)."""
    if jobs <= 1 or len(specs) <= 1:
        runs = {}
        for spec in specs:
            callback = (lambda done, total, _s=spec: progress(_s, done, total)) \
                if progress else None
            runs[spec] = simulate_policy(workload, fleet, spec, view=view, seed=seed,
                                         progress=callback)
        return runs
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    _SHARED.update(workload=workload, fleet=fleet, view=view, seed=seed)
    total = len(workload.requests)
    context = multiprocessing.get_context("fork")
    with ProcessPoolExecutor(max_workers=min(jobs, len(specs)), mp_context=context) as pool:
        futures = {spec: pool.submit(_run_shared, spec) for spec in specs}
        runs = {}
        for spec in specs:  # collect in the given order
            runs[spec] = futures[spec].result()
            if progress:
                progress(spec, total, total)
    return runs


_pct, _secs = pct, secs  # the names sweep and older callers import


def print_table(result: dict, console, fmt: str = "table", columns: str | None = None) -> None:
    """The workload and fleet lines, then one row per policy (``--format``, ``--columns``)."""
    rows = list(result["policies"].values())
    chosen = choose_columns(columns, POLICY_COLUMNS, SIMULATE_DEFAULT,
                            present=set(rows[0]) if rows else None)
    if fmt == "csv":
        print_rows(rows, chosen, fmt)
        return
    w = result["workload"]
    f = result["fleet"]
    name = w.get("name") or w.get("trace", "")
    # A closed loop's arrivals depend on the run: no fixed duration to state.
    span = "closed loop (each turn sent after the previous reply)" if w.get("closed_loop") \
        else f"{w['duration_s']:.1f} s"
    say = console.print if fmt == "table" else print
    say(f"workload {name}: {w['requests']:,} requests, {w['input_tokens']:,} prompt "
        f"tokens, {span}; ideal token hit rate {_pct(result['ideal_token_hit_rate'])} (one "
        f"infinite cache)")
    say(f"fleet: {f['replicas']} replicas x {f['cache_blocks']:,} blocks of "
        f"{f['block_size']} tokens ({f['cache_tokens']:,} tokens), engine profile "
        f"{f['engine_profile']}")
    if fmt == "markdown":
        print()
    print_rows(rows, chosen, fmt, console)
    if fmt == "table":
        console.print("columns: see --help; more with --columns all", style="dim")


# -- plots ----------------------------------------------------------------------------------------
def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    import matplotlib.pyplot as plt
    plt.close(fig)
    return buffer.getvalue()


TIMELINE_BINS = 300  # points per replica line: a 12,000-request run stays readable


def binned_load(times: list[float], rows: list[list[int]], bins: int = TIMELINE_BINS):
    """Mean requests in flight per replica over ``bins`` equal time bins.

    The timeline has a point per event (tens of thousands in a long run); drawn as is, eight
    replicas' lines fill the panel with ink. The mean over a bin keeps the level and the
    bursts a reader compares, where every n-th point would keep whichever spike it hit.
    Returns (bin centres, array of shape bins x replicas); empty bins repeat the last value.
    """
    import numpy as np

    t = np.asarray(times, dtype=float)
    values = np.asarray(rows, dtype=float)
    if len(t) < 2 or t[-1] <= t[0]:
        return t, values
    edges = np.linspace(t[0], t[-1], min(bins, len(t)) + 1)
    index = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, len(edges) - 2)
    sums = np.zeros((len(edges) - 1, values.shape[1]))
    np.add.at(sums, index, values)
    counts = np.bincount(index, minlength=len(edges) - 1)
    out = np.empty_like(sums)
    last = values[0]
    for b in range(len(sums)):
        if counts[b]:
            last = sums[b] / counts[b]
        out[b] = last
    return (edges[:-1] + edges[1:]) / 2, out


def render_plots(workload: PreparedWorkload, runs: dict[str, PolicyRun]) -> dict[str, bytes]:
    """PNG bytes by file name: TTFT CDF per policy, hit rates, load per replica over time."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = {}
    names = list(runs)
    # Up to 20 distinct colours, and a second line style beyond 10, so that 15 policies stay
    # distinguishable (the default cycle repeats after 10).
    colours = plt.get_cmap("tab20" if len(names) > 10 else "tab10")
    fig, ax = plt.subplots(figsize=(8, 5))
    for index, (spec, run) in enumerate(runs.items()):
        values = sorted(v for v in run.ttft_s if v > 0)
        if not values:
            continue
        n = len(values)
        step = max(1, n // 2000)  # a CDF needs no more points than pixels
        xs = values[::step] + [values[-1]]
        ys = [(i + 1) / n for i in range(0, n, step)] + [1.0]
        ax.plot(xs, ys, label=spec, linewidth=1.2, color=colours(index % colours.N),
                linestyle="-" if index < 10 else "--")
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT CDF per policy ({len(workload.requests):,} requests)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right", ncol=2 if len(names) > 8 else 1)
    out["ttft_cdf.png"] = _png(fig)

    fig, ax = plt.subplots(figsize=(max(6, 0.6 * len(names) + 2), 4.5))
    token = [runs[n].summary["token_hit_rate"] for n in names]
    request = [runs[n].summary["request_hit_rate"] for n in names]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], token, width=0.4, label="token hit rate")
    ax.bar([x + 0.2 for x in xs], request, width=0.4, label="request hit rate", alpha=0.6)
    ax.axhline(workload.ideal_token_hit_rate, color="black", linestyle="--", linewidth=1,
               label="ideal token hit rate")
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=45, ha="right", fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("hit rate")
    ax.set_title("Hit rates per policy", pad=28)
    # Above the bars, never over them.
    ax.legend(fontsize=8, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    out["hit_rates.png"] = _png(fig)

    cols = min(3, len(names)) or 1
    rows = -(-len(names) // cols) or 1
    # Shared axes: the panels compare policies on one workload, so one scale for all.
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 2.6 * rows + 0.6), squeeze=False,
                             sharex=True, sharey=True)
    replicas = 0
    for index, spec in enumerate(names):
        ax = axes[index // cols][index % cols]
        run = runs[spec]
        if run.timeline_t:
            t, load = binned_load(run.timeline_t, run.timeline_in_flight)
            replicas = max(replicas, load.shape[1])
            for replica in range(load.shape[1]):
                ax.plot(t, load[:, replica], linewidth=0.8, color=f"C{replica % 10}",
                        label=f"replica {replica}")
        ax.set_title(spec, fontsize=9)
        ax.grid(True, alpha=0.3)
        if index % cols == 0:
            ax.set_ylabel("requests in flight", fontsize=8)
    for index in range(len(names), rows * cols):
        axes[index // cols][index % cols].axis("off")
    for col in range(cols):  # the lowest panel of each column carries the time axis
        last = max(i for i in range(len(names)) if i % cols == col)
        ax = axes[last // cols][col]
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlabel("time (s)", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=min(replicas, 8), fontsize=8,
                   frameon=False, bbox_to_anchor=(0.5, 0.0))
    fig.suptitle(f"Requests in flight per replica (mean over {TIMELINE_BINS} time bins)")
    fig.tight_layout(rect=(0, 0.06 if rows < 3 else 0.03, 1, 1))
    out["load_over_time.png"] = _png(fig)
    return out


def run_stream(args: argparse.Namespace, specs: list[str]) -> int:
    """``--stream``: each policy replays the trace as it is read
    (:func:`~prefixroute.core.simulator.streaming.simulate_stream`)."""
    import itertools
    from array import array

    from rich.console import Console

    from prefixroute.core.simulator.streaming import simulate_stream
    for flag, value in (("--closed-loop", args.closed_loop), ("--plot", args.plot),
                        ("--jobs", args.jobs != 1)):
        if value:
            raise ConfigError(f"{flag} does not apply to --stream")
    err = Console(stderr=True, highlight=False)
    show = not args.no_progress and sys.stderr.isatty()
    policies: dict[str, Any] = {}
    fleet = None
    info: dict[str, Any] = {}
    for spec in specs:
        requests, info, defaults, _ = open_requests(args)
        requests = iter(requests)
        first = next(requests, None)
        if first is None:
            raise ConfigError("the workload has no requests")
        stream = itertools.chain([first], requests)
        if args.requests:
            stream = itertools.islice(stream, args.requests)
        if fleet is None:
            fleet = resolve_fleet(args, PreparedWorkload([], first.block_size, array("q")),
                                  defaults)
        progress = None
        if show:
            from rich.progress import Progress, TextColumn, TimeElapsedColumn
            progress = Progress(TextColumn("{task.description:<24}"),
                                TextColumn("{task.completed:,} requests"), TimeElapsedColumn(),
                                console=err, transient=True)
            task = progress.add_task(spec, total=args.requests)
            progress.start()
        try:
            policies[spec] = simulate_stream(
                stream, fleet, spec, view=args.view, seed=args.seed or 0,
                time_scale=args.time_scale,
                progress=(lambda n: progress.update(task, completed=n)) if progress else None)
        finally:
            if progress is not None:
                progress.stop()
    result = {"workload": {**info, "streamed": True}, "fleet": fleet.describe(),
              "seed": args.seed or 0, "policies": policies}
    if defaults.get("recording") is not None and policies:  # the live fleet beside it
        from prefixroute.edges.cli.live_compare import add_live
        add_live(result, defaults["recording"], next(iter(policies.values()))["requests"],
                 args.time_scale)
    if args.json and args.json != "-":
        write_outputs([(args.json, json.dumps(result, indent=2) + "\n")])
    if args.json == "-":
        print_json(result)
    else:
        for spec, summary in policies.items():
            print(f"{spec}: {summary['requests']:,} requests, token hit rate "
                  f"{summary['token_hit_rate']:.1%}, TTFT p50 {summary['ttft_p50_s']} s, "
                  f"p99 {summary['ttft_p99_s']} s")
        if "live" in result:
            from prefixroute.edges.cli.live_compare import print_live
            print_live(result, stdout_console())
        if args.json:
            print(f"wrote {args.json}")
    return 0
