"""A small HTTP/1.1 client on asyncio streams: keep-alive pools and streamed bodies.

Why not httpx alone: its connection pool (httpcore) scans every pooled connection on each
request and parses with the pure-Python ``h11``, about a millisecond of CPU per proxied request
on this project's 2-core machines (``benchmarks/emulator_rps.py`` saw the same from the client
side). This client does only what a proxy and a load generator need, and parses responses with
``httptools`` (the C parser uvicorn serves with), from the connection's own protocol callback
(no stream reader; a task wakes up only when it waits for the bytes that arrived):

* one pool of idle keep-alive connections per origin, most recently used first; a pooled
  connection the server has closed is noticed before use (EOF already read), and a request
  whose reused connection turns out dead before the first response byte is sent once more on a
  new connection (the server never saw it: nothing is answered twice);
* bodies framed by ``Content-Length``, ``chunked`` or the connection's end, delivered as they
  arrive (:meth:`Response.aiter_raw`); a connection is reused only when its body was read to
  the end and neither side asked to close;
* connect, write and read (between bytes) timeouts;
* a body can be *spliced* (:meth:`Response.splice`): each chunk is handed, as it arrives, to a
  sink called from the connection's data callback, with pause/resume for back-pressure. A
  proxy relaying many streams then wakes no task and runs no generator per chunk.

:class:`HTTP1Transport` puts it under ``httpx.AsyncClient`` (for code written against httpx);
:class:`HttpxClient` goes the other way, an ``httpx.AsyncClient`` behind this client's
``request`` and :class:`Response`, so code written against this client runs on any httpx
transport (tests use ``httpx.MockTransport``).
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from typing import Any, AsyncIterator, Iterable, Mapping, Protocol
from urllib.parse import urlsplit

import httptools
import httpx

DEFAULT_CONNECT_TIMEOUT_S = 5.0
DEFAULT_READ_TIMEOUT_S = 600.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
DEFAULT_MAX_IDLE_PER_ORIGIN = 256
READ_SIZE = 65536
_NO_BODY_STATUSES = (204, 304)


class TransportError(Exception):
    """The request failed on the network: nothing usable came back."""


class ConnectError(TransportError):
    """No connection could be made (refused, unreachable, or timed out)."""


class RequestTimeout(TransportError):
    """No progress within a timeout; ``phase`` is ``connect``, ``write`` or ``read``."""

    def __init__(self, phase: str, seconds: float | None = None):
        super().__init__(f"{phase} timed out" if seconds is None
                         else f"{phase} timed out after {seconds:g} s")
        self.phase = phase


class ProtocolError(TransportError):
    """The server closed the connection early or answered something that is not HTTP/1.1."""


class _Origin:
    __slots__ = ("host", "port", "host_header", "idle")

    def __init__(self, host: str, port: int, host_header: bytes):
        self.host = host
        self.port = port
        self.host_header = host_header
        self.idle: deque[_Connection] = deque()


class _Connection(asyncio.Protocol):
    """One keep-alive connection. Bytes from the server go straight into the current
    exchange's parser from the loop's callback: no stream reader, and no task wakes up unless
    someone is waiting for exactly those bytes (a spliced body wakes nobody)."""

    __slots__ = ("origin", "transport", "reused", "closed", "exchange", "_drain")

    def __init__(self, origin: _Origin):
        self.origin = origin
        self.transport: asyncio.Transport | None = None
        self.reused = False
        self.closed = False  # EOF seen or connection lost: never used again
        self.exchange: _Exchange | None = None
        self._drain: asyncio.Future | None = None  # set while the write buffer is full

    # -- asyncio.Protocol --

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        exchange = self.exchange
        if exchange is None:  # bytes nobody asked for: the connection is out of step
            self.abort()
            return
        exchange.feed(data)

    def eof_received(self) -> bool:
        self.closed = True
        if self.exchange is not None:
            self.exchange.ended(None)
        return False  # close the transport

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.exchange is not None:
            self.exchange.ended(exc)
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        drain, self._drain = self._drain, None
        if drain is not None and not drain.done():
            drain.set_result(None)

    # -- ours --

    def usable(self) -> bool:
        return not self.closed and self.transport is not None \
            and not self.transport.is_closing()

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        """Drop the connection at once (mid-body: nothing left in it is wanted)."""
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class _Exchange:
    """One response being read: httptools callbacks, the body not yet taken, who waits for
    it (a task awaiting :meth:`wait`, or a splice sink called from the connection's
    callback), and the read timeout.

    The read timeout (at most ``seconds`` waiting for the server's next bytes) is one loop
    timer per response: due ``seconds`` after the wait under way started, pushed back when it
    fires early, lapsing while nobody waits (a slow caller is not a slow server)."""

    __slots__ = ("conn", "client", "parser", "status", "headers", "body", "buffered",
                 "headers_done",
                 "complete", "framed", "keep_alive", "error", "received", "waiter", "sink",
                 "seconds", "loop", "handle", "waiting", "since", "paused", "released")

    def __init__(self, conn: _Connection, client: "Client", seconds: float | None):
        self.conn: _Connection | None = conn
        self.client = client
        # The parser holds bound methods of this object: a reference cycle, broken as soon as
        # the response is over (:meth:`_drop_parser`) so that exchanges are freed by their
        # reference counts, not left to the cyclic GC (thousands of objects per collection).
        self.parser: httptools.HttpResponseParser | None = httptools.HttpResponseParser(self)
        self.status = 0
        self.keep_alive = False  # read at the end of the headers: later the parser forgets
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.buffered = 0
        self.headers_done = False
        self.complete = False
        self.framed = False  # Content-Length or chunked: the body's end is known
        self.error: TransportError | None = None
        self.received = 0
        self.waiter: asyncio.Future | None = None
        self.sink: Sink | None = None
        self.seconds = seconds
        self.loop = asyncio.get_running_loop()
        self.handle: asyncio.TimerHandle | None = None
        self.waiting = False
        self.since = 0.0
        self.paused = False  # reading paused: the body is not being taken
        self.released = False

    # -- httptools callbacks --

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding"
                                          and b"chunked" in value.lower()):
            self.framed = True
        self.headers.append((lower, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        parser = self.parser
        if parser is not None:
            self.status = parser.get_status_code()
            self.keep_alive = parser.should_keep_alive()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True

    # -- from the connection --

    def feed(self, data: bytes) -> None:
        self.received += len(data)
        if self.waiting:
            self.since = self.loop.time()
        parser = self.parser
        if parser is None:  # over already: bytes nobody asked for
            return
        try:
            parser.feed_data(data)
        except httptools.HttpParserError as exc:
            what = "response body" if self.headers_done else "response"
            self._fail(ProtocolError(f"malformed {what}: {exc}"))
            return
        if self.complete:
            self._release()
        sink = self.sink
        if sink is not None:
            if self.body:
                sink.on_body(self.take())
            if self.complete:
                self._end_sink()
            return
        if self.buffered > READ_SIZE and not self.complete and self.conn is not None \
                and not self.paused:
            self.paused = True  # nobody takes the body: stop reading until someone does
            self.conn.transport.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def ended(self, exc: Exception | None) -> None:
        """The server closed the connection (EOF, ``exc`` None) or it was lost."""
        if self.complete or self.error is not None:
            return
        if self.headers_done and not self.framed and exc is None:
            self.complete = True  # the body ends with the connection
            self._release()
            if self.sink is not None:
                self._end_sink()
            else:
                self._wake()
            return
        if not self.headers_done:
            if self.conn is not None and self.conn.reused and not self.received:
                error: TransportError = _Stale()
            elif exc is not None:
                error = ProtocolError(f"connection lost before the response: {exc}")
            else:
                error = ProtocolError("the server closed the connection without answering")
        elif exc is not None:
            error = ProtocolError(f"connection lost while reading the body: {exc}")
        else:
            error = ProtocolError("the server closed the connection before the end of the "
                                  "body")
        self._fail(error)

    # -- for the reader --

    def take(self) -> bytes:
        body = self.body
        data = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self.buffered = 0
        if self.paused and self.sink is None:
            self._resume()
        return data

    async def wait(self) -> None:
        """Until something changes: body bytes, the end, or an error."""
        waiter = self.waiter = self.loop.create_future()
        self._start_waiting()
        try:
            await waiter
        finally:
            self.waiter = None
            self.waiting = False

    def splice(self, sink: "Sink") -> None:
        self.sink = sink
        if self.body:
            sink.on_body(self.take())
        if self.error is not None:
            self._error_sink()
        elif self.complete:
            self._end_sink()
        elif not self.paused:
            self._start_waiting()
        else:
            self.resume()

    def pause(self) -> None:
        if not self.paused and self.conn is not None and not self.complete:
            self.paused = True
            self.waiting = False
            self.conn.transport.pause_reading()  # type: ignore[union-attr]

    def resume(self) -> None:
        if self.paused:
            self._resume()
            if self.sink is not None and not self.complete and self.error is None:
                self._start_waiting()

    def close(self) -> None:
        """Done with it: a connection still mid-body is dropped."""
        self.sink = None
        self._drop_connection()

    # -- inside --

    def _drop_connection(self) -> None:
        """Stop reading for good: the connection, mid-response, cannot be reused."""
        self.parser = None
        self._stop_timer()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            conn.abort()

    def _resume(self) -> None:
        self.paused = False
        if self.conn is not None and not self.conn.closed:
            self.conn.transport.resume_reading()  # type: ignore[union-attr]

    def _start_waiting(self) -> None:
        if self.seconds is None:
            return
        self.waiting = True
        self.since = self.loop.time()
        if self.handle is None:
            self.handle = self.loop.call_at(self.since + self.seconds, self._fire)

    def _fire(self) -> None:
        self.handle = None
        if not self.waiting or self.seconds is None:
            return
        due = self.since + self.seconds
        if self.loop.time() < due:
            self.handle = self.loop.call_at(due, self._fire)
            return
        self._fail(RequestTimeout("read", self.seconds))

    def _stop_timer(self) -> None:
        self.waiting = False
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _release(self) -> None:
        """The whole response is in: the connection goes back to the pool (if both sides
        keep it alive) while the body, if not yet taken, stays here."""
        if self.released:
            return
        self.released = True
        self.parser = None
        self._stop_timer()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.exchange = None
            if self.paused:
                self.paused = False
                if not conn.closed:
                    conn.transport.resume_reading()  # type: ignore[union-attr]
            self.client._release(conn, self.keep_alive)

    def _fail(self, error: TransportError) -> None:
        if self.error is not None or self.complete:
            return
        self.error = error
        self._drop_connection()
        if self.sink is not None:
            self._error_sink()
        else:
            self._wake()

    def _end_sink(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_end()

    def _error_sink(self) -> None:
        sink, self.sink = self.sink, None
        if sink is not None:
            sink.on_error(self.error)  # type: ignore[arg-type]


class Sink(Protocol):
    """Where a spliced body goes (:meth:`Response.splice`); called from the connection's
    callback, so it must not block."""

    def on_body(self, data: bytes) -> None: ...

    def on_end(self) -> None: ...

    def on_error(self, error: TransportError) -> None: ...


class Response:
    """A response whose status and headers have arrived; the body follows on demand.

    Read the body with :meth:`aiter_raw` or :meth:`aread`, hand it to a :class:`Sink` as it
    arrives with :meth:`splice`, or drop it with :meth:`aclose` (which closes the connection
    when the body was not read to its end)."""

    __slots__ = ("status", "raw_headers", "_headers", "_exchange", "_done")

    def __init__(self, status: int, exchange: _Exchange):
        self.status = status
        self.raw_headers = exchange.headers
        self._headers: dict[str, str] | None = None
        self._exchange = exchange
        self._done = False

    @property
    def headers(self) -> dict[str, str]:
        """Lowercase names; the last value of a repeated header."""
        if self._headers is None:
            self._headers = {k.decode("latin-1"): v.decode("latin-1")
                             for k, v in self.raw_headers}
        return self._headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (de-chunked, not decompressed)."""
        exchange = self._exchange
        while True:
            if exchange.body:
                yield exchange.take()
                continue
            if exchange.error is not None:
                self._done = True
                raise exchange.error
            if exchange.complete or self._done:
                self._done = True
                return
            try:
                await exchange.wait()
            except BaseException:  # cancelled: the connection is mid-body, unusable
                self._abort()
                raise

    async def aread(self) -> bytes:
        chunks = [chunk async for chunk in self.aiter_raw()]
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def splice(self, sink: Sink) -> None:
        """From now on, every body chunk goes to ``sink.on_body`` as it arrives, from the
        connection's data callback (what is already buffered goes at once); then exactly one
        of ``sink.on_end()`` or ``sink.on_error(exc)``. :meth:`pause_reading` and
        :meth:`resume_reading` push back on the server; :meth:`aclose` stops it all."""
        self._exchange.splice(sink)

    def pause_reading(self) -> None:
        """Stop reading the server (its read timeout is paused too)."""
        self._exchange.pause()

    def resume_reading(self) -> None:
        self._exchange.resume()

    async def aclose(self) -> None:
        self._abort()

    def _abort(self) -> None:
        if not self._done:
            self._done = True
            exchange = self._exchange
            if not exchange.complete:
                exchange.close()


class Client:
    """HTTP/1.1 requests over pooled keep-alive connections (``http://`` only)."""

    def __init__(self, *, connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
                 read_timeout: float = DEFAULT_READ_TIMEOUT_S,
                 write_timeout: float = DEFAULT_WRITE_TIMEOUT_S,
                 max_idle_per_origin: int = DEFAULT_MAX_IDLE_PER_ORIGIN):
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.write_timeout = write_timeout
        self.max_idle_per_origin = max_idle_per_origin
        self._origins: dict[tuple[str, int], _Origin] = {}
        self._targets: dict[str, tuple[_Origin, bytes]] = {}
        self._closed = False

    def _target(self, url: str) -> tuple[_Origin, bytes]:
        """Origin and request target of ``url``, parsed once per distinct URL."""
        found = self._targets.get(url)
        if found is not None:
            return found
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"only http:// URLs with a host are supported, got {url!r}")
        port = parts.port or 80
        origin = self._origins.get((parts.hostname, port))
        if origin is None:
            origin = self._origins[(parts.hostname, port)] = _Origin(
                parts.hostname, port, parts.netloc.encode("idna"))
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        found = (origin, target.encode())
        if len(self._targets) < 4096:  # a proxy has few distinct URLs; a crawler would not
            self._targets[url] = found
        return found

    async def request(self, method: str, url: str, *, body: bytes = b"",
                      headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]] = (),
                      connect_timeout: float | None = None, read_timeout: float | None = None,
                      write_timeout: float | None = None) -> Response:
        """Send one request; return once the response's status and headers are in."""
        if self._closed:
            raise RuntimeError("the client is closed")
        origin, target = self._target(url)
        head = self._head(method, target, origin, body, headers)
        read_s = self.read_timeout if read_timeout is None else read_timeout
        while True:
            conn = self._idle(origin)
            fresh = conn is None
            if conn is None:
                conn = await self._connect(origin, self.connect_timeout if connect_timeout is None
                                           else connect_timeout)
            exchange = conn.exchange = _Exchange(conn, self, read_s)
            try:
                await self._send(conn, head, body, self.write_timeout if write_timeout is None
                                 else write_timeout)
                return await self._read_head(exchange, method)
            except _Stale:
                exchange.close()
                if fresh:  # cannot happen on a new connection; guard against a loop anyway
                    raise ProtocolError("the server closed the connection without answering")
                continue  # the server closed an idle connection: send on a new one
            except BaseException:
                exchange.close()
                raise

    @staticmethod
    def _head(method: str, target: bytes, origin: _Origin, body: bytes,
              headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]]) -> bytes:
        lines = [method.encode(), b" ", target, b" HTTP/1.1\r\nhost: ", origin.host_header,
                 b"\r\ncontent-length: ", str(len(body)).encode(), b"\r\n"]
        items = headers.items() if isinstance(headers, Mapping) else headers
        for name, value in items:
            if isinstance(name, str):
                name, value = name.encode("latin-1"), value.encode("latin-1")
            lower = name.lower()
            if lower in (b"host", b"content-length", b"transfer-encoding", b"connection"):
                continue  # framing and connection handling are this client's
            lines += (name, b": ", value, b"\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    def _idle(self, origin: _Origin) -> _Connection | None:
        idle = origin.idle
        while idle:
            conn = idle.pop()  # most recently used: warmest, least likely closed by the server
            if conn.usable():
                conn.reused = True
                return conn
            conn.close()
        return None

    async def _connect(self, origin: _Origin, timeout: float) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(lambda: _Connection(origin),
                                                       origin.host, origin.port)
        except TimeoutError:
            raise RequestTimeout("connect", timeout) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {origin.host}:{origin.port}: "
                               f"{exc.strerror or exc}") from None
        return conn

    async def _send(self, conn: _Connection, head: bytes, body: bytes, timeout: float) -> None:
        if not conn.usable():
            if conn.reused:
                raise _Stale()
            raise ProtocolError("the server closed the connection before the request went out")
        transport = conn.transport
        assert transport is not None
        if len(body) < 16384:
            transport.write(head + body)
        else:
            transport.write(head)
            transport.write(body)
        drain = conn._drain
        if drain is not None:
            try:
                async with asyncio.timeout(timeout):
                    await drain
            except TimeoutError:
                raise RequestTimeout("write", timeout) from None

    async def _read_head(self, exchange: _Exchange, method: str) -> Response:
        while not exchange.headers_done:
            if exchange.error is not None:
                raise exchange.error
            await exchange.wait()
        status = exchange.status
        if status < 200:
            # Interim answers (100 Continue, 103 Early Hints) are never asked for here.
            raise ProtocolError("interim (1xx) responses are not supported")
        if method == "HEAD" or status in _NO_BODY_STATUSES:
            exchange.body.clear()
            exchange.buffered = 0
            exchange.complete = True
            exchange._release()
        return Response(status, exchange)

    def _release(self, conn: _Connection, keep_alive: bool) -> None:
        idle = conn.origin.idle
        if keep_alive and not self._closed and conn.usable() \
                and len(idle) < self.max_idle_per_origin:
            conn.reused = True
            idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()


