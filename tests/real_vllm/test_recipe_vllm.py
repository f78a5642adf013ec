"""docs/real-vllm.md as a user follows it: two real vLLM 0.32 CPU replicas started with exactly
the documented flags (``VllmServer`` builds its command from
``prefixroute.edges.gateway.vllm_recipe``, which tests/unit/test_vllm_recipe.py holds the page
to), ``prefixroute doctor`` on each with the page's options, then examples/gateway-vllm.yaml in
front of them (only addresses and the model path replaced by this machine's), and the page's
tenant-isolation check through the gateway.

Run with ``pytest -m vllm tests/real_vllm/test_recipe_vllm.py`` (a few minutes: vLLM startup).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from prefixroute.core.identity.identity import derive_trust_group_salt

from .vllm_server import (BLOCK_SIZE, SERVED_MODEL_NAME, free_port, install_problem,
                          running_gateway, start_vllm_pair, vllm_install_dir)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1500)]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gateway-vllm.yaml"
SECRET = "ab" * 32  # 64 hex digits: a 32-byte key
KEYS = {"acme": "sk-acme-example-key", "globex": "sk-globex-example-key"}  # the example's
DOCUMENT = "Prefix caching keeps the keys and values of a prompt's leading tokens. " * 20


def localized_example(directory: Path, servers, kv_ports, replay_ports) -> Path:
    """examples/gateway-vllm.yaml with this run's addresses and model directory."""
    config = yaml.safe_load(EXAMPLE.read_text())
    config["tokenizer"] = str(vllm_install_dir() / "model")
    for backend, server, kv_port, replay_port in zip(config["backends"], servers, kv_ports,
                                                    replay_ports):
        backend["url"] = server.url
        backend["kv_events"]["endpoint"] = f"tcp://127.0.0.1:{kv_port}"
        backend["kv_events"]["replay_endpoint"] = f"tcp://127.0.0.1:{replay_port}"
    path = directory / "gateway-vllm.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    problem = install_problem()
    if problem:
        pytest.skip(problem)
    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["hashing"]["block_size"] == BLOCK_SIZE
    kv_ports = [free_port(), free_port()]
    replay_ports = [free_port(), free_port()]
    servers = start_vllm_pair(kv_ports, replay_ports)  # the documented flags, nothing more
    try:
        doctors = []
        for server, kv_port in zip(servers, kv_ports):  # before the gateway binds the ports
            doctors.append(subprocess.run(
                [sys.executable, "-m", "prefixroute", "doctor", "--backend", server.url,
                 "--tokenizer", str(vllm_install_dir() / "model"),
                 "--block-size", str(example["hashing"]["block_size"]),
                 "--hash-algo", example["hashing"]["algo"],
                 "--kv-events", f"tcp://127.0.0.1:{kv_port}",
                 "--kv-topic", example["backends"][0]["kv_events"]["topic"], "--json"],
                capture_output=True, text=True, timeout=600))
        directory = tmp_path_factory.mktemp("recipe")
        config = localized_example(directory, servers, kv_ports, replay_ports)
        with running_gateway(config, directory / "gateway.log",
                             {"PREFIXROUTE_SERVER_SECRET": SECRET}) as url:
            yield {"servers": servers, "url": url, "doctors": doctors}
    finally:
        for server in reversed(servers):
            server.stop()


@pytest.mark.parametrize("replica", [0, 1])
def test_doctor_passes_each_documented_replica(recipe, replica):
    doctor = recipe["doctors"][replica]
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    checks = {c["name"]: c["status"] for c in json.loads(doctor.stdout)["checks"]}
    for name in ("engine_config", "cached_tokens", "prefix_hit", "salt_isolation", "kv_events",
                 "tokenize_completion", "tokenize_chat"):
        assert checks[name] == "ok", (name, doctor.stdout)


def test_the_documented_gateway_keeps_tenants_apart(recipe):
    # acme's prefix on both replicas under acme's secret salt, so globex's request meets it
    # wherever the policy sends it; it must hit nothing, while acme's own repeat hits.
    salt = derive_trust_group_salt(SECRET.encode(), "acme")
    for server in recipe["servers"]:
        server.complete(DOCUMENT, cache_salt=salt)

    def send(tenant: str):
        client = openai.OpenAI(base_url=recipe["url"] + "/v1", api_key=KEYS[tenant],
                               max_retries=0, timeout=300)
        return client.completions.create(model=SERVED_MODEL_NAME, prompt=DOCUMENT,
                                         max_tokens=1, temperature=0)

    globex = send("globex")
    assert globex.usage.prompt_tokens_details.cached_tokens == 0
    acme = send("acme")
    n = acme.usage.prompt_tokens
    assert acme.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert n > 2 * BLOCK_SIZE
    health = httpx.get(recipe["url"] + "/health", timeout=10)
    assert health.status_code == 200
