"""Limits on a request's head, before anything of the request reaches the app.

uvicorn's httptools protocol has no limit of its own on the size of a request line and its
headers, nor on the time they take to arrive (its h11 protocol has a size limit, but serves
a proxied request at a fraction of the speed). httptools gathers a header's value by
concatenation until the header ends, so one unauthenticated connection sending a header of
100 MiB held that much memory and the quadratic copying stalled every other request on the
event loop. :class:`HeadGuard` is an ``asyncio.Protocol`` in front of uvicorn's httptools
protocol, passed to uvicorn as its ``http`` protocol class (a documented option): it reads
the same bytes with a second httptools parser that only marks where each request's head
begins and ends (no header callbacks, so nothing is gathered), and hands the bytes on.

* A head (request line and headers) longer than ``max_header_bytes`` is answered 431 and the
  connection closed; the bytes over the limit never reach uvicorn, so a connection holds at
  most the limit and one read (uvloop reads up to 256 KiB) of head.
* A head that takes longer than ``header_timeout_s`` (from the connection's start, or from
  the request's first byte on a kept-alive connection) is answered 408 and the connection
  closed: a caller that sends nothing, or a header a byte at a time, cannot hold a
  connection. On a kept-alive connection whose earlier request may still be answering, the
  connection is closed without a 408 (it could land inside that answer).

Time to receive the body is limited where the body is read (``app.Gateway._read_body``,
``limits.body_timeout_s``). Both answers are OpenAI-style error objects. After an answer the
guard stops reading and closes the connection :data:`LINGER_S` later, so a caller still
sending has time to read the answer before the close resets the connection, while its
unread bytes cost nothing.
"""

from __future__ import annotations

import asyncio
import json
from contextvars import ContextVar
from typing import Any

import httptools
from uvicorn.config import HTTP_PROTOCOLS
from uvicorn.importer import import_from_string

from prefixroute.edges.gateway.errors import error_body

