"""The small HTTP/1.1 client (edges/http1.py) against a scripted asyncio server: keep-alive,
body framings, a dead pooled connection, timeouts, refused connections, and spliced bodies
(delivered to a sink as they arrive, paused without a read timeout, cut short)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from prefixroute.edges.http1 import (Client, ConnectError, ProbeClient, ProtocolError,
                                      RequestTimeout)
from tests.helpers.scripted_http import read_request


class Server:
    """Answers each request on a connection with the next scripted reply; counts connections.
    A reply is a list of byte strings with optional float pauses between them; ``"close"``
    closes the connection."""

    def __init__(self, replies):
        self.replies = list(replies)
        self.connections = 0
        self.requests = 0

    async def handle(self, reader, writer):
        self.connections += 1
        try:
            while self.replies:
                head = await read_request(reader)
                if head is None:
                    return
                self.requests += 1
                for part in self.replies.pop(0):
                    if part == "close":
                        writer.close()
                        return
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                    else:
                        writer.write(part)
                        await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self):
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/x"
        return self

    async def __aexit__(self, *exc):
        self.server.close()


def ok(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)


def run(coro):
    return asyncio.run(coro)


def test_two_requests_share_one_keep_alive_connection():
    async def main():
        async with Server([[ok(b"one")], [ok(b"two")]]) as server:
            client = Client()
            first = await (await client.request("POST", server.url, body=b"{}")).aread()
            second = await (await client.request("POST", server.url, body=b"{}")).aread()
            await client.aclose()
            return first, second, server.connections

    assert run(main()) == (b"one", b"two", 1)


def test_a_chunked_body_arrives_piece_by_piece_and_whole():
    chunked = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n", b"5\r\nhello\r\n",
               0.05, b"6\r\n world\r\n0\r\n\r\n"]

    async def main():
        async with Server([chunked]) as server:
            client = Client()
            response = await client.request("GET", server.url)
            pieces = [piece async for piece in response.aiter_raw()]
            await client.aclose()
            return response.status, pieces

    status, pieces = run(main())
    assert status == 200
    assert b"".join(pieces) == b"hello world"
    assert len(pieces) == 2  # the pause split it: bytes are passed on as they come


def test_a_body_without_length_ends_with_the_connection():
    async def main():
        async with Server([[b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end",
                            "close"]]) as server:
            client = Client()
            body = await (await client.request("GET", server.url)).aread()
            await client.aclose()
            return body

    assert run(main()) == b"until the end"


def test_a_pooled_connection_the_server_closed_is_replaced_without_resending_twice():
    async def main():
        # The first connection answers once and is then closed by the server while idle.
        async with Server([[ok(b"one"), 0.01, "close"], [ok(b"two")]]) as server:
            client = Client()
            await (await client.request("POST", server.url, body=b"a")).aread()
            await asyncio.sleep(0.1)  # the server has closed the idle connection by now
            second = await (await client.request("POST", server.url, body=b"b")).aread()
            await client.aclose()
            return second, server.requests, server.connections

    assert run(main()) == (b"two", 2, 2)


def test_no_byte_for_longer_than_the_read_timeout_is_a_timeout():
    stalled = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n", 1.0,
               b"0\r\n\r\n"]

    async def main():
        async with Server([stalled]) as server:
            client = Client(read_timeout=0.1)
            response = await client.request("GET", server.url)
            got = []
            with pytest.raises(RequestTimeout) as caught:
                async for piece in response.aiter_raw():
                    got.append(piece)
            await client.aclose()
            return got, caught.value.phase

    assert run(main()) == ([b"hello"], "read")


def test_a_slow_but_steady_body_is_not_a_timeout():
    steady = [b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"]
    for _ in range(6):
        steady += [0.5, b"1\r\nx\r\n"]
    steady.append(b"0\r\n\r\n")

    async def main():
        async with Server([steady]) as server:
            # The whole body takes 3 s, more than the read timeout; each gap leaves 1.5 s for
            # a stalled event loop on a loaded machine.
            client = Client(read_timeout=2.0)
            body = await (await client.request("GET", server.url)).aread()
            await client.aclose()
            return body

    assert run(main()) == b"xxxxxx"


def test_cancelling_the_reader_is_a_cancellation_not_a_timeout():
    stalled = [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", 1.0, b"world"]

    async def main():
        async with Server([stalled]) as server:
            client = Client(read_timeout=5.0)
            response = await client.request("GET", server.url)
            task = asyncio.create_task(response.aread())
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await client.aclose()

    run(main())


def test_a_body_cut_short_is_a_protocol_error():
    async def main():
        async with Server([[b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhel", "close"]]) \
                as server:
            client = Client()
            response = await client.request("GET", server.url)
            with pytest.raises(ProtocolError):
                await response.aread()
            await client.aclose()

    run(main())


def test_nobody_listening_is_a_connect_error():
    async def main():
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        server.close()
        await server.wait_closed()
        client = Client(connect_timeout=1.0)
        with pytest.raises(ConnectError):
            await client.request("GET", f"http://127.0.0.1:{port}/")

    run(main())


class Sink:
    """Records what a spliced body delivers, and when it ends."""

    def __init__(self):
        self.pieces: list[bytes] = []
        self.ended = asyncio.Event()
        self.error = None

    def on_body(self, data: bytes) -> None:
        self.pieces.append(data)

    def on_end(self) -> None:
        self.ended.set()

    def on_error(self, error) -> None:
        self.error = error
        self.ended.set()


CHUNKED_HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def test_a_spliced_body_goes_to_the_sink_piece_by_piece_and_the_connection_is_reused():
    async def main():
        async with Server([[CHUNKED_HEAD, b"5\r\nhello\r\n", 0.05, b"6\r\n world\r\n",
                            0.05, b"0\r\n\r\n"], [ok(b"next")]]) as server:
            client = Client()
            response = await client.request("POST", server.url, body=b"{}")
            sink = Sink()
            response.splice(sink)
            await asyncio.wait_for(sink.ended.wait(), 5)
            after = await (await client.request("POST", server.url, body=b"{}")).aread()
            await client.aclose()
            return sink.pieces, sink.error, after, server.connections

    pieces, error, after, connections = run(main())
    assert pieces == [b"hello", b" world"] and error is None
    assert (after, connections) == (b"next", 1)


def test_a_paused_splice_is_not_a_read_timeout_and_a_stall_after_resuming_is():
    async def main():
        async with Server([[CHUNKED_HEAD, b"5\r\nhello\r\n", 0.4, b"6\r\n world\r\n",
                            1.0, b"0\r\n\r\n"]]) as server:
            client = Client(read_timeout=0.2)
            response = await client.request("GET", server.url)
            sink = Sink()
            response.splice(sink)
            response.pause_reading()  # a slow caller: 0.5 s without reading
            await asyncio.sleep(0.5)
            assert sink.error is None
            response.resume_reading()  # " world" is waiting; then 1 s of nothing
            await asyncio.wait_for(sink.ended.wait(), 5)
            await client.aclose()
            return sink.pieces, sink.error

    pieces, error = run(main())
    assert pieces == [b"hello", b" world"]
    assert isinstance(error, RequestTimeout) and error.phase == "read"


def test_a_spliced_body_cut_short_is_an_error_for_the_sink():
    async def main():
        async with Server([[CHUNKED_HEAD, b"5\r\nhello\r\n", 0.05, "close"]]) as server:
            client = Client()
            response = await client.request("GET", server.url)
            sink = Sink()
            response.splice(sink)
            await asyncio.wait_for(sink.ended.wait(), 5)
            await client.aclose()
            return sink.pieces, sink.error

    pieces, error = run(main())
    assert pieces == [b"hello"] and isinstance(error, ProtocolError)


# -- ProbeClient: httpx's ``get`` for health checks and scrapes --------------------------------


def test_a_probe_get_reads_the_whole_answer_as_httpx_would_and_reuses_the_connection():
    async def main():
        async with Server([[ok(b'{"data": [1]}')], [ok(b"vllm:num_requests_waiting 0\n")]]) \
                as server:
            probes = ProbeClient(Client())
            first = await probes.get(server.url, headers={"authorization": "x"}, timeout=2.0)
            second = await probes.get(server.url, timeout=2.0)
            await probes.aclose()
            return first.status_code, first.json(), second.text, server.connections

    assert run(main()) == (200, {"data": [1]}, "vllm:num_requests_waiting 0\n", 1)


def test_a_probe_failure_is_httpx_s_exception_type():
    # Backends catch httpx.HTTPError for both clients: a stall past the timeout, a refused
    # connection and a cut body must all be one of its kinds.
    stalled = [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", 1.0, b"world"]
    cut = [b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nhello", "close"]

    async def main():
        kinds = []
        async with Server([stalled, cut]) as server:
            probes = ProbeClient(Client())
            for _ in range(2):
                with pytest.raises(httpx.HTTPError) as caught:
                    await probes.get(server.url, timeout=0.2)
                kinds.append(type(caught.value))
            await probes.aclose()
        listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = listener.sockets[0].getsockname()[1]
        listener.close()
        await listener.wait_closed()
        with pytest.raises(httpx.ConnectError):
            await ProbeClient(Client()).get(f"http://127.0.0.1:{port}/", timeout=1.0)
        return kinds

    assert run(main()) == [httpx.TimeoutException, httpx.TransportError]
