"""Several gateway instances, with and without shared state on Redis (one command, bounded).

    PYTHONPATH=src python benchmarks/shared_state.py [--requests 150] [--json out.json]

Starts a redis-server (a plain process on a free loopback port; ``scripts/setup_test_services.sh``
installs it), emulator replicas, and for each of 1, 2 and 4 gateway instances, with and
without ``shared_state``, replays the design scenario (the demo's workload and pacing) with
requests taking turns over the instances. Per configuration it reports token hit rate and
TTFT p50/p99 (engine seconds), then, for the shared configurations:

* rate-limit accuracy: one tenant limited to R requests a second is sent 3 R a second
  (open loop, evenly spaced) spread over the instances for a few seconds; accepted / (burst + R x seconds) should be
  at most 1 (without shared state each instance lets R through: N x);
* Redis operations per request (from the instances' metrics);
* added latency on a request's path, measured in this process against the same Redis: what
  a booking costs the gateway (encode and queue; the write happens off the path) and a
  fleet-wide rate-limit check (one round trip, for limited tenants only).

Every process is stopped by its id at the end. Figures and their reading:
benchmarks/results/shared_state.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.lifecycle import LifecycleRunner
from prefixroute.core.routing.views import ApproximateView
from prefixroute.edges.cli.demo import (ENGINE_PROFILE, MAX_MODEL_LEN, OUTPUT_TOKENS,
                                        PREFILL_S_PER_TOKEN, RATE_PER_REPLICA)
from prefixroute.edges.gateway.config import hash_api_key
from prefixroute.edges.listen import free_port
from prefixroute.edges.loadtest.fleet import LocalFleet
from prefixroute.edges.loadtest.replay import replay, summarize
from prefixroute.edges.loadtest.workload import design_requests

POLICY = "prefixroute"
LIMIT_RPS, LIMIT_BURST, LIMIT_SECONDS = 10.0, 1, 3.0
CONFIGS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def hammer_limit(urls: list[str], key: str, model: str) -> tuple[int, int, float]:
    """Open loop, 3 R requests a second evenly spaced for LIMIT_SECONDS, taking turns over
    ``urls``: (accepted, sent, seconds)."""
    headers = {"authorization": f"Bearer {key}"}
    interval = 1.0 / (3 * LIMIT_RPS)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> bool:
            response = await client.post(
                f"{urls[i % len(urls)]}/v1/completions", headers=headers,
                json={"model": model, "prompt": [1, 2, 3], "max_tokens": 1})
            return response.status_code == 200

        started = time.monotonic()
        tasks = []
        i = 0
        while time.monotonic() - started < LIMIT_SECONDS:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(max(0.0, started + i * interval - time.monotonic()))
        seconds = time.monotonic() - started
        accepted = sum(await asyncio.gather(*tasks))
        return accepted, len(tasks), seconds


async def path_latency(url: str, samples: int = 2000) -> dict:
    """What shared state adds on a request's path, measured here against the same Redis."""
    from prometheus_client import CollectorRegistry

    from prefixroute.edges.shared_state.shared import SharedState

    class First(BasePolicy):
        def route(self, request, replicas):
            return Decision(replicas[0].index, "first")

    runner = LifecycleRunner(First())
    runner.add_replica(ReplicaView(index=0, name="r0", cache=ApproximateView(None)))
    shared = SharedState(url, runner, CollectorRegistry(), now=time.monotonic,
                         namespace=f"bench-{os.urandom(4).hex()}")
    keys = tuple(range(10_000, 10_000 + 600))  # a 9,600-token prompt: 600 blocks
    book_us = []
    for i in range(samples):
        request = RequestView(f"q{i}", 9_601, 16, block_keys=keys, now=time.monotonic())
        booking = runner.route(request)
        t0 = time.perf_counter()
        shared.routed(booking, 0)
        shared.completed(booking, 0)
        book_us.append((time.perf_counter() - t0) * 1e6)
        runner.completed(booking, 0)
    shared.bookings.outbox.clear()
    limit_us = []
    for _ in range(min(samples, 1000)):
        t0 = time.perf_counter()
        await shared.take("t", [("requests", 1e9, 1e9, 1.0)])
        limit_us.append((time.perf_counter() - t0) * 1e6)
    await shared.stop()
    return {"booking_us_p50": statistics.median(book_us),
            "booking_us_p99": statistics.quantiles(book_us, n=100)[98],
            "rate_limit_check_us_p50": statistics.median(limit_us),
            "rate_limit_check_us_p99": statistics.quantiles(limit_us, n=100)[98]}


