"""Several gateway instances sharing bookings and rate limits through a real Redis, in front of
emulator replicas: every process real, on 127.0.0.1, stopped by PID."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from prefixroute.edges.gateway.config import hash_api_key
from tests.helpers.redis_server import RedisServer, needs_redis
from tests.integration.test_gateway_fleet import KEYS, Fleet, needs_emulator

pytestmark = [needs_redis, needs_emulator, pytest.mark.slow]

PREFIX = "You are a careful assistant for the shared-state tests. " * 12


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
    return total


def wait_for(check, timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def complete(url: str, prompt: str, model: str, tenant: str = "a",
             client: httpx.Client | None = None) -> httpx.Response:
    send = client or httpx
    return send.post(f"{url}/v1/completions", timeout=30,
                     headers={"authorization": f"Bearer {KEYS[tenant]}"},
                     json={"model": model, "prompt": prompt, "max_tokens": 1})


def fleet_with_redis(tmp_path, redis: RedisServer, replicas: int = 2, **extra) -> Fleet:
    gateway = {"shared_state": {"redis": redis.url}, **extra}
    return Fleet(tmp_path, replicas=replicas, replica_args=["--time-scale", "0"],
                 gateway=gateway)


def test_instances_see_each_others_bookings_and_follow_the_same_prefix(tmp_path):
    with RedisServer(tmp_path) as redis, fleet_with_redis(tmp_path, redis, replicas=3) as fleet:
        second = fleet.start_another_gateway()
        third = fleet.start_another_gateway()
        # Five requests through the first instance, each a new session sharing one prefix.
        for i in range(5):
            assert complete(fleet.url, PREFIX + f"question {i}", fleet.model).status_code == 200
        for url in (second, third):
            wait_for(lambda: metric(url, "prefixroute_shared_state_remote_events_total",
                                    kind="routed") == 5, what="5 remote bookings")
            wait_for(lambda: metric(url, "prefixroute_shared_state_remote_events_total",
                                    kind="completed") == 5, what="5 remote completions")
            assert metric(url, "prefixroute_shared_state_up") == 1
        first_replicas = {d["replica"] for d in fleet.decisions(5)}
        # The other instances never saw this prefix themselves: only through the bookings
        # do they know where it is cached, and they send the same prefix there.
        assert complete(second, PREFIX + "question 5", fleet.model).status_code == 200
        assert complete(third, PREFIX + "question 6", fleet.model).status_code == 200
        for url in (second, third):
            assert fleet.decisions(1, url)[0]["replica"] in first_replicas
            assert fleet.decisions(1, url)[0]["predicted_cached_tokens"] > 0
        # An instance started now rebuilds the same state from the stream's history.
        late = fleet.start_another_gateway()
        wait_for(lambda: metric(late, "prefixroute_shared_state_remote_events_total",
                                kind="completed") == 7, what="the late instance's bootstrap")
        assert complete(late, PREFIX + "question 7", fleet.model).status_code == 200
        assert fleet.decisions(1, late)[0]["replica"] in first_replicas


def test_a_streamed_request_s_first_byte_reaches_the_other_instances(tmp_path):
    # The others count its prefill as pending on its replica from its booking to this
    # message (a non-streamed answer sends none: its end says it). The replicas take modelled
    # time to decode, so the stream is still running when its first byte is seen (an answer
    # that has ended by then needs no such message either).
    with RedisServer(tmp_path) as redis, \
            Fleet(tmp_path, replicas=2, replica_args=["--time-scale", "0.5"],
                  gateway={"shared_state": {"redis": redis.url}}) as fleet:
        second = fleet.start_another_gateway()
        with httpx.stream("POST", f"{fleet.url}/v1/completions", timeout=30,
                          headers={"authorization": f"Bearer {KEYS['a']}"},
                          json={"model": fleet.model, "prompt": PREFIX + "streamed",
                                "max_tokens": 32, "stream": True}) as response:
            assert response.status_code == 200
            assert b"[DONE]" in response.read()
        assert complete(fleet.url, PREFIX + "not streamed", fleet.model).status_code == 200
        wait_for(lambda: metric(second, "prefixroute_shared_state_remote_events_total",
                                kind="completed") == 2, what="2 remote completions")
        assert metric(second, "prefixroute_shared_state_remote_events_total",
                      kind="prefilled") == 1


async def hammer(urls: list[str], model: str, seconds: float, prompt_for,
                 weight: int) -> tuple[int, int, list[httpx.Response]]:
    """Tenant a's completions, six at a time over the instances in turn, for ``seconds``: what
    was accepted and offered, each request counting ``weight`` (1 for requests, its prompt
    tokens for a token limit), and the refusals."""
    ok = offered = 0
    refusals: list[httpx.Response] = []
    async with httpx.AsyncClient(timeout=30) as client:
        deadline = time.monotonic() + seconds
        i = 0
        while time.monotonic() < deadline:
            batch = [client.post(f"{urls[(i + k) % len(urls)]}/v1/completions",
                                 headers={"authorization": f"Bearer {KEYS['a']}"},
                                 json={"model": model, "prompt": prompt_for(i + k),
                                       "max_tokens": 1}) for k in range(6)]
            i += 6
            for response in await asyncio.gather(*batch):
                offered += weight
                assert response.status_code in (200, 429), response.text
                if response.status_code == 200:
                    ok += weight
                else:
                    refusals.append(response)
    return ok, offered, refusals


def test_a_tenant_limit_holds_across_instances(tmp_path):
    rate, burst, seconds = 5.0, 1, 4.0
    limited = {"rate_limit": {"requests_per_second": rate, "burst": burst}}
    tenants = [{"name": "a", "api_key_sha256": hash_api_key(KEYS["a"]), **limited},
               {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True}]
    with RedisServer(tmp_path) as redis, \
            fleet_with_redis(tmp_path, redis, tenants=tenants) as fleet:
        urls = [fleet.url, fleet.start_another_gateway(), fleet.start_another_gateway()]

        started = time.monotonic()
        ok, offered, _ = asyncio.run(hammer(urls, fleet.model, seconds,
                                            lambda i: f"hi {i}", weight=1))
        elapsed = time.monotonic() - started
        allowed = burst + rate * elapsed
        # Each instance alone would let through its own `allowed`: three times as many.
        assert offered > 2 * allowed, f"the load ({offered}) was too light to test the limit"
        assert ok <= 1.05 * allowed, f"{ok} accepted; the fleet-wide limit allows {allowed:.1f}"
        assert ok >= 0.6 * rate * seconds
        assert sum(metric(u, "prefixroute_shared_state_local_rate_checks_total")
                   for u in urls) == 0


def test_a_tenant_prompt_token_limit_holds_across_instances(tmp_path):
    """A tenant limited to T prompt tokens a second, sent more than twice that over three
    instances, gets at most burst + T x seconds through; a refusal is an OpenAI-style 429
    with Retry-After, and a prompt longer than the burst is refused for good."""
    rate, burst, seconds, prompt_tokens = 1000.0, 1000, 4.0, 100
    limited = {"rate_limit": {"prompt_tokens_per_second": rate, "prompt_tokens_burst": burst}}
    tenants = [{"name": "a", "api_key_sha256": hash_api_key(KEYS["a"]), **limited},
               {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True}]
    prompt = list(range(500, 500 + prompt_tokens))  # token ids: exactly 100 prompt tokens
    with RedisServer(tmp_path) as redis, \
            fleet_with_redis(tmp_path, redis, tenants=tenants) as fleet:
        urls = [fleet.url, fleet.start_another_gateway(), fleet.start_another_gateway()]
        started = time.monotonic()
        ok, offered, refusals = asyncio.run(hammer(urls, fleet.model, seconds,
                                                   lambda i: prompt, weight=prompt_tokens))
        elapsed = time.monotonic() - started
        allowed = burst + rate * elapsed
        assert offered > 2 * allowed, f"the load ({offered}) was too light to test the limit"
        assert ok <= 1.05 * allowed, f"{ok} tokens accepted; the fleet allows {allowed:.0f}"
        assert ok >= 0.6 * rate * seconds
        error = refusals[0].json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["type"] == "rate_limit_error"
        assert "prompt tokens per second" in error["message"]
        assert int(refusals[0].headers["retry-after"]) >= 1
        too_long = httpx.post(f"{urls[1]}/v1/completions", timeout=30,
                              headers={"authorization": f"Bearer {KEYS['a']}"},
                              json={"model": fleet.model, "prompt": list(range(1001)),
                                    "max_tokens": 1})
        assert too_long.status_code == 429 and "retry-after" not in too_long.headers
        assert "can never pass" in too_long.json()["error"]["message"]
        assert sum(metric(u, "prefixroute_shared_state_local_rate_checks_total")
                   for u in urls) == 0


def test_killing_redis_fails_no_request_and_instances_resync(tmp_path):
    with RedisServer(tmp_path) as redis, fleet_with_redis(tmp_path, redis) as fleet:
        second = fleet.start_another_gateway()
        urls = [fleet.url, second]
        statuses = []
        with httpx.Client() as client:
            for i in range(6):
                statuses.append(complete(urls[i % 2], PREFIX + f"before {i}", fleet.model,
                                         client=client).status_code)
            redis.kill()
            for i in range(10):
                statuses.append(complete(urls[i % 2], PREFIX + f"during {i}", fleet.model,
                                         client=client).status_code)
            for url in urls:
                wait_for(lambda: metric(url, "prefixroute_shared_state_up") == 0,
                         what="the instance to notice Redis is down")
            log = fleet.log("gateway").read_text()
            assert "shared state unavailable" in log
            seen_before = metric(second, "prefixroute_shared_state_remote_events_total",
                                 kind="routed")
            redis.start()  # the same port, empty
            for url in urls:
                wait_for(lambda: metric(url, "prefixroute_shared_state_up") == 1,
                         what="the instance to reconnect")
            # What the first instance did during the outage reaches the second one.
            wait_for(lambda: metric(second, "prefixroute_shared_state_remote_events_total",
                                    kind="routed") >= seen_before + 5,
                     what="the outage's bookings to be resent")
            for i in range(4):
                statuses.append(complete(fleet.url, PREFIX + f"after {i}", fleet.model,
                                         client=client).status_code)
            wait_for(lambda: metric(second, "prefixroute_shared_state_remote_events_total",
                                    kind="routed") >= seen_before + 9,
                     what="new bookings after the outage")
        assert statuses == [200] * 20


def test_the_demo_routes_through_several_gateways_sharing_state(tmp_path):
    import json
    import subprocess
    import sys

    with RedisServer(tmp_path) as redis:
        result = subprocess.run(
            [sys.executable, "-m", "prefixroute", "demo", "--requests", "30", "--replicas", "2",
             "--gateways", "2", "--shared-state", redis.url, "--policy", "prefixroute",
             "--json"], capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert (report["scenario"]["gateways"], report["scenario"]["shared_state"]) == (2, True)
    row = report["policies"]["prefixroute"]
    assert (row["requests_ok"], row["requests_failed"]) == (30, 0)
    assert sum(r["requests"] for r in row["replica_load"]) == 30