class _Stale(TransportError):
    """A reused connection was found closed before any response byte: resend."""


# -- under httpx ---------------------------------------------------------------------------


class _ByteStream(httpx.AsyncByteStream):
    def __init__(self, response: Response, request: httpx.Request):
        self._response = response
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except RequestTimeout as exc:
            raise httpx.ReadTimeout(str(exc), request=self._request) from None
        except TransportError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=self._request) from None

    async def aclose(self) -> None:
        await self._response.aclose()


class HTTP1Transport(httpx.AsyncBaseTransport):
    """An ``httpx`` transport over :class:`Client`: httpx's API (timeouts from the request's
    ``timeout`` extension, its exception classes) on this client's wire."""

    def __init__(self, client: Client | None = None):
        self.client = client or Client()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeout = request.extensions.get("timeout") or {}
        body = request.content if isinstance(request.stream, httpx.ByteStream) \
            else await request.aread()
        try:
            response = await self.client.request(
                request.method, str(request.url), body=body, headers=request.headers.raw,
                connect_timeout=timeout.get("connect"), read_timeout=timeout.get("read"),
                write_timeout=timeout.get("write"))
        except RequestTimeout as exc:
            error = {"connect": httpx.ConnectTimeout, "write": httpx.WriteTimeout}.get(
                exc.phase, httpx.ReadTimeout)
            raise error(str(exc), request=request) from None
        except ConnectError as exc:
            raise httpx.ConnectError(str(exc), request=request) from None
        except TransportError as exc:
            raise httpx.RemoteProtocolError(str(exc), request=request) from None
        return httpx.Response(response.status, headers=response.raw_headers,
                              stream=_ByteStream(response, request),
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        await self.client.aclose()


# -- httpx under this client's interface ---------------------------------------------------


class _HttpxResponse:
    """An ``httpx.Response`` seen as a :class:`Response` (status, lowercase headers, raw body,
    this module's exceptions)."""

    __slots__ = ("status", "headers", "_response")

    def __init__(self, response: httpx.Response):
        self._response = response
        self.status = response.status_code
        self.headers = {k.lower(): v for k, v in response.headers.items()}

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.aiter_raw():
                yield chunk
        except httpx.TimeoutException as exc:
            raise RequestTimeout("read") from exc
        except httpx.TransportError as exc:
            raise ProtocolError(f"{type(exc).__name__}: {exc}") from exc

    async def aread(self) -> bytes:
        try:
            return await self._response.aread()
        except httpx.TimeoutException as exc:
            raise RequestTimeout("read") from exc
        except httpx.TransportError as exc:
            raise ProtocolError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        await self._response.aclose()


class ProbeAnswer:
    """A whole, small answer to a :class:`ProbeClient` GET: what the gateway's health checks
    and metric scrapes read of ``httpx.Response`` (``status_code``, ``text``, ``json()``)."""

    __slots__ = ("status_code", "content")

    def __init__(self, status_code: int, content: bytes):
        self.status_code = status_code
        self.content = content

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)  # ValueError on a body that is not JSON


