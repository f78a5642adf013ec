"""Discrete-event fleet simulation: a request stream, replicas, one routing policy.

The pieces stay apart as in Vidur: the workload (:class:`PreparedWorkload`: requests with
their block keys, computed once and shared by every policy), the replica model
(:class:`~prefixroute.core.replica.engine.ReplicaEngine` over a
:class:`~prefixroute.core.caches.paged_pool.PagedBlockPool`), the policy (from the registry,
the same objects the gateway runs), a :class:`~prefixroute.core.clock.ManualClock`, and the
metrics (:mod:`prefixroute.core.simulator.metrics`).

Events, in time order (engine events before arrivals at the same instant, so a router sees a
replica that just finished as free):

* **arrival**: fill each replica's :class:`ReplicaView` with its engine's load (waiting,
  running, KV usage, pending prefill) and route through the
  :class:`~prefixroute.core.routing.lifecycle.LifecycleRunner`, the same runner the gateway
  drives (it keeps the in-flight and assignment counts and books the request into the cache
  view), then submit to the chosen replica's engine;
* **engine events**: first token (TTFT), finish (a completion with the replica's reported
  ``cached_tokens``), rejection (a request larger than the replica's KV: an end without a
  report, the engine not having run it).

Cache views, chosen per run (``view=`` in the policy spec, or the default):
``approximate`` (the router records each request's blocks on the replica it chose, in an LRU
of the replica's size: what it can infer from its own history), ``events`` (the replica
pool's KV events feed the gateway's :class:`LiveEventView`, which also counts the blocks of
requests in flight there) or ``oracle`` (the pool itself).

Routers see each request's prompt block keys; token ids only when the workload was prepared
with ``keep_token_ids`` (a 10,000-token prompt is 40 kB, so by default they are dropped once
hashed), as a gateway that hashes without keeping tokens would.

Every run gets fresh replicas and a fresh policy over the same requests, and nothing depends
on anything but the inputs and the seed, so runs repeat exactly.
"""

from __future__ import annotations

import heapq
import math
from array import array
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from mypy_extensions import mypyc_attr

from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.clock import ManualClock
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.replica.engine import (DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS,
                                             SCHEDULING_POLICIES, ReplicaEngine)
from prefixroute.core.replica.service_time import ServiceTimeModel
from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.lifecycle import Booking, LifecycleRunner
from prefixroute.core.routing.registry import create_policy, parse_spec
from prefixroute.core.routing.views import ApproximateView, EventView, LiveEventView, OracleView
from prefixroute.core.simulator import metrics
from prefixroute.core.simulator.keys import BlockKeyer
from prefixroute.core.simulator.request import Request

VIEWS = ("approximate", "events", "oracle")
DEFAULT_VIEW = "approximate"


# A plain class even when compiled, so that its checks word a wrong value (ConfigError)
# rather than a compiled typed field refusing it first.
@mypyc_attr(native_class=False)
@dataclass
class FleetConfig:
    """The replicas every policy gets: how many, how much KV each, how fast."""

    replicas: int
    cache_blocks: int  # usable KV blocks per replica (the pool adds vLLM's null block)
    block_size: int
    service: ServiceTimeModel
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    scheduling_policy: str = "fcfs"  # vllm serve --scheduling-policy (fcfs or priority)

    def __post_init__(self) -> None:
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ConfigError(f"replicas must be a positive integer, got {self.replicas!r}")
        if not isinstance(self.cache_blocks, int) or self.cache_blocks < 1:
            raise ConfigError(f"cache blocks must be a positive integer, got "
                              f"{self.cache_blocks!r}")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"block size must be a positive integer, got {self.block_size!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling policy must be one of "
                              f"{', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")

    def engine(self, pool: PagedBlockPool, name: str = "") -> ReplicaEngine:
        """One replica's engine over ``pool`` with this fleet's service model and limits."""
        return ReplicaEngine(pool, self.service,
                             max_num_batched_tokens=self.max_num_batched_tokens,
                             max_num_seqs=self.max_num_seqs, name=name,
                             scheduling_policy=self.scheduling_policy)

    def describe(self) -> dict[str, Any]:
        return {"replicas": self.replicas, "cache_blocks": self.cache_blocks,
                "block_size": self.block_size, "cache_tokens": self.cache_blocks * self.block_size,
                "engine_profile": self.service.name,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "max_num_seqs": self.max_num_seqs, "scheduling_policy": self.scheduling_policy}


