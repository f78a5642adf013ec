"""Model shapes that decide how much memory a token of KV takes.

bytes per token = 2 (K and V) x layers x kv_heads x head_dim x dtype bytes (docs/concepts.md,
"KV memory"); an FP8 KV cache (1 byte) halves a BF16 one (2 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixroute.core.errors import ConfigError

DTYPE_BYTES = {"fp32": 4, "float32": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2,
               "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: str = "bf16"

    def __post_init__(self) -> None:
        for field_name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field_name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model config {self.name!r}: {field_name} must be a "
                                  f"positive integer, got {value!r}")
        if self.kv_dtype not in DTYPE_BYTES:
            raise ConfigError(f"model config {self.name!r}: unknown kv_dtype {self.kv_dtype!r}; "
                              f"choose one of {', '.join(sorted(DTYPE_BYTES))}")

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.kv_dtype]

    def blocks_for_memory(self, memory_bytes: float, block_size: int) -> int:
        """How many ``block_size``-token blocks of KV fit in ``memory_bytes``."""
        if memory_bytes < 0:
            raise ConfigError(f"KV memory must not be negative, got {memory_bytes}")
        return int(memory_bytes // (self.kv_bytes_per_token * block_size))

    @classmethod
    def from_dict(cls, data: dict, where: str = "model config") -> "ModelConfig":
        """Accepts our field names or a Hugging Face ``config.json``'s."""
        try:
            layers = data.get("num_layers", data.get("num_hidden_layers"))
            heads = data.get("num_attention_heads")
            kv_heads = data.get("num_kv_heads", data.get("num_key_value_heads", heads))
            head_dim = data.get("head_dim")
            if head_dim is None and heads and data.get("hidden_size"):
                head_dim = data["hidden_size"] // heads
            dtype = data.get("kv_dtype", data.get("torch_dtype", "bf16"))
            return cls(name=str(data.get("name", data.get("_name_or_path", "model"))),
                       num_layers=layers, num_kv_heads=kv_heads, head_dim=head_dim,
                       kv_dtype=str(dtype))
        except AttributeError:
            raise ConfigError(f"{where}: expected a JSON/YAML mapping") from None


# Published architectures (Hugging Face config.json of each model).
MODEL_PRESETS: dict[str, ModelConfig] = {
    # meta-llama/Meta-Llama-3-8B: 32 layers, 8 KV heads (GQA), head_dim 128 -> 128 KiB/token
    "llama-3-8b": ModelConfig("llama-3-8b", 32, 8, 128, "bf16"),
    # meta-llama/Meta-Llama-3-70B: 80 layers, 8 KV heads, head_dim 128 -> 320 KiB/token
    "llama-3-70b": ModelConfig("llama-3-70b", 80, 8, 128, "bf16"),
    # Qwen/Qwen2.5-7B-Instruct: 28 layers, 4 KV heads, head_dim 128 -> 56 KiB/token
    "qwen2.5-7b": ModelConfig("qwen2.5-7b", 28, 4, 128, "bf16"),
    # the tiny local test model (scripts/make_tiny_model.py): 2 layers, 2 KV heads, dim 32
    "tiny": ModelConfig("tiny", 2, 2, 32, "bf16"),
}
