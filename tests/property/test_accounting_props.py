"""Invariants of trace-driven provider-cache accounting, for any small trace."""

from __future__ import annotations

from array import array

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.economics.accounting import (
    Breakpoint,
    CacheModel,
    ProviderCacheReplay,
    account_trace,
)
from prefixroute.core.economics.presets import CachePolicy
from prefixroute.core.simulator.request import Request

BLOCK = 16
# Nested sharing: every prompt is a prefix of one long shared text, then one of two branches
# (so some requests share more than others), then text of its own.
SHARED = array("I", range(1, 4001))
BRANCHES = [array("I", range(100_001 + 10_000 * b, 100_001 + 10_000 * b + 1000)) for b in (0, 1)]

breakpoint_models = st.one_of(
    st.just(None),
    st.lists(st.sampled_from([Breakpoint("end"), Breakpoint("static"), Breakpoint("end", 320),
                              Breakpoint("absolute", 1024), Breakpoint("absolute", 2048)]),
             min_size=1, max_size=4, unique=True).map(tuple))


@st.composite
def traces(draw):
    n = draw(st.integers(min_value=1, max_value=25))
    requests = []
    t = 0.0
    for i in range(n):
        t += draw(st.floats(min_value=0, max_value=900, allow_nan=False))
        shared = draw(st.sampled_from([512, 1024, 2048, 3000]))
        branch = draw(st.integers(min_value=0, max_value=1))
        branch_tokens = draw(st.sampled_from([0, 320, 640]))
        suffix = draw(st.integers(min_value=0, max_value=600))
        tokens = (SHARED[:shared] + BRANCHES[branch][:branch_tokens]
                  + array("I", range(500_000 + 1000 * i, 500_000 + 1000 * i + suffix)))
        # The static region a request declares need not match what it shares with others.
        static = draw(st.sampled_from([shared, 512, 1024, 1600, 2048, 3000]))
        requests.append(Request(f"r{i}", t, len(tokens), 1, BLOCK, token_ids=tokens,
                                prefix_group=f"s{shared}", prefix_tokens=static))
    return requests


def fresh(requests):
    """Copies without keys, so each replay hashes its own."""
    return [Request(r.request_id, r.arrival_s, r.input_tokens, 1, BLOCK, token_ids=r.token_ids,
                    prefix_group=r.prefix_group, prefix_tokens=r.prefix_tokens) for r in requests]


@settings(max_examples=150, deadline=None)
@given(traces(), breakpoint_models, st.sampled_from([0, 512, 1024, 4096]),
       st.sampled_from([60.0, 300.0, 3600.0]))
def test_written_plus_read_plus_uncached_is_the_input(requests, breakpoints, min_tokens, ttl):
    policy = CachePolicy("p", ttl, 1.25, 0.1)
    replay = ProviderCacheReplay(policy, CacheModel(breakpoints, 20, min_tokens))
    for r in requests:
        charge = replay.charge(r)
        assert min(charge.written_tokens, charge.read_tokens, charge.uncached_tokens) >= 0
        assert charge.written_tokens + charge.read_tokens + charge.uncached_tokens == r.input_tokens
    total = replay.result().total
    assert total.written_tokens + total.read_tokens + total.uncached_tokens == sum(
        r.input_tokens for r in requests)


@settings(max_examples=150, deadline=None)
@given(traces(), breakpoint_models, st.sampled_from([0, 1024]),
       st.floats(min_value=1, max_value=3600), st.floats(min_value=1, max_value=3600))
def test_a_longer_ttl_never_lowers_the_hits(requests, breakpoints, min_tokens, a, b):
    short, long = min(a, b), max(a, b)
    model = CacheModel(breakpoints, 20, min_tokens)
    hits_short = account_trace(fresh(requests), CachePolicy("s", short, 1.25, 0.1), model).total
    hits_long = account_trace(fresh(requests), CachePolicy("l", long, 1.25, 0.1), model).total
    # With refresh on hit, every entry lives at least as long under the longer TTL, and the
    # entries that exist are the same, so every read stays a read at least as deep.
    assert hits_long.read_requests >= hits_short.read_requests
    assert hits_long.read_tokens >= hits_short.read_tokens
