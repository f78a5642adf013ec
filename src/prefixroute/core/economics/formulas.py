"""Provider prompt-cache formulas (docs/concepts.md, "Provider prompt caching and its cost").

Prices are relative to the provider's base input price: a cache write costs ``w`` times it, a
cache read ``r`` times it, a miss without caching 1 times it. Everything here is a pure function
of numbers; presets, advice and the CLI build on these and never re-derive them.

Units, fixed across the package so no caller has to guess: request rates are per hour, TTLs are
in seconds, prices are USD per million tokens (storage: USD per million tokens per hour).
"""

from __future__ import annotations

import math

from prefixroute.core.errors import ConfigError

SECONDS_PER_HOUR = 3600.0
HOURS_PER_DAY = 24.0
TOKENS_PER_MTOK = 1_000_000


def require_non_negative(what: str, value: float) -> float:
    """Return ``value`` as a float, or raise :class:`ConfigError` if it is negative or not finite.

    Rates, prices, token counts and multipliers are all quantities that cannot go below zero;
    a NaN or infinity is always an input mistake, never a meaningful price.
    """
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{what} must be a finite number, got {value}")
    if value < 0:
        raise ConfigError(f"{what} must be non-negative, got {value:g}")
    return value


def require_multipliers(write: float, read: float) -> tuple[float, float]:
    """Validate a (write, read) multiplier pair and return it as floats.

    A read above the write would mean a hit costs more than the miss that stored it: no provider
    prices caching that way, and the break-even formula has no meaning there.
    """
    write = require_non_negative("write multiplier", write)
    read = require_non_negative("read multiplier", read)
    if read > write:
        raise ConfigError(f"read multiplier {read:g} is above write multiplier {write:g}; "
                          f"a cache read must not cost more than the write that stored it")
    return write, read


def cost_multiplier(hit_rate: float, write: float, read: float) -> float:
    """Cost of a cached prefix relative to not caching: ``h*r + (1-h)*w``.

    ``hit_rate`` is the token hit rate h in [0, 1]: hits are billed as reads, misses as writes.
    """
    write, read = require_multipliers(write, read)
    hit_rate = require_non_negative("hit rate", hit_rate)
    if hit_rate > 1:
        raise ConfigError(f"hit rate must be at most 1, got {hit_rate:g}")
    return hit_rate * read + (1.0 - hit_rate) * write


def break_even_hit_rate(write: float, read: float) -> float:
    """Token hit rate above which caching is cheaper: ``h* = max(0, (w-1)/(w-r))``.

    Solving ``h*r + (1-h)*w = 1`` gives ``(w-1)/(w-r)``; with no write premium (w <= 1) caching
    never costs more, so h* is 0. When ``w == r > 1`` every token costs more than without caching
    and the result is ``math.inf``; any result above 1 likewise means caching never pays.
    """
    write, read = require_multipliers(write, read)
    if write <= 1.0:
        return 0.0
    if write == read:
        return math.inf
    return max(0.0, (write - 1.0) / (write - read))


def poisson_hit_probability(requests_per_hour: float, ttl_seconds: float) -> float:
    """P(hit) = 1 - exp(-lambda*T) for Poisson arrivals with refresh-on-hit TTL.

    A request hits when the previous request for the same prefix came less than T ago (every
    request, hit or miss, leaves the prefix cached for T). Inter-arrival times of a Poisson process
    at rate lambda are exponential, so that happens with probability ``1 - exp(-lambda*T)``.
    Assumes steady traffic: no day/night cycle, no bursts.
    """
    rate = require_non_negative("request rate (per hour)", requests_per_hour)
    ttl = require_non_negative("TTL (seconds)", ttl_seconds)
    if ttl == 0:
        raise ConfigError("TTL must be positive, got 0")
    return 1.0 - math.exp(-rate * ttl / SECONDS_PER_HOUR)


def prefix_cost_per_day(requests_per_day: float, prefix_tokens: float, price_per_mtok: float,
                        multiplier: float = 1.0) -> float:
    """USD per day to send one prefix ``requests_per_day`` times at a cost ``multiplier``.

    ``multiplier`` is :func:`cost_multiplier` (1.0 means no caching). Only the prefix tokens are
    counted: the volatile suffix costs the same whatever the caching policy.
    """
    requests = require_non_negative("requests per day", requests_per_day)
    tokens = require_non_negative("prefix tokens", prefix_tokens)
    price = require_non_negative("price per million input tokens", price_per_mtok)
    multiplier = require_non_negative("cost multiplier", multiplier)
    return requests * tokens / TOKENS_PER_MTOK * price * multiplier


def storage_cost(prefix_tokens: float, usd_per_mtok_hour: float, hours: float) -> float:
    """USD to keep an explicit cache object of ``prefix_tokens`` alive for ``hours``.

    Explicit cache objects (Gemini-style) bill storage per million tokens per hour
    on top of the writes and reads.
    """
    tokens = require_non_negative("prefix tokens", prefix_tokens)
    price = require_non_negative("storage price (USD per million tokens per hour)", usd_per_mtok_hour)
    hours = require_non_negative("storage hours", hours)
    return tokens / TOKENS_PER_MTOK * price * hours
