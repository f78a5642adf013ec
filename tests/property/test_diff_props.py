"""Invariants of the block diff, for any two token sequences and any block size."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixroute.core.diagnostics.diff import common_prefix_length, diff_tokens

tokens = st.lists(st.integers(min_value=0, max_value=5), max_size=300)
block_sizes = st.integers(min_value=1, max_value=40)


def naive_common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(tokens, tokens, block_sizes)
def test_reusable_tokens_are_whole_blocks_and_never_pass_the_divergence(a, b, block_size):
    diff = diff_tokens(a, b, block_size)
    assert diff.reusable_tokens % block_size == 0
    assert diff.reusable_tokens == diff.reusable_blocks * block_size
    assert diff.reusable_tokens <= len(b)
    if diff.first_divergence_token is not None:
        assert diff.reusable_tokens <= diff.first_divergence_token
        assert diff.first_divergence_block == diff.first_divergence_token // block_size
    assert a[:diff.reusable_tokens] == b[:diff.reusable_tokens]


@given(tokens, block_sizes)
def test_identical_prompts_reuse_every_full_block(a, block_size):
    diff = diff_tokens(a, list(a), block_size)
    assert diff.first_divergence_token is None
    assert diff.reusable_tokens == len(a) // block_size * block_size
    assert diff.invalidated_fraction == 0.0


@given(tokens, tokens, block_sizes)
def test_reuse_is_the_longest_whole_block_prefix(a, b, block_size):
    diff = diff_tokens(a, b, block_size)
    shared = naive_common_prefix(a, b)
    assert diff.reusable_tokens == min(shared, len(b)) // block_size * block_size
    assert 0.0 <= diff.invalidated_fraction <= 1.0


@given(st.lists(st.integers(0, 3), max_size=2000), st.lists(st.integers(0, 3), max_size=2000))
def test_common_prefix_length_matches_a_token_by_token_scan(a, b):
    assert common_prefix_length(a, b) == naive_common_prefix(a, b)
    assert common_prefix_length(a, a + b) == len(a)
