"""Cache identity and block hashing, as specifications."""

import hashlib
import pickle

import cbor2
import numpy as np
import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.hashing import (BlockHasher, mm_extra_keys,
                                              resolve_vllm_none_hash_seed, vllm_event_block_hash)
from prefixroute.core.identity.identity import (Adapter, CacheIdentity, MediaItem,
                                               derive_trust_group_salt)
from prefixroute.core.identity.xxh3_rows import chain_blocks, supports

TOKENS = list(range(100, 170))  # 70 tokens: 2 full blocks of 32, 6 left over


def sha256_pickle(obj):
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def test_vllm_sha256_first_block_is_hash_of_none_hash_tokens_and_none():
    none_hash = sha256_pickle("vllm-none-hash")
    expected = sha256_pickle((none_hash, tuple(TOKENS[:32]), None))
    assert BlockHasher("vllm", "sha256", 32).block_hashes(TOKENS)[0] == expected


def test_vllm_blocks_chain_on_the_parent_digest():
    first, second = BlockHasher("vllm", "sha256", 32).block_hashes(TOKENS)
    assert second == sha256_pickle((first, tuple(TOKENS[32:64]), None))


def test_only_full_blocks_get_a_hash():
    assert len(BlockHasher("vllm", "sha256", 32).block_hashes(TOKENS)) == 2
    assert BlockHasher("vllm", "sha256", 32).block_hashes(TOKENS[:31]) == []


def test_cache_salt_is_an_extra_key_of_the_first_block_only():
    hasher = BlockHasher("vllm", "sha256", 32)
    salted = hasher.block_hashes(TOKENS, CacheIdentity(cache_salt="s3cret"))
    none_hash = sha256_pickle("vllm-none-hash")
    assert salted[0] == sha256_pickle((none_hash, tuple(TOKENS[:32]),
                                       (("cache_salt", "s3cret"),)))
    assert salted[1] == sha256_pickle((salted[0], tuple(TOKENS[32:64]), None))


def test_lora_then_mm_then_salt_is_vllms_extra_key_order():
    hasher = BlockHasher("vllm", "sha256_cbor", 4)
    identity = CacheIdentity(cache_salt="s", adapter=Adapter("ad", "/p"))
    media = [MediaItem("img", 2, 3)]
    expected_extra = (("lora", "ad", "/p"), ("mm", "img", 2), ("cache_salt", "s"))
    assert hasher.extra_keys(0, identity, media) == expected_extra
    none_hash = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    digest = hashlib.sha256(cbor2.dumps((none_hash, (1, 2, 3, 4), expected_extra),
                                        canonical=True)).digest()
    assert hasher.block_hashes([1, 2, 3, 4], identity, media)[0] == digest


def test_mm_item_offset_is_relative_to_each_block_it_overlaps():
    item = MediaItem("img", 6, 12)  # tokens 6..17 with blocks of 8: blocks 0, 1 and 2
    assert mm_extra_keys(0, 8, [item]) == [("mm", "img", 6)]
    assert mm_extra_keys(8, 16, [item]) == [("mm", "img", -2)]
    assert mm_extra_keys(16, 24, [item]) == [("mm", "img", -10)]
    assert mm_extra_keys(24, 32, [item]) == []


def test_event_block_hash_is_low_64_bits_big_endian():
    digest = bytes(range(32))
    assert vllm_event_block_hash(digest) == int.from_bytes(bytes(range(24, 32)), "big")


def test_pythonhashseed_overrides_the_none_hash_seed():
    assert resolve_vllm_none_hash_seed("sha256", {}) == "vllm-none-hash"
    assert resolve_vllm_none_hash_seed("sha256", {"PYTHONHASHSEED": "7"}) == "7"
    seeded = BlockHasher("vllm", "sha256", 32, none_hash_seed="7").block_hashes(TOKENS)[0]
    assert seeded == sha256_pickle((sha256_pickle("7"), tuple(TOKENS[:32]), None))


def test_xxhash_without_a_known_seed_is_refused():
    with pytest.raises(ConfigError, match="PYTHONHASHSEED"):
        resolve_vllm_none_hash_seed("xxhash", {})


