"""One backend replica as the gateway sees it: health, load, circuit breaker and cache view.

The cache view is what the routing policy matches a request's block keys against:

* with ``kv_events`` configured, a :class:`~prefixroute.core.routing.views.LiveEventView` fed
  by the engine's KV events (exact up to event delay) plus the keys of requests in flight
  there and, for a grace period, of requests that ended there (the simulator's ``--view
  events`` runs the same class);
* otherwise an :class:`ApproximateView`: the blocks this gateway sent there, LRU-bounded by the
  replica's KV size (``capacity_blocks`` in the config, else ``num_gpu_blocks`` from the
  engine's ``vllm:cache_config_info``; while neither is known,
  :data:`~prefixroute.core.caches.base.UNKNOWN_CAPACITY_BLOCKS`).

The backend keeps one :class:`ReplicaView` (``state``) over that view; the lifecycle runner
(:mod:`prefixroute.core.routing.lifecycle`, driven by
:class:`~prefixroute.edges.gateway.router.GatewayRouter`) keeps its in-flight and assignment
counts and books requests into the view, the backend fills in the load it measures.

Character-block prompts count estimated tokens (characters / 4), the engine real ones. Each
answer's ``prompt_tokens`` teaches the backend the ratio (``units_per_token``), and the KV
size and prefill speed the policy sees are given in estimated tokens: a replica of 10,000
blocks holds 15,000 character blocks of text that runs 6 characters to the token.

Load comes from the gateway's own in-flight count and the engine's Prometheus gauges
(``vllm:num_requests_waiting``, ``vllm:num_requests_running``, ``vllm:kv_cache_usage_perc``),
scraped every ``health.metrics_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Any, Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.core.clock import Clock
from prefixroute.core.identity.identity import Adapter
from prefixroute.core.routing.base import ReplicaView
from prefixroute.core.routing.views import ApproximateView, EventView, LiveEventView
from prefixroute.edges.gateway.breaker import STATE_CODES, CircuitBreaker
from prefixroute.edges.gateway.config import BackendConfig, GatewayConfig
from prefixroute.edges.gateway.metrics import GatewayMetrics

log = logging.getLogger("prefixroute.gateway")

_UNITS_STEP = 0.05  # see Backend.units_per_token
ENGINE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc")
_SCRAPED = (*ENGINE_GAUGES, "vllm:cache_config_info")


def parse_engine_metrics(text: str, cache_config: bool = True) -> dict[str, float]:
    """The engine gauges routing reads, summed over label sets (one per engine in
    data-parallel setups), and with ``cache_config`` ``num_gpu_blocks`` from
    ``vllm:cache_config_info``.

    The samples are read by ``prometheus_client``'s exposition parser (escaped label values,
    timestamps as the format defines them). It is pure Python, a few microseconds a
    character, while an engine page has hundreds of lines (histogram buckets) and is read on
    the event loop every poll, per backend; so only the sample lines of the families read
    here go to it (the format is line-based: a sample line starts with its metric name), and
    the long ``cache_config_info`` line (some 1,400 characters) only while the caller still
    needs the KV size. If it refuses one of those lines the result is ``{}``: the scrape is
    ignored, as when the engine does not answer."""
    scraped = _SCRAPED if cache_config else ENGINE_GAUGES
    wanted = "\n".join(line for line in text.splitlines() if line.startswith(scraped))
    out: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(wanted):
            for sample in family.samples:
                if sample.name in ENGINE_GAUGES:
                    out[sample.name] = out.get(sample.name, 0.0) + sample.value
                elif sample.name == "vllm:cache_config_info":
                    blocks = sample.labels.get("num_gpu_blocks", "")
                    if blocks.isdigit():
                        out["num_gpu_blocks"] = float(blocks)
    except ValueError:
        return {}
    return out


class Backend:
    """State of one replica. All methods run on the event loop thread."""

    def __init__(self, index: int, config: BackendConfig, gateway: GatewayConfig,
                 clock: Clock, metrics: GatewayMetrics):
        self.index = index
        self.config = config
        self.name = config.name
        self.url = config.url
        self.models: set[str] = set(config.models)
        self.adapters = {name: Adapter(name, path) for name, path in config.adapters.items()}
        self.models.update(self.adapters)
        self.breaker = CircuitBreaker(clock, gateway.circuit_breaker.failure_threshold,
                                      gateway.circuit_breaker.open_s)
        self._metrics = metrics
        self._unhealthy_after = gateway.health.unhealthy_after
        self.healthy = True  # until a check says otherwise; the first probe runs at start
        # Draining or leaving the fleet (edges/gateway/fleet.py): no new requests, retries
        # included; those in flight finish.
        self.draining = False
        self.health_failures = 0
        self._models_checked = False  # configured models compared with GET /v1/models
        self.last_health_error: str | None = None
        # Called with this replica's index when its cache is known to be empty (set by the
        # GatewayRouter: the lifecycle runner clears the view and tells the policy).
        self.on_reset: Callable[[int], None] | None = None
        # Told (index, time of the previous scrape) when a scrape shows nothing waiting, so
        # the other gateway instances' requests sent before then count as prefilled too.
        self.on_scheduled: Callable[[int, float], None] | None = None
        # Uncached prompt tokens of requests whose prefill is not known to be done, by
        # dispatch ticket: (tokens, dispatch time). See prefill_done and scrape_metrics.
        self._prefills: dict[int, tuple[int, float]] = {}
        self._prefill_total = 0  # their sum, read at every routing decision
        self._next_ticket = 0
        self._clock = clock
        self._last_scrape = clock.now()
        self.queued = 0
        self.running = 0
        self.kv_usage = 0.0
        self.num_gpu_blocks: int | None = None
        self.headers: dict[str, str] = {}
        if config.api_key_env and os.environ.get(config.api_key_env):
            self.headers["authorization"] = f"Bearer {os.environ[config.api_key_env]}"
        # Estimated tokens per real token for character-block prompts (see the module doc):
        # the applied value, moved only when the running estimate drifts past
        # _UNITS_STEP, because the policy restarts its learned capacity when the KV size
        # it is shown changes.
        self.units_per_token = 1.0
        self._units_estimate: float | None = None
        self.view: LiveEventView | ApproximateView
        if config.kv_events is not None:
            self.view = LiveEventView(EventView(), clock)
        else:
            self.view = ApproximateView(config.capacity_blocks)
        # What the policy reads: the runner keeps in_flight and assignments on it.
        self.state = ReplicaView(index=index, name=self.name, cache=self.view,
                                 scheduling_policy=config.scheduling_policy)
        self.subscriber: Any = None  # a KVEventSubscriber, set by the pool
        # An event view is "exact" while every event batch arrived (live or replayed);
        # "degraded" from a batch lost for good (older than the engine's replay buffer)
        # until the view starts over (the engine restarted or cleared its cache).
        self.view_state = "exact" if config.kv_events is not None else "approximate"
        if config.kv_events is not None:
            metrics.view_exact.labels(self.name).set(1)
        self.loop: asyncio.AbstractEventLoop | None = None  # where event batches are applied
        for gauge in (metrics.healthy, metrics.breaker):
            gauge.labels(self.name)
        # Read when scraped, not set on every dispatch and finish.
        metrics.in_flight.labels(self.name).set_function(lambda: self.in_flight)
        self._published: tuple[int, int] | None = None  # (healthy, breaker) last set
        self._publish_state()

    # -- routing --------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return self.state.in_flight

    @property
    def assignments(self) -> int:
        return self.state.assignments

    @property
    def uses_events(self) -> bool:
        return isinstance(self.view, LiveEventView)

    def serves(self, model: str) -> bool:
        return model in self.models

    def available(self) -> bool:
        return not self.draining and self.healthy and self.breaker.available()

    def answering(self) -> bool:
        """Healthy and its breaker not open, though it may be busy with its half-open trial:
        a replica to try when no other is available, rather than answering 503."""
        return self.healthy and self.breaker.state != "open"

    def replica_view(self) -> ReplicaView:
        """:attr:`state` with the load and KV size this backend measured, as the policy is
        to see them now."""
        capacity = self.config.capacity_blocks or self.num_gpu_blocks or 0
        speed = self.config.prefill_s_per_token
        units = self.units_per_token
        if units != 1.0:
            capacity = int(capacity * units)
            speed = speed / units if speed is not None else None
        view = self.state
        view.healthy = self.healthy
        view.queued = self.queued
        view.running = self.running
        view.pending_prefill_tokens = self._prefill_total
        view.kv_usage = self.kv_usage
        view.capacity_blocks = capacity
        view.prefill_s_per_token = speed
        return view

    def observe_units(self, estimated_tokens: int, prompt_tokens: int) -> None:
        """A character-block prompt of ``estimated_tokens`` was ``prompt_tokens`` real tokens:
        update the running ratio (exponential average, weight 0.1 per answer) and apply it
        when it has moved by more than _UNITS_STEP."""
        if estimated_tokens <= 0 or prompt_tokens <= 0:
            return
        ratio = estimated_tokens / prompt_tokens
        estimate = self._units_estimate
        estimate = ratio if estimate is None else estimate + 0.1 * (ratio - estimate)
        self._units_estimate = estimate
        if abs(estimate - self.units_per_token) > _UNITS_STEP * self.units_per_token:
            self.units_per_token = estimate
            self._size_approximate_view()

    @property
    def pending_prefill_tokens(self) -> int:
        return self._prefill_total

    def dispatch(self, uncached_tokens: int) -> int:
        """A request booked here (by the lifecycle runner) is being sent: its prefill is
        pending and the breaker counts it. Returns the ticket that :meth:`prefill_done`
        takes."""
        ticket = self._next_ticket
        self._next_ticket += 1
        self._prefills[ticket] = (uncached_tokens, self._clock.now())
        self._prefill_total += uncached_tokens
        self.breaker.on_dispatch()
        return ticket

    def prefill_done(self, ticket: int) -> None:
        """The request's prefill is over: its first byte arrived (a stream's first token) or
        it ended."""
        entry = self._prefills.pop(ticket, None)
        if entry is not None:
            self._prefill_total -= entry[0]

    def finished(self) -> None:
        """A request left (the runner has applied its end to the view)."""
        self._metrics.view_blocks.labels(self.name).set(len(self.view))

    def record_success(self) -> None:
        self.breaker.record_success()
        self._publish_state()

    def record_failure(self, reason: str) -> None:
        was_open = self.breaker.state
        self.breaker.record_failure()
        self._metrics.backend_failures.labels(self.name, reason).inc()
        if self.breaker.state != was_open and self.breaker.state == "open":
            log.warning("circuit breaker opened", extra={"fields": {
                "event": "breaker_open", "replica": self.name, "reason": reason,
                "open_s": self.breaker.open_s}})
        self._publish_state()

    def _publish_state(self) -> None:
        state = (1 if self.healthy else 0, STATE_CODES[self.breaker.state])
        if state == self._published:
            return  # every success lands here: set the gauges only when they change
        self._published = state
        self._metrics.healthy.labels(self.name).set(state[0])
        self._metrics.breaker.labels(self.name).set(state[1])

    # -- health and load ------------------------------------------------------------------

    async def check_health(self, client: httpx.AsyncClient, timeout: float) -> bool:
        try:
            response = await client.get(f"{self.url}/health", headers=self.headers,
                                        timeout=timeout)
            ok = response.status_code == 200
            error = None if ok else f"GET /health answered {response.status_code}"
        except httpx.HTTPError as exc:
            ok, error = False, f"{type(exc).__name__}: {exc}"
        if ok:
            if not self.healthy:
                log.info("replica healthy again", extra={"fields": {
                    "event": "replica_healthy", "replica": self.name}})
                self._models_checked = False  # it may have restarted with other flags
            self.healthy, self.health_failures, self.last_health_error = True, 0, None
            self.breaker.record_health_ok()
            if not self.config.models:
                await self._discover_models(client, timeout)
            elif not self._models_checked:
                await self.check_configured_models(client, timeout)
        else:
            self.health_failures += 1
            self.last_health_error = error
            if self.healthy and self.health_failures >= self._unhealthy_after:
                self.healthy = False
                self._forget_routed_blocks()
                log.warning("replica unhealthy", extra={"fields": {
                    "event": "replica_unhealthy", "replica": self.name, "error": error}})
        self._publish_state()
        return ok

    async def _discover_models(self, client: httpx.AsyncClient, timeout: float) -> None:
        found = await self._served_models(client, timeout)
        if found is not None:
            self.models = found | set(self.adapters)

    async def _served_models(self, client: httpx.AsyncClient,
                             timeout: float) -> set[str] | None:
        """The model ids the replica lists at ``GET /v1/models`` (None: no usable answer)."""
        try:
            response = await client.get(f"{self.url}/v1/models", headers=self.headers,
                                        timeout=timeout)
            data = response.json().get("data") if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            return None
        if not isinstance(data, list):
            return None
        return {m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)}

    async def check_configured_models(self, client: httpx.AsyncClient,
                                      timeout: float) -> list[str]:
        """Configured ``models`` the replica does not list (logged as a warning): every
        request for them would come back 404 from the replica, so say so when it first
        answers (at start-up, or when it comes up later or back) rather than leave it to the
        first caller."""
        configured = set(self.config.models)
        if not configured:
            return []
        served = await self._served_models(client, timeout)
        if served is None:
            return []
        self._models_checked = True
        missing = sorted(configured - served - set(self.adapters))
        if missing:
            log.warning("replica does not serve configured models", extra={"fields": {
                "event": "models_missing", "replica": self.name, "missing": missing,
                "served": sorted(served),
                "hint": "start the replica with --served-model-name, or fix backends[].models"}})
        return missing

    async def scrape_metrics(self, client: httpx.AsyncClient, timeout: float) -> None:
        try:
            response = await client.get(f"{self.url}/metrics", headers=self.headers,
                                        timeout=timeout)
        except httpx.HTTPError:
            return
        if response.status_code != 200:
            return
        values = parse_engine_metrics(response.text, cache_config=self.num_gpu_blocks is None)
        scraped_at, previous = self._clock.now(), self._last_scrape
        self._last_scrape = scraped_at
        if values.get("vllm:num_requests_waiting") == 0 and self._prefills:
            # Nothing waits on the engine: requests sent before the previous scrape have been
            # scheduled and, at one chunk per step, prefilled. A non-streaming answer shows no
            # first byte, so this is how its prefill is seen to end before the whole answer.
            for ticket in [t for t, (_, sent) in self._prefills.items() if sent <= previous]:
                self._prefill_total -= self._prefills.pop(ticket)[0]
        if values.get("vllm:num_requests_waiting") == 0 and self.on_scheduled is not None:
            self.on_scheduled(self.index, previous)
        self.queued = int(values.get("vllm:num_requests_waiting", self.queued))
        self.running = int(values.get("vllm:num_requests_running", self.running))
        self.kv_usage = float(values.get("vllm:kv_cache_usage_perc", self.kv_usage))
        blocks = values.get("num_gpu_blocks")
        if blocks and self.num_gpu_blocks is None:
            self.num_gpu_blocks = int(blocks)
            self._size_approximate_view()

    def _forget_routed_blocks(self) -> None:
        """A replica that stopped answering health checks has most likely restarted, and a
        restarted engine starts with an empty cache: the lifecycle runner clears the view
        (an event view would also learn it from the restarted stream) and tells the
        policy."""
        if self.on_reset is not None:
            self.on_reset(self.index)
        self._metrics.view_blocks.labels(self.name).set(len(self.view))

    def _size_approximate_view(self) -> None:
        """Bound the approximate view by the replica's KV size, in the units its keys count
        (block 0 is vLLM's reserved null block, so N engine blocks hold N - 1)."""
        if not isinstance(self.view, ApproximateView):
            return
        blocks = self.config.capacity_blocks
        if blocks is None and self.num_gpu_blocks and self.num_gpu_blocks > 1:
            blocks = self.num_gpu_blocks - 1
        if blocks is not None:
            self.view.resize(max(1, int(blocks * self.units_per_token)))

    # -- KV events ------------------------------------------------------------------------

    def deliver_events(self, received: Any) -> None:
        """The subscriber's callback (its own thread): hand the batch to the event loop, where
        the view is read, so the view is only ever touched from one thread."""
        loop = self.loop
        if loop is None:
            return
        try:
            loop.call_soon_threadsafe(self.apply_events, received)
        except RuntimeError:  # the loop closed during shutdown
            pass

    def apply_events(self, received: Any) -> None:
        """One batch from the subscriber (called on the loop thread)."""
        if not isinstance(self.view, LiveEventView):
            return
        view = self.view
        if received.restarted:  # vLLM sends no AllBlocksCleared when it restarts
            if self.on_reset is not None:
                self.on_reset(self.index)  # the runner clears the view, the policy forgets
            else:
                view.on_cleared()
            self._metrics.kv_events.labels(self.name, "restart").inc()
        state = self.view_state
        if received.restarted:
            state = "exact"  # a fresh stream over an empty cache: nothing before it matters
        elif received.missing_before:
            self._metrics.kv_event_gaps.labels(self.name).inc(received.missing_before)
            state = "degraded"
        for kind, count in view.apply(received.batch.events).items():
            self._metrics.kv_events.labels(self.name, kind).inc(count)
            if kind == "cleared" and count:
                state = "exact"  # the engine emptied its cache: the view starts over too
        if state != self.view_state:
            self.view_state = state
            self._metrics.view_exact.labels(self.name).set(1 if state == "exact" else 0)
            log.warning("replica cache view is now %s", state, extra={"fields": {
                "event": "view_state", "replica": self.name, "state": state}})
        self._metrics.view_blocks.labels(self.name).set(len(self.view))

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "healthy": self.healthy,
                "breaker": self.breaker.state, "in_flight": self.in_flight,
                "queued": self.queued, "running": self.running, "kv_usage": self.kv_usage,
                "models": sorted(self.models), "view_state": self.view_state,
                "view": "events" if self.uses_events
                else "approximate", "view_blocks": len(self.view),
                # Estimated (characters / 4) per real token, learned from character-block
                # answers; 1.0 until one arrives.
                "chars_units_per_token": round(self.units_per_token, 3),
                "last_health_error": self.last_health_error}


