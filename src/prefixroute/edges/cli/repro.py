"""``prefixroute repro``: the reference figures (hashing, hit rates, economics), computed by running
the library."""

from __future__ import annotations

import argparse

from rich.table import Table

from prefixroute.core.reproduce import reproduce_all
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          stdout_console)


def register(subparsers) -> None:
    p = subparsers.add_parser("repro", help="reproduce the reference numbers (hashing, hit rates, economics) from the library",
                              description=__doc__)
    add_json_argument(p, "the figures")
    p.set_defaults(handler=run)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def run(args: argparse.Namespace) -> int:
    check_json_destination(args.json)
    result = reproduce_all()
    if args.json:
        emit_json(result, args.json)
        return 0
    console = stdout_console(highlight=True)
    conv = result["conversation"]
    table = Table(title="1. Five-turn conversation (token-level ideal vs 16-token blocks)")
    for col in ("turn", "prompt", "reused (ideal)", "fresh (ideal)", "reused (blocks)",
                "fresh (blocks)"):
        table.add_column(col, justify="right")
    for i, prompt in enumerate(conv["prompt_tokens_by_turn"]):
        table.add_row(str(i + 1), str(prompt), str(conv["reused_tokens_by_turn"][i]),
                      str(conv["fresh_tokens_by_turn"][i]),
                      str(conv["full_block_reused_by_turn"][i]),
                      str(conv["full_block_fresh_by_turn"][i]))
    table.add_row("total", str(conv["total_input_tokens"]), str(conv["total_reused_tokens"]),
                  str(conv["total_input_tokens"] - conv["total_reused_tokens"]),
                  str(conv["full_block_reused_total"]), str(conv["full_block_fresh_total"]))
    console.print(table)
    console.print(f"   reuse fraction: ideal {conv['reuse_fraction']:.4f}, "
                  f"full blocks {conv['full_block_reuse_fraction']:.4f}\n")

    up = result["universal_prefix"]
    console.print(f"[bold]2. Universal prefix[/bold]: {up['requests']} requests share a "
                  f"{up['prefix_tokens']}-token prompt over {up['replicas']} replicas: "
                  f"round robin {up['round_robin_hits']} hits, one replica "
                  f"{up['single_replica_hits']} hits; warm-up difference "
                  f"{up['warmup_saving_tokens']} prefill tokens; every request hits after "
                  f"warm-up: {up['every_request_hits_after_warmup']}\n")

    table = Table(title="3. Skewed routing trace AABACABDAACBADABCABA (3 replicas, 2 families each)")
    for col in ("policy", "reused tokens", "assignments", "final max skew", "peak skew",
                "evictions"):
        table.add_column(col, justify="right")
    for name, r in result["routing"].items():
        table.add_row(name, f"{r['reused_prefix_tokens']:,}", str(r["assignments"]),
                      str(r["max_assignment_skew"]), str(r.get("peak_assignment_skew", "")),
                      str(r["evictions"]))
    console.print(table)
    exercises = result.get("routing_exercises", {})
    if exercises:
        table = Table(title="   exercises")
        for col in ("run", "policy", "reused tokens", "final skew", "peak skew", "evictions",
                    "queued ahead", "queue penalty (tokens)"):
            table.add_column(col, justify="right")
        for run_name, runs in exercises.items():
            for policy, r in runs.items():
                table.add_row(run_name, policy, f"{r['reused_prefix_tokens']:,}",
                              str(r["max_assignment_skew"]), str(r.get("peak_assignment_skew", "")),
                              str(r["evictions"]), str(r.get("queued_ahead", "")),
                              f"{r.get('queue_penalty_tokens', '')}")
        console.print(table)
        console.print("   queue penalty: uncached prompt tokens of the requests still on the same "
                      "replica when a request arrives (arrivals evenly spaced; see "
                      "core/routing/skewed_trace.py)")

    if "fleet" in result:
        fleet = result["fleet"]
        console.print(f"\n[bold]4. Fleet hit rates[/bold] (4 replicas x 400-block LRU, 2,000 "
                      f"requests): random {_pct(fleet['random'])}, prefix-aware "
                      f"{_pct(fleet['prefix_aware'])}, timestamp at top "
                      f"{_pct(fleet['timestamp_at_top'])}")
    if "economics" in result:
        eco = result["economics"]
        console.print("\n[bold]5. Economics[/bold] break-even: " + ", ".join(
            f"{name} {_pct(value)}" for name, value in eco["break_even"].items()))
        worked = eco["worked_example"]
        console.print(f"   worked example: no caching ${worked['no_caching_usd_per_day']:,.0f}/day; "
                      + "; ".join(f"{name} {_pct(p['p_hit'])} hit ${p['usd_per_day']:,.0f}"
                                  for name, p in worked.items() if isinstance(p, dict)
                                  and "usd_per_day" in p))
    iso = result["isolation"]
    console.print("\n[bold]6. Isolation[/bold]: tenant B probe of A's unsalted prefix hits: "
                  f"{iso['cross_tenant_hit_without_salt']}; with distinct salts: "
                  f"{iso['cross_tenant_hit_with_distinct_salts']}; other model revision: "
                  f"{iso['model_revision_change_hits']}; other adapter: "
                  f"{iso['adapter_change_hits']}")
    return 0
