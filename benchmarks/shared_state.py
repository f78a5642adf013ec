"""Several gateway instances, with and without shared state on Redis (one command, bounded).

    PYTHONPATH=src python benchmarks/shared_state.py [--requests 150] [--repeats 3] [--json F]

Starts a redis-server (a plain process on a free loopback port; ``scripts/setup_test_services.sh``
installs it), emulator replicas, and for each of 1, 2 and 4 gateway instances, with and
without ``shared_state``, replays the design scenario (the demo's workload and pacing) with
requests taking turns over the instances. Every scenario tenant has a request limit and a
prompt-token limit that its traffic never reaches (:data:`SCENARIO_LIMIT`), in every
configuration, so each request pays the limit checks and "shared state on" and "off" differ
only by where the buckets live. Per configuration it reports:

* token hit rate and TTFT p50/p99 (engine seconds);
* what shared state adds to a request's path, measured inside the gateways under this very
  load: ``prefixroute_shared_state_path_seconds`` (each booking event and each fleet
  rate-limit check, p50/p99 per call, and the sum per request), beside the gateways' own
  time before sending a request (``prefixroute_gateway_routing_seconds``, mean) with shared
  state on and off, and the 1-minute load average;
* how stale the other instances' bookings are when applied (p50/p99);
* Redis operations per request (from the instances' metrics);
* rate-limit accuracy across the instances: one tenant limited to R requests a second and
  another to T prompt tokens a second are each sent three times their limit (open loop,
  evenly spaced) over the instances for a few seconds; accepted / (burst + rate x seconds)
  should be at most 1, the seconds running from the first send to the last answer (without
  shared state each instance lets its own share through: N x).

``--repeats K`` then runs one instance and four shared instances back to back on K more seeds
of the scenario, to tell a TTFT difference from run-to-run noise. Every process is stopped by
its id at the end. Figures and their reading: benchmarks/results/shared_state.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from prefixroute.edges.cli.demo import (ENGINE_PROFILE, MAX_MODEL_LEN, OUTPUT_TOKENS,
                                        PREFILL_S_PER_TOKEN, RATE_PER_REPLICA)
from prefixroute.edges.gateway.config import hash_api_key
from prefixroute.edges.listen import free_port
from prefixroute.edges.loadtest.fleet import LocalFleet
from prefixroute.edges.loadtest.replay import replay, summarize
from prefixroute.edges.loadtest.workload import design_requests

POLICY = "prefixroute"
LIMIT_RPS, LIMIT_BURST, LIMIT_SECONDS = 10.0, 1, 3.0
# The prompt-token limit's test: prompts of TOKEN_PROMPT token ids (exactly that many prompt
# tokens), the tenant limited to LIMIT_TPS a second with a burst of one second's worth.
LIMIT_TPS, LIMIT_TOKEN_BURST, TOKEN_PROMPT = 5_000.0, 5_000, 250
# Scenario tenants: limits their traffic never reaches (the busiest sends about one request
# of 10,000 tokens a second), so every request is checked and none is refused.
SCENARIO_LIMIT = {"requests_per_second": 50, "burst": 50,
                  "prompt_tokens_per_second": 500_000, "prompt_tokens_burst": 500_000}
CONFIGS = [(1, False), (2, False), (2, True), (4, False), (4, True)]


def metric_lines(url: str) -> list[tuple[str, float]]:
    out = []
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            head, _, value = line.rpartition(" ")
            out.append((head, float(value)))
    return out


def histogram(urls: list[str], name: str, label: str = "") -> tuple[list, float, float]:
    """The instances' summed histogram ``name`` (series with ``label`` in their labels):
    ([(upper bound, cumulative count)], count, sum)."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for url in urls:
        for head, value in metric_lines(url):
            if label and label not in head:
                continue
            if head.startswith(name + "_bucket{"):
                le = head.split('le="', 1)[1].split('"', 1)[0]
                bound = float("inf") if le == "+Inf" else float(le)
                buckets[bound] = buckets.get(bound, 0.0) + value
            elif head.startswith(name + "_count"):
                count += value
            elif head.startswith(name + "_sum"):
                total += value
    return sorted(buckets.items()), count, total


def quantile(buckets: list, count: float, q: float) -> float | None:
    """The q-quantile of a histogram, interpolated linearly inside its bucket (Prometheus's
    histogram_quantile)."""
    if not count:
        return None
    rank, lower, below = q * count, 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= rank:
            if bound == float("inf"):
                return lower
            inside = cumulative - below
            return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
        lower, below = bound, cumulative
    return lower


