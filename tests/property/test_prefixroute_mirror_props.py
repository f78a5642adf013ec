"""The block mirror's bookkeeping of evicted blocks, over random streams of routed requests,
reports and replica resets: the count of blocks it holds that feedback marked evicted
(``gone``) and its per-touch counts always equal a recount from the blocks themselves, so a
replica's free room (its capacity less its live blocks) is exact however the horizon moved."""

from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.policies.prefixroute.mirror import BlockMirror

op_st = st.one_of(
    st.tuples(st.just("touch"), st.integers(0, 3), st.integers(0, 12), st.integers(0, 12)),
    st.tuples(st.just("report"), st.integers(0, 12)),
    st.tuples(st.just("untouch"), st.integers(0, 12)),
    st.tuples(st.just("reset")),
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.sampled_from([0, 5, 16]), ops=st.lists(op_st, max_size=40))
def test_gone_and_per_touch_counts_match_a_recount(capacity, ops):
    mirror = BlockMirror()
    mirror.capacity = capacity
    last = None  # (keys, stamp, predicted, chain, held before) of the latest touch
    for op in ops:
        if op[0] == "touch":
            _, family, n, predicted = op
            keys = [(family, i) for i in range(n)]
            held = sum(1 for key in keys if key in mirror.blocks)
            predicted = min(predicted, held)
            stamps = [mirror.blocks[key] for key in keys[:predicted]]
            stamp, chain = mirror.touch(keys, predicted)
            last = (keys, stamp, predicted, stamps, chain)
        elif op[0] == "report" and last is not None:
            keys, _, predicted, stamps, chain = last
            mirror.learn(min(op[1], len(keys)), stamps, chain, predicted)
        elif op[0] == "untouch" and last is not None:
            keys, stamp, predicted, _, chain = last
            mirror.untouch(keys, stamp, min(op[1], len(keys)), 0)
            last = None
        elif op[0] == "reset":
            mirror.reset()
            last = None
        held = list(mirror.blocks.values())
        assert mirror.gone == sum(1 for stamp in held if stamp <= mirror.horizon)
        assert mirror.per_stamp == dict(Counter(held))
        assert list(mirror.per_stamp) == sorted(mirror.per_stamp)  # oldest touch first
        assert mirror.live_blocks() == len(held) - mirror.gone
