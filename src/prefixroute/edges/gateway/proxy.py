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

Two drivers relay a stream, sharing the per-event logic (:class:`SSERelay`'s ``take``, ``tail``
and ``broke``):

* *spliced* (served by uvicorn's httptools protocol behind our own protocol,
  ``guard.HeadGuard``, which holds the caller's transport; replicas through
  ``edges/http1.py``): once the replica's headers are in, its connection's data callback
  hands each body chunk to a sink that frames it as an HTTP/1.1 chunk and writes it straight
  to the caller's transport: no task wake-up, no generator, no ASGI message per event. The first event too:
  the sink starts the response with uvicorn's own ``send`` (run to completion in place) and
  writes the event, in the same write as the response head, inside the engine step's burst
  of events, not after it; until then the request's task waits, and retries if the stream
  breaks before its first event. When the caller's write buffer is full, reading the
  replica pauses until it drains. The response's start and end go through uvicorn's
  ``send``, so its connection state (keep-alive, completion) stays its own. Nothing of
  uvicorn's is read but what its ASGI ``send`` does: the transport, its flow control and the
  disconnect are the guard's own (``guard.connection``);
* *generic* (any other ASGI server, in-process test clients, an httpx transport): an async
  generator under a ``StreamingResponse``.
"""

from __future__ import annotations

import asyncio
import logging
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import orjson
from starlette.responses import Response, StreamingResponse

from prefixroute.core.clock import Clock
from prefixroute.edges.gateway.backends import Backend, candidates_for
from prefixroute.edges.gateway.errors import GatewayError, sse_error
from prefixroute.edges.gateway.guard import HeadGuard, connection
from prefixroute.edges.gateway.metrics import GatewayMetrics
from prefixroute.edges.gateway.prompts import PreparedPrompt
from prefixroute.edges.gateway.router import Attempt, GatewayRouter
from prefixroute.edges.gateway.sanitize import CHAT, CheckedRequest, encode_json
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
    usage: dict | None = None  # the answer's usage object, when it had one


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that always closes its relay, however the send ends (client
    gone, server shutting down, or never started): the upstream response and the request's
    slot are released at once rather than whenever the generator is collected. Spliced when
    the server and the upstream allow it (module docstring), else a generator."""

    def __init__(self, relay: "SSERelay", **kwargs: Any):
        super().__init__(relay.events(), **kwargs)
        self.relay = relay
        self.sink: _SpliceSink | None = None  # set when spliced from the first event on

    def start_message(self) -> dict:
        return {"type": "http.response.start", "status": self.status_code,
                "headers": self.raw_headers}

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
        self.relay.task = task  # a shutdown cuts a generic stream by cancelling it
        try:
            caller = None if self.sink is not None or not hasattr(
                self.relay.upstream, "splice") else connection.get()
            if self.sink is not None:  # spliced since the first event
                await self.relay.finish_splice(self.sink, send)
            elif caller is None:
                await self.stream_response(send)
            else:
                if await _start_chunked(caller, send, self.start_message()):
                    await self.relay.splice(caller, send)
                else:  # not what this splice was written for: relay as Starlette would
                    async for chunk in self.body_iterator:
                        await send({"type": "http.response.body", "body": chunk,
                                    "more_body": True})
                    await send({"type": "http.response.body", "body": b"",
                                "more_body": False})
        except asyncio.CancelledError:
            cut = self.relay.cut_event
            if not (left or cut is not None) or task.uncancel() > 0:  # cancelled otherwise
                raise
            if not left:  # the server is stopping: the stream ends with the error event
                await send({"type": "http.response.body", "body": cut, "more_body": False})
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
        self.streams: set[SSERelay] = set()  # open streams, for a shutdown to cut
        self.cut_by_shutdown = 0  # streams cut so far

    def cut_streams(self) -> int:
        """The server is stopping: end every open stream with an error event that says so
        (``server_shutdown``) and ``data: [DONE]``; the replicas' requests are aborted as
        for a caller that left. Returns how many were cut."""
        cut = 0
        for relay in list(self.streams):
            if relay.cut():
                cut += 1
        self.cut_by_shutdown += cut
        return cut

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
        payload = encode_json(body)
        path = PATHS[job.checked.endpoint]
        tried: set[int] = set()
        last_5xx: tuple[int, bytes, str] | None = None
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        routing_key = body.get("prompt_cache_key") or body.get("user")
        for attempt_no in range(self.retries + 1):
            candidates = candidates_for(job.backends, tried)
            if not candidates:
                break
            if attempt_no:
                self.metrics.retries.labels(job.failures[-1].split(":", 1)[0]).inc()
            attempt = self.router.route(
                request_id=job.request_id, tenant=job.tenant, model=job.checked.model,
                prompt=job.prompt, block_size=self.block_size, candidates=candidates,
                attempt=attempt_no, routing_key=routing_key if isinstance(routing_key, str)
                else None, max_tokens=max_tokens if isinstance(max_tokens, int) else None,
                arrival=job.started)
            backend = attempt.backend
            tried.add(backend.index)
            job.attempts += 1
            job.replica = backend.name
            job.predicted_cached_tokens = attempt.predicted_cached_tokens
            send = payload
            priority = self.router.upstream_priority(attempt, job.started)
            if priority is not None:  # this replica orders its queue by it
                attempt.record.priority = priority
                if "priority" in body or not payload.endswith(b"}") or len(payload) < 3:
                    send = encode_json({**body, "priority": priority})  # the caller's replaced
                else:  # appended to the encoded object: no second encoding of a long prompt
                    send = payload[:-1] + b',"priority":%d}' % priority
            try:
                outcome = await self._attempt(job, attempt, path, send, on_done)
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
                   **backend.headers, **attempt.trace_headers}
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
            caller = connection.get() if hasattr(upstream, "splice") else None
            send = caller_send.get()
            if caller is not None and send is not None:
                return await self._spliced_stream(job, attempt, upstream, status, on_done,
                                                  caller, send)
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
        self.router.first_byte(attempt, whole=True)
        usage = _usage_of(content)
        self.router.succeeded(attempt, usage)
        job.cached_tokens = attempt.record.reported_cached_tokens
        job.usage = usage
        job.status = str(status)
        return Response(content, status_code=status, headers=_reply_headers(upstream, job),
                        media_type=upstream.headers.get("content-type", "application/json"))

    async def _spliced_stream(self, job: Job, attempt: Attempt, upstream: Upstream,
                              status: int, on_done: Callable[[Job], None], caller: HeadGuard,
                              send: Callable[[dict], Any]) -> ClosingStreamingResponse | None:
        """A stream spliced from its first event on: the replica connection's data callback
        starts the response and writes the first event itself, inside the engine step's
        burst of events rather than after it (waking this task would queue it behind every
        event of the burst); this task wakes to return the response, or to retry when the
        stream breaks before its first event."""
        relay = SSERelay(job, attempt, upstream, None, b"", self, on_done)
        response = ClosingStreamingResponse(relay, status_code=status,
                                            headers=_reply_headers(upstream, job),
                                            media_type="text/event-stream")
        sink = relay.sink = _SpliceSink(relay, caller, send, response.start_message())
        woken = sink.wake = asyncio.get_running_loop().create_future()
        upstream.splice(sink)  # type: ignore[attr-defined]
        try:
            if not (sink.started or sink.finished or sink.pending):
                await woken
        except BaseException:
            self.streams.discard(relay)
            raise
        finally:
            sink.wake = None
        if not sink.started and (sink.error is not None or sink.failure is not None):
            self.streams.discard(relay)  # not a stream the caller will see
        if not sink.started and sink.error is not None:
            await upstream.aclose()
            reason = "timeout" if isinstance(sink.error, RequestTimeout) else "stream"
            self._failed(job, attempt, reason, f"stream broke before its first event: "
                         f"{type(sink.error).__name__}")
            return None
        if not sink.started and sink.failure is not None:
            raise sink.failure
        self.router.first_byte(attempt)
        response.sink = sink
        return response

    def _failed(self, job: Job, attempt: Attempt, reason: str, detail: str) -> None:
        self.router.failed(attempt, reason)
        job.failures.append(f"{reason}: {attempt.backend.name}: {detail}")
        log.warning("attempt failed", extra={"fields": {
            "event": "attempt_failed", "request_id": job.request_id,
            "replica": attempt.backend.name, "reason": reason, "detail": detail[:200],
            "attempt": job.attempts}})


