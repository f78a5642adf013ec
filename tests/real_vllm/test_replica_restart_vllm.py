"""A real vLLM 0.32 CPU replica restarted under traffic: the gateway's view of its cache resets
and rebuilds.

vLLM sends no "cache cleared" event when it restarts; its KV event sequence starts again from
0. The gateway's subscriber sees the sequence go back, resets the replica's view (the policy
forgets the replica's blocks) and counts a restart; ``prefixroute doctor --gateway`` shows the
view ``exact`` with one restart seen. What must hold:

* before the restart, a repeated prefix is predicted cached and vLLM reports it cached;
* after it (and once the new process's first events arrived), the same prefix is predicted
  *uncached*, as vLLM reports it: the gateway does not route on blocks that died with the
  old process;
* a repeat after that is predicted cached again, as vLLM reports: the view rebuilt;
* traffic kept flowing through the gateway around the restart, and every request after the
  replica came back succeeded.

Run with ``pytest -m vllm tests/real_vllm/test_replica_restart_vllm.py`` (two vLLM startups:
a few minutes).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest

from prefixroute.edges.gateway.config import BreakerConfig, HealthConfig, hash_api_key

from .vllm_server import (BLOCK_SIZE, SERVED_MODEL_NAME, VllmServer, free_port,
                          install_problem, running_gateway, vllm_install_dir)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

SECRET = "vllm-restart-test-secret-0123456789abcdef-0123456789"
KEYS = {"a": "sk-restart-a", "ops": "sk-restart-ops"}
PREFIX = ("Chapter {n}. A replica that restarts loses every cached block; a router that kept "
          "routing on them would send requests to a cold cache. ") * 8


def doctor_view(url: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "prefixroute", "doctor", "--gateway", url,
                             "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["checks"][0]["data"]


def complete(client: httpx.Client, url: str, prompt: str) -> httpx.Response:
    return client.post(f"{url}/v1/completions", timeout=300,
                       headers={"authorization": f"Bearer {KEYS['a']}"},
                       json={"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": 1})


def predicted(url: str, answer: httpx.Response) -> int:
    """The cached tokens the gateway predicted for the request ``answer`` answers (found by
    its ``x-request-id`` among the recent decisions: background traffic runs meanwhile)."""
    response = httpx.get(f"{url}/debug/decisions?n=100", timeout=10,
                         headers={"authorization": f"Bearer {KEYS['ops']}"})
    response.raise_for_status()
    request_id = answer.headers["x-request-id"]
    return next(d["predicted_cached_tokens"] for d in response.json()["decisions"]
                if d["request_id"] == request_id)


def cached(response: httpx.Response) -> int:
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


# After the replica is back, the gateway may still answer 503 while its circuit breaker,
# opened by the failures during the restart, stays open, and until a health check sees the
# replica: the default breaker's open time plus two default health-check intervals (this
# test checks every second, so that is a margin).
SETTLE_S = BreakerConfig().open_s + 2 * HealthConfig().interval_s


def wait_for(check, timeout: float, what: str, detail=lambda: "") -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}{detail()}"
        time.sleep(0.5)


def test_a_restarted_replica_s_view_resets_and_rebuilds(tmp_path):
    problem = install_problem()
    if problem:
        pytest.skip(problem)
    kv_port, replay_port = free_port(), free_port()
    server = VllmServer(kv_events_port=kv_port, replay_port=replay_port, topic="kv")
    config = {
        "server_secret": {"env": "PR_VLLM_RESTART_SECRET"},
        "tokenizer": str(vllm_install_dir() / "model"),
        "hashing": {"block_size": BLOCK_SIZE, "algo": "sha256"},
        "backends": [{"name": "vllm0", "url": server.url, "models": [SERVED_MODEL_NAME],
                      "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv_port}",
                                    "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                                    "topic": "kv"}}],
        "tenants": [{"name": "a", "api_key_sha256": hash_api_key(KEYS["a"])},
                    {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]),
                     "admin": True}],
        "timeouts": {"read_s": 300},
        "health": {"interval_s": 1},
    }
    path = tmp_path / "gateway.yaml"
    path.write_text(json.dumps(config))  # JSON is YAML
    # vLLM connects to the event endpoint the gateway binds (ZeroMQ retries until it is
    # bound; batches sent meanwhile are replayed). The gateway is healthy once vLLM is.
    try:
        server.start()
        with running_gateway(path, tmp_path / "gateway.log",
                             {"PR_VLLM_RESTART_SECRET": SECRET}) as url:
            statuses: list[tuple[float, int]] = []
            stop = threading.Event()

            def background_traffic() -> None:  # until stopped; bounded: 4000 x 0.3 s
                with httpx.Client() as client:
                    for i in range(4000):
                        if stop.is_set():
                            return
                        try:
                            status = complete(client, url, f"background request {i}. " * 8)
                            statuses.append((time.monotonic(), status.status_code))
                        except httpx.HTTPError:
                            statuses.append((time.monotonic(), 0))
                        time.sleep(0.3)

            traffic = threading.Thread(target=background_traffic, daemon=True)
            try:
                with httpx.Client() as client:
                    traffic.start()
                    before = PREFIX.format(n=1)
                    assert complete(client, url, before + "first").status_code == 200
                    wait_for(lambda: doctor_view(url)["blocks"] > 0, 60, "the first events")
                    repeat = complete(client, url, before + "second")
                    assert cached(repeat) > 0
                    assert predicted(url, repeat) == cached(repeat)
                    view = doctor_view(url)
                    assert (view["state"], view["restarts"]) == ("exact", 0)
                    # The background traffic flows before the restart: on a slow machine its
                    # first answer can come after the steps above.
                    wait_for(lambda: any(code == 200 for _, code in list(statuses))
                             or not traffic.is_alive(), 120,
                             "background traffic before the restart", lambda: f": {statuses}")
                    assert traffic.is_alive(), f"the background traffic stopped: {statuses}"

                    server.stop()  # under traffic
                    server.start()
                    back = time.monotonic()
                    # The new process's first events carry sequence 0 again: requests of
                    # another prompt (the gateway may answer 503 until its health check and
                    # circuit breaker see the replica back).
                    wait_for(lambda: complete(client, url, "the first after the restart. " * 8)
                             .status_code == 200 and doctor_view(url)["restarts"] == 1, 180,
                             "the restart")
                    view = doctor_view(url)
                    assert view["state"] == "exact"

                    after = complete(client, url, before + "third")
                    assert after.status_code == 200
                    assert cached(after) == 0  # the engine's cache died with its process ...
                    assert predicted(url, after) == 0  # ... and so did the gateway's view
                    again = complete(client, url, before + "fourth")
                    assert cached(again) > 0  # rebuilt from the new process's events
                    assert predicted(url, again) == cached(again)
                    # The background traffic goes on past the restart's settling time: its
                    # answers there must all be 200 (checked below).
                    wait_for(lambda: sum(t > back + SETTLE_S for t, _ in list(statuses)) >= 3,
                             120, "background traffic after the restart")
            finally:
                stop.set()
                if traffic.is_alive():
                    traffic.join(timeout=330)
    finally:
        server.stop()
    assert any(code == 200 for t, code in statuses if t < back), \
        f"no traffic before the restart: {statuses}"
    after_back = [code for t, code in statuses if t > back + SETTLE_S]
    assert after_back and all(code == 200 for code in after_back), statuses
