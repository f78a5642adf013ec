"""``prefixroute economics``: provider prompt-cache cost, break-even and P(hit) by request rate.

With no flags it prints the reference economics: break-even per policy, P(hit) and cost multiplier
at 1/6/12/60/600 requests per hour, and the worked example (200 prefixes x 10,000 tokens, 50,000
requests/day, $3 per million input tokens). Every figure comes from
:mod:`prefixroute.core.economics`; this module only parses flags and formats.

With ``--trace FILE`` it also replays a trace (any format ``prefixroute simulate`` reads) through
a provider cache per policy (:mod:`prefixroute.core.economics.accounting`: refresh-on-hit TTL,
automatic caching or ``cache_control`` breakpoints with the 20-block lookback and a minimum
cacheable length) and prints the exact written / read / uncached tokens and cost, per prefix
group, beside the Poisson approximation for the same per-group rates.

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

from prefixroute.core.economics.accounting import (
    DEFAULT_LOOKBACK_BLOCKS,
    DEFAULT_MIN_CACHEABLE_TOKENS,
    CacheModel,
    TraceAccounting,
    account_policies,
    min_cacheable_tokens,
    parse_breakpoints,
)
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
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          stdout_console)

_EXAMPLE = WorkedExample()
_TRACE_FORMATS = ("jsonl", "mooncake", "kvtester", "azure", "recording")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "economics",
        help="provider prompt-cache cost: break-even, P(hit) by request rate, cost per day",
        description="Provider prompt-cache cost: break-even, P(hit) and cost multiplier by "
                    "request rate, and cost per day for a fleet of prefixes."
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
                        help="requests per hour per prefix, comma-separated (default %(default)s)")
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
    trace = parser.add_argument_group(
        "trace accounting",
        "Replay a trace through a provider cache per policy and bill every prompt token as "
        "written, read or uncached, per prefix group, beside the Poisson approximation.")
    trace.add_argument("--trace", metavar="FILE", help="a trace file (kvtester: a file or a "
                       "directory), as 'prefixroute simulate' reads it")
    trace.add_argument("--trace-format", choices=_TRACE_FORMATS, default=None,
                       help="format of --trace (default: detected from the first record; "
                            "docs/trace-format.md)")
    trace.add_argument("--trace-block-size", metavar="N",
                       help="block size of the trace's block ids (default: the format's)")
    trace.add_argument("--requests", metavar="N", help="replay only the first N requests")
    trace.add_argument("--breakpoints", metavar="BREAKPOINTS",
                       help="'auto' (automatic prefix caching, the default) or up to 4 "
                            "cache_control breakpoints: end, end-N or a token position N, "
                            "comma-separated (e.g. 10000,end: the end of a 10,000-token static "
                            "region, and the end)")
    trace.add_argument("--lookback-blocks", metavar="N",
                       help=f"blocks each breakpoint looks back for an earlier write (default "
                            f"{DEFAULT_LOOKBACK_BLOCKS}, Anthropic's)")
    trace.add_argument("--min-cacheable-tokens", metavar="N|MODEL",
                       help=f"shortest cacheable prefix, tokens or a model family such as "
                            f"claude-haiku-4.5 (default {DEFAULT_MIN_CACHEABLE_TOKENS})")
    trace.add_argument("--groups", metavar="N", default="10",
                       help="prefix groups to print, most input tokens first (default "
                            "%(default)s; --json has all)")
    add_json_argument(parser, "the report")
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
    check_json_destination(args.json)
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

    trace_options = _trace_options(args)
    report = economics_report(policies, rates, example)
    advice = []
    if args.advise:
        advice_policies = _policies(args, ADVICE_POLICIES)
        advice = [advise_ttl(rate, tokens, price, advice_policies) for rate in rates]
        report["advice"] = [item.as_dict() for item in advice]
    accounting: dict[str, TraceAccounting] = {}
    if trace_options is not None:
        accounting = _account(args, trace_options, policies)
        report["trace"] = {
            "file": str(args.trace),
            "format": trace_options["format"],
            "requests": next(iter(accounting.values())).total.requests,
            "model": trace_options["model"].as_dict(),
            "policies": {name: result.as_dict(price) for name, result in accounting.items()},
        }

    if args.json:
        emit_json(report, args.json)
    else:
        _print_report(report, policies, example, advice)
        if accounting:
            _print_trace(report["trace"], policies, trace_options["groups"])
    return 0


# -- trace accounting ---------------------------------------------------------------------------
def _trace_options(args: argparse.Namespace) -> dict | None:
    """Check every trace flag before any work; ``None`` without ``--trace``."""
    given = [flag for flag, value in (("--trace-format", args.trace_format),
                                      ("--trace-block-size", args.trace_block_size),
                                      ("--requests", args.requests),
                                      ("--breakpoints", args.breakpoints),
                                      ("--lookback-blocks", args.lookback_blocks),
                                      ("--min-cacheable-tokens", args.min_cacheable_tokens))
             if value is not None]
    if not args.trace:
        if given:
            raise ConfigError(f"{given[0]} needs --trace FILE")
        return None
    block_size = None if args.trace_block_size is None else \
        _positive_integer(args.trace_block_size, "--trace-block-size")
    limit = None if args.requests is None else _positive_integer(args.requests, "--requests")
    lookback = DEFAULT_LOOKBACK_BLOCKS if args.lookback_blocks is None else \
        _integer(args.lookback_blocks, "--lookback-blocks")
    with _flag("--lookback-blocks"):
        require_non_negative("lookback (blocks)", lookback)
    with _flag("--breakpoints"):
        breakpoints = parse_breakpoints(args.breakpoints or "auto")
    if breakpoints and any(b.kind == "static" for b in breakpoints):
        # Only generated workloads know where their static region ends; on a trace the
        # breakpoint would silently place nothing.
        raise ConfigError("--breakpoints: 'static' needs a generated workload, and a trace "
                          "does not say where its static region ends; give the token "
                          "position instead (e.g. --breakpoints 2048,end)")
    with _flag("--min-cacheable-tokens"):
        minimum = min_cacheable_tokens(DEFAULT_MIN_CACHEABLE_TOKENS if args.min_cacheable_tokens
                                       is None else args.min_cacheable_tokens)
    from prefixroute.edges.traces import resolve_format
    fmt = resolve_format(args.trace, args.trace_format)
    return {"format": fmt, "block_size": block_size, "limit": limit,
            "model": CacheModel(breakpoints, lookback, minimum),
            "groups": _non_negative_integer(args.groups, "--groups")}


def _non_negative_integer(text: str, flag: str) -> int:
    value = _integer(text, flag)
    if value < 0:
        raise ConfigError(f"{flag}: must be non-negative, got {value}")
    return value


def _positive_integer(text: str, flag: str) -> int:
    value = _integer(text, flag)
    if value < 1:
        raise ConfigError(f"{flag}: must be at least 1, got {value}")
    return value


def _account(args: argparse.Namespace, options: dict,
             policies: tuple[CachePolicy, ...]) -> dict[str, TraceAccounting]:
    import sys

    from prefixroute.edges.traces import read_trace

    longest = [0]

    def measured(stream):
        for request in stream:
            longest[0] = max(longest[0], request.input_tokens)
            yield request

    requests = measured(read_trace(args.trace, options["format"], options["block_size"]))
    if not sys.stderr.isatty() or args.json:
        result = account_policies(requests, policies, options["model"], limit=options["limit"])
    else:
        from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
        with Progress(SpinnerColumn(), TextColumn("replaying {task.fields[done]:,} requests"),
                      TimeElapsedColumn(), console=Console(stderr=True),
                      transient=True) as progress:
            task = progress.add_task("replay", total=None, done=0)
            result = account_policies(requests, policies, options["model"],
                                      limit=options["limit"],
                                      progress=lambda done: progress.update(task, done=done))
    _warn_unreached_breakpoints(options["model"].breakpoints, longest[0])
    return result


def _warn_unreached_breakpoints(breakpoints, longest_prompt: int) -> None:
    """A token position beyond every prompt is clamped to the prompt's end: the breakpoint then
    duplicates ``end`` (or is the only one), which is rarely what was meant."""
    from prefixroute.edges.traces.common import warn

    positions = [b.tokens for b in breakpoints or () if b.kind == "absolute"]
    beyond = [p for p in positions if p >= longest_prompt]
    if beyond and longest_prompt:
        warn(f"--breakpoints {','.join(map(str, beyond))}: every prompt of the trace is shorter "
             f"(the longest has {longest_prompt:,} tokens), so "
             f"{'this breakpoint sits' if len(beyond) == 1 else 'these breakpoints sit'} at "
             f"each prompt's end")


def _percent(fraction: float | None, digits: int) -> str:
    return "never" if fraction is None else f"{fraction:.{digits}%}"


def _print_report(report: dict, policies: tuple[CachePolicy, ...], example: WorkedExample,
                  advice: list[TTLAdvice]) -> None:
    console = stdout_console(markup=False, emoji=False)

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


def _usd(value: float | None) -> str:
    if value is None:
        return "-"
    return f"${value:,.2f}" if value >= 0.01 or value == 0 else f"${value:.2g}"


def _share(fraction: float | None, digits: int) -> str:
    return "-" if fraction is None else f"{fraction:.{digits}%}"


def _times(value: float | None) -> str:
    return "-" if value is None else f"x{value:.2f}"


def _print_trace(trace: dict, policies: tuple[CachePolicy, ...], group_limit: int) -> None:
    console = stdout_console(markup=False, emoji=False)
    first = trace["policies"][policies[0].name]
    model = trace["model"]
    hours = first["duration_s"] / 3600
    console.print()
    console.print(f"Trace accounting: {trace['file']} ({trace['format']}, {trace['requests']:,} "
                  f"requests over {hours:.2f} h, {len(first['groups']):,} prefix groups, "
                  f"{first['block_size']}-token blocks)", soft_wrap=True)
    where = ("automatic prefix caching (every block)" if model["breakpoints"] == "auto" else
             f"breakpoints {model['breakpoints']}, {model['lookback_blocks']}-block lookback")
    console.print(f"Cache: {where}, minimum {model['min_cacheable_tokens']:,} tokens; "
                  f"${first['price_per_mtok']:g} per million input tokens. Exact replay beside "
                  f"Poisson P(hit) = 1 - exp(-rate x TTL) at each group's own rate.", soft_wrap=True)
    table = Table()
    for column in ("policy", "written", "read", "uncached", "token hit", "requests hit",
                   "P(hit) Poisson", "x exact", "x Poisson", "USD exact", "USD Poisson",
                   "USD uncached"):
        table.add_column(column, justify="left" if column == "policy" else "right")
    for policy in policies:
        totals = trace["policies"][policy.name]["totals"]
        poisson = totals["poisson"]
        table.add_row(policy.name, f"{totals['written_tokens']:,}", f"{totals['read_tokens']:,}",
                      f"{totals['uncached_tokens']:,}", _share(totals["token_hit_rate"], 1),
                      _share(totals["request_hit_rate"], 1), _share(poisson["p_hit"], 1),
                      _times(totals["cache_multiplier"]), _times(poisson["multiplier"]),
                      _usd(totals["usd"]), _usd(poisson["usd"]), _usd(totals["no_cache_usd"]))
    console.print(table)
    console.print("x = cost of the written and read tokens relative to sending them uncached "
                  "(h*r + (1-h)*w for hit probability h, read price r, write price w).", soft_wrap=True)
    names = list(first["groups"])
    shown = names[:max(0, group_limit)]
    if not shown:
        return
    console.print(f"Per prefix group ({len(shown)} of {len(names)}, most input tokens first): "
                  f"requests that read, exact / Poisson, and the cost multiplier, exact / Poisson:",
                  soft_wrap=True)
    groups = Table()
    groups.add_column("group")
    groups.add_column("requests", justify="right")
    groups.add_column("per hour", justify="right")
    for policy in policies:
        groups.add_column(policy.name, justify="right")
    for name in shown:
        entry = first["groups"][name]
        rate = entry["poisson"]["requests_per_hour"]
        cells = [name, f"{entry['requests']:,}", "-" if rate is None else f"{rate:.3g}"]
        for policy in policies:
            g = trace["policies"][policy.name]["groups"][name]
            cells.append(f"{_share(g['request_hit_rate'], 0)} / {_share(g['poisson']['p_hit'], 0)}"
                          f"  {_times(g['cache_multiplier'])} / {_times(g['poisson']['multiplier'])}")
        groups.add_row(*cells)
    console.print(groups)
