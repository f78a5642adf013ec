"""Provider prompt-cache economics: write premium, read discount, TTL (docs/concepts.md,
"Provider prompt caching and its cost").

- :mod:`.formulas`: cost multiplier, break-even hit rate, Poisson P(hit), cost per day.
- :mod:`.presets`: provider pricing as dated, overridable data; TTL parsing.
- :mod:`.advice`: per-prefix TTL advice (cheapest option, "do not cache", pre-warming).
- :mod:`.repro`: the economics worked example's report, as ``prefixroute economics --json``
  prints it.

Trace-driven accounting (:mod:`.accounting`) and the fleet planner (:mod:`.planner`) build on
these.
"""

from prefixroute.core.economics.advice import CacheOption, TTLAdvice, advise_ttl
from prefixroute.core.economics.formulas import (
    break_even_hit_rate,
    cost_multiplier,
    poisson_hit_probability,
    prefix_cost_per_day,
    storage_cost,
)
from prefixroute.core.economics.presets import (
    PRESETS,
    RATE_TABLE_POLICIES,
    CachePolicy,
    parse_ttl,
    preset,
)
from prefixroute.core.economics.repro import WorkedExample, economics_report, repro_economics

__all__ = [
    "PRESETS",
    "RATE_TABLE_POLICIES",
    "CacheOption",
    "CachePolicy",
    "TTLAdvice",
    "WorkedExample",
    "advise_ttl",
    "break_even_hit_rate",
    "cost_multiplier",
    "economics_report",
    "parse_ttl",
    "poisson_hit_probability",
    "prefix_cost_per_day",
    "preset",
    "repro_economics",
    "storage_cost",
]
