"""The prefixroute mirror reads a prompt's stamps in doubling chunks: same stamps as one
lookup per block cut at the first block it lacks (hypothesis)."""

from hypothesis import given, settings, strategies as st

from prefixroute.core.routing.policies.prefixroute.mirror import _held_stamps


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.integers(0, 60), st.integers(0, 9), max_size=60),
       st.lists(st.integers(0, 60), max_size=80), st.integers(0, 90))
def test_chunked_scan_gives_the_stamps_up_to_the_first_missing_block(held, keys, end):
    whole = [held.get(key) for key in keys[:end]]
    if None in whole:
        whole = whole[:whole.index(None)]
    assert _held_stamps(held.get, keys, end) == whole
