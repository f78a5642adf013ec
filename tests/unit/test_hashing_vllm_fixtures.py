"""Our ``vllm`` hashing profile reproduces every block hash real vLLM 0.32 published.

Fixtures: tests/fixtures/vllm_0.32, recorded by scripts/record_vllm_fixtures.py from a real
vLLM 0.32 CPU server (block size 32, sha256, PYTHONHASHSEED unset). Each request lists the
prompt token ids the engine reported and the KV events it caused; the raw frames carry the
token ids of every stored block.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from prefixroute.core.identity.hashing import BlockHasher, vllm_event_block_hash
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.kvevents import BlockStored, decode_event_batch

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_0.32"
REQUESTS = json.loads((FIXTURES / "requests.json").read_text())["requests"]
BY_NAME = {r["name"]: r for r in REQUESTS}
PAYLOADS = {f["seq"]: base64.b64decode(f["payload_b64"])
            for f in json.loads((FIXTURES / "frames.json").read_text())["frames"]}
BLOCK = 32
HASHER = BlockHasher("vllm", "sha256", BLOCK)

STORING = [r for r in REQUESTS if any(e["type"] == "BlockStored" for e in r["events"])]


def predicted_event_ids(request: dict) -> list[int]:
    digests = HASHER.block_hashes(request["prompt_token_ids"],
                                  CacheIdentity(cache_salt=request["cache_salt"]))
    return [vllm_event_block_hash(d) for d in digests]


def stored_events(request: dict) -> list[BlockStored]:
    """The BlockStored events of ``request``, decoded from the raw frames."""
    out = []
    for seq in sorted({e["seq"] for e in request["events"]}):
        out += [e for e in decode_event_batch(PAYLOADS[seq]).events
                if isinstance(e, BlockStored)]
    return out


def first_block_index(event: BlockStored, predicted: list[int]) -> int:
    """Where the event's run starts in the prompt: right after its parent, or at block 0."""
    if event.parent_block_hash is None:
        return 0
    return predicted.index(event.parent_block_hash) + 1


def test_fixtures_cover_plain_salted_multi_block_text_and_hits():
    names = {r["name"] for r in STORING}
    assert {"plain_100", "salted_a_100", "salted_b_100", "plain_300_extends_100",
            "text_plain", "text_salted", "full_report_300"} <= names
    assert BY_NAME["plain_100_repeat"]["cached_tokens"] == 96


@pytest.mark.parametrize("request_", STORING, ids=lambda r: r["name"])
def test_vllm_profile_reproduces_every_published_block_hash(request_):
    predicted = predicted_event_ids(request_)
    events = stored_events(request_)
    assert events
    for event in events:
        start = first_block_index(event, predicted)
        assert list(event.block_hashes) == predicted[start:start + len(event.block_hashes)]


@pytest.mark.parametrize("request_", STORING, ids=lambda r: r["name"])
def test_each_stored_run_carries_the_tokens_of_its_blocks(request_):
    predicted = predicted_event_ids(request_)
    prompt = request_["prompt_token_ids"]
    for event in stored_events(request_):
        start = first_block_index(event, predicted)
        assert event.block_size == BLOCK
        assert list(event.token_ids) == prompt[start * BLOCK:(start + len(event.block_hashes))
                                               * BLOCK]


def test_parent_block_hash_chains_an_extension_onto_the_cached_prefix():
    # 300 tokens extending the cached 100: blocks 0..2 hit, 3..8 are stored with parent = 2.
    predicted = predicted_event_ids(BY_NAME["plain_300_extends_100"])
    (event,) = stored_events(BY_NAME["plain_300_extends_100"])
    assert event.parent_block_hash == predicted[2]
    assert list(event.block_hashes) == predicted[3:9]
    assert predicted[:3] == predicted_event_ids(BY_NAME["plain_100"])


def test_a_block_aligned_repeat_stores_its_last_block_again():
    # 64 tokens: the last token is recomputed, so block 1 is recomputed and re-published.
    predicted = predicted_event_ids(BY_NAME["aligned_64"])
    (event,) = stored_events(BY_NAME["aligned_64_repeat"])
    assert event.parent_block_hash == predicted[0]
    assert list(event.block_hashes) == [predicted[1]]


def test_full_report_mode_republishes_the_hit_blocks_from_the_root():
    predicted = predicted_event_ids(BY_NAME["full_report_300"])
    (event,) = stored_events(BY_NAME["full_report_300"])
    assert event.parent_block_hash is None
    assert list(event.block_hashes) == predicted[:9]  # floor(299 / 32) = 9 hit blocks


def test_salt_changes_every_block_and_is_published_on_the_first_block_only():
    plain = predicted_event_ids(BY_NAME["plain_100"])
    salted_a = predicted_event_ids(BY_NAME["salted_a_100"])
    salted_b = predicted_event_ids(BY_NAME["salted_b_100"])
    assert len({*plain, *salted_a, *salted_b}) == 9  # 3 blocks x 3 identities, no overlap
    (event,) = stored_events(BY_NAME["salted_a_100"])
    assert event.extra_keys == (("tenant-a-salt",), None, None)
    (event,) = stored_events(BY_NAME["plain_100"])
    assert event.extra_keys == (None, None, None)


def test_event_id_is_the_low_64_bits_of_the_sha256_digest():
    request = BY_NAME["plain_100"]
    digests = HASHER.block_hashes(request["prompt_token_ids"])
    (event,) = stored_events(request)
    assert list(event.block_hashes) == [int.from_bytes(d[-8:], "big") for d in digests]
    assert list(event.block_hashes) != [int.from_bytes(d[:8], "big") for d in digests]


def test_text_prompts_are_hashed_over_the_engine_tokens_bos_included():
    request = BY_NAME["text_plain"]
    assert request["prompt_token_ids"][0] == 0  # <|bos|> of the tiny tokenizer
    assert request["rendered_token_ids_match"] is True
    assert len(predicted_event_ids(request)) == request["prompt_tokens"] // BLOCK


@pytest.mark.parametrize("name, cached", [("plain_100_repeat", 96),
                                          ("salted_a_100_repeat", 96),
                                          ("plain_300_extends_100", 96),
                                          ("aligned_64_repeat", 32),
                                          ("full_report_300", 288),
                                          ("salted_b_100", 0),
                                          ("plain_100_after_reset", 0)])
def test_cached_tokens_follow_the_last_token_rule(name, cached):
    request = BY_NAME[name]
    assert request["cached_tokens"] == cached
    assert request["prefix_cache_hits_delta"] == cached
    assert request["prefix_cache_queries_delta"] == request["prompt_tokens"]


def test_eviction_removes_the_least_recently_freed_chain_tail_first():
    removed = [e["block_hashes"][0] for e in BY_NAME["evict_4"]["events"]
               if e["type"] == "BlockRemoved"]
    after_reset = predicted_event_ids(BY_NAME["plain_100_after_reset"])
    evict_1 = predicted_event_ids(BY_NAME["evict_1"])
    # 64 usable blocks hold 3 + 3 x 18 cached blocks; evict_4 needs 19 and 7 free blocks hold
    # no hash, so 12 go: the oldest freed request first, each chain from its tail (vLLM frees
    # a finished request's blocks in reverse order and evicts from the free queue's head).
    assert removed == after_reset[::-1] + evict_1[17:8:-1]


def test_reset_is_published_with_the_next_step():
    assert BY_NAME["reset_prefix_cache"]["events"] == []
    assert BY_NAME["plain_100_after_reset"]["events"][0]["type"] == "AllBlocksCleared"
