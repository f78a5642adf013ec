"""Clients that leave, and SIGTERM with requests in flight, over real sockets.

A slow emulator (every engine step 20 ms: a 500-token reply takes 10 s) so requests are still
in the engine when the client leaves or the signal comes. Every wait is bounded.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time

import httpx
import pytest

from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.emulator.server import SHUTDOWN_GRACE_S

BLOCK = 16
BOUND_S = 5.0  # every wait below; the engine alone would take 10 s


@pytest.fixture
def slow_profile(tmp_path):
    profile = tmp_path / "steps.json"
    profile.write_text(json.dumps({"base": "instant", "name": "steps",
                                   "step_overhead_s": 0.02}))
    return str(profile)


def ids(seed: int, n: int) -> list[int]:
    return [10 + (seed * 131 + i * 17) % 1900 for i in range(n)]


def send(port: int, body: dict, path: str = "/v1/completions") -> socket.socket:
    """A raw HTTP/1.1 POST whose answer is left unread (the client may just close)."""
    data = json.dumps({"model": "emulated", **body}).encode()
    sock = socket.create_connection(("127.0.0.1", port), timeout=BOUND_S)
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    out = b""
    deadline = time.monotonic() + BOUND_S
    while time.monotonic() < deadline:
        chunk = sock.recv(65536)
        if not chunk:
            return out
        out += chunk
    raise AssertionError(f"the server did not close the connection: {out[-300:]!r}")


def gauge(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=BOUND_S).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{"))


def aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=BOUND_S).text
    found = re.search(r'vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} (\S+)',
                      text)
    return float(found.group(1)) if found else 0.0


def wait_for(predicate, what: str) -> None:
    deadline = time.monotonic() + BOUND_S
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_client_that_disconnects_aborts_its_requests_in_the_engine(slow_profile):
    with EmulatorProcess(["--block-size", str(BLOCK), "--num-blocks", "256",
                          "--profile", slow_profile]) as process:
        url = process.url
        plain = send(process.port, {"prompt": ids(1, 40), "max_tokens": 500})
        batch = send(process.port, {"prompt": [ids(2, 30), ids(3, 30)], "max_tokens": 500})
        wait_for(lambda: gauge(url, "vllm:num_requests_running") == 3,
                 "three sequences should be running")
        plain.close()
        wait_for(lambda: gauge(url, "vllm:num_requests_running") == 2,
                 "the closed request is still running in the engine")
        batch.close()  # both sequences of a batched request go
        wait_for(lambda: gauge(url, "vllm:num_requests_running") == 0,
                 "the closed batch is still running in the engine")
        assert aborted(url) == 3
        assert gauge(url, "vllm:num_requests_waiting") == 0
        # The engine is free again: a new request is served at once.
        response = httpx.post(url + "/v1/completions", timeout=BOUND_S,
                              json={"model": "emulated", "prompt": ids(4, 20), "max_tokens": 2})
        assert response.status_code == 200


def test_sigterm_stops_the_server_promptly_with_requests_in_flight(slow_profile):
    process = EmulatorProcess(["--block-size", str(BLOCK), "--num-blocks", "256",
                               "--profile", slow_profile]).start()
    try:
        url = process.url
        abandoned = [send(process.port, {"prompt": ids(10 + i, 40), "max_tokens": 500})
                     for i in range(3)]
        plain = send(process.port, {"prompt": ids(20, 40), "max_tokens": 500})
        stream = send(process.port, {"prompt": ids(21, 40), "max_tokens": 500, "stream": True})
        chat = send(process.port, {"messages": [{"role": "user", "content": "hi"}],
                                   "max_tokens": 500, "stream": True}, "/v1/chat/completions")
        wait_for(lambda: gauge(url, "vllm:num_requests_running") == 6,
                 "six sequences should be running")
        for sock in abandoned:
            sock.close()
        start = time.monotonic()
        os.killpg(process.process.pid, signal.SIGTERM)
        try:
            code = process.process.wait(timeout=BOUND_S)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {BOUND_S} s after SIGTERM") from None
        elapsed = time.monotonic() - start
        # uvicorn shuts down gracefully, then re-raises the signal it caught (exit by SIGTERM).
        assert code in (0, -signal.SIGTERM), process.log_tail()
        assert "Traceback" not in process.log_tail(200)
        # Under uvicorn's grace: nothing waited for it (the engine alone would take 10 s).
        assert elapsed < SHUTDOWN_GRACE_S - 0.1, f"took {elapsed:.2f} s to stop"
        # Clients still connected got an answer, not a silent drop.
        answer = read_until_closed(plain)
        assert answer.startswith(b"HTTP/1.1 503")
        assert b'"type":"ServiceUnavailableError"' in answer
        for sock in (stream, chat):
            answer = read_until_closed(sock)
            assert answer.startswith(b"HTTP/1.1 200")
            assert b'"code":503' in answer and b"data: [DONE]" in answer
    finally:
        process.stop()
