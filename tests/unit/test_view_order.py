"""The gateway's approximate cache view forgets what vLLM evicts: a finished request's
blocks are freed tail first, so the engine evicts a prompt's tail first and keeps its head;
the view records a chain tail first and, sized at the engine's usable blocks (one fewer than
``num_gpu_blocks``: the null block), predicts the same prefix hits."""

from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.routing.views import ApproximateView

BLOCK = 4


def run(pool, owner, keys):
    """One request through the engine's pool: admitted, computed, finished."""
    tokens = len(keys) * BLOCK
    hit = pool.admit(owner, keys, tokens)
    pool.commit(owner, keys, tokens)
    pool.release(owner)
    return hit


def test_the_view_keeps_the_head_the_engine_keeps():
    a = [("a", i) for i in range(6)]
    b = [("b", i) for i in range(4)]
    pool = PagedBlockPool(9, BLOCK)  # 9 blocks, 8 usable
    view = ApproximateView(capacity_blocks=8)
    for keys in (a, b):
        run(pool, keys[0], keys)
        view.record(keys)
    # b needed 4 blocks: the 2 never used, then the 2 least recently freed, a's tail.
    assert pool.match(a) == 4
    assert view.match(a) == 4  # recorded head first, the view had forgotten a's head: 0
    assert view.match(b) == pool.match(b) == 4


def test_a_prompt_replayed_after_the_overflow_hits_as_the_view_predicted():
    pool = PagedBlockPool(9, BLOCK)
    view = ApproximateView(capacity_blocks=8)
    prompts = [[(family, i) for i in range(5)] for family in "xyz"]
    for keys in prompts:
        run(pool, keys[0], keys)
        view.record(keys)
    for keys in prompts:
        assert view.match(keys) == pool.match(keys)
