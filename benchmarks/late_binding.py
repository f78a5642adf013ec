"""Late binding: the p99 TTFT of a simple router that holds requests until a replica is free.

The policy comparison asks our policy for a p99 TTFT at most 0.9x the best peer's. When every
good router lands on the same p99 (Mooncake conversation at 3 replicas: 14.11 s ours, 13.85 s
dynamo_kv_cost), is the rest a routing problem at all? This replays each setting of
``benchmarks/results/policy_comparison.json`` through the simulator's engines without
per-request routing: requests wait in one first-come-first-served queue at the router, and the
head goes to a replica as soon as one has no prefill left (or at most one chunk,
``max_num_batched_tokens``, so it never idles waiting for the router), the free replica
holding most of its prompt (read exactly from the engine's cache), then the one with the least
KV in use. That is late binding, the pooled queue of an M/G/k system: with no slack, no
request waits at the router while a replica has nothing to prefill (with one chunk of
slack, the holder of the prompt may take it ahead of an idle replica). It is a baseline, not
a bound: it gives up cache affinity whenever the holder is busy (ours beats it by far where
affinity pays), and a router could also reorder requests. Where it lands on the routers' p99
anyway, the p99 is set by the work the engines must do more than by where requests go.

A closed-loop workload (the agentic sessions) sends each turn its think time after the
previous turn ended, as ``simulate --closed-loop`` does (the simulator's ``ArrivalPlan``).

Run from the repository after ``benchmarks/policy_comparison.py`` (it reads that run's
settings): ``python benchmarks/late_binding.py`` (about a minute, on one core). Writes
``benchmarks/results/late_binding.md`` and ``late_binding.json``.
"""

from __future__ import annotations

import heapq
import math
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import policy_comparison as pc  # noqa: E402  (the settings' workloads, fleets and paths)

from prefixroute.core.caches.paged_pool import PagedBlockPool  # noqa: E402
from prefixroute.core.replica.engine import ReplicaEngine  # noqa: E402  (for types)
from prefixroute.core.simulator.metrics import percentile  # noqa: E402
from prefixroute.core.simulator.simulation import (ArrivalPlan, FleetConfig,  # noqa: E402
                                                   PreparedWorkload)

# A replica takes the router's next request with no prefill left, or with at most one chunk
# (``max_num_batched_tokens``) left, so that it never idles for the router's reply.
SLACKS = ("none", "one chunk")


def late_binding(workload: PreparedWorkload, fleet: FleetConfig,
                 slack: int) -> dict[str, float]:
    """Replay ``workload`` on ``fleet.replicas`` fresh engines with one central FCFS queue
    (module docstring); ``slack``: prefill tokens a replica may still have pending and take
    the next request. Figures as the simulator's summary counts them: over completed
    requests (a prompt longer than the KV is rejected)."""
    requests = workload.requests
    prompt_keys = workload.prompt_keys
    engines = [fleet.engine(PagedBlockPool(fleet.cache_blocks + 1, fleet.block_size))
               for _ in range(fleet.replicas)]
    plan = ArrivalPlan(workload)
    arrive, arrivals = plan.arrive, plan.pending
    total = len(requests)
    first = [-1.0] * total
    cached = [-1] * total  # -1: not completed
    held: deque[int] = deque()

    def handle(events, now: float) -> None:
        for event in events:
            k = event.request_id
            if event.kind == "first_token":
                first[k] = event.time
                continue
            if event.kind == "finished":
                cached[k] = event.cached_tokens
            plan.release(k, event.time, now)  # finished or rejected

    def free(engine: ReplicaEngine) -> bool:
        return engine.waiting + engine.entering == 0 and engine.pending_prefill_tokens <= slack

    while True:
        wakes = [e.next_event_time() for e in engines]
        now = min([t for t in wakes if t is not None]
                  + [arrivals[0][0] if arrivals else math.inf])
        if now == math.inf:
            break
        for engine, wake in zip(engines, wakes):  # engine events first, as the simulator
            if wake is not None and wake <= now:  # handles them
                handle(engine.advance(now), now)
        while arrivals and arrivals[0][0] <= now:
            held.append(heapq.heappop(arrivals)[1])
        while held:
            ready = [i for i, engine in enumerate(engines) if free(engine)]
            if not ready:
                break
            k = held.popleft()
            request = requests[k]
            i = max(ready, key=lambda i: (engines[i].pool.match(prompt_keys[k]),
                                          -engines[i].kv_usage, -i))
            engines[i].submit(k, request.input_tokens, request.output_tokens,
                              request.block_keys, now)
            handle(engines[i].advance(now), now)
    if held:  # every engine idle with requests still queued: the loop above is wrong
        raise RuntimeError(f"{len(held)} requests left at the router")
    done = [k for k in range(total) if cached[k] >= 0]
    ttft = [first[k] - arrive[k] for k in done]
    prompt = sum(requests[k].input_tokens for k in done)
    return {"ttft_p99_s": percentile(ttft, 99) or 0.0,
            "ttft_mean_s": sum(ttft) / len(ttft) if ttft else 0.0,
            "token_hit_rate": sum(cached[k] for k in done) / prompt if prompt else 0.0,
            "completed": len(done), "last_first_token_s": max(first)}