@dataclass
class PreparedWorkload:
    """Requests in arrival order with their block keys, and the workload's ideal reuse.

    A *closed-loop* workload (``after`` set) sends a session's turn ``gap_s`` seconds after the
    previous turn (request ``after[k]``) completes or is rejected, as a client waiting for each
    reply does; ``arrival_s`` is then the recorded time, used only for the first turns (``after
    -1``) and the order of the request list."""

    requests: list[Request]
    block_size: int
    ideal_cached: array
    info: dict[str, Any] = field(default_factory=dict)
    prompt_keys: list[list] = field(default_factory=list)  # per request, what routers see
    after: array | None = None  # per request: the request whose completion sends it, or -1
    gap_s: array | None = None  # per request: seconds from that completion to its arrival

    def __post_init__(self) -> None:
        if not self.prompt_keys:
            self.prompt_keys = [r.block_keys if len(r.block_keys) == metrics.prompt_blocks(r)
                                else r.block_keys[:metrics.prompt_blocks(r)]
                                for r in self.requests]

    @property
    def closed_loop(self) -> bool:
        return self.after is not None

    @property
    def input_tokens(self) -> int:
        return sum(r.input_tokens for r in self.requests)

    @property
    def ideal_token_hit_rate(self) -> float:
        total = self.input_tokens
        return sum(self.ideal_cached) / total if total else 0.0

    def scaled(self, factor: float) -> "PreparedWorkload":
        """The same workload with every recorded time (arrivals, and a closed loop's gaps)
        multiplied by ``factor``; the requests are copies, the keys shared."""
        if not math.isfinite(factor) or factor < 0:
            raise ConfigError(f"time scale must be a non-negative number, got {factor!r}")
        requests = [replace(r, arrival_s=r.arrival_s * factor) for r in self.requests]
        gaps = None if self.gap_s is None else array("d", [g * factor for g in self.gap_s])
        info = {**self.info, "time_scale": self.info.get("time_scale", 1.0) * factor}
        return PreparedWorkload(requests, self.block_size, self.ideal_cached, info,
                                self.prompt_keys, self.after, gaps)

    def describe(self) -> dict[str, Any]:
        requests = self.requests
        duration = requests[-1].arrival_s - requests[0].arrival_s if requests else 0.0
        out = {**self.info, "requests": len(requests), "block_size": self.block_size,
               "input_tokens": self.input_tokens,
               "output_tokens": sum(r.output_tokens for r in requests),
               "duration_s": round(duration, 6),
               "ideal_reused_tokens": int(sum(self.ideal_cached))}
        if self.closed_loop:
            out["closed_loop"] = True
        return out


# kv-cache-tester's trace replay caps a client's wait between turns at 60 s by default
# (``--max-delay``): a user away for hours is not load.
DEFAULT_MAX_THINK_S = 60.0


