"""Invariants of the prompt-cache economics formulas, for any valid prices and traffic."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from prefixroute.core.economics.advice import advise_ttl
from prefixroute.core.economics.formulas import (
    break_even_hit_rate,
    cost_multiplier,
    poisson_hit_probability,
)
from prefixroute.core.economics.presets import CachePolicy

multipliers = st.floats(min_value=0.0, max_value=10.0, allow_nan=False)
hit_rates = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)
rates = st.floats(min_value=0.0, max_value=10_000.0, allow_nan=False)
ttls = st.floats(min_value=1.0, max_value=86_400.0, allow_nan=False)


@st.composite
def write_read(draw):
    """A valid (write, read) pair: read never above write."""
    a, b = draw(multipliers), draw(multipliers)
    return max(a, b), min(a, b)


@given(write_read(), hit_rates)
def test_multiplier_lies_between_read_and_write(pair, hit_rate):
    write, read = pair
    multiplier = cost_multiplier(hit_rate, write, read)
    assert read - 1e-12 <= multiplier <= write + 1e-12


@given(st.floats(min_value=1.0, max_value=10.0, exclude_min=True),
       st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_break_even_hit_rate_makes_caching_cost_exactly_what_no_caching_costs(write, read):
    # A write premium (w > 1) and a read discount (r < 1): the case where h* is in [0, 1].
    h_star = break_even_hit_rate(write, read)
    assert 0.0 <= h_star <= 1.0
    assert math.isclose(cost_multiplier(h_star, write, read), 1.0, rel_tol=1e-9)


@given(st.floats(min_value=0.0, max_value=1.0), st.floats(min_value=0.0, max_value=1.0))
def test_without_write_premium_caching_never_costs_more(write, read_share):
    read = write * read_share
    assert break_even_hit_rate(write, read) == 0.0
    assert cost_multiplier(0.0, write, read) <= 1.0


@given(write_read(), hit_rates, hit_rates)
def test_more_hits_never_cost_more(pair, h1, h2):
    write, read = pair
    low, high = sorted((h1, h2))
    assert cost_multiplier(high, write, read) <= cost_multiplier(low, write, read) + 1e-12


@given(rates, rates, ttls)
def test_p_hit_is_monotone_in_request_rate(rate_a, rate_b, ttl):
    slow, fast = sorted((rate_a, rate_b))
    assert poisson_hit_probability(slow, ttl) <= poisson_hit_probability(fast, ttl)


@given(rates, ttls, ttls)
def test_p_hit_is_monotone_in_ttl(rate, ttl_a, ttl_b):
    short, long_ = sorted((ttl_a, ttl_b))
    assert poisson_hit_probability(rate, short) <= poisson_hit_probability(rate, long_)


@given(rates, ttls)
def test_p_hit_is_a_probability(rate, ttl):
    assert 0.0 <= poisson_hit_probability(rate, ttl) <= 1.0


@given(rates, st.integers(min_value=0, max_value=200_000), st.floats(min_value=0.0, max_value=100.0),
       write_read(), ttls)
def test_advice_picks_the_cheapest_option_and_never_costs_more_than_no_caching(
        rate, tokens, price, pair, ttl):
    write, read = pair
    policy = CachePolicy("p", ttl_seconds=ttl, write_multiplier=write, read_multiplier=read)
    advice = advise_ttl(rate, tokens, price, policies=(policy,))
    assert advice.best.usd_per_day == min(option.usd_per_day for option in advice.options)
    assert advice.best.usd_per_day <= advice.no_cache_usd_per_day
