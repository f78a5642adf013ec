"""A streamed simulation: traces too long to hold, replayed in memory bounded by live state.

:func:`simulate_stream` takes requests as an iterator in arrival order (a trace reader or a
generator), computes each one's block keys as it arrives, routes it through the same body as
:func:`~prefixroute.core.simulator.simulation.simulate_policy` (:class:`SimulatedFleet`: the
lifecycle runner, the policy, the replica engines) and forgets it when it ends. What stays in
memory: the replicas (caches, queues), the policy's state, the requests in flight, and the
metrics below.

Metrics, and what each costs:

* counts and sums (completed, rejected, input / reused / output tokens, requests with a hit,
  per-replica assignments, busy time, evictions, preemptions): constant;
* TTFT and end-to-end latency **percentiles are exact**: each completed request adds two
  8-byte floats (``array('d')``), 16 MB per million requests, well inside a bounded budget
  (a sketch such as t-digest would save that and lose exactness, so we keep the values);
* no per-request records otherwise (no timeline, no per-request cached tokens), and no
  ``ideal`` reuse: an infinite cache's reuse needs every block ever seen, which grows with
  the trace.

Only open-loop arrivals (each request at its recorded time): a closed loop needs the whole
session graph up front (:class:`~prefixroute.core.simulator.simulation.ArrivalPlan`).
"""

from __future__ import annotations

import math
from array import array
from typing import Any, Callable, Iterable, Iterator

from prefixroute.core.clock import ManualClock
from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.routing.registry import create_policy
from prefixroute.core.simulator import metrics
from prefixroute.core.simulator.keys import BlockKeyer
from prefixroute.core.simulator.request import Request
from prefixroute.core.simulator.simulation import (DEFAULT_VIEW, EngineWakeups, FleetConfig,
                                                   SimulatedFleet, split_view)


class StreamingFleet(SimulatedFleet):
    """:class:`SimulatedFleet` that holds a request only while it lives and folds what it
    measured into running totals as it ends."""

    def __init__(self, fleet: FleetConfig, policy: Any, *, view: str = DEFAULT_VIEW,
                 clock: ManualClock | None = None):
        super().__init__(None, fleet, policy, view=view, clock=clock)
        self.live: dict[int, tuple[Request, float, float]] = {}  # k -> request, arrival, ttft
        self.completed = 0
        self.input_tokens = self.reused = self.output_tokens = self.request_hits = 0
        self.ttft_s = array("d")
        self.e2e_s = array("d")
        self.first_arrival = math.inf
        self.last_finish = -math.inf

    def admit(self, k: int, request: Request, now: float):
        self.live[k] = (request, now, -1.0)
        self.first_arrival = min(self.first_arrival, now)
        return self.route_and_submit(k, request, request.block_keys[:metrics.prompt_blocks(
            request)], now)

    def engine_events(self, i: int, events: Iterable[Any]) -> list[tuple[int, float]]:
        runner = self.runner
        for event in events:
            k = event.request_id
            request, arrived, first = self.live[k]
            if event.kind == "first_token":
                self.live[k] = (request, arrived, event.time)
                continue
            del self.live[k]
            booking = self.bookings.pop(k)
            if event.kind == "finished":
                cached = event.cached_tokens
                runner.completed(booking, cached)
                self.completed += 1
                self.input_tokens += request.input_tokens
                self.output_tokens += request.output_tokens
                self.reused += cached
                self.request_hits += cached > 0
                self.ttft_s.append(first - arrived)
                self.e2e_s.append(event.time - arrived)
                self.last_finish = max(self.last_finish, event.time)
            else:
                self.rejected += 1
                runner.ended(booking, ran=False)
        return []

    def summary(self, spec: str, view: str, requests: int) -> dict[str, Any]:
        done, input_tokens = self.completed, self.input_tokens
        makespan = max(0.0, self.last_finish - self.first_arrival) if done else 0.0
        assignments = self.assignments
        out: dict[str, Any] = {
            "policy": spec, "view": view, "requests": requests, "completed": done,
            "rejected": self.rejected, "input_tokens": input_tokens,
            "token_hit_rate": round(self.reused / input_tokens, 6) if input_tokens else 0.0,
            "request_hit_rate": round(self.request_hits / done, 6) if done else 0.0,
            "reused_prefix_tokens": self.reused,
            "fresh_prefill_tokens": input_tokens - self.reused,
            "predicted_reused_tokens": self.predicted_total,
        }
        out.update(metrics.summarize_latencies("ttft", self.ttft_s))
        out.update(metrics.summarize_latencies("e2e", self.e2e_s))
        out.update({
            "makespan_s": round(makespan, 6),
            "throughput_rps": round(done / makespan, 6) if makespan > 0 else None,
            "output_tokens_per_s": round(self.output_tokens / makespan, 3)
            if makespan > 0 else None,
            "assignments": list(assignments),
            "max_assignment_skew": metrics.max_skew(assignments),
            "utilisation": [round(e.busy_s / makespan, 6) if makespan > 0 else 0.0
                            for e in self.engines],
            "evictions": sum(e.pool.stats.evicted_blocks for e in self.engines),
            "preemptions": sum(e.preemptions for e in self.engines),
            "policy_errors": self.runner.policy_errors,
        })
        return out


