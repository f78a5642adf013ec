"""The key-level LRU / TTL cache, as specifications."""

from prefixroute.core.caches.key_lru import KeyLRUCache


def test_access_counts_leading_hits_and_inserts_misses_in_order():
    cache = KeyLRUCache(capacity=3)
    assert cache.access(["a", "b"]) == 0
    assert cache.access(["a", "b", "c"]) == 2
    assert cache.keys() == ["a", "b", "c"]


def test_over_capacity_the_oldest_key_is_evicted():
    cache = KeyLRUCache(capacity=2)
    cache.put("a")
    cache.put("b")
    cache.lookup("a")  # a is now most recent
    assert cache.put("c") == ["b"]
    assert cache.evictions == 1


def test_ttl_expires_and_a_hit_refreshes_it():
    cache = KeyLRUCache(capacity=10, ttl=300)
    cache.put("p", now=0)
    assert cache.lookup("p", now=299)         # hit at 299 refreshes to 599
    assert cache.lookup("p", now=598)
    assert not cache.lookup("p", now=1000)    # expired


def test_without_refresh_the_ttl_runs_from_the_write():
    cache = KeyLRUCache(capacity=10, ttl=300, refresh_on_hit=False)
    cache.put("p", now=0)
    assert cache.lookup("p", now=200)
    assert not cache.lookup("p", now=300)


def test_put_many_writes_in_order_and_trims_once():
    cache = KeyLRUCache(capacity=3)
    cache.put_many(["a", "b", "c"])
    assert cache.put_many(["b", "d"]) == ["a"]  # b touched again, a the oldest goes
    assert cache.keys() == ["c", "b", "d"]
    assert cache.match(["c", "b", "x"]) == 2


def test_match_with_a_ttl_stops_at_an_expired_key():
    cache = KeyLRUCache(capacity=10, ttl=10)
    cache.put("a", now=0)
    cache.put("b", now=5)
    assert cache.match(["a", "b"], now=9) == 2
    assert cache.match(["a", "b"], now=12) == 0  # a expired at 10


def _reference_access(order: list, capacity: int, keys: list) -> tuple[int, int]:
    """The rule, one key at a time: hits move to the recent end, a miss is inserted and the
    oldest entry evicted when over capacity; leading hits count. Returns (hits, evicted)."""
    hits, evicted, prefix = 0, 0, True
    for key in keys:
        if key in order:
            order.remove(key)
            order.append(key)
            hits += prefix
        else:
            prefix = False
            if capacity:
                order.append(key)
                if len(order) > capacity:
                    order.pop(0)
                    evicted += 1
    return hits, evicted


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@given(capacity=st.integers(0, 6),
       requests=st.lists(st.lists(st.integers(0, 9), max_size=8), max_size=12))
@settings(max_examples=300, deadline=None)
def test_access_follows_the_one_key_at_a_time_rule_in_every_shape(capacity, requests):
    # The bulk path (leading hits, then new distinct keys) and the stepwise path must both
    # end where the rule ends: same hits, same keys in the same order, same eviction count.
    cache, order = KeyLRUCache(capacity), []
    evicted = 0
    for keys in requests:
        hits, gone = _reference_access(order, capacity, keys)
        evicted += gone
        assert cache.access(keys) == hits
        assert cache.keys() == order
    assert cache.evictions == evicted


def test_access_in_bulk_evicts_the_oldest_entries_in_order():
    cache = KeyLRUCache(capacity=4)
    cache.access(["a", "b", "c", "d"])
    assert cache.access(["c", "x", "y"]) == 1   # c moves up; a and b go, oldest first
    assert cache.keys() == ["d", "c", "x", "y"]
    assert cache.evictions == 2


def test_expired_entries_are_reported_least_recently_used_first():
    removed: list = []

    class Listener:
        def on_stored(self, keys, parent, token_ids): pass
        def on_removed(self, keys): removed.extend(keys)
        def on_cleared(self): pass

    cache = KeyLRUCache(capacity=4, ttl=10.0, refresh_on_hit=False, listener=Listener())
    cache.put("a", now=0.0)
    cache.put("b", now=1.0)
    cache.lookup("a", now=2.0)   # a is used again (its TTL is not renewed): b is older now
    assert cache.expire(now=11.0) == 2
    assert removed == ["b", "a"]


def test_without_a_ttl_nothing_expires():
    cache = KeyLRUCache(capacity=4)
    cache.put("a")
    assert cache.expire(now=1e9) == 0 and cache.keys() == ["a"]
