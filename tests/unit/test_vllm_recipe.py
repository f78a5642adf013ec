"""docs/real-vllm.md, examples/gateway-vllm.yaml and the real-vLLM suite's engines say the same
thing: the replica commands on the page are the recipe module's, and the example gateway
configuration agrees with them flag for flag."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import yaml

from prefixroute.edges.gateway import vllm_recipe
from prefixroute.edges.gateway.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "real-vllm.md"
EXAMPLE = ROOT / "examples" / "gateway-vllm.yaml"


def doc_commands(program: str) -> list[list[str]]:
    """Shell commands in the page's code blocks that start with ``program``, as argv lists
    (backslash continuations joined)."""
    text = DOC.read_text().replace("\\\n", " ")
    return [shlex.split(line) for line in text.splitlines()
            if line.startswith(program + " ")]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_page_shows_the_recipes_replica_commands():
    commands = doc_commands("vllm serve")
    assert len(commands) == 2
    for argv in commands:
        events = json.loads(option(argv, "--kv-events-config"))
        expected = vllm_recipe.serve_command(
            "./model", served_model_name="tiny", port=int(option(argv, "--port")),
            kv_events_endpoint=events["endpoint"], replay_endpoint=events["replay_endpoint"],
            topic=events["topic"])
        assert argv == expected


def test_the_example_gateway_config_matches_the_replica_commands(tmp_path, tiny_tokenizer_dir,
                                                                 monkeypatch):
    monkeypatch.setenv("PREFIXROUTE_SERVER_SECRET", "5e" * 32)
    (tmp_path / "model").symlink_to(tiny_tokenizer_dir)  # the example's ./model
    config = parse_config(yaml.safe_load(EXAMPLE.read_text()), str(EXAMPLE), tmp_path)
    assert config.hashing.block_size == vllm_recipe.RECIPE_BLOCK_SIZE
    assert config.hashing.algo == vllm_recipe.RECIPE_HASH_ALGO
    assert config.hashing.none_hash_seed is None  # the page leaves PYTHONHASHSEED unset
    commands = doc_commands("vllm serve")
    assert len(config.backends) == len(commands)
    for backend, argv in zip(config.backends, commands):
        assert backend.url == f"http://{option(argv, '--host')}:{option(argv, '--port')}"
        assert backend.models == (option(argv, "--served-model-name"),)
        assert option(argv, "--block-size") == str(config.hashing.block_size)
        assert option(argv, "--prefix-caching-hash-algo") == config.hashing.algo
        events = json.loads(option(argv, "--kv-events-config"))
        assert backend.kv_events is not None and backend.kv_events.bind
        assert (backend.kv_events.endpoint, backend.kv_events.replay_endpoint,
                backend.kv_events.topic) == (events["endpoint"], events["replay_endpoint"],
                                             events["topic"])


@pytest.mark.parametrize("index", [0, 1])
def test_the_pages_doctor_commands_check_what_the_gateway_uses(index):
    doctor = doc_commands("prefixroute doctor")[index]
    replica = doc_commands("vllm serve")[index]
    assert option(doctor, "--backend").endswith(":" + option(replica, "--port"))
    assert option(doctor, "--block-size") == option(replica, "--block-size")
    assert option(doctor, "--hash-algo") == option(replica, "--prefix-caching-hash-algo")
    events = json.loads(option(replica, "--kv-events-config"))
    assert option(doctor, "--kv-events") == events["endpoint"]
    assert option(doctor, "--kv-topic") == events["topic"]
