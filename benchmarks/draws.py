"""Many draws of one policy-comparison setting: how much of a verdict is the draw.

``benchmarks/policy_comparison.py`` judges each setting on one run and checks it at five time
scales 0.5% and 1% apart (its stability table). On a fleet run 100% busy through bursts those
five do not settle a median: a 1% change of the arrival times moves which requests meet in a
burst. This runs ``prefixroute`` and the setting's best peer (from
``benchmarks/results/policy_comparison.json``) at ``--draws`` time scales ``--step`` apart
around the setting's, on the same replicas (in ``--jobs`` worker processes), and reports each
draw's p99 and mean TTFT ratios, their medians and how many draws meet the comparison's targets.
``--windows S`` also splits the setting's own draw by arrival time into windows of S seconds:
each window's summed TTFT and token hit rate for both, which shows when in the run a mean is
won or lost.

Run from the repository: ``python benchmarks/draws.py --workload mooncake-synthetic --setting b
--draws 21 --windows 50`` (about a minute on two cores for that setting; the Mooncake
conversation and the agentic sessions take a few times longer). Writes
``benchmarks/results/draws_<workload>_<a|b>.md`` and ``.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_comparison as pc  # noqa: E402  (settings, runs, verdicts and paths)

from prefixroute.core.simulator.simulation import simulate_policy  # noqa: E402


def windows(name: str, scale: float, replicas: int, peer: str,
            width_s: float) -> list[dict]:
    """Per ``width_s`` of arrivals in the setting's own draw, for ours and the peer: requests
    completed, their prompt tokens, summed TTFT and cached tokens. Each run's requests go by
    that run's own arrival times (a closed loop's later turns arrive when the run sends them;
    an open loop's are the recorded times, the same in both)."""
    workload = pc.scaled(name, scale)
    fleet = pc.fleet_for(workload, replicas)
    runs = {spec: simulate_policy(workload, fleet, spec, view=pc.VIEW) for spec in (pc.OURS, peer)}
    requests = workload.requests
    done = {}
    for spec, run in runs.items():
        done[spec] = [k for k in range(len(requests)) if run.cached_tokens[k] >= 0]
        # PolicyRun.ttft_s lists the completed requests' TTFTs in request order.
        if len(done[spec]) != len(run.ttft_s):
            raise RuntimeError(f"{spec}: {len(run.ttft_s)} first tokens for "
                               f"{len(done[spec])} completed requests")
    times = [runs[spec].arrival_s[k] for spec in runs for k in done[spec]]
    start = min(times)
    count = int((max(times) - start) // width_s) + 1
    fields = ("requests", "tokens", "ttft_s", "cached")
    rows = [{"from_s": start + i * width_s, **{f"{spec}_{f}": 0 for spec in runs for f in fields}}
            for i in range(count)]
    for spec, run in runs.items():
        for k, ttft in zip(done[spec], run.ttft_s):
            row = rows[int((run.arrival_s[k] - start) // width_s)]
            row[f"{spec}_requests"] += 1
            row[f"{spec}_tokens"] += requests[k].input_tokens
            row[f"{spec}_ttft_s"] += ttft
            row[f"{spec}_cached"] += run.cached_tokens[k]
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="one of: " + ", ".join(pc.BY_NAME))
    parser.add_argument("--setting", choices=("a", "b"), required=True)
    parser.add_argument("--draws", type=int, default=21, help="time scales (odd: the "
                        "setting's own in the middle; default %(default)s)")
    parser.add_argument("--step", type=float, default=0.005,
                        help="relative step between time scales (default %(default)s)")
    parser.add_argument("--windows", type=float, default=0.0, metavar="S",
                        help="also split the own draw into windows of S seconds of arrivals")
    parser.add_argument("--results", default=str(pc.RESULTS / "policy_comparison.json"))
    parser.add_argument("--jobs", type=int, default=2, help="worker processes")
    parser.add_argument("--out", default=str(pc.RESULTS), help="output directory")
    args = parser.parse_args()
    if args.draws < 1 or args.draws % 2 == 0:
        parser.error("--draws must be odd and positive")
    if not 0 < args.step * max(1, args.draws // 2) < 1:  # (also refuses NaN)
        parser.error("--step must be positive, and --step x (--draws // 2) below 1 (every "
                     "time scale positive)")
    if not 0 <= args.windows < float("inf"):
        parser.error("--windows must be a number of seconds >= 0")
    rows = pc.read_settings(args.results, "draws.py")
    if rows is None:
        return 2
    row = next((r for r in rows if r["workload"] == args.workload
                and r["setting"].startswith(args.setting + ":")), None)
    if row is None:
        print(f"draws.py: {args.results} has no setting {args.setting} for workload "
              f"{args.workload!r}", file=sys.stderr)
        return 2
    started = time.perf_counter()
    name, replicas, peer, base = row["workload"], row["replicas"], row["best_peer"], \
        row["time_scale"]
    pc.prepare([name])
    half = args.draws // 2
    scales = [round(base * (1 + args.step * (i - half)), 6) for i in range(args.draws)]
    runner = pc.Runner(max(1, args.jobs))
    draws = []
    try:
        for scale in scales:
            res = runner.run(name, scale, replicas, [pc.OURS, peer])
            verdict = pc.verdicts(res[pc.OURS], res[peer], row["ideal"])
            draws.append({"time_scale": scale, **verdict,
                          "hit": res[pc.OURS]["token_hit_rate"],
                          "peer_hit": res[peer]["token_hit_rate"]})
            pc.log(f"x{scale:g}: p99 {verdict['p99_ratio']:.2f}x, mean "
                   f"{verdict['mean_ratio']:.2f}x, hit {draws[-1]['hit']:.1%} / "
                   f"{draws[-1]['peer_hit']:.1%}")
    finally:
        runner.close()
    p99s = [d["p99_ratio"] for d in draws]
    means = [d["mean_ratio"] for d in draws]
    summary = {"p99_median": statistics.median(p99s), "mean_median": statistics.median(means),
               "p99_ok": sum(d["p99_ok"] for d in draws),
               "mean_ok": sum(d["mean_ok"] for d in draws),
               "both_ok": sum(d["p99_ok"] and d["mean_ok"] for d in draws)}
    n = len(draws)
    md = [f"# {name}, setting {row['setting']}: {n} draws", "",
          f"Generated by `python benchmarks/draws.py --workload {name} --setting "
          f"{args.setting} --draws {n} --step {args.step:g}"
          + (f" --windows {args.windows:g}" if args.windows else "") + "`. "
          f"{replicas} replicas; ours against {peer} (the setting's best peer) at time scales "
          f"{scales[0]:g} to {scales[-1]:g}, the setting's own x{base:g} in the middle.", "",
          f"Medians: p99 TTFT {summary['p99_median']:.2f}x, mean TTFT "
          f"{summary['mean_median']:.2f}x the peer's. Draws meeting p99 <= 0.9x: "
          f"{summary['p99_ok']} of {n}; mean no worse: {summary['mean_ok']} of {n}; both: "
          f"{summary['both_ok']} of {n}.", "",
          "| time scale | p99 ratio | mean ratio | token hit ours | token hit peer |",
          "|---:|---:|---:|---:|---:|"]
    for d in draws:
        own = " (own)" if d["time_scale"] == scales[half] else ""
        md.append(f"| {d['time_scale']:g}{own} | {d['p99_ratio']:.2f} | "
                  f"{d['mean_ratio']:.2f} | {d['hit']:.1%} | {d['peer_hit']:.1%} |")
    split = []
    if args.windows:
        split = windows(name, scales[half], replicas, peer, args.windows)
        md += ["", f"The own draw by arrival time, windows of {args.windows:g} s: the "
               "requests arriving in each that completed, their summed TTFT and token hit "
               "rate.", "",
               f"| from | requests ours / {peer} | TTFT sum ours | TTFT sum {peer} | "
               f"hit ours | hit {peer} |", "|---:|---:|---:|---:|---:|---:|"]
        for w in split:
            ours, other = pc.OURS, peer
            md.append(f"| {w['from_s']:.0f} s | {w[ours + '_requests']} / "
                      f"{w[other + '_requests']} | {w[ours + '_ttft_s']:.0f} s | "
                      f"{w[other + '_ttft_s']:.0f} s | "
                      f"{w[ours + '_cached'] / max(1, w[ours + '_tokens']):.1%} | "
                      f"{w[other + '_cached'] / max(1, w[other + '_tokens']):.1%} |")
    pc.write_results(args.out, f"draws_{name}_{args.setting}", md,
                     {"workload": name, "setting": row["setting"], "replicas": replicas,
                      "best_peer": peer, "draws": draws, "summary": summary, "windows": split},
                     started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
