"""Limits on what a caller sends before the gateway has a request: the size of the request
line and headers (431), the time they take (408) and the time the body takes (408), over
real sockets to ``prefixroute serve``; and what unauthenticated callers sending endless
headers cost the gateway (memory, other requests' latency)."""

from __future__ import annotations

import json
import socket
import statistics
import threading
import time
from pathlib import Path

import httpx

from test_gateway_fleet import KEYS, Fleet, needs_emulator

pytestmark = needs_emulator

MIB = 1024 * 1024


def connect(fleet: Fleet) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", fleet.gateway_port), timeout=20)
    sock.settimeout(20)
    return sock


def read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the one answer the gateway sends before it closes."""
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = [line for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:")]
        if length and len(body) >= int(length[0].split(b":")[1]):
            break
    head, _, body = data.partition(b"\r\n\r\n")
    assert head, "no answer"
    return int(head.split(b" ")[1]), json.loads(body)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_request_head_over_the_limit_is_431_before_authentication(tmp_path):
    with Fleet(tmp_path, replicas=1) as fleet:
        sock = connect(fleet)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"A" * 200_000)
        status, body = read_answer(sock)
        sock.close()
        assert status == 431
        assert body["error"]["code"] == "headers_too_large"
        assert "65536 bytes" in body["error"]["message"]
        # a head just under the limit is served
        response = httpx.get(fleet.url + "/health", headers={"x-big": "A" * 60_000},
                             timeout=10)
        assert response.status_code == 200


def test_a_head_that_does_not_arrive_in_time_is_408(tmp_path):
    with Fleet(tmp_path, replicas=1, gateway={"limits": {"header_timeout_s": 1.0}}) as fleet:
        silent = connect(fleet)  # sends nothing at all
        trickle = connect(fleet)
        trickle.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never ends
        started = time.monotonic()
        for sock in (silent, trickle):
            status, body = read_answer(sock)
            sock.close()
            assert status == 408 and body["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 15
        assert httpx.get(fleet.url + "/health", timeout=10).status_code == 200


def test_a_body_that_does_not_arrive_in_time_is_408_and_not_left_open(tmp_path):
    with Fleet(tmp_path, replicas=1, gateway={"limits": {"body_timeout_s": 1.0}}) as fleet:
        auth = f"Authorization: Bearer {KEYS['a']}\r\n".encode()
        short = connect(fleet)  # declares 1000 bytes, sends 20
        short.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                      b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                      + b'{"model": "tiny", "p')
        chunked = connect(fleet)  # a chunked body that never ends
        chunked.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + auth +
                        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n"
                        b"\r\n5\r\n{\"mod\r\n")
        started = time.monotonic()
        for sock in (short, chunked):
            status, body = read_answer(sock)
            sock.close()
            assert status == 408 and body["error"]["code"] == "request_timeout"
        assert time.monotonic() - started < 15
        # both answered and counted: nothing is left open for a shutdown to wait on
        assert fleet.metric("prefixroute_gateway_requests_total", status="408") == 2


def test_endless_headers_on_eight_connections_cost_no_memory_or_latency(tmp_path):
    """8 unauthenticated connections each send a header of up to 100 MiB that never ends,
    as fast as the gateway takes it. While they last, the gateway's memory stays within
    50 MiB of idle and a normal request's latency (median of at least 15, against the median
    of 15 at idle) within 2x."""
    with Fleet(tmp_path, replicas=1) as fleet:
        assert fleet.gateway is not None
        client = httpx.Client(base_url=fleet.url, timeout=30,
                              headers={"authorization": f"Bearer {KEYS['a']}"})
        body = {"model": fleet.model, "prompt": "a short prompt", "max_tokens": 1}

        def latency() -> float:
            started = time.perf_counter()
            assert client.post("/v1/completions", json=body).status_code == 200
            return time.perf_counter() - started

        for _ in range(5):  # warm up
            latency()
        idle_latency = statistics.median(latency() for _ in range(15))
        idle_rss = rss_bytes(fleet.gateway.pid)
        sent = [0] * 8

        def flood(i: int) -> None:
            piece = b"A" * MIB
            deadline = time.monotonic() + 90  # bounded even if the gateway reads it all
            try:
                with socket.create_connection(("127.0.0.1", fleet.gateway_port)) as sock:
                    sock.settimeout(30)
                    sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
                    while sent[i] < 100 and time.monotonic() < deadline:
                        sock.sendall(piece)
                        sent[i] += 1
            except OSError:  # answered and closed (reset), or no longer read
                pass

        floods = [threading.Thread(target=flood, args=(i,)) for i in range(8)]
        for thread in floods:
            thread.start()
        busy: list[float] = []
        peak_rss = idle_rss
        while len(busy) < 15 or any(thread.is_alive() for thread in floods):
            busy.append(latency())
            peak_rss = max(peak_rss, rss_bytes(fleet.gateway.pid))
        for thread in floods:
            thread.join()
        busy_latency = statistics.median(busy)
        print(f"idle {idle_latency * 1000:.1f} ms, during the flood {busy_latency * 1000:.1f} "
              f"ms ({len(busy)} requests); RSS idle {idle_rss / MIB:.1f} MiB, peak "
              f"{peak_rss / MIB:.1f} MiB; MiB sent per connection {sent}")
        assert peak_rss - idle_rss < 50 * MIB
        assert busy_latency < 2 * idle_latency
