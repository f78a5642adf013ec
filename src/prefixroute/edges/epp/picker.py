"""The Endpoint Picker: an Envoy external processor (ext_proc v3) that routes with the
gateway's own request handling.

Envoy carries the bytes; for each HTTP request it opens one ext_proc stream and sends what
its processing mode asks for (``prefixroute envoy-config`` writes that mode: request headers,
except on the completions routes where they come as attributes of the body; the request
body buffered, or streamed in chunks; no response headers; the response body streamed).
One :class:`Exchange` follows one such stream:

====================  ================================================================
Envoy sends           the EPP does
====================  ================================================================
request headers       authenticate the tenant (API key, or the trusted tenant header), its
                      rate limit; ``GET /v1/models`` is answered here. Without a headers
                      message the same is read from the body message's attributes. With a
                      streamed body the answer is held until the body is whole (the
                      endpoint goes into the headers). The endpoint subset the data plane
                      allows, if any, comes with the first message
request body          :meth:`Gateway.admit` (the checks, salt and media identities, block
                      keys, admission slot: the code ``serve`` runs), then the lifecycle
                      runner's decision; the body is replaced by the salted one, and the
                      picked ``ip:port`` (then the fallbacks) goes into the
                      ``x-gateway-destination-endpoint`` header and the ``envoy.lb``
                      dynamic metadata, as the Endpoint Picker Protocol says (on the fast
                      route, where Envoy applies no header change, the metadata only)
first response        the status and the replica that served (``response.code`` and
message               ``upstream.address`` attributes; from a data plane that sends
                      response headers, the ``x-gateway-destination-endpoint-served``
                      header or the protocol's ``envoy.lb`` metadata): a fallback replica
                      means those named before it failed; the picked one's attempt ends
                      failed and the served one is booked, as a retry in ``serve``
response body         usage (``cached_tokens``) from the JSON or the SSE stream, through
                      the same :class:`SSERelay` logic ``serve`` relays streams with (the
                      usage chunk the caller did not ask for is dropped). A JSON answer
                      that parses whole ends the exchange there: the EPP closes the
                      stream without answering (Envoy passes the body on as it is), so
                      neither that message nor Envoy's end message waits for an answer
the stream ends       the attempt ends: completed with its usage, refused, failed or
                      abandoned, as in ``serve``
====================  ================================================================

Refusals are immediate responses with the OpenAI error object and status ``serve`` would
answer (400, 401, 404, 413, 429, 503), so a client sees the same errors through either.

**Answers by access log.** When the stream's initial metadata says the data plane logs
answers to the EPP (the bootstrap of ``prefixroute envoy-config`` with one EPP), a
non-streamed request is tagged in its routing answer and its stream closed in the same
write: Envoy then sends the request on and its answer back without waiting for the EPP.
The exchange stays open (its admission slot, its booking) until Envoy's access log entry
for the tag arrives on the access log stream (:class:`AccessLogRun`, entries in batches):
the entry's status, the replica that served and the usage Envoy read from the answer end
it as the answer's messages would. An entry with no status means no answer (the caller
left, or Envoy gave up). An entry that never comes (lost with Envoy's log buffer) ends the
exchange as abandoned once the route's timeout and :data:`LOG_GRACE_S` have passed.
Streamed answers stay on their stream: the usage chunk the caller did not ask for is cut
from them, which takes an answer to each message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import deque
from typing import Any, AsyncIterator, Protocol

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.accesslog.v3 import als_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from prefixroute.edges.eager import start
from prefixroute.edges.epp.config import EppSettings, address_of, endpoint_of
from prefixroute.edges.epp.http2 import INTERNAL, INVALID_ARGUMENT, OK, UNAVAILABLE
from prefixroute.edges.epp.protocol import (ACCESS_LOG_METHOD, ANSWERS_BY_ACCESS_LOG,
                                            ANSWERS_HEADER, ATTRIBUTES_KEY, DESTINATION,
                                            EXCHANGE_KEY, LB_NAMESPACE, METADATA_NAMESPACE,
                                            PROCESS_METHOD, SERVED, SUBSET, SUBSET_NAMESPACE,
                                            USAGE_KEYS, attribute_header,
                                            answers_by_access_log)
from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.backends import Backend, candidates_for
from prefixroute.edges.gateway.errors import GatewayError
from prefixroute.edges.gateway.proxy import PATHS, Job, SSERelay, _usage_of, usage_in
from prefixroute.edges.gateway.router import Attempt
from prefixroute.edges.gateway.sanitize import encode_json

log = logging.getLogger("prefixroute.epp")

ENDPOINTS = {path: endpoint for endpoint, path in PATHS.items()}  # path -> endpoint
_NON_STREAM_LIMIT = 16 * 1024 * 1024  # a non-streamed answer kept to read its usage
# What one message gets back: nothing yet, one answer, or (streamed request bodies) the
# held-back headers answer and the body's, in order.
Answer = ext.ProcessingResponse | tuple[ext.ProcessingResponse, ...] | None


def _header(key: str, value: str | bytes) -> base_pb2.HeaderValueOption:
    raw = value if isinstance(value, bytes) else value.encode()
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=raw),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)


def _headers_of(message: ext.HttpHeaders) -> dict[str, str]:
    out = {}
    for h in message.headers.headers:
        out[h.key] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def immediate(error: GatewayError, request_id: str | None = None) -> ext.ProcessingResponse:
    """``error`` as Envoy's answer to the caller, with the body ``serve`` would send."""
    headers = [_header("content-type", "application/json")]
    headers += [_header(k.lower(), v) for k, v in error.headers.items()]
    if request_id:
        headers.append(_header("x-request-id", request_id))
    return ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=error.status),
        headers=ext.HeaderMutation(set_headers=headers),
        body=encode_json(error.body()),
        details=f"prefixroute_{error.code or error.status}"))