def run(args: argparse.Namespace) -> dict:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not installed: scripts/setup_test_services.sh")
    requests = design_requests(args.requests, replicas=args.replicas, model="emulated",
                               rate_per_replica=RATE_PER_REPLICA, output_tokens=OUTPUT_TOKENS,
                               seed=args.seed)
    tenants = sorted({r.tenant for r in requests})
    duration = (requests[-1].arrival_s - requests[0].arrival_s) * args.time_scale
    workdir = Path(tempfile.mkdtemp(prefix="prefixroute-shared-bench-"))
    port = free_port()
    redis_log = open(workdir / "redis.log", "wb")
    redis = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save",
                              "", "--appendonly", "no"], stdout=redis_log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    results: dict = {"scenario": {"requests": len(requests), "replicas": args.replicas,
                                  "time_scale": args.time_scale, "policy": POLICY,
                                  "rate_limit": {"requests_per_second": LIMIT_RPS,
                                                 "burst": LIMIT_BURST,
                                                 "seconds": LIMIT_SECONDS}},
                     "runs": []}
    replica_args = ["--time-scale", f"{args.time_scale:g}", "--profile", ENGINE_PROFILE,
                    "--max-model-len", str(MAX_MODEL_LEN)]
    try:
        time.sleep(0.3)
        with LocalFleet(workdir, args.replicas, replica_args,
                        tenants=[*tenants, "limited"]) as fleet:
            fleet.start_replicas()
            tenant_entries = [{"name": t, "api_key_sha256": hash_api_key(k)}
                              for t, k in fleet.api_keys.items()]
            for entry in tenant_entries:
                if entry["name"] == "limited":
                    entry["rate_limit"] = {"requests_per_second": LIMIT_RPS,
                                           "burst": LIMIT_BURST}
            headers = {t: {"content-type": "application/json", "authorization": f"Bearer {k}"}
                       for t, k in fleet.api_keys.items()}
            for instances, shared in CONFIGS:
                fleet.reset_replicas()
                extra: dict = {"tenants": tenant_entries}
                if shared:
                    extra["shared_state"] = {"redis": url,
                                             "namespace": f"bench-{os.urandom(4).hex()}"}
                fleet.start_gateway(POLICY, instances=instances, backend_fields={
                    "prefill_s_per_token": PREFILL_S_PER_TOKEN * args.time_scale}, **extra)
                urls = fleet.gateway_urls
                outcomes = asyncio.run(replay(
                    [u + "/v1/completions" for u in urls], requests,
                    headers_for=lambda r: headers[r.tenant], time_scale=args.time_scale,
                    deadline_s=duration + 60.0))
                summary = summarize(outcomes, time_scale=args.time_scale)
                ops = sum(metric_sum(u, "prefixroute_shared_state_redis_operations_total")
                          for u in urls)
                ok, sent, seconds = asyncio.run(
                    hammer_limit(urls, fleet.api_keys["limited"], fleet.model))
                allowed = LIMIT_BURST + LIMIT_RPS * seconds
                run_result = {
                    "gateways": instances, "shared_state": shared,
                    "token_hit_rate": summary["token_hit_rate"],
                    "ttft_p50_s": summary["ttft_p50_s"], "ttft_p99_s": summary["ttft_p99_s"],
                    "requests_ok": summary["requests_ok"],
                    "requests_failed": summary["requests_failed"],
                    "redis_operations_per_request": ops / max(1, len(requests)),
                    "rate_limit": {"accepted": ok, "sent": sent, "allowed": round(allowed, 1),
                                   "accepted_over_allowed": round(ok / allowed, 3)}}
                results["runs"].append(run_result)
                print(json.dumps(run_result), file=sys.stderr, flush=True)
                fleet.stop_gateway()
        results["path_latency"] = asyncio.run(path_latency(url))
    finally:
        redis.terminate()
        redis.wait(timeout=10)
        redis_log.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return results


def print_table(results: dict) -> None:
    s = results["scenario"]
    print(f"design scenario, {s['requests']} requests, {s['replicas']} emulator replicas, "
          f"policy {s['policy']}, time scale {s['time_scale']:g} (TTFT in engine seconds)")
    print(f"{'gateways':>8} {'shared':>6} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'failed':>6} {'redis ops/req':>13} {'limit accepted/allowed':>22}")
    for r in results["runs"]:
        rl = r["rate_limit"]
        print(f"{r['gateways']:>8} {'yes' if r['shared_state'] else 'no':>6} "
              f"{(r['token_hit_rate'] or 0):>8.1%} {r['ttft_p50_s'] or 0:>8.3f}s "
              f"{r['ttft_p99_s'] or 0:>8.3f}s {r['requests_failed']:>6} "
              f"{r['redis_operations_per_request']:>13.2f} "
              f"{rl['accepted']:>5}/{rl['allowed']:<6} = {rl['accepted_over_allowed']:.2f}")
    lat = results.get("path_latency")
    if lat:
        print(f"added on a request's path: booking p50 {lat['booking_us_p50']:.1f} us "
              f"(p99 {lat['booking_us_p99']:.1f}); rate-limit check p50 "
              f"{lat['rate_limit_check_us_p50']:.0f} us (p99 {lat['rate_limit_check_us_p99']:.0f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print_table(results)


if __name__ == "__main__":
    main()
