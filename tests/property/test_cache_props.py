"""Invariants of the local prefix caches, checked on random workloads (hypothesis)."""

import numpy as np
from hypothesis import given, settings, strategies as st

from prefixroute.core.caches.key_lru import KeyLRUCache
from prefixroute.core.caches.lru_replay import replay_lru_hits
from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.caches.radix_tree import RadixCache
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import Adapter, CacheIdentity
from prefixroute.core.identity.xxh3_rows import chain_blocks

BLOCK = 4
HASHER = BlockHasher("native", block_size=BLOCK)

# Prompts drawn from a few shared stems so prefixes actually repeat.
stems = st.lists(st.integers(0, 5), min_size=0, max_size=24)
prompts = st.lists(st.tuples(st.integers(0, 2), stems), min_size=1, max_size=25)


def build(stem_id, tail):
    stem = [1000 + stem_id] * 8 + list(range(stem_id * 10, stem_id * 10 + 8))
    return stem + tail


@settings(max_examples=60, deadline=None)
@given(prompts)
def test_paged_pool_and_radix_tree_agree_with_ample_capacity(workload):
    pool = PagedBlockPool(10_000, BLOCK)
    tree = RadixCache(10_000, page_size=BLOCK)
    for i, (stem_id, tail) in enumerate(workload):
        tokens = build(stem_id, tail)
        keys = HASHER.block_hashes(tokens)
        from_pool = pool.admit(i, keys, len(tokens))
        from_tree = tree.admit(i, tokens, len(tokens))
        assert from_pool == from_tree
        pool.commit(i, keys, len(tokens))
        tree.commit(i, tokens, len(tokens))
        pool.release(i)
        tree.release(i)


@settings(max_examples=60, deadline=None)
@given(prompts, st.integers(2, 12))
def test_every_hit_is_a_prefix_and_capacity_is_never_exceeded(workload, num_blocks):
    pool = PagedBlockPool(num_blocks, BLOCK)
    seen: list[list] = []
    for i, (stem_id, tail) in enumerate(workload):
        tokens = build(stem_id, tail)
        keys = HASHER.block_hashes(tokens)
        cached = pool.admit(i, keys, len(tokens))
        if cached is None:
            continue
        hit_blocks = cached // BLOCK
        # A hit means an earlier request had exactly these leading blocks.
        assert hit_blocks == 0 or any(s[:hit_blocks] == keys[:hit_blocks] for s in seen)
        assert cached <= max(0, (len(tokens) - 1)) // BLOCK * BLOCK
        pool.commit(i, keys, len(tokens))
        assert pool.cached_blocks <= pool.capacity_blocks
        pool.release(i)
        seen.append(keys)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 30)), min_size=1, max_size=30),
       st.integers(2, 16))
def test_eviction_never_touches_a_block_in_use(workload, num_blocks):
    pool = PagedBlockPool(num_blocks, BLOCK)
    running = {}
    for i, (stem_id, length) in enumerate(workload):
        tokens = build(stem_id, list(range(length)))
        keys = HASHER.block_hashes(tokens)
        if pool.admit(i, keys, len(tokens)) is None:
            # Free the oldest running request and go on: the pool had no room.
            if running:
                oldest = next(iter(running))
                pool.release(oldest)
                del running[oldest]
            continue
        pool.commit(i, keys, len(tokens))
        running[i] = keys
        for other_keys in running.values():
            # every running request's committed blocks are still cached
            assert pool.match(other_keys) == len(other_keys)
        if len(running) > 2:
            oldest = next(iter(running))
            pool.release(oldest)
            del running[oldest]


identities = st.sampled_from([
    CacheIdentity(), CacheIdentity(cache_salt="a"), CacheIdentity(cache_salt="b"),
    CacheIdentity(model_revision="r2"), CacheIdentity(adapter=Adapter("x", "/x")),
])


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(identities, st.integers(0, 2)), min_size=2, max_size=12),
       st.sampled_from(["native", "vllm"]))
def test_no_hit_ever_crosses_salts_adapters_or_model_revisions(workload, profile):
    hasher = BlockHasher(profile, block_size=BLOCK)
    pool = PagedBlockPool(10_000, BLOCK)
    warmed: set = set()
    for i, (identity, stem_id) in enumerate(workload):
        if profile == "vllm" and identity.model_revision:
            continue  # vLLM's own hash is per engine: model revision is an engine-scope field
        tokens = build(stem_id, [7] * 9)
        keys = hasher.block_hashes(tokens, identity)
        cached = pool.admit(i, keys, len(tokens))
        if (identity, stem_id) not in warmed:
            assert cached == 0
        pool.commit(i, keys, len(tokens))
        pool.release(i)
        warmed.add((identity, stem_id))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=6), min_size=1, max_size=40),
       st.integers(0, 8))