class ProbeClient:
    """``await get(url, headers=..., timeout=...)`` as ``httpx.AsyncClient`` has it, over a
    :class:`Client` of its own: for the gateway's health checks and metric scrapes, a few a
    second, whose httpx request and response objects cost more than twice the CPU of the
    GET itself (an emulator's ``/metrics``: about 0.9 ms against 0.35 ms of CPU), CPU the
    replicas on the same machine would otherwise have. ``timeout`` bounds the whole GET.
    Failures are httpx's own exception types, so callers treat both clients alike."""

    def __init__(self, client: Client):
        self.client = client

    async def get(self, url: str, *, headers: Mapping[str, str] | None = None,
                  timeout: float) -> ProbeAnswer:
        try:
            async with asyncio.timeout(timeout):
                response = await self.client.request(
                    "GET", url, headers=headers or (), connect_timeout=timeout,
                    read_timeout=timeout, write_timeout=timeout)
                try:
                    content = await response.aread()
                finally:
                    await response.aclose()
        except (TimeoutError, RequestTimeout) as exc:
            raise httpx.TimeoutException(f"GET {url}: no answer within {timeout:g} s") from exc
        except ConnectError as exc:
            raise httpx.ConnectError(f"GET {url}: {exc}") from exc
        except TransportError as exc:
            raise httpx.TransportError(f"GET {url}: {type(exc).__name__}: {exc}") from exc
        return ProbeAnswer(response.status, content)

    async def aclose(self) -> None:
        await self.client.aclose()


class HttpxClient:
    """:meth:`Client.request` on an ``httpx.AsyncClient`` (its transport and timeouts)."""

    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def request(self, method: str, url: str, *, body: bytes = b"",
                      headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]] = ()
                      ) -> _HttpxResponse:
        request = self.client.build_request(method, url, content=body, headers=headers)
        try:
            return _HttpxResponse(await self.client.send(request, stream=True))
        except httpx.TimeoutException as exc:
            phase = "connect" if isinstance(exc, httpx.ConnectTimeout) else "read"
            raise RequestTimeout(phase) from exc
        except httpx.ConnectError as exc:
            raise ConnectError(f"{type(exc).__name__}: {exc}") from exc
        except httpx.TransportError as exc:
            raise ProtocolError(f"{type(exc).__name__}: {exc}") from exc

    async def aclose(self) -> None:
        pass  # the httpx client belongs to whoever made it


__all__ = ["Client", "Response", "HTTP1Transport", "HttpxClient", "ProbeClient", "TransportError",
           "ConnectError", "RequestTimeout", "ProtocolError"]
