"""The mirror's LRU, kept as stamps and each touch's keys, evicts exactly what an ordered
dict of its blocks would: the oldest touch's keys first, tail first within a touch, never a
block touched again since; with compactions and sweeps of dead keys anywhere along the way,
and the dead keys it counts exactly those its touches hold."""

from collections import OrderedDict

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.policies.prefixroute.mirror import BlockMirror

steps = st.lists(st.one_of(
    st.tuples(st.just("touch"), st.lists(st.integers(0, 30), max_size=7), st.booleans()),
    st.tuples(st.just("untouch"), st.integers(0, 3), st.booleans()),
    st.tuples(st.just("sweep"), st.integers(1, 12), st.booleans()),
    st.tuples(st.just("reset"), st.just(0), st.booleans())), max_size=60)


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
        elif kind == "sweep":
            mirror._sweep(arg)
        elif kind == "reset":
            mirror.reset()
            reference.clear()
        elif touches:
            keys, stamp = touches[-1 - arg % len(touches)]
            held = min(len(keys), arg)
            mirror.untouch(keys, stamp, held, 0)
            for key in keys[held:]:
                if reference.get(key) == stamp:
                    del reference[key]
        assert mirror.blocks == dict(reference)
        # Every held block is in its touch's tuple; ``dead`` counts the others exactly, except
        # the keys the eviction walk has passed in the oldest touch.
        for stamp, keys in mirror.touched.items():
            live = sum(mirror.blocks.get(key) == stamp for key in keys)
            passed = mirror.oldest_at if stamp == mirror.head else 0
            assert len(keys) - live - mirror.dead.get(stamp, 0) in range(passed + 1)
        assert sum(mirror.dead.values()) == mirror.dead_total
        assert all(stamp in mirror.touched for stamp in mirror.dead)
        assert all(mirror.blocks[key] in mirror.touched for key in mirror.blocks)
        # The touches are linked oldest to newest, both ways.
        linked, stamp = [], mirror.head
        while stamp != -1:
            linked.append(stamp)
            stamp = mirror.after.get(stamp, -1)
        assert linked == sorted(mirror.touched) and mirror.tail == (linked or [-1])[-1]
        assert mirror.before == dict(zip(linked[1:], linked))
    # The order too: evicting everything gives the reference's order.
    order = []
    while mirror.blocks:
        before = dict(mirror.blocks)
        mirror._evict(1)
        assert len(mirror.blocks) == len(before) - 1
        order += [k for k in before if k not in mirror.blocks]
    assert order == list(reference)


def test_a_sweep_of_the_touch_the_walk_is_in_restarts_the_walk_at_its_first_key():
    mirror = BlockMirror()
    mirror.capacity = 4
    mirror.touch([1, 2, 3, 4], 0)  # kept tail first: 4 3 2 1
    mirror.touch([5], 0)           # 4 goes; the walk stands after it in that touch
    mirror.touch([2], 0)           # 2 is dead in the first touch now
    mirror._sweep(100)             # the first touch is rewritten as 3 1
    mirror.touch([6], 0)           # the least recently used is 3
    assert sorted(mirror.blocks) == [1, 2, 5, 6]


def test_the_walk_passes_touches_that_left_nothing_without_visiting_them():
    mirror = BlockMirror()
    mirror.capacity = 3
    mirror.touch([1], 0)
    for _ in range(1_000):
        mirror.touch([], 0)   # a prompt under one block: no touch record
        mirror.touch([2], 0)  # each leaves the one before it with nothing
    assert list(mirror.touched) == [0, 2000] and mirror.after == {0: 2000}
    mirror.touch([3, 4], 0)   # 1 goes: the oldest, reached in one link
    assert sorted(mirror.blocks) == [2, 3, 4]


def test_a_sweep_drops_the_touch_the_walk_is_in_once_nothing_of_it_is_held():
    mirror = BlockMirror()
    mirror.capacity = 4
    mirror.touch([1, 2, 3, 4], 0)  # kept tail first: 4 3 2 1
    mirror.touch([5], 0)           # 4 goes: the walk stands in the first touch
    mirror.touch([1, 2, 3], 0)     # the rest of it is touched again
    mirror._sweep(100)             # nothing of the first touch is held: it goes
    assert 0 not in mirror.touched and mirror.head == 1
    mirror.touch([6], 0)           # the least recently used is 5
    assert sorted(mirror.blocks) == [1, 2, 3, 6]


def test_a_touch_taken_back_whole_leaves_no_record():
    mirror = BlockMirror()
    mirror.touch([1, 2], 0)
    mirror.untouch([1, 2], 0, 0, 2)  # the engine never ran it
    assert mirror.blocks == {} and mirror.touched == {} and mirror.head == -1
