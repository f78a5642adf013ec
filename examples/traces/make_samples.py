"""Write the two small sample traces of this folder from prefixroute's own generators.

    python examples/traces/make_samples.py

``sample.jsonl``: prefixroute's native format, 240 turns of 40 concurrent six-turn chats
behind one 400-token system prompt (the ``conversations`` workload, seed 0), as chained
``hash_ids`` of 64-token blocks with tenant and session. ``mooncake_sample.jsonl``: the
``hot-burst`` workload (8 prefix families, bursts of one hot prefix) in the Mooncake FAST'25
layout: ``timestamp`` in ms, ``input_length``, ``output_length`` and ids of 512-token blocks,
the last one partial. Both are generated (no recorded traffic) and deterministic; they exist
so that every example in the docs runs from a fresh clone. For real traffic see
docs/trace-format.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from prefixroute.core.simulator.generators import make_workload

HERE = Path(__file__).resolve().parent


def chained_ids(token_ids, block_size: int, ids: dict, *, partial_last: bool) -> list[int]:
    """One id per block; equal ids at a position mean equal prompts up to that block's end
    (the prefix-chaining rule of both formats). ``ids`` numbers distinct prefixes globally."""
    out = []
    parent = -1
    end = len(token_ids) if partial_last else len(token_ids) - len(token_ids) % block_size
    for start in range(0, end, block_size):
        key = (parent, tuple(token_ids[start:start + block_size]))
        parent = ids.setdefault(key, len(ids))
        out.append(parent)
    return out


def write_native(path: Path) -> int:
    block_size = 64
    ids: dict = {}
    lines = [json.dumps({"prefixroute_trace": 1, "block_size": block_size})]
    for request in make_workload("conversations", {}, seed=0):
        lines.append(json.dumps({
            "request_id": request.request_id, "arrival_s": round(request.arrival_s, 3),
            "input_tokens": request.input_tokens, "output_tokens": request.output_tokens,
            "hash_ids": chained_ids(request.token_ids, block_size, ids, partial_last=False),
            "tenant": request.tenant, "session": request.session, "turn": request.turn}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines) - 1


def write_mooncake(path: Path) -> int:
    ids: dict = {}
    lines = []
    for request in make_workload("hot-burst", {"duration_s": 60.0, "burst_size": 60}, seed=0):
        lines.append(json.dumps({
            "timestamp": round(request.arrival_s * 1000), "input_length": request.input_tokens,
            "output_length": request.output_tokens,
            "hash_ids": chained_ids(request.token_ids, 512, ids, partial_last=True)}))
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


if __name__ == "__main__":
    print(f"sample.jsonl: {write_native(HERE / 'sample.jsonl')} requests")
    print(f"mooncake_sample.jsonl: {write_mooncake(HERE / 'mooncake_sample.jsonl')} requests")