# The class uvicorn runs for ``http="httptools"``, resolved the way uvicorn resolves it.
HTTPTOOLS_PROTOCOL: type[asyncio.Protocol] = import_from_string(HTTP_PROTOCOLS["httptools"])
LINGER_S = 2.0
_REASONS = {408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


# The connection (its :class:`HeadGuard`) whose bytes are being handed to uvicorn: set around
# uvicorn's ``data_received``, where it starts a request's task, so that the task (asyncio
# copies the current context into a task it creates) knows the connection its request came
# on. A pipelined request's task is started from the previous one's, on the same connection.
# How a stream splices into the caller's connection (``proxy._SpliceSink``).
connection: ContextVar["HeadGuard | None"] = ContextVar("prefixroute_connection", default=None)


def guarded_protocol(max_header_bytes: int, header_timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol behind a :class:`HeadGuard` with these limits."""
    return type("GuardedHttpToolsProtocol", (HeadGuard,), {
        "max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s})


class HeadGuard(asyncio.Protocol):
    """One connection: the byte count and deadline of the request head under way.

    Invariant: ``in_head`` is true from a connection's start or a request's first byte until
    that request's headers are complete; ``head_bytes`` counts the bytes received meanwhile
    (whole reads: at most one read more than the head itself), and ``deadline`` is when the
    head must be complete (``None`` between requests). One timer per connection checks the
    deadline and re-arms itself for a later one, so a request costs a clock read, not a
    timer of its own (a timer set and cancelled per request doubled the guard's cost)."""

    max_header_bytes = 64 * 1024
    header_timeout_s = 10.0

    def __init__(self, *args: Any, **kwargs: Any):
        self.inner = HTTPTOOLS_PROTOCOL(*args, **kwargs)
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_data_after_close=True)  # as uvicorn's
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.in_head = True
        self.head_bytes = 0
        self.heads_done = 0  # requests on this connection whose heads were complete
        self.deadline: float | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.passthrough = False  # the parsers disagree or the protocol switched: hand on
        self.refused = False
        # What a stream spliced into this connection needs, kept here from the transport's
        # own callbacks: the writes uvicorn makes go through ``output``.
        self.output: Output | None = None
        self.write_paused = False
        self.disconnected = False
        self.writable: asyncio.Future | None = None  # awaited by drain() while paused

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.loop = asyncio.get_running_loop()
        self._start_clock()
        self.output = Output(transport)
        self.inner.connection_made(self.output)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        if not self.passthrough:
            try:
                self.parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self.passthrough = True
            except httptools.HttpParserError:
                self.passthrough = True  # uvicorn's parser fails on it too and answers 400
            if self.in_head and not self.passthrough:
                self.head_bytes += len(data)
                if self.head_bytes > self.max_header_bytes:
                    self._refuse(431, f"the request line and headers exceed "
                                 f"{self.max_header_bytes} bytes", "headers_too_large")
                    return
        token = connection.set(self)
        try:
            self.inner.data_received(data)
        finally:
            connection.reset(token)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self.disconnected = True
        self._now_writable()
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.write_paused = True
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._now_writable()
        self.inner.resume_writing()

    # -- for a spliced stream ------------------------------------------------------------

    async def drain(self) -> None:
        """Until the caller's write buffer is below its low-water mark (or the caller left)."""
        while self.write_paused and not self.disconnected:
            if self.writable is None:
                self.writable = asyncio.get_running_loop().create_future()
            await asyncio.shield(self.writable)

    def _now_writable(self) -> None:
        writable, self.writable = self.writable, None
        if writable is not None and not writable.done():
            writable.set_result(None)

    # -- httptools callbacks (the guard's own parser) ------------------------------------

    def on_message_begin(self) -> None:
        self.in_head = True
        self.head_bytes = 0
        if self.deadline is None:  # (a new connection's clock runs from its start)
            self._start_clock()

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.heads_done += 1
        self.deadline = None

    # -- limits --------------------------------------------------------------------------

    def _start_clock(self) -> None:
        assert self.loop is not None
        self.deadline = self.loop.time() + self.header_timeout_s
        if self.timer is None:
            self.timer = self.loop.call_at(self.deadline, self._check_deadline)

    def _disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def _check_deadline(self) -> None:
        self.timer = None
        deadline = self.deadline
        if deadline is None or not self.in_head or self.refused or self.passthrough:
            return
        assert self.loop is not None
        if self.loop.time() < deadline:  # a later request's: wait for it
            self.timer = self.loop.call_at(deadline, self._check_deadline)
            return
        message = f"the request line and headers did not arrive within " \
                  f"{self.header_timeout_s:g} s"
        if self.heads_done:
            self._close_quietly()  # an earlier answer may still be going out
        else:
            self._refuse(408, message, "request_timeout")

    def _refuse(self, status: int, message: str, code: str) -> None:
        """Answer ``status`` with an OpenAI-style error and close, lingering (module
        docstring)."""
        self.refused = True
        self._disarm()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
        transport.write(b"HTTP/1.1 %d %b\r\ncontent-type: application/json\r\n"
                        b"content-length: %d\r\nconnection: close\r\n\r\n%b"
                        % (status, _REASONS[status], len(body), body))
        self._close_quietly()

    def _close_quietly(self) -> None:
        self.refused = True
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.pause_reading()
        asyncio.get_running_loop().call_later(LINGER_S, transport.close)


class Output:
    """The transport as uvicorn's protocol sees it: writes go to the real one, except that
    after :meth:`hold` the next write (a response head) waits to leave in one write with what
    follows it (one syscall and one segment instead of two): the next write here (a whole
    answer's body), or the first event of a spliced stream, which takes the head
    (:meth:`take`).
    Anything else asked of the transport (close, is_closing...) sends a waiting head first
    and goes to the real one."""

    __slots__ = ("transport", "head", "holding")

    def __init__(self, transport: Any):
        self.transport = transport
        self.head = b""
        self.holding = False

    def write(self, data: bytes) -> None:
        if self.holding:
            self.holding = False
            self.head = data
            return
        if self.head:
            data, self.head = self.head + data, b""
        self.transport.write(data)

    def hold(self) -> None:
        """Keep the next write back (see the class docstring)."""
        self.release()
        self.holding = True

    def take(self) -> bytes:
        """The held head, now the caller's to write."""
        head, self.head = self.head, b""
        return head

    def release(self) -> None:
        """Stop holding; write a head still held (nothing followed it, or an error came)."""
        self.holding = False
        head = self.take()
        if head:
            self.transport.write(head)

    def __getattr__(self, name: str) -> Any:
        self.release()
        return getattr(self.transport, name)
