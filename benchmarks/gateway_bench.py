"""Gateway benchmark: our gateway, sglang-router and vllm-router on the same replicas.

Run: ``python benchmarks/gateway_bench.py`` (about 12 minutes; the first run also installs the
peer routers, see below). ``--json`` prints the results as JSON; ``--out FILE`` writes the
Markdown report (default ``benchmarks/results/gateway.md``); ``--skip-peers`` measures ours
alone; ``--skip-scenario`` skips part 2. The exit code is 0 when our overhead meets the
target (p50 at most 1 ms, p99 at most 5 ms; inside the router when packets were captured,
else the hop overhead) in either of our configurations (it says which), else 1.

Routers under test, each in front of the same emulator replicas (``prefixroute replica``):

``prefixroute``
    ``prefixroute serve`` with its default policy (``prefixroute``), one tenant key;
``prefixroute+busy_poll``
    the same with ``busy_poll_s: 0.1`` (part 1 only): its event loop polls without sleeping
    while requests are open (``edges/gateway/busypoll.py``; HAProxy's ``busy-polling``);
``sglang-router``
    ``sglang-router launch --policy cache_aware`` (PyPI ``sglang-router``);
``vllm-router``
    ``vllm-router --policy cache_aware`` (PyPI ``vllm-router``).

The peers are installed with pip into their own virtual environment,
``~/.cache/prefixroute/peer-routers`` (``--peer-dir``), pinned to the versions below, once.

Part 1, the hop itself. Two replicas and the load generator are pinned to core 0, the router
under test to core 1 (the router's own CPU, as in a deployment); every router is also charged
its own CPU time per request (from /proc), which other load on the machine does not move.

* **overhead with about 200 open streams**: streams arrive open loop (Poisson, 175/s, short
  prompts from 20 shared prefixes, 24 output tokens) and the replicas pace them with engine
  steps of a fixed 50 ms (a profile with every other cost zero), so each lasts about 1.15 s
  and about 200 are open at once while the replicas' core is not saturated. With replicas
  that answer instantly (time model off) 200 concurrent streams exist only in a closed loop,
  where by Little's law the latency difference measures the throughput ratio, not the hop.

  The overhead is measured per request, as the **hop**: the client's TTFT of a request (its
  clock) minus the time the replica spent on it from receiving it to writing its first
  event (the replica's clock; the emulator's opt-in timing records,
  ``PREFIXROUTE_EMULATOR_TIMINGS``, served at ``/debug/timings``, docs/emulator.md). Why:
  a TTFT here is about 87 ms, nearly all of it the wait for the engine step under way
  (0-50 ms) and one step, and that wait varies from request to request and its tail from
  run to run (the no-router TTFT p99 moved between 150 and 350 ms) by far more than a
  router's few milliseconds; it lies inside the replica's interval, so subtracting the
  interval request by request removes it. What is left is the client's send and read, the
  router (if any) both ways, and the time the request and its first event wait in sockets
  and event loops. Each side's interval comes from one process's clock, so the clocks need
  not agree. The join: every request carries a unique tag as the body's ``user`` (all three
  routers forward it; the peers also forward the caller's ``x-request-id``, which the
  client sets too, while our gateway sets its own), and the replicas record it. Overhead
  = a percentile (p50, p99; also the mean) of the router's hops minus the same percentile
  of the hops with no router (the client takes turns between the replicas). Routed and
  direct requests are different requests, so there is no per-request pairing: the
  difference of percentiles is the figure. The former measure, the router's TTFT
  percentile minus the no-router one, is still reported, second, and so is the replicas'
  side (their receive-to-first-event percentiles, which should match with and without the
  router since the load is the same). Not removed: other work on the machine when a
  request passes; the router's core is passed by routed requests only, so the router's
  run-queue wait (ms per s, /proc schedstat) is reported as the sign of such work.

  Both targets are measured *interleaved* in one run: one arrival process whose target alternates every ``BLOCK_S`` (4 s) between no
  router and the router (``--rounds`` such pairs, 10 by default), so both see the same
  replicas and the same background load on the machine, minute by minute. The first
  ``SETTLE_S`` (1.5 s, more than a stream's 1.15 s) of every block are not counted: by then
  the streams of the other target have ended and about 200 streams are open through the
  current one. The percentiles are taken over the pooled counted samples of each target
  (about 4,400 per target with the defaults, so the p99 rests on about 44 samples, not on
  one short run's 17). Why not paired runs, as before: the no-router p99 alone moved between
  120 and 320 ms from one 10 s run to the next (other work on this 2-core machine comes and
  goes), which swamped a p99 difference of a few milliseconds; interleaving at the scale of
  seconds cancels that drift. The report also gives the differences (hop and TTFT) over the
  odd and the even block pairs separately, two independent halves, as a check of their
  stability.
  A router's overhead run uses the same arrival process (seed) as every other router's.
* **inside the router** (the primary measure when packets can be captured: ``tcpdump`` on
  ``lo``, the ``dpkt`` of the ``bench`` extra, root or CAP_NET_RAW; ``--no-capture`` skips
  it): the same overhead run, read from the routed requests' packets, request by request, on
  the kernel's clock: the time from the request's last byte arriving from the client to its
  last byte leaving for the replica, plus the time from the replica's first event arriving to
  it leaving for the client (``wire_timing.py``). That is what the router adds, its wake-ups
  and event loop included, and nothing else: the hop above also holds the client's and the
  replicas' socket and loop waits, which on this machine share one core with the load
  generator and move by milliseconds from run to run (the no-router hop p50 alone went from
  4 to 10 ms between runs), so its difference of percentiles cannot resolve a millisecond.
  The targets are judged on this measure where it exists, on the hop overhead otherwise.
* **throughput**, time model off (``--time-scale 0``): closed loop, 200 clients streaming 16
  tokens, then 128 clients sending non-streaming requests (1 token): completed per second.

The **floors** (part 1 only, when ``haproxy`` is installed, e.g. ``apt-get install
haproxy``; ``--no-floor`` skips them): HAProxy, round robin, one thread, on the router's core,
in two modes. ``http``: it parses every request and response and forwards them in C, with no
policy, tokenization or tenants, what a router that does nothing but be an HTTP hop costs in
that place on this machine. ``tcp``: it only copies bytes between connections (each client
connection tied to one replica), the least any proxy in that place can cost. A target that a
floor itself misses is out of reach for any router there.

Part 2, the design scenario (the simulator's generator, timestamp fixed): four
replicas with the time model on (``llama-3-8b-h100`` at ``--time-scale``), the first
``--requests`` requests replayed open loop through each router, prompts as text (one word per
token: sglang-router refuses token-id prompts and matches characters, so all three get text;
our gateway then routes on character blocks), and through ours once more as token ids (its
exact mode). Reported: token hit rate (``cached_tokens`` / prompt tokens, as the replicas
report them), TTFT p50/p99 in engine seconds.

Part 3, the request shape of ``real_engines.py`` (``--chat-shape``, alone; results in
``results/gateway_chat_shape.md``)::

    python benchmarks/gateway_bench.py --chat-shape --baseline 51da113

On real vLLM replicas our gateway's TTFT trailed the peers' by milliseconds in every row, and
its CPU per request was about twice theirs; on a 2-core machine the gateway's CPU competes with
the engines. This part measures the gateway's own cost on that traffic: real_engines.py's
``tenants`` workload (8 tenants with ~590-token system documents, Zipf-drawn, ~30 fresh user
tokens, streamed chat through the official ``openai`` client, ``max_tokens`` 8, usage in the
last chunk, 4 closed-loop lanes) against two emulator replicas (block size 32, 160 blocks, the
test helpers' tiny tokenizer), through no gateway, through ``prefixroute serve`` configured as
real_engines.py configures it (tokenizer, one trust group and salt per tenant, decision log
kept) and, with ``--baseline GIT_REF``, through the gateway of that commit too, side by side:
each of ``--chat-rounds`` rounds sends one new draw of ``--chat-requests`` requests through
every target in turn (order rotated per round; the replicas' caches emptied before each
block). Reported per target: the gateway's CPU per request (from /proc), the time from a
request's last byte arriving to its last byte leaving for the replica and from the first event
arriving to it leaving for the client (loopback packets, as part 1), TTFT and added TTFT over
no gateway. Each request's tag leads its user message (the packets' join key).

Load generators run in their own process (this file with ``_loadgen``), bounded by a request
count and a deadline; every process is stopped by its id at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import httpx

from prefixroute.core.simulator.generators import design_scenario
from prefixroute.core.simulator.metrics import percentile
from prefixroute.edges.emulator.timings import ENV as TIMINGS_ENV
from prefixroute.edges.listen import free_port
from prefixroute.edges.loadtest.fleet import LocalFleet, ServiceProcess
from prefixroute.edges.http1 import Client
from prefixroute.edges.loadtest.replay import closed_loop, replay, send, summarize
from prefixroute.edges.loadtest.workload import TEXT, TOKEN_IDS, design_requests, to_wire

import wire_timing  # benchmarks/, beside this file

PEER_VERSIONS = {"sglang-router": "sglang-router==0.3.2", "vllm-router": "vllm-router==0.1.17"}
DEFAULT_PEER_DIR = Path.home() / ".cache" / "prefixroute" / "peer-routers"
OVERHEAD_TARGET_P50_MS = 1.0
OVERHEAD_TARGET_P99_MS = 5.0
STREAMS = 200
RPS_CONCURRENCY = 128
# The overhead run: streams of OPEN_TOKENS tokens arrive at OPEN_RATE per second, and the
# replicas pace them with engine steps of a fixed 50 ms whatever the batch (so how a router
# spreads the load cannot change the step time): a stream lasts about 1.15 s, so about 200
# are open at any time, with few enough events that the replicas' core is not saturated.
# TTFT is then the hop plus the wait for the step under way and one step, the same with or
# without a router.
OPEN_RATE = 175.0
OPEN_TOKENS = 24
PACING_PROFILE = {"name": "pacing-50ms", "step_overhead_s": 0.05, "prefill_s_per_token": 0.0,
                  "attention_s_per_token_context": 0.0, "decode_s_per_seq": 0.0,
                  "decode_s_per_context_token": 0.0}
HOP_REPLICAS = 2
SCENARIO_REPLICAS = 4
SCENARIO_RATE_PER_REPLICA = 2.9  # as prefixroute demo (edges/cli/demo.py says why)
SCENARIO_OUTPUT_TOKENS = (8, 32)
MODEL = "emulated"
LOAD_CPU, ROUTER_CPU = 0, 1
BLOCK_S = 4.0  # the overhead run alternates targets every BLOCK_S seconds ...
SETTLE_S = 1.5  # ... and counts a block's requests only from SETTLE_S seconds into it
DEFAULT_BLOCK_PAIRS = 10
TIMINGS_KEPT = 200_000  # per replica: more than one overhead run sends (175/s x 80 s)


# -- peers -----------------------------------------------------------------------------------


def ensure_peers(peer_dir: Path, log: Callable[[str], None]) -> dict[str, Path]:
    """The peer routers' commands, installed with pip into ``peer_dir`` if missing."""
    bin_dir = peer_dir / "bin"
    commands = {name: bin_dir / name for name in PEER_VERSIONS}
    marker = peer_dir / "installed.txt"
    wanted = "\n".join(PEER_VERSIONS.values())
    if all(c.exists() for c in commands.values()) and marker.exists() \
            and marker.read_text() == wanted:
        return commands
    log(f"installing {', '.join(PEER_VERSIONS.values())} into {peer_dir} (once)")
    if not (bin_dir / "pip").exists():
        subprocess.run([sys.executable, "-m", "venv", str(peer_dir)], check=True)
    subprocess.run([str(bin_dir / "pip"), "install", "-q", *PEER_VERSIONS.values()],
                   check=True, timeout=900)
    marker.write_text(wanted)
    return commands


