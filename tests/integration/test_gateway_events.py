"""Gateway and emulator replicas sharing a tokenizer, with KV events: the gateway's block keys
are the ids the replicas publish, so its predictions equal the replicas' reports; and
``prefixroute doctor`` finds a correctly configured replica healthy and a misconfigured
gateway setting wrong."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from prefixroute.edges import children
from test_gateway_fleet import KEYS, Fleet, free_port, needs_emulator, stop_process, wait_healthy

pytestmark = needs_emulator

BLOCK = 32
SYSTEM = "You answer questions about the train timetable. Quote times exactly. " * 10


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_tokenizer_dir):
    tokenizer = str(tiny_tokenizer_dir)
    with Fleet(tmp_path_factory.mktemp("events"), replicas=2, block_size=BLOCK,
               kv_events=True, replica_args=["--tokenizer", tokenizer],
               gateway={"tokenizer": tokenizer, "policy": "hybrid:max_skew=64"}) as running:
        yield running


def test_views_come_from_events_and_predictions_equal_reports(fleet):
    client = fleet.client("a")
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "When does the first train leave?"}]
    reported = []
    for turn in range(3):
        result = client.chat.completions.create(model=fleet.model, messages=messages,
                                                max_tokens=4)
        reported.append(result.usage.prompt_tokens_details.cached_tokens)
        messages += [{"role": "assistant", "content": result.choices[0].message.content},
                     {"role": "user", "content": f"And train number {turn + 2}?"}]
        time.sleep(0.2)  # the replica's BlockStored events trail its answer by milliseconds
    decisions = list(reversed(fleet.decisions(3)))
    assert [d["tokenization"] for d in decisions] == ["tokenizer"] * 3
    assert [d["reported_cached_tokens"] for d in decisions] == reported
    assert [d["predicted_cached_tokens"] for d in decisions] == reported
    assert reported[0] == 0 and reported[1] > 0 and reported[2] > reported[1]
    assert len({d["replica"] for d in decisions}) == 1
    replicas = httpx.get(f"{fleet.url}/debug/decisions?n=1", timeout=10,
                         headers={"authorization": f"Bearer {KEYS['ops']}"}).json()["replicas"]
    assert [r["view"] for r in replicas] == ["events", "events"]


def test_another_tenant_sees_no_cached_tokens_of_this_prefix(fleet):
    messages = [{"role": "system", "content": "isolation " + SYSTEM},
                {"role": "user", "content": "Any delays today?"}]
    fleet.client("a").chat.completions.create(model=fleet.model, messages=messages,
                                              max_tokens=2)
    other = fleet.client("b").chat.completions.create(model=fleet.model, messages=messages,
                                                      max_tokens=2)
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    last = fleet.decisions(1)[0]
    assert last["tenant"] == "b" and last["predicted_cached_tokens"] == 0


def run_doctor(*args: str) -> tuple[int, dict]:
    result = subprocess.run([sys.executable, "-m", "prefixroute", "doctor", *args, "--json"],
                            capture_output=True, text=True, timeout=120)
    return result.returncode, json.loads(result.stdout) if result.stdout else {}


@pytest.fixture(scope="module")
def lone_replica(tmp_path_factory, tiny_tokenizer_dir):
    """One replica that binds its event socket (tcp://*:PORT), for the doctor to connect to."""
    port, kv_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("doctor") / "replica.log"
    with open(log, "wb") as out:
        process = children.spawn(
            [sys.executable, "-m", "prefixroute", "replica", "--port", str(port),
             "--block-size", str(BLOCK), "--tokenizer", str(tiny_tokenizer_dir),
             "--kv-events", f"tcp://*:{kv_port}", "--time-scale", "0"],
            stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        yield f"http://127.0.0.1:{port}", kv_port
    finally:
        stop_process(process)


def test_doctor_passes_a_correctly_configured_replica(lone_replica, tiny_tokenizer_dir):
    url, kv_port = lone_replica
    code, report = run_doctor("--backend", url, "--tokenizer", str(tiny_tokenizer_dir),
                              "--kv-events", f"tcp://127.0.0.1:{kv_port}",
                              "--kv-events-connect")
    assert code == 0, report
    statuses = {c["name"]: c["status"] for c in report["checks"]}
    assert statuses == {"reachable": "ok", "engine_config": statuses["engine_config"],
                        "cached_tokens": "ok", "prefix_hit": "ok", "salt_isolation": "ok",
                        "kv_events": "ok", "tokenize_completion": "ok", "tokenize_chat": "ok"}
    assert statuses["engine_config"] in ("ok", "warn")


def test_doctor_names_a_wrong_block_size(lone_replica):
    url, _ = lone_replica
    code, report = run_doctor("--backend", url, "--block-size", "16")
    assert code == 1
    failed = [c for c in report["checks"] if c["status"] == "fail"]
    assert failed and any("32" in c["detail"] for c in failed)


def test_a_second_gateway_instance_finds_the_prefix_the_first_one_placed(tmp_path,
                                                                          tiny_tokenizer_dir):
    # Two gateway instances (for availability) in front of the same replicas: neither sees
    # the other's routing, but both read every replica's KV events, so the second sends the
    # prefix to where the first put it instead of computing it again elsewhere.
    tokenizer = str(tiny_tokenizer_dir)
    with Fleet(tmp_path, replicas=2, block_size=BLOCK, kv_events=True,
               replicas_bind_events=True, replica_args=["--tokenizer", tokenizer],
               gateway={"tokenizer": tokenizer}) as fleet:
        second = fleet.start_another_gateway()
        system = "two gateways " + SYSTEM
        first = fleet.client("a").chat.completions.create(
            model=fleet.model, max_tokens=2,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "When does the first train leave?"}])
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        placed = fleet.decisions(1)[0]["replica"]
        deadline = time.monotonic() + 10
        while not any(r["view_blocks"] for r in fleet.debug(1, second)["replicas"]):
            assert time.monotonic() < deadline, "the replica's events never reached gateway 2"
            time.sleep(0.05)
        other = openai.OpenAI(base_url=second + "/v1", api_key=KEYS["a"], max_retries=0,
                              timeout=60)
        again = other.chat.completions.create(
            model=fleet.model, max_tokens=2,
            messages=[{"role": "system", "content": system},
                      {"role": "user", "content": "And the last one?"}])
        decision = fleet.decisions(1, second)[0]
        assert (decision["replica"], decision["branch"]) == (placed, "cache_affinity"), decision
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached > 0
        assert decision["predicted_cached_tokens"] == decision["reported_cached_tokens"] == cached
