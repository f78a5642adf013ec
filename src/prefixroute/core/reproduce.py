"""The worked examples of docs/concepts.md, computed by running the library.

Each function builds real token sequences (or prefix families), hashes them with
:mod:`prefixroute.core.identity.hashing`, runs them through the project's caches and routing
policies, and counts. Nothing here is a printed constant: change a cache rule and the figures
move. ``prefixroute repro`` prints :func:`reproduce_all`.
"""

from __future__ import annotations

import random
from typing import Any

from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.caches.radix_tree import RadixCache
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import Adapter, CacheIdentity, derive_trust_group_salt
from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy

# Example 1: prompt sizes per turn and the assistant replies before turns 2..5.
CONVERSATION_PROMPTS = (400, 700, 1000, 1400, 1700)
CONVERSATION_REPLIES = (100, 100, 150, 100)
CONVERSATION_BLOCK_SIZE = 16


def _fresh_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 50_000) for _ in range(n)]


def conversation(prompts=CONVERSATION_PROMPTS, replies=CONVERSATION_REPLIES,
                 block_size: int = CONVERSATION_BLOCK_SIZE, seed: int = 0) -> dict[str, Any]:
    """A five-turn conversation, each turn extending the previous prompt plus its reply.

    Idealised reuse runs a token-granular radix tree (page size 1) that caches every token
    seen, the reply's last token included. The full-block figures run the same tokens through
    the vLLM-style paged pool: only full 16-token blocks are cached, the last prompt token is
    always recomputed, and the last sampled token of each turn has no KV yet (it was never fed
    back through the model).
    """
    rng = random.Random(seed)
    hasher = BlockHasher("native", block_size=block_size)
    ideal = RadixCache(capacity_units=10 ** 9, page_size=1)
    pool = PagedBlockPool(num_blocks=10 ** 5, block_size=block_size)
    sequence: list[int] = []
    ideal_reused, full_reused = [], []
    for turn, prompt_len in enumerate(prompts):
        if prompt_len <= len(sequence):
            raise ValueError(f"turn {turn + 1}: prompt {prompt_len} must extend the previous "
                             f"{len(sequence)} tokens")
        sequence += _fresh_tokens(rng, prompt_len - len(sequence))
        prompt_keys = hasher.block_hashes(sequence)
        ideal_reused.append(ideal.admit(turn, sequence, len(sequence)))
        full_reused.append(pool.admit(turn, prompt_keys, len(sequence)))
        pool.commit(turn, prompt_keys, len(sequence))
        if turn < len(replies):
            sequence += _fresh_tokens(rng, replies[turn])
            ideal.commit(turn, sequence, len(sequence))
            # Decode blocks are cached as they fill; the last sampled token has no KV.
            pool.commit(turn, hasher.block_hashes(sequence), len(sequence) - 1)
        else:
            ideal.commit(turn, sequence, len(sequence))
        ideal.release(turn)
        pool.release(turn)
    total = sum(prompts)
    return {
        "prompt_tokens_by_turn": list(prompts),
        "reused_tokens_by_turn": ideal_reused,
        "fresh_tokens_by_turn": [p - r for p, r in zip(prompts, ideal_reused)],
        "total_reused_tokens": sum(ideal_reused),
        "total_input_tokens": total,
        "reuse_fraction": sum(ideal_reused) / total,
        "block_size": block_size,
        "full_block_reused_by_turn": full_reused,
        "full_block_fresh_by_turn": [p - r for p, r in zip(prompts, full_reused)],
        "full_block_reused_total": sum(full_reused),
        "full_block_fresh_total": total - sum(full_reused),
        "full_block_reuse_fraction": sum(full_reused) / total,
    }