def routing_metadata(destination: str, tag: str | None) -> struct_pb2.Struct:
    """A routing answer's dynamic metadata: ``destination`` (the picked ``ip:port``, then
    the fallbacks) in the ``envoy.lb`` namespace, where Envoy's override_host load balancer
    reads it, and, when the answer comes back by access log, the exchange's ``tag`` in the
    EPP's own namespace (Envoy logs the requests that carry one)."""
    metadata = struct_pb2.Struct()
    metadata.fields[LB_NAMESPACE].struct_value.fields[DESTINATION].string_value = destination
    if tag is not None:
        metadata.fields[METADATA_NAMESPACE].struct_value.fields[EXCHANGE_KEY] \
            .string_value = tag
    return metadata


def fast_route_answer(body: bytes, metadata: struct_pb2.Struct) -> ext.ProcessingResponse:
    """The answer to a request body that came with no headers message before it: the body
    to send on, and the metadata naming the replica (Envoy applies no header change to
    such a request, so none is sent)."""
    return ext.ProcessingResponse(
        request_body=ext.BodyResponse(response=ext.CommonResponse(
            body_mutation=ext.BodyMutation(body=body))),
        dynamic_metadata=metadata)


_CONTINUE_REQUEST_HEADERS = ext.ProcessingResponse(
    request_headers=ext.HeadersResponse(response=ext.CommonResponse()))
_CONTINUE_RESPONSE_BODY = ext.ProcessingResponse(
    response_body=ext.BodyResponse(response=ext.CommonResponse()))
_CONTINUE_REQUEST_BODY = ext.ProcessingResponse(
    request_body=ext.BodyResponse(response=ext.CommonResponse()))
_CONTINUE_RESPONSE_TRAILERS = ext.ProcessingResponse(response_trailers=ext.TrailersResponse())
LATER = object()  # the message is answered by the asynchronous Exchange.handle
_ANSWERS = (ANSWERS_HEADER.encode(), ANSWERS_BY_ACCESS_LOG.encode())
# Envoy's response flags that, on an answer the replica started (not one Envoy made itself
# after the replica failed: that one fails the request), mean it did not reach the caller
# whole: the request ends as abandoned, as on its own stream, which Envoy then ends early.
_UPSTREAM_CUT = ("upstream_remote_reset", "upstream_connection_termination",
                 "upstream_request_timeout", "stream_idle_timeout", "upstream_protocol_error")
# How long past the route's timeout a handed-off exchange waits for its access log entry
# (Envoy logs a request when it ends, at the latest at that timeout, and sends its entries
# batched): past it the entry was lost, and the exchange ends as abandoned.
LOG_GRACE_S = 30.0


