"""The numpy LRU over block ids, as specifications (same rules as KeyLRUCache.access)."""

import numpy as np
import pytest

from prefixroute.core.caches.id_lru import IdLRU
from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.xxh3_rows import chain_blocks, supports


def ids(*values):
    return np.array(values, dtype=np.int64)


def test_leading_hits_count_and_new_blocks_follow_in_order():
    cache = IdLRU(capacity=3, n_ids=10)
    assert cache.access(ids(0, 1)) == 0
    assert cache.access(ids(0, 1, 2)) == 2
    assert cache.keys() == [0, 1, 2]


def test_an_insertion_past_capacity_evicts_the_least_recently_used():
    cache = IdLRU(capacity=3, n_ids=10)
    cache.access(ids(0, 1, 2))
    cache.access(ids(1))                 # 1 is now the most recent
    assert cache.access(ids(3)) == 0     # 0 goes
    assert cache.keys() == [2, 1, 3]
    assert cache.evictions == 1


def test_a_block_evicted_by_an_earlier_block_of_the_same_request_misses():
    # 5 is cached but the oldest; inserting 4 first pushes it out before its turn.
    cache = IdLRU(capacity=2, n_ids=10)
    cache.access(ids(5))
    cache.access(ids(6))
    assert cache.access(ids(4, 5)) == 0
    assert cache.keys() == [4, 5]


def test_hits_after_a_miss_are_touched_but_not_counted():
    cache = IdLRU(capacity=4, n_ids=10)
    cache.access(ids(0, 1, 2))
    assert cache.access(ids(0, 9, 1)) == 1
    assert cache.keys() == [2, 0, 9, 1]


def test_zero_capacity_holds_nothing_and_negative_is_refused():
    cache = IdLRU(capacity=0, n_ids=4)
    assert cache.access(ids(1, 2)) == 0
    assert cache.access(ids(1, 2)) == 0
    assert len(cache) == 0
    with pytest.raises(ConfigError):
        IdLRU(capacity=-1, n_ids=4)


def test_block_major_hashing_supports_whole_16_byte_lanes_only():
    assert [b for b in range(1, 40) if supports(b)] == [8, 12, 16, 20, 24, 28, 32]
    with pytest.raises(ValueError):
        chain_blocks(np.zeros((1, 10, 2), dtype=np.uint32), np.zeros(2, dtype=np.uint64))
