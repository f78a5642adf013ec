"""The emulator's settings, with every default and where its number comes from."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
from prefixroute.core.replica.service_time import DEFAULT_PROFILE, ServiceTimeModel
from prefixroute.edges.profiles import load_model_config
from prefixroute.edges.emulator.tokens import DEFAULT_MM_ITEM_TOKENS

DEFAULT_BLOCK_SIZE = 16  # vLLM's default --block-size on GPUs
DEFAULT_SERVED_MODEL_NAME = "emulated"
DEFAULT_MAX_MODEL_LEN = 8192  # capped by the KV capacity; vLLM takes the model's own limit
DEFAULT_KV_EVENTS_TOPIC = ""  # vLLM KVEventsConfig.topic default
GIB = 1 << 30


@dataclass(slots=True)
class EmulatorConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None       # physical blocks, block 0 reserved (vLLM's count)
    kv_memory_gib: float | None = None  # with model_config: KV memory -> blocks
    model_config: str | None = None     # a preset name or a JSON/YAML/HF config.json file
    profile: str = DEFAULT_PROFILE      # a preset name or a profile JSON/YAML file
    time_scale: float = 1.0
    tokenizer: str | None = None
    kv_events: str | None = None
    kv_events_format: str = "tagged"    # or "legacy" (positional arrays)
    kv_events_topic: str = DEFAULT_KV_EVENTS_TOPIC
    kv_events_replay: str | None = None
    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    max_model_len: int | None = None
    lora_modules: list[tuple[str, str]] = field(default_factory=list)
    seed: int = 0
    mm_item_tokens: int = DEFAULT_MM_ITEM_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    scheduling_policy: str = "fcfs"     # vllm serve --scheduling-policy: fcfs or priority
    hash_algo: str = "sha256"           # vLLM's default --prefix-caching-hash-algo


def served_model_config(config: EmulatorConfig) -> dict | None:
    """The served model's ``config.json`` (in the ``--tokenizer`` directory, the model
    directory vLLM would serve), or None without one: vLLM derives a few reported settings
    from it (see :func:`prefixroute.edges.emulator.metrics.mamba_ssm_cache_dtype`)."""
    if config.tokenizer is None:
        return None
    path = Path(config.tokenizer) / "config.json"
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read the model's config.json: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the model's config.json is not a JSON object")
    return data


def resolve_num_blocks(config: EmulatorConfig, profile: ServiceTimeModel) -> tuple[int, str]:
    """Physical blocks and how they were chosen: ``--num-blocks``; else ``--kv-memory-gib``
    with ``--model-config`` (bytes per token = 2 x layers x kv heads x head dim x dtype bytes);
    else the profile's own KV memory and model (e.g. 50 GiB of Llama-3-8B KV)."""
    if config.num_blocks is not None:
        if config.kv_memory_gib is not None:
            raise ConfigError("give either --num-blocks or --kv-memory-gib, not both")
        if config.num_blocks < 2:
            raise ConfigError(f"--num-blocks must be at least 2 (block 0 is reserved), got "
                              f"{config.num_blocks}")
        return config.num_blocks, "--num-blocks"
    if config.kv_memory_gib is not None:
        if config.model_config is None:
            raise ConfigError("--kv-memory-gib needs --model-config (a preset name or a "
                              "config.json) to convert memory to blocks")
        model = load_model_config(config.model_config)
        source = f"{config.kv_memory_gib:g} GiB of {model.name} KV"
        memory = config.kv_memory_gib
    else:
        model = load_model_config(config.model_config or profile.model)
        memory = profile.kv_memory_gib
        source = f"profile {profile.name}: {memory:g} GiB of {model.name} KV"
    blocks = model.blocks_for_memory(memory * GIB, config.block_size)
    if blocks < 2:
        raise ConfigError(f"{source} holds {blocks} block(s) of {config.block_size} tokens; "
                          "need at least 2")
    return blocks, source


def resolve_max_model_len(config: EmulatorConfig, num_blocks: int) -> int:
    """The context limit: ``--max-model-len``, else 8192 capped by the KV capacity. Like vLLM,
    refuse a limit one sequence could not fit in (``(num_blocks - 1) * block_size``)."""
    capacity = (num_blocks - 1) * config.block_size
    if config.max_model_len is None:
        return min(DEFAULT_MAX_MODEL_LEN, capacity)
    if config.max_model_len < 1:
        raise ConfigError(f"--max-model-len must be positive, got {config.max_model_len}")
    if config.max_model_len > capacity:
        raise ConfigError(f"--max-model-len {config.max_model_len} does not fit in the KV cache:"
                          f" {num_blocks - 1} usable blocks of {config.block_size} tokens hold "
                          f"{capacity} (vLLM refuses to start the same way)")
    return config.max_model_len
