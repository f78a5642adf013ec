"""A small HTTP/1.1 client on asyncio streams: keep-alive pools and streamed bodies.

Why not httpx alone: its connection pool (httpcore) scans every pooled connection on each
request and parses with the pure-Python ``h11``, about a millisecond of CPU per proxied request
on this project's 2-core machines (``benchmarks/emulator_rps.py`` saw the same from the client
side). This client does only what a proxy and a load generator need, and parses responses with
``httptools`` (the C parser uvicorn serves with):

* one pool of idle keep-alive connections per origin, most recently used first; a pooled
  connection the server has closed is noticed before use (EOF already read), and a request
  whose reused connection turns out dead before the first response byte is sent once more on a
  new connection (the server never saw it: nothing is answered twice);
* bodies framed by ``Content-Length``, ``chunked`` or the connection's end, delivered as they
  arrive (:meth:`Response.aiter_raw`); a connection is reused only when its body was read to
  the end and neither side asked to close;
* connect, write and read (between bytes) timeouts.

:class:`HTTP1Transport` puts it under ``httpx.AsyncClient`` (for code written against httpx);
:class:`HttpxClient` goes the other way, an ``httpx.AsyncClient`` behind this client's
``request`` and :class:`Response`, so code written against this client runs on any httpx
transport (tests use ``httpx.MockTransport``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import AsyncIterator, Iterable, Mapping
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


class _Connection:
    __slots__ = ("reader", "writer", "origin", "reused")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 origin: _Origin):
        self.reader = reader
        self.writer = writer
        self.origin = origin
        self.reused = False

    def usable(self) -> bool:
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        self.writer.close()


class _Events:
    """httptools callbacks, collected."""

    __slots__ = ("headers", "body", "headers_done", "complete", "framed", "keep_alive",
                 "parser")

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.keep_alive = False  # read at the end of the headers: later the parser forgets
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.headers_done = False
        self.complete = False
        self.framed = False  # Content-Length or chunked: the body's end is known

    def on_header(self, name: bytes, value: bytes) -> None:
        lower = name.lower()
        if lower == b"content-length" or (lower == b"transfer-encoding"
                                          and b"chunked" in value.lower()):
            self.framed = True
        self.headers.append((lower, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        if self.parser is not None:
            self.keep_alive = self.parser.should_keep_alive()
            self.parser = None  # no reference cycle with the parser that holds us

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class _ReadTimer:
    """The read timeout (at most ``seconds`` waiting for the server's next bytes) with one
    loop timer per response instead of an ``asyncio.timeout`` per read: making, scheduling and
    cancelling one for every read of a streamed body was a tenth of a proxied stream's CPU.

    The timer is due ``seconds`` after the read under way started; when it fires early (that
    read ended and another began) it is pushed back to the current read's due time, and with
    no read under way it lapses until the next read arms it again. On expiry the reading task
    is cancelled and the read raises ``TimeoutError`` (a cancellation from anyone else stays a
    cancellation)."""

    __slots__ = ("seconds", "loop", "handle", "task", "read_started", "expired")

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.loop = asyncio.get_running_loop()
        self.handle: asyncio.TimerHandle | None = None
        self.task: asyncio.Task | None = None
        self.read_started: float | None = None
        self.expired = False

    async def read(self, reader: asyncio.StreamReader) -> bytes:
        if self.seconds is None:
            return await reader.read(READ_SIZE)
        self.task = asyncio.current_task()
        self.read_started = now = self.loop.time()
        if self.handle is None:
            self.handle = self.loop.call_at(now + self.seconds, self._fire)
        try:
            return await reader.read(READ_SIZE)
        except asyncio.CancelledError:
            if self.expired and self.task is not None and self.task.uncancel() == 0:
                raise TimeoutError() from None
            raise
        finally:
            self.read_started = None

    def _fire(self) -> None:
        self.handle = None
        started = self.read_started
        if started is None or self.seconds is None:
            return
        due = started + self.seconds
        if self.loop.time() < due:
            self.handle = self.loop.call_at(due, self._fire)
            return
        self.expired = True
        if self.task is not None:
            self.task.cancel()

    def stop(self) -> None:
        if self.handle is not None:
            self.handle.cancel()
            self.handle = None


class Response:
    """A response whose status and headers have arrived; the body follows on demand.

    Read the body with :meth:`aiter_raw` or :meth:`aread`, or drop it with :meth:`aclose`
    (which closes the connection when the body was not read to its end)."""

    __slots__ = ("status", "raw_headers", "_headers", "_client", "_conn", "_parser", "_events",
                 "_timer", "_done")

    def __init__(self, status: int, client: "Client", conn: _Connection,
                 parser: httptools.HttpResponseParser, events: _Events, timer: _ReadTimer,
                 no_body: bool):
        self.status = status
        self.raw_headers = events.headers
        self._headers: dict[str, str] | None = None
        self._client = client
        self._conn: _Connection | None = conn
        self._parser = parser
        self._events = events
        self._timer = timer
        self._done = False
        if no_body:
            events.body.clear()
            self._finish(events.keep_alive)

    @property
    def headers(self) -> dict[str, str]:
        """Lowercase names; the last value of a repeated header."""
        if self._headers is None:
            self._headers = {k.decode("latin-1"): v.decode("latin-1")
                             for k, v in self.raw_headers}
        return self._headers

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body bytes as they arrive (de-chunked, not decompressed)."""
        events = self._events
        while True:
            if events.body:
                data = events.body[0] if len(events.body) == 1 else b"".join(events.body)
                events.body.clear()
                if events.complete:
                    self._finish(events.keep_alive)
                yield data
            if events.complete or self._done:
                if not self._done:
                    self._finish(events.keep_alive)
                return
            conn = self._conn
            assert conn is not None
            try:
                data = await self._timer.read(conn.reader)
            except TimeoutError:
                self._abort()
                raise RequestTimeout("read", self._timer.seconds) from None
            except OSError as exc:
                self._abort()
                raise ProtocolError(f"connection lost while reading the body: {exc}") from None
            except BaseException:  # cancelled: the connection is mid-body, unusable
                self._abort()
                raise
            if not data:
                if events.framed:
                    self._abort()
                    raise ProtocolError("the server closed the connection before the end of "
                                        "the body")
                events.complete = True  # the body ends with the connection
                self._finish(False)
                continue
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserError as exc:
                self._abort()
                raise ProtocolError(f"malformed response body: {exc}") from None

    async def aread(self) -> bytes:
        chunks = [chunk async for chunk in self.aiter_raw()]
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def aclose(self) -> None:
        if not self._done:
            self._abort()

    def _finish(self, keep_alive: bool) -> None:
        conn, self._conn = self._conn, None
        self._done = True
        self._timer.stop()
        if conn is not None:
            self._client._release(conn, keep_alive)

    def _abort(self) -> None:
        conn, self._conn = self._conn, None
        self._done = True
        self._timer.stop()
        if conn is not None:
            conn.close()


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
            try:
                await self._send(conn, head, body, self.write_timeout if write_timeout is None
                                 else write_timeout)
                return await self._read_head(conn, method, read_s)
            except _Stale:
                conn.close()
                if fresh:  # cannot happen on a new connection; guard against a loop anyway
                    raise ProtocolError("the server closed the connection without answering")
                continue  # the server closed an idle connection: send on a new one
            except BaseException:
                conn.close()
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
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(origin.host, origin.port,
                                                               limit=READ_SIZE)
        except TimeoutError:
            raise RequestTimeout("connect", timeout) from None
        except OSError as exc:
            raise ConnectError(f"cannot connect to {origin.host}:{origin.port}: "
                               f"{exc.strerror or exc}") from None
        return _Connection(reader, writer, origin)

    async def _send(self, conn: _Connection, head: bytes, body: bytes, timeout: float) -> None:
        writer = conn.writer
        try:
            if len(body) < 16384:
                writer.write(head + body)
            else:
                writer.write(head)
                writer.write(body)
            if writer.transport.get_write_buffer_size() > READ_SIZE:
                async with asyncio.timeout(timeout):
                    await writer.drain()
        except TimeoutError:
            raise RequestTimeout("write", timeout) from None
        except OSError as exc:
            if conn.reused:
                raise _Stale() from None
            raise ProtocolError(f"connection lost while sending: {exc}") from None

    async def _read_head(self, conn: _Connection, method: str, timeout: float) -> Response:
        events = _Events()
        parser = events.parser = httptools.HttpResponseParser(events)
        received = 0
        timer = _ReadTimer(timeout)
        try:
            while not events.headers_done:
                data = await self._read_head_bytes(conn, timer, received)
                received += len(data)
                try:
                    parser.feed_data(data)
                except httptools.HttpParserError as exc:
                    raise ProtocolError(f"malformed response: {exc}") from None
                if events.headers_done and parser.get_status_code() < 200:
                    # Interim answers (100 Continue, 103 Early Hints) are never asked for here.
                    raise ProtocolError("interim (1xx) responses are not supported")
        except BaseException:
            timer.stop()
            raise
        status = parser.get_status_code()
        return Response(status, self, conn, parser, events, timer,
                        no_body=method == "HEAD" or status in _NO_BODY_STATUSES)

    @staticmethod
    async def _read_head_bytes(conn: _Connection, timer: _ReadTimer, received: int) -> bytes:
        try:
            data = await timer.read(conn.reader)
        except TimeoutError:
            raise RequestTimeout("read", timer.seconds) from None
        except OSError as exc:
            if conn.reused and not received:
                raise _Stale() from None
            raise ProtocolError(f"connection lost before the response: {exc}") from None
        if not data:
            if conn.reused and not received:
                raise _Stale()
            raise ProtocolError("the server closed the connection without answering")
        return data

    def _release(self, conn: _Connection, keep_alive: bool) -> None:
        idle = conn.origin.idle
        if keep_alive and not self._closed and conn.usable() \
                and len(idle) < self.max_idle_per_origin:
            idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        self._closed = True
        for origin in self._origins.values():
            while origin.idle:
                origin.idle.pop().close()


class _Stale(Exception):
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


__all__ = ["Client", "Response", "HTTP1Transport", "HttpxClient", "TransportError",
           "ConnectError", "RequestTimeout", "ProtocolError"]