class EndpointPicker:
    """The ext_proc service over one :class:`Gateway` (its tenants, prompt preparer, backend
    pool, router and metrics; started and stopped by the caller)."""

    def __init__(self, gateway: Gateway, settings: EppSettings):
        self.gateway = gateway
        self.settings = settings
        self.router = gateway.router
        self.clock = gateway.clock
        # ``ip:port`` by backend URL: the fleet changes (DNS or file discovery, reloads), so
        # addresses follow the pool's backends as they are first named, not the static list.
        self._addresses: dict[str, str | None] = {}
        # The streamed answers being read (SSERelay registers with its owner). Envoy, not the
        # picker, holds the caller's connection, so a shutdown has no stream of its own to cut.
        self.streams: set = set()
        self.runs: set[ExchangeRun] = set()  # the open exchanges (shut down on close)
        # Exchanges routed and handed off to the access log, by tag, with the timer that
        # ends one whose entry never comes.
        self.handed_off: dict[str, tuple[Exchange, asyncio.TimerHandle]] = {}
        # ... and their tags by the request id Envoy logs (a request whose caller left as
        # the routing answer went out may be logged without the tag); ``None`` for an id
        # another open request has too (a caller may reuse ids): that id finds none.
        self.tags_by_id: dict[str, str | None] = {}
        self.open_ids: dict[str, int] = {}  # open requests by that id
        # Tags are this process's random prefix and a count: never one of an earlier
        # process's (Envoy may still log those after a restart), and not guessable.
        self._tag_prefix = os.urandom(8).hex()
        self._tags = itertools.count(1)
        self.log_wait_s = gateway.config.timeouts.read_s + LOG_GRACE_S
        # (Never for instances sharing state: the rule is the bootstrap's, in one place.)
        self.by_access_log = answers_by_access_log(gateway.config)
        self.logs: set[AccessLogRun] = set()  # Envoy's access log streams
        self.closing = False

    def open(self, stream: Sink, path: str, headers: Any = ()
             ) -> "ExchangeRun | AccessLogRun | None":
        """A new stream (the gRPC server's opener): an ext_proc exchange's run, Envoy's
        access log stream, or ``None`` for another method. An ext_proc stream whose
        initial metadata says the data plane logs answers to the EPP hands its exchange off
        once routed. Once shut down, a new exchange ends ``UNAVAILABLE`` at once."""
        if path == ACCESS_LOG_METHOD:
            return AccessLogRun(self, stream)
        if path != PROCESS_METHOD:
            return None
        run = ExchangeRun(self, stream, by_access_log=self.by_access_log
                          and _ANSWERS in headers)
        if self.closing:
            run.shutdown()
        return run

    def shutdown(self) -> None:
        """End every open exchange ``UNAVAILABLE``, and any new one (the EPP is stopping);
        those waiting for their access log entry end as they stand."""
        self.closing = True
        for run in list(self.runs):
            run.shutdown()
        for tag in list(self.handed_off):
            self._unlogged(tag)
        for run in list(self.logs):
            run.end()

    def new_tag(self) -> str:
        return f"{self._tag_prefix}{next(self._tags):x}"

    def hand_off(self, exchange: "Exchange") -> None:
        """``exchange`` was routed and its stream closed: its access log entry ends it."""
        tag = exchange.tag
        assert tag is not None
        timer = asyncio.get_running_loop().call_later(self.log_wait_s, self._unlogged, tag)
        self.handed_off[tag] = (exchange, timer)
        request_id = exchange.logged_id
        if request_id:
            alone = request_id not in self.tags_by_id and self.open_ids.get(request_id) == 1
            self.tags_by_id[request_id] = tag if alone else None

    def id_opened(self, request_id: str) -> None:
        self.open_ids[request_id] = self.open_ids.get(request_id, 0) + 1
        if request_id in self.tags_by_id:  # another open request has it: it finds none
            self.tags_by_id[request_id] = None

    def id_closed(self, request_id: str) -> None:
        left = self.open_ids.get(request_id, 0) - 1
        if left > 0:
            self.open_ids[request_id] = left
        else:
            self.open_ids.pop(request_id, None)

    def _take(self, tag: str) -> "Exchange | None":
        handed = self.handed_off.pop(tag, None)
        if handed is None:
            return None
        exchange, timer = handed
        timer.cancel()
        if exchange.logged_id in self.tags_by_id \
                and self.tags_by_id[exchange.logged_id] in (tag, None):
            del self.tags_by_id[exchange.logged_id]
        return exchange

    def logged(self, entry: Any) -> None:
        """One access log entry: the request it names (if handed off here) is over."""
        ours = entry.common_properties.metadata.filter_metadata.get(METADATA_NAMESPACE)
        if ours is not None:
            tag = ours.fields[EXCHANGE_KEY].string_value
        else:  # logged for its caller leaving: its tag may not have reached Envoy
            tag = self.tags_by_id.get(entry.request.request_id) or ""
        exchange = self._take(tag) if tag else None
        if exchange is None:
            return  # ended already (its wait ran out), or not routed here
        try:
            exchange.logged(entry, ours)
        except Exception as exc:  # a bug of ours: the exchange still ends
            log.error("unexpected error reading an access log entry", exc_info=exc,
                      extra={"fields": {"event": "internal_error",
                                        "request_id": exchange.request_id}})
            exchange.close()

    def _unlogged(self, tag: str) -> None:
        exchange = self._take(tag)
        if exchange is None:
            return
        if not self.closing:
            log.warning("no access log entry came for a request routed here; it ends as "
                        "abandoned", extra={"fields": {"event": "access_log_entry_missing",
                                                       "request_id": exchange.request_id}})
        exchange.close()

    def address(self, backend: Backend) -> str | None:
        """The ``ip:port`` Envoy reaches ``backend`` at, or ``None`` when its URL names a
        host (a member a discovery file lists by name): Envoy routes by address, so such a
        backend is never picked (logged once)."""
        url = backend.url
        try:
            return self._addresses[url]
        except KeyError:
            pass
        if len(self._addresses) > 2 * len(self.gateway.pool.backends) + 64:
            self._addresses.clear()  # replicas that left long ago (pods come and go)
        address = self._addresses[url] = endpoint_of(url)
        if address is None:
            log.warning("backend url is not http://IP:PORT: the endpoint picker cannot name "
                        "it to Envoy, so it gets no requests", extra={"fields": {
                            "event": "backend_not_addressable", "backend": backend.name,
                            "url": url}})
        return address

    async def Process(self, request_iterator: AsyncIterator[ext.ProcessingRequest]
                      ) -> AsyncIterator[ext.ProcessingResponse]:
        """One ext_proc stream as async iterators (for tests and in-process measurements:
        the server drives :class:`ExchangeRun` from its read callbacks instead). Ends when
        the EPP closes the stream or the messages end."""
        sink = _Collected()
        run = ExchangeRun(self, sink)
        try:
            async for message in request_iterator:
                run.take(message)
                await run.settled()
                while sink.answers:
                    yield sink.answers.pop(0)
                if sink.status is not None:
                    return
            run.end()
            await run.settled()
            for answer in sink.answers:
                yield answer
        finally:
            run.reset()

    # SSERelay reports a broken stream through its proxy's ``_failed``; Envoy never hands the
    # EPP a broken body (it ends the exchange), so this only keeps the interface whole.
    def _failed(self, job: Job, attempt: Attempt, reason: str, detail: str) -> None:
        self.router.failed(attempt, reason)
        job.failures.append(f"{reason}: {attempt.backend.name}: {detail}")


class Sink(Protocol):
    """Where an exchange's answers go: the transport's stream (or a test's list)."""

    def send(self, payload: bytes) -> None: ...
    def close(self, status: int = OK, message: str = "") -> None: ...
    def send_and_close(self, payloads: list[bytes]) -> None: ...


class _Collected:
    """A :class:`Sink` that keeps the answers, parsed back (for :meth:`EndpointPicker.Process`)."""

    def __init__(self) -> None:
        self.answers: list[ext.ProcessingResponse] = []
        self.status: int | None = None

    def send(self, payload: bytes) -> None:
        self.answers.append(ext.ProcessingResponse.FromString(payload))

    def close(self, status: int = OK, message: str = "") -> None:
        self.status = status

    def send_and_close(self, payloads: list[bytes]) -> None:
        for payload in payloads:
            self.send(payload)
        self.close()