FLOORS = {"haproxy http (floor)": "http", "haproxy tcp (floor)": "tcp"}
# Our gateway's configurations in part 1: the defaults, and busy polling on (off by default:
# it keeps the router's core 100% busy while it serves).
BUSY_POLL_S = 0.1
OURS = {"prefixroute": {}, "prefixroute+busy_poll": {"busy_poll_s": BUSY_POLL_S}}


def haproxy_config(port: int, worker_urls: list[str], mode: str) -> str:
    """HAProxy as a bare hop: round robin, one thread; in ``http`` mode kept-alive connections
    both ways and ``http-no-delay`` (without it HAProxy holds small writes back to merge them,
    MSG_MORE, which added about 130 ms to every stream's first event here)."""
    servers = "\n".join(f"    server r{i} {url.split('://', 1)[1]}"
                         for i, url in enumerate(worker_urls))
    http = ("    option http-no-delay\n    timeout http-keep-alive 75s\n" if mode == "http"
            else "")
    reuse = "    http-reuse always\n" if mode == "http" else ""
    return (f"global\n    nbthread 1\n    maxconn 8000\n"
            f"defaults\n    mode {mode}\n{http}    timeout connect 5s\n"
            f"    timeout client 120s\n    timeout server 120s\n"
            f"frontend bench\n    bind 127.0.0.1:{port}\n    default_backend replicas\n"
            f"backend replicas\n    balance roundrobin\n{reuse}{servers}\n")


def floor_process(name: str, command: Path, worker_urls: list[str], workdir: Path,
                  cpu: int | None) -> ServiceProcess:
    mode = FLOORS[name]
    config = workdir / f"haproxy-{mode}.cfg"

    def build(port: int) -> list[str]:
        config.write_text(haproxy_config(port, worker_urls, mode))
        return [str(command), "-db", "-f", str(config)]  # -db: foreground, no daemon

    return ServiceProcess(name, build, cpu=cpu, log_path=workdir / f"haproxy-{mode}.log")


def peer_process(name: str, command: Path, worker_urls: list[str], workdir: Path,
                 cpu: int | None, policy: str = "cache_aware") -> ServiceProcess:
    """A peer router on a free port with its routing ``policy`` (cache-aware unless told),
    its metrics on another free port."""
    metrics_port = free_port()

    def build(port: int) -> list[str]:
        common = ["--host", "127.0.0.1", "--port", str(port), "--worker-urls", *worker_urls,
                  "--policy", policy, "--prometheus-port", str(metrics_port)]
        if name == "sglang-router":
            return [str(command), "launch", *common, "--log-level", "warn"]
        return [str(command), *common, "--log-level", "warning"]

    return ServiceProcess(name, build, cpu=cpu, log_path=workdir / f"{name}.log")


# -- load generation (in its own process) ----------------------------------------------------


def hop_requests(stream: bool, max_tokens: int, *, count: int = 2000,
                 rate: float | None = None) -> list:
    """Short prompts: the design scenario's shape at small size (20 tenants, 64-token
    prefixes, 16-64 user tokens), as text; Poisson arrivals at ``rate`` per second."""
    per_day = (rate or 1.0) * 86_400
    generated = design_scenario(requests=count, tenants=20, prefix_tokens=64,
                                user_tokens_min=16, user_tokens_max=64,
                                output_tokens_min=max_tokens, output_tokens_max=max_tokens,
                                requests_per_day=per_day, seed=1)
    return to_wire(generated, model=MODEL, prompt_format=TEXT, stream=stream)


