"""The spliced stream relay (edges/gateway/proxy.py) on real sockets: the gateway served by
uvicorn (httptools) in this process, in front of a scripted replica on a real socket.

Checks that a spliced stream is byte for byte what the generic path (an in-process ASGI
client, no transport to splice into) sends, the usage chunk filtered or kept as asked; that a
caller hanging up mid-stream aborts the replica's request; that a replica cut mid-stream ends
the caller's stream with the error event; and that a caller that does not read pushes back
on the replica (its writes stall) without tripping the replica read timeout, and then gets
every byte."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import time

import httpx
import openai
import pytest
import uvicorn

from prefixroute.edges.gateway import proxy
from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.config import hash_api_key, parse_config
from prefixroute.edges.gateway.guard import guarded_protocol
from tests.helpers.scripted_http import read_request

SECRET = "s" * 64
KEY = "key-splice"
AUTH = {"authorization": f"Bearer {KEY}"}


def chunk(i: int, text: str = "tok") -> bytes:
    body = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
            "choices": [{"index": 0, "text": f"{text}{i}", "finish_reason": None}]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


USAGE = (b'data: {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny", '
         b'"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3, '
         b'"total_tokens": 8, "prompt_tokens_details": {"cached_tokens": 0}}}\n\n')
DONE = b"data: [DONE]\n\n"


class ScriptedReplica:
    """A replica on a real socket. ``script`` is a list of byte strings (written as HTTP
    chunks), float pauses, ``"cut"`` (close without the last chunk) or ``"forever"`` (one
    event every 10 ms until the gateway hangs up). Records when a stream's connection was
    closed by the other side, and how many bytes of events it has written."""

    def __init__(self, script: list):
        self.script = script
        self.hung_up = asyncio.Event()
        self.bytes_written = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            while True:
                head = await read_request(reader)
                if head is None:
                    return
                path = head.split(b" ")[1]
                if path == b"/v1/models":
                    self.reply(writer, b'{"object": "list", "data": [{"id": "tiny"}]}')
                elif path == b"/metrics":
                    self.reply(writer, b"vllm:num_requests_running 0\n")
                elif path != b"/v1/completions":
                    self.reply(writer, b"ok")
                else:
                    await self.stream(reader, writer)
                    return
        finally:
            writer.close()

    @staticmethod
    def reply(writer: asyncio.StreamWriter, body: bytes) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n%s" % (len(body), body))

    async def stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                     b"transfer-encoding: chunked\r\n\r\n")
        try:
            for step in self.script:
                if step == "cut":
                    writer.transport.abort()
                    return
                if step == "forever":
                    i = 0
                    while not reader.at_eof():
                        await self.write(writer, chunk(i))
                        i += 1
                        await asyncio.sleep(0.01)
                    self.hung_up.set()
                    return
                if isinstance(step, float):
                    await asyncio.sleep(step)
                else:
                    await self.write(writer, step)
            writer.write(b"0\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            self.hung_up.set()

    async def write(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(b"%x\r\n%b\r\n" % (len(data), data))
        self.bytes_written += len(data)
        await writer.drain()


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.asynccontextmanager
async def running(monkeypatch, script: list, *, read_s: float = 30.0, **extra):
    """A scripted replica and a gateway in front of it, served by uvicorn on a real socket;
    yields (gateway URL, the gateway, the replica, the splices made)."""
    replica = ScriptedReplica(script)
    server = await asyncio.start_server(replica.handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    monkeypatch.setenv("PR_SPLICE_TEST_SECRET", SECRET)
    config = parse_config({
        "server_secret": {"env": "PR_SPLICE_TEST_SECRET"},
        "backends": [{"name": "r0", "url": f"http://127.0.0.1:{port}", "models": ["tiny"]}],
        "tenants": [{"name": "t", "api_key_sha256": hash_api_key(KEY), "trust_group": "g"}],
        "health": {"interval_s": 60, "metrics_interval_s": 60},
        "timeouts": {"read_s": read_s},
        "retries": 0,
        **extra,
    }, "test.yaml")
    splices: list = []

    class CountingSink(proxy._SpliceSink):
        __slots__ = ()

        def __init__(self, *args):
            super().__init__(*args)
            splices.append(self)

    monkeypatch.setattr(proxy, "_SpliceSink", CountingSink)
    gateway = Gateway(config)
    sock = free_socket()
    # served as ``prefixroute serve`` serves it: httptools behind the head guard, whose
    # connection the splice writes to
    web = uvicorn.Server(uvicorn.Config(gateway.app, http=guarded_protocol(64 * 1024, 10.0),
                                        lifespan="on", log_level="warning", access_log=False))
    web.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(web.serve(sockets=[sock]))
    while not web.started:
        assert not task.done(), task.exception()
        await asyncio.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", gateway, replica, splices
    finally:
        web.should_exit = True
        await asyncio.wait_for(task, 15)
        sock.close()
        server.close()


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def raw_stream(url: str, body: dict) -> bytes:
    async with httpx.AsyncClient(timeout=30) as client:
        async with client.stream("POST", url + "/v1/completions", json=body,
                                 headers=AUTH) as response:
            assert response.status_code == 200
            return b"".join([piece async for piece in response.aiter_raw()])


async def generic_stream(gateway: Gateway, body: dict) -> bytes:
    """The same request through the in-process ASGI client: the generic (generator) path."""
    transport = httpx.ASGITransport(app=gateway.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
        response = await client.post("/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 200
        return response.content


SCRIPT = [chunk(0), 0.01, chunk(1), chunk(2)[:20], 0.01, chunk(2)[20:] + chunk(3), 0.01,
          USAGE, DONE]


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_spliced_stream_is_byte_identical_to_the_generic_path(monkeypatch, include_usage):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}

    async def main():
        async with running(monkeypatch, SCRIPT) as (url, gateway, _, splices):
            spliced = await raw_stream(url, body)
            assert len(splices) == 1
            generic = await generic_stream(gateway, body)
            assert len(splices) == 1  # the in-process client was not spliced
            return spliced, generic

    spliced, generic = run(main())
    assert spliced == generic
    expected = b"".join(chunk(i) for i in range(4)) + (USAGE if include_usage else b"") + DONE
    assert spliced == expected


def test_the_official_client_streams_through_the_splice(monkeypatch):
    async def main():
        async with running(monkeypatch, SCRIPT) as (url, gateway, _, splices):
            client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
            stream = await client.completions.create(model="tiny", prompt="hello",
                                                     max_tokens=4, stream=True)
            texts = [c.choices[0].text async for c in stream if c.choices]
            await client.close()
            decisions = gateway.router.recent(1, None)
            return texts, len(splices), decisions

    texts, splices, decisions = run(main())
    assert texts == ["tok0", "tok1", "tok2", "tok3"]
    assert splices == 1
    assert decisions[0]["outcome"] == "ok"


def test_a_caller_hanging_up_mid_stream_aborts_the_replica_request(monkeypatch):
    async def main():
        async with running(monkeypatch, ["forever"]) as (url, gateway, replica, splices):
            reader, writer = await asyncio.open_connection(*url[7:].split(":"))
            payload = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 1000,
                                  "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: g\r\n"
                         b"authorization: Bearer %b\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%b" % (KEY.encode(), len(payload),
                                                            payload))
            received = b""
            while received.count(b"data: ") < 5:
                received += await reader.read(65536)
            writer.close()
            await asyncio.wait_for(replica.hung_up.wait(), 5)
            deadline = time.monotonic() + 5
            while gateway.open_requests and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return gateway.open_requests, gateway.admission.active, len(splices), \
                gateway.router.recent(1, None)

    open_requests, active, splices, decisions = run(main())
    assert (open_requests, active, splices) == (0, 0, 1)
    assert decisions[0]["outcome"] != "ok"


def test_a_replica_cut_mid_stream_ends_with_the_error_event(monkeypatch):
    async def main():
        async with running(monkeypatch, [chunk(0), 0.02, chunk(1), 0.02, "cut"]) \
                as (url, gateway, _, splices):
            data = await raw_stream(url, {"model": "tiny", "prompt": "x", "max_tokens": 9,
                                          "stream": True})
            return data, len(splices), gateway.open_requests

    data, splices, open_requests = run(main())
    assert splices == 1 and open_requests == 0
    events = [e for e in data.split(b"\n\n") if e]
    assert events[:2] == [chunk(0)[:-2], chunk(1)[:-2]]
    assert json.loads(events[2][6:])["error"]["code"] == "stream_interrupted"
    assert events[3] == b"data: [DONE]"


def test_a_slow_reader_pushes_back_on_the_replica_without_a_read_timeout(monkeypatch):
    big = [chunk(i, "x" * 60_000) for i in range(1500)]  # about 90 MB

    async def main():
        async with running(monkeypatch, [*big, DONE], read_s=1.0) \
                as (url, gateway, replica, splices):
            host, port = url[7:].split(":")
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
            reader, writer = await asyncio.open_connection(sock=sock)
            payload = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 9,
                                  "stream": True}).encode()
            writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: g\r\n"
                         b"authorization: Bearer %b\r\ncontent-type: application/json\r\n"
                         b"connection: close\r\ncontent-length: %d\r\n\r\n%b"
                         % (KEY.encode(), len(payload), payload))
            received = bytearray(await reader.read(1000))  # the response has started
            await asyncio.sleep(1.0)  # not reading ...
            stalled_at = replica.bytes_written
            await asyncio.sleep(1.5)  # ... for longer than the read timeout
            still_at = replica.bytes_written
            while True:
                data = await reader.read(1 << 20)
                if not data:
                    break
                received += data
            writer.close()
            return stalled_at, still_at, bytes(received), len(splices)

    stalled_at, still_at, received, splices = run(main())
    total = sum(len(b) for b in big)
    assert splices == 1
    assert stalled_at < total * 0.8  # the replica could not send it all while nobody read
    assert still_at == stalled_at  # its writes waited for the gateway to read again
    assert received.count(b"data: {") == len(big)  # and then every event arrived
    assert b"data: [DONE]" in received and b"stream_interrupted" not in received


def test_a_replica_cut_before_the_first_event_is_a_clear_error_not_a_started_stream(monkeypatch):
    async def main():
        async with running(monkeypatch, [b"data: {\"partial", 0.02, "cut"]) \
                as (url, gateway, _, splices):
            async with httpx.AsyncClient(timeout=30) as client:
                response = await client.post(url + "/v1/completions", headers=AUTH, json={
                    "model": "tiny", "prompt": "x", "max_tokens": 9, "stream": True})
            return response, len(splices), gateway.open_requests

    response, splices, open_requests = run(main())
    assert splices == 1 and open_requests == 0
    assert response.status_code == 503  # nothing had reached the caller: no stream began
    assert response.json()["error"]["code"] == "replicas_unavailable"
    assert "before its first event" in response.json()["error"]["message"]


def test_busy_polling_runs_while_a_stream_is_open_and_stops_after_the_linger(monkeypatch):
    script = [chunk(0), 1.0, chunk(1), DONE]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 2, "stream": True}

    async def main():
        loop = asyncio.get_running_loop()
        async with running(monkeypatch, script, busy_poll_s=0.3) as (url, gateway, _, _s):
            poller = gateway.busy_poller
            assert poller is not None and not poller.running  # nothing open yet
            stream = asyncio.create_task(raw_stream(url, body))
            while not gateway.open_requests:  # the replica then pauses 1 s mid-stream
                await asyncio.sleep(0.01)
            assert poller.running
            ticks = poller.ticks
            await asyncio.sleep(0.2)
            # The loop goes round instead of sleeping (a sleeping loop: a few iterations).
            assert poller.ticks > ticks + 100
            received = await stream
            assert b"tok1" in received and received.endswith(DONE)
            deadline = loop.time() + 10
            while gateway.open_requests:
                assert loop.time() < deadline
                await asyncio.sleep(0.01)
            ended = loop.time()
            while poller.running:  # the linger, then the loop may sleep again
                assert loop.time() < deadline
                await asyncio.sleep(0.02)
            assert loop.time() - ended >= 0.25  # it lingered about busy_poll_s first

    run(main())
