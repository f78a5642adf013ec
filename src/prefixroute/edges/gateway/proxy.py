"""Sending one request to the replicas: route, send, retry, relay.

An attempt that fails before the first byte reaches the caller (connect error, timeout, a 5xx
answer, a stream that breaks before its first event) is retried on a replica not yet tried, up
to ``retries`` more times. For a stream, the gateway reads the replica's first event *before*
answering the caller, so a replica that accepts the connection and then fails is still
retried. Once bytes have reached the caller, a failure ends the stream with an OpenAI-style
error event (``data: {"error": ...}``, then ``data: [DONE]``): the caller is never left with a
silently truncated answer.

Streams pass through event by event as the replica sends them. The gateway asks the replica for
the usage chunk (``stream_options.include_usage``) to learn ``cached_tokens``, and drops that
chunk again when the caller did not ask for it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from starlette.responses import Response, StreamingResponse

from prefixroute.core.clock import Clock
from prefixroute.edges.gateway.backends import Backend
from prefixroute.edges.gateway.errors import GatewayError, sse_error
from prefixroute.edges.gateway.metrics import GatewayMetrics
from prefixroute.edges.gateway.prompts import PreparedPrompt
from prefixroute.edges.gateway.router import Attempt, GatewayRouter
from prefixroute.edges.gateway.sanitize import CHAT, CheckedRequest
from prefixroute.edges.http1 import Client, HttpxClient, RequestTimeout, TransportError
from prefixroute.edges.http1 import Response as Upstream  # a replica's answer, body pending

log = logging.getLogger("prefixroute.gateway")

PATHS = {CHAT: "/v1/chat/completions", "completions": "/v1/completions"}
_ERROR_SNIPPET = 300


@dataclass(slots=True)
class Job:
    """One accepted request on its way through the gateway."""

    request_id: str
    tenant: str
    checked: CheckedRequest
    prompt: PreparedPrompt
    backends: list[Backend]
    started: float
    attempts: int = 0
    failures: list[str] = field(default_factory=list)
    replica: str | None = None
    status: str = "pending"
    ttft_s: float | None = None
    cached_tokens: int | None = None
    predicted_cached_tokens: int | None = None


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always closes its relay, however the send ends (client
    gone, server shutting down, or never started): the upstream response and the request's
    slot are released at once rather than whenever the generator is collected."""

    def __init__(self, relay: "SSERelay", **kwargs: Any):
        super().__init__(relay.events(), **kwargs)
        self.relay = relay

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        try:
            await self._send_watching_disconnect(receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
            await self.relay.close()

    async def _send_watching_disconnect(self, receive, send) -> None:
        """Starlette's loop, with one plain task watching for the caller leaving instead of an
        anyio task group per stream (a visible share of a proxied stream's CPU): when the
        caller disconnects, the relay is cancelled, which aborts the replica's request."""
        task = asyncio.current_task()
        assert task is not None
        left = False

        async def watch() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            task.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not left or task.uncancel() > 0:  # cancelled by someone else as well
                raise
        finally:
            watcher.cancel()


class Proxy:
    def __init__(self, client: Client | HttpxClient, router: GatewayRouter,
                 metrics: GatewayMetrics, clock: Clock, *, retries: int, block_size: int):
        self.client = client  # edges/http1.py's client, or httpx behind its interface (tests)
        self.router = router
        self.metrics = metrics
        self.clock = clock
        self.retries = retries
        self.block_size = block_size
        self._urls: dict[tuple[int, str], str] = {}

    def _url(self, backend: Backend, path: str) -> str:
        key = (backend.index, path)
        url = self._urls.get(key)
        if url is None:
            url = self._urls[key] = backend.url + path
        return url

    async def forward(self, job: Job, on_done: Callable[[Job], None]) -> Response:
        """Answer ``job``: the replica's response, relayed, or a clear error.

        ``on_done(job)`` runs exactly once, when the answer is complete (for a stream: when the
        stream ends, however it ends)."""
        handed_off = False
        try:
            response = await self._attempts(job, on_done)
            handed_off = isinstance(response, ClosingStreamingResponse)
            return response
        except Exception:  # a bug of ours: the app answers 500; count it as that
            job.status = "500"
            raise
        finally:
            if not handed_off:
                on_done(job)

    async def _attempts(self, job: Job, on_done: Callable[[Job], None]) -> Response:
        body = job.checked.body
        payload = json.dumps(body, ensure_ascii=False).encode()
        path = PATHS[job.checked.endpoint]
        tried: set[int] = set()
        last_5xx: tuple[int, bytes, str] | None = None
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        routing_key = body.get("prompt_cache_key") or body.get("user")
        for attempt_no in range(self.retries + 1):
            candidates = [b for b in job.backends if b.index not in tried and b.available()]
            if not candidates:  # health checks may lag a recovery; the breaker still guards
                candidates = [b for b in job.backends
                              if b.index not in tried and b.breaker.available()]
            if not candidates:
                break
            if attempt_no:
                self.metrics.retries.labels(job.failures[-1].split(":", 1)[0]).inc()
            attempt = self.router.route(
                request_id=job.request_id, tenant=job.tenant, model=job.checked.model,
                prompt=job.prompt, block_size=self.block_size, candidates=candidates,
                attempt=attempt_no, routing_key=routing_key if isinstance(routing_key, str)
                else None, max_tokens=max_tokens if isinstance(max_tokens, int) else None)
            backend = attempt.backend
            tried.add(backend.index)
            job.attempts += 1
            job.replica = backend.name
            job.predicted_cached_tokens = attempt.predicted_cached_tokens
            try:
                outcome = await self._attempt(job, attempt, path, payload, on_done)
            except BaseException:
                # Cancelled (the server is stopping, the caller left) or a bug: the replica's
                # count, breaker trial and view must not keep this attempt forever.
                self.router.abandoned(attempt, started=False)
                raise
            if isinstance(outcome, Response):
                return outcome
            if outcome is not None:
                last_5xx = outcome

        if last_5xx is not None and _is_openai_error(last_5xx[1]):
            job.status = str(last_5xx[0])
            return Response(last_5xx[1], status_code=last_5xx[0],
                            headers={"x-request-id": job.request_id},
                            media_type=last_5xx[2] or "application/json")
        tried_text = "; ".join(job.failures) if job.failures else "none is available"
        error = GatewayError(503 if last_5xx is None else 502,
                             f"no replica could serve model {job.checked.model!r} after "
                             f"{job.attempts} attempt(s): {tried_text}",
                             code="replicas_unavailable", headers={"retry-after": "1"})
        job.status = str(error.status)
        return error.response(job.request_id)

    async def _attempt(self, job: Job, attempt: Attempt, path: str, payload: bytes,
                       on_done: Callable[[Job], None]) -> Response | tuple[int, bytes, str] | None:
        """Send one attempt. A response ends the request; a (status, body, content type) is a
        5xx worth retrying; ``None`` a failure worth retrying."""
        backend = attempt.backend
        headers = {"content-type": "application/json", "x-request-id": job.request_id,
                   **backend.headers}
        try:
            upstream = await self.client.request("POST", self._url(backend, path),
                                                 body=payload, headers=headers)
        except RequestTimeout:
            self._failed(job, attempt, "timeout", "timed out waiting for the replica")
            return None
        except TransportError as exc:
            self._failed(job, attempt, "connect", f"{type(exc).__name__}: {exc}")
            return None
        try:
            return await self._answer(job, attempt, upstream, on_done)
        except BaseException:
            await upstream.aclose()
            raise

    async def _answer(self, job: Job, attempt: Attempt, upstream: Upstream,
                      on_done: Callable[[Job], None]) -> Response | tuple[int, bytes, str] | None:
        status = upstream.status
        if status >= 500:
            content = await _read_quietly(upstream)
            self._failed(job, attempt, f"http_{status}", content[:_ERROR_SNIPPET].decode(
                "utf-8", "replace"))
            return (status, content, upstream.headers.get("content-type", ""))
        if status >= 400:  # the replica refused the request itself: pass it on, no retry
            content = await _read_quietly(upstream)
            self.router.refused(attempt)
            job.status = str(status)
            return Response(content, status_code=status, headers=_reply_headers(
                upstream, job), media_type=upstream.headers.get("content-type"))

        if job.checked.stream:
            chunks = upstream.aiter_raw()
            try:
                first = await _first_chunk(chunks)
            except TransportError as exc:
                await upstream.aclose()
                reason = "timeout" if isinstance(exc, RequestTimeout) else "stream"
                self._failed(job, attempt, reason, f"stream broke before its first "
                             f"event: {type(exc).__name__}")
                return None
            self.router.first_byte(attempt)
            relay = SSERelay(job, attempt, upstream, chunks, first, self, on_done)
            return ClosingStreamingResponse(relay, status_code=status,
                                            headers=_reply_headers(upstream, job),
                                            media_type="text/event-stream")
        try:
            content = await upstream.aread()
        except TransportError as exc:
            await upstream.aclose()
            reason = "timeout" if isinstance(exc, RequestTimeout) else "read"
            self._failed(job, attempt, reason, f"response broke: {type(exc).__name__}")
            return None
        self.router.first_byte(attempt)
        usage = _usage_of(content)
        self.router.succeeded(attempt, usage)
        job.cached_tokens = attempt.record.reported_cached_tokens
        job.status = str(status)
        return Response(content, status_code=status, headers=_reply_headers(upstream, job),
                        media_type=upstream.headers.get("content-type", "application/json"))

    def _failed(self, job: Job, attempt: Attempt, reason: str, detail: str) -> None:
        self.router.failed(attempt, reason)
        job.failures.append(f"{reason}: {attempt.backend.name}: {detail}")
        log.warning("attempt failed", extra={"fields": {
            "event": "attempt_failed", "request_id": job.request_id,
            "replica": attempt.backend.name, "reason": reason, "detail": detail[:200],
            "attempt": job.attempts}})


class SSERelay:
    """Relays one replica stream to the caller, event by event."""

    def __init__(self, job: Job, attempt: Attempt, upstream: Upstream,
                 chunks: AsyncIterator[bytes], first: bytes, proxy: Proxy,
                 on_done: Callable[[Job], None]):
        self.job = job
        self.attempt = attempt
        self.upstream = upstream
        self.chunks = chunks
        self.first = first
        self.proxy = proxy
        self.on_done = on_done
        self.usage: dict | None = None
        self._closed = False

    async def close(self) -> None:
        """Release everything once: the attempt (as abandoned if it did not end), the upstream
        response, and the job (``on_done``)."""
        if self._closed:
            return
        self._closed = True
        if not self.attempt.finished:
            self.proxy.router.abandoned(self.attempt, started=True)
            self.job.status = "client_closed"
        try:
            await self.upstream.aclose()
        finally:
            self.on_done(self.job)

    async def events(self) -> AsyncIterator[bytes]:
        job, proxy = self.job, self.proxy
        buffer = b""
        sent_any = False
        try:
            chunks = self.chunks
            pending = self.first
            while True:
                buffer += pending
                # Every complete event that arrived goes out in one write (what one read
                # brought, usually one event); only a run with the usage chunk is split up.
                cut = buffer.rfind(b"\n\n")
                if cut >= 0:
                    complete, buffer = buffer[:cut + 2], buffer[cut + 2:]
                    if b'"usage"' in complete:
                        complete = b"".join(
                            out for out in map(self._filter, _events_of(complete)) if out)
                    if complete:
                        if not sent_any:
                            sent_any = True
                            job.ttft_s = proxy.clock.now() - job.started
                        if b"data: [DONE]" in complete:
                            # The answer is whole once [DONE] is out: record success before
                            # yielding it, since a caller that has it may hang up at once and
                            # the generator then never gets past this yield.
                            self._succeed()
                        yield complete
                try:
                    pending = await chunks.__anext__()
                except StopAsyncIteration:
                    break
            if buffer.strip():
                yield buffer
            self._succeed()
        except TransportError as exc:
            # Bytes already reached the caller: no retry possible, so say so in the stream.
            reason = "timeout" if isinstance(exc, RequestTimeout) else "stream"
            proxy._failed(job, self.attempt, reason, f"stream broke midway: "
                          f"{type(exc).__name__}")
            job.status = "stream_error"
            yield sse_error(f"the replica's stream broke midway ({type(exc).__name__}); the "
                            "answer is incomplete", code="stream_interrupted")
        finally:
            await self.close()

    def _succeed(self) -> None:
        if self.attempt.finished:
            return
        self.proxy.router.succeeded(self.attempt, self.usage)
        self.job.cached_tokens = self.attempt.record.reported_cached_tokens
        self.job.status = "200"

    def _filter(self, event: bytes) -> bytes | None:
        """Pick up usage; drop the usage-only chunk the caller did not ask for."""
        if b'"usage"' not in event or b'"prompt_tokens"' not in event:
            return event
        data = event.strip()
        if data.startswith(b"data:"):
            try:
                obj = json.loads(data[5:])
            except ValueError:
                return event
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if not self.job.checked.caller_wants_usage:
                    if not obj.get("choices"):
                        return None
                    obj["usage"] = None
                    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"
        return event


def _events_of(data: bytes) -> list[bytes]:
    """``data`` (whole events only) cut into events, each with its ``\\n\\n``."""
    return [part + b"\n\n" for part in data[:-2].split(b"\n\n")]


async def _first_chunk(chunks: AsyncIterator[bytes]) -> bytes:
    """The first non-empty chunk (b"" if the stream ends first)."""
    while True:
        try:
            chunk = await chunks.__anext__()
        except StopAsyncIteration:
            return b""
        if chunk:
            return chunk


async def _read_quietly(upstream: Upstream) -> bytes:
    try:
        return await upstream.aread()
    except TransportError:
        return b""
    finally:
        await upstream.aclose()


def _usage_of(content: bytes) -> dict | None:
    if b'"usage"' not in content:
        return None
    try:
        obj = json.loads(content)
    except ValueError:
        return None
    usage = obj.get("usage") if isinstance(obj, dict) else None
    return usage if isinstance(usage, dict) else None


def _is_openai_error(content: bytes) -> bool:
    try:
        obj = json.loads(content)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) \
        and isinstance(obj["error"].get("message"), str)


def _reply_headers(upstream: Upstream, job: Job) -> dict[str, str]:
    headers = {"x-request-id": job.request_id}
    if job.checked.stream:
        headers["cache-control"] = "no-cache"
    return headers

