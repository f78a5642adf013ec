"""How to start a vLLM 0.32 replica so that the gateway's keys are the engine's: the one
definition the documentation (docs/real-vllm.md), the example configuration
(examples/gateway-vllm.yaml) and the real-vLLM test suite all use.

Each flag, and what breaks without it:

``--enable-prefix-caching``
    the engine keeps and reuses prompt blocks at all (the default on GPUs in vLLM 0.32; said
    explicitly because the CPU build and older releases differ).
``--block-size B``
    the gateway hashes blocks of exactly ``hashing.block_size`` tokens; a different size gives
    different keys for every block. vLLM's CPU backend needs a multiple of 32 (GPUs default
    to 16).
``--prefix-caching-hash-algo A``
    the gateway's ``hashing.algo`` (vLLM's default ``sha256``). The ``xxhash`` variants seed
    themselves randomly per process unless the engine runs with ``PYTHONHASHSEED`` (then give
    the gateway ``hashing.none_hash_seed``); the ``sha256`` ones need nothing, as long as
    ``PYTHONHASHSEED`` is unset or also given to the gateway.
``--enable-prompt-tokens-details``
    responses carry ``usage.prompt_tokens_details.cached_tokens``: what the gateway corrects its
    view of each replica with, and what ``prefixroute doctor`` measures the hit with.
``--kv-events-config JSON``
    the engine publishes ``BlockStored``/``BlockRemoved`` over ZeroMQ, so the gateway's view
    follows evictions instead of guessing; with a concrete ``tcp://host:port`` endpoint vLLM
    connects and the gateway binds, and the replay endpoint (bound by vLLM) fills gaps.

Every request's ``cache_salt`` is set by the gateway; vLLM honours the field without a flag.
"""

from __future__ import annotations

import json
import shlex
from typing import Sequence

RECIPE_BLOCK_SIZE = 32  # the smallest size vLLM's CPU backend accepts; GPUs may use 16
RECIPE_HASH_ALGO = "sha256"  # vLLM 0.32's default --prefix-caching-hash-algo
RECIPE_TOPIC = "kv"


def kv_events_config(endpoint: str, replay_endpoint: str | None,
                     topic: str = RECIPE_TOPIC) -> str:
    """The ``--kv-events-config`` JSON for a replica publishing on ``endpoint``."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint,
              "replay_endpoint": replay_endpoint, "topic": topic}
    if replay_endpoint is None:
        del config["replay_endpoint"]
    return json.dumps(config, separators=(",", ":"))


def serve_flags(*, block_size: int = RECIPE_BLOCK_SIZE, hash_algo: str = RECIPE_HASH_ALGO,
                kv_events_endpoint: str | None = None, replay_endpoint: str | None = None,
                topic: str = RECIPE_TOPIC) -> list[str]:
    """The flags above, in the documented order (without KV events when no endpoint)."""
    flags = ["--enable-prefix-caching", "--block-size", str(block_size),
             "--prefix-caching-hash-algo", hash_algo, "--enable-prompt-tokens-details"]
    if kv_events_endpoint is not None:
        flags += ["--kv-events-config", kv_events_config(kv_events_endpoint, replay_endpoint,
                                                         topic)]
    return flags


def serve_command(model: str, *, served_model_name: str, port: int, host: str = "127.0.0.1",
                  vllm: str = "vllm", **flags) -> list[str]:
    """A whole ``vllm serve`` command line: the model and its address, then
    :func:`serve_flags` (``flags`` are its keyword arguments)."""
    return [vllm, "serve", model, "--served-model-name", served_model_name, "--host", host,
            "--port", str(port), *serve_flags(**flags)]


def shell_line(command: Sequence[str]) -> str:
    """``command`` as one shell line (single quotes where needed), as the docs print it."""
    return " ".join(shlex.quote(part) for part in command)