class SSERelay:
    """Relays one replica stream to the caller, event by event.

    ``take``, ``tail`` and ``broke`` are the per-event logic both drivers share: what to pass
    on for bytes just received, at the stream's end, and when the replica's stream breaks.
    :meth:`events` is the generic driver, :meth:`splice` the spliced one."""

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
        self.buffer = b""
        self.sent_any = False
        self._closed = False
        self.sink: _SpliceSink | None = None  # the spliced driver's, once it has one
        self.task: asyncio.Task | None = None  # the generic driver's, once it runs
        self.cut_event: bytes | None = None  # set when a shutdown cut the stream
        proxy.streams.add(self)

    async def close(self) -> None:
        """Release everything once: the attempt (as abandoned if it did not end), the upstream
        response, and the job (``on_done``)."""
        if self._closed:
            return
        self._closed = True
        self.proxy.streams.discard(self)
        if not self.attempt.finished:
            self.proxy.router.abandoned(self.attempt, started=True)
            self.job.status = "client_closed" if self.cut_event is None else "server_shutdown"
        try:
            await self.upstream.aclose()
        finally:
            self.on_done(self.job)

    def cut(self) -> bool:
        """End the stream now with a ``server_shutdown`` error event and ``data: [DONE]``
        (:meth:`Proxy.cut_streams`); ``False`` if it was ending anyway."""
        if self._closed or self.attempt.finished or self.cut_event is not None:
            return False
        self.cut_event = sse_error("the gateway is shutting down; the answer is incomplete",
                                   "service_unavailable", code="server_shutdown")
        if self.sink is not None:
            self.sink.cut(self.cut_event)
        elif self.task is not None:
            self.task.cancel()
        # else not handed to a driver yet: the one that takes it sends the cut first
        return True

    # -- the per-event logic --

    def take(self, data: bytes) -> bytes:
        """What goes to the caller for ``data`` just received: every complete event in one
        piece (what one read brought, usually one event), the usage chunk filtered; an
        incomplete event waits for the rest."""
        buffer = self.buffer + data if self.buffer else data
        cut = buffer.rfind(b"\n\n")
        if cut < 0:
            self.buffer = buffer
            return b""
        if cut + 2 == len(buffer):
            complete, self.buffer = buffer, b""
        else:
            complete, self.buffer = buffer[:cut + 2], buffer[cut + 2:]
        at = complete.find(b'"usage"')
        if at >= 0:
            # The events before the first that mentions usage pass as they are (as _filter
            # would pass them): a read that brought a whole short answer is not cut up.
            cut = complete.rfind(b"\n\n", 0, at)
            start = cut + 2 if cut >= 0 else 0
            complete = complete[:start] + b"".join(
                out for out in map(self._filter, _events_of(complete[start:])) if out)
        if complete:
            if not self.sent_any:
                self.sent_any = True
                self.job.ttft_s = self.proxy.clock.now() - self.job.started
            if b"data: [DONE]" in complete:
                # The answer is whole once [DONE] is out: record success before it goes,
                # since a caller that has it may hang up at once.
                self._succeed()
        return complete

    def tail(self) -> bytes:
        """The replica's stream ended: what is left to pass on (a last event without its
        blank line); the attempt succeeded."""
        rest, self.buffer = self.buffer, b""
        self._succeed()
        return rest if rest.strip() else b""

    def broke(self, exc: TransportError) -> bytes:
        """The replica's stream broke after bytes reached the caller: no retry is possible,
        so the error event that says so in the stream."""
        reason = "timeout" if isinstance(exc, RequestTimeout) else "stream"
        self.proxy._failed(self.job, self.attempt, reason,
                           f"stream broke midway: {type(exc).__name__}")
        self.job.status = "stream_error"
        return sse_error(f"the replica's stream broke midway ({type(exc).__name__}); the "
                         "answer is incomplete", code="stream_interrupted")

    # -- the drivers --

    async def events(self) -> AsyncIterator[bytes]:
        """The generic driver: an async generator over the upstream's body."""
        try:
            if self.cut_event is not None:  # cut before the response started
                yield self.cut_event
                return
            out = self.take(self.first)
            if out:
                yield out
            chunks = self.chunks
            while True:
                try:
                    data = await chunks.__anext__()
                except StopAsyncIteration:
                    break
                out = self.take(data)
                if out:
                    yield out
            out = self.tail()
            if out:
                yield out
        except TransportError as exc:
            yield self.broke(exc)
        finally:
            await self.close()

    async def splice(self, caller: HeadGuard, send: Callable[[dict], Awaitable[None]]) -> None:
        """The spliced driver, once uvicorn has sent the response start (chunked): the first
        event goes out here, every later one from the replica connection's data callback
        (:class:`_SpliceSink`)."""
        sink = self.sink = _SpliceSink(self, caller, send)
        if self.cut_event is not None:  # cut before the response started
            sink.cut(self.cut_event)
        sink.on_body(self.first)
        self.upstream.splice(sink)  # type: ignore[attr-defined]
        await self.finish_splice(sink, send)

    async def finish_splice(self, sink: "_SpliceSink",
                            send: Callable[[dict], Awaitable[None]]) -> None:
        """The rest of a spliced stream: this task only wakes to start the response if the
        data callback could not, to wait for the caller's buffer to drain, and to send the
        end through uvicorn."""
        caller = sink.caller
        if not sink.started:
            await send(sink.start)
            sink.started = True
            if sink.pending:
                pending, sink.pending = sink.pending, b""
                sink.write(pending)
        loop = asyncio.get_running_loop()
        while not sink.finished or sink.paused:
            if sink.paused:
                await caller.drain()
                sink.paused = False
                if not caller.disconnected and not sink.finished:
                    self.upstream.resume_reading()  # type: ignore[attr-defined]
                continue
            sink.wake = loop.create_future()
            try:
                await sink.wake
            finally:
                sink.wake = None
        if sink.failure is not None:
            raise sink.failure
        await send({"type": "http.response.body", "body": sink.last, "more_body": False})

    def _succeed(self) -> None:
        if self.attempt.finished:
            return
        self.proxy.router.succeeded(self.attempt, self.usage)
        self.job.cached_tokens = self.attempt.record.reported_cached_tokens
        self.job.usage = self.usage
        self.job.status = "200"

    def _filter(self, event: bytes) -> bytes | None:
        """Pick up usage; drop the usage-only chunk the caller did not ask for."""
        if b'"usage"' not in event or b'"prompt_tokens"' not in event:
            return event
        data = event.strip()
        if data.startswith(b"data:"):
            try:
                obj = orjson.loads(data[5:])
            except ValueError:
                return event
            if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                self.usage = obj["usage"]
                if not self.job.checked.caller_wants_usage:
                    if not obj.get("choices"):
                        return None
                    obj["usage"] = None
                    return b"data: " + encode_json(obj) + b"\n\n"
        return event