def test_xxhash_with_a_seed_is_xxh3_128_of_the_pickle():
    import xxhash
    hasher = BlockHasher("vllm", "xxhash", 4, none_hash_seed="0")
    none_hash = xxhash.xxh3_128_digest(pickle.dumps("0", protocol=5))
    expected = xxhash.xxh3_128_digest(pickle.dumps((none_hash, (1, 2, 3, 4), None), protocol=5))
    assert hasher.block_hashes([1, 2, 3, 4])[0] == expected


@pytest.mark.parametrize("kwargs", [{"profile": "md5"}, {"profile": "vllm", "algo": "md5"},
                                    {"block_size": 0}, {"block_size": -3},
                                    {"profile": "vllm", "memo_blocks": -1}])
def test_bad_hasher_settings_are_config_errors(kwargs):
    with pytest.raises(ConfigError):
        BlockHasher(**kwargs)


def test_native_extension_continues_the_chain():
    hasher = BlockHasher("native", block_size=16)
    tokens = list(range(64))
    whole = hasher.block_hashes(tokens)
    tail = hasher.block_hashes(tokens, parent=whole[1], start=32)
    assert tail == whole[2:]


@pytest.mark.parametrize("field,value", [
    ("model", "other"), ("model_revision", "r2"), ("tokenizer_revision", "t2"),
    ("chat_template_revision", "c2"), ("adapter", Adapter("x", "/y")),
    ("attention_config", "rope=yarn:4"), ("kv_dtype", "fp8"), ("kv_layout", "NHD"),
    ("cache_salt", "salt")])
def test_changing_any_identity_field_changes_every_native_block_key(field, value):
    hasher = BlockHasher("native", block_size=16)
    tokens = list(range(160))
    base = hasher.block_hashes(tokens, CacheIdentity())
    changed = hasher.block_hashes(tokens, CacheIdentity(**{field: value}))
    assert all(a != b for a, b in zip(base, changed))


def test_trust_group_salt_is_hmac_sha256_of_the_group_under_the_secret():
    import hmac
    secret = b"k" * 32
    expected = hmac.new(secret, b"prefixroute-salt/v1/acme", hashlib.sha256).hexdigest()
    assert derive_trust_group_salt(secret, "acme") == expected
    assert len(expected) == 64  # 256 bits
    assert derive_trust_group_salt(secret, "acme") != derive_trust_group_salt(secret, "acme2")


def test_short_server_secret_is_refused():
    with pytest.raises(ConfigError, match="256 bits"):
        derive_trust_group_salt(b"short", "acme")


def test_the_memo_gives_the_same_digests_and_hashes_only_new_blocks(monkeypatch):
    plain = BlockHasher("vllm", "sha256", 32)
    memo = BlockHasher("vllm", "sha256", 32, memo_blocks=4)
    salted = CacheIdentity(cache_salt="s")
    calls = []
    hash_fn = memo._hash_fn
    monkeypatch.setattr(memo, "_hash_fn", lambda key: calls.append(key) or hash_fn(key))
    shared = list(range(1000, 1096))  # 3 full blocks
    assert memo.block_hashes(shared + [1], salted) == plain.block_hashes(shared + [1], salted)
    assert len(calls) == 3
    # A new prompt on the same prefix: the three shared blocks come from the memo.
    longer = shared + list(range(32))
    assert memo.block_hashes(longer, salted) == plain.block_hashes(longer, salted)
    assert len(calls) == 4
    # Another salt is another chain: nothing shared, all hashed.
    assert memo.block_hashes(shared, CacheIdentity(cache_salt="t")) == \
        plain.block_hashes(shared, CacheIdentity(cache_salt="t"))
    assert len(calls) == 7
    # Bounded: at most two generations of memo_blocks entries.
    assert len(memo._memo_new) + len(memo._memo_old) <= 8


def test_block_major_hashing_supports_whole_16_byte_lanes_only():
    assert [b for b in range(1, 40) if supports(b)] == [8, 12, 16, 20, 24, 28, 32]
    with pytest.raises(ValueError):
        chain_blocks(np.zeros((1, 10, 2), dtype=np.uint32), np.zeros(2, dtype=np.uint64))