def test_key_lru_never_exceeds_capacity(requests, capacity):
    cache = KeyLRUCache(capacity)
    for keys in requests:
        cache.access(keys)
        assert len(cache) <= capacity


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 40)), min_size=1, max_size=30),
       st.integers(8, 64), st.sampled_from(["lru", "lfu", "fifo", "mru"]))
def test_radix_tree_never_exceeds_capacity(workload, capacity, policy):
    tree = RadixCache(capacity, eviction_policy=policy)
    for i, (stem_id, length) in enumerate(workload):
        tokens = build(stem_id, list(range(length)))
        if tree.admit(i, tokens, len(tokens)) is None:
            continue
        tree.commit(i, tokens, len(tokens))
        assert tree.total_units <= capacity
        tree.release(i)
        assert tree.total_units <= capacity


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=8), min_size=1, max_size=40),
       st.integers(0, 10))
def test_key_lru_fast_path_matches_the_general_path(requests, capacity):
    fast = KeyLRUCache(capacity)                 # no TTL, no listener: the fast path
    general = KeyLRUCache(capacity, ttl=1e12)    # a TTL that never expires: the general path
    for keys in requests:
        assert fast.access(keys) == general.access(keys)
        assert fast.keys() == general.keys()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=8), min_size=1, max_size=40),
       st.integers(0, 10), st.sampled_from([None, 1e12]))
def test_key_lru_put_many_ends_as_puts_one_at_a_time_and_match_agrees(requests, capacity, ttl):
    bulk = KeyLRUCache(capacity, ttl=ttl)
    single = KeyLRUCache(capacity, ttl=ttl)
    for keys in requests:
        gone = bulk.put_many(keys)
        for key in keys:
            single.put(key)
        assert bulk.keys() == single.keys()
        assert not set(gone) & set(bulk.keys())  # what it reports evicted is really gone
        for probe in requests[:5]:
            assert bulk.match(probe) == single.match(probe)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 70), st.sampled_from(["", "s"])),
                min_size=1, max_size=25), st.integers(1, 6))
def test_the_hash_memo_never_changes_a_digest(prompts, memo_blocks):
    # Prompts share stems (the same leading blocks) with tails of any length, salted or not;
    # a tiny memo churns through its generations.
    plain = BlockHasher("vllm", "sha256", 8)
    memo = BlockHasher("vllm", "sha256", 8, memo_blocks=memo_blocks)
    for stem, tail, salt in prompts:
        tokens = [stem] * 24 + list(range(tail))
        identity = CacheIdentity(cache_salt=salt or None)
        assert memo.block_hashes(tokens, identity) == plain.block_hashes(tokens, identity)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.integers(0, 14), min_size=0, max_size=10), min_size=0, max_size=40),
       st.integers(0, 10), st.sampled_from([1, 2, 3, 32]), st.sampled_from([0, 1 << 20, 1 << 61]))
def test_replaying_a_whole_sequence_gives_the_hits_of_key_lru_access(requests, capacity,
                                                                       window, offset):
    """Hits computed at once from the sequence (inclusion property of LRU) equal the
    key-at-a-time cache's, whatever the request shapes (repeated ids, empty requests,
    evictions reaching a block the same request uses later), however far back the cut lies
    behind the window looked at first (small windows widen, then scan) and whatever the
    size of the ids (each way of sorting them)."""
    keys = KeyLRUCache(capacity)
    expected = [keys.access(request) for request in requests]
    ids = [block + offset for request in requests for block in request]
    assert replay_lru_hits(ids, [len(r) for r in requests], capacity, window).tolist() == \
        expected


@settings(max_examples=40, deadline=None)
@given(st.sampled_from([8, 12, 16, 20, 24, 28, 32]), st.integers(1, 4), st.integers(1, 5),
       st.integers(0, 2 ** 64 - 1), st.randoms(use_true_random=False))
def test_block_major_hashing_gives_the_native_keys(block_size, blocks, rows, parent, rnd):
    """xxh3 in numpy, one block position for every prompt at once, equals the ``native``
    profile's one-call-per-block chain (the xxhash package); so does reading the prompts'
    tokens from a few shared texts by column."""
    tokens = np.array([[rnd.getrandbits(32) for _ in range(blocks * block_size)]
                       for _ in range(rows)], dtype=np.uint32)
    by_block = np.ascontiguousarray(tokens.reshape(rows, blocks, block_size).transpose(1, 2, 0))
    keys = chain_blocks(by_block, np.full(rows, parent, dtype=np.uint64))
    hasher = BlockHasher("native", block_size=block_size)
    for r in range(rows):
        assert keys[:, r].tolist() == hasher.native_chain(tokens[r].tobytes(), parent)
    columns = [rnd.randrange(rows) for _ in range(5)]
    parents = [rnd.getrandbits(64) for _ in range(5)]
    by_column = chain_blocks(by_block, np.array(parents, dtype=np.uint64),
                             columns=np.array(columns))
    for i, (column, seed) in enumerate(zip(columns, parents)):
        assert by_column[:, i].tolist() == hasher.native_chain(tokens[column].tobytes(), seed)
