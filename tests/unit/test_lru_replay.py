"""A known sequence of requests replayed on one LRU at once, as specifications (the rule of
KeyLRUCache.access: leading hits count, every block is then touched or inserted in order)."""

import pytest

from prefixroute.core.caches.lru_replay import replay_lru_hits
from prefixroute.core.errors import ConfigError


def replay(requests, capacity, window=32):
    ids = [block for request in requests for block in request]
    return replay_lru_hits(ids, [len(r) for r in requests], capacity, window).tolist()


def test_leading_hits_count_and_new_blocks_follow_in_order():
    assert replay([[0, 1], [0, 1, 2]], capacity=3) == [0, 2]


def test_an_insertion_past_capacity_evicts_the_least_recently_used():
    # After [0, 1, 2] and a touch of 1, the order is 0, 2, 1: inserting 3 evicts 0 only.
    assert replay([[0, 1, 2], [1], [3], [0]], capacity=3) == [0, 1, 0, 0]
    assert replay([[0, 1, 2], [1], [3], [2]], capacity=3) == [0, 1, 0, 1]


def test_a_block_evicted_by_an_earlier_block_of_the_same_request_misses():
    # 5 is cached but the oldest; inserting 4 first pushes it out before its turn. The cache
    # then holds 4 and 5, so the same request hits in full next time.
    assert replay([[5], [6], [4, 5], [4, 5]], capacity=2) == [0, 0, 0, 2]


def test_hits_after_a_miss_are_touched_but_not_counted():
    # [0, 9, 1] hits 0, misses 9, then touches 1 (order 2, 0, 9, 1): inserting 3 evicts 2.
    assert replay([[0, 1, 2], [0, 9, 1], [3], [0], [2]], capacity=4) == [0, 1, 0, 1, 0]


def test_a_block_named_twice_in_one_request():
    # The first 7 misses and is inserted, the second touches it (not counted: after a miss).
    assert replay([[7, 7], [7]], capacity=2) == [0, 1]
    # With room for one block, 8 evicts 7 and the second 7 evicts 8.
    assert replay([[7, 8, 7], [7], [8]], capacity=1) == [0, 1, 0]


def test_empty_requests_hit_nothing_and_change_nothing():
    assert replay([[], [1], [], [1]], capacity=1) == [0, 0, 0, 1]
    assert replay([], capacity=1) == []


def test_the_cut_is_found_far_behind_a_run_of_repeated_requests():
    # [9] over and over leaves one alive access per window of requests; the cache still
    # holds 1, 2 and 9 from long before (capacity 3), whatever window is looked at first.
    requests = [[0, 1, 2]] + [[9]] * 6 + [[1], [0]]
    for window in (1, 2, 32):
        assert replay(requests, capacity=3, window=window) == [0] + [0] + [1] * 5 + [1, 0]


def test_block_ids_of_any_size_give_the_same_hits():
    # Small ids, ids that need a 64-bit key per access, ids too large to pack with positions.
    requests = [[0, 1, 2], [0, 9, 1], [3], [0], [2]]
    for offset in (0, 1 << 20, 1 << 61):
        shifted = [[block + offset for block in request] for request in requests]
        assert replay(shifted, capacity=4) == [0, 1, 0, 1, 0]


def test_zero_capacity_holds_nothing_and_bad_arguments_are_refused():
    assert replay([[1, 2], [1, 2]], capacity=0) == [0, 0]
    with pytest.raises(ConfigError):
        replay([[1]], capacity=-1)
    with pytest.raises(ConfigError):
        replay_lru_hits([1, 2], [1], 4)  # lengths do not add up to the ids
    with pytest.raises(ConfigError):
        replay_lru_hits([-1], [1], 4)