def prepare_workload(requests: Iterable[Request], *, block_size: int | None = None,
                     time_scale: float = 1.0, limit: int | None = None,
                     keep_token_ids: bool = False, keyer: BlockKeyer | None = None,
                     info: dict[str, Any] | None = None, closed_loop: bool = False,
                     max_think_s: float = DEFAULT_MAX_THINK_S) -> PreparedWorkload:
    """Compute every request's block keys once, scale arrival times by ``time_scale``
    (below 1 replays faster: more load), check one block size and time order, and the ideal
    reuse. Token ids are dropped afterwards unless ``keep_token_ids`` (they are only needed to
    hash, and a 10,000-token prompt is 40 kB).

    ``closed_loop``: each turn of a session after its first is sent when the previous turn
    (the session's previous request in the list) has completed, after the client's think time
    (:attr:`Request.think_s`, at most ``max_think_s``; without one, the recorded interval
    between the two turns), times ``time_scale``. This is how kv-cache-tester's own trace
    replay sends them (``trace_replay_tester.py``, timing strategy ``think-only``, its
    default): a coding agent waits for each reply. Requests without a session arrive at their
    recorded times."""
    if not math.isfinite(time_scale) or time_scale < 0:
        raise ConfigError(f"time scale must be a non-negative number, got {time_scale!r}")
    if math.isnan(max_think_s) or max_think_s < 0:
        raise ConfigError(f"the longest think time must be a non-negative number of seconds, "
                          f"got {max_think_s!r}")
    keyer = keyer or BlockKeyer()
    out: list[Request] = []
    last = -math.inf
    after = array("l") if closed_loop else None
    gaps = array("d") if closed_loop else None
    previous: dict[str, tuple[int, float]] = {}  # session -> its latest request, recorded at
    for request in requests:
        if limit is not None and len(out) >= limit:
            break
        if block_size is None:
            block_size = request.block_size
        elif request.block_size != block_size:
            raise InputError(f"request {request.request_id!r} has block size "
                             f"{request.block_size}, the workload {block_size}: one simulation "
                             f"needs one block size", where=request.request_id,
                             field="block_size")
        if request.arrival_s < last:
            raise InputError(f"request {request.request_id!r} arrives at {request.arrival_s} "
                             f"s, before the previous request ({last} s)",
                             where=request.request_id, field="arrival_s")
        last = request.arrival_s
        if after is not None and gaps is not None:  # (a closed loop)
            before, recorded = previous.get(request.session, (-1, 0.0)) \
                if request.session is not None else (-1, 0.0)
            think = 0.0
            if before >= 0:
                think = request.think_s if request.think_s is not None \
                    else request.arrival_s - recorded
                think = min(max(0.0, think), max_think_s) * time_scale
            after.append(before)
            gaps.append(think)
            if request.session is not None:
                previous[request.session] = (len(out), request.arrival_s)
        if not request.block_keys:
            keyer.fill(request)
        if not keep_token_ids:
            request.token_ids = None
            request.output_token_ids = None
        if time_scale != 1.0:
            request.arrival_s *= time_scale
        out.append(request)
    if not out or block_size is None:
        raise InputError("the workload has no requests")
    return PreparedWorkload(out, block_size, metrics.ideal_reuse(out), dict(info or {}),
                            after=after, gap_s=gaps)


@dataclass
class PolicyRun:
    """One policy's results: the JSON summary and the raw series the plots need."""

    name: str
    summary: dict[str, Any]
    ttft_s: list[float]
    timeline_t: list[float]
    timeline_in_flight: list[list[int]]
    cached_tokens: list[int] = field(default_factory=list)  # per request, -1 if not completed
    # Per replica, seconds spent in engine steps over the whole run, and up to the run's
    # ``busy_until`` time (``None`` unless asked for; ``ReplicaEngine.busy_seconds_until``).
    busy_s: list[float] = field(default_factory=list)
    busy_until_s: list[float] | None = None
    # Per request, when its last token came (-1 if it did not complete).
    finish_s: list[float] = field(default_factory=list)
    # Per request, when it arrived (a closed loop's turns arrive when the run sends them).
    arrival_s: list[float] = field(default_factory=list)
    # The time up to which ``busy_until_s`` counts (``busy_until``, or the arrival that
    # ``busy_quantile`` names).
    busy_until_at: float | None = None


class ArrivalPlan:
    """When each request of a workload arrives. An open loop's arrivals are its recorded
    times; a closed loop's later turns are ``inf`` until the turn before them ends
    (:meth:`release`). ``pending`` is the heap of (time, request) known so far, earliest
    first, for the runner to pop."""

    __slots__ = ("arrive", "successor", "gap_s", "pending")

    def __init__(self, workload: PreparedWorkload) -> None:
        total = len(workload.requests)
        self.arrive = array("d", [r.arrival_s for r in workload.requests])
        self.successor = array("l", [-1]) * total  # the request each one's end sends
        self.gap_s = workload.gap_s if workload.gap_s is not None else array("d")
        if workload.after is not None:
            for j, before in enumerate(workload.after):
                if before >= 0:
                    self.successor[before] = j
                    self.arrive[j] = math.inf
        self.pending = [(self.arrive[j], j) for j in range(total) if self.arrive[j] < math.inf]
        heapq.heapify(self.pending)

    def release(self, k: int, ended: float, now: float) -> None:
        """Request ``k`` ended at ``ended`` (finished or rejected): its session's next turn is
        sent its gap later, and never before ``now``."""
        j = self.successor[k]
        if j >= 0:
            self.arrive[j] = max(ended + self.gap_s[j], now)
            heapq.heappush(self.pending, (self.arrive[j], j))


