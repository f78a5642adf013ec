"""Record and replay: how close the simulator's replay of recorded traffic comes to the live
fleet that served it.

For each ``--policy`` and each ``--num-blocks`` (KV blocks per emulator replica; ``0`` is
the engine profile's own, about 25,600, where the design scenario's prefixes all fit), two
emulator replicas and a gateway with ``record`` start, the first ``--requests`` of the
design scenario go through over HTTP (token-id prompts, streamed, engines and arrivals at
time scale 0.5, as ``prefixroute demo``), and ``prefixroute simulate --trace`` replays the
recording through the same policy at the live fleet size and KV (both from the recording's
headers). Printed per run: the live token hit rate (from the recording, equal to what the
clients were told), the replay's, the difference in points, and TTFT p50 live and replayed,
with the machine's 1-minute load average (the live engines run in real time, so a loaded
machine slows them; the replay does not notice).

Run: ``python benchmarks/record_replay.py [--policy prefixroute --policy round_robin]
[--num-blocks 0,3000] [--requests 200] [--json]`` (about a minute per run on 2 cores).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile

from prefixroute.edges.loadtest.fleet import LocalFleet
from prefixroute.edges.loadtest.replay import replay
from prefixroute.edges.loadtest.workload import design_requests

REPLICAS = 2
TIME_SCALE = 0.5  # prefixroute demo's default
RATE_PER_REPLICA = 2.9  # prefixroute demo's: loaded, not overloaded
OUTPUT_TOKENS = (8, 32)
PROFILE = "llama-3-8b-h100"
PREFILL_S_PER_TOKEN = 4.0e-5  # that profile's prefill cost


def run_once(policy: str, num_blocks: int, requests: int) -> dict:
    wire = design_requests(requests, replicas=REPLICAS, model="emulated",
                           rate_per_replica=RATE_PER_REPLICA, output_tokens=OUTPUT_TOKENS)
    tenants = sorted({r.tenant for r in wire})
    replica_args = ["--time-scale", f"{TIME_SCALE:g}", "--profile", PROFILE,
                    "--max-model-len", "16384"]
    if num_blocks:
        replica_args += ["--num-blocks", str(num_blocks)]
    with tempfile.TemporaryDirectory(prefix="record-replay-") as work:
        recording = os.path.join(work, "recording")
        with LocalFleet(work, REPLICAS, replica_args, tenants=tenants) as fleet:
            for replica in fleet.replicas:
                replica.start()
            fleet.start_gateway(policy, backend_fields={
                "prefill_s_per_token": PREFILL_S_PER_TOKEN * TIME_SCALE},
                record={"path": recording})
            headers = {t: {"content-type": "application/json", "authorization": f"Bearer {k}"}
                       for t, k in fleet.api_keys.items()}
            duration = (wire[-1].arrival_s - wire[0].arrival_s) * TIME_SCALE
            asyncio.run(replay([fleet.gateway_urls[0] + "/v1/completions"], wire,
                               headers_for=lambda r: headers[r.tenant], time_scale=TIME_SCALE,
                               deadline_s=duration + 60))
            load = os.getloadavg()[0]
            fleet.stop_gateway()  # writes what is queued
        result = subprocess.run(
            [sys.executable, "-m", "prefixroute", "simulate", "--trace", recording,
             "--policy", policy, "--time-scale", f"{1 / TIME_SCALE:g}", "--json", "-",
             "--no-progress"], capture_output=True, text=True, check=True)
    report = json.loads(result.stdout)
    live, replayed = report["live"], report["policies"][policy]
    return {"policy": policy, "cache_blocks": report["fleet"]["cache_blocks"],
            "requests": live["requests"], "load_average_1m": round(load, 1),
            "live_token_hit_rate": live["token_hit_rate"],
            "replay_token_hit_rate": replayed["token_hit_rate"],
            "points": replayed["vs_live"]["token_hit_rate_points"],
            "replay_evictions": replayed["evictions"],
            "live_ttft_p50_s": live["ttft_p50_s"], "replay_ttft_p50_s": replayed["ttft_p50_s"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", action="append", help="default prefixroute, round_robin")
    parser.add_argument("--num-blocks", default="0,3000",
                        help="KV blocks per replica, comma-separated (0: the profile's)")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = [run_once(policy, int(blocks), args.requests)
            for blocks in args.num_blocks.split(",")
            for policy in (args.policy or ["prefixroute", "round_robin"])]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print("| policy | KV blocks per replica | live token hit rate | replay | points | "
          "replay evictions | TTFT p50 live / replay | load avg |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['policy']} | {r['cache_blocks']:,} | {r['live_token_hit_rate']:.1%} | "
              f"{r['replay_token_hit_rate']:.1%} | {r['points']:+.2f} | "
              f"{r['replay_evictions']:,} | {r['live_ttft_p50_s']:.3f} / "
              f"{r['replay_ttft_p50_s']:.3f} s | {r['load_average_1m']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
