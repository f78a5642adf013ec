"""The Endpoint Picker's gRPC server over HTTP/2 (edges/epp/http2.py): against grpcio's own
client (a complete, independent implementation) and, for the protocol's error paths, raw
frames written by hand over a socket."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

grpc = pytest.importorskip("grpc")
hpack = pytest.importorskip("hpack")

from prefixroute.edges.epp import http2  # noqa: E402
from prefixroute.edges.epp.http2 import (DATA, END_HEADERS, END_STREAM, GOAWAY, HEADERS,  # noqa
                                         PING, RST_STREAM, SETTINGS, GrpcServer, frame)

METHOD = "/test.Echo/Chat"


class Echo:
    """Answers each message with its bytes reversed; ``close:CODE:TEXT`` closes with that
    status; the peer's end closes OK."""

    def __init__(self, stream, log):
        self.stream = stream
        self.log = log

    def message(self, data: bytes) -> None:
        self.log.append(("message", len(data)))
        if data.startswith(b"close:"):
            _, code, text = data.decode().split(":", 2)
            self.stream.close(int(code), text)
        elif data == b"boom":
            raise RuntimeError("a bug in the service")
        else:
            self.stream.send(data[::-1])

    def end(self) -> None:
        self.log.append(("end",))
        self.stream.close()

    def reset(self) -> None:
        self.log.append(("reset",))


class Served:
    """A GrpcServer with the Echo service on its own event loop thread."""

    def __init__(self, max_message: int = 1 << 20):
        self.log: list = []
        self.loop = asyncio.new_event_loop()
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.server = GrpcServer(lambda stream, path, headers: Echo(stream, self.log)
                                 if path == METHOD else None, max_message=max_message)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> "Served":
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(self.sock), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        async def stop():
            self.server.close()
            await self.server.wait_closed(1.0)
        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def call(self, messages, method: str = METHOD, timeout: float = 10):
        with grpc.insecure_channel(f"127.0.0.1:{self.port}") as channel:
            chat = channel.stream_stream(method, request_serializer=None,
                                         response_deserializer=None)
            return list(chat(iter(messages), timeout=timeout))


def test_each_message_is_answered_in_order_and_the_peers_end_closes_ok():
    with Served() as served:
        assert served.call([b"abc", b"hello"]) == [b"cba", b"olleh"]
    assert served.log == [("message", 3), ("message", 5), ("end",)]


def test_messages_larger_than_a_frame_and_than_the_peers_window_arrive_whole():
    # 300 kB each way: more than one 16 kB frame, and more than grpcio's first window of
    # 64 kB, so the answer waits for the client's window updates.
    big = bytes(range(256)) * 1200
    with Served() as served:
        assert served.call([big, b"xy"]) == [big[::-1], b"yx"]


def test_a_status_and_message_reach_the_client_percent_encoded_and_back():
    with Served() as served:
        with pytest.raises(grpc.RpcError) as raised:
            served.call(["close:3:bad 100% input, caf\u00e9".encode()])
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "bad 100% input, caf\u00e9"


def test_an_unknown_method_is_unimplemented():
    with Served() as served:
        with pytest.raises(grpc.RpcError) as raised:
            served.call([b"x"], method="/test.Echo/Other")
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_a_message_past_the_limit_is_refused_and_its_handler_reset():
    with Served(max_message=1000) as served:
        with pytest.raises(grpc.RpcError) as raised:
            served.call([b"x" * 1001])
        assert served.call([b"y" * 1000]) == [b"y" * 1000]  # the connection goes on
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("reset",) in served.log


def test_a_bug_in_the_service_fails_its_stream_internal_not_the_connection():
    with Served() as served:
        with grpc.insecure_channel(f"127.0.0.1:{served.port}") as channel:
            chat = channel.stream_stream(METHOD, request_serializer=None,
                                         response_deserializer=None)
            with pytest.raises(grpc.RpcError) as raised:
                list(chat(iter([b"boom"]), timeout=10))
            assert list(chat(iter([b"ok"]), timeout=10)) == [b"ko"]  # same channel
    assert raised.value.code() == grpc.StatusCode.INTERNAL


