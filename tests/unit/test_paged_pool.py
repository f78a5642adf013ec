"""The vLLM-style paged block pool, as specifications (block size 4 keeps numbers small)."""

import pytest

from prefixroute.core.caches.base import capacity_in_blocks, cacheable_blocks
from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.model_config import MODEL_PRESETS


class Recorder:
    def __init__(self):
        self.events = []

    def on_stored(self, keys, parent, token_ids):
        self.events.append(("stored", list(keys), parent))

    def on_removed(self, keys):
        self.events.append(("removed", list(keys)))

    def on_cleared(self):
        self.events.append(("cleared",))


def run(pool, owner, keys, n):
    cached = pool.admit(owner, keys, n)
    pool.commit(owner, keys, n)
    pool.release(owner)
    return cached


def test_block_zero_is_reserved_so_n_blocks_hold_n_minus_1():
    pool = PagedBlockPool(num_blocks=5, block_size=4)
    assert pool.capacity_blocks == 4
    assert pool.free_blocks == 4


def test_a_repeat_hits_every_full_block_but_recomputes_the_last_token():
    pool = PagedBlockPool(10, 4)
    assert run(pool, "a", ["k0", "k1", "k2"], 12) == 0
    # 12 tokens = 3 full blocks, but at most floor(11 / 4) = 2 blocks may hit.
    assert run(pool, "b", ["k0", "k1", "k2"], 12) == 8
    assert cacheable_blocks(12, 4) == 2 and cacheable_blocks(13, 4) == 3


def test_matching_stops_at_the_first_missing_block():
    pool = PagedBlockPool(10, 4)
    run(pool, "a", ["k0", "k1", "k2"], 13)
    assert pool.match(["k0", "x", "k2"]) == 1
    assert run(pool, "b", ["k0", "x", "k2"], 13) == 4


def test_finished_request_is_freed_tail_first_so_the_tail_is_evicted_first():
    rec = Recorder()
    pool = PagedBlockPool(5, 4, listener=rec)  # 4 usable blocks
    run(pool, "a", ["a0", "a1", "a2"], 13)      # blocks for a0 a1 a2 + 1 partial
    rec.events.clear()
    run(pool, "b", ["b0"], 5)                   # needs 2 blocks: evicts two from the front
    removed = [e[1][0] for e in rec.events if e[0] == "removed"]
    assert removed == ["a2"]  # the partial (uncached) block went first, then a2, not a0
    assert pool.match(["a0", "a1", "a2"]) == 2


def test_blocks_in_use_are_never_evicted_and_admission_waits():
    pool = PagedBlockPool(5, 4)
    assert pool.admit("a", ["a0", "a1", "a2"], 13) == 0  # holds all 4 blocks
    assert pool.admit("b", ["b0"], 5) is None           # nothing free: caller queues
    pool.commit("a", ["a0", "a1", "a2"], 13)
    assert pool.match(["a0", "a1", "a2"]) == 3
    pool.release("a")
    assert pool.admit("b", ["b0"], 5) == 0


def test_hits_on_free_cached_blocks_take_them_out_of_the_free_queue():
    pool = PagedBlockPool(5, 4)
    run(pool, "a", ["a0", "a1"], 9)  # 3 blocks allocated then freed
    assert pool.free_blocks == 4
    assert pool.admit("b", ["a0", "a1"], 9) == 8
    assert pool.free_blocks == 1  # two touched hits + one new block


def test_events_report_stored_blocks_with_their_parent_and_removals():
    rec = Recorder()
    pool = PagedBlockPool(4, 4, listener=rec)  # 3 usable
    pool.admit("a", ["a0", "a1"], 8)
    pool.commit("a", ["a0"], 4)
    pool.commit("a", ["a0", "a1"], 8)
    pool.release("a")
    assert rec.events == [("stored", ["a0"], None), ("stored", ["a1"], "a0")]
    run(pool, "b", ["b0", "b1", "b2"], 12)
    assert ("removed", ["a1"]) in rec.events and ("removed", ["a0"]) in rec.events


def test_reset_is_refused_while_requests_run_and_clears_everything_after():
    rec = Recorder()
    pool = PagedBlockPool(8, 4, listener=rec)
    pool.admit("a", ["a0"], 5)
    pool.commit("a", ["a0"], 5)
    assert pool.reset() is False
    pool.release("a")
    assert pool.reset() is True
    assert pool.match(["a0"]) == 0 and rec.events[-1] == ("cleared",)


def test_stats_count_queried_and_hit_tokens_like_vllm_counters():
    pool = PagedBlockPool(10, 4)
    run(pool, "a", ["k0", "k1"], 9)
    run(pool, "b", ["k0", "k1"], 9)
    assert (pool.stats.queried_tokens, pool.stats.hit_tokens) == (18, 8)


def test_two_running_requests_with_the_same_block_each_keep_their_own_copy():
    pool = PagedBlockPool(10, 4)
    pool.admit("a", ["k0"], 5)
    pool.admit("b", ["k0"], 5)  # admitted before a's block was cached: a miss
    pool.commit("a", ["k0"], 5)
    pool.commit("b", ["k0"], 5)
    assert pool.cached_blocks == 2
    pool.release("a")
    pool.release("b")
    assert pool.evict(1) == 1 and pool.match(["k0"]) == 1  # the duplicate still serves
    assert pool.evict(10) == 1 and pool.match(["k0"]) == 0


def test_capacity_in_tokens_and_bytes():
    llama = MODEL_PRESETS["llama-3-8b"]
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131072
    assert capacity_in_blocks(16, tokens=1000) == 62
    assert capacity_in_blocks(16, memory_bytes=131072 * 16 * 10, model=llama) == 10
    with pytest.raises(ConfigError):
        capacity_in_blocks(16, blocks=-1)
    with pytest.raises(ConfigError):
        PagedBlockPool(1, 16)


def test_fits_kv_counts_prompt_and_output_less_the_last_sampled_token():
    from prefixroute.core.caches.base import fits_kv
    # 10 blocks of 16 tokens hold 160 slots; the last sampled token never needs one.
    assert fits_kv(160, 1, 10, 16)          # 160 slots
    assert not fits_kv(160, 2, 10, 16)      # 161 slots: an 11th block
    assert not fits_kv(161, 1, 10, 16)      # a partial 11th block
    assert fits_kv(150, 11, 10, 16)         # 160 slots
    assert fits_kv(10**6, 1, 0, 16)         # unknown capacity: assume it fits
