"""Per-prefix TTL advice: which cache option is cheapest for one prefix's traffic.

Given a prefix's request rate, length and base input price, every option is costed for one day of
steady traffic (Poisson arrivals, each hit refreshes the TTL, no day/night cycle):

- ``no_cache``: every request pays the base price (multiplier 1).
- each cache policy as is: P(hit) = 1 - exp(-lambda*T), multiplier ``h*r + (1-h)*w``; explicit
  cache objects also pay storage while alive, which under refresh-on-use is a fraction P(hit) of
  the day (Poisson arrivals see time averages, so the chance a request finds the object alive
  equals the fraction of time it is alive).
- each policy *pre-warmed* (``<name>+prewarm``): something keeps the prefix hot all day, so every
  real request is a read. For a TTL cache that is one keep-alive request per TTL period, each
  landing before expiry and so billed as a read (it refreshes the TTL like any hit), plus one write
  a day to start. For an explicit object it is 24 hours of storage plus one creation a day. The
  fixed schedule is an upper bound: a pinger that skips periods with real traffic pays less.

The cheapest option wins, ties going to the simpler one (no caching, then plain, then pre-warm).
This yields "do not cache" below break-even, and "pre-warm only the hottest": pinging pays only
when a prefix is hot enough that the misses it removes cost more than the pings, yet not so hot
that it never misses anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from prefixroute.core.economics.formulas import (
    HOURS_PER_DAY,
    SECONDS_PER_HOUR,
    break_even_hit_rate,
    cost_multiplier,
    poisson_hit_probability,
    prefix_cost_per_day,
    require_non_negative,
    storage_cost,
)
from prefixroute.core.economics.presets import ADVICE_POLICIES, CachePolicy

NO_CACHE = "no_cache"
PREWARM_SUFFIX = "+prewarm"
HOT_P_HIT = 0.99  # above this a prefix is "already hot": pre-warming can only add ping cost


@dataclass(frozen=True, slots=True)
class CacheOption:
    """One option costed for one prefix and one day.

    ``multiplier`` is the per-request cost multiplier ``h*r + (1-h)*w`` for the real requests;
    ``overhead_usd_per_day`` is what comes on top (storage, keep-alive pings, the daily warm-up
    write); ``usd_per_day`` is the total, the number options are compared by.
    """

    name: str
    policy: CachePolicy | None
    prewarm: bool
    p_hit: float
    multiplier: float
    overhead_usd_per_day: float
    usd_per_day: float
    note: str = ""

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "policy": self.policy.name if self.policy else None,
            "prewarm": self.prewarm,
            "p_hit": self.p_hit,
            "multiplier": self.multiplier,
            "overhead_usd_per_day": self.overhead_usd_per_day,
            "usd_per_day": self.usd_per_day,
            "note": self.note,
        }


@dataclass(frozen=True, slots=True)
class TTLAdvice:
    """Every option for one prefix, the cheapest (``best``) and why, in ``notes``."""

    requests_per_hour: float
    prefix_tokens: float
    price_per_mtok: float
    options: tuple[CacheOption, ...]
    best: CacheOption
    notes: tuple[str, ...]

    @property
    def no_cache_usd_per_day(self) -> float:
        return self.options[0].usd_per_day

    def option(self, name: str) -> CacheOption:
        for candidate in self.options:
            if candidate.name == name:
                return candidate
        raise KeyError(name)

    def as_dict(self) -> dict:
        return {
            "requests_per_hour": self.requests_per_hour,
            "prefix_tokens": self.prefix_tokens,
            "price_per_mtok": self.price_per_mtok,
            "no_cache_usd_per_day": self.no_cache_usd_per_day,
            "best": self.best.name,
            "options": [option.as_dict() for option in self.options],
            "notes": list(self.notes),
        }


def _daily_requests(requests_per_hour: float) -> float:
    return require_non_negative("request rate (per hour)", requests_per_hour) * HOURS_PER_DAY


def no_cache_option(requests_per_hour: float, prefix_tokens: float,
                    price_per_mtok: float) -> CacheOption:
    usd = prefix_cost_per_day(_daily_requests(requests_per_hour), prefix_tokens, price_per_mtok)
    return CacheOption(NO_CACHE, None, False, 0.0, 1.0, 0.0, usd, "every request at the base price")


def policy_option(policy: CachePolicy, requests_per_hour: float, prefix_tokens: float,
                  price_per_mtok: float) -> CacheOption:
    """``policy`` left to itself: hits only when the previous request came within the TTL."""
    p_hit = poisson_hit_probability(requests_per_hour, policy.ttl_seconds)
    multiplier = cost_multiplier(p_hit, policy.write_multiplier, policy.read_multiplier)
    requests = prefix_cost_per_day(_daily_requests(requests_per_hour), prefix_tokens,
                                   price_per_mtok, multiplier)
    overhead = storage_cost(prefix_tokens, policy.storage_usd_per_mtok_hour, HOURS_PER_DAY * p_hit)
    break_even = break_even_hit_rate(policy.write_multiplier, policy.read_multiplier)
    if p_hit < break_even:
        note = f"P(hit) {p_hit:.0%} is below the {break_even:.1%} break-even"
    else:
        note = f"P(hit) {p_hit:.0%} is at or above the {break_even:.1%} break-even"
    if policy.explicit:
        note += "; storage billed for the hours the object is alive"
    return CacheOption(policy.name, policy, False, p_hit, multiplier, overhead, requests + overhead, note)


def prewarm_option(policy: CachePolicy, requests_per_hour: float, prefix_tokens: float,
                   price_per_mtok: float) -> CacheOption:
    """``policy`` kept hot all day, so every real request is a read (see the module docstring)."""
    prefix_once = prefix_cost_per_day(1, prefix_tokens, price_per_mtok)
    warm_up = prefix_once * policy.write_multiplier
    if policy.explicit:
        keep_alive = storage_cost(prefix_tokens, policy.storage_usd_per_mtok_hour, HOURS_PER_DAY)
        how = "object kept alive all day (storage 24 h, one creation)"
    else:
        pings = HOURS_PER_DAY * SECONDS_PER_HOUR / policy.ttl_seconds
        keep_alive = pings * prefix_once * policy.read_multiplier
        how = f"{pings:g} keep-alive requests a day, one per {policy.ttl} TTL, each billed as a read"
    requests = prefix_cost_per_day(_daily_requests(requests_per_hour), prefix_tokens,
                                   price_per_mtok, policy.read_multiplier)
    overhead = keep_alive + warm_up
    return CacheOption(policy.name + PREWARM_SUFFIX, policy, True, 1.0, policy.read_multiplier,
                       overhead, requests + overhead, how)


def advise_ttl(requests_per_hour: float, prefix_tokens: float, price_per_mtok: float,
               policies: Sequence[CachePolicy] = ADVICE_POLICIES) -> TTLAdvice:
    """Cost every option for one prefix over one day and pick the cheapest.

    ``requests_per_hour`` is the prefix's own arrival rate, ``prefix_tokens`` its cacheable
    length, ``price_per_mtok`` the base input price in USD per million tokens.
    """
    plain = [policy_option(p, requests_per_hour, prefix_tokens, price_per_mtok) for p in policies]
    warmed = [prewarm_option(p, requests_per_hour, prefix_tokens, price_per_mtok) for p in policies]
    options = (no_cache_option(requests_per_hour, prefix_tokens, price_per_mtok), *plain, *warmed)
    best = min(options, key=lambda option: option.usd_per_day)  # min keeps the first of ties
    return TTLAdvice(requests_per_hour, prefix_tokens, price_per_mtok, options, best,
                     _explain(best, options[0], plain, warmed))


def _explain(best: CacheOption, no_cache: CacheOption, plain: list[CacheOption],
             warmed: list[CacheOption]) -> tuple[str, ...]:
    notes = []
    if best is no_cache:
        cheapest = min(plain + warmed, key=lambda option: option.usd_per_day, default=None)
        if cheapest is None:
            notes.append("do not cache: no cache policy given")
        else:
            notes.append(f"do not cache: the cheapest caching option, {cheapest.name} at "
                         f"${cheapest.usd_per_day:,.2f}/day, does not beat sending the prefix "
                         f"uncached at ${no_cache.usd_per_day:,.2f}/day")
    else:
        notes.append(f"cheapest: {best.name} at ${best.usd_per_day:,.2f}/day against "
                     f"${no_cache.usd_per_day:,.2f}/day uncached")
    # Pre-warm verdict for the policy the decision rests on: the winner's, or else the cheapest.
    if best.policy is not None:
        family_name = best.policy.name
    elif plain:
        family_name = min(plain, key=lambda option: option.usd_per_day).name
    else:
        return tuple(notes)
    left_alone = next(option for option in plain if option.name == family_name)
    kept_hot = next(option for option in warmed if option.policy.name == family_name)
    saved = left_alone.usd_per_day - (kept_hot.usd_per_day - kept_hot.overhead_usd_per_day)
    cost = kept_hot.overhead_usd_per_day
    if cost < saved:
        notes.append(f"pre-warming {family_name} pays: keeping it hot costs ${cost:,.2f}/day and "
                     f"removes ${saved:,.2f}/day of misses")
    elif left_alone.p_hit >= HOT_P_HIT:
        notes.append(f"{family_name} is already hot (P(hit) {left_alone.p_hit:.0%}): "
                     f"pre-warming would only add ${cost:,.2f}/day")
    else:
        notes.append(f"pre-warming {family_name} does not pay: keeping it hot costs ${cost:,.2f}/day, "
                     f"more than the ${max(saved, 0.0):,.2f}/day of misses it removes; "
                     f"pre-warm only hotter prefixes")
    return tuple(notes)