def _loadgen_main(spec: dict) -> dict:
    headers = {"content-type": "application/json",
               "authorization": f"Bearer {spec['api_key']}"}
    if spec["mode"] == "closed":
        requests = hop_requests(spec["stream"], spec["max_tokens"])
        outcomes, elapsed = asyncio.run(closed_loop(
            spec["urls"], requests, concurrency=spec["concurrency"],
            headers_for=lambda r: headers, duration_s=spec["seconds"], stream=spec["stream"],
            warmup_s=spec["warmup"], timeout_s=60))
        summary = summarize(outcomes)
        summary["requests_per_second"] = round(summary["requests_ok"] / elapsed, 1)
        return summary
    if spec["mode"] == "open_hop":
        count = int(spec["rate"] * (spec["warmup"] + spec["seconds"]))
        requests = hop_requests(True, spec["max_tokens"], count=count, rate=spec["rate"])
        started = time.perf_counter()
        outcomes = asyncio.run(replay(
            spec["urls"], requests, headers_for=lambda r: headers,
            deadline_s=spec["warmup"] + spec["seconds"] + 60))
        elapsed = time.perf_counter() - started
        warm = int(spec["rate"] * spec["warmup"])
        summary = summarize(outcomes[warm:])
        summary["mean_open_streams"] = round(sum(o.latency_s for o in outcomes) / elapsed, 1)
        summary["requests_per_second"] = round(len(outcomes) / elapsed, 1)
        return summary
    if spec["mode"] == "interleaved":
        return asyncio.run(_interleaved(spec, headers))
    requests = scenario_requests(spec["requests"], spec.get("prompt_format", TEXT))
    outcomes = asyncio.run(replay(
        spec["urls"][0], requests, headers_for=lambda r: headers,
        time_scale=spec["time_scale"], deadline_s=spec["deadline"]))
    return summarize(outcomes, time_scale=spec["time_scale"])


async def _interleaved(spec: dict, headers: dict) -> dict:
    """One open-loop arrival process whose target alternates every ``block`` seconds: no
    router (the replicas in turn) in even blocks, the router in odd ones. Requests that leave
    in the first ``settle`` seconds of a block are sent but not counted."""
    block, settle, pairs = spec["block"], spec["settle"], spec["pairs"]
    count = int(spec["rate"] * block * 2 * pairs)
    # Every request carries a tag of its own, as the body's "user" (forwarded by all three
    # routers) and as x-request-id (which the peers forward, ours replaces): the replicas
    # record it with their timings (PREFIXROUTE_EMULATOR_TIMINGS), to be joined below.
    # Tagging is done before the clock starts.
    run = os.urandom(3).hex()
    requests, tagged = [], []
    for request in hop_requests(True, spec["max_tokens"], count=count, rate=spec["rate"]):
        tag = f"hop-{run}-{request.index}"
        body = json.loads(request.body)
        body["user"] = tag
        requests.append(dataclasses.replace(request, body=json.dumps(body).encode()))
        tagged.append({**headers, "x-request-id": tag})
    replicas = [url.rsplit("/v1/", 1)[0] for url in spec["direct"]]
    async with httpx.AsyncClient(timeout=30) as http:
        for replica in replicas:
            (await http.delete(replica + "/debug/timings")).raise_for_status()
    client = Client(read_timeout=60, max_idle_per_origin=1024)
    first = requests[0].arrival_s
    counted: dict[str, list[list]] = {"direct": [[], []], "router": [[], []]}
    tags: dict[int, str] = {}  # id(outcome) -> tag
    open_seconds = {"direct": 0.0, "router": 0.0}
    served = {"direct": 0, "router": 0}
    direct_turn = 0

    async def one(target: str, url: str, request, half: int | None, tag_headers) -> None:
        outcome = await send(client, url, request, tag_headers, stream=True, timeout_s=60)
        open_seconds[target] += outcome.latency_s
        if half is not None:
            counted[target][half].append(outcome)
            tags[id(outcome)] = tag_headers["x-request-id"]

    tasks = []
    start = time.perf_counter()
    try:
        for request, tag_headers in zip(requests, tagged):
            offset = request.arrival_s - first
            number = int(offset // block)
            target = "router" if number % 2 else "direct"
            if target == "router":
                url = spec["router"]
            else:
                url = spec["direct"][direct_turn % len(spec["direct"])]
                direct_turn += 1
            half = (number // 2) % 2 if offset - number * block >= settle else None
            served[target] += 1
            delay = start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(target, url, request, half, tag_headers)))
        async with asyncio.timeout(60):
            await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await client.aclose()
    # The replicas' records: tag -> nanoseconds from receiving the request to writing its
    # first event (replica clock). hop = client TTFT (client clock) - that.
    inside: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=60) as http:
        for replica in replicas:
            answer = await http.get(replica + "/debug/timings")
            answer.raise_for_status()
            for record in answer.json()["records"]:
                if record["user"]:
                    inside[record["user"]] = record["first_event_ns"] - record["received_ns"]

    def hops(outcomes: list) -> dict:
        values, inner = [], []
        for outcome in outcomes:
            ns = inside.get(tags.get(id(outcome), ""))
            if outcome.ok and outcome.ttft_s is not None and ns is not None:
                values.append(outcome.ttft_s - ns / 1e9)
                inner.append(ns / 1e9)
        return {"hop_p50_s": _pct(values, 50), "hop_p90_s": _pct(values, 90),
                "hop_p99_s": _pct(values, 99), "hop_mean_s": _mean(values),
                "replica_p50_s": _pct(inner, 50), "replica_p99_s": _pct(inner, 99),
                "hop_joined": len(values),
                "hop_unjoined": sum(1 for o in outcomes if o.ok) - len(values)}

    out = {}
    for target, halves in counted.items():
        summary = summarize(halves[0] + halves[1])
        summary.update(hops(halves[0] + halves[1]))
        summary["halves"] = [{**summarize(half), **hops(half)} for half in halves]
        # Streams open through this target, averaged over the time it was the target.
        summary["mean_open_streams"] = round(open_seconds[target] / (block * pairs), 1)
        summary["served"] = served[target]
        # The counted requests' tags, per half, to find them in a packet capture.
        summary["tags"] = [[tags[id(o)] for o in half if o.ok] for half in halves]
        out[target] = summary
    return out


def _pct(values: list[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value, 6)


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 6) if values else None


def scenario_requests(count: int, prompt_format: str = TEXT) -> list:
    return design_requests(count, replicas=SCENARIO_REPLICAS, model=MODEL,
                           prompt_format=prompt_format,
                           rate_per_replica=SCENARIO_RATE_PER_REPLICA,
                           output_tokens=SCENARIO_OUTPUT_TOKENS)