def main() -> int:
    started = time.perf_counter()
    settings = pc.replay_settings(__doc__, "late_binding.py")
    if settings is None:
        return 2
    args, rows = settings
    out_rows = []
    for row in rows:
        runs = {}
        workload = pc.scaled(row["workload"], row["time_scale"])
        fleet = pc.fleet_for(workload, row["replicas"])
        for slack in SLACKS:
            t0 = time.perf_counter()
            runs[slack] = late_binding(workload, fleet, 0 if slack == "none"
                                       else fleet.max_num_batched_tokens)
            pc.log(f"{row['workload']} {row['setting']} slack {slack}: p99 "
                   f"{runs[slack]['ttft_p99_s']:.2f} s, mean {runs[slack]['ttft_mean_s']:.3f} s, "
                   f"hit {runs[slack]['token_hit_rate']:.1%} ({time.perf_counter() - t0:.0f} s)")
        out_rows.append({"workload": row["workload"], "setting": row["setting"],
                         "replicas": row["replicas"], "time_scale": row["time_scale"],
                         "best_peer": row["best_peer"],
                         "peer_p99_s": row["peer"]["ttft_p99_s"],
                         "ours_p99_s": row["ours"]["ttft_p99_s"],
                         "late_binding": {str(s): r for s, r in runs.items()}})
    md = ["# Late binding against the routers' p99 TTFT", "",
          "Generated by `python benchmarks/late_binding.py` from the settings of "
          "`policy_comparison.json`. One FCFS queue at the router; its head goes to the first "
          "replica with no prefill left or at most one chunk "
          "(`max_num_batched_tokens`) left, the one holding most of its prompt (exact, from "
          "the engine's cache). A baseline, not a bound: ours beats it where cache affinity "
          "pays. See the script's docstring.", "",
          "| workload | setting | best peer | 0.9x its p99 | ours p99 | late binding p99 "
          "(none left / one chunk) | its mean TTFT | its token hit |",
          "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in out_rows:
        lb = [r["late_binding"][str(s)] for s in SLACKS]
        md.append(f"| {r['workload']} | {r['setting']} ({r['replicas']} replicas) | "
                  f"{r['best_peer']} | {0.9 * r['peer_p99_s']:.2f} s | {r['ours_p99_s']:.2f} s | "
                  f"{lb[0]['ttft_p99_s']:.2f} / {lb[1]['ttft_p99_s']:.2f} s | "
                  f"{lb[0]['ttft_mean_s']:.3f} / {lb[1]['ttft_mean_s']:.3f} s | "
                  f"{lb[0]['token_hit_rate']:.1%} / {lb[1]['token_hit_rate']:.1%} |")
    pc.write_results(args.out, "late_binding", md, {"rows": out_rows}, started)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