def split_view(spec: str, default_view: str = DEFAULT_VIEW) -> tuple[str, str]:
    """``hybrid:max_skew=2,view=oracle`` -> (``hybrid:max_skew=2``, ``oracle``)."""
    name, params = parse_spec(spec)
    view = params.pop("view", default_view)
    if view not in VIEWS:
        raise ConfigError(f"policy {spec!r}: unknown view {view!r}; choose one of "
                          f"{', '.join(VIEWS)}")
    rest = ",".join(f"{k}={v}" for k, v in params.items())
    return (f"{name}:{rest}" if rest else name), view


class SimulatedFleet:
    """The simulator's body: replicas (engines over paged pools), their views, and the
    lifecycle runner that routes onto them. It turns what the engines do into the runner's
    events, as the gateway turns HTTP answers into them:

    * :meth:`arrive`: fill each replica's load from its engine (waiting, running, KV usage,
      pending prefill), route through the runner, submit to the chosen engine;
    * :meth:`engine_events`: a first token is timed; a finish is a completion with the
      engine's ``cached_tokens``; a rejection (a request larger than the replica's KV) is an
      end without a report, the engine not having run it;
    * :meth:`restart`: the replica came back empty (its pool reset, the runner told).

    Per request it keeps arrival, first token, finish, cached tokens and replica for the
    summary; without a ``workload`` (a streamed trace, :mod:`~prefixroute.core.simulator.
    streaming`) it keeps none of that, and the caller records what it needs."""

    def __init__(self, workload: PreparedWorkload | None, fleet: FleetConfig, policy: Any, *,
                 view: str = DEFAULT_VIEW, clock: ManualClock | None = None):
        if view not in VIEWS:
            raise ConfigError(f"unknown view {view!r}; choose one of {', '.join(VIEWS)}")
        self.workload = workload
        self.fleet = fleet
        self.clock = clock or ManualClock(0.0)
        self.runner = LifecycleRunner(policy, keep_scores=False)  # (it logs no decisions)
        self.pools: list[PagedBlockPool] = []
        self.engines: list[ReplicaEngine] = []
        for i in range(fleet.replicas):
            listener = LiveEventView(EventView(), self.clock) if view == "events" else None
            pool = PagedBlockPool(fleet.cache_blocks + 1, fleet.block_size, listener=listener)
            if view == "events":
                cache: Any = listener
            elif view == "oracle":
                cache = OracleView(pool)
            else:
                cache = ApproximateView(capacity_blocks=fleet.cache_blocks)
            self.pools.append(pool)
            self.engines.append(fleet.engine(pool, f"replica-{i}"))
            self.runner.add_replica(ReplicaView(
                index=i, name=f"replica-{i}", capacity_blocks=fleet.cache_blocks, cache=cache,
                prefill_s_per_token=fleet.service.prefill_s_per_token,
                scheduling_policy=fleet.scheduling_policy))
        self.views = [self.runner.replicas[i] for i in range(fleet.replicas)]
        self._readouts: list[tuple | None] = [None] * fleet.replicas  # as last put in views
        self.rejected = 0
        self.predicted_total = 0
        self.bookings: dict[int, Booking] = {}
        if workload is not None:
            self._per_request(len(workload.requests))

    def _per_request(self, total: int) -> None:
        self.first_token = array("d", [-1.0]) * total
        self.finish = array("d", [-1.0]) * total
        self.cached = array("q", [0]) * total
        self.replica_of = array("l", [-1]) * total
        self.timeline_t: list[float] = []
        self.timeline_rows: list[list[int]] = []

    def arrive(self, k: int, now: float) -> Booking:
        """Request ``k`` arrives at ``now`` (the clock is there): route and submit it. The
        engine's events due by ``now`` are returned by the engine's next ``advance``."""
        workload = self.workload
        assert workload is not None  # (a streamed fleet admits instead)
        booking = self.route_and_submit(k, workload.requests[k], workload.prompt_keys[k], now)
        self.replica_of[k] = booking.replica
        self.timeline_t.append(now)
        self.timeline_rows.append([v.in_flight for v in self.views])
        return booking

    def route_and_submit(self, k: int, request: Request, prompt_keys: Sequence,
                         now: float) -> Booking:
        """Fill the replicas' load from their engines, route request ``k`` through the runner
        and submit it to the chosen engine (what every arrival does)."""
        rv = RequestView(request.request_id, request.input_tokens, self.fleet.block_size,
                         block_keys=prompt_keys, token_ids=request.token_ids,
                         tenant=request.tenant, routing_key=request.session, now=now)
        seen = self._readouts
        for i, engine in enumerate(self.engines):
            readout = engine.readout()
            if readout is not seen[i]:  # (an engine that did not move keeps its figures)
                seen[i] = readout
                v = self.views[i]
                v.queued, v.running, v.pending_prefill_tokens, v.kv_usage = readout
        booking = self.runner.route(rv)
        decision = booking.decision
        target = booking.replica
        self.predicted_total += decision.predicted_cached_tokens or 0
        self.bookings[k] = booking
        self.engines[target].submit(k, request.input_tokens, request.output_tokens,
                                    request.block_keys, now, priority=decision.priority or 0)
        return booking

    def engine_events(self, i: int, events: Iterable[Any]) -> list[tuple[int, float]]:
        """Apply replica ``i``'s engine events; returns (request, time) of those that ended
        (finished or rejected), whose sessions may send their next turn."""
        ended = []
        runner = self.runner
        for event in events:
            k = event.request_id
            if event.kind == "first_token":
                self.first_token[k] = event.time
                continue
            booking = self.bookings.pop(k)
            if event.kind == "finished":
                self.finish[k] = event.time
                self.cached[k] = event.cached_tokens
                runner.completed(booking, event.cached_tokens)
            else:  # rejected: the engine never ran it
                self.rejected += 1
                runner.ended(booking, ran=False)
            ended.append((k, event.time))
        return ended

    def restart(self, i: int) -> None:
        """Replica ``i`` restarted with an empty cache. It must hold no request (a restart
        fails those; the simulator has no failed requests), else ConfigError."""
        if self.engines[i].waiting or self.engines[i].running or not self.pools[i].reset():
            raise ConfigError(f"replica {i} has requests: it cannot restart now")
        self.runner.reset_replica(i)

    @property
    def assignments(self) -> list[int]:
        return [v.assignments for v in self.views]