class ExchangeRun:
    """One ext_proc stream driven from the transport's callbacks: each message handled in
    order, its answer sent as soon as it is ready, the stream closed when the exchange is
    complete or the data plane ends it.

    The answer messages (response headers and body, trailers) never wait: when nothing is
    ahead of them they are answered inside the read that brought them, with no task, and
    the answer leaves in that read's write. The request's messages may wait (the rate
    limit, tokenization, an admission slot): each starts inside the read too
    (:func:`prefixroute.edges.eager.start`), and one that waits for nothing is answered
    there as well; one that must wait goes on as a task, and messages that arrive
    meanwhile wait their turn behind it.

    The exchange is closed (its admission slot and booking released) only once no task of
    it runs: a task cancelled while it waited may still finish the step it was taking (a
    slot granted as it was cancelled is kept), so its end, not the cancel, closes it."""

    __slots__ = ("picker", "sink", "exchange", "waiting", "task", "ended", "closed")

    def __init__(self, picker: "EndpointPicker", sink: Sink, by_access_log: bool = False):
        self.picker = picker
        self.sink = sink
        self.exchange = Exchange(picker, by_access_log)
        self.waiting: deque[ext.ProcessingRequest] = deque()
        self.task: asyncio.Task | None = None
        self.ended = False  # the data plane sent its last message
        self.closed = False  # the exchange is over: closed here, reset, or shut down
        picker.runs.add(self)

    # -- the transport's callbacks (StreamHandler) ----------------------------------------

    def message(self, data: bytes) -> None:
        try:
            message = ext.ProcessingRequest.FromString(data)
        except DecodeError:
            self._close(INVALID_ARGUMENT, "not an ext_proc ProcessingRequest")
            return
        self.take(message)

    def end(self) -> None:
        """The data plane half-closed the stream: once what came is answered, close."""
        self.ended = True
        if self.task is None and not self.waiting:
            self._close(OK)

    def reset(self) -> None:
        """The stream was cut (Envoy reset it, or its connection ended): nobody waits for an
        answer; the exchange ends as it stands."""
        if self.closed:
            return
        self.closed = True
        self._stop()

    def shutdown(self) -> None:
        """The EPP stops: the exchange ends ``UNAVAILABLE`` (Envoy then fails the request
        open or closed, at once rather than at its message timeout)."""
        self._close(UNAVAILABLE, "the endpoint picker shut down before this request's "
                    "exchange ended")

    # -- handling ---------------------------------------------------------------------------

    def take(self, message: ext.ProcessingRequest) -> None:
        if self.closed:
            return
        if self.task is not None or self.waiting:
            self.waiting.append(message)
            return
        self._handle(message)

    def _handle(self, message: ext.ProcessingRequest) -> None:
        try:
            answer = self.exchange.answer_now(message)
        except Exception as exc:
            self._internal_error(exc)
            return
        if answer is not LATER:
            self._answer(answer)
            return
        # Started here, in the read that brought the message: a request that waits for
        # nothing is answered in this read's write, with no turn of the loop in between.
        started = start(self.exchange.handle(message))
        if started.task is not None:
            self.task = started.task
            self.task.add_done_callback(self._handled)
        else:
            self._settle(started.error, started.result, in_read=True)

    def _handled(self, task: asyncio.Task) -> None:
        self.task = None
        error = asyncio.CancelledError() if task.cancelled() else task.exception()
        if self.closed:  # reset or closed while the task ran: the exchange ends now
            if error is not None and not task.cancelled():
                log.error("unexpected error in an exchange that had ended", exc_info=error,
                          extra={"fields": {"event": "internal_error",
                                            "request_id": self.exchange.request_id}})
            self.exchange.close()
            return
        self._settle(error, None if error is not None else task.result(), in_read=False)
        try:
            while self.waiting and self.task is None and not self.closed:
                self._handle(self.waiting.popleft())
            if self.ended and self.task is None and not self.waiting:
                self._close(OK)
        except Exception as exc:
            self._internal_error(exc)

    def _settle(self, error: BaseException | None, answer: Answer, *, in_read: bool) -> None:
        """A request message handled: send its answer, or end the exchange as its error
        says (cancelled: UNAVAILABLE, as when the EPP stops; anything else is a bug of
        ours). Nothing but KeyboardInterrupt and SystemExit leaves the transport's read
        callback (anything else would end Envoy's whole connection); from a task, those
        have already reached the loop."""
        if isinstance(error, asyncio.CancelledError):
            self._close(UNAVAILABLE, "the request's handling was cancelled (the endpoint "
                        "picker may be stopping)")
        elif error is not None:
            if in_read and isinstance(error, (KeyboardInterrupt, SystemExit)):
                raise error
            self._internal_error(error)
        else:
            try:
                self._answer(answer)
            except Exception as exc:
                self._internal_error(exc)

    def _answer(self, answer: Answer) -> None:
        # (a tuple: a held-back headers answer, then the body's)
        answers = () if answer is None else answer if type(answer) is tuple else (answer,)
        exchange = self.exchange
        if exchange.tag is not None and not exchange.done and not self.closed:
            # Routed, and the access log will say how it ends: the answer and the close go
            # in one write, and Envoy sends the request on and its answer back without
            # consulting the EPP again.
            self.closed = True
            self.waiting.clear()
            self.picker.runs.discard(self)
            self.picker.hand_off(exchange)
            self.sink.send_and_close([a.SerializeToString() for a in answers])
            return
        for each in answers:
            self.sink.send(each.SerializeToString())
        if exchange.complete:
            # Nothing left to learn: closing the stream (status OK) tells Envoy to go on
            # without the EPP, so what remains of the answer (at least its end-of-stream
            # message) needs no answer from here.
            self._close(OK)

    def _internal_error(self, error: BaseException) -> None:
        # A bug of ours: Envoy fails the request open or closed, as for an EPP that is down.
        log.error("unexpected error in an exchange", exc_info=error, extra={"fields": {
            "event": "internal_error", "request_id": self.exchange.request_id}})
        self._close(INTERNAL, "internal error in the endpoint picker")

    def _close(self, status: int, message: str = "") -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.sink.close(status, message)
        finally:
            self._stop()

    def _stop(self) -> None:
        self.waiting.clear()
        self.picker.runs.discard(self)
        if self.task is not None:
            self.task.cancel()  # the exchange closes when the task has ended (_handled)
            return
        self.exchange.close()

    async def settled(self) -> None:
        """Wait until the message being handled is answered (and those waiting behind it)."""
        while self.task is not None:
            await asyncio.wait([self.task])


