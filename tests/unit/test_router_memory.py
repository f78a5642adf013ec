"""A router's memory does not grow with the requests it routes: a gateway runs for weeks.

What it remembers of each replica's cache is bounded by the replica's KV (by
``UNKNOWN_CAPACITY_BLOCKS`` while that is unknown), and the prefixroute policy's insert clock
keeps a reading for every stamp its held blocks carry and drops the others as it goes; the
keys it keeps in LRU order stay within a small multiple of the blocks held."""

import random

from prefixroute.core.caches.base import UNKNOWN_CAPACITY_BLOCKS
from prefixroute.core.routing.policies.prefixroute.mirror import BlockMirror
from prefixroute.core.routing.views import ApproximateView

WIDTH = 0.5  # survival width: with 8 blocks, a block survives surely up to age 4, never at 8


def test_the_mirror_keeps_the_replicas_kv_and_a_bounded_clock():
    mirror = BlockMirror()
    mirror.capacity = 8
    for i in range(20_000):  # two new blocks each
        mirror.touch([("p", i, 0), ("p", i, 1)], 0)
    assert len(mirror.blocks) == 8
    # The 4 stamps the held blocks carry, and at most about a thousand since the last
    # compaction: not one reading per request.
    assert {stamp for stamp in mirror.blocks.values()} == {19_996, 19_997, 19_998, 19_999}
    assert len(mirror.inserts_at) <= 2 * 5 + 1024


def test_a_long_shared_prefix_is_not_kept_once_per_request():
    # 200 blocks every request shares, then one of its own, on a replica of 1,000 blocks:
    # each request re-touches the prefix, and its older touch's copy of those 200 keys is
    # dead. 5,000 requests made a million dead keys; the sweep keeps them under twice the
    # blocks held plus 1,024 (and a sweep's own pass), instead of about 800 touches' worth.
    mirror = BlockMirror()
    mirror.capacity = 1_000
    prefix = [("shared", j) for j in range(200)]
    for i in range(5_000):
        mirror.touch(prefix + [("own", i)], 200 if i else 0)
        kept = sum(map(len, mirror.touched.values()))
        assert kept <= 3 * (1_000 + 1_024), i
    assert len(mirror.blocks) == 1_000
    assert kept - mirror.dead_total == 1_000  # every held block once, plus the dead ones
    # Evicting still goes least recently used first: the oldest own blocks, never the prefix.
    assert ("own", 4_199) not in mirror.blocks and ("own", 4_200) in mirror.blocks
    assert all(key in mirror.blocks for key in prefix)


def test_a_block_held_through_many_full_hits_keeps_its_age():
    mirror = BlockMirror()
    mirror.capacity = 8
    mirror.touch([("old",)], 0)  # stamp 0: the clock reads 1 after it
    for i in range(5):
        mirror.touch([("new", i)], 0)  # 5 blocks inserted since: clock 6
    # Age 5 of 8, between 4 (sure) and 8 (gone): (8 - 5) / (8 - 4).
    assert mirror.survival(0, WIDTH) == 0.75
    for _ in range(20_000):  # a prompt the replica holds whole: nothing inserted
        mirror.touch([("new", 4)], 1)
    assert mirror.survival(0, WIDTH) == 0.75
    assert len(mirror.blocks) == 6
    assert len(mirror.inserts_at) <= 2 * 7 + 1024


def test_a_replica_of_unknown_size_is_remembered_up_to_the_bound():
    mirror = BlockMirror()  # capacity 0: unknown
    view = ApproximateView(None)
    for i in range(UNKNOWN_CAPACITY_BLOCKS + 100):
        mirror.touch([("p", i)], 0)
        view.record([("p", i)])
    assert len(mirror.blocks) == len(view) == UNKNOWN_CAPACITY_BLOCKS == 65_536
    # The least recently sent went first.
    assert ("p", 99) not in mirror.blocks and ("p", 100) in mirror.blocks
    assert view.match([("p", 99)]) == 0 and view.match([("p", 100)]) == 1
    assert mirror.survival(mirror.blocks[("p", 100)], WIDTH) == 1.0  # unknown: no decay


def test_every_held_block_keeps_its_clock_reading():
    # Touches, some taken back (the engine never ran them), some hitting what is held: after
    # each, every held block can still be aged.
    rng = random.Random(7)
    mirror = BlockMirror()
    mirror.capacity = 8
    for i in range(5_000):
        keys = [("shared", rng.randrange(3)), ("own", i)]
        stamp, _ = mirror.touch(keys, rng.randrange(2))
        if rng.random() < 0.15:
            mirror.untouch(keys, stamp, 1, 1)
        assert all(s in mirror.inserts_at for s in mirror.blocks.values())
        for s in set(mirror.blocks.values()):
            assert 0.0 <= mirror.survival(s, WIDTH) <= 1.0


def test_a_prompt_longer_than_the_bound_leaves_an_unknown_replica_as_it_was():
    mirror = BlockMirror()
    view = ApproximateView(None)
    mirror.touch([("held",)], 0)
    view.record([("held",)])
    huge = [("huge", i) for i in range(UNKNOWN_CAPACITY_BLOCKS + 1)]
    mirror.touch(huge, 0)
    view.record(huge)
    assert list(mirror.blocks) == [("held",)] and mirror.inserts == 1
    assert len(view) == 1 and view.match([("held",)]) == 1
