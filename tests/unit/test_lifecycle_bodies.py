"""The simulator and the gateway are two bodies of one lifecycle runner: the same scripted
life of a fleet (routes, completions, a rejection, a replica restart) through the simulator's
driver and through the gateway's router gives the same decisions and the same policy state.

The simulator's engines produce the script (when each request finishes, how many tokens it
found cached, which one is rejected); the gateway then hears the same events the way it hears
them live: answers with ``usage.prompt_tokens_details.cached_tokens``, a 400, and health
checks that fail twice (the replica restarted) and then pass."""

import asyncio
import random

import httpx
import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.core.replica.service_time import LLAMA3_8B_H100
from prefixroute.core.routing.registry import create_policy
from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import FleetConfig, SimulatedFleet, prepare_workload
from prefixroute.edges.gateway.backends import Backend
from prefixroute.edges.gateway.config import hash_api_key, parse_config
from prefixroute.edges.gateway.metrics import GatewayMetrics
from prefixroute.edges.gateway.prompts import TOKENIZER, PreparedPrompt
from prefixroute.edges.gateway.router import GatewayRouter

BLOCK = 16
REPLICAS = 3
CACHE_BLOCKS = 20  # 320 tokens per replica


def workload():
    """Two prefix families (A: blocks 1-8, B: 101-108) with short tails, and one request
    (r) whose prompt fits the KV (19 blocks) but not with its 100 output tokens: rejected."""
    def req(rid, t, family, tail, output=8):
        ids = list(range(family, family + 8)) + tail
        return Request(rid, t, len(ids) * BLOCK + 5, output, BLOCK, hash_ids=ids + [9_999])

    return prepare_workload([
        req("a1", 0.0, 1, [20]), req("b1", 0.0, 101, [120]), req("a2", 0.0, 1, [21]),
        Request("r", 1.0, 19 * BLOCK, 100, BLOCK, hash_ids=list(range(1, 9))
                + list(range(300, 311))),
        req("a3", 2.0, 1, [22, 23]), req("b2", 2.0, 101, [121]),
        req("a4", 4.0, 1, [24]), req("b3", 4.0, 101, [122]), req("a5", 4.0, 1, [25]),
    ])


# (arrival time, requests arriving then, replica to restart once everything has ended)
SCRIPT = [(0.0, [0, 1, 2], None), (1.0, [3], None), (2.0, [4, 5], "holder of a1"),
          (4.0, [6, 7, 8], None)]


