"""The Mooncake conversation trace (12,031 requests) through 8 replicas under every policy.

Target: every registered policy completes within 60 s in total on this machine,
peak memory under 2 GB. The trace is read in place from ``../shared/data/mooncake/``; block
keys are computed once and shared by every policy; each policy gets fresh replicas
(llama-3-8b-h100 engine profile: 50 GiB of KV = 800 blocks of 512 tokens per replica unless
``--cache-blocks`` says otherwise).

Policies run in as many worker processes as the machine has cores (``--jobs``, as
``prefixroute simulate --jobs``); ``--jobs 1`` runs them one after another in this process.

Usage: ``python benchmarks/mooncake_all_policies.py [--trace FILE] [--replicas 8]
[--cache-blocks N] [--policy NAME ...] [--jobs N]``
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

from prefixroute.core.identity.model_config import MODEL_PRESETS
from prefixroute.core.replica.service_time import DEFAULT_PROFILE, PRESETS
from prefixroute.core.routing.registry import expand_specs
from prefixroute.core.simulator.simulation import FleetConfig, prepare_workload, simulate_policy
from prefixroute.edges.traces import read_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "data" / "mooncake" / \
    "conversation_trace.jsonl"
TIME_LIMIT_S = 60.0
MEMORY_LIMIT_MB = 2048.0


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kilobytes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--cache-blocks", type=int)
    parser.add_argument("--policy", action="append")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="policies in N worker processes, as `prefixroute simulate --jobs` "
                             "runs them (default: this machine's cores; 1 is sequential)")
    args = parser.parse_args()

    start = time.perf_counter()
    workload = prepare_workload(read_trace(args.trace, "mooncake"))
    read_s = time.perf_counter() - start
    service = PRESETS[DEFAULT_PROFILE]
    blocks = args.cache_blocks or MODEL_PRESETS[service.model].blocks_for_memory(
        service.kv_memory_gib * (1 << 30), workload.block_size)
    fleet = FleetConfig(args.replicas, blocks, workload.block_size, service)
    specs = expand_specs(args.policy or ["all"])
    print(f"{len(workload.requests):,} requests, ideal token hit rate "
          f"{workload.ideal_token_hit_rate:.1%}; {fleet.replicas} replicas x {blocks} blocks of "
          f"{fleet.block_size} tokens; read + keys {read_s:.2f} s")
    print(f"{'policy':<22} {'seconds':>8} {'cpu s':>7} {'token hit':>10} {'TTFT p50':>9} "
          f"{'TTFT p99':>9} {'skew':>6}")
    if args.jobs > 1:
        from prefixroute.edges.cli.simulate import run_policies
        runs = run_policies(workload, fleet, specs, jobs=args.jobs)
        for spec, run in runs.items():
            summary = run.summary
            print(f"{spec:<22} {'-':>8} {'-':>7} {summary['token_hit_rate']:10.1%} "
                  f"{summary['ttft_p50_s']:9.3f} {summary['ttft_p99_s']:9.3f} "
                  f"{summary['max_assignment_skew']:6d}")
    else:
        for spec in specs:
            t, cpu = time.perf_counter(), time.process_time()
            summary = simulate_policy(workload, fleet, spec).summary
            print(f"{spec:<22} {time.perf_counter() - t:8.2f} {time.process_time() - cpu:7.2f} "
                  f"{summary['token_hit_rate']:10.1%} "
                  f"{summary['ttft_p50_s']:9.3f} {summary['ttft_p99_s']:9.3f} "
                  f"{summary['max_assignment_skew']:6d}", flush=True)
    total = time.perf_counter() - start
    peak = peak_rss_mb()
    workers = ""
    if args.jobs > 1:
        children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
        workers = f", largest worker {children:.0f} MB"
        peak = max(peak, children)
    print(f"total {total:.1f} s for {len(specs)} policies with {args.jobs} process(es) (limit "
          f"{TIME_LIMIT_S:.0f} s); peak memory {peak:.0f} MB{workers} (limit "
          f"{MEMORY_LIMIT_MB:.0f} MB)")
    return 0 if total <= TIME_LIMIT_S and peak <= MEMORY_LIMIT_MB else 1


if __name__ == "__main__":
    raise SystemExit(main())
