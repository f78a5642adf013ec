"""Routing live requests through the same lifecycle runner and policy objects the simulator
runs.

For each attempt the router builds one :class:`RequestView` (the prompt's salted block keys),
refreshes each candidate's :class:`ReplicaView` with the load its backend measured
(:mod:`prefixroute.edges.gateway.backends`), and asks the
:class:`~prefixroute.core.routing.lifecycle.LifecycleRunner` to route and book it; it keeps the
decision (candidates, scores, branch, reason) for ``/debug/decisions``. What the replica
answers becomes the runner's events: a usage with ``cached_tokens`` a completion (and the
predicted-versus-reported metrics), anything else an end without a report, with whether the
engine ran it.

The policy never learns it runs live: everything it sees is in the two views.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from prefixroute.core.caches.base import cacheable_blocks
from prefixroute.core.clock import Clock
from prefixroute.core.routing.base import Decision, RequestView
from prefixroute.core.routing.lifecycle import Booking, LifecycleRunner
from prefixroute.edges.gateway.backends import Backend
from prefixroute.edges.gateway.metrics import GatewayMetrics
from prefixroute.edges.gateway.prompts import CHARS, PreparedPrompt

log = logging.getLogger("prefixroute.gateway")
_NO_HEADERS: dict[str, str] = {}  # shared, never written


def predicted_cached_tokens(num_tokens: int, matched_blocks: int, block_size: int) -> int:
    """Tokens a replica holding ``matched_blocks`` leading blocks will report as cached: the
    engine recomputes a fully cached prompt's last token, so at most ``floor((n - 1) / B) * B``
    (vLLM computes the last token's logits, so it never serves that token from cache)."""
    return min(matched_blocks, cacheable_blocks(num_tokens, block_size)) * block_size


def cached_in_routing_units(cached: int, prompt_tokens: int | None, estimated_tokens: int,
                            block_size: int) -> int:
    """A character-block prompt's reported ``cached_tokens`` in the units its routing used.

    Character-block routing counts ``len(text) / CHARS_PER_TOKEN`` estimated tokens and
    ``block_size`` of them per block, while the engine reports real tokens. Fed back as they
    are, a prompt of 6 characters per token (1.5 estimated tokens per real one) reads as a
    third of its blocks evicted on every hit, and the policy forgets prefixes the replica
    still holds (design scenario through the gateway: 54% token hit rate, against 66% with
    feedback off). The usage's ``prompt_tokens`` gives this prompt's exact scale. Engine
    blocks and character blocks do not line up, so a hit is credited up to the end of the
    engine block after the last cached one (a shortfall of less than one engine block is not
    taken as an eviction), and a prompt cached as far as the engine ever reports (all but
    the last token's block) counts as wholly cached.
    """
    if cached <= 0 or not prompt_tokens or prompt_tokens <= 0 or estimated_tokens <= 0:
        return max(0, cached)
    if cached >= cacheable_blocks(prompt_tokens, block_size) * block_size:
        return estimated_tokens
    scale = estimated_tokens / prompt_tokens
    return min(estimated_tokens, int((cached + block_size) * scale))


@dataclass(slots=True)
class DecisionRecord:
    """One routing decision as ``/debug/decisions`` shows it."""

    request_id: str
    tenant: str
    model: str
    attempt: int
    time: float
    policy: str
    replica: str
    branch: str
    reason: str
    num_tokens: int
    full_blocks: int
    tokenization: str
    predicted_cached_tokens: int
    candidates: list[tuple]  # (backend, in_flight, queued, running, kv_usage, assignments)
    scores: Mapping[int, dict[str, Any]]
    reported_cached_tokens: int | None = None
    outcome: str = "pending"
    priority: int | None = None  # sent to the replica (its scheduling policy is priority)

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__slots__ if name != "scores"}
        # The candidates as they were at the decision, made readable only when asked for
        # (``/debug/decisions``), not on every request.
        out["candidates"] = [{"replica": b.name, "index": b.index, "in_flight": in_flight,
                              "queued": queued, "running": running, "kv_usage": kv_usage,
                              "assignments": assignments,
                              "scores": self.scores.get(b.index, {})}
                             for b, in_flight, queued, running, kv_usage, assignments
                             in self.candidates]
        return out


@dataclass(slots=True)
class Attempt:
    """One try of a request on one replica (its :class:`Booking` in the lifecycle runner)."""

    backend: Backend
    booking: Booking
    record: DecisionRecord
    matched_blocks: int
    predicted_cached_tokens: int
    uncached_tokens: int
    ticket: int
    prefill_pending: bool = True
    finished: bool = field(default=False)
    span: Any = None  # its ``upstream`` span when tracing (edges/gateway/tracing.py)
    trace_headers: dict = field(default_factory=lambda: _NO_HEADERS)  # sent to the replica

    @property
    def request(self) -> RequestView:
        return self.booking.request

    @property
    def decision(self) -> Decision:
        return self.booking.decision


