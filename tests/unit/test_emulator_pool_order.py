"""The paged pool frees blocks in vLLM 0.32's order (``BlockPool.free_blocks``), which decides
which cached block an allocation evicts: the emulator's BlockRemoved stream rests on it."""

from prefixroute.core.caches.paged_pool import PagedBlockPool


class Recorder:
    def __init__(self):
        self.removed = []

    def on_stored(self, keys, parent, token_ids):
        pass

    def on_removed(self, keys):
        self.removed.extend(keys)

    def on_cleared(self):
        pass


def test_a_freed_partial_block_is_reused_before_any_cached_block_is_evicted():
    # 5 blocks: block 0 is the null block, so 4 usable; block size 4.
    recorder = Recorder()
    pool = PagedBlockPool(5, 4, listener=recorder)
    # a: 8 tokens, two full blocks (1, 2), both cached; freed -> queue [3, 4, a1, a0].
    pool.admit("a", ["a0", "a1"], 8)
    pool.commit("a", ["a0", "a1"], 8)
    pool.release("a")
    # b: 6 tokens in blocks 3 (cached b0) and 4 (partial, never cached).
    pool.admit("b", ["b0"], 6)
    pool.commit("b", ["b0"], 6)
    pool.release("b")
    # vLLM prepends the partial block: queue [4, a1, a0, b0]. One new block takes block 4 and
    # evicts nothing (appended behind the cached blocks, it would have cost a1).
    assert pool.admit("c", [], 3) == 0
    assert recorder.removed == []
    assert pool.match(["a0", "a1"]) == 2 and pool.match(["b0"]) == 1


def test_cached_blocks_are_still_evicted_tail_first():
    recorder = Recorder()
    pool = PagedBlockPool(5, 4, listener=recorder)
    pool.admit("a", ["a0", "a1"], 10)
    pool.commit("a", ["a0", "a1"], 10)
    pool.release("a")
    # 4 blocks: the never-used block 4 and the partial one first, then a1 (the tail), then a0.
    pool.admit("b", [], 13)
    assert recorder.removed == ["a1", "a0"]
