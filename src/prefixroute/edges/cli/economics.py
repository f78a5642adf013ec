"""``prefixroute economics``: provider prompt-cache cost, break-even and P(hit) by request rate.

With no flags it prints SPEC section 3 item 5: break-even per policy, P(hit) and cost multiplier
at 1/6/12/60/600 requests per hour, and the worked example (200 prefixes x 10,000 tokens, 50,000
requests/day, $3 per million input tokens). Every figure comes from
:mod:`prefixroute.core.economics`; this module only parses flags and formats.

Numbers are parsed here rather than by argparse so that bad input gives one line naming the flag
(and exit code 2 through :func:`prefixroute.edges.cli.main.main`), not a usage dump.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.table import Table

from prefixroute.core.economics.advice import TTLAdvice, advise_ttl
from prefixroute.core.economics.formulas import require_non_negative
from prefixroute.core.economics.presets import (
    ADVICE_POLICIES,
    FIVE_MINUTE,
    RATE_TABLE_POLICIES,
    CachePolicy,
    custom_policy,
    parse_ttl,
)
from prefixroute.core.economics.repro import DEFAULT_RATES_PER_HOUR, WorkedExample, economics_report
from prefixroute.core.errors import ConfigError
from prefixroute.edges.cli.common import print_json

_EXAMPLE = WorkedExample()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "economics",
        help="provider prompt-cache cost: break-even, P(hit) by request rate, cost per day",
        description="Provider prompt-cache cost: break-even, P(hit) and cost multiplier by "
                    "request rate, and cost per day for a fleet of prefixes (SPEC section 3 item 5)."
                    " Policies: 5m_1.25x (5-minute TTL, write 1.25x, "
                    "read 0.1x), 1h_2x (1-hour TTL, write 2x, read 0.1x), 5m_1.0x (no write "
                    "premium); example multipliers in the style of Oct 2026 price lists.",
    )
    custom = parser.add_argument_group(
        "custom policy",
        "Any of these adds one policy (missing values from 5m_1.25x). If its TTL and write "
        "multiplier match a preset, it re-prices that preset's read instead; otherwise it is "
        "added as <ttl>_<write>x, e.g. 10m_1.5x.")
    custom.add_argument("--write", metavar="W", help=f"write multiplier (default "
                        f"{FIVE_MINUTE.write_multiplier:g})")
    custom.add_argument("--read", metavar="R", help=f"read multiplier (default "
                        f"{FIVE_MINUTE.read_multiplier:g})")
    custom.add_argument("--ttl", metavar="TTL", help=f"TTL with a unit: 300s, 5m, 1h, 1d "
                        f"(default {FIVE_MINUTE.ttl})")
    parser.add_argument("--rates", metavar="LIST",
                        default=",".join(f"{rate:g}" for rate in DEFAULT_RATES_PER_HOUR),
                        help="requests per hour per prefix, comma-separated (default %(default)s, "
                             "SPEC section 3 item 5)")
    parser.add_argument("--price-per-mtok", metavar="USD", default=f"{_EXAMPLE.price_per_mtok:g}",
                        help="base input price in USD per million tokens (default %(default)s)")
    parser.add_argument("--prefixes", metavar="N", default=str(_EXAMPLE.prefixes),
                        help="worked example: distinct prefixes (default %(default)s)")
    parser.add_argument("--prefix-tokens", metavar="N", default=str(_EXAMPLE.prefix_tokens),
                        help="worked example: tokens per prefix (default %(default)s)")
    parser.add_argument("--requests-per-day", metavar="N", default=f"{_EXAMPLE.requests_per_day:g}",
                        help="worked example: requests per day over all prefixes (default %(default)s)")
    parser.add_argument("--advise", action="store_true",
                        help="also advise, per rate, the cheapest option for one prefix of "
                             "--prefix-tokens (no caching, each policy, each pre-warmed, and an "
                             "explicit cache object with storage)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser.set_defaults(handler=run)


@contextmanager
def _flag(name: str) -> Iterator[None]:
    """Prefix core errors with the flag they came from, so the message says what to fix."""
    try:
        yield
    except ConfigError as exc:
        raise ConfigError(f"{name}: {exc}") from None


def _number(text: str, flag: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise ConfigError(f"{flag}: expected a finite number, got {text!r}")
    return value


def _integer(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{flag}: expected a whole number, got {text!r}") from None


def _policies(args: argparse.Namespace, base: tuple[CachePolicy, ...]) -> tuple[CachePolicy, ...]:
    if args.write is None and args.read is None and args.ttl is None:
        return base
    write = FIVE_MINUTE.write_multiplier if args.write is None else _number(args.write, "--write")
    read = FIVE_MINUTE.read_multiplier if args.read is None else _number(args.read, "--read")
    with _flag("--write"):
        require_non_negative("write multiplier", write)
    with _flag("--read"):
        require_non_negative("read multiplier", read)
    with _flag("--ttl"):
        ttl = FIVE_MINUTE.ttl_seconds if args.ttl is None else parse_ttl(args.ttl)
    with _flag("--write/--read"):
        return custom_policy(ttl, write, read, base)


def _rates(text: str) -> list[float]:
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ConfigError("--rates: expected a comma-separated list of requests per hour")
    rates = [_number(item, "--rates") for item in items if item]
    with _flag("--rates"):
        return [require_non_negative("request rate (per hour)", rate) for rate in rates]


def run(args: argparse.Namespace) -> int:
    policies = _policies(args, RATE_TABLE_POLICIES)
    rates = _rates(args.rates)
    price = _number(args.price_per_mtok, "--price-per-mtok")
    prefixes = _integer(args.prefixes, "--prefixes")
    tokens = _integer(args.prefix_tokens, "--prefix-tokens")
    per_day = _number(args.requests_per_day, "--requests-per-day")
    with _flag("--price-per-mtok"):
        require_non_negative("price per million input tokens", price)
    with _flag("--prefix-tokens"):
        require_non_negative("prefix tokens", tokens)
    with _flag("--requests-per-day"):
        require_non_negative("requests per day", per_day)
    with _flag("--prefixes"):
        example = WorkedExample(prefixes, tokens, per_day, price)

    report = economics_report(policies, rates, example)
    advice = []
    if args.advise:
        advice_policies = _policies(args, ADVICE_POLICIES)
        advice = [advise_ttl(rate, tokens, price, advice_policies) for rate in rates]
        report["advice"] = [item.as_dict() for item in advice]

    if args.json:
        print_json(report)
    else:
        _print_report(report, policies, example, advice)
    return 0


def _percent(fraction: float | None, digits: int) -> str:
    return "never" if fraction is None else f"{fraction:.{digits}%}"


def _print_report(report: dict, policies: tuple[CachePolicy, ...], example: WorkedExample,
                  advice: list[TTLAdvice]) -> None:
    console = Console(highlight=False, markup=False, emoji=False)

    def line(text: str = "") -> None:
        console.print(text, soft_wrap=True)

    line("Break-even token hit rate h* = max(0, (w - 1) / (w - r)); caching pays above it:")
    for policy in policies:
        line(f"  {policy.name} ({policy.describe()}): {_percent(report['break_even'][policy.name], 1)}")
    line()

    line("P(hit) and cost multiplier h*r + (1-h)*w by requests per hour per prefix")
    line("(Poisson arrivals, each hit refreshes the TTL: P(hit) = 1 - exp(-rate x TTL)):")
    table = Table()
    table.add_column("requests/hour", justify="right")
    for policy in policies:
        table.add_column(policy.name, justify="right")
    for row in report["rates"]:
        cells = [f"{row['requests_per_hour']:g}"]
        cells += [f"{row[p.name]['p_hit']:.0%} x{row[p.name]['multiplier']:.2f}" for p in policies]
        table.add_row(*cells)
    console.print(table)
    line()

    worked = report["worked_example"]
    line(f"Worked example: {example.prefixes:,} prefixes x {example.prefix_tokens:,} tokens, "
         f"{example.requests_per_day:,.0f} requests/day ({example.requests_per_hour_per_prefix:.1f} "
         f"per hour per prefix), ${example.price_per_mtok:g} per million input tokens:")
    line(f"  no caching: ${worked['no_caching_usd_per_day']:,.0f}/day")
    for policy in policies:
        entry = worked[policy.name]
        line(f"  {policy.name}: {entry['p_hit']:.0%} hit, ${entry['usd_per_day']:,.0f}/day")

    if advice:
        line()
        line(f"Per-prefix TTL advice for one prefix of {example.prefix_tokens:,} tokens at "
             f"${example.price_per_mtok:g} per million (one day of steady traffic):")
        for item in advice:
            best = item.best
            line(f"  {item.requests_per_hour:g} requests/hour: {best.name}, P(hit) "
                 f"{best.p_hit:.0%}, ${best.usd_per_day:,.2f}/day "
                 f"(uncached ${item.no_cache_usd_per_day:,.2f}/day; requests at "
                 f"x{best.multiplier:.2f} plus ${best.overhead_usd_per_day:,.2f}/day overhead)")
            for note in item.notes:
                line(f"    {note}")
