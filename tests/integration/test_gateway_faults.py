"""Faults under traffic: a replica killed mid-run, a slow replica, a flapping replica, and
malformed and oversized bodies. In every case each request gets an answer or a clear error,
and the gateway's counts add up to the requests sent."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from test_gateway_fleet import KEYS, Fleet, needs_emulator

pytestmark = needs_emulator

AUTH = {"authorization": f"Bearer {KEYS['a']}"}


async def send_all(fleet: Fleet, bodies: list[bytes | dict], *, concurrency: int = 8,
                   path: str = "/v1/completions", on_sent=None) -> list[tuple[int, dict | str]]:
    """Send every body (JSON dicts or raw bytes) with bounded concurrency; return (status,
    parsed body) for each, in order. A transport error is recorded as status 0."""
    results: list[tuple[int, dict | str]] = [(0, "")] * len(bodies)
    gate = asyncio.Semaphore(concurrency)
    sent = 0

    async with httpx.AsyncClient(base_url=fleet.url, timeout=60) as client:
        async def one(i: int, body: bytes | dict) -> None:
            nonlocal sent
            async with gate:
                try:
                    if isinstance(body, dict):
                        response = await client.post(path, json=body, headers=AUTH)
                    else:
                        response = await client.post(path, content=body, headers={
                            **AUTH, "content-type": "application/json"})
                    text = response.text
                    try:
                        parsed: dict | str = json.loads(text)
                    except ValueError:
                        parsed = text
                    results[i] = (response.status_code, parsed)
                except httpx.HTTPError as exc:
                    results[i] = (0, f"{type(exc).__name__}: {exc}")
                sent += 1
                if on_sent is not None:
                    on_sent(sent)

        await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return results


def assert_answered(results: list[tuple[int, dict | str]]) -> None:
    """Every request got a 200 with choices, or an OpenAI-style error object."""
    for status, body in results:
        assert status != 0, f"a request got no answer: {body}"
        if status == 200:
            assert isinstance(body, dict) and body.get("choices"), body
        else:
            assert isinstance(body, dict) and isinstance(body.get("error"), dict), (status, body)
            assert body["error"]["message"]


def requests_counted(fleet: Fleet) -> float:
    return fleet.metric("prefixroute_gateway_requests_total")


def wait_counted(fleet: Fleet, expected: float) -> None:
    deadline = time.monotonic() + 10
    while requests_counted(fleet) < expected:
        assert time.monotonic() < deadline, (requests_counted(fleet), expected)
        time.sleep(0.05)
    assert requests_counted(fleet) == expected


def wait_first_event(lines: list[str], timeout_s: float = 20) -> None:
    """Until a reader thread appending a stream's ``lines`` has its first data event."""
    deadline = time.monotonic() + timeout_s
    while not any(line.startswith("data: {") for line in lines):
        assert time.monotonic() < deadline, "no first event"
        time.sleep(0.02)


def bodies(fleet: Fleet, n: int, tag: str) -> list[dict]:
    return [{"model": fleet.model, "prompt": f"{tag} request {i} about shared context " * 6,
             "max_tokens": 2} for i in range(n)]


def test_replica_killed_mid_run(tmp_path):
    with Fleet(tmp_path, replicas=3) as fleet:
        def kill_at(sent: int) -> None:
            if sent == 20:
                fleet.kill_replica(1, signal.SIGKILL)

        results = asyncio.run(send_all(fleet, bodies(fleet, 60, "kill"), on_sent=kill_at))
        assert_answered(results)
        ok = sum(1 for status, _ in results if status == 200)
        assert ok == 60  # two replicas remain: retries absorb the dead one
        wait_counted(fleet, 60)
        later = [d for d in fleet.decisions(10) if d["outcome"] == "ok"]
        assert all(d["replica"] != "r1" for d in later[:5])


def test_stream_cut_midway_ends_with_an_error_event(tmp_path):
    with Fleet(tmp_path, replicas=1, replica_args=["--time-scale", "50"]) as fleet:
        lines: list[str] = []

        def read() -> None:
            with httpx.stream("POST", fleet.url + "/v1/completions", headers=AUTH, json={
                    "model": fleet.model, "prompt": "stream me", "max_tokens": 200,
                    "stream": True}, timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)

        reader = threading.Thread(target=read)
        reader.start()
        wait_first_event(lines)
        fleet.kill_replica(0, signal.SIGKILL)
        reader.join(timeout=30)
        assert not reader.is_alive()
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "stream_interrupted"


def test_slow_replica_is_timed_out_and_retried(tmp_path):
    with Fleet(tmp_path, replicas=2, per_replica_args={0: ["--time-scale", "1000"]},
               gateway={"timeouts": {"read_s": 1.0}, "policy": "round_robin"}) as fleet:
        results = asyncio.run(send_all(fleet, bodies(fleet, 10, "slow"), concurrency=2))
        assert_answered(results)
        assert all(status == 200 for status, _ in results)
        assert fleet.metric("prefixroute_gateway_retries_total", reason="timeout") >= 1
        wait_counted(fleet, 10)
        # The slow replica still holds the abandoned requests and would drain them for
        # minutes on SIGTERM; it has served its purpose.
        fleet.kill_replica(0, signal.SIGKILL)


def test_flapping_replica(tmp_path):
    with Fleet(tmp_path, replicas=2, gateway={
            "circuit_breaker": {"failure_threshold": 2, "open_s": 0.5}}) as fleet:
        stop = threading.Event()

        def flap() -> None:
            while not stop.is_set():
                fleet.kill_replica(1, signal.SIGKILL)
                time.sleep(0.4)
                fleet.start_replica(1, wait=False)
                time.sleep(0.6)

        flapper = threading.Thread(target=flap)
        flapper.start()
        try:
            results = asyncio.run(send_all(fleet, bodies(fleet, 80, "flap"), concurrency=4))
        finally:
            stop.set()
            flapper.join(timeout=30)
        assert_answered(results)
        assert sum(1 for status, _ in results if status == 200) == 80
        wait_counted(fleet, 80)