def path_figures(urls: list[str], requests: int) -> dict:
    """What shared state added to the requests' paths, from the gateways' own histograms."""
    out: dict = {}
    added = 0.0
    for op in ("booking", "ratelimit", "limits_wait"):
        buckets, count, total = histogram(urls, "prefixroute_shared_state_path_seconds",
                                          f'op="{op}"')
        if op != "ratelimit":  # a check's time may overlap the request's own work
            added += total
        p50, p99 = quantile(buckets, count, 0.5), quantile(buckets, count, 0.99)
        out[op] = {"calls": int(count),
                   "p50_us": None if p50 is None else round(p50 * 1e6, 1),
                   "p99_us": None if p99 is None else round(p99 * 1e6, 1)}
    out["added_per_request_mean_us"] = round(added / max(1, requests) * 1e6, 1)
    buckets, count, _ = histogram(urls, "prefixroute_shared_state_remote_lag_seconds")
    lag50, lag99 = quantile(buckets, count, 0.5), quantile(buckets, count, 0.99)
    out["remote_lag_p50_ms"] = None if lag50 is None else round(lag50 * 1e3, 2)
    out["remote_lag_p99_ms"] = None if lag99 is None else round(lag99 * 1e3, 2)
    return out


def metric_sum(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


async def hammer_limit(urls: list[str], key: str, model: str, rate: float,
                       prompt: list[int] | str) -> tuple[int, int, float]:
    """Open loop, 3 x ``rate`` requests a second evenly spaced for LIMIT_SECONDS, taking
    turns over ``urls``: (accepted, sent, seconds). The seconds run from the first send to
    the last answer: every check the gateways made falls inside (a loaded gateway may still
    be checking its backlog after the last send), so ``burst + rate x seconds`` is an upper
    bound of what a correct limit lets through."""
    headers = {"authorization": f"Bearer {key}"}
    interval = 1.0 / (3 * rate)
    async with httpx.AsyncClient(timeout=30) as client:
        async def one(i: int) -> bool:
            response = await client.post(
                f"{urls[i % len(urls)]}/v1/completions", headers=headers,
                json={"model": model, "prompt": prompt, "max_tokens": 1})
            assert response.status_code in (200, 429), response.text
            return response.status_code == 200

        started = time.monotonic()
        tasks = []
        i = 0
        while time.monotonic() - started < LIMIT_SECONDS:
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(max(0.0, started + i * interval - time.monotonic()))
        accepted = sum(await asyncio.gather(*tasks))
        return accepted, len(tasks), time.monotonic() - started


async def round_trip_us(url: str, samples: int = 500) -> float:
    """A plain Redis round trip (PING) from this process: the floor of any check that asks
    Redis on a request's path."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    times = []
    try:
        for _ in range(samples):
            t0 = time.perf_counter()
            await client.ping()
            times.append((time.perf_counter() - t0) * 1e6)
    finally:
        await client.aclose()
    return statistics.median(times)


def replay_config(fleet: LocalFleet, requests: list, headers: dict, args, instances: int,
                  shared_url: str | None, tenant_entries: list, duration: float) -> tuple:
    fleet.reset_replicas()
    extra: dict = {"tenants": tenant_entries}
    if shared_url:
        extra["shared_state"] = {"redis": shared_url,
                                 "namespace": f"bench-{os.urandom(4).hex()}"}
    fleet.start_gateway(POLICY, instances=instances, backend_fields={
        "prefill_s_per_token": PREFILL_S_PER_TOKEN * args.time_scale}, **extra)
    urls = fleet.gateway_urls
    outcomes = asyncio.run(replay(
        [u + "/v1/completions" for u in urls], requests,
        headers_for=lambda r: headers[r.tenant], time_scale=args.time_scale,
        deadline_s=duration + 60.0))
    return urls, summarize(outcomes, time_scale=args.time_scale)


def run(args: argparse.Namespace) -> dict:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not installed: scripts/setup_test_services.sh")

    def scenario(seed: int) -> tuple[list, float]:
        requests = design_requests(args.requests, replicas=args.replicas, model="emulated",
                                   rate_per_replica=RATE_PER_REPLICA,
                                   output_tokens=OUTPUT_TOKENS, seed=seed)
        return requests, (requests[-1].arrival_s - requests[0].arrival_s) * args.time_scale

    requests, duration = scenario(args.seed)
    repeat_seeds = [args.seed + 1 + i for i in range(args.repeats)]
    tenants = sorted({r.tenant for seed in [args.seed, *repeat_seeds]
                      for r in scenario(seed)[0]})
    workdir = Path(tempfile.mkdtemp(prefix="prefixroute-shared-bench-"))
    port = free_port()
    redis_log = open(workdir / "redis.log", "wb")
    redis = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save",
                              "", "--appendonly", "no"], stdout=redis_log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    results: dict = {"scenario": {"requests": len(requests), "replicas": args.replicas,
                                  "time_scale": args.time_scale, "policy": POLICY,
                                  "seed": args.seed, "scenario_limit": SCENARIO_LIMIT,
                                  "rate_limit": {"requests_per_second": LIMIT_RPS,
                                                 "burst": LIMIT_BURST,
                                                 "prompt_tokens_per_second": LIMIT_TPS,
                                                 "prompt_tokens_burst": LIMIT_TOKEN_BURST,
                                                 "prompt_tokens": TOKEN_PROMPT,
                                                 "seconds": LIMIT_SECONDS}},
                     "runs": [], "repeats": []}
    replica_args = ["--time-scale", f"{args.time_scale:g}", "--profile", ENGINE_PROFILE,
                    "--max-model-len", str(MAX_MODEL_LEN)]
    try:
        time.sleep(0.3)
        with LocalFleet(workdir, args.replicas, replica_args,
                        tenants=[*tenants, "limited", "token-limited"]) as fleet:
            fleet.start_replicas()
            tenant_entries = [{"name": t, "api_key_sha256": hash_api_key(k),
                               "rate_limit": dict(SCENARIO_LIMIT)}
                              for t, k in fleet.api_keys.items()]
            for entry in tenant_entries:
                if entry["name"] == "limited":
                    entry["rate_limit"] = {"requests_per_second": LIMIT_RPS,
                                           "burst": LIMIT_BURST}
                elif entry["name"] == "token-limited":
                    entry["rate_limit"] = {"prompt_tokens_per_second": LIMIT_TPS,
                                           "prompt_tokens_burst": LIMIT_TOKEN_BURST}
            headers = {t: {"content-type": "application/json", "authorization": f"Bearer {k}"}
                       for t, k in fleet.api_keys.items()}
            token_prompt = list(range(1000, 1000 + TOKEN_PROMPT))
            for instances, shared in CONFIGS:
                urls, summary = replay_config(fleet, requests, headers, args, instances,
                                              url if shared else None, tenant_entries,
                                              duration)
                load = os.getloadavg()[0]
                ops = sum(metric_sum(u, "prefixroute_shared_state_redis_operations_total")
                          for u in urls)
                limit_ops = sum(value for u in urls for head, value in metric_lines(u)
                                if head == 'prefixroute_shared_state_redis_operations_total'
                                           '{op="ratelimit"}')
                routing = histogram(urls, "prefixroute_gateway_routing_seconds")
                run_result = {
                    "gateways": instances, "shared_state": shared,
                    "token_hit_rate": summary["token_hit_rate"],
                    "ttft_p50_s": summary["ttft_p50_s"], "ttft_p99_s": summary["ttft_p99_s"],
                    "requests_ok": summary["requests_ok"],
                    "requests_failed": summary["requests_failed"],
                    "load_average_1m": round(load, 2),
                    "gateway_time_before_sending_mean_ms": round(
                        routing[2] / max(1.0, routing[1]) * 1e3, 3),
                    "redis_operations_per_request": round(ops / max(1, len(requests)), 2),
                    "rate_limit_redis_operations_per_request": round(
                        limit_ops / max(1, len(requests)), 2)}
                if shared:
                    run_result["shared_state_path"] = path_figures(urls, len(requests))
                ok, sent, seconds = asyncio.run(hammer_limit(
                    urls, fleet.api_keys["limited"], fleet.model, LIMIT_RPS, "hi"))
                allowed = LIMIT_BURST + LIMIT_RPS * seconds
                run_result["rate_limit"] = {
                    "accepted": ok, "sent": sent, "allowed": round(allowed, 1),
                    "accepted_over_allowed": round(ok / allowed, 3)}
                ok, sent, seconds = asyncio.run(hammer_limit(
                    urls, fleet.api_keys["token-limited"], fleet.model,
                    LIMIT_TPS / TOKEN_PROMPT, token_prompt))
                allowed = LIMIT_TOKEN_BURST + LIMIT_TPS * seconds
                run_result["token_limit"] = {
                    "accepted_tokens": ok * TOKEN_PROMPT, "sent_tokens": sent * TOKEN_PROMPT,
                    "allowed_tokens": round(allowed),
                    "accepted_over_allowed": round(ok * TOKEN_PROMPT / allowed, 3)}
                results["runs"].append(run_result)
                print(json.dumps(run_result), file=sys.stderr, flush=True)
                fleet.stop_gateway()
            for seed in repeat_seeds:
                more, more_duration = scenario(seed)
                for instances, shared in ((1, False), (4, True)):
                    urls, summary = replay_config(fleet, more, headers, args, instances,
                                                  url if shared else None, tenant_entries,
                                                  more_duration)
                    row = {"seed": seed, "gateways": instances, "shared_state": shared,
                           "token_hit_rate": summary["token_hit_rate"],
                           "ttft_p50_s": summary["ttft_p50_s"],
                           "ttft_p99_s": summary["ttft_p99_s"],
                           "requests_failed": summary["requests_failed"],
                           "load_average_1m": round(os.getloadavg()[0], 2)}
                    if shared:
                        row["remote_lag_p99_ms"] = path_figures(
                            urls, len(more))["remote_lag_p99_ms"]
                    results["repeats"].append(row)
                    print(json.dumps(row), file=sys.stderr, flush=True)
                    fleet.stop_gateway()
        results["redis_round_trip_us_p50"] = round(asyncio.run(round_trip_us(url)), 1)
        results["load_average_1m_at_end"] = round(os.getloadavg()[0], 2)
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
          f"{'failed':>6} {'redis ops/req':>13} {'req limit':>9} {'token limit':>11} "
          f"{'before send':>11} {'load':>5}")
    for r in results["runs"]:
        print(f"{r['gateways']:>8} {'yes' if r['shared_state'] else 'no':>6} "
              f"{(r['token_hit_rate'] or 0):>8.1%} {r['ttft_p50_s'] or 0:>8.3f}s "
              f"{r['ttft_p99_s'] or 0:>8.3f}s {r['requests_failed']:>6} "
              f"{r['redis_operations_per_request']:>13.2f} "
              f"{r['rate_limit']['accepted_over_allowed']:>9.2f} "
              f"{r['token_limit']['accepted_over_allowed']:>11.2f} "
              f"{r['gateway_time_before_sending_mean_ms']:>9.2f}ms "
              f"{r['load_average_1m']:>5.1f}")
    for r in results["runs"]:
        path = r.get("shared_state_path")
        if path:
            print(f"{r['gateways']} shared: booking p50 {path['booking']['p50_us']} us "
                  f"p99 {path['booking']['p99_us']} us; rate-limit check p50 "
                  f"{path['ratelimit']['p50_us']} us p99 {path['ratelimit']['p99_us']} us, "
                  f"waited for by a request p50 {path['limits_wait']['p50_us']} us p99 "
                  f"{path['limits_wait']['p99_us']} us; "
                  f"added per request (mean) {path['added_per_request_mean_us']} us; "
                  f"remote bookings applied after p50 {path['remote_lag_p50_ms']} ms, "
                  f"p99 {path['remote_lag_p99_ms']} ms")
    for r in results.get("repeats", []):
        print(f"seed {r['seed']}: {r['gateways']} gateway(s), shared "
              f"{'yes' if r['shared_state'] else 'no'}: hit {(r['token_hit_rate'] or 0):.1%} "
              f"TTFT p50 {r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s "
              f"(load {r['load_average_1m']:.1f})")
    print(f"plain Redis round trip from the benchmark process: p50 "
          f"{results['redis_round_trip_us_p50']} us")
    for line in headline(results):
        print(line)


def headline(results: dict) -> list[str]:
    """The targets, each against one instance (the baseline) on its own line: hit rate and
    TTFT p99 of 4 shared instances, rate-limit accuracy, added latency."""
    runs = {(r["gateways"], r["shared_state"]): r for r in results["runs"]}
    one, four = runs.get((1, False)), runs.get((4, True))
    if one is None or four is None:
        return []
    hit4, hit1 = 100 * (four["token_hit_rate"] or 0), 100 * (one["token_hit_rate"] or 0)
    lines = [f"4 shared instances vs 1 instance: token hit {hit4:.1f}% vs {hit1:.1f}% "
             f"({hit4 - hit1:+.1f} points, target within 2); TTFT p99 "
             f"{four['ttft_p99_s']:.3f} s vs {one['ttft_p99_s']:.3f} s "
             f"(x{four['ttft_p99_s'] / one['ttft_p99_s']:.2f}, target <= x1.10)"]
    ratios = [r["ttft_p99_s"] for r in results.get("repeats", [])]
    pairs = list(zip(ratios[0::2], ratios[1::2]))  # (1 instance, 4 shared) per seed
    if pairs:
        lines.append("TTFT p99, 4 shared over 1 instance, per repeat seed: "
                     + ", ".join(f"x{b / a:.2f}" for a, b in pairs) + " (target <= x1.10)")
    lines.append(f"rate limits across 4 instances: requests "
                 f"{four['rate_limit']['accepted_over_allowed']:.2f}, prompt tokens "
                 f"{four['token_limit']['accepted_over_allowed']:.2f} of allowed (target <= 1.05)")
    path = four.get("shared_state_path")
    if path:
        lines.append(f"added latency per request, 4 shared instances: limit checks waited for "
                     f"p50 {path['limits_wait']['p50_us']} us, booking p50 "
                     f"{path['booking']['p50_us']} us (target p50 <= 500 us)")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="more seeds run with 1 instance and 4 shared ones (TTFT noise)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    # A SIGTERM ends the run through its clean-up (Redis, replicas, gateways stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    print_table(results)


if __name__ == "__main__":
    main()