class GatewayRouter:
    def __init__(self, policy: Any, backends: list[Backend], metrics: GatewayMetrics,
                 clock: Clock, decisions_kept: int = 1000,
                 wall_clock: Callable[[], float] = time.time):
        self.policy = policy
        self.runner = LifecycleRunner(policy, on_policy_error=self._log_policy_error)
        self.policy_name = self.runner.policy_name
        self.backends = backends
        self._metrics = metrics
        self._clock = clock
        self._wall = wall_clock
        self.decisions: deque[DecisionRecord] = deque(maxlen=decisions_kept)
        self.tracing: Any = None  # a GatewayTracing, set by the gateway when configured
        # Told each booking, the end of its prefill and its end, and asked for the other
        # instances' pending prefill per replica (shared state across gateway instances:
        # :class:`prefixroute.edges.shared_state.shared.SharedState`), or None.
        self.observer: Any = None
        for backend in backends:
            self.runner.add_replica(backend.state)
            self.watch(backend)

    def watch(self, backend: Backend) -> None:
        """Wire ``backend``'s signals to the runner: a restart it learns of resets its
        replica at once; its queue seen empty ends the other instances' prefills there."""
        backend.on_reset = self.runner.reset_replica
        backend.on_scheduled = self._scheduled

    def _scheduled(self, index: int, before: float) -> None:
        if self.observer is not None:
            self.observer.scheduled(index, before)

    def replace_policy(self, policy: Any) -> None:
        """Route with ``policy`` from the next request on (a configuration reload)."""
        self.runner.replace_policy(policy)
        self.policy = policy
        self.policy_name = self.runner.policy_name

    def _log_policy_error(self, request: RequestView, decision: Decision,
                          candidates: list[int]) -> None:
        log.error("policy chose a replica that was not a candidate", extra={"fields": {
            "event": "policy_error", "policy": self.policy_name,
            "chosen": decision.replica, "candidates": candidates}})

    def route(self, *, request_id: str, tenant: str, model: str, prompt: PreparedPrompt,
              block_size: int, candidates: list[Backend], attempt: int,
              routing_key: str | None = None, max_tokens: int | None = None,
              arrival: float | None = None) -> Attempt:
        """Choose among ``candidates`` (non-empty) and count the request as sent there;
        ``arrival``: when the request reached the gateway (this clock)."""
        request = RequestView(request_id=request_id, num_tokens=prompt.num_tokens,
                              block_size=block_size, block_keys=prompt.block_keys,
                              token_ids=prompt.token_ids, tenant=tenant,
                              routing_key=routing_key, output_tokens_hint=max_tokens,
                              now=self._clock.now(), arrival=arrival)
        by_index = {}
        snapshot = []  # the candidates as they were at the decision
        shared = self.observer
        for b in candidates:
            view = b.replica_view()
            if shared is not None:  # the other instances' requests are pending there too
                view.pending_prefill_tokens += shared.pending_prefill_tokens(b.index)
            by_index[b.index] = b
            snapshot.append((b, b.in_flight, b.queued, b.running, b.kv_usage, b.assignments))
        booking = self.runner.route(request, by_index)
        decision = booking.decision
        backend = by_index[booking.replica]

        matched = self.runner.held_blocks(booking)
        predicted = predicted_cached_tokens(prompt.num_tokens, matched, block_size)
        uncached = max(0, prompt.num_tokens - predicted)
        record = DecisionRecord(
            request_id=request_id, tenant=tenant, model=model, attempt=attempt,
            time=self._clock.now(), policy=self.policy_name, replica=backend.name,
            branch=decision.branch, reason=decision.reason, num_tokens=prompt.num_tokens,
            full_blocks=len(prompt.block_keys), tokenization=prompt.mode,
            predicted_cached_tokens=predicted, candidates=snapshot, scores=decision.scores)
        self.decisions.append(record)
        self._metrics.decisions.labels(self.policy_name, decision.branch).inc()
        if self.observer is not None:
            self.observer.routed(booking, predicted)
        ticket = backend.dispatch(uncached)
        made = Attempt(backend, booking, record, matched, predicted, uncached, ticket)
        if self.tracing is not None:
            made.span, made.trace_headers = self.tracing.routed(request_id, {
                "prefixroute.replica": backend.name, "prefixroute.branch": decision.branch,
                "prefixroute.predicted_cached_tokens": predicted,
                "prefixroute.policy": self.policy_name, "prefixroute.attempt": attempt})
        return made

    def upstream_priority(self, attempt: Attempt, arrived: float) -> int | None:
        """The ``priority`` to send with ``attempt`` to a replica started with
        ``--scheduling-policy priority``, or ``None`` (send none): the policy's order
        (:attr:`Decision.priority`, ms on the gateway's clock; ``prefixroute`` dates its
        deadline from the request's arrival, so a retry keeps its place) moved to
        milliseconds of wall time, so that several gateways in front of the same replicas
        agree; a policy that sets no order gets the arrival time (``arrived``, on the
        gateway's clock): first come, first served. Either way it replaces a caller's own
        ``priority``: otherwise any tenant could put its requests ahead of everyone's."""
        if attempt.backend.config.scheduling_policy != "priority":
            return None
        priority = attempt.decision.priority
        offset_ms = round((self._wall() - self._clock.now()) * 1000.0)  # gateway -> wall clock
        if priority is None:
            return round(arrived * 1000.0) + offset_ms
        return priority + offset_ms

    def first_byte(self, attempt: Attempt, whole: bool = False) -> None:
        """The replica's first byte came back: the request's prefill is over. ``whole``: it
        is the whole answer (not streamed), whose end follows at once and tells the other
        instances as much."""
        if attempt.prefill_pending:
            attempt.prefill_pending = False
            attempt.backend.prefill_done(attempt.ticket)
            if self.observer is not None and not (whole or attempt.finished):
                self.observer.prefilled(attempt.booking)
            if attempt.span is not None and not attempt.finished:
                self.tracing.first_token(attempt.span)

    def succeeded(self, attempt: Attempt, usage: dict | None) -> None:
        """The replica answered (2xx). ``usage`` is the response's usage object, if any."""
        if attempt.finished:
            return
        cached = _cached_tokens(usage)
        self._finish(attempt, ran=True, outcome="ok", cached=cached)
        backend = attempt.backend
        backend.record_success()
        if cached is None:
            return
        attempt.record.reported_cached_tokens = cached
        replica = backend.name
        prompt_tokens = usage.get("prompt_tokens") if isinstance(usage, dict) else None
        if isinstance(prompt_tokens, bool) or not isinstance(prompt_tokens, int):
            prompt_tokens = None
        predicted = attempt.predicted_cached_tokens
        chars = attempt.record.tokenization == CHARS
        if chars and prompt_tokens and attempt.request.num_tokens > 0:
            # The metric compares like with like: the estimate in real tokens.
            predicted = round(predicted * prompt_tokens / attempt.request.num_tokens)
        self._metrics.predicted_cached.labels(replica).inc(predicted)
        self._metrics.reported_cached.labels(replica).inc(cached)
        tenant = attempt.record.tenant
        self._metrics.tenant_cached_tokens.labels(tenant, replica).inc(cached)
        if prompt_tokens is not None:
            self._metrics.prompt_tokens.labels(replica).inc(prompt_tokens)
            self._metrics.tenant_prompt_tokens.labels(tenant, replica).inc(prompt_tokens)
        if chars:
            if prompt_tokens:
                backend.observe_units(attempt.request.num_tokens, prompt_tokens)
            cached = cached_in_routing_units(cached, prompt_tokens,
                                             attempt.request.num_tokens,
                                             attempt.request.block_size)
        self.runner.completed(attempt.booking, cached)
        if self.observer is not None:
            self.observer.completed(attempt.booking, cached)
        backend.finished()

    def refused(self, attempt: Attempt) -> None:
        """The replica answered with a 4xx: alive, but it did not run (or cache) the prompt."""
        if attempt.finished:
            return
        self._finish(attempt, ran=False, outcome="refused")
        attempt.backend.record_success()

    def failed(self, attempt: Attempt, reason: str) -> None:
        """Connect error, timeout or 5xx: counts against the replica's circuit breaker."""
        if attempt.finished:
            return
        self._finish(attempt, ran=False, outcome=f"failed:{reason}")
        attempt.backend.record_failure(reason)

    def abandoned(self, attempt: Attempt, *, started: bool) -> None:
        """The caller went away (or the stream broke after bytes reached it)."""
        if attempt.finished:
            return
        self._finish(attempt, ran=started, outcome="abandoned")
        attempt.backend.breaker.release()

    def _finish(self, attempt: Attempt, *, ran: bool, outcome: str,
                cached: int | None = None) -> None:
        """Common to every end. With ``cached`` tokens reported, :meth:`succeeded` tells the
        runner (after scaling them); otherwise the request ended without a report."""
        attempt.finished = True
        self.first_byte(attempt)
        if attempt.span is not None:
            self.tracing.attempt_ended(attempt.span, outcome, cached)
        attempt.record.outcome = outcome
        if cached is None:
            self.runner.ended(attempt.booking, ran=ran)
            if self.observer is not None:
                self.observer.ended(attempt.booking, ran)
            attempt.backend.finished()

    def recent(self, n: int, tenant: str | None = None) -> list[dict[str, Any]]:
        """The last ``n`` decisions, newest first (one tenant's only, unless ``None``)."""
        out = []
        for record in reversed(self.decisions):
            if tenant is None or record.tenant == tenant:
                out.append(record.as_dict())
                if len(out) >= n:
                    break
        return out


def _cached_tokens(usage: Any) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    if isinstance(cached, bool) or not isinstance(cached, int):
        return None
    return cached