# -- raw frames --------------------------------------------------------------------------


class Raw:
    """A hand-driven HTTP/2 client: frames out, frames in."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        self.buffer = b""
        self.encoder = hpack.Encoder()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def start(self) -> None:
        self.send(http2.PREFACE + frame(SETTINGS, 0, 0))

    def headers(self, stream_id: int, path: str = METHOD, end_stream: bool = False) -> bytes:
        block = self.encoder.encode([(":method", "POST"), (":scheme", "http"),
                                     (":path", path), (":authority", "epp"),
                                     ("content-type", "application/grpc"), ("te", "trailers")])
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        return frame(HEADERS, flags, stream_id, block)

    def frames(self, until=lambda kind, flags, stream_id, payload: False, limit: int = 50):
        """Frames read until ``until`` says stop (or the connection ends)."""
        out = []
        while len(out) < limit:
            while len(self.buffer) < 9 or len(self.buffer) < 9 + (
                    int.from_bytes(self.buffer[:3], "big")):
                chunk = self.sock.recv(65536)
                if not chunk:
                    return out
                self.buffer += chunk
            length = int.from_bytes(self.buffer[:3], "big")
            kind, flags = self.buffer[3], self.buffer[4]
            stream_id = int.from_bytes(self.buffer[5:9], "big") & 0x7FFFFFFF
            payload, self.buffer = self.buffer[9:9 + length], self.buffer[9 + length:]
            out.append((kind, flags, stream_id, payload))
            if until(kind, flags, stream_id, payload):
                return out
        return out


def message(data: bytes) -> bytes:
    return b"\x00" + len(data).to_bytes(4, "big") + data


def goaway_code(frames) -> int | None:
    """The error code of the first GOAWAY among ``frames``."""
    goaway = [f for f in frames if f[0] == GOAWAY]
    return int.from_bytes(goaway[0][3][4:8], "big") if goaway else None


def test_the_server_opens_with_settings_and_answers_a_ping():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        raw.send(frame(PING, 0, 0, b"12345678"))
        got = raw.frames(until=lambda kind, *rest: kind == PING)
    assert got[0][0] == SETTINGS
    assert (PING, 1, 0, b"12345678") in got


def test_a_bad_preface_ends_the_connection_with_a_protocol_error():
    with Served() as served:
        raw = Raw(served.port)
        raw.send(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        got = raw.frames()
    assert goaway_code(got) == http2.PROTOCOL_ERROR


def test_a_frame_past_the_advertised_size_is_a_frame_size_error():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        # (the head alone: the server answers from it, before any of the payload)
        raw.send((http2.RECEIVE_FRAME_SIZE + 1).to_bytes(3, "big") + bytes((DATA, 0))
                 + (1).to_bytes(4, "big"))
        got = raw.frames()
    assert goaway_code(got) == http2.FRAME_SIZE_ERROR


def test_one_message_split_over_three_frames_and_two_in_one_frame_are_read_right():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        body = message(b"abcdefghij")
        raw.send(raw.headers(1) + frame(DATA, 0, 1, body[:3]) + frame(DATA, 0, 1, body[3:9])
                 + frame(DATA, 0, 1, body[9:]))
        raw.send(frame(DATA, END_STREAM, 1, message(b"12") + message(b"345")))
        got = raw.frames(until=lambda kind, flags, *rest: kind == HEADERS and flags & END_STREAM)
    data = b"".join(f[3] for f in got if f[0] == DATA)
    assert data == message(b"jihgfedcba") + message(b"21") + message(b"543")
    decoder = hpack.Decoder()
    blocks = [dict(decoder.decode(f[3])) for f in got if f[0] == HEADERS]
    assert blocks[0][":status"] == "200" and blocks[-1]["grpc-status"] == "0"
    assert served.log == [("message", 10), ("message", 2), ("message", 3), ("end",)]


def test_streams_past_the_limit_are_refused_the_rest_served():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        ids = [2 * i + 1 for i in range(http2.MAX_STREAMS + 1)]
        raw.send(b"".join(raw.headers(i) for i in ids))
        got = raw.frames(until=lambda kind, *rest: kind == RST_STREAM)
        refused = [f for f in got if f[0] == RST_STREAM]
        assert refused[0][2] == ids[-1]
        assert int.from_bytes(refused[0][3], "big") == http2.REFUSED_STREAM
        raw.send(frame(DATA, END_STREAM, ids[0], message(b"ok")))
        got = raw.frames(until=lambda kind, flags, stream_id, payload:
                         kind == HEADERS and flags & END_STREAM)
    assert (DATA, 0, ids[0], message(b"ko")) in got


def test_a_reset_from_the_peer_resets_the_handler():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        raw.send(raw.headers(1) + frame(RST_STREAM, 0, 1, (8).to_bytes(4, "big")))
        raw.send(frame(PING, 0, 0, b"abcdefgh"))  # the ping's answer comes after the reset
        raw.frames(until=lambda kind, *rest: kind == PING)
    assert served.log == [("reset",)]


def test_a_stream_the_service_ends_first_is_reset_no_error_and_its_late_data_ignored():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        raw.send(raw.headers(1) + frame(DATA, 0, 1, message(b"close:0:")))
        got = raw.frames(until=lambda kind, *rest: kind == RST_STREAM)
        trailers = [f for f in got if f[0] == HEADERS and f[1] & END_STREAM]
        assert trailers and trailers[0][2] == 1
        assert got[-1] == (RST_STREAM, 0, 1, (http2.NO_ERROR).to_bytes(4, "big"))
        # What the peer had already sent is ignored; the connection goes on.
        raw.send(frame(DATA, END_STREAM, 1, message(b"late")) + frame(PING, 0, 0, b"pingpong"))
        got = raw.frames(until=lambda kind, *rest: kind == PING)
    assert not [f for f in got if f[0] == GOAWAY]
    assert served.log == [("message", 8)]


def test_a_stream_that_ends_inside_a_message_is_internal():
    with Served() as served:
        raw = Raw(served.port)
        raw.start()
        raw.send(raw.headers(1) + frame(DATA, END_STREAM, 1, message(b"abcdef")[:7]))
        got = raw.frames(until=lambda kind, flags, *rest: kind == HEADERS and flags & END_STREAM)
    decoder = hpack.Decoder()
    assert dict(decoder.decode(got[-1][3]))["grpc-status"] == str(http2.INTERNAL)
    assert served.log == [("reset",)]


class _Transport:
    """What the connection writes, kept; reading paused or not, ignored."""

    def __init__(self):
        self.written = bytearray()
        self.closed = False

    def write(self, data):
        self.written += data

    def close(self):
        self.closed = True

    def pause_reading(self):
        pass

    def resume_reading(self):
        pass


def test_bytes_arriving_one_at_a_time_are_read_as_whole_frames():
    log: list = []
    server = GrpcServer(lambda stream, path, headers: Echo(stream, log))
    connection = http2.Http2Connection(server.opener, server)
    transport = _Transport()
    connection.connection_made(transport)
    client = hpack.Encoder()
    block = client.encode([(":method", "POST"), (":scheme", "http"), (":path", METHOD),
                           (":authority", "epp"), ("content-type", "application/grpc")])
    wire = (http2.PREFACE + frame(SETTINGS, 0, 0) + frame(HEADERS, END_HEADERS, 1, block)
            + frame(DATA, END_STREAM, 1, message(b"hello")))
    for i in range(len(wire)):
        connection.data_received(wire[i:i + 1])
    assert log == [("message", 5), ("end",)]
    assert message(b"olleh") in transport.written and not transport.closed
    assert connection.streams == {}  # both sides ended: nothing kept
