"""The gateway in front of two real vLLM 0.32 CPU replicas with KV events.

What must hold: tenant B never gets cached tokens from tenant A's prefix, and tenant
A's repeat does; the gateway's keys are the ids vLLM publishes, so its predicted cached tokens
equal what vLLM reports; ``prefixroute doctor`` finds nothing wrong with a correctly configured
engine. The second replica runs ``--scheduling-policy priority``, and the gateway sends it the
policy's deadlines as ``priority`` (and none to the first).

To make the isolation check independent of where the policy sends a request, tenant A's prefix
is first planted on *both* replicas directly, under A's secret salt (the test wrote the config,
so it knows the secret): then B's request lands on a replica holding A's prefix whichever it
is, and must still hit nothing.

The two replicas are this suite's one vLLM slot: the first server takes the one-vLLM lock of
``vllm_server.py`` and the second runs under it (2 x 2.2 GB fits; each gets its own core).
Run with ``pytest -m vllm tests/real_vllm/test_gateway_vllm.py`` (a few minutes: vLLM startup).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from prefixroute.core.identity.identity import derive_trust_group_salt
from prefixroute.edges.gateway.config import hash_api_key
from tests.helpers.decisions import settled_decisions

from .vllm_server import (BLOCK_SIZE, SERVED_MODEL_NAME, VllmServer, cached_tokens, free_port,
                          install_problem, running_epp_behind_envoy, running_gateway,
                          start_vllm_pair, vllm_install_dir)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

SECRET = "vllm-gateway-test-secret-0123456789abcdef-0123456789"
KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b", "ops": "sk-ops"}
# Long enough for several full 32-token blocks, varied enough to tokenize into many tokens.
DOCUMENT = ("Section {n}. Prefix caching keeps the keys and values of a prompt's leading tokens "
            "so that a repeated prefix skips prefill. The router decides which replica holds "
            "it; the gateway salts it per trust group. ") * 6


def start_pair(kv_ports: list[int], replay_ports: list[int]) -> list[VllmServer]:
    # The second runs vLLM's priority scheduling: the gateway sends it the policy's deadlines.
    return start_vllm_pair(kv_ports, replay_ports,
                           extra_args=((), ("--scheduling-policy", "priority")))


def write_config(directory: Path, servers: list[VllmServer], kv_ports: list[int],
                 replay_ports: list[int], *, name: str = "gateway.yaml",
                 kv_events: bool = True) -> Path:
    config = {
        "server_secret": {"env": "PR_VLLM_GATEWAY_SECRET"},
        "tokenizer": str(vllm_install_dir() / "model"),
        "hashing": {"block_size": BLOCK_SIZE, "algo": "sha256"},
        "backends": [{"name": f"vllm{i}", "url": server.url, "models": [SERVED_MODEL_NAME],
                      "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv_ports[i]}",
                                    "replay_endpoint": f"tcp://127.0.0.1:{replay_ports[i]}",
                                    "topic": "kv"},
                      "scheduling_policy": "priority" if i == 1 else "fcfs"}
                     for i, server in enumerate(servers)],
        "tenants": [
            {"name": "a", "api_key_sha256": hash_api_key(KEYS["a"]), "trust_group": "a"},
            {"name": "b", "api_key_sha256": hash_api_key(KEYS["b"]), "trust_group": "b"},
            {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
        ],
        "timeouts": {"read_s": 300},
    }
    if not kv_events:
        for backend in config["backends"]:
            del backend["kv_events"]
    path = directory / name
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    problem = install_problem()
    if problem:
        pytest.skip(problem)
    kv_ports = [free_port(), free_port()]
    replay_ports = [free_port(), free_port()]
    servers = start_pair(kv_ports, replay_ports)
    try:
        # The doctor binds replica 0's event endpoint first; the gateway binds it after.
        doctor = subprocess.run(
            [sys.executable, "-m", "prefixroute", "doctor", "--backend", servers[0].url,
             "--tokenizer", str(vllm_install_dir() / "model"), "--kv-events",
             f"tcp://127.0.0.1:{kv_ports[0]}", "--kv-topic", "kv", "--json"],
            capture_output=True, text=True, timeout=600)
        directory = tmp_path_factory.mktemp("gateway")
        config = write_config(directory, servers, kv_ports, replay_ports)
        with running_gateway(config, directory / "gateway.log",
                             {"PR_VLLM_GATEWAY_SECRET": SECRET}) as url:
            yield {"servers": servers, "url": url, "doctor": doctor,
                   "log": directory / "gateway.log", "directory": directory,
                   "kv_ports": kv_ports, "replay_ports": replay_ports}
    finally:
        for server in reversed(servers):
            server.stop()


def client(fleet, tenant: str, url: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=(url or fleet["url"]) + "/v1", api_key=KEYS[tenant],
                         max_retries=0, timeout=300)


def decisions(fleet, n: int = 50, url: str | None = None) -> list[dict]:
    return settled_decisions(url or fleet["url"], KEYS["ops"], n)


def usage_cached(result) -> int:
    details = result.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def test_doctor_finds_the_gateway_hashing_equal_to_vllm(fleet):
    doctor = fleet["doctor"]
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    for name in ("prefix_hit", "salt_isolation", "kv_events", "tokenize_completion",
                 "tokenize_chat"):
        assert checks[name]["status"] == "ok", checks[name]


def test_tenant_a_repeat_hits_and_tenant_b_never_gets_a_prefix(fleet):
    check_isolation(fleet, fleet["url"], fleet["url"], DOCUMENT.format(n=1))


def test_the_same_isolation_through_envoy_and_the_endpoint_picker(fleet):
    # The same replicas behind `prefixroute epp` and a real Envoy (without KV events: the
    # gateway above already binds the replicas' event endpoints).
    directory = fleet["directory"]
    config = write_config(directory, fleet["servers"], fleet["kv_ports"],
                          fleet["replay_ports"], name="epp.yaml", kv_events=False)
    with running_epp_behind_envoy(config, directory,
                                  {"PR_VLLM_GATEWAY_SECRET": SECRET}) as (url, admin):
        check_isolation(fleet, url, admin, DOCUMENT.format(n=7))


def check_isolation(fleet, url: str, admin: str, text: str) -> None:
    """Tenant A's prefix planted on both replicas under A's secret salt: B's request
    through ``url`` gets no cached token, A's repeat gets every full block but the last
    token's; the decisions ``admin`` shows agree."""
    salt_a = derive_trust_group_salt(SECRET.encode(), "a")
    for server in fleet["servers"]:  # A's prefix on both replicas, under A's secret salt
        server.complete(text, cache_salt=salt_a)

    b = client(fleet, "b", url).completions.create(model=SERVED_MODEL_NAME, prompt=text,
                                                   max_tokens=2, temperature=0)
    assert usage_cached(b) == 0

    a = client(fleet, "a", url).completions.create(model=SERVED_MODEL_NAME, prompt=text,
                                                   max_tokens=2, temperature=0)
    n = a.usage.prompt_tokens
    assert usage_cached(a) == (n - 1) // BLOCK_SIZE * BLOCK_SIZE > 0
    a_decision, b_decision = decisions(fleet, 2, admin)
    assert (a_decision["tenant"], b_decision["tenant"]) == ("a", "b")
    assert b_decision["reported_cached_tokens"] == 0
    assert a_decision["reported_cached_tokens"] == usage_cached(a)