class AccessLogRun:
    """Envoy's access log stream (one per Envoy worker, open for as long as Envoy runs):
    each message is a batch of entries, and each entry of a request handed off here ends
    it. Nothing is answered until Envoy ends the stream."""

    __slots__ = ("picker", "sink")

    def __init__(self, picker: EndpointPicker, sink: Sink):
        self.picker = picker
        self.sink = sink
        picker.logs.add(self)

    def message(self, data: bytes) -> None:
        try:
            message = als_pb2.StreamAccessLogsMessage.FromString(data)
        except DecodeError:
            self.sink.close(INVALID_ARGUMENT, "not a StreamAccessLogsMessage")
            return
        logged = self.picker.logged
        for entry in message.http_logs.log_entry:
            logged(entry)

    def end(self) -> None:
        self.picker.logs.discard(self)
        self.sink.close(OK)

    def reset(self) -> None:
        self.picker.logs.discard(self)


class Exchange:
    """One HTTP request's ext_proc stream, from its headers to the end of its answer."""

    __slots__ = ("picker", "gateway", "request_id", "started", "endpoint", "tenant",
                 "headers", "body", "job", "attempt", "tried", "relay", "status",
                 "answer", "answer_size", "open", "done", "subset", "head_seen",
                 "via_headers", "held", "body_size", "complete", "by_access_log", "tag",
                 "logged_id")

    def __init__(self, picker: EndpointPicker, by_access_log: bool = False):
        self.picker = picker
        self.gateway = picker.gateway
        self.request_id = ""  # set with the head (Envoy's id, or one of our own)
        self.started = picker.clock.now()
        self.endpoint: str | None = None
        self.tenant: Any = None
        self.headers: dict[str, str] = {}
        self.body: list[bytes] = []
        self.job: Job | None = None
        self.attempt: Attempt | None = None
        self.tried: list[Backend] = []  # the picked replica, then the fallbacks named
        self.relay: SSERelay | None = None
        self.status = 0
        self.answer: list[bytes] = []
        self.answer_size = 0
        self.open = False  # counted in the gateway's open requests
        self.done = False
        # The endpoints the data plane allows for this request (the protocol's subset
        # hint), or None: every configured replica.
        self.subset: frozenset[str] | None = None
        self.head_seen = False  # the request's head was checked (headers or attributes)
        self.via_headers = False  # ... from a headers message
        self.body_size = 0
        self.held = False  # the headers' answer waits for the whole body (streamed mode)
        self.complete = False  # the answer was read whole before its end: close the stream
        # The data plane logs answers to the EPP: a non-streamed request is handed off to
        # its access log entry once routed, under this tag (in the routing answer's metadata).
        self.by_access_log = by_access_log
        self.tag: str | None = None
        # Envoy's request id as it came (Envoy logs it when the routing answer, which sets
        # the EPP's own on the full route, did not reach it).
        self.logged_id = ""

    def answer_now(self, message: ext.ProcessingRequest) -> Answer | object:
        """The answer to a message about the response (it never waits), or :data:`LATER`
        for one about the request: :meth:`handle` answers those."""
        kind = message.WhichOneof("request")
        if kind == "response_body":
            return self._response_body(message)
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_trailers":
            return _CONTINUE_RESPONSE_TRAILERS
        return LATER

    async def handle(self, message: ext.ProcessingRequest) -> Answer:
        """The answer to any message (those about the request may wait)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self._read_subset(message)
            return await self._request_headers(message)
        if kind == "request_body":
            if not self.head_seen:  # the fast route: no headers message, attributes instead
                self._read_subset(message)
                refused = await self._head_from_attributes(message)
                if refused is not None:
                    return refused
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            if self.held and not self.done:  # a streamed body ended by trailers
                answer = await self._request_body(ext.HttpBody(end_of_stream=True))
                trailers = ext.ProcessingResponse(request_trailers=ext.TrailersResponse())
                return (*answer, trailers) if type(answer) is tuple else answer  # or refused
            return ext.ProcessingResponse(request_trailers=ext.TrailersResponse())
        answer = self.answer_now(message)
        return None if answer is LATER else answer  # type: ignore[return-value]

    # -- the request ----------------------------------------------------------------------

    async def _request_headers(self, message: ext.ProcessingRequest) -> Answer:
        head = message.request_headers
        self.headers = _headers_of(head)
        self.via_headers = True
        refused = await self._check_head(head.end_of_stream)
        if refused is not None:
            return refused
        if message.protocol_config.request_body_mode == ProcessingMode.FULL_DUPLEX_STREAMED:
            # The body streams in chunks and Envoy does not wait for this answer to send
            # them; the header changes (the picked endpoint) need the whole body, so this
            # answer is held back and sent with the body's (as the protocol's EPPs do).
            self.held = True
            return None
        return _CONTINUE_REQUEST_HEADERS

    async def _head_from_attributes(self, message: ext.ProcessingRequest) -> Answer:
        """The fast route sends no headers message: the path, method and the headers the
        EPP reads come as ``request_attributes`` with the body (``request.path``,
        ``request.method``, ``request.headers['NAME']``; a header the request lacks is
        absent)."""
        headers: dict[str, str] = {}
        attributes = message.attributes.get(ATTRIBUTES_KEY)
        if attributes is not None:
            for key, value in attributes.fields.items():
                name = attribute_header(key)
                if name is not None and value.WhichOneof("kind") == "string_value":
                    headers[name] = value.string_value
        self.headers = headers
        # Envoy's id (which a caller can set) leads, for finding the request in the decision
        # log; the random tail keeps ids unique, since routing state is keyed by them.
        request_id = headers.get("x-request-id", "")
        if 0 < len(request_id) <= 128 and request_id.isprintable():
            self.request_id = f"{request_id}.{os.urandom(6).hex()}"
        return await self._check_head(end_of_stream=False)

    async def _check_head(self, end_of_stream: bool) -> ext.ProcessingResponse | None:
        """The request's path, method, tenant and rate limit: the refusal, or ``None``."""
        self.head_seen = True
        if not self.request_id:
            self.request_id = f"pr-{os.urandom(16).hex()}"
        headers = self.headers
        if self.by_access_log and headers.get("x-request-id"):
            self.logged_id = headers["x-request-id"]
            self.picker.id_opened(self.logged_id)
        gateway = self.gateway
        path = headers.get(":path", "").split("?", 1)[0]
        method = headers.get(":method", "")
        self.gateway.open_requests += 1
        self.open = True
        try:
            if path == "/v1/models" and method == "GET":
                self._authenticate()
                return self._models()
            endpoint = ENDPOINTS.get(path)
            if endpoint is None:
                raise GatewayError(404, f"no such endpoint: {method} {path}",
                                   code="unknown_url")
            if method != "POST":
                raise GatewayError(405, f"method {method} is not allowed on {path}",
                                   code="method_not_allowed")
            self.endpoint = endpoint
            self._authenticate()
            await gateway.check_rate(self.tenant)
            declared = headers.get("content-length")
            limit = gateway.config.limits.max_body_bytes
            if declared is not None and declared.isdigit() and int(declared) > limit:
                raise GatewayError(413, f"the request body is {declared} bytes; the limit is "
                                   f"{limit}", code="body_too_large")
            if end_of_stream:
                raise GatewayError(400, "the request body is empty; expected a JSON object",
                                   code="invalid_body")
        except GatewayError as error:
            return self._refuse(error)
        return None

    def _read_subset(self, message: ext.ProcessingRequest) -> None:
        """The protocol's endpoint subset: the data plane may restrict the replicas this
        request can go to (a list of ``ip:port`` under ``x-gateway-destination-endpoint-
        subset`` in the ``envoy.lb.subset_hint`` metadata namespace). Present, even empty,
        it is a hard filter; a comma-separated string is read as the list."""
        if not message.HasField("metadata_context"):
            return
        hint = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
        if hint is None:
            return
        value = hint.fields.get(SUBSET)
        if value is None:
            return
        kind = value.WhichOneof("kind")
        if kind == "list_value":
            self.subset = frozenset(v.string_value for v in value.list_value.values
                                    if v.string_value)
        elif kind == "string_value":
            self.subset = frozenset(p.strip() for p in value.string_value.split(",")
                                    if p.strip())
        else:
            self.subset = frozenset()

    def _authenticate(self) -> None:
        registry = self.gateway.tenants
        header = self.picker.settings.trusted_tenant_header
        if header is None:
            self.tenant = registry.authenticate(self.headers.get("authorization"))
            return
        name = self.headers.get(header)
        tenant = next((t for t in registry.tenants if t.name == name), None) if name else None
        if tenant is None:
            raise GatewayError(401, f"no known tenant in the {header} header (set by the "
                               "gateway in front of Envoy)", code="invalid_tenant")
        self.tenant = tenant

    def _models(self) -> ext.ProcessingResponse:
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "prefixroute"}
                for name in self.gateway.pool.models()]
        self._account("200")
        return ext.ProcessingResponse(immediate_response=ext.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=200),
            headers=ext.HeaderMutation(set_headers=[_header("content-type",
                                                            "application/json")]),
            body=encode_json({"object": "list", "data": data})))

    async def _request_body(self, message: ext.HttpBody) -> ext.ProcessingResponse | None:
        if self.endpoint is None or self.done:  # refused at its headers already
            return _CONTINUE_REQUEST_BODY
        self.body.append(message.body)
        self.body_size += len(message.body)
        gateway = self.gateway
        limit = gateway.config.limits.max_body_bytes
        if not message.end_of_stream:
            # Streamed bodies come in chunks, answered all at once at the end.
            if self.body_size > limit:
                self.body = []
                return self._refuse(GatewayError(
                    413, f"the request body exceeds the limit of {limit} bytes",
                    code="body_too_large"))
            return None
        raw = b"".join(self.body)
        self.body = []
        try:
            if len(raw) > limit:
                raise GatewayError(413, f"the request body exceeds the limit of {limit} "
                                   "bytes", code="body_too_large")
            checked, backends, prompt = await gateway.admit(self.endpoint, self.tenant, raw)
        except GatewayError as error:
            return self._refuse(error)
        except Exception as exc:  # a bug of ours: answer 500, never a dropped request
            log.error("unexpected error before routing", exc_info=exc, extra={"fields": {
                "event": "internal_error", "request_id": self.request_id}})
            return self._refuse(GatewayError(500, "internal error in the endpoint picker; "
                                             "the request was not sent",
                                             code="internal_error"))
        gateway.metrics.overhead.observe(self.picker.clock.now() - self.started)
        self.job = job = Job(self.request_id, self.tenant.name, checked, prompt, backends,
                             self.started)
        address = self.picker.address
        candidates = [b for b in candidates_for(backends, set()) if address(b) is not None]
        where = "none is available"
        if self.subset is not None:
            subset = self.subset
            candidates = [b for b in candidates if address(b) in subset]
            where = "none of the endpoints the gateway allows for it is available"
        if not candidates:
            job.status = "503"
            error = GatewayError(503, f"no replica could serve model {checked.model!r}: "
                                 f"{where}", code="replicas_unavailable",
                                 headers={"retry-after": "1"})
            response = immediate(error, self.request_id)
            self._finish()
            return response
        attempt = self._book(candidates, 0)
        body = checked.body
        payload = encode_json(body)
        priority = self.picker.router.upstream_priority(attempt, job.started)
        if priority is not None:
            attempt.record.priority = priority
            payload = encode_json({**body, "priority": priority})
        # The fallbacks, least loaded first: where Envoy goes if the picked replica fails.
        others = sorted((b for b in candidates if b is not attempt.backend),
                        key=lambda b: (b.in_flight, b.index))
        self.tried = [attempt.backend] + others[:self.picker.settings.fallback_endpoints]
        destination = ",".join(address(b) for b in self.tried)  # type: ignore[misc]
        if self.by_access_log and not job.checked.stream:
            # (A streamed answer stays on this stream: the usage chunk the caller did not
            # ask for is cut from it, which only an answer to each message can do.)
            self.tag = self.picker.new_tag()
        metadata = routing_metadata(destination, self.tag)
        if not self.via_headers:
            # The fast route: Envoy applies no header change from a body answer when no
            # headers message came first, so none is sent (the metadata names the replica).
            return fast_route_answer(payload, metadata)
        set_headers = [_header(DESTINATION, destination),
                       _header("x-request-id", self.request_id)]
        # Envoy drops content-length whenever the body changes without the headers waiting
        # for it (streamed): then the body goes out chunked.
        if not self.held:
            set_headers.append(_header("content-length", str(len(payload))))
        set_headers.append(_header("content-type", "application/json"))
        set_headers += [_header(k, v) for k, v in attempt.backend.headers.items()]
        remove = [] if "authorization" in attempt.backend.headers else ["authorization"]
        mutation = ext.HeaderMutation(set_headers=set_headers, remove_headers=remove)
        if self.held:
            return (ext.ProcessingResponse(
                        request_headers=ext.HeadersResponse(response=ext.CommonResponse(
                            header_mutation=mutation)),
                        dynamic_metadata=metadata),
                    ext.ProcessingResponse(request_body=ext.BodyResponse(
                        response=ext.CommonResponse(body_mutation=ext.BodyMutation(
                            streamed_response=ext.StreamedBodyResponse(
                                body=payload, end_of_stream=True))))))
        return ext.ProcessingResponse(
            request_body=ext.BodyResponse(response=ext.CommonResponse(
                header_mutation=mutation, body_mutation=ext.BodyMutation(body=payload))),
            dynamic_metadata=metadata)

    def _book(self, candidates: list[Backend], attempt_no: int) -> Attempt:
        job = self.job
        assert job is not None
        body = job.checked.body
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        routing_key = body.get("prompt_cache_key") or body.get("user")
        attempt = self.picker.router.route(
            request_id=job.request_id, tenant=job.tenant, model=job.checked.model,
            prompt=job.prompt, block_size=self.gateway.config.hashing.block_size,
            candidates=candidates, attempt=attempt_no,
            routing_key=routing_key if isinstance(routing_key, str) else None,
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            arrival=job.started)
        job.attempts += 1
        job.replica = attempt.backend.name
        job.predicted_cached_tokens = attempt.predicted_cached_tokens
        self.attempt = attempt
        return attempt

    # -- the response ---------------------------------------------------------------------

    def _response_headers(self, message: ext.ProcessingRequest) -> ext.ProcessingResponse:
        """Response headers, for a data plane that sends them (``prefixroute envoy-config``
        skips them and reads the same from attributes on the body; see
        :meth:`_response_body`): the status, and the served endpoint from the header or the
        protocol's metadata. The served header is removed, the request id set."""
        headers = _headers_of(message.response_headers)
        mutation = ext.HeaderMutation(remove_headers=[SERVED],
                                      set_headers=[_header("x-request-id", self.request_id)])
        response = ext.ProcessingResponse(response_headers=ext.HeadersResponse(
            response=ext.CommonResponse(header_mutation=mutation)))
        if self.attempt is None or self.job is None or self.done:
            return response
        status = int(headers.get(":status", "0") or 0)
        self._answer_started(status, headers.get(SERVED) or _served_from_metadata(message))
        if message.response_headers.end_of_stream:
            self._end_of_answer()
        return response

    def _answer_started(self, status: int, served: str | None) -> None:
        """The answer's status and the replica that served it are known: end the attempts
        that failed before it, and the attempt itself unless it succeeded (then its usage
        ends it)."""
        job = self.job
        assert job is not None
        self.status = status
        self._follow_fallback(served)
        attempt = self.attempt
        assert attempt is not None
        router = self.picker.router
        if status >= 500 or not served:
            # Envoy answered itself (no replica reached) or every endpoint it tried failed.
            router.failed(attempt, f"http_{status}")
            job.failures.append(f"http_{status}: {attempt.backend.name}")
            job.status = str(status)
        elif status >= 400:
            router.refused(attempt)
            job.status = str(status)
        elif job.checked.stream:
            self.relay = SSERelay(job, attempt, None, None, b"", self.picker,  # type: ignore
                                  self.gateway._job_done)

    def _follow_fallback(self, served: str | None) -> None:
        """Envoy reached ``served``: if that is a fallback, every replica named before it
        failed (connect error, reset or 5xx, as the route's retry policy says), and the
        request now runs on ``served``: booked there like a retry in ``serve``."""
        attempt, job = self.attempt, self.job
        if not served or attempt is None or job is None:
            return
        address = self.picker.address
        if served == address(attempt.backend):
            return
        # Envoy goes down the list the EPP named, nowhere else.
        backend = next((b for b in self.tried if address(b) == served), None)
        if backend is None:
            return
        router = self.picker.router
        for failed in self.tried:
            if failed is backend:
                break
            if failed is attempt.backend:
                router.failed(attempt, "envoy_retry")
            else:  # a fallback Envoy tried and passed over: never booked, but it failed
                failed.record_failure("envoy_retry")
            job.failures.append(f"envoy_retry: {failed.name}")
        self.gateway.metrics.retries.labels("envoy_retry").inc()
        self._book([backend], job.attempts)

    def _response_body(self, message: ext.ProcessingRequest) -> ext.ProcessingResponse | None:
        if self.attempt is None or self.job is None or self.done:
            return _CONTINUE_RESPONSE_BODY
        if not self.status:  # no headers message: the attributes on the first body message
            self._answer_started(*_response_attributes(message))
        attempt = self.attempt
        body = message.response_body
        data = body.body
        response = _CONTINUE_RESPONSE_BODY
        relay = self.relay
        if relay is not None:
            if data:
                self.picker.router.first_byte(attempt)
            out = relay.take(data) if data else b""
            if body.end_of_stream:
                out += relay.tail()
            if out != data:
                response = ext.ProcessingResponse(response_body=ext.BodyResponse(
                    response=ext.CommonResponse(body_mutation=ext.BodyMutation(body=out))))
        elif not attempt.finished and self.answer_size < _NON_STREAM_LIMIT:
            self.answer.append(data)
            self.answer_size += len(data)
            whole = None if body.end_of_stream else _whole_json(self.answer)
            if whole is not None:
                # A non-streamed answer is one JSON object: once it parses, its usage is
                # known and only the end-of-stream message (empty) would follow. The stream
                # closes with no answer to this message: Envoy then goes on with the body
                # as it is, which is what the answer would say.
                self.complete = True
                self._end_of_answer(usage_in(whole))
                return None
        if body.end_of_stream:
            self._end_of_answer()
        return response

    def logged(self, entry: Any, ours: struct_pb2.Struct | None) -> None:
        """Envoy's access log entry of this handed-off request (``ours``: the entry's
        metadata in the EPP's namespace): it ended with the entry's status, on the replica
        it names, with the usage Envoy read from the answer; with no status (the caller
        left, or Envoy gave up before any answer) or cut short after it, abandoned."""
        if self.attempt is None or self.job is None or self.done:
            self.close()
            return
        status = entry.response.response_code.value
        common = entry.common_properties
        address = common.upstream_remote_address.socket_address
        served = address_of(address.address, address.port_value) if address.address else None
        flags = common.response_flags
        if not status or flags.downstream_connection_termination or (
                status < 500 and any(getattr(flags, flag) for flag in _UPSTREAM_CUT)):
            self.status = status
            if status:
                self._follow_fallback(served)
            self.close()
            return
        self._answer_started(status, served)
        if self.attempt.finished:  # failed or refused: nothing to read
            self._finish()
            return
        self._end_of_answer(_usage_from(ours.fields) if ours is not None else None)

    def _end_of_answer(self, usage: dict | None = None) -> None:
        """The answer ended; ``usage``: its usage when the caller already parsed it, else
        it is read from the answer's bytes."""
        attempt, job = self.attempt, self.job
        assert attempt is not None and job is not None
        if not attempt.finished:
            self.picker.router.first_byte(attempt, whole=True)
            if usage is None and self.answer:
                usage = _usage_of(b"".join(self.answer))
            self.picker.router.succeeded(attempt, usage)
            job.cached_tokens = attempt.record.reported_cached_tokens
            job.usage = usage
            job.status = str(self.status)
        self.answer = []
        self._finish()

    # -- ends -----------------------------------------------------------------------------

    def _refuse(self, error: GatewayError) -> ext.ProcessingResponse:
        self._account(str(error.status), error.message)
        return immediate(error, self.request_id)

    def _account(self, status: str, error: str | None = None) -> None:
        """A request answered without a replica (refused, or ``/v1/models``)."""
        self._forget_id()
        self.done = True
        if self.open:
            self.open = False
            self.gateway.open_requests -= 1
        self.gateway._account(self.endpoint or "other", status, self.started,
                              self.request_id, self.tenant.name if self.tenant else "-",
                              error=error)

    def _finish(self) -> None:
        """The request's answer is complete (or it ended): its slot and count go back, once."""
        if self.done:
            return
        self._forget_id()
        self.done = True
        job = self.job
        if job is not None:
            self.open = False
            self.gateway._job_done(job)  # releases the admission slot, counts, logs

    def close(self) -> None:
        """Envoy ended the exchange: whatever did not end yet ends now. Before any response
        header the replica never answered (the caller left, or Envoy gave up); after, the
        caller left during the answer."""
        attempt, job = self.attempt, self.job
        if attempt is not None and job is not None and not attempt.finished:
            self.picker.router.abandoned(attempt, started=bool(self.status))
            job.status = "client_closed"
        if job is not None:
            self._finish()
        elif self.open:
            self.open = False
            self.gateway.open_requests -= 1
        self._forget_id()

    def _forget_id(self) -> None:
        if self.logged_id:
            self.picker.id_closed(self.logged_id)
            self.logged_id = ""