def test_malformed_and_oversized_bodies_get_clear_errors(tmp_path):
    with Fleet(tmp_path, replicas=1, gateway={"limits": {"max_body_bytes": 4096}}) as fleet:
        good = bodies(fleet, 5, "good")
        bad: list[bytes | dict] = [
            b"{not json", b"", b"[1, 2, 3]", b"\xff\xfe",
            {"model": fleet.model},  # no prompt
            {"model": fleet.model, "prompt": {"oops": 1}},
            {"model": fleet.model, "prompt": "x", "max_tokens": "many"},  # the replica's 400
            {"model": fleet.model, "prompt": "x" * 10_000},  # over 4096 bytes
            json.dumps({"model": fleet.model, "prompt": "y" * 10_000}).encode(),
        ]
        results = asyncio.run(send_all(fleet, [*good, *bad]))
        assert_answered(results)
        statuses = [status for status, _ in results]
        assert statuses[:5] == [200] * 5
        assert statuses[5:12] == [400] * 7
        assert statuses[12:] == [413, 413]
        wait_counted(fleet, len(results))


@pytest.mark.parametrize("tenant_key", ["", "Bearer nope"])
def test_unauthenticated_requests_are_refused_and_counted(tmp_path, tenant_key):
    with Fleet(tmp_path, replicas=1) as fleet:
        headers = {"authorization": tenant_key} if tenant_key else {}
        response = httpx.post(fleet.url + "/v1/completions", headers=headers,
                              json={"model": fleet.model, "prompt": "x"}, timeout=10)
        assert response.status_code == 401
        wait_counted(fleet, 1)


def test_a_full_queue_answers_429_and_the_rest_complete(tmp_path):
    with Fleet(tmp_path, replicas=1, replica_args=["--time-scale", "5"], gateway={
            "limits": {"max_concurrent": 2, "max_queued": 2, "queue_timeout_s": 60}}) as fleet:
        many = [{**body, "max_tokens": 30} for body in bodies(fleet, 12, "queue")]
        results = asyncio.run(send_all(fleet, many, concurrency=12))
        assert_answered(results)
        statuses = [status for status, _ in results]
        refused = [body for status, body in results if status == 429]
        assert statuses.count(200) >= 4  # two running and two queued at the least
        assert refused and all(body["error"]["code"] == "queue_full" for body in refused)
        assert statuses.count(200) + len(refused) == 12
        wait_counted(fleet, 12)


@pytest.mark.slow
def test_a_restarted_replica_that_passes_health_checks_takes_requests_at_once(tmp_path):
    """Both replicas fail in turn: r1 dies and its breaker opens; r1 comes back and passes
    its health checks while the gateway idles; then r0 dies. r1 must take every request,
    not one half-open trial while the rest are refused (default breaker: 5 failures, 10 s)."""
    with Fleet(tmp_path, replicas=2, gateway={
            "policy": "round_robin", "health": {"interval_s": 2.0}}) as fleet:
        fleet.kill_replica(1, signal.SIGKILL)
        first = asyncio.run(send_all(fleet, bodies(fleet, 12, "before"), concurrency=1))
        assert [status for status, _ in first] == [200] * 12
        assert fleet.metric("prefixroute_gateway_replica_breaker_state", replica="r1") == 2  # open
        fleet.start_replica(1)
        time.sleep(13)  # past the 10 s open period, health checks passing, no requests
        fleet.kill_replica(0, signal.SIGKILL)
        results = asyncio.run(send_all(fleet, bodies(fleet, 20, "after"), concurrency=20))
        assert_answered(results)
        assert [status for status, _ in results] == [200] * 20


def test_a_shutdown_drains_then_cuts_open_streams_with_an_error_event(tmp_path):
    """SIGTERM with a long stream open: during the grace /health answers 503 draining (new
    connections still accepted); at its end the stream gets a server_shutdown error event
    and [DONE], the request is logged as cut, and the gateway exits within the grace."""
    grace = 3.0
    with Fleet(tmp_path, replicas=1, gateway={"shutdown_grace_s": grace}) as fleet:
        lines: list[str] = []
        failures: list[str] = []

        def read() -> None:
            try:
                with httpx.stream("POST", fleet.url + "/v1/chat/completions", headers=AUTH,
                                  json={"model": fleet.model, "max_tokens": 1500,
                                        "stream": True, "messages": [
                                            {"role": "user", "content": "a long story"}]},
                                  timeout=60) as response:
                    for line in response.iter_lines():
                        lines.append(line)
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")

        reader = threading.Thread(target=read)
        reader.start()
        wait_first_event(lines)
        assert fleet.gateway is not None
        signalled = time.monotonic()
        fleet.gateway.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(fleet.url + "/health", timeout=5)
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        reader.join(timeout=30)
        assert not reader.is_alive() and not failures, failures
        fleet.gateway.wait(timeout=30)
        assert time.monotonic() - signalled < grace + 10  # the grace, and a loaded machine's
        events = [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        assert json.loads(events[-2][6:])["error"]["code"] == "server_shutdown"
        logged = [json.loads(line) for line in fleet.log("gateway").read_text().splitlines()
                  if line.startswith("{")]
        requests = [r for r in logged if r.get("event") == "request"]
        assert [r["status"] for r in requests] == ["server_shutdown"]
        stopped = [r for r in logged if r.get("event") == "stopped"]
        assert stopped[0]["streams_cut_by_shutdown"] == 1
        assert stopped[0]["unfinished_requests"] == 0
