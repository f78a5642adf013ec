"""Provider cache pricing as data: TTL, write and read multipliers, storage price.

The numbers are *example multipliers in the style of Oct 2026 price lists*, not
quotes from any provider: prices change and differ by model. Each preset says when and where its
numbers come from; every field can be overridden (``dataclasses.replace`` or :func:`preset`) and
the CLI takes ``--write``, ``--read`` and ``--ttl``.

Policy names are stable keys (JSON output, ``prefixroute repro``):

==============  =====  =====  =====  ===========================================================
name            TTL    write  read   meaning
==============  =====  =====  =====  ===========================================================
``5m_1.25x``    5 min  1.25x  0.1x   short TTL with a write premium (Anthropic-style default)
``1h_2x``       1 h    2.0x   0.1x   long TTL, higher write premium (Anthropic-style 1-hour)
``5m_1.0x``     5 min  1.0x   0.1x   no write premium (OpenAI-style automatic caching)
``explicit_1h`` 1 h    1.0x   0.1x   explicit cache object plus storage per Mtok-hour (Gemini-style)
==============  =====  =====  =====  ===========================================================
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace

from prefixroute.core.economics.formulas import (
    require_multipliers,
    require_non_negative,
)
from prefixroute.core.errors import ConfigError

AS_OF = "Oct 2026"

_TTL_UNITS = {
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": 86400.0, "day": 86400.0, "days": 86400.0,
}
_TTL_PATTERN = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([A-Za-z]*)\s*$")


def parse_ttl(text: str) -> float:
    """Parse a TTL such as ``"5m"``, ``"1h"``, ``"300s"`` or ``"1.5h"`` into seconds.

    A unit is required (s, m, h or d, or their long forms): a bare ``"300"`` is ambiguous between
    seconds and minutes, and guessing wrong is a 60x pricing error.
    """
    match = _TTL_PATTERN.match(text)
    if not match:
        raise ConfigError(f"cannot read TTL {text!r}: expected a number and a unit, e.g. 5m, 1h, 300s")
    number, unit = match.groups()
    if not unit:
        raise ConfigError(f"TTL {text!r} has no unit: write e.g. 300s, 5m or 1h")
    factor = _TTL_UNITS.get(unit.lower())
    if factor is None:
        raise ConfigError(f"unknown TTL unit {unit!r} in {text!r}: use s, m, h or d (e.g. 5m, 1h, 300s)")
    seconds = float(number) * factor
    if seconds <= 0:
        raise ConfigError(f"TTL must be positive, got {text!r}")
    return seconds


def format_ttl(seconds: float) -> str:
    """The shortest exact spelling of a TTL in the largest whole unit: 300 -> ``"5m"``."""
    for unit, factor in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if seconds >= factor and seconds % factor == 0:
            return f"{seconds / factor:g}{unit}"
    return f"{seconds:g}s"


def format_multiplier(value: float) -> str:
    """``1.25 -> "1.25x"``, ``2 -> "2.0x"``: at least one decimal, as price lists write them."""
    text = f"{value:g}"
    if "." not in text and "e" not in text:
        text += ".0"
    return f"{text}x"


@dataclass(frozen=True, slots=True)
class CachePolicy:
    """One way a provider prices a cached prefix, relative to its base input price.

    Every request that uses the prefix refreshes its TTL (for explicit cache
    objects that means the application extends the TTL on use). ``storage_usd_per_mtok_hour`` is
    0 for implicit caches and the hourly storage price for explicit cache objects. ``as_of`` and
    ``source`` say where the numbers come from; they are examples, never hard truths.
    """

    name: str
    ttl_seconds: float
    write_multiplier: float
    read_multiplier: float
    storage_usd_per_mtok_hour: float = 0.0
    as_of: str = AS_OF
    source: str = ""

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a cache policy needs a name")
        ttl = require_non_negative(f"{self.name}: TTL (seconds)", self.ttl_seconds)
        if ttl == 0 or not math.isfinite(ttl):
            raise ConfigError(f"{self.name}: TTL must be positive, got {self.ttl_seconds}")
        require_multipliers(self.write_multiplier, self.read_multiplier)
        require_non_negative(f"{self.name}: storage price", self.storage_usd_per_mtok_hour)

    @property
    def ttl(self) -> str:
        return format_ttl(self.ttl_seconds)

    @property
    def explicit(self) -> bool:
        """True for explicit cache objects, which bill storage while they live."""
        return self.storage_usd_per_mtok_hour > 0

    def describe(self) -> str:
        """Human summary, e.g. ``"5m TTL, write 1.25x, read 0.1x"``."""
        text = (f"{self.ttl} TTL, write {format_multiplier(self.write_multiplier)}, "
                f"read {format_multiplier(self.read_multiplier)}")
        if self.explicit:
            text += f", storage ${self.storage_usd_per_mtok_hour:g}/Mtok/hour"
        if self.write_multiplier <= 1.0:
            text += ", no write premium"
        return text

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "ttl": self.ttl,
            "ttl_seconds": self.ttl_seconds,
            "write_multiplier": self.write_multiplier,
            "read_multiplier": self.read_multiplier,
            "storage_usd_per_mtok_hour": self.storage_usd_per_mtok_hour,
            "as_of": self.as_of,
            "source": self.source,
        }


_STYLE = f"Example multipliers in the style of {AS_OF} price lists, not a quote"

FIVE_MINUTE = CachePolicy(
    name="5m_1.25x", ttl_seconds=300, write_multiplier=1.25, read_multiplier=0.1,
    source=f"{_STYLE}: 5-minute TTL with a 1.25x write premium and 0.1x reads, as "
           "Anthropic-style cache_control breakpoints price their default TTL.",
)
ONE_HOUR = CachePolicy(
    name="1h_2x", ttl_seconds=3600, write_multiplier=2.0, read_multiplier=0.1,
    source=f"{_STYLE}: 1-hour TTL with a 2x write premium and 0.1x reads, as "
           "Anthropic-style APIs price their extended TTL.",
)
NO_WRITE_PREMIUM = CachePolicy(
    name="5m_1.0x", ttl_seconds=300, write_multiplier=1.0, read_multiplier=0.1,
    source=f"{_STYLE}: no write premium, 0.1x reads, a few minutes of retention, as "
           "OpenAI-style automatic prefix caching prices it.",
)
EXPLICIT_OBJECT = CachePolicy(
    name="explicit_1h", ttl_seconds=3600, write_multiplier=1.0, read_multiplier=0.1,
    storage_usd_per_mtok_hour=1.0,
    source=f"{_STYLE}: Gemini-style explicit cache object, created at the base input price, "
           "read at 0.1x, default TTL 1 hour, storage billed per million tokens per hour "
           "($1.00 is an example; it varies by model).",
)

PRESETS: dict[str, CachePolicy] = {
    policy.name: policy for policy in (FIVE_MINUTE, ONE_HOUR, NO_WRITE_PREMIUM, EXPLICIT_OBJECT)
}

# The three policies of the economics worked example, in its column order.
RATE_TABLE_POLICIES: tuple[CachePolicy, ...] = (FIVE_MINUTE, ONE_HOUR, NO_WRITE_PREMIUM)

# Options per-prefix advice weighs by default: the three above plus the explicit cache object.
ADVICE_POLICIES: tuple[CachePolicy, ...] = (FIVE_MINUTE, ONE_HOUR, NO_WRITE_PREMIUM, EXPLICIT_OBJECT)


def preset(name: str, **overrides: object) -> CachePolicy:
    """A preset by name, with any field overridden (validated like a new policy).

    >>> preset("5m_1.25x", read_multiplier=0.05).read_multiplier
    0.05
    """
    try:
        base = PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown cache policy preset {name!r}; known: {', '.join(PRESETS)}") from None
    return replace(base, **overrides) if overrides else base


def custom_policy(ttl_seconds: float, write_multiplier: float, read_multiplier: float,
                  base: tuple[CachePolicy, ...] = RATE_TABLE_POLICIES) -> tuple[CachePolicy, ...]:
    """``base`` with one policy added, or overridden when a base policy has the same TTL and write.

    Matching on (TTL, write) lets ``--read 0.05`` re-price the 5-minute preset under its stable
    name; anything else is a new policy named ``<ttl>_<write>x`` (e.g. ``10m_1.5x``) appended
    after the presets.
    """
    for index, policy in enumerate(base):
        if policy.ttl_seconds == ttl_seconds and policy.write_multiplier == write_multiplier:
            if policy.read_multiplier == read_multiplier:
                return base
            changed = replace(policy, read_multiplier=read_multiplier, as_of="user input",
                              source=f"{policy.source} Read multiplier overridden by the user.")
            return base[:index] + (changed,) + base[index + 1:]
    name = f"{format_ttl(ttl_seconds)}_{write_multiplier:g}x"
    if any(policy.name == name for policy in base):
        name += "_custom"
    added = CachePolicy(name=name, ttl_seconds=ttl_seconds, write_multiplier=write_multiplier,
                        read_multiplier=read_multiplier, as_of="user input",
                        source="Given on the command line.")
    return base + (added,)