def run_loadgen(spec: dict, cpu: int | None, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "_loadgen", json.dumps(spec)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


# -- the two parts ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def with_cpu(pid: int | None, run: Callable[[], dict]) -> dict:
    """``run()``'s result plus the router's CPU milliseconds per completed request (not
    affected by other load on the machine, unlike latencies)."""
    before = cpu_seconds(pid) if pid else 0.0
    result = run()
    if pid:
        done = result["requests_ok"] + result["requests_failed"]
        result["router_cpu_ms_per_request"] = round(
            1000 * (cpu_seconds(pid) - before) / max(1, done), 3)
    return result


def runqueue_wait_seconds(pid: int) -> float:
    """Time the process's threads spent runnable but waiting for a CPU (schedstat's second
    field), summed over its threads; 0.0 where the kernel does not report it."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def with_cpu_of(pid: int | None, key: str, run: Callable[[], dict]) -> dict:
    """:func:`with_cpu` for a result holding several targets' summaries: the router's CPU
    is charged to ``result[key]``'s requests (counted or not: it served them all). Also the
    router's wait for a CPU (run queue) per second of the run: other work on the router's
    core delays the router, which the interleaving does not cancel (the no-router requests
    do not pass that core)."""
    before = cpu_seconds(pid) if pid else 0.0
    waited = runqueue_wait_seconds(pid) if pid else 0.0
    started = time.perf_counter()
    result = run()
    if pid:
        served = result[key].pop("served", None) or (
            result[key]["requests_ok"] + result[key]["requests_failed"])
        result[key]["router_cpu_ms_per_request"] = round(
            1000 * (cpu_seconds(pid) - before) / max(1, served), 3)
        result[key]["router_runqueue_wait_ms_per_s"] = round(
            1000 * (runqueue_wait_seconds(pid) - waited) / (time.perf_counter() - started), 2)
    return result


def measure_overhead(name: str, direct: list[str], router: str, api_key: str, pairs: int,
                     pin: bool, log: Callable[[str], None], rate: float = OPEN_RATE) -> dict:
    log(f"{name}: open loop, {rate:g} streams/s of {OPEN_TOKENS} tokens, {pairs} x "
        f"({BLOCK_S:g} s no router, {BLOCK_S:g} s through {name})")
    spec = {"direct": direct, "router": router, "api_key": api_key, "mode": "interleaved",
            "rate": rate, "max_tokens": OPEN_TOKENS, "block": BLOCK_S,
            "settle": SETTLE_S, "pairs": pairs}
    return run_loadgen(spec, LOAD_CPU if pin else None, timeout=2 * BLOCK_S * pairs + 180)


def measure_throughput(name: str, urls: list[str], api_key: str, seconds: float, pin: bool,
                       log: Callable[[str], None], pid: int | None) -> dict:
    cpu = LOAD_CPU if pin else None
    base = {"urls": urls, "api_key": api_key, "mode": "closed", "warmup": 2.0,
            "seconds": seconds}
    log(f"{name}: {STREAMS} closed-loop streams for {seconds:g} s")
    streams = with_cpu(pid, lambda: run_loadgen(
        {**base, "stream": True, "max_tokens": 16, "concurrency": STREAMS}, cpu,
        timeout=seconds + 120))
    log(f"{name}: {RPS_CONCURRENCY} clients, non-streaming, for {seconds:g} s")
    rps = with_cpu(pid, lambda: run_loadgen(
        {**base, "stream": False, "max_tokens": 1, "concurrency": RPS_CONCURRENCY}, cpu,
        timeout=seconds + 120))
    return {"closed_streams": streams, "rps": rps}


def measure_scenario(name: str, url: str, api_key: str, requests: int, time_scale: float,
                     log: Callable[[str], None], prompt_format: str = TEXT) -> dict:
    log(f"{name}: design scenario, {requests} requests, prompts as {prompt_format}")
    last = scenario_requests(requests)[-1].arrival_s
    spec = {"urls": [url], "api_key": api_key, "mode": "open", "requests": requests,
            "time_scale": time_scale, "deadline": last * time_scale + 60,
            "prompt_format": prompt_format}
    return run_loadgen(spec, None, timeout=last * time_scale + 180)


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def run_part1(workdir: Path, peers: dict[str, Path], seconds: float, pin: bool,
              log: Callable[[str], None], rounds: int = DEFAULT_BLOCK_PAIRS,
              rate: float = OPEN_RATE, floor: Path | None = None, wire: bool = False) -> dict:
    """Overhead (paced replicas) then throughput (time model off) for every router, and the
    HAProxy floors if ``floor`` is its command. Each router's overhead run interleaves it with
    no router, ``rounds`` block pairs (module docstring), so both see the same background
    load on the machine."""
    cpus = [LOAD_CPU] if pin else None
    router_cpu = ROUTER_CPU if pin else None
    profile = workdir / "pacing-profile.json"
    profile.write_text(json.dumps(PACING_PROFILE))
    names = (*OURS, *peers, *(FLOORS if floor else ()))
    results: dict[str, Any] = {name: {} for name in ("direct", *names)}
    for part, replica_args in (("overhead", ["--profile", str(profile)]),
                               ("throughput", ["--time-scale", "0"])):
        with LocalFleet(workdir / part, HOP_REPLICAS, replica_args, tenants=["bench"],
                        cpus=cpus) as fleet:
            # The overhead run's replicas record per-request timings (the hop measurement);
            # the throughput run's do not (normal serving).
            if part == "overhead":
                os.environ[TIMINGS_ENV] = str(TIMINGS_KEPT)
            try:
                fleet.start_replicas()
            finally:
                os.environ.pop(TIMINGS_ENV, None)
            key = fleet.api_keys["bench"]
            direct = [u + "/v1/completions" for u in fleet.replica_urls]  # client takes turns
            if part == "throughput":
                results["direct"].update(measure_throughput("direct", direct, key, seconds,
                                                            pin, log, None))
            for name in names:
                router = None
                try:
                    if name in OURS:
                        router = fleet.start_gateway("prefixroute", cpu=router_cpu,
                                                     **OURS[name])
                    elif name in FLOORS:
                        router = floor_process(name, floor, fleet.replica_urls,
                                               workdir / part, router_cpu).start()
                    else:
                        router = peer_process(name, peers[name], fleet.replica_urls,
                                              workdir / part, router_cpu).start()
                    urls = [router.url + "/v1/completions"]
                    pid = router.process.pid if router.process else None
                    if part == "overhead":
                        def overhead() -> dict:
                            return with_cpu_of(pid, "router", lambda: measure_overhead(
                                name, direct, urls[0], key, rounds, pin, log, rate))
                        if wire:
                            both, inside = wire_timing.measure(
                                workdir / part / "capture.pcap", _port(router.url),
                                {_port(u) for u in fleet.replica_urls}, LOAD_CPU if pin
                                else None, overhead, lambda r: r["router"]["tags"])
                            results[name]["inside"] = inside
                        else:
                            both = overhead()
                        for target in both.values():
                            target.pop("tags", None)
                        results[name]["overhead"] = both["router"]
                        results[name]["overhead_baseline"] = both["direct"]
                    else:
                        results[name].update(measure_throughput(name, urls, key, seconds,
                                                                pin, log, pid))
                finally:
                    if router is not None:
                        router.stop()
    for name in names:
        row = results[name]
        routed, base = row["overhead"], row["overhead_baseline"]
        results["direct"].setdefault("overhead", base)
        row["overhead_ms"] = {
            key: _ms_diff(routed[field], base[field])
            for key, field in (("hop_p50", "hop_p50_s"), ("hop_p99", "hop_p99_s"),
                               ("hop_mean", "hop_mean_s"),
                               ("ttft_p50", "ttft_p50_s"), ("ttft_p99", "ttft_p99_s"),
                               ("stream_p50", "latency_p50_s"),
                               ("stream_p99", "latency_p99_s"))}
        for key, field in (("hop_p50", "hop_p50_s"), ("hop_p99", "hop_p99_s"),
                           ("ttft_p50", "ttft_p50_s"), ("ttft_p99", "ttft_p99_s")):
            row["overhead_ms"][f"{key}_rounds"] = [
                _ms_diff(r[field], b[field])
                for r, b in zip(routed["halves"], base["halves"])]
    return results


def run_part2(workdir: Path, peers: dict[str, Path], requests: int, time_scale: float,
              log: Callable[[str], None]) -> dict:
    results: dict[str, Any] = {}
    replica_args = ["--time-scale", f"{time_scale:g}", "--profile", "llama-3-8b-h100",
                    "--max-model-len", "16384"]
    with LocalFleet(workdir / "scenario", SCENARIO_REPLICAS, replica_args,
                    tenants=["bench"]) as fleet:
        fleet.start_replicas()
        key = fleet.api_keys["bench"]
        fleet.reset_replicas()
        gateway = fleet.start_gateway("prefixroute", backend_fields={
            "prefill_s_per_token": 4.0e-5 * time_scale})
        results["prefixroute"] = measure_scenario("prefixroute", gateway.url + "/v1/completions",
                                                  key, requests, time_scale, log)
        # The same requests as token ids: the gateway then hashes exactly what the engine
        # hashes instead of routing on character blocks (the peers cannot take token ids).
        fleet.reset_replicas()
        gateway = fleet.start_gateway("prefixroute", backend_fields={  # a fresh view
            "prefill_s_per_token": 4.0e-5 * time_scale})
        results["prefixroute (token-id prompts)"] = measure_scenario(
            "prefixroute", gateway.url + "/v1/completions", key, requests, time_scale, log,
            prompt_format=TOKEN_IDS)
        fleet.stop_gateway()
        for name, command in peers.items():
            fleet.reset_replicas()
            peer = peer_process(name, command, fleet.replica_urls, workdir / "scenario", None)
            try:
                peer.start()
                results[name] = measure_scenario(name, peer.url + "/v1/completions", key,
                                                 requests, time_scale, log)
            finally:
                peer.stop()
    return results


# -- part 3: the real-engines request shape, two versions of our gateway side by side -------

CHAT_SHAPE_OUT = Path(__file__).parent / "results" / "gateway_chat_shape.md"
CHAT_REPLICAS = 2
CHAT_LANES = 4  # real_engines.py: 4 closed-loop lanes, so 4 requests in flight
CHAT_KV_BLOCKS = 160  # real_engines.py's larger KV size
CHAT_BLOCK_SIZE = 32  # real_engines.py (the vLLM CPU backend needs multiples of 32)
CHAT_SNAPLEN = 8192  # a ~2 KB chat body whole: its tag sits in the user message, at the end
CHAT_TIMEOUT_S = 120.0


def baseline_source(ref: str, workdir: Path) -> Path:
    """The ``src`` tree of git ``ref`` of this repository, unpacked under ``workdir``."""
    out = workdir / "baseline"
    out.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parent.parent
    archive = subprocess.run(["git", "-C", str(repo), "archive", ref, "src"],
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(out)], input=archive, check=True)
    return out / "src"


def chat_gateway(name: str, src: Path, fleet: LocalFleet, tokenizer_dir: Path,
                 decisions_kept: int) -> ServiceProcess:
    """``prefixroute serve`` from the package tree ``src``, configured as real_engines.py
    configures it: the engines' tokenizer, 32-token sha256 blocks, one tenant and trust group
    (its own salt) per workload tenant, the decision log kept for the whole run."""
    import yaml

    config = fleet.gateway_config("prefixroute", tokenizer=str(tokenizer_dir),
                                  hashing={"block_size": CHAT_BLOCK_SIZE, "algo": "sha256"},
                                  timeouts={"read_s": CHAT_TIMEOUT_S},
                                  decisions_kept=decisions_kept)
    for tenant in config["tenants"]:
        tenant["trust_group"] = tenant["name"]
    path = fleet.workdir / f"gateway-{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "prefixroute", "serve", "--config", str(path),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]

    return ServiceProcess(f"gateway ({name})", command,
                          env={**os.environ, "PYTHONPATH": str(src)},
                          log_path=fleet.workdir / f"gateway-{name}.log").start()


async def _chat_lanes(urls: list[str], lanes: list[list], api_keys: dict[str, str],
                      tag: str, model: str) -> list[dict]:
    """real_engines.py's client: each lane sends its chat requests one after another with
    the official ``openai`` client (streamed, usage in the last chunk, ``max_tokens`` 8),
    the k-th request of the block to ``urls[k % len(urls)]``. The request's tag leads its
    user message (the packets' join key; the user message is fresh text anyway)."""
    import openai

    from real_engines import MAX_TOKENS  # noqa: PLC0415 - benchmarks/, beside this file

    clients = {(url, tenant): openai.AsyncOpenAI(base_url=url + "/v1", api_key=key,
                                                 max_retries=0, timeout=CHAT_TIMEOUT_S)
               for url in urls for tenant, key in api_keys.items()}
    counter = iter(range(1 << 30))

    async def one(job) -> dict:
        k = next(counter)
        name = f"{tag}-{k}"
        messages = [dict(m) for m in job.messages]
        messages[-1]["content"] = f"{name} {messages[-1]['content']}"
        out: dict[str, Any] = {"tag": name, "ok": False, "ttft_s": None}
        started = time.perf_counter()
        try:
            stream = await clients[(urls[k % len(urls)], job.tenant)].chat.completions.create(
                model=model, messages=messages, max_tokens=MAX_TOKENS, temperature=0.0,
                stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if out["ttft_s"] is None:
                    out["ttft_s"] = time.perf_counter() - started
                if chunk.usage is not None:
                    out["ok"] = chunk.usage.prompt_tokens > 0
        except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
            out["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
        return out

    async def lane(jobs: list) -> list[dict]:
        return [await one(job) for job in jobs]

    try:
        async with asyncio.timeout(600):
            results = await asyncio.gather(*(lane(jobs) for jobs in lanes))
    finally:
        for client in clients.values():
            await client.close()
    return [o for outcomes in results for o in outcomes]


def run_chat_shape(workdir: Path, baseline: str | None, rounds: int, requests: int,
                   time_scale: float, wire: bool, log: Callable[[str], None]) -> dict:
    """real_engines.py's ``tenants`` workload (8 tenants with ~590-token system documents,
    Zipf-drawn, ~30 fresh user tokens, 4 lanes) against two emulator replicas: no gateway
    (the client takes turns between the replicas), our gateway from git ``baseline`` (if
    given) and from this tree, block by block: each round sends one new draw of the workload
    through every target in turn (the order rotated by round), the replicas' caches emptied
    before each block."""
    from prefixroute.edges.tiny_tokenizer import make_tiny_tokenizer
    from prefixroute.edges.tokenization import load_tokenizer

    import real_engines  # benchmarks/, beside this file: the workload, as it is there

    tokenizer_dir = make_tiny_tokenizer(workdir / "tokenizer")
    maker = real_engines.TextMaker(load_tokenizer(tokenizer_dir))
    draws = [real_engines.tenant_workload(maker, seed, requests, CHAT_LANES)
             for seed in range(rounds)]
    here = Path(__file__).resolve().parent.parent / "src"
    sources = {"after": here}
    if baseline is not None:
        sources = {"before": baseline_source(baseline, workdir), **sources}
    targets = ["direct", *sources]
    replica_args = ["--block-size", str(CHAT_BLOCK_SIZE), "--num-blocks", str(CHAT_KV_BLOCKS),
                    "--tokenizer", str(tokenizer_dir), "--time-scale", str(time_scale)]
    samples: dict[str, dict[str, list]] = {
        t: {"ttft": [], "tags": [], "cpu_ms": [], "failed": [], "load": []} for t in targets}
    with LocalFleet(workdir / "chat", CHAT_REPLICAS, replica_args, tenants=draws[0].tenants,
                    model=MODEL) as fleet:
        fleet.start_replicas()
        gateways = {name: chat_gateway(name, src, fleet, tokenizer_dir, requests * rounds + 100)
                    for name, src in sources.items()}
        capture = None
        if wire:
            ports = [_port(g.url) for g in gateways.values()]
            ports += [_port(u) for u in fleet.replica_urls]
            capture = wire_timing.Capture(workdir / "chat.pcap", ports,
                                          snaplen=CHAT_SNAPLEN).start()
        try:
            for r, draw in enumerate(draws):
                order = targets[r % len(targets):] + targets[:r % len(targets)]
                for target in order:
                    fleet.reset_replicas()
                    gateway = gateways.get(target)
                    urls = fleet.replica_urls if gateway is None else [gateway.url]
                    pid = gateway.process.pid if gateway is not None else None
                    load = round(os.getloadavg()[0], 2)
                    before = cpu_seconds(pid) if pid else 0.0
                    outcomes = asyncio.run(_chat_lanes(
                        urls, draw.lanes, fleet.api_keys,
                        f"hop-{r:03x}{targets.index(target):03x}", MODEL))
                    s = samples[target]
                    if pid:
                        s["cpu_ms"].append(1000 * (cpu_seconds(pid) - before) / len(outcomes))
                    ok = [o for o in outcomes if o["ok"]]
                    s["ttft"] += [o["ttft_s"] for o in ok]
                    s["tags"] += [o["tag"] for o in ok]
                    s["failed"].append(len(outcomes) - len(ok))
                    s["load"].append(load)
                    log(f"chat shape round {r + 1}/{rounds} {target}: {len(ok)} ok, TTFT p50 "
                        f"{1000 * (percentile(s['ttft'][-len(ok):], 50) or 0):.1f} ms"
                        + (f", CPU {s['cpu_ms'][-1]:.2f} ms/request" if pid else "")
                        + f", load {load}")
        finally:
            dropped = capture.stop() if capture is not None else -1
        inside = {}
        if capture is not None:
            replica_ports = {_port(u) for u in fleet.replica_urls}
            for name, gateway in gateways.items():
                times = wire_timing.router_times(workdir / "chat.pcap", _port(gateway.url),
                                                 replica_ports)
                inside[name] = wire_timing.summarize(times, [samples[name]["tags"]], dropped)
            os.unlink(workdir / "chat.pcap")
    out: dict[str, Any] = {}
    direct_p50 = percentile(samples["direct"]["ttft"], 50)
    for target in targets:
        s = samples[target]
        row = {"requests_ok": len(s["ttft"]), "failed": sum(s["failed"]),
               "ttft_p50_s": percentile(s["ttft"], 50), "ttft_p99_s": percentile(s["ttft"], 99),
               "load": [min(s["load"]), max(s["load"])]}
        if target != "direct":
            row["added_ttft_p50_s"] = row["ttft_p50_s"] - direct_p50
            row["cpu_ms_per_request"] = s["cpu_ms"]
            row["inside"] = inside.get(target)
        out[target] = row
    return {"targets": out, "baseline": baseline, "rounds": rounds, "requests": requests,
            "time_scale": time_scale}


def chat_shape_markdown(result: dict, meta: dict) -> str:
    targets = result["targets"]
    lines = [
        "# Our gateway's own cost on the real-engines request shape",
        "",
        f"`{meta['command']}` on {meta['machine']}, {meta['date']}.",
        "",
        "real_engines.py's `tenants` workload (8 tenants, each with a ~590-token system "
        "document, Zipf-drawn; ~30 fresh user tokens; streamed chat with the official `openai` "
        "client, `max_tokens` 8, usage in the last chunk; 4 closed-loop lanes) against 2 "
        f"emulator replicas (block size {CHAT_BLOCK_SIZE}, {CHAT_KV_BLOCKS} blocks, the "
        "test helpers' tiny tokenizer and chat template, `llama-3-8b-h100` at time scale "
        f"{result['time_scale']:g}). Our gateway as real_engines.py configures it: policy "
        "`prefixroute`, the tokenizer, one tenant and trust group (salt) per workload tenant, "
        "decision log kept. "
        + (f"`before` is git `{result['baseline']}`, `after` this tree; " if result["baseline"]
           else "") +
        f"{result['rounds']} rounds of {result['requests']} requests: each round one new draw "
        "of the workload through every target in turn (order rotated per round), the "
        "replicas' caches emptied before each block, so all targets see the same requests and "
        "the same machine, minute by minute.",
        "",
        "CPU = the gateway process's user + system time over its blocks / requests (each round "
        "one figure); pre-send = from the request's last byte arriving from the client to its "
        "last byte leaving for the replica, from loopback packets (tcpdump, kernel clock); "
        "first event = from the replica's first event arriving to it leaving for the client; "
        "inside = the two together, request by request: what the gateway adds to a TTFT, "
        "measured where nothing else is in it; added TTFT = the target's client TTFT p50 "
        "minus the direct one's (the direct client takes turns between the replicas and "
        "sends no salts, so its cache hits differ too). Load = 1-minute load average at the "
        "blocks' starts (the machine is shared).",
        "",
        "| target | ok | failed | CPU ms/request (rounds) | pre-send p50 / p99 ms | "
        "first event p50 / p99 ms | inside p50 / p99 ms | TTFT p50 / p99 ms | "
        "added TTFT p50 ms | load |",
        "|---|---:|---:|---|---|---|---|---|---:|---|",
    ]
    for name, row in targets.items():
        inside = row.get("inside") or {}
        cpu = row.get("cpu_ms_per_request")
        cpu_text = "-" if not cpu else (f"{statistics.mean(cpu):.2f} ("
                                        + ", ".join(f"{c:.2f}" for c in cpu) + ")")
        added = row.get("added_ttft_p50_s")
        lines.append(
            f"| {name} | {row['requests_ok']} | {row['failed']} | {cpu_text} | "
            f"{_ms(inside.get('request_p50_s'), 2)} / {_ms(inside.get('request_p99_s'), 2)} | "
            f"{_ms(inside.get('event_p50_s'), 2)} / {_ms(inside.get('event_p99_s'), 2)} | "
            f"{_ms(inside.get('p50_s'), 2)} / {_ms(inside.get('p99_s'), 2)} | "
            f"{_ms(row['ttft_p50_s'])} / {_ms(row['ttft_p99_s'])} | "
            f"{'-' if added is None else f'{1000 * added:+.1f}'} | "
            f"{row['load'][0]:g}-{row['load'][1]:g} |")
    return "\n".join(lines) + "\n"


def haproxy_version(command: str) -> str:
    out = subprocess.run([command, "-v"], capture_output=True, text=True, timeout=10).stdout
    return " ".join(out.split()[:3])  # "HAProxy version 2.6.12-1+deb12u3"


def _ms_diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round((a - b) * 1000, 2)


# -- report ----------------------------------------------------------------------------------


def _ms(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x * 1000:.{digits}f}"


def _rounds(overhead: dict, key: str) -> str:
    """The pooled difference, then the odd and the even block pairs' each."""
    if overhead.get(key) is None:
        return "-"
    each = ", ".join("-" if x is None else f"{x:g}" for x in overhead[f"{key}_rounds"])
    return f"**{overhead[key]:g}** ({each})"


def markdown(result: dict) -> str:
    hop, scenario, meta = result["hop"], result["scenario"], result["meta"]
    rate = meta.get("rate", OPEN_RATE)
    # Little's law: a stream stays about 1.15 s (OPEN_RATE's comment), 200 at 175/s.
    open_streams = f"{rate * 200 / OPEN_RATE:.0f}"
    lines = [
        "# Gateway benchmark",
        "",
        f"`{meta.get('command', 'python benchmarks/gateway_bench.py')}` on {meta['machine']}, "
        f"{meta['date']}. "
        f"Replicas: `prefixroute replica`; ours also with `busy_poll_s: {BUSY_POLL_S:g}` "
        "(`prefixroute+busy_poll`, part 1 only: its event loop polls without sleeping while "
        "requests are open, docs/gateway.md); "
        f"peers {', '.join(meta['peers']) or 'skipped'}"
        + (f"; floors: {meta['floor']}, HTTP and TCP modes, round robin, one thread (part 1 "
           "only). "
           if meta.get("floor") else ". ")
        + f"Load average before the run: {meta.get('load_average_before', '-')} (other work on "
        "the machine moves latencies; the routers' CPU per request it does not).",
        "",
        f"## The hop: overhead with about {open_streams} open streams, and throughput",
        "",
        f"{HOP_REPLICAS} replicas; "
        + ("replicas and load generator on core 0, the router on core 1. "
           if meta["pinned"] else "no CPU pinning. ")
        + f"**Overhead**: streams of {OPEN_TOKENS} tokens arrive (Poisson) at "
        f"{rate:g}/s; the replicas pace them with fixed 50 ms engine steps, so about "
        f"{open_streams} streams are open at any time; the target alternates every "
        f"{BLOCK_S:g} s between no router (the client takes turns between the replicas) and "
        f"the router, {meta['rounds']} such pairs, the first {SETTLE_S:g} s of each block "
        "not counted; percentiles over the pooled counted requests of each target. Target: "
        f"p50 at most {OVERHEAD_TARGET_P50_MS:g} ms, p99 at most {OVERHEAD_TARGET_P99_MS:g} "
        "ms, inside the router where its packets were captured, else on the hop overhead. "
        f"**Throughput**: time model off (`--time-scale 0`), closed loop for "
        f"{meta['seconds']:g} s after 2 s: {STREAMS} clients streaming 16 tokens, and "
        f"{RPS_CONCURRENCY} clients sending non-streaming requests (1 token).",
        "",
    ]
    met = ", ".join(f"`{name}`" for name in configurations_meeting_target(hop))
    lines += [f"**Overhead target met by:** {met or 'neither of our configurations'} (of "
              + ", ".join(f"`{name}`" for name in OURS if name in hop) + ").", ""]
    inside_rows = [(name, row["inside"]) for name, row in hop.items() if row.get("inside")]
    if inside_rows:
        lines += [
            "**Inside the router** (the primary measure, per request, `wire_timing.py`): from "
            "the routed requests' packets on the loopback interface (tcpdump, kernel "
            "timestamps, one clock), the time from the request's last byte arriving from the "
            "client to its last byte leaving for the replica, plus the time from the "
            "replica's first event arriving to it leaving for the client: what the router "
            "adds, wake-ups and event loop included, without the client's and the replicas' "
            "own waits, which the hop below also holds. Target: p50 at most "
            f"{OVERHEAD_TARGET_P50_MS:g} ms, p99 at most {OVERHEAD_TARGET_P99_MS:g} ms (in "
            "brackets: over the odd and the even block pairs alone).",
            "",
            "| router | p50 ms | p90 ms | p99 ms | mean ms | max ms | request leg p50 / p99 "
            "ms | first-event leg p50 / p99 ms | joined (not) | packets dropped |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, w in inside_rows:
            halves = w.get("halves", [])

            def both(key: str) -> str:
                parts = ", ".join(_ms(h[key], 2) for h in halves)
                return f"**{_ms(w[key], 2)}** ({parts})" if parts else _ms(w[key], 2)
            lines.append(
                f"| {name} | {both('p50_s')} | {_ms(w['p90_s'], 2)} | {both('p99_s')} | "
                f"{_ms(w['mean_s'], 2)} | {_ms(w['max_s'], 2)} | {_ms(w['request_p50_s'], 2)} / "
                f"{_ms(w['request_p99_s'], 2)} | {_ms(w['event_p50_s'], 2)} / "
                f"{_ms(w['event_p99_s'], 2)} | {w['joined']} ({w['unjoined']}) | "
                f"{w['dropped_packets']} |")
        lines.append("")
    lines += [
        "**Hop** (end to end, per request): client TTFT minus the time the replica "
        "spent between receiving the request and writing its first event (its own clock, "
        "`PREFIXROUTE_EMULATOR_TIMINGS`), which removes the wait for the engine step. "
        "Overhead = the router's hop percentile minus the same percentile with no router "
        "(in brackets: over the odd and the even block pairs alone). Replica time: the "
        "replica-side interval of the routed requests (no-router in brackets). Joined: "
        "counted requests matched to a replica record (unmatched in brackets). Run-queue "
        "wait: milliseconds per second the router's threads were runnable but had no CPU "
        "(/proc schedstat), a sign of other work on its core, which delays only routed "
        "requests.",
        "",
        "| router | hop p50 / p99 ms (no router) | hop overhead p50 ms | hop overhead p99 ms "
        "| hop overhead mean ms | replica time p50 / p99 ms (no router) | joined | "
        "run-queue wait ms/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, row in hop.items():
        o, base = row.get("overhead"), row.get("overhead_baseline")
        if not o or "hop_p50_s" not in o:
            continue
        d = row.get("overhead_ms", {})
        lines.append(
            f"| {name} | {_ms(o['hop_p50_s'])} / {_ms(o['hop_p99_s'])} "
            + (f"({_ms(base['hop_p50_s'])} / {_ms(base['hop_p99_s'])})" if base else "")
            + f" | {_rounds(d, 'hop_p50')} | {_rounds(d, 'hop_p99')} | "
            f"{d.get('hop_mean', '-')} | {_ms(o['replica_p50_s'])} / {_ms(o['replica_p99_s'])}"
            + (f" ({_ms(base['replica_p50_s'])} / {_ms(base['replica_p99_s'])})" if base
               else "")
            + f" | {o['hop_joined']} ({o['hop_unjoined']}) | "
            f"{o.get('router_runqueue_wait_ms_per_s', '-')} |")
    lines += [
        "",
        "The same runs by the older, secondary measure: overhead = the router's TTFT "
        "percentile minus the no-router one (engine-step wait included, so noisy).",
        "",
        "| router | open streams | TTFT p50 / p99 ms (no router) | TTFT overhead p50 ms | "
        "TTFT overhead p99 ms | router CPU ms per stream | streams/s (200 clients) | "
        "router CPU ms per stream | req/s (128 clients) | router CPU ms per request | "
        "failed |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in hop.items():
        o, c, r = row.get("overhead"), row["closed_streams"], row["rps"]
        base = row.get("overhead_baseline")
        d = row.get("overhead_ms", {})
        failed = c["requests_failed"] + r["requests_failed"] + (o["requests_failed"] if o else 0)
        lines.append(
            f"| {name} | {o['mean_open_streams'] if o else '-'} | "
            + (f"{_ms(o['ttft_p50_s'])} / {_ms(o['ttft_p99_s'])} "
               f"({_ms(base['ttft_p50_s'])} / {_ms(base['ttft_p99_s'])})" if base
               else (f"{_ms(o['ttft_p50_s'])} / {_ms(o['ttft_p99_s'])}" if o else "-"))
            + f" | {_rounds(d, 'ttft_p50')} | {_rounds(d, 'ttft_p99')} | "
            f"{(o or {}).get('router_cpu_ms_per_request', '-')} | "
            f"{c['requests_per_second']} | {c.get('router_cpu_ms_per_request', '-')} | "
            f"{r['requests_per_second']} | {r.get('router_cpu_ms_per_request', '-')} | "
            f"{failed} |")
    lines += [
        "",
        "## The design scenario",
        "",
        f"{SCENARIO_REPLICAS} replicas, `llama-3-8b-h100` time model at time scale "
        f"{meta['time_scale']:g}; the first {meta['requests']} requests of the scenario "
        "(timestamp fixed), open loop, prompts as text (our gateway then routes on character "
        "blocks); our gateway also with the same prompts as token ids. TTFT in engine seconds.",
        "",
        "| router | token hit rate | TTFT p50 s | TTFT p99 s | ok | failed |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in scenario.items():
        rate = row["token_hit_rate"]
        lines.append(f"| {name} | {'-' if rate is None else f'{rate:.1%}'} | "
                     f"{row['ttft_p50_s']} | {row['ttft_p99_s']} | {row['requests_ok']} | "
                     f"{row['requests_failed']} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_loadgen"]:
        print(json.dumps(_loadgen_main(json.loads(argv[1]))))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="measured seconds per closed-loop run (default 10)")
    parser.add_argument("--rate", type=float, default=OPEN_RATE,
                        help=f"streams per second in the overhead run (default {OPEN_RATE:g}: "
                             "about 200 open at once; 10 gives about 11, the unloaded hop)")
    parser.add_argument("--rounds", type=int, default=DEFAULT_BLOCK_PAIRS,
                        help="interleaved (no router, router) block pairs per router in the "
                             f"overhead run (default {DEFAULT_BLOCK_PAIRS})")
    parser.add_argument("--requests", type=int, default=200,
                        help="design-scenario requests per router (default 200)")
    parser.add_argument("--time-scale", type=float, default=0.5,
                        help="engine speed for the design scenario (default 0.5)")
    parser.add_argument("--peer-dir", type=Path, default=DEFAULT_PEER_DIR)
    parser.add_argument("--skip-peers", action="store_true")
    parser.add_argument("--skip-scenario", action="store_true")
    parser.add_argument("--no-pin", action="store_true", help="no CPU pinning in part 1")
    parser.add_argument("--no-floor", action="store_true",
                        help="skip the HAProxy floors in part 1 (skipped anyway without "
                             "haproxy)")
    parser.add_argument("--no-capture", action="store_true",
                        help="do not time the routers from loopback packets (skipped anyway "
                             "without tcpdump, dpkt or the right to capture)")
    parser.add_argument("--chat-shape", action="store_true",
                        help="run part 3 only: real_engines.py's request shape through our "
                             "gateway (and --baseline's), report in "
                             "results/gateway_chat_shape.md")
    parser.add_argument("--baseline", metavar="GIT_REF",
                        help="part 3: also run the gateway of this git commit, side by side")
    parser.add_argument("--chat-rounds", type=int, default=6,
                        help="part 3: rounds (one workload draw through every target each; "
                             "default 6: short blocks follow the machine's load closely)")
    parser.add_argument("--chat-requests", type=int, default=150,
                        help="part 3: requests per round and target (default 150)")
    parser.add_argument("--out", default=None,
                        help="the Markdown report (default results/gateway.md, with "
                             "--chat-shape results/gateway_chat_shape.md)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    def log(message: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    if args.chat_shape:
        return chat_shape_main(args, argv, log)
    if args.out is None:
        args.out = str(Path(__file__).parent / "results" / "gateway.md")

    pin = not args.no_pin and (os.cpu_count() or 1) >= 2
    load_before = round(os.getloadavg()[0], 2)  # other work on the machine moves latencies
    peers = {} if args.skip_peers else ensure_peers(args.peer_dir, log)
    with tempfile.TemporaryDirectory(prefix="prefixroute-bench-") as tmp:
        workdir = Path(tmp)
        haproxy = None if args.no_floor else shutil.which("haproxy")
        if haproxy is None and not args.no_floor:
            log("haproxy is not installed: no floor rows (apt-get install haproxy)")
        wire = None if args.no_capture else wire_timing.unavailable(workdir)
        if wire is not None and not args.no_capture:
            log(f"no packet timing of the routers: {wire}")
        hop = run_part1(workdir, peers, args.seconds, pin, log, args.rounds, args.rate,
                        Path(haproxy) if haproxy else None,
                        wire=wire is None and not args.no_capture)
        scenario = {} if args.skip_scenario else run_part2(
            workdir, peers, args.requests, args.time_scale, log)
    result = {"meta": {"command": " ".join(["python benchmarks/gateway_bench.py", *argv]),
                       "machine": f"{os.cpu_count()} cores, Python "
                                  f"{sys.version.split()[0]}",
                       "load_average_before": load_before,
                       "date": time.strftime("%Y-%m-%d"), "pinned": pin,
                       "seconds": args.seconds, "requests": args.requests,
                       "rounds": args.rounds, "rate": args.rate,
                       "time_scale": args.time_scale,
                       "peers": [PEER_VERSIONS[p] for p in peers],
                       "floor": haproxy_version(haproxy) if haproxy else None},
              "hop": hop, "scenario": scenario}
    report = markdown(result)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(report)
        log(f"wrote {args.out}")
    print(json.dumps(result, indent=2) if args.json else report)
    met = configurations_meeting_target(hop)
    log(f"overhead target met by: {', '.join(met)}" if met
        else "overhead target met by neither of our configurations")
    return 0 if met else 1


def chat_shape_main(args: argparse.Namespace, argv: list[str],
                    log: Callable[[str], None]) -> int:
    """Part 3 alone (``--chat-shape``): run, write the report, print it (or the JSON)."""
    with tempfile.TemporaryDirectory(prefix="prefixroute-bench-") as tmp:
        workdir = Path(tmp)
        wire = None if args.no_capture else wire_timing.unavailable(workdir)
        if wire is not None and not args.no_capture:
            log(f"no packet timing of the gateways: {wire}")
        result = run_chat_shape(workdir, args.baseline, args.chat_rounds, args.chat_requests,
                                args.time_scale, wire is None and not args.no_capture, log)
    meta = {"command": " ".join(["python benchmarks/gateway_bench.py", *argv]),
            "machine": f"{os.cpu_count()} cores, Python {sys.version.split()[0]}",
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["meta"] = meta
    report = chat_shape_markdown(result, meta)
    out = Path(args.out) if args.out else CHAT_SHAPE_OUT
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    log(f"wrote {out}")
    print(json.dumps(result, indent=2) if args.json else report)
    return 0


def configurations_meeting_target(hop: dict) -> list[str]:
    """Which of our configurations (:data:`OURS`) measured in ``hop`` meet the target."""
    return [name for name in OURS if name in hop and overhead_met(hop[name])]


def overhead_met(row: dict) -> bool:
    """Our overhead targets, on the time inside the router when packets were captured, else
    on the hop overhead."""
    inside = row.get("inside")
    if inside and inside.get("p50_s") is not None:
        p50, p99 = 1000 * inside["p50_s"], 1000 * inside["p99_s"]
    else:
        p50, p99 = row.get("overhead_ms", {}).get("hop_p50"), row.get(
            "overhead_ms", {}).get("hop_p99")
    return (p50 is not None and p50 <= OVERHEAD_TARGET_P50_MS and p99 is not None
            and p99 <= OVERHEAD_TARGET_P99_MS)


if __name__ == "__main__":
    sys.exit(main())
