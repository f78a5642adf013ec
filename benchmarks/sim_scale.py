"""The simulator at scale: a generated Mooncake-format trace of 10k, 100k and 1M requests,
replayed streaming at 32 replicas under the default policy, with time and peak memory.

Each size runs child processes, timed and measured on their own (``os.wait4``):

1. ``prefixroute generate mooncake-sessions:rate=R --requests N --seed 7 -o FILE``;
2. ``prefixroute simulate --trace FILE --trace-format mooncake --stream --policy prefixroute
   --replicas 32 --json OUT``, once per build: ``source`` (the installed package; an editable
   install runs the Python source) and ``compiled`` (the wheel ``pip wheel .`` builds, with
   the hot path compiled by mypyc, set up in the work directory). The two must give the same
   results; the compiled build's speed-up over the source is measured side by side.

Target: 1M requests at 32 replicas in at most 10 minutes and 2 GB peak RSS. Results go to
``benchmarks/results/sim_scale_run.md`` (and ``sim_scale.json``); ``sim_scale.md`` keeps the
history of runs.

Usage: ``python benchmarks/sim_scale.py [--sizes 10000,100000,1000000] [--rate 40]
[--builds source,compiled] [--workdir DIR]``
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
BUILDS = ("source", "compiled")
REPLICAS = 32
TARGET_REQUESTS = 1_000_000
TIME_LIMIT_S = 600.0
MEMORY_LIMIT_MB = 2048.0


def compiled_site(workdir: Path) -> Path:
    """The compiled wheel of this checkout, unpacked under ``workdir`` (for ``PYTHONPATH``)."""
    dist, site = workdir / "dist", workdir / "site"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q",
                    "-w", str(dist), str(ROOT)], check=True)
    (wheel,) = dist.glob("prefixroute-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    return site


def measured(argv: list[str], env: dict | None = None) -> tuple[float, float, float]:
    """Run ``argv``; its wall seconds, CPU seconds (user + system) and peak RSS in MB (its
    own, not its siblings'). On a shared machine the CPU seconds are the steadier figure:
    wall time also counts waiting for a core."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(argv)} failed with exit code {proc.returncode}")
    return (time.perf_counter() - start, usage.ru_utime + usage.ru_stime,
            usage.ru_maxrss / 1024)  # Linux: kilobytes


def write_results(rows: list[dict], rate: float) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "sim_scale.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["# Simulator at scale: the latest run", "",
             f"`python benchmarks/sim_scale.py` (rate {rate:g} req/s, {REPLICAS} replicas, "
             "default policy `prefixroute`, streamed). Target for 1M requests: "
             f"<= {TIME_LIMIT_S / 60:.0f} min and <= {MEMORY_LIMIT_MB / 1024:.0f} GB peak RSS.",
             "", "| requests | build | trace MB | generate s | generate peak MB | simulate s | "
             "simulate CPU s | load avg (start, end) | simulate peak MB | token hit rate | "
             "TTFT p50 s | TTFT p99 s |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        load = " / ".join(str(x) for x in r.get("load_average_1min", []))
        lines.append(f"| {r['requests']:,} | {r['build']} | {r['trace_mb']} | {r['generate_s']} | "
                     f"{r['generate_peak_mb']} | {r['simulate_s']} | "
                     f"{r.get('simulate_cpu_s', '')} | {load} | {r['simulate_peak_mb']} | "
                     f"{r['token_hit_rate']:.1%} | {r['ttft_p50_s']} | {r['ttft_p99_s']} |")
    for r in rows:
        if r["requests"] == TARGET_REQUESTS:
            met = r["simulate_s"] <= TIME_LIMIT_S and r["simulate_peak_mb"] <= MEMORY_LIMIT_MB
            lines.append(f"\n{r['requests']:,} requests, {r['build']} build: simulated in "
                         f"{r['simulate_s'] / 60:.1f} min of wall time at "
                         f"{r['simulate_peak_mb']} MB peak RSS: the target "
                         f"(<= {TIME_LIMIT_S / 60:.0f} min, <= {MEMORY_LIMIT_MB / 1024:.0f} GB) "
                         f"is {'met' if met else 'missed'}.")
    for n in sorted({r["requests"] for r in rows}):
        cpu = {r["build"]: r["simulate_cpu_s"] for r in rows if r["requests"] == n}
        if len(cpu) == 2:
            lines.append(f"\n{n:,} requests: the compiled build is "
                         f"{cpu['source'] / cpu['compiled']:.2f}x as fast as the source "
                         "(CPU seconds), side by side.")
    (RESULTS / "sim_scale_run.md").write_text("\n".join(lines) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--rate", type=float, default=40.0,
                        help="mean requests/s of the generated traffic (default 40)")
    parser.add_argument("--builds", default=",".join(BUILDS),
                        help="which builds simulate: source, compiled or both (default)")
    parser.add_argument("--workdir", default=None, help="where traces go (default: a temp dir)")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    builds = args.builds.split(",")
    if not builds or set(builds) - set(BUILDS):
        parser.error(f"--builds takes {' and/or '.join(BUILDS)}, got {args.builds!r}")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="sim-scale-"))
    workdir.mkdir(parents=True, exist_ok=True)
    envs: dict[str, dict | None] = {"source": None}
    if "compiled" in builds:
        envs["compiled"] = {**os.environ, "PYTHONPATH": str(compiled_site(workdir))}
    cli = [sys.executable, "-m", "prefixroute"]
    rows = []
    for n in sizes:
        trace, out = workdir / f"trace-{n}.jsonl", workdir / f"result-{n}.json"
        gen_s, _, gen_mb = measured(cli + ["generate", f"mooncake-sessions:rate={args.rate}",
                                        "--requests", str(n), "--seed", "7", "-o", str(trace),
                                        "--no-progress"])
        summaries = {}
        for build in builds:
            load_before = os.getloadavg()[0]
            sim_s, sim_cpu, sim_mb = measured(cli + [
                "simulate", "--trace", str(trace), "--trace-format", "mooncake", "--stream",
                "--policy", "prefixroute", "--replicas", str(REPLICAS), "--json", str(out),
                "--no-progress"], env=envs[build])
            summary = summaries[build] = json.loads(out.read_text())["policies"]["prefixroute"]
            row = {"requests": n, "build": build,
                   "trace_mb": round(trace.stat().st_size / 2**20, 1),
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
        if len(summaries) == 2 and summaries["source"] != summaries["compiled"]:
            raise SystemExit(f"{n:,} requests: the compiled build's results differ from the "
                             "source's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