class EngineWakeups:
    """Each engine's next event time, queued once in a heap: :meth:`schedule` after an engine
    changed (a time already queued is not pushed again), :meth:`pop` the earliest entry, or
    None when a later :meth:`schedule` of that engine superseded it. The simulator and its
    streaming variant drive their engines through this one queue."""

    __slots__ = ("engines", "heap", "wake")

    def __init__(self, engines: Sequence) -> None:
        self.engines = engines
        self.heap: list[tuple[float, int]] = []
        self.wake: list[float | None] = [None] * len(engines)

    def schedule(self, i: int) -> None:
        t = self.engines[i].next_event_time()
        wake = self.wake
        if t is None:
            wake[i] = None
        elif t != wake[i]:
            wake[i] = t
            heapq.heappush(self.heap, (t, i))

    def pop(self) -> tuple[float, int] | None:
        t, i = heapq.heappop(self.heap)
        if self.wake[i] != t:
            return None
        self.wake[i] = None
        return t, i

    def fire(self, clock: ManualClock, handle: Callable[[int, list], object]) -> None:
        """Run the earliest queued engine event (nothing if superseded): advance the clock to
        it, step that engine, hand its events to ``handle(i, events)``, queue it again."""
        popped = self.pop()
        if popped is None:
            return
        t, i = popped
        clock.advance_to(t)
        events = self.engines[i].advance(t)
        if events:
            handle(i, events)
        self.schedule(i)


