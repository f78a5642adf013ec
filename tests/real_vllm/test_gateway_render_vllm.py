"""``tokenization: backend`` against a real vLLM 0.32 CPU replica (``--enable-scale-out``) with
KV events: a gateway with no tokenizer gets token ids from vLLM's render endpoints, and its
keys are the ids vLLM publishes, so its predicted cached tokens equal vLLM's reports, for
completions and chat alike. ``prefixroute doctor`` without ``--tokenizer`` finds the render
endpoints' ids equal to what the engine runs.

Run with ``PREFIXROUTE_VLLM_DIR=... pytest -m vllm tests/real_vllm/test_gateway_render_vllm.py``
(one vLLM server, under the suite's one-vLLM lock).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from prefixroute.edges.gateway.config import hash_api_key

from .vllm_server import (BLOCK_SIZE, SERVED_MODEL_NAME, VllmServer, free_port, install_problem,
                          running_gateway)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

SECRET = "vllm-render-test-secret-0123456789abcdef-0123456789"
KEYS = {"a": "sk-render-a", "ops": "sk-render-ops"}
DOCUMENT = ("Chapter {n}. A cache-aware router keeps requests that share a prefix on the "
            "replica that already holds its keys and values, and salts every prefix per trust "
            "group so tenants cannot probe each other. ") * 6


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    problem = install_problem()
    if problem:
        pytest.skip(problem)
    kv_port, replay_port = free_port(), free_port()
    directory = tmp_path_factory.mktemp("render-vllm")
    with VllmServer(kv_events_port=kv_port, replay_port=replay_port, topic="kv",
                    extra_args=("--enable-scale-out",)) as server:
        doctor = subprocess.run(
            [sys.executable, "-m", "prefixroute", "doctor", "--backend", server.url,
             "--json"], capture_output=True, text=True, timeout=600)
        config = {
            "server_secret": {"env": "PR_VLLM_RENDER_SECRET"},
            "tokenization": "backend",
            "hashing": {"block_size": BLOCK_SIZE, "algo": "sha256"},
            "backends": [{"name": "vllm0", "url": server.url, "models": [SERVED_MODEL_NAME],
                          "kv_events": {"endpoint": f"tcp://127.0.0.1:{kv_port}",
                                        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
                                        "topic": "kv"}}],
            "tenants": [
                {"name": "a", "api_key_sha256": hash_api_key(KEYS["a"])},
                {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
            ],
            "timeouts": {"read_s": 300, "render_s": 30},  # a loaded CPU box renders slowly
        }
        path = directory / "gateway.yaml"
        path.write_text(json.dumps(config, indent=2))
        with running_gateway(path, directory / "gateway.log",
                             {"PR_VLLM_RENDER_SECRET": SECRET}) as url:
            yield {"url": url, "doctor": doctor, "log": directory / "gateway.log"}


def client(fleet) -> openai.OpenAI:
    return openai.OpenAI(base_url=fleet["url"] + "/v1", api_key=KEYS["a"], max_retries=0,
                         timeout=300)


def decisions(fleet, n: int) -> list[dict]:
    response = httpx.get(fleet["url"] + f"/debug/decisions?n={n}",
                         headers={"authorization": f"Bearer {KEYS['ops']}"}, timeout=10)
    response.raise_for_status()
    return list(reversed(response.json()["decisions"]))


def cached(result) -> int:
    details = result.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def settle() -> None:
    time.sleep(1.0)  # vLLM publishes BlockStored with the step after the answer


def test_doctor_without_a_tokenizer_finds_the_render_ids_are_the_engines(fleet):
    doctor = fleet["doctor"]
    checks = {c["name"]: c for c in json.loads(doctor.stdout)["checks"]}
    assert checks["render_completion"]["status"] == "ok", checks["render_completion"]
    assert checks["render_chat"]["status"] == "ok", checks["render_chat"]


def test_render_keys_are_vllms_event_ids_for_completions(fleet):
    text = DOCUMENT.format(n=1)
    reported = []
    for suffix in ("", " One more sentence here.", " And another, longer one, to extend it."):
        result = client(fleet).completions.create(model=SERVED_MODEL_NAME, prompt=text + suffix,
                                                  max_tokens=2, temperature=0)
        reported.append(cached(result))
        settle()
    made = decisions(fleet, 3)
    assert [d["tokenization"] for d in made] == ["backend"] * 3, made
    assert reported[0] == 0 and reported[1] > 0
    assert [d["predicted_cached_tokens"] for d in made] == reported


def test_render_keys_are_vllms_event_ids_for_chat(fleet):
    messages = [{"role": "system", "content": DOCUMENT.format(n=2)},
                {"role": "user", "content": "Summarise the chapter."}]
    reported = []
    for turn in range(3):
        result = client(fleet).chat.completions.create(model=SERVED_MODEL_NAME,
                                                       messages=messages, max_tokens=3,
                                                       temperature=0)
        reported.append(cached(result))
        messages += [{"role": "assistant", "content": result.choices[0].message.content or ""},
                     {"role": "user", "content": f"And point {turn + 2}?"}]
        settle()
    made = decisions(fleet, 3)
    assert [d["tokenization"] for d in made] == ["backend"] * 3, made
    assert reported[0] == 0 and reported[2] > 0
    assert [d["predicted_cached_tokens"] for d in made] == reported
    assert "render_failed" not in Path(fleet["log"]).read_text()
