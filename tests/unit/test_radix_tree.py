"""The SGLang-style radix tree, as specifications."""

import pytest

from prefixroute.core.caches.radix_tree import RadixCache
from prefixroute.core.errors import ConfigError


def test_longest_prefix_match_splits_the_node_where_the_match_ends():
    tree = RadixCache(100)
    tree.insert([1, 2, 3, 4, 5])
    matched, node = tree.match_prefix([1, 2, 3, 9])
    assert matched == 3
    assert node.key == (1, 2, 3) and list(node.children.values())[0].key == (4, 5)
    assert tree.total_units == 5  # a split moves no data


def test_page_size_aligns_matches_down_to_whole_pages():
    tree = RadixCache(100, page_size=4)
    tree.insert(list(range(10)))  # only 8 units (2 pages) are stored
    assert tree.total_units == 8
    assert tree.match_prefix(list(range(7)) + [99])[0] == 4


def test_evicts_least_recently_used_leaves_first():
    tree = RadixCache(6)
    tree.insert([1, 1, 1])
    tree.insert([2, 2, 2])
    tree.match_prefix([1, 1, 1])          # 1-branch now more recent
    tree.insert([3, 3, 3])                # needs 3 units: the 2-branch goes
    assert tree.match([2, 2, 2]) == 0 and tree.match([1, 1, 1]) == 3


def test_lfu_keeps_the_most_hit_leaf():
    tree = RadixCache(6, eviction_policy="lfu")
    tree.insert([1, 1, 1])
    tree.insert([2, 2, 2])
    for _ in range(3):
        tree.match_prefix([2, 2, 2])
    tree.match_prefix([1, 1, 1])  # most recent, but hit once
    tree.insert([3, 3, 3])
    assert tree.match([1, 1, 1]) == 0 and tree.match([2, 2, 2]) == 3


def test_locked_nodes_are_never_evicted():
    tree = RadixCache(6)
    tree.insert([1, 1, 1])
    _, node = tree.match_prefix([1, 1, 1])
    tree.inc_lock_ref(node)
    tree.insert([2, 2, 2])
    tree.insert([3, 3, 3])  # only the unlocked 2-branch can go
    assert tree.match([1, 1, 1]) == 3 and tree.match([3, 3, 3]) == 3
    tree.dec_lock_ref(node)
    assert tree.protected_units == 0


def test_namespaces_never_share_prefixes():
    tree = RadixCache(100)
    tree.insert([1, 2, 3], namespace="salt-a")
    assert tree.match([1, 2, 3], namespace="salt-b") == 0
    assert tree.match([1, 2, 3]) == 0
    assert tree.match([1, 2, 3], namespace="salt-a") == 3


def test_admit_applies_the_last_token_rule_and_reports_cached_tokens():
    tree = RadixCache(100, page_size=4)
    tree.admit("a", list(range(12)), 12)
    tree.commit("a", list(range(12)), 12)
    tree.release("a")
    assert tree.admit("b", list(range(12)), 12) == 8  # floor(11 / 4) pages


def test_parent_becomes_a_leaf_and_evictable_after_its_children_go():
    tree = RadixCache(5)
    tree.insert([1, 2, 3])
    tree.insert([1, 2, 4])  # splits: (1,2) -> (3), (4)
    assert tree.evict_units(4) == 4
    assert tree.total_units == 0


def test_bad_settings():
    with pytest.raises(ConfigError):
        RadixCache(-1)
    with pytest.raises(ConfigError):
        RadixCache(10, page_size=0)
    with pytest.raises(ConfigError):
        RadixCache(10, eviction_policy="random")
