"""The simulator at scale: a generated Mooncake-format trace of 10k, 100k and 1M requests,
replayed streaming at 32 replicas under the default policy, with time and peak memory.

Each size runs two child processes, timed and measured on their own (``os.wait4``):

1. ``prefixroute generate mooncake-sessions:rate=R --requests N --seed 7 -o FILE``;
2. ``prefixroute simulate --trace FILE --trace-format mooncake --stream --policy prefixroute
   --replicas 32 --json OUT``.

Target: 1M requests at 32 replicas in at most 10 minutes and 2 GB peak RSS. Results go to
``benchmarks/results/sim_scale.md`` (and ``.json``).

Usage: ``python benchmarks/sim_scale.py [--sizes 10000,100000,1000000] [--rate 40]
[--workdir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPLICAS = 32
TIME_LIMIT_S = 600.0
MEMORY_LIMIT_MB = 2048.0


def measured(argv: list[str]) -> tuple[float, float, float]:
    """Run ``argv``; its wall seconds, CPU seconds (user + system) and peak RSS in MB (its
    own, not its siblings'). On a shared machine the CPU seconds are the steadier figure:
    wall time also counts waiting for a core."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    return (time.perf_counter() - start, usage.ru_utime + usage.ru_stime,
            usage.ru_maxrss / 1024)  # Linux: kilobytes


def write_results(rows: list[dict], rate: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_scale.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["# Simulator at scale", "",
             f"`python benchmarks/sim_scale.py` (rate {rate:g} req/s, {REPLICAS} replicas, "
             "default policy `prefixroute`, streamed). Target for 1M requests: "
             f"<= {TIME_LIMIT_S / 60:.0f} min and <= {MEMORY_LIMIT_MB / 1024:.0f} GB peak RSS.",
             "", "| requests | trace MB | generate s | generate peak MB | simulate s | "
             "simulate CPU s | load avg (start, end) | simulate peak MB | token hit rate | "
             "TTFT p50 s | TTFT p99 s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        load = " / ".join(str(x) for x in r.get("load_average_1min", []))
        lines.append(f"| {r['requests']:,} | {r['trace_mb']} | {r['generate_s']} | "
                     f"{r['generate_peak_mb']} | {r['simulate_s']} | "
                     f"{r.get('simulate_cpu_s', '')} | {load} | {r['simulate_peak_mb']} | "
                     f"{r['token_hit_rate']:.1%} | {r['ttft_p50_s']} | {r['ttft_p99_s']} |")
    (RESULTS / "sim_scale.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="mean requests/s of the generated traffic (default 40)")
    parser.add_argument("--workdir", default=None, help="where traces go (default: a temp dir)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sim-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    cli = [sys.executable, "-m", "prefixroute"]
    rows = []
    for n in sizes:
        trace, out = workdir / f"trace-{n}.jsonl", workdir / f"result-{n}.json"
        gen_s, _, gen_mb = measured(cli + ["generate", f"mooncake-sessions:rate={args.rate}",
                                        "--requests", str(n), "--seed", "7", "-o", str(trace),
                                        "--no-progress"])
        load_before = os.getloadavg()[0]
        sim_s, sim_cpu, sim_mb = measured(cli + [
            "simulate", "--trace", str(trace), "--trace-format", "mooncake", "--stream",
            "--policy", "prefixroute", "--replicas", str(REPLICAS), "--json", str(out),
            "--no-progress"])
        summary = json.loads(out.read_text())["policies"]["prefixroute"]
        row = {"requests": n, "trace_mb": round(trace.stat().st_size / 2**20, 1),
               "generate_s": round(gen_s, 1), "generate_peak_mb": round(gen_mb),
               "simulate_s": round(sim_s, 1), "simulate_cpu_s": round(sim_cpu, 1),
               "simulate_peak_mb": round(sim_mb),
               "load_average_1min": [round(load_before, 1), round(os.getloadavg()[0], 1)],
               "token_hit_rate": summary["token_hit_rate"],
               "ttft_p50_s": summary["ttft_p50_s"], "ttft_p99_s": summary["ttft_p99_s"],
               "completed": summary["completed"]}
        rows.append(row)
        print(json.dumps(row), flush=True)
        trace.unlink()
        write_results(rows, args.rate)  # after every size: a long run keeps what it measured
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