def universal_prefix(num_requests: int = 50, prefix_tokens: int = 200, replicas: int = 5,
                     suffix_tokens: int = 50, seed: int = 0,
                     policies: tuple[str, ...] = ("round_robin", "prefix_hash")) -> dict[str, Any]:
    """One shared system prompt over several replicas with ample memory (example 2).

    Every request is the shared prefix plus a unique suffix. Each replica is a token-granular
    radix tree; a request "hits" when its whole shared prefix is cached on the replica it was
    routed to. ``round_robin`` computes the prefix once per replica; a prefix-keyed policy
    (``prefix_hash``) sends everything to one replica, which computes it once. After warm-up
    (every replica that gets traffic holds the prefix) every policy hits on every request.
    """
    rng = random.Random(seed)
    prefix = _fresh_tokens(rng, prefix_tokens)
    requests = [prefix + _fresh_tokens(rng, suffix_tokens) for _ in range(num_requests)]
    hasher = BlockHasher("native", block_size=16)
    results = {}
    for spec in policies:
        policy = create_policy(spec, seed=seed, num_replicas=replicas, block_size=16)
        caches = [RadixCache(10 ** 9, page_size=1) for _ in range(replicas)]
        assignments = [0] * replicas
        hits, missed_prefix_tokens, after_warmup_misses, warm = 0, 0, 0, set()
        for i, tokens in enumerate(requests):
            view = RequestView(str(i), len(tokens), 16, hasher.block_hashes(tokens),
                               token_ids=tokens)
            replica_views = [ReplicaView(r, assignments=assignments[r]) for r in range(replicas)]
            decision = policy.route(view, replica_views)
            policy.on_routed(view, decision)
            target = decision.replica
            assignments[target] += 1
            cached = caches[target].admit(i, tokens, len(tokens))
            caches[target].commit(i, tokens, len(tokens))
            caches[target].release(i)
            if cached >= prefix_tokens:
                hits += 1
            else:
                missed_prefix_tokens += prefix_tokens - cached
            if len(warm) == len({t for t in range(replicas) if assignments[t]}) and warm:
                after_warmup_misses += cached < prefix_tokens
            warm.add(target)
        results[spec] = {"hits": hits, "misses": num_requests - hits,
                         "prefill_tokens_for_prefix": missed_prefix_tokens,
                         "assignments": assignments,
                         "misses_after_warmup": after_warmup_misses}
    round_robin = results[policies[0]]
    single = results[policies[1]]
    return {
        "requests": num_requests, "prefix_tokens": prefix_tokens, "replicas": replicas,
        "round_robin_hits": round_robin["hits"],
        "single_replica_hits": single["hits"],
        "warmup_saving_tokens": (round_robin["prefill_tokens_for_prefix"]
                                 - single["prefill_tokens_for_prefix"]),
        "every_request_hits_after_warmup": all(r["misses_after_warmup"] == 0
                                               for r in results.values()),
        "policies": results,
    }


def isolation(prefix_tokens: int = 1024, block_size: int = 16, seed: int = 0) -> dict[str, Any]:
    """Can tenant B learn, through a cache hit, that tenant A sent a prefix? (example 6)

    Tenant A's request warms one paged pool; tenant B then sends the identical tokens. Without
    salts B hits. With gateway-managed salts (HMAC of a server secret and the trust group) the
    first block's key differs, so nothing hits. A different model revision or adapter is a
    different :class:`CacheIdentity` and misses too. Keys use the ``native`` profile (which binds
    the whole identity); the salt and adapter cases also hold for the ``vllm`` profile, which
    puts them in vLLM's extra keys.
    """
    rng = random.Random(seed)
    prompt = _fresh_tokens(rng, prefix_tokens + 10)
    secret = bytes(rng.randrange(256) for _ in range(32))
    base = CacheIdentity(model="tiny", model_revision="r1")

    def probe(victim: CacheIdentity, prober: CacheIdentity, profile: str) -> int:
        hasher = BlockHasher(profile, block_size=block_size)
        pool = PagedBlockPool(num_blocks=4096, block_size=block_size)
        keys_a = hasher.block_hashes(prompt, victim)
        pool.admit("a", keys_a, len(prompt))
        pool.commit("a", keys_a, len(prompt))
        pool.release("a")
        keys_b = hasher.block_hashes(prompt, prober)
        return pool.admit("b", keys_b, len(prompt)) or 0

    salt_a = derive_trust_group_salt(secret, "tenant-a")
    salt_b = derive_trust_group_salt(secret, "tenant-b")
    cases = {
        "cross_tenant_hit_without_salt": (base, base),
        "cross_tenant_hit_with_distinct_salts": (base.with_salt(salt_a), base.with_salt(salt_b)),
        "same_tenant_hit_with_salt": (base.with_salt(salt_a), base.with_salt(salt_a)),
        "model_revision_change_hits": (base, CacheIdentity(model="tiny", model_revision="r2")),
        "adapter_change_hits": (base.with_adapter(Adapter("support-lora", "/adapters/a")),
                                base.with_adapter(Adapter("support-lora", "/adapters/b"))),
    }
    out: dict[str, Any] = {"cached_tokens": {}}
    for name, (victim, prober) in cases.items():
        cached = probe(victim, prober, "native")
        out[name] = cached > 0
        out["cached_tokens"][name] = cached
    out["vllm_profile_cross_tenant_hit_with_distinct_salts"] = probe(
        base.with_salt(salt_a), base.with_salt(salt_b), "vllm") > 0
    out["vllm_profile_adapter_change_hits"] = probe(
        base.with_adapter(Adapter("support-lora", "/adapters/a")),
        base.with_adapter(Adapter("support-lora", "/adapters/b")), "vllm") > 0
    return out


def reproduce_all() -> dict[str, Any]:
    """Every worked-example figure this build can compute."""
    from prefixroute.core.routing import skewed_trace

    out: dict[str, Any] = {"conversation": conversation()}
    out["universal_prefix"] = universal_prefix()
    out["routing"] = {name: skewed_trace.run_skewed_trace(name)
                      for name in ("round_robin", "affinity_only", "hybrid")}
    out["routing_exercises"] = skewed_trace.skewed_trace_exercises()
    try:
        from prefixroute.core.simulator.repro_fleet import repro_fleet
    except ImportError:
        pass
    else:
        out["fleet"] = repro_fleet()
    try:
        from prefixroute.core.economics.repro import repro_economics
    except ImportError:
        pass
    else:
        out["economics"] = repro_economics()
    out["isolation"] = isolation()
    return out
