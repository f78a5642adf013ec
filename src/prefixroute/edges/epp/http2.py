"""A small gRPC server over HTTP/2 for one streaming service: what the Endpoint Picker needs
to answer Envoy's ext_proc streams, on the event loop, with few Python steps per message.

Why not a gRPC library: per request, Envoy's ext_proc filter sends the EPP two messages and
takes one or two answers and the trailers. Measured behind the same Envoy on one core, a
server that does nothing but answer took 0.38 to 0.46 ms of CPU per request on grpclib
(pure-Python HTTP/2 through ``h2``, a task and several futures per stream), 0.35 ms on
grpcio's asyncio server (each message handed from gRPC's poller thread to the loop), 0.40 ms
on grpcio's threaded server, and 0.08 ms on this module, which does only what such a server
needs: a message costs a frame parse and a protobuf parse
(``benchmarks/results/epp_history.md``). The EPP's whole process, routing included, takes
0.25 to 0.4 ms per request at its maximum.

* **Framing** by hand (a 9-byte header, RFC 9113); **header blocks** through the ``hpack``
  library (the Huffman code and the dynamic table are the error-prone part). Envoy opens
  every stream with the same block, which leaves the table as it is: such a block is
  decoded once and kept until a block that changes the table arrives
  (:func:`leaves_table_alone`). Header blocks sent are literals without indexing, so the
  encoder keeps no state to get wrong.
* **Flow control.** Received: each stream's window is the maximum, 2 GiB over the stream's
  life (an ext_proc stream carries one request and its answer; the service bounds each
  message's size), and the connection's is topped up as it is consumed, so Envoy never
  waits on the EPP's windows and no per-stream update is sent. Sent: the peer's windows
  and frame size are kept; what does not fit waits for its ``WINDOW_UPDATE``.
* **Batching.** Frames produced while the bytes of one read are handled go out in one write
  (answers made inside the read, trailers, acknowledgements): one system call, not one per
  frame.
* **Back-pressure.** When the transport's write buffer fills, reading stops until it drains
  (no new messages, so no new answers; those already being made still go out).
* **Streams end** with their trailers, and a peer still sending is told to stop
  (``RST_STREAM`` ``NO_ERROR``, as gRPC's own servers do), so a stream holds nothing once
  its answer is complete.
* **Errors.** A malformed frame ends the connection with ``GOAWAY`` and a protocol error
  code; a stream past ``MAX_STREAMS`` is refused (``REFUSED_STREAM``); an unknown method
  is answered ``UNIMPLEMENTED``, a message past the size limit ``RESOURCE_EXHAUSTED``, a
  compressed one (never offered) ``UNIMPLEMENTED``, a stream that ends inside a message
  ``INTERNAL``; a bug in the service fails its own stream (``INTERNAL``), not the
  connection.

The service sees each stream through :class:`Stream` (``send`` a message, ``close`` with a
status) and answers with a :class:`StreamHandler` (``message``, ``end`` when the peer
half-closes, ``reset`` when the stream is cut). Handlers are called inside the read callback;
what they send from there is written once that read is handled, what they send later (from
a task) at once.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Callable, Protocol, cast
from urllib.parse import quote

from hpack import Decoder
from hpack.exceptions import HPACKError

log = logging.getLogger("prefixroute.epp")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# Frame types (RFC 9113, section 6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, \
    CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS, PADDED, PRIORITY_FLAG = 0x4, 0x8, 0x20
# Error codes (section 7)
NO_ERROR, PROTOCOL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x9
ENHANCE_YOUR_CALM = 0xB
# Settings (section 6.5.2)
HEADER_TABLE_SIZE, ENABLE_PUSH, MAX_CONCURRENT_STREAMS, INITIAL_WINDOW_SIZE = 0x1, 0x2, 0x3, 0x4
MAX_FRAME_SIZE, MAX_HEADER_LIST_SIZE = 0x5, 0x6

# gRPC status codes
OK, INVALID_ARGUMENT = 0, 3
RESOURCE_EXHAUSTED, UNIMPLEMENTED, INTERNAL, UNAVAILABLE = 8, 12, 13, 14

MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535
DEFAULT_FRAME_SIZE = 16_384
MAX_STREAMS = 100  # concurrent streams per connection, advertised (h2's default, kept)
RECEIVE_FRAME_SIZE = 1 << 20  # the largest frame accepted: a long prompt in few frames
MAX_HEADER_LIST = 64 * 1024
DECODED_BLOCKS = 64  # header blocks kept decoded per connection
HEADER_TABLE = 4_096  # the protocol's default size of the decoder's dynamic table
MAX_GRPC_MESSAGE = 4 * 1024 * 1024  # what a server takes by default, as gRPC's own
_FRAME = struct.Struct(">IBI")  # length << 8 | type, flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_SETTINGS_SENT = b"".join(_SETTING.pack(k, v) for k, v in (
    (ENABLE_PUSH, 0), (MAX_CONCURRENT_STREAMS, MAX_STREAMS), (INITIAL_WINDOW_SIZE, MAX_WINDOW),
    (MAX_FRAME_SIZE, RECEIVE_FRAME_SIZE), (MAX_HEADER_LIST_SIZE, MAX_HEADER_LIST)))


def _integer(block: bytes, i: int, prefix: int) -> tuple[int, int]:
    """The HPACK integer at ``block[i]`` with a ``prefix``-bit prefix, and where the field
    goes on after it (RFC 7541, 5.1)."""
    mask = (1 << prefix) - 1
    value = block[i] & mask
    i += 1
    if value == mask:
        shift = 0
        while True:
            byte = block[i]
            i += 1
            value += (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
    return value, i


def leaves_table_alone(block: bytes) -> bool:
    """Whether decoding ``block`` leaves the HPACK decoder's dynamic table as it was: every
    field is indexed, a literal without indexing or a never-indexed literal (RFC 7541,
    6.1-6.2.3), with no table size update. Envoy's ext_proc streams open with such blocks,
    the same bytes each time, so a decoded block can be kept and reused until a block that
    changes the table comes. Anything it cannot read is taken as changing the table."""
    i, end = 0, len(block)
    try:
        while i < end:
            byte = block[i]
            if byte & 0x80:  # indexed field
                _, i = _integer(block, i, 7)
            elif byte & 0xE0:  # incremental indexing (01), or a table size update (001)
                return False
            else:  # 0000 or 0001: a literal that is not added to the table
                index, i = _integer(block, i, 4)
                if not index:  # the name as a string
                    length, i = _integer(block, i, 7)
                    i += length
                length, i = _integer(block, i, 7)
                i += length
    except IndexError:
        return False
    return i == end


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _FRAME.pack(len(payload) << 8 | kind, flags, stream_id) + payload


def literal(name: bytes, value: bytes) -> bytes:
    """A header field as an HPACK literal without indexing, new name (RFC 7541, 6.2.2),
    lengths as plain (not Huffman) strings."""
    return b"\x00" + _hpack_int(len(name)) + name + _hpack_int(len(value)) + value


def _hpack_int(n: int) -> bytes:
    """An HPACK integer with a 7-bit prefix and the Huffman bit clear."""
    if n < 127:
        return bytes((n,))
    out = bytearray((127,))
    n -= 127
    while n >= 128:
        out.append(n & 127 | 128)
        n >>= 7
    out.append(n)
    return bytes(out)


# ":status: 200" is entry 8 of HPACK's static table.
_RESPONSE_HEAD = b"\x88" + literal(b"content-type", b"application/grpc")


def trailers_block(status: int, message: str = "") -> bytes:
    block = literal(b"grpc-status", str(status).encode())
    if message:  # percent-encoded, as gRPC's wire format says; kept short
        block += literal(b"grpc-message", quote(message[:512], safe=" ").encode())
    return block


_OK_TRAILERS = trailers_block(OK)


class HeaderBlocks:
    """One connection's header blocks decoded (``hpack``'s decoder), those that leave the
    dynamic table alone kept by their bytes until a block changes the table: the same bytes
    against the same table decode the same."""

    def __init__(self) -> None:
        self.decoder = Decoder(max_header_list_size=MAX_HEADER_LIST)
        self.decoded: dict[bytes, list[tuple[bytes, bytes]]] = {}

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        """The block's fields as ``(name, value)`` bytes; raises ``HPACKError``. Every block
        must come here, in order: the table follows each."""
        headers = self.decoded.get(block)
        if headers is not None:
            return headers
        headers = cast("list[tuple[bytes, bytes]]", self.decoder.decode(block, raw=True))
        if not leaves_table_alone(block):
            self.decoded.clear()
        elif len(self.decoded) < DECODED_BLOCKS:
            self.decoded[block] = headers
        return headers


class Http2Error(Exception):
    """The peer broke the protocol: the connection ends with this error code."""

    def __init__(self, code: int, reason: str):
        super().__init__(reason)
        self.code = code


class StreamHandler(Protocol):
    def message(self, data: bytes) -> None: ...
    def end(self) -> None: ...
    def reset(self) -> None: ...


# What the service makes of a new stream (its path and request headers): its handler, or
# None to answer UNIMPLEMENTED.
Opener = Callable[["Stream", str, "list[tuple[bytes, bytes]]"], "StreamHandler | None"]


class Stream:
    """One gRPC call. ``send`` a message, ``close`` with a status (once; later calls do
    nothing). ``open`` is False once closed by either side."""

    __slots__ = ("id", "connection", "handler", "buffer", "window", "pending", "trailers",
                 "headers_sent", "local_closed", "remote_closed", "open")

    def __init__(self, stream_id: int, connection: "Http2Connection"):
        self.id = stream_id
        self.connection = connection
        self.handler: StreamHandler | None = None
        self.buffer = bytearray()  # received bytes not yet a whole message
        self.window = connection.peer_window
        self.pending = b""  # DATA waiting for window
        self.trailers: bytes | None = None  # a trailers block waiting behind ``pending``
        self.headers_sent = False
        self.local_closed = False
        self.remote_closed = False
        self.open = True

    def send(self, payload: bytes) -> None:
        if self.local_closed or not self.open:
            return
        data = b"\x00" + len(payload).to_bytes(4, "big") + payload
        head = b""
        if not self.headers_sent:
            self.headers_sent = True
            head = frame(HEADERS, END_HEADERS, self.id, self.connection.header_prefix()
                         + _RESPONSE_HEAD)
        if self.pending:
            self.connection.write(head)
            self.pending += data
            return
        self.connection.write(head + self.connection.data_frames(self, data))

    def send_and_close(self, payloads: list[bytes]) -> None:
        """Each message, then the close (status OK), in one write: the peer wakes once."""
        connection = self.connection
        gathered = connection.out is not None  # inside a read: written at its end anyway
        if not gathered:
            connection.out = []
        try:
            for payload in payloads:
                self.send(payload)
            self.close()
        finally:
            if not gathered:
                out, connection.out = connection.out, None
                connection.flush(out)

    def close(self, status: int = OK, message: str = "") -> None:
        if self.local_closed or not self.open:
            return
        self.local_closed = True
        block = _OK_TRAILERS if status == OK and not message else trailers_block(status, message)
        if not self.headers_sent:  # trailers only
            self.headers_sent = True
            block = _RESPONSE_HEAD + block
        if self.pending:
            self.trailers = block
        else:
            self.connection.end_stream(self, block)


class Http2Connection(asyncio.Protocol):
    """One client connection (an Envoy worker's to this EPP)."""

    def __init__(self, opener: Opener, server: "GrpcServer"):
        self.opener = opener
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()  # a frame's bytes not all read yet
        self.preface = False
        self.streams: dict[int, Stream] = {}
        self.last_stream = 0
        self.header_blocks = HeaderBlocks()
        self.header_block: list[bytes] = []
        self.header_stream = 0  # a header block continues on this stream (CONTINUATION)
        self.header_end_stream = False
        self.header_size = 0
        self.settings = False  # the peer's first SETTINGS came (it must come first)
        self.peer_window = DEFAULT_WINDOW  # the peer's initial window for each stream
        self.peer_frame = DEFAULT_FRAME_SIZE
        self.table_update = False  # signal a dynamic table size of 0 in the next block
        self.send_window = DEFAULT_WINDOW  # the connection's
        self.received = 0  # bytes received since the connection window was last topped up
        self.blocked: dict[int, Stream] = {}  # streams with DATA waiting for window
        self.out: list[bytes] | None = None  # frames gathered during one read
        self.peer_goaway = False
        self.closing = False
        self.failed = False

    # -- transport callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.server.connections.add(self)
        transport.write(frame(SETTINGS, 0, 0, _SETTINGS_SENT)  # type: ignore[attr-defined]
                        + frame(WINDOW_UPDATE, 0, 0, _U32.pack(MAX_WINDOW - DEFAULT_WINDOW)))

    def data_received(self, data: bytes) -> None:
        if self.failed:
            return
        buffer = self.buffer
        buf: bytes | bytearray = data
        if buffer:  # (frames are read from the read's own bytes unless one was cut)
            buffer += data
            buf = buffer
        out: list[bytes] = []
        self.out = out
        try:
            position = 0
            if not self.preface:
                if len(buf) < len(PREFACE):
                    if not PREFACE.startswith(buf):
                        raise Http2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                    if buf is not buffer:
                        self.buffer = bytearray(buf)
                    return
                if not buf.startswith(PREFACE):
                    raise Http2Error(PROTOCOL_ERROR, "not an HTTP/2 connection preface")
                self.preface = True
                position = len(PREFACE)
            end = len(buf)
            while end - position >= 9:
                word, flags, stream_id = _FRAME.unpack_from(buf, position)
                length = word >> 8
                if length > RECEIVE_FRAME_SIZE:
                    raise Http2Error(FRAME_SIZE_ERROR, f"a frame of {length} bytes")
                if end - position - 9 < length:
                    break
                start = position + 9
                position = start + length
                payload = buf[start:position]  # (bytes: the read's own, or copied out)
                self.frame(word & 0xFF, flags, stream_id & 0x7FFFFFFF,
                           bytes(payload) if buf is buffer else cast(bytes, payload))
            if buf is buffer:
                del buffer[:position]
            elif position < end:
                self.buffer = bytearray(buf[position:])
        except Http2Error as error:
            self.fail(error.code, str(error))
        finally:
            self.out = None
            self.flush(out)

    def flush(self, out: list[bytes]) -> None:
        """Write the frames gathered while the connection's writes were held (one write),
        then close the connection if it failed, or it is going away with no stream left."""
        if self.transport is not None:
            if out:
                self.transport.write(b"".join(out))
            if self.failed or (self.closing or self.peer_goaway) and not self.streams:
                self.transport.close()

    def eof_received(self) -> bool | None:
        return None  # close the transport (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        streams, self.streams = self.streams, {}
        self.blocked.clear()
        for stream in streams.values():
            stream.open = False
            handler, stream.handler = stream.handler, None
            if handler is not None:
                _reset(handler)

    def pause_writing(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    # -- writing ----------------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        if self.out is not None:
            self.out.append(data)
        elif self.transport is not None:
            self.transport.write(data)

    def header_prefix(self) -> bytes:
        """A dynamic table size update, once, after the peer shrank the table below its
        default (this encoder never adds to the table, but must say so)."""
        if self.table_update:
            self.table_update = False
            return b"\x20"
        return b""

    def data_frames(self, stream: Stream, data: bytes) -> bytes:
        """DATA frames for as much of ``data`` as the windows allow; the rest waits in the
        stream's ``pending``."""
        frames = []
        size = self.peer_frame
        while data:
            room = min(stream.window, self.send_window, size, len(data))
            if room <= 0:
                stream.pending = data
                self.blocked[stream.id] = stream
                break
            frames.append(frame(DATA, 0, stream.id, data[:room]))
            data = data[room:]
            stream.window -= room
            self.send_window -= room
        return b"".join(frames)

    def flush_blocked(self) -> None:
        for stream in list(self.blocked.values()):
            if self.send_window <= 0:
                return
            del self.blocked[stream.id]
            data, stream.pending = stream.pending, b""
            self.write(self.data_frames(stream, data))
            if not stream.pending and stream.trailers is not None:
                block, stream.trailers = stream.trailers, None
                self.end_stream(stream, block)

    def end_stream(self, stream: Stream, block: bytes) -> None:
        """The trailers (``block``) go out, ending this side. A peer still sending is asked
        to stop (``RST_STREAM`` ``NO_ERROR`` after a complete response, RFC 9113 section
        8.1, as gRPC's own servers do) and the stream is forgotten: what it still sends is
        ignored, and it does not hold a place among ``MAX_STREAMS``."""
        self.write(frame(HEADERS, END_HEADERS | END_STREAM, stream.id,
                         self.header_prefix() + block))
        if not stream.remote_closed:
            self.write(frame(RST_STREAM, 0, stream.id, _U32.pack(NO_ERROR)))
        self.forget(stream)

    def forget(self, stream: Stream) -> StreamHandler | None:
        """The stream is over: dropped, and its handler (returned) let go of, so the two
        are freed without waiting for the cycle collector."""
        stream.open = False
        self.streams.pop(stream.id, None)
        self.blocked.pop(stream.id, None)
        handler, stream.handler = stream.handler, None
        if (self.closing or self.peer_goaway) and not self.streams and self.out is None \
                and self.transport is not None:
            self.transport.close()  # (inside a read, the read's end closes it)
        return handler

    def fail(self, code: int, reason: str) -> None:
        """End the connection (called while a read is handled): GOAWAY with ``code``;
        the transport closes once the read's frames are written."""
        log.warning("http/2 connection error", extra={"fields": {
            "event": "epp_connection_error", "code": code, "reason": reason}})
        self.write(frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(code)
                         + reason.encode()[:256]))
        self.failed = True

    def go_away(self) -> None:
        """The server closes: no new stream; the connection ends once its streams have."""
        self.closing = True
        self.write(frame(GOAWAY, 0, 0, _U32.pack(self.last_stream) + _U32.pack(NO_ERROR)))
        if not self.streams and self.transport is not None:
            self.transport.close()

    # -- reading ----------------------------------------------------------------------------

    def frame(self, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if not self.settings:
            if kind != SETTINGS or flags & ACK:
                raise Http2Error(PROTOCOL_ERROR, "the preface must be followed by SETTINGS")
            self.settings = True
        if self.header_stream and (kind != CONTINUATION or stream_id != self.header_stream):
            raise Http2Error(PROTOCOL_ERROR, "a header block was interrupted")
        if kind == DATA:
            self.on_data(flags, stream_id, payload)
        elif kind == HEADERS:
            self.on_headers(flags, stream_id, payload)
        elif kind == CONTINUATION:
            if not self.header_stream:
                raise Http2Error(PROTOCOL_ERROR, "CONTINUATION without a header block")
            self.header_block.append(payload)
            self.header_size += len(payload)
            if self.header_size > MAX_HEADER_LIST:
                raise Http2Error(ENHANCE_YOUR_CALM, "a header block past its limit")
            if flags & END_HEADERS:
                self.headers_done()
        elif kind == SETTINGS:
            self.on_settings(flags, stream_id, payload)
        elif kind == WINDOW_UPDATE:
            self.on_window_update(stream_id, payload)
        elif kind == PING:
            if stream_id or len(payload) != 8:
                raise Http2Error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR, "bad PING")
            if not flags & ACK:
                self.write(frame(PING, ACK, 0, payload))
        elif kind == RST_STREAM:
            if not stream_id or len(payload) != 4:
                raise Http2Error(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR,
                                 "bad RST_STREAM")
            stream = self.streams.get(stream_id)
            if stream is not None:
                handler = self.forget(stream)
                if handler is not None:
                    _reset(handler)
            elif stream_id > self.last_stream:
                raise Http2Error(PROTOCOL_ERROR, "RST_STREAM on an idle stream")
        elif kind == PRIORITY:
            if not stream_id or len(payload) != 5:
                raise Http2Error(PROTOCOL_ERROR if not stream_id else FRAME_SIZE_ERROR,
                                 "bad PRIORITY")
        elif kind == GOAWAY:
            if stream_id or len(payload) < 8:
                raise Http2Error(PROTOCOL_ERROR if stream_id else FRAME_SIZE_ERROR,
                                 "bad GOAWAY")
            self.peer_goaway = True  # (the read's end closes a connection left empty)
        elif kind == PUSH_PROMISE:
            raise Http2Error(PROTOCOL_ERROR, "a client cannot push")
        # Unknown frame types are ignored (section 4.1).

    def on_data(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id:
            raise Http2Error(PROTOCOL_ERROR, "DATA on stream 0")
        # Everything counts against the connection's window, the padding too.
        self.received += len(payload)
        if self.received > MAX_WINDOW // 2:
            self.write(frame(WINDOW_UPDATE, 0, 0, _U32.pack(self.received)))
            self.received = 0
        if flags & PADDED:
            payload = _unpad(payload)
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            if stream_id > self.last_stream:
                raise Http2Error(PROTOCOL_ERROR, "DATA on an idle stream")
            if stream is not None:  # DATA after the peer's own END_STREAM
                self.write(frame(RST_STREAM, 0, stream_id, _U32.pack(STREAM_CLOSED)))
                handler = self.forget(stream)
                if handler is not None:
                    _reset(handler)
            return  # a stream this side ended or reset: ignored (section 5.1)
        if flags & END_STREAM:  # (known before the messages: an answer to them ends both)
            stream.remote_closed = True
        if payload:
            # Messages are read from the frame itself; only a message split over frames
            # is gathered in the stream's buffer.
            buffer = stream.buffer
            data: bytes | bytearray = payload
            if buffer:
                buffer += payload
                data = buffer
            position, end = 0, len(data)
            while end - position >= 5 and not stream.local_closed:
                size = int.from_bytes(data[position + 1:position + 5], "big")
                if data[position]:
                    self.refuse(stream, UNIMPLEMENTED, "compressed messages are not accepted")
                elif size > self.server.max_message:
                    self.refuse(stream, RESOURCE_EXHAUSTED, f"a message of {size} bytes; the "
                                f"limit is {self.server.max_message}")
                if stream.local_closed or end - position - 5 < size:
                    break
                message = bytes(data[position + 5:position + 5 + size])
                position += 5 + size
                self.deliver(stream, message)
            if stream.local_closed:
                stream.buffer = bytearray()
            elif buffer:
                del buffer[:position]
            elif position < end:
                stream.buffer = bytearray(data[position:])
        if flags & END_STREAM:
            self.remote_end(stream)

    def deliver(self, stream: Stream, message: bytes) -> None:
        handler = stream.handler
        if handler is None:
            return
        try:
            handler.message(message)
        except Exception as exc:  # a bug in the service: this stream fails, not the others
            _log_bug(exc)
            self.refuse(stream, INTERNAL, "internal error")

    def refuse(self, stream: Stream, status: int, message: str) -> None:
        """End a stream the service cannot take more of: its status, and its handler
        reset (nothing more will come to it)."""
        handler, stream.handler = stream.handler, None
        stream.close(status, message)
        if handler is not None:
            _reset(handler)

    def remote_end(self, stream: Stream) -> None:
        stream.remote_closed = True
        if stream.local_closed and stream.trailers is None:
            self.forget(stream)
        handler = stream.handler
        if handler is None or stream.local_closed:
            return
        if stream.buffer:
            self.refuse(stream, INTERNAL, "the stream ended inside a message")
            return
        try:
            handler.end()
        except Exception as exc:  # a bug in the service: this stream fails, not the others
            _log_bug(exc)
            self.refuse(stream, INTERNAL, "internal error")

    def on_headers(self, flags: int, stream_id: int, payload: bytes) -> None:
        if not stream_id or not stream_id & 1:
            raise Http2Error(PROTOCOL_ERROR, f"HEADERS on stream {stream_id}")
        if flags & PADDED:
            payload = _unpad(payload)
        if flags & PRIORITY_FLAG:
            if len(payload) < 5:
                raise Http2Error(FRAME_SIZE_ERROR, "HEADERS too short for its priority")
            payload = payload[5:]
        self.header_block = [payload]
        self.header_size = len(payload)
        self.header_end_stream = bool(flags & END_STREAM)
        self.header_stream = stream_id
        if flags & END_HEADERS:
            self.headers_done()

    def headers_done(self) -> None:
        stream_id, self.header_stream = self.header_stream, 0
        block = b"".join(self.header_block)
        self.header_block = []
        try:
            headers = self.header_blocks.decode(block)
        except HPACKError as exc:
            raise Http2Error(COMPRESSION_ERROR, f"header block: {exc}") from None
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client: they must end the stream
            if not self.header_end_stream:
                raise Http2Error(PROTOCOL_ERROR, "a second header block without END_STREAM")
            if not stream.remote_closed:
                self.remote_end(stream)
            return
        if stream_id <= self.last_stream:
            return  # a stream already ended or reset: ignored
        self.last_stream = stream_id
        if self.closing or self.peer_goaway:
            self.write(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        if len(self.streams) >= MAX_STREAMS:
            self.write(frame(RST_STREAM, 0, stream_id, _U32.pack(REFUSED_STREAM)))
            return
        stream = Stream(stream_id, self)
        self.streams[stream_id] = stream
        stream.remote_closed = self.header_end_stream
        method = path = content_type = b""
        for name, value in headers:
            if name == b":path":
                path = value
            elif name == b":method":
                method = value
            elif name == b"content-type":
                content_type = value
        if method != b"POST" or not content_type.startswith(b"application/grpc"):
            stream.close(UNIMPLEMENTED, "not a gRPC request")
        else:
            try:
                handler = self.opener(stream, path.decode("latin-1"), headers)
            except Exception as exc:
                _log_bug(exc)
                stream.close(INTERNAL, "internal error")
            else:
                if handler is None:
                    stream.close(UNIMPLEMENTED, f"no method {path.decode('latin-1')}")
                elif stream.open and not stream.local_closed:
                    stream.handler = handler
                else:  # the service ended the stream already
                    _reset(handler)
        if self.header_end_stream:
            self.remote_end(stream)

    def on_settings(self, flags: int, stream_id: int, payload: bytes) -> None:
        if stream_id:
            raise Http2Error(PROTOCOL_ERROR, "SETTINGS on a stream")
        if flags & ACK:
            if payload:
                raise Http2Error(FRAME_SIZE_ERROR, "SETTINGS ACK with a payload")
            return
        if len(payload) % 6:
            raise Http2Error(FRAME_SIZE_ERROR, "SETTINGS payload not a multiple of 6")
        for offset in range(0, len(payload), 6):
            key, value = _SETTING.unpack_from(payload, offset)
            if key == INITIAL_WINDOW_SIZE:
                if value > MAX_WINDOW:
                    raise Http2Error(FLOW_CONTROL_ERROR, "initial window past 2^31-1")
                delta, self.peer_window = value - self.peer_window, value
                for stream in self.streams.values():
                    stream.window += delta
            elif key == MAX_FRAME_SIZE:
                if not DEFAULT_FRAME_SIZE <= value <= 2**24 - 1:
                    raise Http2Error(PROTOCOL_ERROR, f"max frame size {value}")
                self.peer_frame = value
            elif key == HEADER_TABLE_SIZE:
                self.table_update = value < HEADER_TABLE
            elif key == ENABLE_PUSH and value > 1:
                raise Http2Error(PROTOCOL_ERROR, "ENABLE_PUSH past 1")
        self.write(frame(SETTINGS, ACK, 0))
        self.flush_blocked()

    def on_window_update(self, stream_id: int, payload: bytes) -> None:
        if len(payload) != 4:
            raise Http2Error(FRAME_SIZE_ERROR, "WINDOW_UPDATE of the wrong size")
        increment = _U32.unpack(payload)[0] & 0x7FFFFFFF
        if not stream_id:
            if not increment:
                raise Http2Error(PROTOCOL_ERROR, "a connection window update of 0")
            self.send_window += increment
            if self.send_window > MAX_WINDOW:
                raise Http2Error(FLOW_CONTROL_ERROR, "the connection window past 2^31-1")
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                return
            if not increment or stream.window + increment > MAX_WINDOW:
                self.write(frame(RST_STREAM, 0, stream_id, _U32.pack(
                    PROTOCOL_ERROR if not increment else FLOW_CONTROL_ERROR)))
                handler = self.forget(stream)
                if handler is not None:
                    _reset(handler)
                return
            stream.window += increment
        if self.blocked:
            self.flush_blocked()


def _log_bug(exc: BaseException) -> None:
    log.error("unexpected error in the gRPC service", exc_info=exc, extra={
        "fields": {"event": "internal_error"}})


def _reset(handler: StreamHandler) -> None:
    """Tell a handler its stream was cut; a bug in it fails no other stream."""
    try:
        handler.reset()
    except Exception as exc:
        _log_bug(exc)


def _unpad(payload: bytes) -> bytes:
    if not payload:
        raise Http2Error(PROTOCOL_ERROR, "padded frame without a pad length")
    pad = payload[0]
    if pad >= len(payload):
        raise Http2Error(PROTOCOL_ERROR, "padding past the frame")
    return payload[1:len(payload) - pad]


class GrpcServer:
    """Listens on a bound socket and serves every connection with ``opener``."""

    def __init__(self, opener: Opener, *, max_message: int = MAX_GRPC_MESSAGE):
        self.opener = opener
        self.max_message = max_message
        self.connections: set[Http2Connection] = set()
        self.server: asyncio.AbstractServer | None = None

    async def start(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        factory = lambda: Http2Connection(self.opener, self)  # noqa: E731
        if sock.family == getattr(socket, "AF_UNIX", None):
            self.server = await loop.create_unix_server(factory, sock=sock)
        else:
            self.server = await loop.create_server(factory, sock=sock)

    def close(self) -> None:
        """Stop listening; each connection gets ``GOAWAY`` and ends once its streams have."""
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.go_away()

    async def wait_closed(self, timeout: float) -> None:
        """Wait up to ``timeout`` for the connections to end, then cut the rest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.connections and loop.time() < deadline:
            await asyncio.sleep(0.02)
        for connection in list(self.connections):
            if connection.transport is not None:
                connection.transport.abort()
        if self.server is not None:
            await self.server.wait_closed()
