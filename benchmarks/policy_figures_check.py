"""Re-run ``prefixroute`` at every setting recorded in a policy comparison and compare figures.

``benchmarks/policy_comparison.py`` takes tens of minutes because it searches each setting and
runs every peer. After a change to ``prefixroute`` that must not change its decisions (a
refactoring), this runs only ``prefixroute`` at the recorded settings (a) and (b), its
ablation variants at (a) and, with ``--stability``, its stability draws, and reports every
figure that differs from the recorded JSON (``--results``, default
``benchmarks/results/policy_comparison.json``). Exit status 1 if any differs.

``--rename OLD->NEW`` maps a recorded ablation row to its current spec (a renamed switch).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import policy_comparison as pc  # noqa: E402
from prefixroute_ablations import register_ablations  # noqa: E402

from prefixroute.core.errors import ConfigError  # noqa: E402
from prefixroute.core.routing.registry import create_policy  # noqa: E402

KEYS = ("ttft_p50_s", "ttft_p99_s", "ttft_mean_s", "token_hit_rate", "balance_busy",
        "assignments", "completed", "rejected", "preemptions")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(pc.RESULTS / "policy_comparison.json"))
    parser.add_argument("--rename", action="append", default=[], metavar="OLD->NEW")
    parser.add_argument("--stability", action="store_true")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    recorded = json.loads(Path(args.results).read_text())
    pc.SCHEDULING = recorded["scheduling_policy"]
    pc.VIEW = recorded["view"]
    rename = dict(item.split("->", 1) for item in args.rename)
    register_ablations()
    tasks: list[tuple[tuple, dict, str]] = []  # (run_task's task, recorded figures, label)
    for row in recorded["rows"]:
        name, scale, replicas = row["workload"], row["time_scale"], row["replicas"]
        tasks.append(((name, scale, replicas, pc.OURS, False), row["ours"],
                      f"{name} ({row['setting']})"))
        if args.stability:
            for draw in row["stability"]["draws"]:
                if draw["factor"] != 1.0:
                    task = (name, round(scale * draw["factor"], 6), replicas, pc.OURS, False)
                    tasks.append((task, {"balance_busy": draw["balance_busy"]},
                                  f"{name} ({row['setting']}) x{draw['factor']:g}"))
    for name, variants in recorded.get("ablation", {}).items():
        scale = recorded["workloads"][name]["time_scale"]
        for spec, figures in variants.items():
            if spec == pc.OURS:
                continue
            spec = rename.get(spec, spec)
            try:
                create_policy(spec)
            except ConfigError as exc:
                print(f"{name} (a) {spec}: not run ({exc})")
                continue
            tasks.append(((name, scale, pc.BASE_REPLICAS, spec, False), figures,
                          f"{name} (a) {spec}"))
    pc.prepare(sorted({task[0] for task, _, _ in tasks}))
    with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
        results = pool.map(pc.run_task, [task for task, _, _ in tasks], chunksize=1)
    differ = 0
    for (_, figures, label), result in zip(tasks, results):
        changed = {k: (figures[k], result[k]) for k in KEYS
                   if k in figures and figures[k] != result[k]}
        differ += bool(changed)
        print(f"{label}: " + ("same" if not changed else f"DIFFERS {changed}") +
              f" (p99 {result['ttft_p99_s']:.6g} s, mean {result['ttft_mean_s']:.6g} s, "
              f"hit {result['token_hit_rate']:.4%}, busiest {result['balance_busy']:.4f})")
    print(f"{len(tasks)} runs, {differ} with a different figure")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