class _SpliceSink:
    """Where a spliced replica body goes (``edges/http1.py``'s ``Sink``), called from the
    replica connection's data callback: each piece :meth:`SSERelay.take` passes on is framed
    as one HTTP/1.1 chunk and written to the caller's transport.

    With ``start`` (the response start message, not yet sent) the first piece starts the
    response first, by running uvicorn's ``send`` for it to completion right here (it does
    not wait for anything unless the caller's buffer is full; then the piece waits for the
    driver task). A stream that breaks before its first piece reached the caller only
    records the ``error`` (the attempt can be retried). A full caller buffer pauses the
    replica (the driver resumes it on drain); the end and errors wake the driver, which
    sends the last piece through uvicorn. A bug of ours here is kept for the driver to raise
    rather than left to the event loop's handler."""

    __slots__ = ("relay", "caller", "send", "transport", "start", "started", "pending",
                 "finished", "paused", "last", "error", "failure", "wake")

    def __init__(self, relay: SSERelay, caller: HeadGuard, send: Callable[[dict], Any],
                 start: dict | None = None):
        self.relay = relay
        self.caller = caller  # the caller's connection
        self.send = send  # uvicorn's ASGI send for the request
        self.transport = caller.transport
        self.start = start
        self.started = start is None
        self.pending = b""  # a first piece waiting for the driver to start the response
        self.finished = False
        self.paused = False
        self.last = b""
        self.error: TransportError | None = None
        self.failure: BaseException | None = None
        self.wake: asyncio.Future | None = None

    def on_body(self, data: bytes) -> None:
        if self.finished:  # cut by a shutdown: the rest is not passed on
            return
        try:
            out = self.relay.take(data)
            if not out:
                return
            if not self.started:
                head = None if self.pending else self._start_now()
                if head is None:
                    self.pending += out
                    self._pause()
                    return
                self._wake()  # the response is under way: its task can hand it over
                self.write(out, head)
                return
            self.write(out)
        except Exception as exc:  # pragma: no cover - a bug of ours
            self._end(failure=exc)

    def write(self, out: bytes, head: bytes = b"") -> None:
        """``out`` as one chunk, after ``head`` (the response head, with the first event)."""
        if not self.caller.disconnected and not self.transport.is_closing():
            self.transport.write(b"%b%x\r\n%b\r\n" % (head, len(out), out))
            if self.caller.write_paused:
                self._pause()

    def on_end(self) -> None:
        if self.finished:
            return
        try:
            self._end(last=self.relay.tail())
        except Exception as exc:  # pragma: no cover - a bug of ours
            self._end(failure=exc)

    def on_error(self, error: TransportError) -> None:
        if self.finished:
            return
        if not self.started and not self.pending:  # nothing reached the caller: retry
            self.error = error
            self._end()
            return
        try:
            self._end(last=self.relay.broke(error))
        except Exception as exc:  # pragma: no cover - a bug of ours
            self._end(failure=exc)

    def _start_now(self) -> bytes | None:
        """Send the response start through uvicorn now, if that needs no waiting: the head
        it writes, held back to go out with the first event in one write (one syscall on
        the first event's way instead of two); ``None``: the driver starts the response."""
        caller = self.caller
        if caller.disconnected or caller.write_paused or self.started:
            return None
        output = caller.output
        assert output is not None
        output.hold()
        try:
            step = self.send(self.start)
            try:
                step.send(None)
            except StopIteration:
                self.started = True
                head = output.take()
                if _is_chunked(head):
                    return head
                output.transport.write(head)
                raise RuntimeError("uvicorn did not choose chunked encoding for the stream")
            step.close()  # it wanted to wait after all: leave it to the driver
            return None
        finally:
            output.release()  # not taken (an error): written as uvicorn would have

    def cut(self, event: bytes) -> None:
        """End the stream with ``event`` (a shutdown's); the driver sends it as the last
        piece. Reading the replica stops."""
        if not self.finished:
            self.relay.upstream.pause_reading()  # type: ignore[attr-defined]
            self._end(last=event)

    def _pause(self) -> None:
        if not self.paused:
            self.paused = True
            self.relay.upstream.pause_reading()  # type: ignore[attr-defined]
            self._wake()

    def _end(self, last: bytes = b"", failure: BaseException | None = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.last = last
        self.failure = failure
        self._wake()

    def _wake(self) -> None:
        wake = self.wake
        if wake is not None and not wake.done():
            wake.set_result(None)


async def send_response(response: Response, scope: dict, receive: Any, send: Any) -> None:
    """``response(scope, receive, send)``; served through the guard's protocol, a whole
    answer (not a stream, which splices) leaves as one write (``guard.Output.hold``)."""
    caller = None if isinstance(response, StreamingResponse) else connection.get()
    if caller is None or caller.output is None:
        await response(scope, receive, send)
        return
    caller.output.hold()
    try:
        await response(scope, receive, send)
    finally:
        caller.output.release()


async def _start_chunked(caller: HeadGuard, send: Callable[[dict], Awaitable[None]],
                         start: dict) -> bool:
    """Send the response ``start`` through uvicorn; is its head chunked (what the splice's
    framing needs)? A response without a length is, on HTTP/1.1."""
    output = caller.output
    assert output is not None
    output.hold()
    try:
        await send(start)
        head = output.take()
    finally:
        output.release()
    output.write(head)
    return _is_chunked(head)


def _is_chunked(head: bytes) -> bool:
    """Does this response head (as uvicorn wrote it) announce chunked encoding?"""
    return b"\r\ntransfer-encoding: chunked\r\n" in head.lower()


# The ASGI ``send`` of the request the current task serves, set by the app around its
# handler (``app.GenerationFastPath``): what a spliced stream starts and ends its response
# with. A context variable, because each request runs in a task of its own.
caller_send: ContextVar[Any] = ContextVar("prefixroute_caller_send", default=None)


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
        return usage_in(orjson.loads(content))
    except ValueError:
        return None


def usage_in(answer: object) -> dict | None:
    """The ``usage`` object of a parsed non-streamed answer, if it has one."""
    usage = answer.get("usage") if isinstance(answer, dict) else None
    return usage if isinstance(usage, dict) else None


def _is_openai_error(content: bytes) -> bool:
    try:
        obj = orjson.loads(content)
    except ValueError:
        return False
    return isinstance(obj, dict) and isinstance(obj.get("error"), dict) \
        and isinstance(obj["error"].get("message"), str)


def _reply_headers(upstream: Upstream, job: Job) -> dict[str, str]:
    headers = {"x-request-id": job.request_id}
    if job.checked.stream:
        headers["cache-control"] = "no-cache"
    return headers