def simulate_policy(workload: PreparedWorkload, fleet: FleetConfig, spec: str, *,
                    view: str = DEFAULT_VIEW, seed: int = 0,
                    progress: Callable[[int, int], object] | None = None,
                    busy_until: float | None = None,
                    busy_quantile: float | None = None) -> PolicyRun:
    """Replay ``workload`` through fresh replicas routed by the policy ``spec``.

    ``busy_until``: also measure each replica's busy seconds up to that time
    (:attr:`PolicyRun.busy_until_s`; replicas start idle, so from the first arrival on). It
    only reads the engines when the first event after it comes, so the run is unchanged.
    ``busy_quantile`` (instead): up to the arrival of that share of the requests (the
    ``ceil(q n)``-th arrival), which in a closed loop depends on the run."""
    if busy_until is not None and busy_quantile is not None:
        raise ConfigError("give busy_until or busy_quantile, not both")
    if busy_quantile is not None and not 0.0 < busy_quantile <= 1.0:
        raise ConfigError(f"busy_quantile must be in (0, 1], got {busy_quantile!r}")
    policy_spec, view = split_view(spec, view)
    if workload.block_size != fleet.block_size:
        raise ConfigError(f"the workload's block size is {workload.block_size}, the fleet's "
                          f"{fleet.block_size}")
    n_replicas = fleet.replicas
    policy = create_policy(policy_spec, seed=seed, num_replicas=n_replicas,
                           block_size=fleet.block_size)
    total = len(workload.requests)

    # Arrivals in time order (ties: list order). An open loop's are the recorded times; a
    # closed loop's later turns join when the turn before them ends.
    plan = ArrivalPlan(workload)
    arrive, arrivals = plan.arrive, plan.pending
    clock = ManualClock(arrivals[0][0] if arrivals else 0.0)
    body = SimulatedFleet(workload, fleet, policy, view=view, clock=clock)
    engines = body.engines
    wakeups = EngineWakeups(engines)
    heap, schedule = wakeups.heap, wakeups.schedule

    def handle(i: int, events) -> None:
        for k, ended in body.engine_events(i, events):
            plan.release(k, ended, clock.now())

    seen = 0
    report_every = max(1, total // 100)
    inf = math.inf
    busy_until_s: list[float] | None = None
    snap_at = inf if busy_until is None else busy_until
    snap_count = max(1, math.ceil(busy_quantile * total)) if busy_quantile is not None else 0
    def snapshot() -> None:
        nonlocal busy_until_s, busy_until, snap_at
        busy_until_s = [e.busy_seconds_until(snap_at) for e in engines]
        busy_until = snap_at
        snap_at = inf

    while arrivals or heap:
        arrival = arrivals[0][0] if arrivals else inf
        if snap_count and seen == snap_count - 1 and arrival < inf and \
                (not heap or heap[0][0] > arrival):
            snap_at = arrival  # the named arrival is next: measure up to it
            snap_count = 0
        if (heap[0][0] if heap and heap[0][0] < arrival else arrival) > snap_at:
            snapshot()  # every event up to busy_until is done: read the engines now
        if heap and heap[0][0] <= arrival:
            wakeups.fire(clock, handle)
            continue
        _, k = heapq.heappop(arrivals)
        clock.advance_to(arrival)
        target = body.arrive(k, arrival).replica
        events = engines[target].advance(arrival)
        if events:
            handle(target, events)
        schedule(target)
        seen += 1
        if progress is not None and seen % report_every == 0:
            progress(seen, total)
    if progress is not None:
        progress(total, total)
    if snap_at < inf:  # nothing happened after busy_until: every step ended by then
        snapshot()

    first_token, finish, cached = body.first_token, body.finish, body.cached
    summary = _summarize(workload, fleet, spec, view, engines, arrive, first_token, finish,
                         cached, body.replica_of, body.assignments, body.rejected,
                         body.predicted_total)
    summary["policy_errors"] = body.runner.policy_errors
    ttfts = [first_token[j] - arrive[j] for j in range(total) if first_token[j] >= 0]
    cached_list = [cached[j] if finish[j] >= 0 else -1 for j in range(total)]
    return PolicyRun(spec, summary, ttfts, body.timeline_t, body.timeline_rows, cached_list,
                     [e.busy_s for e in engines], busy_until_s, finish.tolist(),
                     arrive.tolist(), busy_until if busy_until_s is not None else None)


def _summarize(workload: PreparedWorkload, fleet: FleetConfig, spec: str, view: str,
               engines: Sequence[ReplicaEngine], arrive: array, first_token: array,
               finish: array, cached: array, replica_of: array, assignments: list[int],
               rejected: int, predicted_total: int) -> dict[str, Any]:
    requests = workload.requests
    done = [j for j in range(len(requests)) if finish[j] >= 0]
    input_tokens = sum(requests[j].input_tokens for j in done)
    reused = sum(cached[j] for j in done)
    ideal = sum(workload.ideal_cached[j] for j in done)
    ttft = [first_token[j] - arrive[j] for j in done]
    e2e = [finish[j] - arrive[j] for j in done]
    start = min(arrive) if requests else 0.0
    end = max((finish[j] for j in done), default=start)
    makespan = end - start
    output_tokens = sum(requests[j].output_tokens for j in done)
    summary: dict[str, Any] = {
        "policy": spec,
        "view": view,
        "requests": len(requests),
        "completed": len(done),
        "rejected": rejected,
        "input_tokens": input_tokens,
        "token_hit_rate": round(reused / input_tokens, 6) if input_tokens else 0.0,
        "request_hit_rate": round(sum(1 for j in done if cached[j] > 0) / len(done), 6)
        if done else 0.0,
        "reused_prefix_tokens": reused,
        "fresh_prefill_tokens": input_tokens - reused,
        "ideal_reused_tokens": ideal,
        "recomputed_prefill_tokens": ideal - reused,
        "predicted_reused_tokens": predicted_total,
    }
    summary.update(metrics.summarize_latencies("ttft", ttft))
    summary.update(metrics.summarize_latencies("e2e", e2e))
    summary.update({
        "makespan_s": round(makespan, 6),
        "throughput_rps": round(len(done) / makespan, 6) if makespan > 0 else None,
        "output_tokens_per_s": round(output_tokens / makespan, 3) if makespan > 0 else None,
        "assignments": list(assignments),
        "max_assignment_skew": metrics.max_skew(assignments),
        "utilisation": [round(e.busy_s / makespan, 6) if makespan > 0 else 0.0
                        for e in engines],
        "evictions": sum(e.pool.stats.evicted_blocks for e in engines),
        "evictions_per_replica": [e.pool.stats.evicted_blocks for e in engines],
        "preemptions": sum(e.preemptions for e in engines),
    })
    return summary


def simulate(workload: PreparedWorkload, fleet: FleetConfig, specs: Sequence[str], *,
             view: str = DEFAULT_VIEW, seed: int = 0,
             progress: Callable[[str, int, int], object] | None = None) -> dict[str, Any]:
    """Every policy in ``specs`` over the same workload and fleet: ``runs`` by policy
    spec, and the ``report`` comparing them."""
    runs = {}
    for spec in specs:
        callback = (lambda done, total, _s=spec: progress(_s, done, total)) if progress else None
        runs[spec] = simulate_policy(workload, fleet, spec, view=view, seed=seed,
                                     progress=callback)
    return {"runs": runs, "report": report(workload, fleet, runs, seed=seed)}


def report(workload: PreparedWorkload, fleet: FleetConfig, runs: dict[str, PolicyRun],
           seed: int = 0) -> dict[str, Any]:
    return {
        "workload": workload.describe(),
        "fleet": fleet.describe(),
        "seed": seed,
        "ideal_token_hit_rate": round(workload.ideal_token_hit_rate, 6),
        "policies": {name: run.summary for name, run in runs.items()},
    }
