"""The emulated replica replays the requests recorded from a real vLLM 0.32 server
(``tests/fixtures/vllm_0.32/requests.json``, block size 32, 65 blocks) and must report the same
cached tokens and publish the same KV events, field for field: the fidelity check that runs
without vLLM (the live one is ``tests/real_vllm/test_emulator_fidelity.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from prefixroute.core.replica.service_time import INSTANT
from prefixroute.edges.emulator.replica import EmulatedReplica, SequenceMeta

FIXTURE = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "vllm_0.32"
                      / "requests.json").read_text())


def _summary(event) -> dict:
    """The fields the recorder kept (scripts/record_vllm_fixtures.py ``summarize``)."""
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes)}
    assert isinstance(event, BlockStored)
    extra = None if event.extra_keys is None else [
        None if k is None else [list(x) if isinstance(x, tuple) else x for x in k]
        for k in event.extra_keys]
    return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash, "num_tokens": len(event.token_ids),
            "block_size": event.block_size, "extra_keys": extra, "lora_id": event.lora_id,
            "lora_name": event.lora_name, "medium": event.medium, "group_idx": event.group_idx,
            "kv_cache_spec_kind": event.kv_cache_spec_kind, "session_id": event.session_id}


def _expected(event: dict) -> dict:
    if event["type"] == "BlockRemoved":
        return {"type": "BlockRemoved", "block_hashes": event["block_hashes"]}
    out = {k: v for k, v in event.items() if k not in ("seq", "kv_cache_spec_sliding_window")}
    return out


def _replay():
    server = FIXTURE["server"]
    replica = EmulatedReplica(num_blocks=server["num_gpu_blocks_override"],
                              block_size=server["block_size"], service=INSTANT)
    results = []
    for n, record in enumerate(FIXTURE["requests"]):
        if record["kind"] == "reset":
            assert replica.reset_prefix_cache() is record["success"]
            results.append((record, None, []))
            continue
        extra = record["request_extra"] or {}
        meta = SequenceMeta(CacheIdentity(cache_salt=record["cache_salt"]),
                            session_id=extra.get("session_id"),
                            report_full=extra.get("vllm_xargs", {}).get(
                                "kv_cache_report_mode") == "full")
        replica.submit(n, record["prompt_token_ids"], [0], float(n), meta)
        engine_events = replica.advance(float(n))
        cached = [e.cached_tokens for e in engine_events if e.kind == "finished"]
        results.append((record, cached, replica.take_events()))
    return results


RESULTS = _replay()
IDS = [record["name"] for record, _, _ in RESULTS]


REQUEST_INDICES = [i for i, (record, _, _) in enumerate(RESULTS) if record["kind"] != "reset"]


@pytest.mark.parametrize("index", REQUEST_INDICES, ids=[IDS[i] for i in REQUEST_INDICES])
def test_cached_tokens_match_vllm(index):
    record, cached, _ = RESULTS[index]
    assert cached == [record["cached_tokens"]]


@pytest.mark.parametrize("index", range(len(RESULTS)), ids=IDS)
def test_kv_events_match_vllm(index):
    record, _, events = RESULTS[index]
    # vLLM publishes a reset's AllBlocksCleared with the next step's batch: the emulator's
    # event for the reset record is therefore compared with the next request's first event.
    ours = [_summary(e) for e in events]
    theirs = [_expected(e) for e in record["events"]]
    if index > 0 and RESULTS[index - 1][0]["kind"] == "reset":
        ours = [_summary(e) for e in RESULTS[index - 1][2]] + ours
    if record["kind"] == "reset":
        ours = []
    assert ours == theirs


def test_prefix_cache_counters_match_vllm():
    replica_queries = sum(r["prefix_cache_queries_delta"] for r in FIXTURE["requests"])
    replica_hits = sum(r["prefix_cache_hits_delta"] for r in FIXTURE["requests"])
    server = FIXTURE["server"]
    replica = EmulatedReplica(num_blocks=server["num_gpu_blocks_override"],
                              block_size=server["block_size"], service=INSTANT,
                              record_events=False)
    for n, record in enumerate(FIXTURE["requests"]):
        if record["kind"] == "reset":
            replica.reset_prefix_cache()
            continue
        replica.submit(n, record["prompt_token_ids"], [0], float(n),
                       SequenceMeta(CacheIdentity(cache_salt=record["cache_salt"])))
        replica.advance(float(n))
    stats = replica.pool.stats
    assert (stats.queried_tokens, stats.hit_tokens) == (replica_queries, replica_hits)
