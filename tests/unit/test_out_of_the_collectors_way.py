"""What a router keeps for weeks is kept where CPython's cycle collector does not walk it.

A full collection walks every container the collector tracks, one memory access per
reference; the router's per-replica block records hold tens of thousands of keys each, so
kept in an ``OrderedDict`` they made every full collection a pause that each request in
flight waited out. Plain dicts holding only atoms (numbers, bytes, strings) are
not tracked, and that is how they are kept now."""

import gc

from prefixroute.core.caches.key_lru import KeyLRUCache
from prefixroute.core.caches.recency import RecencyOrder
from prefixroute.core.routing.policies.prefixroute.mirror import BlockMirror
from prefixroute.core.routing.views import ApproximateView


def _hashes(start: int, count: int) -> list[int]:
    return [(i * 0x9E3779B97F4A7C15) % (1 << 64) for i in range(start, start + count)]


def test_the_mirrors_blocks_are_not_tracked_by_the_collector():
    mirror = BlockMirror()
    mirror.capacity = 100
    for i in range(300):
        mirror.touch(_hashes(i, 8), 0)
    assert len(mirror.blocks) == 100
    mirror.untouch(_hashes(299, 8), mirror.stamps - 1, 4, 4)  # the last touch's 4 last go
    assert len(mirror.blocks) == 96
    assert not gc.is_tracked(mirror.blocks)
    assert not gc.is_tracked(mirror.inserts_at)
    assert not gc.is_tracked(mirror.dead)


def test_a_views_lru_is_not_tracked_by_the_collector():
    view = ApproximateView(50)
    for i in range(100):
        view.record([f"block-{j}".encode() for j in range(i, i + 5)])
    assert len(view) == 50
    order = view._lru._order
    assert not gc.is_tracked(order.rank) and not gc.is_tracked(order.keyed)


def test_recency_order_oldest_first_passing_over_touched_keys():
    order = RecencyOrder()
    order.add_new(["a", "b", "c", "d"])   # numbers 0 1 2 3
    order.touch("b")                      # b -> 4: a hole at 1
    order.touch_distinct(["a", "e"])      # a -> 5, e new at 6: a hole at 0
    assert order.keys() == ["c", "d", "b", "a", "e"]
    assert order.pop_oldest() == "c"      # passes over the holes 0 and 1
    assert order.head == 3
    assert order.discard("b") and not order.discard("zzz")
    assert order.pop_oldest_many(2) == ["d", "a"]
    assert order.keys() == ["e"] and len(order) == 1


def test_put_many_with_a_repeated_key_ends_where_its_last_put_puts_it():
    cache = KeyLRUCache(capacity=10)
    cache.put_many(["a", "b", "a", "c"])
    assert cache.keys() == ["b", "a", "c"]