def test_a_conversation_sticks_to_its_replica_and_predictions_equal_reports(fleet):
    chat = client(fleet, "a").chat.completions
    messages = [{"role": "system", "content": DOCUMENT.format(n=2)},
                {"role": "user", "content": "Summarise section 2 in one line."}]
    first = chat.create(model=SERVED_MODEL_NAME, messages=messages, max_tokens=4,
                        temperature=0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content or "ok"},
                 {"role": "user", "content": "And in one word?"}]
    # Sent at once: the first answer's BlockStored events may still be on the way, and the
    # gateway must hold its blocks anyway (EVENT_GRACE_S); a CI run once routed it elsewhere.
    second = chat.create(model=SERVED_MODEL_NAME, messages=messages, max_tokens=4,
                         temperature=0)
    last, before = decisions(fleet, 2)
    # On failure, the two decisions (replicas, branches, costs) say why.
    assert usage_cached(second) > 0, json.dumps([before, last], indent=1)
    assert last["replica"] == before["replica"]
    assert last["branch"] != "miss_least_assigned"
    # The gateway's tokens and block keys are vLLM's: what it predicted is what vLLM reused.
    assert last["predicted_cached_tokens"] == last["reported_cached_tokens"] == \
        usage_cached(second)


def test_streaming_chat_through_the_gateway(fleet):
    stream = client(fleet, "b").chat.completions.create(
        model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "Say something."}],
        max_tokens=8, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert decisions(fleet, 1)[0]["outcome"] == "ok"


def test_replica_views_are_fed_by_kv_events(fleet):
    response = httpx.get(fleet["url"] + "/debug/decisions?n=1",
                         headers={"authorization": f"Bearer {KEYS['ops']}"}, timeout=10)
    replicas = response.json()["replicas"]
    assert all(r["view"] == "events" for r in replicas)
    assert sum(r["view_blocks"] for r in replicas) > 0
    metrics = httpx.get(fleet["url"] + "/metrics", timeout=10).text
    stored = [line for line in metrics.splitlines()
              if line.startswith("prefixroute_gateway_kv_events_total{") and 'kind="stored"' in line]
    assert stored and all(float(line.rsplit(" ", 1)[1]) > 0 for line in stored)


def test_direct_vllm_sanity_salted_requests_do_not_share(fleet):
    server = fleet["servers"][0]
    text = DOCUMENT.format(n=3)
    server.complete(text, cache_salt="x" * 64)
    assert cached_tokens(server.complete(text, cache_salt="y" * 64)) == 0


def test_the_priority_replica_gets_deadlines_and_vllm_serves_them(fleet):
    # vLLM 0.32 takes any int64 priority; under its default (fcfs) it ignores it.
    for server in fleet["servers"]:
        assert server.complete("priority check", priority=5)["choices"]
    a = client(fleet, "a")
    seen: dict[str, list] = {"vllm0": [], "vllm1": []}
    for n in range(12):  # cold prompts spread over both replicas; stop once both have some
        result = a.completions.create(model=SERVED_MODEL_NAME, max_tokens=1,
                                      prompt=DOCUMENT.format(n=200 + n))
        assert result.choices
        decision = decisions(fleet, 1)[0]
        assert decision["outcome"] == "ok"
        seen[decision["replica"]].append(decision["priority"])
        if seen["vllm0"] and seen["vllm1"]:
            break
    assert seen["vllm0"] and seen["vllm1"], seen
    assert all(p is None for p in seen["vllm0"])
    # A deadline in milliseconds of the gateway's clock.
    assert all(isinstance(p, int) and p > 0 for p in seen["vllm1"])
