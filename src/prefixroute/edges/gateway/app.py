"""The gateway as an ASGI app (Starlette): OpenAI-compatible endpoints in front of replicas.

Endpoints:

``POST /v1/completions``, ``POST /v1/chat/completions``
    authenticate (``Authorization: Bearer KEY``), rate-limit, check and salt the body, tokenize
    and hash, wait for a slot in the bounded queue, route, send (with retries), relay.
``GET /v1/models``
    the union of the backends' models (authenticated, as OpenAI's).
``GET /health``
    ``ok`` (every replica healthy), ``degraded`` (some) or ``unavailable`` (none: 503).
``GET /metrics``
    Prometheus text (:mod:`prefixroute.edges.gateway.metrics`).
``GET /debug/decisions?n=N``
    the last N routing decisions with candidates, scores and reasons; a tenant sees its own,
    an ``admin`` tenant sees all and the replicas' state.
``/admin/...``
    the fleet's replicas, drain, undrain, reload (``admin``); the replicas come and go
    through :mod:`prefixroute.edges.gateway.fleet`.

Every refusal is an OpenAI-style error object with the right status; an accepted request gets
the replica's answer or a clear error (``proxy``), and is logged as one JSON line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable, Coroutine

import httpx
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from prefixroute.core.clock import Clock, MonotonicClock
from prefixroute.core.errors import ConfigError, PrefixRouteError
from prefixroute.core.routing.registry import create_policy
from prefixroute.edges.gateway.admin import AdminAPI
from prefixroute.edges.gateway.admission import AdmissionQueue
from prefixroute.edges.gateway.backends import Backend, BackendPool
from prefixroute.edges.gateway.busypoll import BusyPoller
from prefixroute.edges.gateway.config import GatewayConfig, load_config
from prefixroute.edges.gateway.fleet import Fleet
from prefixroute.edges.gateway.errors import GatewayError
from prefixroute.edges.gateway.metrics import GatewayMetrics
from prefixroute.edges.gateway.prompts import CHARS, PreparedPrompt, PromptPreparer
from prefixroute.edges.gateway.proxy import Job, Proxy, caller_send, send_response
from prefixroute.edges.gateway.reload import apply_config
from prefixroute.edges.gateway.render import RenderClient
from prefixroute.edges.gateway.router import GatewayRouter
from prefixroute.edges.gateway.sanitize import (CHAT, COMPLETIONS, CheckedRequest, check_request,
                                                parse_json_body)
from prefixroute.edges.gateway.tenants import Tenant, TenantRegistry
from prefixroute.edges.gateway.tracing import GatewayTracing, provider_from_config
from prefixroute.edges.http1 import Client, HTTP1Transport, HttpxClient, ProbeClient

log = logging.getLogger("prefixroute.gateway")

DEFAULT_DECISIONS_SHOWN = 20
# Bodies above this are tokenized and hashed on a worker thread: about 8k tokens of text, which
# takes milliseconds, long enough to stall every other request on the event loop.
OFFLOAD_PREPARE_BYTES = 32 * 1024



def _settle(check: asyncio.Future | None) -> None:
    """A rate check the request no longer waits for (it failed first): cancel it if still
    running, else mark its outcome seen (no "exception was never retrieved" warning)."""
    if check is None:
        return
    if not check.done():
        check.cancel()
    elif not check.cancelled():
        check.exception()

class Gateway:
    """Everything one gateway process holds; ``app`` is its ASGI application.

    ``transport`` replaces the network to the backends (tests use ``httpx.MockTransport``);
    ``tokenizer`` is a loaded tokenizer (``edges.tokenization``) or ``None``; how prompts
    become keys is ``config.tokenization`` (``prompts``); ``clock`` drives rate limits,
    breakers and latencies; ``wall_clock`` (``time.time``) dates the priorities sent to
    replicas with priority scheduling, which every gateway in front of them must share.
    """

    def __init__(self, config: GatewayConfig, *, tokenizer: Any = None,
                 transport: httpx.AsyncBaseTransport | None = None, clock: Clock | None = None,
                 wall_clock: Callable[[], float] = time.time, tracer_provider: Any = None):
        self.config = config
        self.clock = clock or MonotonicClock()
        self.metrics = GatewayMetrics()
        self.tenants = TenantRegistry(config.tenants, config.server_secret, self.clock)
        self.pool = BackendPool(config, self.clock, self.metrics)
        policy = create_policy(config.policy, seed=config.seed,
                               num_replicas=max(1, len(config.backends)),
                               block_size=config.hashing.block_size)
        self.router = GatewayRouter(policy, self.pool.backends, self.metrics, self.clock,
                                    config.decisions_kept, wall_clock)
        # OpenTelemetry spans (edges/gateway/tracing.py): from the config's ``tracing``, or
        # a provider given here (tests: an in-memory exporter).
        self.tracing: GatewayTracing | None = None
        if tracer_provider is None and config.tracing is not None:
            tracer_provider = provider_from_config(config.tracing)
        if tracer_provider is not None:
            self.tracing = self.router.tracing = GatewayTracing(tracer_provider)
        self.fleet = Fleet(config, self.pool, self.router, self.clock, self.metrics)
        self.admin = AdminAPI(self)
        self.shared = None  # shared routing state and rate limits (several instances)
        if config.shared_state is not None:
            try:
                from prefixroute.edges.shared_state.shared import SharedState
            except ImportError as exc:  # the optional client is missing
                raise ConfigError(f"{config.source}: shared_state needs the Redis client: "
                                  f"pip install 'prefixroute[redis]' ({exc})") from None
            self.shared = SharedState(config.shared_state.redis, self.router.runner,
                                      self.metrics.registry, now=self.clock.now,
                                      wall=wall_clock, namespace=config.shared_state.namespace)
            self.router.observer = self.shared
        self.renderer = RenderClient(config.timeouts.render_s, self.metrics.registry)
        mode = None if config.tokenization == "auto" else config.tokenization
        self.prompts = PromptPreparer(config.hashing, tokenizer, mode=mode,
                                      render=self.renderer.render)
        # The traffic recording (edges/gateway/recorder.py), written off the request path.
        self.recorder = None
        if config.record is not None:
            from prefixroute.edges.gateway.recorder import TrafficRecorder, fleet_description
            self.recorder = TrafficRecorder(
                config.record, config.server_secret, self.metrics.registry,
                block_size=config.hashing.block_size, policy=config.policy,
                fleet=lambda: fleet_description(self.pool.backends),
                now=self.clock.now, wall=wall_clock)
            self.recorder.check_directory(config.source)
        self.admission = AdmissionQueue(config.limits.max_concurrent, config.limits.max_queued,
                                        config.limits.queue_timeout_s)
        # Read when scraped rather than set on every change (four lock-taking sets per
        # request): a scrape shows the same values.
        self.metrics.queue_depth.set_function(lambda: self.admission.waiting)
        self.metrics.active.set_function(lambda: self.admission.active)
        self._transport = transport
        self.client: httpx.AsyncClient | None = None
        self.upstream: Client | HttpxClient | None = None
        self.probes: ProbeClient | None = None  # health checks and scrapes, from start()
        self.proxy: Proxy | None = None
        self.open_requests = 0
        self.draining = False
        self._reload_lock = asyncio.Lock()
        self.busy_poller: BusyPoller | None = None  # config.busy_poll_s > 0, from start()
        self.starlette = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.prometheus, methods=["GET"]),
                Route("/debug/decisions", self.debug_decisions, methods=["GET"]),
                Route("/admin/backends", self.admin.backends, methods=["GET"]),
                Route("/admin/backends/{name}/drain", self.admin.drain, methods=["POST"]),
                Route("/admin/backends/{name}/undrain", self.admin.undrain, methods=["POST"]),
                Route("/admin/reload", self.admin.reload, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_exception,
                                Exception: self._unexpected},
            lifespan=self._lifespan)
        self.app = GenerationFastPath(self.starlette, {
            "/v1/completions": self.completions,
            "/v1/chat/completions": self.chat_completions})

    # -- lifecycle ------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Starlette):
        await self.start()
        try:
            yield
        finally:
            await self.stop()

    async def start(self) -> None:
        t = self.config.timeouts
        # Requests go through our HTTP/1.1 client (edges/http1.py): httpx's pool scans every
        # pooled connection on each request, and with its client layer cost more CPU than the
        # rest of the hop together (benchmarks/gateway_bench.py). Health checks and scrapes,
        # a few per second, keep httpx's API on the same wire. Admission bounds concurrency;
        # the pool adds no second, hidden queue. An injected transport (tests) serves both.
        if self._transport is None:
            upstream = Client(connect_timeout=t.connect_s, read_timeout=t.read_s,
                              write_timeout=t.write_s, max_idle_per_origin=256)
            transport: httpx.AsyncBaseTransport = HTTP1Transport(Client(
                connect_timeout=t.connect_s, read_timeout=t.read_s, write_timeout=t.write_s))
            # Health checks and metric scrapes (a few a second) skip httpx's client layer
            # too, on connections of their own.
            self.probes = ProbeClient(Client(connect_timeout=t.connect_s,
                                             read_timeout=t.health_s,
                                             write_timeout=t.write_s))
        else:
            transport = self._transport
        self.client = httpx.AsyncClient(
            transport=transport,
            timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.write_s,
                                  pool=t.pool_s))
        self.upstream = upstream if self._transport is None else HttpxClient(self.client)
        self.renderer.client = self.upstream  # render calls share the requests' connections
        self.proxy = Proxy(self.upstream, self.router, self.metrics, self.clock,
                           retries=self.config.retries, block_size=self.config.hashing.block_size)
        probes = self.probes or self.client  # an injected transport (tests) serves both
        await self.pool.start(probes)
        await self.fleet.start(probes)
        self._watch_sighup()
        if self.shared is not None:
            await self.shared.start()
        if self.recorder is not None:
            self.recorder.start()
        if self.config.busy_poll_s > 0:
            self.busy_poller = BusyPoller(asyncio.get_running_loop(), self.config.busy_poll_s,
                                          lambda: self.open_requests > 0, self.clock.now)
        log.info("gateway started", extra={"fields": {
            "event": "started", "policy": self.config.policy,
            "tokenization": self.prompts.mode, "busy_poll_s": self.config.busy_poll_s,
            "replicas": [b.status() for b in self.pool.backends]}})

    async def stop(self, grace_s: float | None = None) -> None:
        """Drain: the server stops accepting first; open requests (streams included) get up
        to ``grace_s`` (default ``shutdown_grace_s``) to finish before the backend
        connections close."""
        await self.drain(self.config.shutdown_grace_s if grace_s is None else grace_s)
        if self.busy_poller is not None:
            self.busy_poller.close()
        await self.fleet.stop()
        await self.pool.stop()
        if self.shared is not None:
            await self.shared.stop()
        if self.tracing is not None:
            self.tracing.shutdown()
        if self.recorder is not None:
            await asyncio.to_thread(self.recorder.close)
        if self.upstream is not None:
            await self.upstream.aclose()
        if self.probes is not None:
            await self.probes.aclose()
        if self.client is not None:
            await self.client.aclose()
        log.info("gateway stopped", extra={"fields": {
            "event": "stopped", "unfinished_requests": self.open_requests,
            "streams_cut_by_shutdown": self.proxy.cut_by_shutdown if self.proxy else 0}})

    async def drain(self, grace_s: float, interrupted: asyncio.Event | None = None) -> None:
        """Take no new work (``/health`` answers 503 ``draining``) and wait up to ``grace_s``
        for the open requests, streams included, to end; ``interrupted`` (a second stop
        signal) ends the wait at once."""
        self.draining = True
        deadline = self.clock.now() + grace_s
        while self.open_requests and self.clock.now() < deadline \
                and not (interrupted is not None and interrupted.is_set()):
            await asyncio.sleep(0.05)

    def cut_streams(self) -> int:
        """End every open stream with a ``server_shutdown`` error event (the end of a
        shutdown's drain, ``server.py``); how many were cut."""
        return self.proxy.cut_streams() if self.proxy is not None else 0

    def _watch_sighup(self) -> None:
        """``SIGHUP`` reloads the configuration file (only where the loop can take signals:
        the main thread of a process on a POSIX system)."""
        if threading.current_thread() is not threading.main_thread() \
                or not hasattr(signal, "SIGHUP") or not Path(self.config.source).is_file():
            return
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGHUP, lambda: loop.create_task(
                self._reload_logged()))
        except (NotImplementedError, RuntimeError, ValueError):
            # This loop cannot take signals (NotImplementedError where the platform's loop has
            # no signal support, RuntimeError or ValueError where signals cannot be set from
            # here): no reload on SIGHUP; ``POST /admin/reload`` still reloads.
            return

    async def _reload_logged(self) -> None:
        try:
            await self.reload()
        except PrefixRouteError as exc:
            log.error("configuration not reloaded; the running one stays", extra={"fields": {
                "event": "reload_refused", "source": self.config.source, "error": str(exc)}})

    async def reload(self) -> dict[str, Any]:
        """Re-read the configuration file and apply it (:mod:`.reload`); raises
        :class:`PrefixRouteError` with the reason if it is invalid (the old one stays).
        Reloads run one at a time."""
        async with self._reload_lock:
            new = await asyncio.to_thread(load_config, self.config.source)
            return await apply_config(self, new)

    async def _replicas_for(self, model: str) -> list:
        """The replicas serving ``model``; with none, wait up to ``limits.queue_timeout_s``
        for one to join if one may (scale from zero), then 503; a model no replica could
        serve is a 404 at once."""
        backends = self.pool.serving(model)
        if backends:
            return backends
        if self.fleet.may_appear(model):
            timeout = self.config.limits.queue_timeout_s
            backends = await self.fleet.wait_for(model, timeout)
            if backends:
                return backends
            raise GatewayError(503, f"no replica serves model {model!r} now; waited "
                               f"{timeout:g} s (limits.queue_timeout_s) for one to join",
                               code="no_replica_available", headers={"retry-after": "1"})
        known = ", ".join(self.pool.models()) or "none yet"
        raise GatewayError(404, f"the model {model!r} does not exist on any "
                           f"replica; available: {known}", param="model",
                           code="model_not_found")

    # -- generation endpoints -------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, COMPLETIONS)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, CHAT)

    async def _generate(self, request: Request, endpoint: str) -> Response:
        started = self.clock.now()
        request_id = f"pr-{os.urandom(16).hex()}"  # uuid4's hex, without building a UUID
        tenant_name = "-"
        self.open_requests += 1
        if self.busy_poller is not None:
            self.busy_poller.kick()
        tracing = self.tracing
        if tracing is not None:
            tracing.request_started(request_id, endpoint, request.headers)
        try:
            if tracing is None:
                tenant = self._authorize(request)
            else:
                with tracing.span(request_id, "auth"):
                    tenant = self._authorize(request)
            tenant_name = tenant.name
            rate_check = self._start_rate_check(tenant)
            try:
                raw = await self._read_body(request)
                if rate_check is not None and rate_check.done():
                    rate_check.result()  # refused already: no work on the body
                checked, backends, prompt = await self.admit(endpoint, tenant, raw,
                                                             request_id, rate_check)
            finally:
                _settle(rate_check)
        except GatewayError as error:
            self.open_requests -= 1
            self._account(endpoint, str(error.status), started, request_id, tenant_name,
                          error=error.message)
            return error.response(request_id)
        except Exception as exc:  # a bug of ours: answer 500, never a dropped connection
            self.open_requests -= 1
            log.error("unexpected error before routing", exc_info=exc, extra={"fields": {
                "event": "internal_error", "request_id": request_id}})
            error = GatewayError(500, "internal error in the gateway; the request was not "
                                 "sent", code="internal_error")
            self._account(endpoint, "500", started, request_id, tenant_name, error=str(exc))
            return error.response(request_id)
        except BaseException:
            self.open_requests -= 1
            raise

        self.metrics.overhead.observe(self.clock.now() - started)
        job = Job(request_id, tenant.name, checked, prompt, backends, started)
        assert self.proxy is not None
        try:
            return await self.proxy.forward(job, self._job_done)
        except Exception as exc:  # a bug of ours: the caller still gets a clear answer
            log.error("unexpected error while forwarding", exc_info=exc, extra={"fields": {
                "event": "internal_error", "request_id": request_id}})
            return GatewayError(500, "internal error in the gateway; the request may not have "
                                "completed", code="internal_error").response(request_id)

    # -- what every body does with a request before routing it (serve, the EPP) ----------

    def _authorize(self, request: Request) -> Tenant:
        """The caller's tenant (401 without a valid key)."""
        return self.tenants.authenticate(request.headers.get("authorization"))

    async def check_rate(self, tenant: Tenant) -> None:
        """Take one request from ``tenant``'s rate limit, or raise 429 (counted). With shared
        state the bucket is the whole fleet's (:meth:`_take`)."""
        if tenant.bucket is not None:
            pending = self._take(tenant, "requests", 1.0)
            if pending is not None:
                await pending

    def _start_rate_check(self, tenant: Tenant) -> asyncio.Future | None:
        """Take one request from ``tenant``'s request limit. A local bucket, or the slice of
        the fleet's bucket this instance holds, answers at once (429 raised here); when
        Redis must be asked, the check runs beside the request's own work (reading and
        tokenizing the body) and :meth:`admit` awaits it before the request takes a slot:
        the limit is as exact as before and the round trip is off the path unless it
        outlasts that work. A prompt-token limit's slice is fetched at the same time (its
        check follows tokenization)."""
        if self.shared is not None and tenant.token_bucket is not None:
            # The prompt-token check needs the prompt's tokens: its slice is fetched now,
            # beside the body's work too.
            self.shared.warm(tenant.name, "prompt_tokens", tenant.token_bucket.rate,
                             tenant.token_bucket.burst)
        if tenant.bucket is None:
            return None
        pending = self._take(tenant, "requests", 1.0)
        return None if pending is None else asyncio.ensure_future(pending)

    def _take(self, tenant: Tenant, limit: str, cost: float) -> Coroutine | None:
        """Take ``cost`` from ``tenant``'s ``limit`` ("requests" or "prompt_tokens"), the one
        way every limit check goes: ``None`` when decided at once (a 429 raised, counted),
        else a coroutine to await that asks the fleet's bucket in Redis.

        Without shared state the local bucket decides. With it, this instance's slice of
        the fleet bucket, a refusal it already knows or credit decide without Redis, and
        synchronously: no task, no turn of the loop (which costs milliseconds on a busy
        host); else Redis is asked, and the local bucket decides while Redis cannot
        answer."""
        try:
            if self.shared is None:
                self._take_local(tenant, limit, cost)
                return None
            bucket = tenant.bucket if limit == "requests" else tenant.token_bucket
            buckets = [(limit, bucket.rate, bucket.burst, cost)]
            wait = self.shared.take_local(tenant.name, buckets)
            if wait is None:
                return self._take_fleet(tenant, buckets)
            if wait > 0:
                raise self._refusal(tenant, limit, cost, wait)
            return None
        except GatewayError:
            self.metrics.rate_limited.labels(tenant.name).inc()
            raise

    async def _take_fleet(self, tenant: Tenant,
                          buckets: list[tuple[str, float, float, float]]) -> None:
        """:meth:`_take` when Redis must be asked."""
        limit, _, _, cost = buckets[0]
        try:
            wait = await self.shared.take(tenant.name, buckets)
            if wait is None:
                self._take_local(tenant, limit, cost)
            elif wait > 0:
                raise self._refusal(tenant, limit, cost, wait)
        except GatewayError:
            self.metrics.rate_limited.labels(tenant.name).inc()
            raise

    def _take_local(self, tenant: Tenant, limit: str, cost: float) -> None:
        """This instance's own bucket (no shared state, or Redis cannot answer)."""
        if limit == "requests":
            self.tenants.check_rate(tenant)
        else:
            self.tenants.check_prompt_tokens(tenant, int(cost))

    def _refusal(self, tenant: Tenant, limit: str, cost: float, wait: float) -> GatewayError:
        if limit == "requests":
            return self.tenants.rate_error(tenant, wait)
        return self.tenants.token_rate_error(tenant, int(cost), wait)

    async def admit(self, endpoint: str, tenant: Tenant, raw: bytes, request_id: str = "",
                    rate_check: asyncio.Future | None = None
                    ) -> tuple[CheckedRequest, list[Backend], PreparedPrompt]:
        """From an authenticated tenant's raw body to a request ready to route: the body
        checked and salted (:func:`check_request`), the replicas serving its model (waiting
        for one to join when none does yet: :meth:`_replicas_for`), the prompt's block keys,
        and a slot in the admission queue (the caller releases it, through
        :meth:`_job_done`). Raises :class:`GatewayError` for what the caller sent or a full
        queue. The HTTP gateway and the Envoy Endpoint Picker both come through here, so a
        request is prepared the same way whichever body receives it."""
        body = parse_json_body(raw)
        checked = check_request(endpoint, body, tenant, self.tenants,
                                self.config.caller_cache_salt)
        backends = self.pool.serving(checked.model) or await self._replicas_for(checked.model)
        adapter = next((b.adapters[checked.model] for b in backends
                        if checked.model in b.adapters), None)
        # Large bodies are tokenized and hashed on a worker thread, to keep the loop (and
        # every stream) moving; tokenization: backend awaits a replica's render first.
        offload = len(raw) > OFFLOAD_PREPARE_BYTES
        tracing = self.tracing
        if tracing is None or not request_id:
            prompt = await self.prompts.prepare_async(checked, adapter, backends, offload=offload)
        else:
            with tracing.span(request_id, "prompt.prepare") as span:
                prompt = await self.prompts.prepare_async(checked, adapter, backends,
                                                          offload=offload)
                span.set_attribute("prefixroute.prompt_tokens", prompt.num_tokens)
                span.set_attribute("prefixroute.tokenization", prompt.mode)
        if prompt.fallback_reason:
            self.metrics.tokenize_fallbacks.inc()
        if rate_check is not None or tenant.token_bucket is not None:
            # What the limit checks add to the request's path: the wait for the request
            # limit's answer once the body is ready, and the prompt-token check.
            waited = time.perf_counter()
            if rate_check is not None:
                await rate_check
            if tenant.token_bucket is not None:
                await self.check_prompt_tokens(tenant, prompt.num_tokens)
            if self.shared is not None:
                self.shared.observe_limit_wait(time.perf_counter() - waited)
        elif self.shared is not None and tenant.bucket is not None:
            self.shared.observe_limit_wait(0.0)  # decided by the slice held, at arrival
        await self.admission.acquire()
        return checked, backends, prompt

    async def check_prompt_tokens(self, tenant: Tenant, prompt_tokens: int) -> None:
        """Take the prompt's tokens from ``tenant``'s prompt-token limit, or raise 429
        (counted). Checked once the prompt is tokenized, so a request refused here has
        already taken its request token (as a refused request does with one gateway). With
        shared state the bucket is the whole fleet's (:meth:`_take`)."""
        if tenant.token_bucket is not None:
            pending = self._take(tenant, "prompt_tokens", float(prompt_tokens))
            if pending is not None:
                await pending

    def _job_done(self, job: Job) -> None:
        self.admission.release()
        self.open_requests -= 1
        endpoint = job.checked.endpoint
        if job.ttft_s is not None:
            self.metrics.ttft.labels(endpoint).observe(job.ttft_s)
        if self.recorder is not None:
            self.recorder.record(job, self.clock.now())
        self._account(endpoint, job.status, job.started, job.request_id, job.tenant, job=job)

    def _account(self, endpoint: str, status: str, started: float, request_id: str,
                 tenant: str, *, error: str | None = None, job: Job | None = None) -> None:
        latency = self.clock.now() - started
        if self.tracing is not None:
            self.tracing.request_ended(request_id, status, tenant=tenant, model=None if job
                                       is None else job.checked.model,
                                       replica=None if job is None else job.replica)
        self.metrics.requests.labels(endpoint, status).inc()
        self.metrics.latency.labels(endpoint).observe(latency)
        if not log.isEnabledFor(logging.INFO):  # the line would be dropped: skip its fields
            return
        fields: dict[str, Any] = {"event": "request", "request_id": request_id,
                                  "endpoint": endpoint, "tenant": tenant, "status": status,
                                  "latency_ms": round(latency * 1000, 3)}
        if job is not None:
            fields.update({"model": job.checked.model, "stream": job.checked.stream,
                           "replica": job.replica, "attempts": job.attempts,
                           "prompt_tokens": job.prompt.num_tokens,
                           "tokenization": job.prompt.mode,
                           "predicted_cached_tokens": job.predicted_cached_tokens,
                           "cached_tokens": job.cached_tokens,
                           "ttft_ms": None if job.ttft_s is None else round(job.ttft_s * 1000, 3)})
            if job.failures:
                fields["failures"] = job.failures
        if error is not None:
            fields["error"] = error
        log.info("request", extra={"fields": fields})

    async def _read_body(self, request: Request) -> bytes:
        limit = self.config.limits.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                raise GatewayError(400, "bad Content-Length header",
                                   code="invalid_body") from None
            if size > limit:
                raise GatewayError(413, f"the request body is {size} bytes; the limit is "
                                   f"{limit}", code="body_too_large")
        chunks = []
        total = 0
        timeout_s = self.config.limits.body_timeout_s
        try:
            async with asyncio.timeout(timeout_s):
                async for chunk in request.stream():
                    total += len(chunk)
                    if total > limit:
                        raise GatewayError(413, f"the request body exceeds the limit of "
                                           f"{limit} bytes", code="body_too_large")
                    chunks.append(chunk)
        except ClientDisconnect:
            raise GatewayError(400, "the client closed the connection while sending the body",
                               code="client_disconnected") from None
        except TimeoutError:  # the connection closes: the rest of the body would follow
            raise GatewayError(408, f"the request body did not arrive within {timeout_s:g} s",
                               code="request_timeout",
                               headers={"connection": "close"}) from None
        return b"".join(chunks)

    # -- other endpoints ------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        try:
            self.tenants.authenticate(request.headers.get("authorization"))
        except GatewayError as error:
            return error.response()
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "prefixroute"}
                for name in self.pool.models()]
        return JSONResponse({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        backends = self.pool.backends
        up = sum(1 for b in backends if b.available())
        if self.draining:
            status, code = "draining", 503
        elif up == len(backends):
            status, code = "ok", 200
        elif up:
            status, code = "degraded", 200
        else:
            status, code = "unavailable", 503
        return JSONResponse({"status": status, "replicas_available": up,
                             "replicas": len(backends)}, status_code=code)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    async def debug_decisions(self, request: Request) -> Response:
        try:
            tenant = self.tenants.authenticate(request.headers.get("authorization"))
            text = request.query_params.get("n", str(DEFAULT_DECISIONS_SHOWN))
            try:
                n = int(text)
            except ValueError:
                raise GatewayError(400, f"n must be an integer, got {text!r}", param="n",
                                   code="invalid_value") from None
            if n < 1:
                raise GatewayError(400, "n must be at least 1", param="n", code="invalid_value")
        except GatewayError as error:
            return error.response()
        n = min(n, self.config.decisions_kept)
        out: dict[str, Any] = {
            "policy": self.config.policy, "block_size": self.config.hashing.block_size,
            "tokenization": self.prompts.mode if self.prompts.mode != CHARS
            else "character blocks",
            "decisions": self.router.recent(n, None if tenant.admin else tenant.name)}
        if tenant.admin:
            out["replicas"] = [b.status() for b in self.pool.backends]
        return JSONResponse(out)

    # -- errors ---------------------------------------------------------------------------

    async def _http_exception(self, request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            error = GatewayError(404, f"no such endpoint: {request.method} {request.url.path}",
                                 code="unknown_url")
        elif exc.status_code == 405:
            error = GatewayError(405, f"method {request.method} is not allowed on "
                                 f"{request.url.path}", code="method_not_allowed")
        else:
            error = GatewayError(exc.status_code, str(exc.detail))
        return error.response()

    async def _unexpected(self, request: Request, exc: Exception) -> Response:
        log.error("unexpected error", exc_info=exc, extra={"fields": {
            "event": "internal_error", "path": request.url.path}})
        return GatewayError(500, "internal error in the gateway; the request was not "
                            "completed", code="internal_error").response()


class GenerationFastPath:
    """The ASGI app: ``POST`` to a generation endpoint goes straight to its handler, everything
    else (other endpoints, other methods, 404s, lifespan) through Starlette.

    Starlette's router and middleware add a regex match per route and two wrapper frames to
    every send, a stream's events included: a visible share of a proxied request's CPU
    (benchmarks/gateway_bench.py). The handlers answer every error themselves (an
    OpenAI-style object, a 500 for bugs of ours), so nothing of Starlette's is lost here."""

    def __init__(self, app: Starlette, handlers: dict[str, Any]):
        self.app = app
        self.handlers = handlers

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            handler = self.handlers.get(scope["path"])
            if handler is not None:
                token = caller_send.set(send)  # a stream splices into the caller's connection
                try:
                    response = await handler(Request(scope, receive))
                finally:
                    caller_send.reset(token)
                await send_response(response, scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(config: GatewayConfig, **kwargs: Any) -> GenerationFastPath:
    """The ASGI app of a :class:`Gateway` (``kwargs`` as its constructor)."""
    return Gateway(config, **kwargs).app


__all__ = ["Gateway", "create_app"]
