"""The mirror's LRU, kept as stamps and each touch's keys, evicts exactly what an ordered
dict of its blocks would: the oldest touch's keys first, tail first within a touch, never a
block touched again since; with compactions anywhere along the way."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.policies.prefixroute.mirror import BlockMirror

steps = st.lists(st.one_of(
    st.tuples(st.just("touch"), st.lists(st.integers(0, 30), max_size=7), st.booleans()),
    st.tuples(st.just("untouch"), st.integers(0, 3), st.booleans())), max_size=60)


@given(capacity=st.integers(1, 12), steps=steps)
@settings(max_examples=400, deadline=None)
def test_the_mirror_evicts_what_an_ordered_dict_would(capacity, steps):
    mirror = BlockMirror()
    mirror.capacity = capacity
    reference: OrderedDict = OrderedDict()  # key -> stamp, least recently used first
    touches: list[tuple[list[int], int]] = []
    for kind, arg, compact in steps:
        if compact:
            mirror.compact_at = 0  # compact at the next touch
        if kind == "touch":
            keys = arg if len(arg) <= capacity else []
            stamp, _ = mirror.touch(arg, 0)
            for key in keys:
                reference.pop(key, None)
            for key in reversed(keys):
                reference[key] = stamp
            while len(reference) > capacity:
                reference.popitem(last=False)
            touches.append((keys, stamp))
        elif touches:
            keys, stamp = touches[-1 - arg % len(touches)]
            held = min(len(keys), arg)
            mirror.untouch(keys, stamp, held, 0)
            for key in keys[held:]:
                if reference.get(key) == stamp:
                    del reference[key]
        assert mirror.blocks == dict(reference)
    # The order too: evicting everything gives the reference's order.
    order = []
    while mirror.blocks:
        before = dict(mirror.blocks)
        mirror._evict(1)
        order += [k for k in before if k not in mirror.blocks]
    assert order == list(reference)
