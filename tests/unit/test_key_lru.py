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
