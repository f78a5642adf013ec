"""Cache identity: which requests may share KV state.

A prefix hit is only sound between requests whose KV values would be bit-identical and whose
callers may see each other's timing (docs/concepts.md, "Block keys and the
compatibility key"). :class:`CacheIdentity` binds everything
that changes either: model and its revision, tokenizer and chat-template revisions, the adapter,
attention and position configuration, KV dtype and layout, and the trust-group salt.
Multimodal media identities are per request and enter per block (see ``hashing``).

Trust-group salts are derived, never accepted from callers: ``HMAC-SHA256(server_secret,
trust_group)``, 256 bits, hex. A caller who knows a tenant's name cannot compute its salt.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import astuple, dataclass, replace

from prefixroute.core.errors import ConfigError

MIN_SECRET_BYTES = 32  # a 256-bit server secret, the HMAC-SHA256 key size


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter as vLLM names it: ``LoRARequest(lora_name, lora_int_id, lora_path)``."""

    name: str
    path: str = ""


@dataclass(frozen=True, slots=True)
class MediaItem:
    """A multimodal item: its identity (content hash or assigned id), first placeholder position
    in the prompt, and length in tokens. vLLM keys cached blocks by ``identifier`` and the offset
    of the item relative to each block it overlaps."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.length < 1:
            raise ConfigError(f"multimodal item {self.identifier!r}: offset must be >= 0 and "
                              f"length >= 1, got offset={self.offset} length={self.length}")


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """Everything besides the tokens that decides whether two requests may share KV.

    Engine-scoped fields (model, revisions, attention, KV dtype/layout) are fixed for one engine
    process, which is why vLLM's own block hash leaves them out; they matter when a router or a
    shared cache sees several engines. The ``native`` hashing profile binds all of them into
    every block key; the ``vllm`` profile reproduces the engine's hash exactly (adapter and salt
    only) and relies on one engine serving one model.
    """

    model: str = ""
    model_revision: str = ""
    tokenizer_revision: str = ""
    chat_template_revision: str = ""
    adapter: Adapter | None = None
    attention_config: str = ""  # RoPE scaling, sliding window, mask type: any canonical string
    kv_dtype: str = "auto"
    kv_layout: str = ""
    cache_salt: str | None = None

    def with_salt(self, cache_salt: str | None) -> "CacheIdentity":
        return replace(self, cache_salt=cache_salt)

    def with_adapter(self, adapter: Adapter | None) -> "CacheIdentity":
        return replace(self, adapter=adapter)

    def digest(self) -> bytes:
        """A 32-byte digest of every field; equal identities give equal digests."""
        fields = astuple(self)
        parts = []
        for value in fields:
            if value is None:
                parts.append("\x00none")
            elif isinstance(value, tuple):  # the adapter
                parts.append("\x00adapter\x00" + "\x00".join(value))
            else:
                parts.append("\x00str\x00" + value)
        return hashlib.sha256("\x1f".join(parts).encode()).digest()


DEFAULT_IDENTITY = CacheIdentity()


def derive_trust_group_salt(server_secret: bytes, trust_group: str) -> str:
    """The cache salt of a trust group: HMAC-SHA256(server_secret, "prefixroute-salt/v1/" + group).

    The secret must hold at least 256 bits; the output is 64 hex characters (256 bits), far past
    guessing. Only the gateway (which holds the secret) can produce it, so a caller cannot
    forge another group's salt from its public name.
    """
    if len(server_secret) < MIN_SECRET_BYTES:
        raise ConfigError(f"server secret must be at least {MIN_SECRET_BYTES} bytes "
                          f"(256 bits), got {len(server_secret)}")
    if not trust_group:
        raise ConfigError("trust group name must not be empty")
    mac = hmac.new(server_secret, b"prefixroute-salt/v1/" + trust_group.encode(), hashlib.sha256)
    return mac.hexdigest()


__all__ = ["Adapter", "MediaItem", "CacheIdentity", "DEFAULT_IDENTITY",
           "derive_trust_group_salt"]
