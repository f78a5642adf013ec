"""Several gateway instances, with and without shared state on Redis (one command, bounded).

    PYTHONPATH=src python benchmarks/shared_state.py [--requests 150] [--repeats 3] [--json F]
    PYTHONPATH=src python benchmarks/shared_state.py --experiments 0,1,2,3 [--json F]
    PYTHONPATH=src python benchmarks/shared_state.py --pooled 0,1,2,3,4,5,6,7

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
  time before routing a request (``prefixroute_gateway_routing_seconds``, mean) with shared
  state on and off, and the 1-minute load average;
* how stale the other instances' bookings are when applied (p50/p99);
* Redis operations per request (from the instances' metrics);
* rate-limit accuracy across the instances: one tenant limited to R requests a second and
  another to T prompt tokens a second are each sent three times their limit (open loop,
  evenly spaced) over the instances for a few seconds; accepted / (burst + rate x seconds)
  should be at most 1, the seconds running from the first send to the last answer (without
  shared state each instance lets its own share through: N x).

``--repeats K`` then runs one instance and four shared instances back to back on K more seeds
of the scenario; the TTFT p99 target is judged on all these seeds' requests pooled (one
run's p99 of 150 requests is nearly their maximum), with a 90% bootstrap interval.

``--pooled SEEDS`` runs, instead, 1, 2 and 4 instances with and without shared state on each
seed back to back and pools each configuration's TTFTs over the seeds (a p99 of 150 requests
is nearly their maximum): the p99 ratio to one instance with a 90% bootstrap interval and
the median of the per-seed ratios (robust to a run the machine saturated), and per
configuration the gateways' time before routing, the decisions made blind to a concurrent
remote booking and the remote lag. ``--configs`` picks configurations; ``--compare-src
LABEL=SRC`` (repeatable) makes it an interleaved A/B: each configuration also runs with the
gateways on another version's code (``SRC``, e.g. a checkout's ``src``), the versions back to
back on each seed in an order that turns from seed to seed:

    PYTHONPATH=src python benchmarks/shared_state.py --pooled 0,1,2,3,4,5,6,7 \
        --configs '1 alone,4 shared,1 alone (main),4 shared (main)' \
        --compare-src main=/tmp/main/src

``--beliefs PATH`` (with ``--pooled``) adds, per run, what each deciding instance believed
about every replica's pending prefill (its decisions' scores, ``/debug/decisions``) against
what was pending there (every instance's decisions and the replicas' own arrival and
first-byte times, ``/debug/timings``), and the raw records to PATH.

``--experiments SEEDS`` runs, instead, the controlled comparison behind the TTFT p99 of
several instances (:data:`EXPERIMENTS`: one instance; one with shared state; one active and
three idle, without and with shared state; four shared), back to back per seed, and reports
per run where the time went: the replicas' own TTFT (placement) beside the clients'
(everything outside the engines), CPU and run-queue wait per process group from ``/proc``
(contention), the replicas' ``/health`` round trip (their loops' lag), the gateways' time
before routing and limit-check waits, the remote lag, the decisions made blind to a
concurrent remote booking (herding) and the prefill tokens per replica.

Every process is stopped by its id at the end. Figures and their reading:
benchmarks/results/shared_state.md.
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
import threading
import time
import zlib
from pathlib import Path
from typing import Callable

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


def process_times(pid: int) -> tuple[float, float, int]:
    """(CPU seconds, seconds spent runnable but waiting for a core, times scheduled) of a
    process, summed over its threads (Linux ``/proc/PID/task/*/schedstat``): the wait is the
    CPU contention the process met."""
    cpu = wait = slices = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            fields = (task / "schedstat").read_text().split()
        except OSError:
            continue
        cpu, wait, slices = cpu + int(fields[0]), wait + int(fields[1]), slices + int(fields[2])
    return cpu / 1e9, wait / 1e9, slices


class ProcessProbe:
    """During a replay: per group of processes (replicas, active gateways, idle gateways),
    CPU seconds and run-queue wait from ``/proc``, and each emulator replica's loop lag: a
    ``GET /health`` round trip every PROBE_EVERY_S from a thread (what any request to the
    replica waits for its loop, plus the probe's own scheduling)."""

    PROBE_EVERY_S = 0.05

    def __init__(self, groups: Callable[[], dict[str, list[int]]], replica_urls: list[str]):
        self.groups_of = groups  # called at start: the gateways' pids are known by then
        self.groups: dict[str, list[int]] = {}
        self.replica_urls = replica_urls
        self.before: dict[int, tuple] = {}
        self.result: dict = {}
        self.health_ms: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self.groups = self.groups_of()
        self.before = {pid: process_times(pid) for pids in self.groups.values() for pid in pids}
        self.started = time.monotonic()
        self._stop.clear()
        self._thread = threading.Thread(target=self._probe, daemon=True)
        self._thread.start()

    def _probe(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.is_set():
                for url in self.replica_urls:
                    t0 = time.perf_counter()
                    client.get(url + "/health")
                    self.health_ms.append((time.perf_counter() - t0) * 1e3)
                self._stop.wait(self.PROBE_EVERY_S)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        seconds = time.monotonic() - self.started
        for name, pids in self.groups.items():
            cpu = wait = slices = 0.0
            for pid in pids:
                after = process_times(pid)
                cpu += after[0] - self.before[pid][0]
                wait += after[1] - self.before[pid][1]
                slices += after[2] - self.before[pid][2]
            self.result[name] = {
                "processes": len(pids),
                "cpu_share_per_process": round(cpu / seconds / max(1, len(pids)), 3),
                "runqueue_wait_ms_per_schedule": round(wait / max(1.0, slices) * 1e3, 3)}
        ordered = sorted(self.health_ms)
        if ordered:
            self.result["replica_health_round_trip_ms"] = {
                "p50": round(ordered[len(ordered) // 2], 2),
                "p99": round(ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2)}
        self.result["seconds"] = round(seconds, 2)


# Engine TTFT bounds (wall seconds, vLLM's histogram buckets) above which requests are
# counted: 1 and 2 engine seconds at time scale 0.5, the tail the TTFT p99 comes from.
ENGINE_TAIL_BOUNDS = (0.5, 1.0)


def engine_ttft(replica_urls: list[str]) -> tuple[float, float, dict[float, float]]:
    """The replicas' own time to first token (``vllm:time_to_first_token_seconds``, from
    arrival in the engine to the first token) so far, over the replicas: (sum, count, count
    at most each of ENGINE_TAIL_BOUNDS)."""
    total = count = 0.0
    below = dict.fromkeys(ENGINE_TAIL_BOUNDS, 0.0)
    for url in replica_urls:
        for head, value in metric_lines(url):
            if head.startswith("vllm:time_to_first_token_seconds_sum"):
                total += value
            elif head.startswith("vllm:time_to_first_token_seconds_count"):
                count += value
            elif head.startswith("vllm:time_to_first_token_seconds_bucket"):
                le = head.split('le="', 1)[1].split('"', 1)[0]
                if le != "+Inf" and float(le) in below:
                    below[float(le)] += value
    return total, count, below


def replay_config(fleet: LocalFleet, requests: list, headers: dict, args, instances: int,
                  shared_url: str | None, tenant_entries: list, duration: float,
                  active: int | None = None, probe: "ProcessProbe | None" = None,
                  source: str | None = None) -> tuple:
    """Start ``instances`` gateways and replay ``requests`` over the first ``active`` of them
    (all by default; the others run idle, subscribed to the shared state like the rest).
    ``source``: a ``src`` directory whose code the gateways run instead of this one's (an
    A/B comparison against another version)."""
    fleet.reset_replicas()
    extra: dict = {"tenants": tenant_entries}
    if shared_url:
        extra["shared_state"] = {"redis": shared_url,
                                 "namespace": f"bench-{os.urandom(4).hex()}"}
    # (The gateway processes run the other version's code: its ``src`` first on their path.)
    env = None if source is None else {**os.environ, "PYTHONPATH": source}
    fleet.start_gateway(POLICY, instances=instances, env=env, backend_fields={
        "prefill_s_per_token": PREFILL_S_PER_TOKEN * args.time_scale}, **extra)
    urls = fleet.gateway_urls
    if probe is not None:
        probe.start()
    pick, used = SPREADS[args.spread], active or instances
    outcomes = asyncio.run(replay(
        [u + "/v1/completions" for u in urls[:used]], requests,
        headers_for=lambda r: headers[r.tenant], time_scale=args.time_scale,
        deadline_s=duration + 60.0, pick=pick))
    if probe is not None:
        probe.stop()
    summary = summarize(outcomes, time_scale=args.time_scale)
    ttfts = [o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None]
    summary["ttft_mean_s"] = (round(statistics.fmean(ttfts) / args.time_scale, 4)
                              if ttfts else None)
    summary["ttfts_s"] = ttfts  # wall seconds
    # (By tenant, an instance's share follows its tenants' volume: uneven under Zipf.)
    shares = [0] * used
    for i, request in enumerate(requests):
        shares[(i if pick is None else pick(i, request)) % used] += 1
    summary["requests_per_instance"] = shares
    return urls, summary


# How requests are spread over the instances (``--spread``): taking turns, as a per-request
# round robin in front would; or by tenant, as a load balancer hashing the caller's key would
# (every tenant's requests decided by one instance, which sees its own bookings at once).
SPREADS: dict[str, Callable | None] = {
    "turns": None,
    "tenant": lambda slot, request: zlib.crc32(request.tenant.encode()),
}


# The controlled comparison (--experiments): (name, instances, shared state, active instances).
# "1 active + 3 idle" runs four shared instances but sends every request to the first: the
# others only follow the shared state (bookings, heartbeats) and their own background work.
EXPERIMENTS = [("1", 1, False, 1), ("1 shared", 1, True, 1),
               ("1 active + 3 idle", 4, False, 1), ("1 active + 3 idle shared", 4, True, 1),
               ("4 shared", 4, True, 4)]


def experiment_row(fleet: LocalFleet, more: list, headers: dict, args, name: str,
                   instances: int, shared_url: str | None, active: int, tenant_entries: list,
                   duration: float, seed: int) -> dict:
    """One configuration of the controlled comparison, with where the time went."""
    load_before = os.getloadavg()[0]
    engine_before = engine_ttft(fleet.replica_urls)
    counters_before = fleet.counters()

    def groups() -> dict[str, list[int]]:
        gateways = [g.process.pid for g in [fleet.gateway, *fleet.more_gateways]]
        return {"replicas": [r.process.pid for r in fleet.replicas],
                "active gateways": gateways[:active], "idle gateways": gateways[active:],
                "redis": [args.redis_pid]}

    probe = ProcessProbe(groups, fleet.replica_urls)
    urls, summary = replay_config(fleet, more, headers, args, instances, shared_url,
                                  tenant_entries, duration, active=active, probe=probe)
    engine_after = engine_ttft(fleet.replica_urls)
    # Tokens each replica had to compute (prompt less cached): the placement's balance.
    prefill = [round((a["prompt_tokens"] - a["cached_tokens"])
                     - (b["prompt_tokens"] - b["cached_tokens"]))
               for a, b in zip(fleet.counters(), counters_before)]
    engine_count = engine_after[1] - engine_before[1]
    row = {"seed": seed, "config": name, "gateways": instances, "active": active,
           "shared_state": shared_url is not None,
           "token_hit_rate": summary["token_hit_rate"], "ttft_p50_s": summary["ttft_p50_s"],
           "ttft_p99_s": summary["ttft_p99_s"], "ttft_mean_s": summary["ttft_mean_s"],
           "engine_ttft_mean_s": round((engine_after[0] - engine_before[0])
                                       / max(1.0, engine_count) / args.time_scale, 4),
           # Requests whose engine TTFT (engine seconds) was above 1 s and above 2 s: the
           # placement's share of the tail (queueing in the engines), beside the clients'.
           "engine_ttft_above_s": {
               f"{bound / args.time_scale:g}": int(engine_count - (engine_after[2][bound]
                                                                   - engine_before[2][bound]))
               for bound in ENGINE_TAIL_BOUNDS},
           "client_ttft_above_s": {
               f"{bound / args.time_scale:g}": sum(1 for t in summary["ttfts_s"] if t > bound)
               for bound in ENGINE_TAIL_BOUNDS},
           "prefill_tokens_per_replica": prefill,
           "requests_failed": summary["requests_failed"],
           "load_average_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
           "processes": probe.result}
    routing = histogram(urls, "prefixroute_gateway_routing_seconds")
    row["gateway_time_before_sending_mean_ms"] = round(
        routing[2] / max(1.0, routing[1]) * 1e3, 3)
    if shared_url is not None:
        path = path_figures(urls, len(more))
        row["remote_lag_ms"] = [path["remote_lag_p50_ms"], path["remote_lag_p99_ms"]]
        _, waits, waited = histogram(urls, "prefixroute_shared_state_path_seconds",
                                     'op="limits_wait"')
        row["limits_wait_mean_ms"] = round(waited / max(1.0, waits) * 1e3, 2)
        row["limits_wait_us"] = [path["limits_wait"]["p50_us"], path["limits_wait"]["p99_us"]]
        blind: dict[str, int] = {}
        for u in urls:
            for head, value in metric_lines(u):
                if head.startswith("prefixroute_shared_state_blind_decisions_total{"):
                    branch = head.split('branch="', 1)[1].split('"', 1)[0]
                    blind[branch] = blind.get(branch, 0) + int(value)
        row["blind_decisions_by_branch"] = blind
    fleet.stop_gateway()
    return row


def run_experiments(args: argparse.Namespace, fleet: LocalFleet, headers: dict,
                    tenant_entries: list, url: str, scenario) -> list[dict]:
    rows = []
    for seed in args.experiments:
        more, duration = scenario(seed)
        for name, instances, shared, active in EXPERIMENTS:
            row = experiment_row(fleet, more, headers, args, name, instances,
                                 url if shared else None, active, tenant_entries, duration,
                                 seed)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


# --beliefs: what the deciding instances believed against what was true (diagnostic).
TIMINGS_ENV = "PREFIXROUTE_EMULATOR_TIMINGS"
BELIEFS_ADMIN = "beliefs-admin"  # a tenant that may read every tenant's decisions


def collect_beliefs(fleet: LocalFleet, urls: list[str], seed: int, name: str,
                    args) -> tuple[list, dict]:
    """Every instance's decisions (``/debug/decisions``) and the replicas' own per-request
    arrival and first-event times (``/debug/timings``, emptied for the next run); the raw
    records are kept for ``--beliefs PATH``."""
    headers = {"authorization": f"Bearer {fleet.api_keys[BELIEFS_ADMIN]}"}
    decisions = []
    for i, u in enumerate(urls):
        answer = httpx.get(u + "/debug/decisions?n=100000", headers=headers, timeout=30).json()
        for d in answer["decisions"]:
            d["instance"] = i
            decisions.append(d)
    timings = {}
    for r, u in enumerate(fleet.replica_urls):
        for t in httpx.get(u + "/debug/timings", timeout=30).json()["records"]:
            timings[t["request_id"]] = (r, t["received_ns"] / 1e9, t["first_event_ns"] / 1e9)
        httpx.delete(u + "/debug/timings", timeout=30)
    args.beliefs_raw.append({"seed": seed, "config": name, "decisions": decisions,
                             "timings": {k: list(v) for k, v in timings.items()}})
    return decisions, timings


def belief_figures(decisions: list[dict], timings: dict) -> dict:
    """Per decision and candidate replica: the prefill the deciding instance believed
    pending there (``wait_s / s_per_token``, token-equivalents) against the uncached tokens
    truly pending there at that moment: requests routed there before it (by any instance,
    ``fleet``; by the deciding one, ``own``) whose first token the replica had not yet
    written. And the placement: the chosen replica's true pending less the least truly
    pending candidate's (``regret``, tokens)."""
    names = {}
    sent = []  # (replica index, decided at, first token at, uncached, instance)
    for d in decisions:
        t = timings.get(d["request_id"])
        if t is None or d.get("reported_cached_tokens") is None:
            continue
        for c in d["candidates"]:
            names[c["replica"]] = c["index"]
        sent.append((names[d["replica"]], d["time"], t[2], d["num_tokens"]
                     - d["reported_cached_tokens"], d["instance"], d["request_id"]))
    believed, fleet_true, own_true, regrets, cold_regrets = [], [], [], [], []
    over = under = 0
    for d in decisions:
        now, inst, rid = d["time"], d["instance"], d["request_id"]
        pend = {}
        for c in d["candidates"]:
            s = c["scores"]
            if "wait_s" not in s:
                continue
            r = c["index"]
            fleet = sum(u for rr, at, first, u, _, other in sent
                        if rr == r and at < now and first > now and other != rid)
            own = sum(u for rr, at, first, u, i, other in sent
                      if rr == r and at < now and first > now and i == inst and other != rid)
            b = s["wait_s"] / s["s_per_token"]
            believed.append(b)
            fleet_true.append(fleet)
            own_true.append(own)
            over += b > fleet + 2000
            under += b < fleet - 2000
            pend[c["replica"]] = fleet
        if pend and d["replica"] in pend:
            regret = pend[d["replica"]] - min(pend.values())
            regrets.append(regret)
            if d["branch"] in ("cold_spread", "cold_balance"):
                cold_regrets.append(regret)
    n = max(1, len(believed))

    def mean(values):
        return round(statistics.fmean(values), 1) if values else None

    return {"pairs": len(believed), "believed_mean": mean(believed),
            "true_fleet_mean": mean(fleet_true), "true_own_mean": mean(own_true),
            "believed_over_true_by_2k": round(over / n, 3),
            "believed_under_true_by_2k": round(under / n, 3),
            "mean_abs_error_vs_fleet": mean([abs(b - f) for b, f in zip(believed, fleet_true)]),
            "mean_abs_error_vs_own": mean([abs(b - o) for b, o in zip(believed, own_true)]),
            "regret_mean": mean(regrets),
            "regret_share_over_5k": round(sum(r > 5000 for r in regrets)
                                          / max(1, len(regrets)), 3),
            "cold_regret_mean": mean(cold_regrets), "cold_decisions": len(cold_regrets)}


# --pooled: every configuration of the table, on each seed back to back (shared machine
# conditions), without the rate-limit runs; TTFTs pooled over the seeds per configuration.
POOLED_CONFIGS = CONFIGS
BOOTSTRAP_DRAWS = 2000


def config_name(instances: int, shared: bool) -> str:
    return f"{instances} {'shared' if shared else 'alone'}"


def pooled_p99_ratio(base: dict[int, list[float]], other: dict[int, list[float]],
                     seed: int = 0) -> tuple[float, float, float]:
    """p99 of ``other``'s TTFTs over ``base``'s, each pooled over the seeds, with a 90%
    bootstrap interval (requests resampled within each seed, both configurations, so the
    interval reflects the tail's sampling noise and not the mix of seeds)."""
    import random

    from prefixroute.edges.loadtest.replay import percentile

    def pooled(runs: dict[int, list[float]]) -> list[float]:
        return [t for values in runs.values() for t in values]

    ratio = percentile(pooled(other), 99) / percentile(pooled(base), 99)
    rng = random.Random(seed)
    draws = []
    for _ in range(BOOTSTRAP_DRAWS):
        a = [t for v in base.values() for t in rng.choices(v, k=len(v))]
        b = [t for v in other.values() for t in rng.choices(v, k=len(v))]
        draws.append(percentile(b, 99) / percentile(a, 99))
    draws.sort()
    return ratio, draws[int(0.05 * len(draws))], draws[int(0.95 * len(draws)) - 1]


def run_pooled(args: argparse.Namespace, fleet: LocalFleet, headers: dict,
               tenant_entries: list, url: str, scenario) -> dict:
    """Each of POOLED_CONFIGS on every seed of ``args.pooled``; per configuration the
    token hit rate and TTFT p50/p99 over all seeds' requests, and each configuration's p99
    over one instance's with its bootstrap interval."""
    ttfts: dict[str, dict[int, list[float]]] = {}
    tokens: dict[str, list[int]] = {}
    failed: dict[str, int] = {}
    rows = []
    sides: list[tuple[str, str | None]] = [("", None)]
    sides += [(f" ({label})", source) for label, source in args.compare_src]
    for turn, seed in enumerate(args.pooled):
        more, duration = scenario(seed)
        # A/B: the versions of each configuration back to back, in an order that turns by
        # seed (the machine's load drifts; no version always runs first or last).
        shift = turn % len(sides)
        order = sides[shift:] + sides[:shift]
        runs = [(c, suffix, source) for c in POOLED_CONFIGS for suffix, source in order
                if not args.configs or config_name(*c) + suffix in args.configs]
        for (instances, shared), suffix, source in runs:
            name = config_name(instances, shared) + suffix
            load_before = os.getloadavg()[0]
            urls, summary = replay_config(fleet, more, headers, args, instances,
                                          url if shared else None, tenant_entries, duration,
                                          source=source)
            row = {"seed": seed, "config": name, "gateways": instances,
                   "shared_state": shared, "token_hit_rate": summary["token_hit_rate"],
                   "ttft_p50_s": summary["ttft_p50_s"], "ttft_p99_s": summary["ttft_p99_s"],
                   "requests_failed": summary["requests_failed"],
                   "load_average_1m": round(os.getloadavg()[0], 2),
                   "load_average_1m_before": round(load_before, 2),
                   "requests_per_instance": summary["requests_per_instance"]}
            routing = histogram(urls, "prefixroute_gateway_routing_seconds")
            row["gateway_time_before_sending_mean_ms"] = round(
                routing[2] / max(1.0, routing[1]) * 1e3, 3)
            if shared:
                path = path_figures(urls, len(more))
                row["remote_lag_ms"] = [path["remote_lag_p50_ms"], path["remote_lag_p99_ms"]]
                row["booking_us"] = [path["booking"]["p50_us"], path["booking"]["p99_us"]]
                row["decisions_by_branch"] = {}
                for u in urls:
                    for head, value in metric_lines(u):
                        if head.startswith("prefixroute_shared_state_blind_decisions_total{"):
                            branch = head.split('branch="', 1)[1].split('"', 1)[0]
                            row.setdefault("blind_decisions_by_branch", {})
                            row["blind_decisions_by_branch"][branch] = (
                                row["blind_decisions_by_branch"].get(branch, 0) + int(value))
                        elif head.startswith("prefixroute_gateway_decisions_total{"):
                            branch = head.split('branch="', 1)[1].split('"', 1)[0]
                            row["decisions_by_branch"][branch] = (
                                row["decisions_by_branch"].get(branch, 0) + int(value))
            if args.beliefs:
                row["beliefs"] = belief_figures(*collect_beliefs(fleet, urls, seed, name, args))
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
            ttfts.setdefault(name, {})[seed] = [t / args.time_scale
                                                for t in summary["ttfts_s"]]
            failed[name] = failed.get(name, 0) + summary["requests_failed"]
            pair = tokens.setdefault(name, [0, 0])
            pair[0] += summary["cached_tokens"]
            pair[1] += summary["prompt_tokens"]
            fleet.stop_gateway()
    from prefixroute.edges.loadtest.replay import percentile

    pooled = {}
    for name, runs in ttfts.items():
        values = [t for v in runs.values() for t in v]
        pooled[name] = {"requests": len(values), "failed": failed[name],
                        "token_hit_rate": round(tokens[name][0] / max(1, tokens[name][1]), 4),
                        "ttft_p50_s": round(percentile(values, 50), 4),
                        "ttft_p99_s": round(percentile(values, 99), 4)}
        # Each version against its own single instance if it ran one, else this one's.
        suffix = name[name.index(" ("):] if " (" in name else ""
        one = "1 alone" + suffix if "1 alone" + suffix in ttfts else "1 alone"
        if name != one and one in ttfts:
            ratio, low, high = pooled_p99_ratio(ttfts[one], runs)
            pooled[name]["p99_over_1"] = [round(ratio, 3), round(low, 3), round(high, 3)]
            # Per seed (each against the single instance run just before it): the median is
            # robust to a run the machine's other work saturated.
            per_seed = [percentile(v, 99) / percentile(ttfts[one][seed], 99)
                        for seed, v in runs.items()]
            pooled[name]["p99_over_1_per_seed"] = [round(r, 3) for r in per_seed]
            pooled[name]["p99_over_1_median"] = round(statistics.median(per_seed), 3)
    return {"runs": rows, "pooled": pooled}


def run(args: argparse.Namespace) -> dict:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        sys.exit("redis-server is not installed: scripts/setup_test_services.sh")

    if args.beliefs:  # the replicas keep per-request arrival and first-token times
        os.environ[TIMINGS_ENV] = "5000"
        args.beliefs_raw = []

    def scenario(seed: int) -> tuple[list, float]:
        requests = design_requests(args.requests, replicas=args.replicas, model="emulated",
                                   rate_per_replica=RATE_PER_REPLICA,
                                   output_tokens=OUTPUT_TOKENS, seed=seed)
        return requests, (requests[-1].arrival_s - requests[0].arrival_s) * args.time_scale

    requests, duration = scenario(args.seed)
    repeat_seeds = [args.seed + 1 + i for i in range(args.repeats)]
    tenants = sorted({r.tenant for seed in [args.seed, *repeat_seeds, *args.experiments,
                                            *args.pooled]
                      for r in scenario(seed)[0]})
    workdir = Path(tempfile.mkdtemp(prefix="prefixroute-shared-bench-"))
    port = free_port()
    redis_log = open(workdir / "redis.log", "wb")
    redis = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save",
                              "", "--appendonly", "no"], stdout=redis_log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    url = f"redis://127.0.0.1:{port}/0"
    args.redis_pid = redis.pid
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
                        tenants=[*tenants, "limited", "token-limited", BELIEFS_ADMIN]
                        ) as fleet:
            fleet.start_replicas()
            tenant_entries = [{"name": t, "api_key_sha256": hash_api_key(k),
                               "rate_limit": dict(SCENARIO_LIMIT)}
                              for t, k in fleet.api_keys.items()]
            for entry in tenant_entries:
                if entry["name"] == "limited":
                    entry["rate_limit"] = {"requests_per_second": LIMIT_RPS,
                                           "burst": LIMIT_BURST}
                elif entry["name"] == BELIEFS_ADMIN:
                    entry["admin"] = True
                elif entry["name"] == "token-limited":
                    entry["rate_limit"] = {"prompt_tokens_per_second": LIMIT_TPS,
                                           "prompt_tokens_burst": LIMIT_TOKEN_BURST}
            headers = {t: {"content-type": "application/json", "authorization": f"Bearer {k}"}
                       for t, k in fleet.api_keys.items()}
            token_prompt = list(range(1000, 1000 + TOKEN_PROMPT))
            if args.pooled:
                results["pooled"] = run_pooled(args, fleet, headers, tenant_entries, url,
                                               scenario)
                if args.beliefs:
                    Path(args.beliefs).write_text(json.dumps(args.beliefs_raw))
                return results
            if args.experiments:
                results["experiments"] = run_experiments(args, fleet, headers, tenant_entries,
                                                         url, scenario)
                return results
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
                        limit_ops / max(1, len(requests)), 2),
                    "ttfts_s": [t / args.time_scale for t in summary["ttfts_s"]]}
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
                           "load_average_1m": round(os.getloadavg()[0], 2),
                           "ttfts_s": [t / args.time_scale for t in summary["ttfts_s"]]}
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
          f"{'pre-route':>11} {'load':>5}")
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


def print_experiments(rows: list[dict]) -> None:
    print("controlled comparison: TTFT in engine seconds; engine TTFT = the replicas' own "
          "(arrival in the engine to first token); CPU = share of a core per process; "
          "wait = run-queue wait per scheduling")
    for r in rows:
        procs = r["processes"]
        parts = [f"{name} cpu {g['cpu_share_per_process']:.2f} wait "
                 f"{g['runqueue_wait_ms_per_schedule']:.2f}ms"
                 for name, g in procs.items() if isinstance(g, dict) and g.get("processes")]
        health = procs.get("replica_health_round_trip_ms", {})
        print(f"seed {r['seed']} {r['config']:>24}: hit {(r['token_hit_rate'] or 0):.1%} "
              f"TTFT p50 {r['ttft_p50_s']:.3f} p99 {r['ttft_p99_s']:.3f} mean "
              f"{r['ttft_mean_s']:.3f} (engine {r['engine_ttft_mean_s']:.3f}) s; above 1 / 2 s: "
              f"{'/'.join(map(str, r['client_ttft_above_s'].values()))} (engine "
              f"{'/'.join(map(str, r['engine_ttft_above_s'].values()))}); "
              f"before routing {r['gateway_time_before_sending_mean_ms']:.1f} ms; "
              f"replica /health p50 {health.get('p50')} p99 {health.get('p99')} ms; "
              + "; ".join(parts)
              + (f"; limit checks waited for mean {r['limits_wait_mean_ms']} ms; remote lag "
                 f"{r['remote_lag_ms']} ms, blind decisions {r['blind_decisions_by_branch']}"
                 if "remote_lag_ms" in r else "")
              + f"; load {r['load_average_1m']}")
    by_config: dict[str, list[float]] = {}
    for r in rows:
        by_config.setdefault(r["config"], []).append(r["ttft_p99_s"])
    base = by_config.get(EXPERIMENTS[0][0])
    for name, values in by_config.items():
        ratios = (", ".join(f"x{v / b:.2f}" for v, b in zip(values, base)) if base else "")
        print(f"{name:>24}: TTFT p99 per seed {', '.join(f'{v:.3f}' for v in values)} s "
              f"(over 1 instance: {ratios})")


def print_pooled(pooled: dict, args) -> None:
    print(f"pooled over seeds {','.join(map(str, args.pooled))} ({len(args.pooled)} x "
          f"{args.requests} requests a configuration; TTFT in engine seconds)")
    for name, p in pooled["pooled"].items():
        ratio = p.get("p99_over_1")
        print(f"{name:>22}: hit {p['token_hit_rate']:.1%} TTFT p50 {p['ttft_p50_s']:.3f} "
              f"p99 {p['ttft_p99_s']:.3f} s ({p['requests']} requests, {p['failed']} failed)"
              + (f"; p99 over 1 instance x{ratio[0]:.2f} (90% interval "
                 f"{ratio[1]:.2f}-{ratio[2]:.2f}); per seed median "
                 f"x{p['p99_over_1_median']:.2f}" if ratio else ""))
    by_config: dict[str, list[dict]] = {}
    for r in pooled["runs"]:
        by_config.setdefault(r["config"], []).append(r)
    for name, runs in by_config.items():
        before = statistics.median(r["gateway_time_before_sending_mean_ms"] for r in runs)
        line = f"{name:>22}: time before routing {before:.2f} ms (mean, median of the runs)"
        if len(runs[0]["requests_per_instance"]) > 1:
            line += f"; requests per instance {[r['requests_per_instance'] for r in runs]}"
        if runs[0]["shared_state"]:
            blind = [sum(r.get("blind_decisions_by_branch", {}).values()) for r in runs]
            lag = [r["remote_lag_ms"] for r in runs]
            line += (f"; blind decisions per run {blind} (mean {statistics.fmean(blind):.1f}); "
                     f"remote lag p50 {[x[0] for x in lag]} ms, p99 {[x[1] for x in lag]} ms")
            p50s = [r["booking_us"][0] for r in runs if r["booking_us"][0] is not None]
            if p50s:
                line += (f"; booking event p50 {statistics.median(p50s):.0f} us (runs "
                         f"{min(p50s):.0f}-{max(p50s):.0f})")
        print(line)
    loads = [r["load_average_1m"] for r in pooled["runs"]]
    print(f"1-minute load average during the runs: {min(loads):.1f} to {max(loads):.1f}")


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
             f"(x{four['ttft_p99_s'] / one['ttft_p99_s']:.2f}, one run)"]
    repeats = results.get("repeats", [])
    ratios = [r["ttft_p99_s"] for r in repeats]
    pairs = list(zip(ratios[0::2], ratios[1::2]))  # (1 instance, 4 shared) per seed
    if pairs:
        lines.append("TTFT p99, 4 shared over 1 instance, per repeat seed: "
                     + ", ".join(f"x{b / a:.2f}" for a, b in pairs))
    if "ttfts_s" in one and "ttfts_s" in four:
        # One run's p99 of 150 requests is nearly their maximum: the target is judged on
        # every seed's requests pooled (the first run's seed and the repeats).
        base = {results["scenario"]["seed"]: one["ttfts_s"]}
        other = {results["scenario"]["seed"]: four["ttfts_s"]}
        for r in repeats:
            (other if r["shared_state"] else base)[r["seed"]] = r["ttfts_s"]
        ratio, low, high = pooled_p99_ratio(base, other)
        lines.append(f"TTFT p99, 4 shared over 1 instance, {len(base)} seed(s) pooled: "
                     f"x{ratio:.2f} (90% interval {low:.2f}-{high:.2f}, target <= x1.10)")
    lines.append(f"rate limits across 4 instances: requests "
                 f"{four['rate_limit']['accepted_over_allowed']:.2f}, prompt tokens "
                 f"{four['token_limit']['accepted_over_allowed']:.2f} of allowed (target <= 1.05)")
    path = four.get("shared_state_path")
    if path:
        lines.append(f"added latency per request, 4 shared instances: limit checks waited for "
                     f"p50 {path['limits_wait']['p50_us']} us, booking p50 "
                     f"{path['booking']['p50_us']} us (target p50 <= 500 us)")
    return lines


def check_configs(args: argparse.Namespace) -> None:
    """Every --configs name is a --pooled configuration of a version run (exit 2 if not,
    before anything starts); --configs and --compare-src go with --pooled, and each version's
    label is new and fits in a --configs name."""
    if (args.configs or args.compare_src or args.beliefs) and not args.pooled:
        print("--configs, --compare-src and --beliefs go with the --pooled runs: add --pooled "
              "SEEDS", file=sys.stderr)
        sys.exit(2)
    labels = [label for label, _ in args.compare_src]
    bad = [label for label in labels
           if labels.count(label) > 1 or any(c in label for c in ",()")]
    if bad:
        print(f"--compare-src: label {bad[0]!r} is repeated or holds ',', '(' or ')'",
              file=sys.stderr)
        sys.exit(2)
    suffixes = [""] + [f" ({label})" for label, _ in args.compare_src]
    known = {config_name(*c) + suffix for c in POOLED_CONFIGS for suffix in suffixes}
    unknown = [name for name in args.configs if name not in known]
    if unknown:
        print(f"--configs: no configuration named {', '.join(map(repr, unknown))}; known: "
              f"{', '.join(sorted(known))}", file=sys.stderr)
        sys.exit(2)


def label_and_source(text: str) -> tuple[str, str]:
    """``main=/tmp/main/src`` as ``("main", "/tmp/main/src")`` (a --compare-src version)."""
    label, sep, source = text.partition("=")
    if not sep or not label or not Path(source, "prefixroute").is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: expected LABEL=SRC, SRC a directory "
                                         "holding the prefixroute package")
    return label, source


def seed_list(text: str) -> list[int]:
    """``0,1,2`` as ``[0, 1, 2]`` (the --experiments and --pooled seeds)."""
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=150)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=3,
                        help="more seeds run with 1 instance and 4 shared ones (TTFT noise)")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--experiments", metavar="SEEDS", default="",
                        type=seed_list,
                        help="instead of the table: the controlled comparison (1 instance; 1 "
                             "with shared state; 1 active and 3 idle, without and with shared "
                             "state; 4 shared) on these seeds, e.g. 0,1,2,3, with the engines' "
                             "own TTFT, per-process CPU and run-queue wait, the replicas' loop "
                             "lag and blind decisions")
    parser.add_argument("--spread", choices=sorted(SPREADS), default="turns",
                        help="how requests are spread over several instances: taking turns "
                             "(default) or by tenant (a load balancer with key affinity; an "
                             "instance's share then follows its tenants' volume)")
    parser.add_argument("--configs", metavar="NAMES", default="",
                        type=lambda text: [x.strip() for x in text.split(",") if x.strip()],
                        help="with --pooled: only these configurations, e.g. '1 alone,4 "
                             "shared,1 alone (main),4 shared (main)' (default: all of 1, 2 "
                             "and 4 instances alone and shared, on every version)")
    parser.add_argument("--compare-src", metavar="LABEL=SRC", action="append", default=[],
                        type=label_and_source,
                        help="with --pooled, repeatable: run the configurations also with the "
                             "gateways on the code in SRC (another version's src directory), "
                             "reported as '... (LABEL)', the versions back to back on each "
                             "seed; each against its own single instance if it ran one")
    parser.add_argument("--beliefs", metavar="PATH", default="",
                        help="with --pooled: per run, what each deciding instance believed "
                             "about every replica's pending prefill (its decisions' scores) "
                             "against what was pending there (every instance's decisions "
                             "and the replicas' own arrival and first-token times); raw "
                             "records to PATH")
    parser.add_argument("--pooled", metavar="SEEDS", default="",
                        type=seed_list,
                        help="instead of the table: 1, 2 and 4 instances with and without "
                             "shared state on each of these seeds back to back (no rate-limit "
                             "runs), TTFT p50/p99 pooled over the seeds' requests per "
                             "configuration and the p99 ratio to 1 instance with a 90%% "
                             "bootstrap interval, e.g. 0,1,2,3,4,5,6,7")
    args = parser.parse_args()
    check_configs(args)
    # A SIGTERM ends the run through its clean-up (Redis, replicas, gateways stopped).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    results = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.pooled:
        print_pooled(results["pooled"], args)
    elif args.experiments:
        print_experiments(results["experiments"])
    else:
        print_table(results)


if __name__ == "__main__":
    main()