def _usage_from(fields: Any) -> dict | None:
    """The answer's ``usage`` object rebuilt from the values Envoy read into metadata (each
    under its name in :data:`USAGE_KEYS`, at its path there), or ``None`` if it read none."""
    usage: dict = {}
    for name, path in USAGE_KEYS.items():
        if name in fields:
            *parents, last = path[1:]
            node = usage
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = int(fields[name].number_value)
    return usage or None


def _whole_json(parts: list[bytes]) -> object | None:
    """The chunks read so far parsed, if they make one whole JSON value (tried only when
    the last one ends with ``}``, so a long answer's chunks are not parsed over and over);
    else None. Parsed once: its usage is read from this."""
    if not parts[-1].rstrip().endswith(b"}"):
        return None
    try:
        return orjson.loads(b"".join(parts))
    except ValueError:
        return None


def _response_attributes(message: ext.ProcessingRequest) -> tuple[int, str | None]:
    """The status and the replica that served (``response.code``, ``upstream.address``:
    the ``response_attributes`` the bootstrap asks Envoy for), from the first response
    message when Envoy sends no headers message; then the protocol's metadata."""
    attributes = message.attributes.get(ATTRIBUTES_KEY)
    status, served = 0, None
    if attributes is not None:
        code = attributes.fields.get("response.code")
        if code is not None:
            kind = code.WhichOneof("kind")
            if kind == "number_value":
                status = int(code.number_value)
            elif kind == "string_value" and code.string_value.isdigit():
                status = int(code.string_value)
        address = attributes.fields.get("upstream.address")
        if address is not None and address.string_value:
            served = address.string_value
    return status, served or _served_from_metadata(message)


def _served_from_metadata(message: ext.ProcessingRequest) -> str | None:
    """The served endpoint as the protocol's data plane reports it (``envoy.lb`` metadata),
    for gateways that set it rather than the response header."""
    if not message.HasField("metadata_context"):
        return None
    lb = message.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if lb is None:
        return None
    value = lb.fields.get(SERVED)
    return value.string_value if value is not None and value.string_value else None


__all__ = ["EndpointPicker", "Exchange", "ExchangeRun", "immediate"]