def state(obj, seen=None):
    """Everything an object holds, as nested tuples (a node met before is named by the
    order it was first met: trees point back at their parents); functions are left out."""
    seen = {} if seen is None else seen
    if obj is None or isinstance(obj, (bool, int, float, str, bytes)):
        return obj
    if callable(obj) and not hasattr(obj, "__dict__") and not hasattr(obj, "__slots__"):
        return "<function>"
    if id(obj) in seen:
        return ("<seen>", seen[id(obj)])
    seen[id(obj)] = len(seen)
    if isinstance(obj, random.Random):
        return ("Random", obj.getstate())
    if isinstance(obj, dict):
        return ("dict", tuple((state(k, seen), state(v, seen)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)) or type(obj).__name__ in ("deque", "array"):
        return (type(obj).__name__, tuple(state(v, seen) for v in obj))
    if isinstance(obj, (set, frozenset)):
        return ("set", tuple(sorted(repr(state(v, {})) for v in obj)))
    fields = dict(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(obj, name):
                fields[name] = getattr(obj, name)
    return (type(obj).__name__, tuple((k, state(v, seen)) for k, v in sorted(fields.items())
                                      if not callable(v) or hasattr(v, "__dict__")))


def run_simulator(spec):
    """Drive the simulator's body by hand; returns the decisions, the lifecycle events in
    the order they happened (the script for the gateway) and the policy."""
    work = workload()
    clock = ManualClock(0.0)
    fleet = FleetConfig(REPLICAS, CACHE_BLOCKS, BLOCK, LLAMA3_8B_H100)
    policy = create_policy(spec, seed=0, num_replicas=REPLICAS, block_size=BLOCK)
    body = SimulatedFleet(work, fleet, policy, clock=clock)
    events, decisions = [], []

    def apply(i, engine_events):
        for event in engine_events:
            if event.kind == "finished":
                events.append(("finished", event.request_id, event.time, event.cached_tokens))
            elif event.kind == "rejected":
                events.append(("rejected", event.request_id, event.time))
        body.engine_events(i, engine_events)

    for t, arriving, restart in SCRIPT:
        for k in arriving:
            clock.advance_to(t)
            booking = body.arrive(k, t)
            decisions.append((booking.replica, booking.decision.branch))
            events.append(("route", k, t))
            apply(booking.replica, body.engines[booking.replica].advance(t))
        while True:  # run every engine until it is idle, in time order
            due = [(e.next_event_time(), i) for i, e in enumerate(body.engines)
                   if e.next_event_time() is not None]
            if not due:
                break
            when, i = min(due)
            clock.advance_to(when)
            apply(i, body.engines[i].advance(when))
        if restart:
            holder = int(body.replica_of[0])
            body.restart(holder)
            events.append(("restart", holder, clock.now()))
    return decisions, events, body, policy


def run_gateway(spec, events, monkeypatch):
    """The same events through the gateway's router and backends."""
    monkeypatch.setenv("PR_BODIES_TEST_SECRET", "5e" * 32)
    config = parse_config({
        "server_secret": {"env": "PR_BODIES_TEST_SECRET"},
        "backends": [{"name": f"replica-{i}", "url": f"http://r{i}.test", "models": ["tiny"],
                      "capacity_blocks": CACHE_BLOCKS} for i in range(REPLICAS)],
        "tenants": [{"name": "t", "api_key_sha256": hash_api_key("k")}],
    }, "test.yaml")
    clock = ManualClock(0.0)
    metrics = GatewayMetrics()
    backends = [Backend(i, b, config, clock, metrics) for i, b in enumerate(config.backends)]
    policy = create_policy(spec, seed=0, num_replicas=REPLICAS, block_size=BLOCK)
    router = GatewayRouter(policy, backends, metrics, clock)
    work = workload()
    attempts, decisions = {}, []
    down = httpx.AsyncClient(transport=httpx.MockTransport(lambda r: httpx.Response(503)))
    up = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda r: httpx.Response(200, json={"data": [{"id": "tiny"}]})))
    for event in events:
        clock.advance_to(event[2])
        if event[0] == "route":
            k = event[1]
            request = work.requests[k]
            prompt = PreparedPrompt(request.input_tokens, tuple(work.prompt_keys[k]), None,
                                    TOKENIZER)
            attempt = router.route(request_id=request.request_id, tenant=request.tenant,
                                   model="tiny", prompt=prompt, block_size=BLOCK,
                                   candidates=[b for b in backends if b.available()],
                                   attempt=0, routing_key=request.session)
            attempts[k] = attempt
            decisions.append((attempt.backend.index, attempt.decision.branch))
        elif event[0] == "finished":
            k, cached = event[1], event[3]
            router.succeeded(attempts[k], {
                "prompt_tokens": work.requests[k].input_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}})
        elif event[0] == "rejected":
            router.refused(attempts[event[1]])  # vLLM: 400, the prompt does not fit
        else:  # the replica restarted: health checks fail until it is back
            backend = backends[event[1]]
            for _ in range(config.health.unhealthy_after):
                asyncio.run(backend.check_health(down, 1.0))
            assert not backend.healthy
            asyncio.run(backend.check_health(up, 1.0))
            assert backend.healthy
    return decisions, router, policy


@pytest.mark.parametrize("spec", ["hybrid:max_skew=1", "affinity_only", "sglang_cache_aware",
                                  "aibrix_prefix_cache", "ray_prefix_affinity"])
def test_one_script_gives_the_same_decisions_and_policy_state_in_both_bodies(spec, monkeypatch):
    sim_decisions, events, body, sim_policy = run_simulator(spec)
    kinds = [e[0] for e in events]
    assert kinds.count("route") == 9 and kinds.count("finished") == 8
    assert kinds.count("rejected") == 1 and kinds.count("restart") == 1
    gw_decisions, router, gw_policy = run_gateway(spec, events, monkeypatch)
    assert gw_decisions == sim_decisions
    sim_replicas = body.runner.replicas
    gw_replicas = router.runner.replicas
    assert [(r.in_flight, r.assignments) for r in gw_replicas.values()] == \
        [(r.in_flight, r.assignments) for r in sim_replicas.values()]
    assert sum(r.assignments for r in gw_replicas.values()) == 8  # the rejected one is not
    work = workload()
    for keys in work.prompt_keys:  # what each body's view believes every replica holds
        assert [r.cache.match(keys) for r in gw_replicas.values()] == \
            [r.cache.match(keys) for r in sim_replicas.values()]
    assert state(gw_policy) == state(sim_policy)


def test_the_rejected_request_left_nothing_in_either_view(monkeypatch):
    _, events, body, _ = run_simulator("hybrid:max_skew=1")
    _, router, _ = run_gateway("hybrid:max_skew=1", events, monkeypatch)
    rejected_keys = workload().prompt_keys[3]
    tail = rejected_keys[8:]  # blocks 300-310: only the rejected request had them
    for runner in (body.runner, router.runner):
        assert all(r.cache.match(tail) == 0 for r in runner.replicas.values())