def _keyed(requests: Iterable[Request], block_size: int, keyer: BlockKeyer,
           time_scale: float) -> Iterator[Request]:
    """Requests with their keys, token ids dropped, times scaled and checked in order."""
    last = -math.inf
    for request in requests:
        if request.block_size != block_size:
            raise InputError(f"request {request.request_id!r} has block size "
                             f"{request.block_size}, the fleet {block_size}",
                             where=request.request_id, field="block_size")
        if request.arrival_s < last:
            raise InputError(f"request {request.request_id!r} arrives at {request.arrival_s} "
                             f"s, before the previous request ({last} s)",
                             where=request.request_id, field="arrival_s")
        last = request.arrival_s
        if not request.block_keys:
            keyer.fill(request)
        request.token_ids = request.output_token_ids = request.hash_ids = None
        if time_scale != 1.0:
            request.arrival_s *= time_scale
        yield request


def simulate_stream(requests: Iterable[Request], fleet: FleetConfig, spec: str, *,
                    view: str = DEFAULT_VIEW, seed: int = 0, time_scale: float = 1.0,
                    progress: Callable[[int], object] | None = None,
                    progress_every: int = 1000) -> dict[str, Any]:
    """Replay ``requests`` (arrival order, any length) through fresh replicas routed by
    ``spec``; returns the summary (module doc for its fields). ``progress(n)`` is called
    with the number of requests that have arrived, every ``progress_every`` of them."""
    if not math.isfinite(time_scale) or time_scale < 0:
        raise ConfigError(f"time scale must be a non-negative number, got {time_scale!r}")
    policy_spec, view = split_view(spec, view)
    policy = create_policy(policy_spec, seed=seed, num_replicas=fleet.replicas,
                           block_size=fleet.block_size)
    stream = _keyed(requests, fleet.block_size, BlockKeyer(), time_scale)
    clock = ManualClock(0.0)
    body = StreamingFleet(fleet, policy, view=view, clock=clock)
    engines = body.engines
    wakeups = EngineWakeups(engines)
    heap, schedule = wakeups.heap, wakeups.schedule

    inf = math.inf
    pending = next(stream, None)
    if pending is None:
        raise InputError("the workload has no requests")
    clock.advance_to(pending.arrival_s)
    seen = 0
    while pending is not None or heap:
        arrival = pending.arrival_s if pending is not None else inf
        if heap and heap[0][0] <= arrival:  # engine events first at the same instant
            wakeups.fire(clock, body.engine_events)
            continue
        assert pending is not None  # (with none left, every event sorts first)
        clock.advance_to(arrival)
        target = body.admit(seen, pending, arrival).replica
        events = engines[target].advance(arrival)
        if events:
            body.engine_events(target, events)
        schedule(target)
        seen += 1
        if progress is not None and seen % progress_every == 0:
            progress(seen)
        pending = next(stream, None)
    if progress is not None:
        progress(seen)
    return body.summary(spec, view, seen)