class BackendPool:
    """All backends, their periodic health checks and metric scrapes, and KV subscribers."""

    def __init__(self, config: GatewayConfig, clock: Clock, metrics: GatewayMetrics):
        self.config = config
        self.backends = [Backend(i, b, config, clock, metrics)
                         for i, b in enumerate(config.backends)]
        self._tasks: list[asyncio.Task] = []
        self._backend_tasks: dict[int, list[asyncio.Task]] = {}
        self._stopping = asyncio.Event()
        self.next_index = len(self.backends)  # indices are never reused while running

    def open_event_streams(self) -> None:
        """Bind or connect every configured KV event subscriber (before serving, so a port
        that is taken is a start-up error, not a silent stale view)."""
        from prefixroute.core.errors import ConfigError
        from prefixroute.edges.kvevents.zmq import KVEventSubscriber

        for backend in self.backends:
            events = backend.config.kv_events
            if events is None or backend.subscriber is not None:
                continue
            try:
                backend.subscriber = KVEventSubscriber(
                    events.endpoint, bind=events.bind, topic=events.topic,
                    replay_endpoint=events.replay_endpoint, on_batch=backend.deliver_events,
                    skip_unknown_events=True)
            except Exception as exc:  # zmq.ZMQError: address in use, bad endpoint
                self.close_event_streams()
                raise ConfigError(f"backend {backend.name}: cannot "
                                  f"{'bind' if events.bind else 'connect'} KV events endpoint "
                                  f"{events.endpoint}: {exc}") from None

    async def start(self, client: httpx.AsyncClient) -> None:
        loop = asyncio.get_running_loop()
        self.open_event_streams()
        for backend in self.backends:
            backend.loop = loop
            if backend.subscriber is not None:
                backend.subscriber.start()
        timeout = self.config.timeouts.health_s
        # One probe round before serving: models discovered, dead replicas known.
        await asyncio.gather(*(self._probe(b, client, timeout) for b in self.backends))
        for backend in self.backends:
            self.watch(backend, client)

    def watch(self, backend: Backend, client: httpx.AsyncClient) -> None:
        """Start ``backend``'s periodic health checks and metric scrapes."""
        tasks = [asyncio.create_task(self._health_loop(backend, client)),
                 asyncio.create_task(self._metrics_loop(backend, client))]
        self._backend_tasks[backend.index] = tasks
        self._tasks.extend(tasks)

    async def unwatch(self, backend: Backend) -> None:
        """Stop ``backend``'s checks, scrapes and KV event subscriber (it left the fleet)."""
        tasks = self._backend_tasks.pop(backend.index, [])
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks = [t for t in self._tasks if t not in tasks]
        if backend.subscriber is not None:
            backend.subscriber.stop()
            backend.subscriber = None

    async def _probe(self, backend: Backend, client: httpx.AsyncClient, timeout: float) -> None:
        await backend.check_health(client, timeout)
        if backend.healthy:
            await backend.scrape_metrics(client, timeout)

    async def _health_loop(self, backend: Backend, client: httpx.AsyncClient) -> None:
        interval = self.config.health.interval_s
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
                return
            except asyncio.TimeoutError:
                pass
            await backend.check_health(client, self.config.timeouts.health_s)

    async def _metrics_loop(self, backend: Backend, client: httpx.AsyncClient) -> None:
        interval = self.config.health.metrics_interval_s
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
                return
            except asyncio.TimeoutError:
                pass
            if backend.healthy:
                await backend.scrape_metrics(client, self.config.timeouts.health_s)

    async def stop(self) -> None:
        self._stopping.set()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
        self.close_event_streams()

    def close_event_streams(self) -> None:
        for backend in self.backends:
            if backend.subscriber is not None:
                backend.subscriber.stop()
                backend.subscriber = None

    def serving(self, model: str) -> list[Backend]:
        return [b for b in self.backends if b.serves(model)]

    def models(self) -> list[str]:
        seen: dict[str, None] = {}
        for backend in self.backends:
            for model in sorted(backend.models):
                seen.setdefault(model, None)
        return list(seen)



def candidates_for(backends: list[Backend], tried: set[int]) -> list[Backend]:
    """The replicas an attempt may go to, none of them draining or tried already: those
    that are healthy and whose breaker lets requests through; if none is, those whose
    breaker alone allows it (health checks may lag a recovery; the breaker still guards);
    if none is, a healthy one busy with its half-open trial (never a 503 while a healthy
    replica is left to try)."""
    found = [b for b in backends if b.index not in tried and b.available()]
    if not found:
        found = [b for b in backends
                 if b.index not in tried and not b.draining and b.breaker.available()]
    if not found:
        found = [b for b in backends
                 if b.index not in tried and not b.draining and b.answering()]
    return found
