"""Metrics: percentiles and the ideal cache, checkable by hand."""

import pytest

from prefixroute.core.simulator.metrics import max_skew, percentile, ideal_reuse
from prefixroute.core.simulator.request import Request


def test_percentiles_interpolate_between_order_statistics():
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == 2.5          # rank 1.5 between 2 and 3
    assert percentile(values, 90) == pytest.approx(3.7)  # rank 2.7: 3 + 0.7
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([], 50) is None


def test_max_skew_is_max_minus_min_assignments():
    assert max_skew([10, 5, 5]) == 5
    assert max_skew([7, 7, 6]) == 1


def request(name, keys, n):
    r = Request(name, 0.0, n, 1, 16)
    r.block_keys = keys
    return r


def test_ideal_cache_reuses_every_earlier_block_under_the_last_token_rule():
    requests = [
        request("a", ["x", "y"], 32),        # first sight: 0
        request("b", ["x", "y"], 32),        # both cached, but the last token is recomputed:
                                             # at most (32 - 1) // 16 = 1 block -> 16
        request("c", ["x", "y", "z"], 50),   # 2 blocks -> 32
        request("d", ["q", "y"], 40),        # different first block: nothing
    ]
    assert list(ideal_reuse(requests)) == [0, 16, 32, 0]
