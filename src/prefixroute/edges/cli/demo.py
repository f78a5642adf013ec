"""``prefixroute demo``: emulator replicas, the gateway, and the design scenario over HTTP.

One command starts ``--replicas`` emulator replicas and a gateway in front of them (child
processes on free 127.0.0.1 ports, stopped by their ids at the end, on errors and on Ctrl-C),
replays the design scenario once per ``--policy`` over real HTTP through the gateway, and
prints a table per policy: token hit rate, TTFT p50/p99, load per replica.

The workload is the simulator's own generator (``design-scenario``): 200 tenants with
10,000-token prefixes, one hot tenant and Zipf popularity, the timestamp moved out of the
prefix (the fix), each tenant with its own API key and trust group at the gateway. Prompts go
as token ids, so the gateway hashes exactly what the engine hashes without a tokenizer.
Replicas run the emulator's time model (``llama-3-8b-h100``) ``--time-scale`` times real time;
arrivals are compressed alike, and the times shown are engine seconds (measured / scale).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import tempfile
from typing import Any

from prefixroute.core.errors import ConfigError
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          non_negative_float, positive_int, stdout_console)

# The comparison the README shows: ours, the load-only baseline, and the most used peer.
DEFAULT_POLICIES = ("prefixroute", "round_robin", "sglang_cache_aware")
# 200 requests x 3 policies take about 40 s here (2 cores) at the defaults below.
DEFAULT_REQUESTS = 200
DEFAULT_REPLICAS = 4  # the design scenario has 8; 4 processes fit a 2-core laptop
DEFAULT_TIME_SCALE = 0.5
# Engine-time arrivals per replica per second. At 2.9 the simulator puts round robin's busiest
# replica at ~85% utilisation over the first 200 requests (cache misses cost 0.5 s of prefill
# each): loaded enough that where a request goes shows in TTFT, not overloaded.
RATE_PER_REPLICA = 2.9
# Output lengths: the scenario's 50-400 tokens would send ~45k stream events per policy
# through three processes on two cores; 8-32 keeps the run about TTFT (prefill and queueing).
OUTPUT_TOKENS = (8, 32)
ENGINE_PROFILE = "llama-3-8b-h100"
PREFILL_S_PER_TOKEN = 4.0e-5  # that profile's prefill cost (core/replica/service_time.py)
MAX_MODEL_LEN = 16_384  # a 10,000-token prefix plus up to 600 user tokens
SLACK_S = 60.0  # past the last arrival, how long stragglers may take before they count as failed
MAX_REPLICAS = 16  # one process each
MAX_GATEWAYS = 8
MAX_REQUESTS = 50_000  # the scenario's whole day


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo", help="replicas + gateway + the design scenario over HTTP, one table per policy",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=positive_int, default=DEFAULT_REQUESTS, metavar="N",
                   help=f"requests per policy (default {DEFAULT_REQUESTS})")
    p.add_argument("--replicas", type=positive_int, default=DEFAULT_REPLICAS, metavar="N",
                   help=f"emulator replicas (default {DEFAULT_REPLICAS})")
    p.add_argument("--policy", action="append", metavar="NAME[:k=v,...]",
                   help="a routing policy, repeatable (default: "
                        f"{', '.join(DEFAULT_POLICIES)})")
    p.add_argument("--time-scale", type=non_negative_float, default=DEFAULT_TIME_SCALE,
                   metavar="F", help="replicas run F x real time, arrivals alike "
                                     f"(default {DEFAULT_TIME_SCALE})")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--gateways", type=positive_int, default=1, metavar="N",
                   help="gateway instances; requests take turns over them (default 1)")
    p.add_argument("--shared-state", metavar="redis://HOST:PORT", default=None,
                   help="the gateways share bookings and rate limits through this Redis "
                        "(needs prefixroute[redis]); without it each sees only its share")
    p.add_argument("--record", metavar="DIR", default=None,
                   help="record each policy's traffic at the gateway into DIR/POLICY/ "
                        "(docs/trace-format.md, 'Recordings'), to replay with "
                        "prefixroute simulate --trace DIR/POLICY")
    add_json_argument(p, "the results")
    p.set_defaults(handler=run)


def check_policies(specs: list[str], replicas: int) -> None:
    from prefixroute.core.routing.registry import create_policy

    for spec in specs:
        create_policy(spec, seed=0, num_replicas=replicas, block_size=16)


def run(args: argparse.Namespace) -> int:
    check_json_destination(args.json)
    if args.record is not None:
        try:
            os.makedirs(args.record, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--record: cannot create {args.record}: "
                              f"{exc.strerror or exc}") from None
    from rich.console import Console

    from prefixroute.edges.loadtest.workload import design_requests

    specs = list(dict.fromkeys(args.policy or DEFAULT_POLICIES))
    check_policies(specs, args.replicas)
    if args.time_scale <= 0:
        raise ConfigError("--time-scale must be above 0 (the demo is about time to first token)")
    if args.replicas > MAX_REPLICAS:
        raise ConfigError(f"--replicas: at most {MAX_REPLICAS} (one process each)")
    if args.gateways > MAX_GATEWAYS:
        raise ConfigError(f"--gateways: at most {MAX_GATEWAYS} (one process each)")
    if args.shared_state is not None and not args.shared_state.startswith(
            ("redis://", "rediss://", "unix://")):
        raise ConfigError(f"--shared-state: {args.shared_state!r} is not a Redis URL "
                          "(redis://HOST:PORT[/DB])")
    if args.requests > MAX_REQUESTS:
        raise ConfigError(f"--requests: at most {MAX_REQUESTS} (the scenario's whole day)")
    # SIGTERM ends the demo like Ctrl-C: the with-blocks below stop every child process.
    signal.signal(signal.SIGTERM, _terminate)
    requests = design_requests(args.requests, replicas=args.replicas, model="emulated",
                               rate_per_replica=RATE_PER_REPLICA, output_tokens=OUTPUT_TOKENS,
                               seed=args.seed)
    err = Console(stderr=True, highlight=False)
    with tempfile.TemporaryDirectory(prefix="prefixroute-demo-") as workdir:
        results = _run_fleet(workdir, args, specs, requests, err)
    result = {"scenario": {"workload": "design-scenario", "requests": len(requests),
                           "tenants": len({r.tenant for r in requests}),
                           "prompt_tokens": sum(r.prompt_tokens for r in requests),
                           "replicas": args.replicas, "gateways": args.gateways,
                           "shared_state": args.shared_state is not None,
                           "engine_profile": ENGINE_PROFILE,
                           "time_scale": args.time_scale, "seed": args.seed,
                           "times": "engine seconds (wall / time_scale)"},
              "policies": results}
    if args.json:
        emit_json(result, args.json)
    else:
        print_table(result, stdout_console())
    return 0


def _terminate(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _run_fleet(workdir: str, args: argparse.Namespace, specs: list[str], requests: list,
               err) -> dict[str, Any]:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from prefixroute.edges.loadtest.fleet import LocalFleet
    from prefixroute.edges.loadtest.replay import replay, summarize

    replica_args = ["--time-scale", f"{args.time_scale:g}", "--profile", ENGINE_PROFILE,
                    "--max-model-len", str(MAX_MODEL_LEN)]
    tenants = sorted({r.tenant for r in requests})
    duration = (requests[-1].arrival_s - requests[0].arrival_s) * args.time_scale
    results: dict[str, Any] = {}
    progress = Progress(TextColumn("{task.description:<28}"), BarColumn(),
                        TextColumn("{task.completed}/{task.total}"),
                        TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                        console=err, transient=False, disable=not err.is_terminal)
    with LocalFleet(workdir, args.replicas, replica_args, tenants=tenants) as fleet, progress:
        start = progress.add_task(f"starting {args.replicas} replicas", total=args.replicas,
                                  status="")
        for replica in fleet.replicas:
            replica.start()
            progress.advance(start)
        recording_dirs = _slugs(specs)
        for spec in specs:
            task = progress.add_task(spec, total=len(requests), status="starting gateway")
            fleet.reset_replicas()
            before = fleet.counters()
            extra: dict[str, Any] = {}
            if args.record is not None:
                recording = os.path.abspath(os.path.join(args.record, recording_dirs[spec]))
                extra["record"] = {"path": recording}
            if args.shared_state is not None:
                # A namespace of its own per run: the next policy must not start from this
                # one's bookings.
                extra["shared_state"] = {"redis": args.shared_state,
                                         "namespace": f"prefixroute-demo-{os.urandom(6).hex()}"}
            fleet.start_gateway(spec, backend_fields={
                "prefill_s_per_token": PREFILL_S_PER_TOKEN * args.time_scale},
                instances=args.gateways, **extra)
            keys = fleet.api_keys
            seen = {"ok": 0, "failed": 0, "prompt": 0, "cached": 0}

            def on_outcome(outcome, task=task, seen=seen) -> None:
                seen["ok" if outcome.ok else "failed"] += 1
                seen["prompt"] += outcome.prompt_tokens or 0
                seen["cached"] += outcome.cached_tokens or 0
                rate = seen["cached"] / seen["prompt"] if seen["prompt"] else 0.0
                progress.update(task, advance=1, status=f"hit {rate:5.1%}  failed "
                                                        f"{seen['failed']}")

            headers = {tenant: {"content-type": "application/json",
                                "authorization": f"Bearer {key}"}
                       for tenant, key in keys.items()}
            outcomes = asyncio.run(replay(
                [url + "/v1/completions" for url in fleet.gateway_urls], requests,
                headers_for=lambda r: headers[r.tenant], time_scale=args.time_scale,
                deadline_s=duration + SLACK_S, on_outcome=on_outcome))
            after = fleet.counters()
            fleet.stop_gateway()
            summary = summarize(outcomes, time_scale=args.time_scale)
            summary["replica_load"] = [
                {"replica": f"r{i}",
                 "requests": int(a["requests"] - b["requests"]),
                 "prompt_tokens": int(a["prompt_tokens"] - b["prompt_tokens"]),
                 "computed_tokens": int((a["prompt_tokens"] - b["prompt_tokens"])
                                        - (a["cached_tokens"] - b["cached_tokens"]))}
                for i, (b, a) in enumerate(zip(before, after))]
            if args.record is not None:
                summary["recording"] = recording
            results[spec] = summary
            progress.update(task, status=f"hit {summary['token_hit_rate'] or 0:5.1%}  "
                                         f"failed {summary['requests_failed']}")
    return results


def _slugs(specs: list[str]) -> dict[str, str]:
    """Each policy spec's directory name (``prefixroute:alpha=2`` -> ``prefixroute_alpha_2``).

    Two specs that differ only in punctuation (``a:b=1`` and ``a_b_1``) would share a name and
    one recording would overwrite the other, so a repeated name gets ``-2``, ``-3``, ...
    """
    names: dict[str, str] = {}
    taken: set[str] = set()
    for spec in specs:
        base = re.sub(r"[^A-Za-z0-9_.-]+", "_", spec).strip("_") or "policy"
        name, n = base, 1
        while name in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name)
        names[spec] = name
    return names


def print_table(result: dict, console) -> None:
    from rich.table import Table

    scenario = result["scenario"]
    console.print(f"design scenario (multi-tenant assistant): {scenario['requests']} requests from "
                  f"{scenario['tenants']} tenants, {scenario['prompt_tokens']:,} prompt tokens")
    gateways = scenario.get("gateways", 1)
    through = "the gateway" if gateways == 1 else (
        f"{gateways} gateways " + ("sharing state" if scenario.get("shared_state")
                                   else "without shared state"))
    console.print(f"through {through} to {scenario['replicas']} emulator replicas "
                  f"({scenario['engine_profile']} at time scale {scenario['time_scale']:g}); "
                  "TTFT in engine seconds")
    table = Table()
    for column, justify in (("policy", "left"), ("token hit rate", "right"),
                            ("TTFT p50", "right"), ("TTFT p99", "right"), ("ok", "right"),
                            ("failed", "right"), ("requests per replica", "right"),
                            ("prefill k-tokens per replica", "right")):
        table.add_column(column, justify=justify)
    for name, row in result["policies"].items():
        load = row["replica_load"]
        table.add_row(
            name, "-" if row["token_hit_rate"] is None else f"{row['token_hit_rate']:.1%}",
            _secs(row["ttft_p50_s"]), _secs(row["ttft_p99_s"]), str(row["requests_ok"]),
            str(row["requests_failed"]), " ".join(str(r["requests"]) for r in load),
            " ".join(f"{r['computed_tokens'] / 1000:.0f}" for r in load))
    console.print(table)
    for name, row in result["policies"].items():
        for error, count in row["errors"].items():
            console.print(f"{name}: {count} x {error}")
    scale = scenario["time_scale"]
    for name, row in result["policies"].items():
        if row.get("recording"):
            # The recording's times are wall seconds: 1 / time scale turns them into the
            # engine seconds the simulator's replicas run in.
            console.print(f"{name}: traffic recorded in {row['recording']}; replay it with "
                          f"prefixroute simulate --trace {row['recording']} --policy {name} "
                          f"--time-scale {1 / scale:g}")


def _secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"
