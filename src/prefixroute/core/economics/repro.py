"""The economics worked example's report (docs/concepts.md, example 5), computed from the
formulas.

:func:`economics_report` builds it for any policies, rates and worked example (the CLI's flags);
:func:`repro_economics` is it on the example's defaults, for ``prefixroute repro``. Both return the
structure ``prefixroute economics --json`` prints:

``policies``
    list of :meth:`CachePolicy.as_dict` (name, TTL, multipliers, ``as_of``, ``source``).
``break_even``
    policy name -> break-even token hit rate as a fraction (``None`` when caching never pays).
``rates``
    one row per request rate: ``{"requests_per_hour": 1.0, "<policy>": {"p_hit", "multiplier"}}``.
``worked_example``
    ``inputs`` (prefixes, prefix_tokens, requests_per_day, price_per_mtok,
    requests_per_hour_per_prefix), ``no_caching_usd_per_day``, and per policy name
    ``{"p_hit", "multiplier", "usd_per_day"}``.

Figures are unrounded; rounding is for display only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from prefixroute.core.economics.formulas import (
    HOURS_PER_DAY,
    break_even_hit_rate,
    cost_multiplier,
    poisson_hit_probability,
    prefix_cost_per_day,
    require_non_negative,
    storage_cost,
)
from prefixroute.core.economics.presets import RATE_TABLE_POLICIES, CachePolicy
from prefixroute.core.errors import ConfigError

# The economics example: from "about once an hour" to "ten a minute", per prefix.
DEFAULT_RATES_PER_HOUR: tuple[float, ...] = (1, 6, 12, 60, 600)

# Report fields that sit beside the per-policy entries, so no policy may take their names.
_RESERVED_KEYS = {"requests_per_hour", "inputs", "no_caching_usd_per_day"}


@dataclass(frozen=True, slots=True)
class WorkedExample:
    """A fleet of equally popular prefixes; defaults are the economics example's (and the
    design scenario's): 200 tenant prefixes of 10,000 tokens, 50,000 requests a day, $3 per million
    input tokens. Traffic is spread evenly over the prefixes and over 24 hours."""

    prefixes: int = 200
    prefix_tokens: int = 10_000
    requests_per_day: float = 50_000
    price_per_mtok: float = 3.0

    def __post_init__(self) -> None:
        if self.prefixes < 1:
            raise ConfigError(f"number of prefixes must be at least 1, got {self.prefixes}")
        require_non_negative("prefix tokens", self.prefix_tokens)
        require_non_negative("requests per day", self.requests_per_day)
        require_non_negative("price per million input tokens", self.price_per_mtok)

    @property
    def requests_per_hour_per_prefix(self) -> float:
        return self.requests_per_day / self.prefixes / HOURS_PER_DAY

    def as_dict(self) -> dict:
        return {
            "prefixes": self.prefixes,
            "prefix_tokens": self.prefix_tokens,
            "requests_per_day": self.requests_per_day,
            "price_per_mtok": self.price_per_mtok,
            "requests_per_hour_per_prefix": self.requests_per_hour_per_prefix,
        }


def _unique(policies: Sequence[CachePolicy]) -> None:
    names = [policy.name for policy in policies]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ConfigError(f"cache policy names must be unique, repeated: {', '.join(duplicates)}")
    reserved = sorted(set(names) & _RESERVED_KEYS)
    if reserved:
        raise ConfigError(f"cache policy name {reserved[0]!r} is reserved for a report field")


def rate_row(requests_per_hour: float, policies: Sequence[CachePolicy]) -> dict:
    """P(hit) and cost multiplier of each policy at one per-prefix request rate."""
    row: dict = {"requests_per_hour": require_non_negative("request rate (per hour)", requests_per_hour)}
    for policy in policies:
        p_hit = poisson_hit_probability(requests_per_hour, policy.ttl_seconds)
        row[policy.name] = {
            "p_hit": p_hit,
            "multiplier": cost_multiplier(p_hit, policy.write_multiplier, policy.read_multiplier),
        }
    return row


def worked_example_costs(example: WorkedExample, policies: Sequence[CachePolicy]) -> dict:
    """USD per day for the whole fleet of ``example`` without caching and under each policy."""
    rate = example.requests_per_hour_per_prefix
    result: dict = {
        "inputs": example.as_dict(),
        "no_caching_usd_per_day": prefix_cost_per_day(
            example.requests_per_day, example.prefix_tokens, example.price_per_mtok),
    }
    for policy in policies:
        p_hit = poisson_hit_probability(rate, policy.ttl_seconds)
        multiplier = cost_multiplier(p_hit, policy.write_multiplier, policy.read_multiplier)
        # Explicit objects pay storage for the fraction of the day they are alive (= P(hit)).
        storage = example.prefixes * storage_cost(
            example.prefix_tokens, policy.storage_usd_per_mtok_hour, HOURS_PER_DAY * p_hit)
        result[policy.name] = {
            "p_hit": p_hit,
            "multiplier": multiplier,
            "usd_per_day": prefix_cost_per_day(example.requests_per_day, example.prefix_tokens,
                                               example.price_per_mtok, multiplier) + storage,
        }
    return result


def economics_report(policies: Sequence[CachePolicy] = RATE_TABLE_POLICIES,
                     rates_per_hour: Sequence[float] = DEFAULT_RATES_PER_HOUR,
                     example: WorkedExample = WorkedExample()) -> dict:
    """Break-even per policy, the P(hit)/multiplier table by rate, and the worked example."""
    _unique(policies)
    break_even = {}
    for policy in policies:
        value = break_even_hit_rate(policy.write_multiplier, policy.read_multiplier)
        break_even[policy.name] = value if math.isfinite(value) else None
    return {
        "policies": [policy.as_dict() for policy in policies],
        "break_even": break_even,
        "rates": [rate_row(rate, policies) for rate in rates_per_hour],
        "worked_example": worked_example_costs(example, policies),
    }


def repro_economics() -> dict:
    """The economics example on its own defaults: the JSON of ``prefixroute economics --json``."""
    return economics_report()
