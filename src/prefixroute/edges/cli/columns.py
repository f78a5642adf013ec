"""The columns of the result tables: name, JSON key, one-line meaning, and how to print a cell.

One list per table is the single source of the table's headers, of the ``--columns`` choices,
of the metric lines in ``--help`` and of ``docs/metrics.md`` (a test checks that the page holds
every line written here), so a header, its JSON key and its explanation cannot drift apart.

Output formats (``--format``): ``table`` (rich, sized to the terminal), ``markdown`` (a pipe
table for notes and issues) and ``csv`` (raw JSON values, fractions as fractions and seconds as
seconds, for spreadsheets and pandas). The default columns fit a 100-column terminal;
``--columns all`` or a comma-separated list of names shows others.
"""

from __future__ import annotations

import argparse
import csv
import sys
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from prefixroute.core.errors import ConfigError

FORMATS = ("table", "markdown", "csv")


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def secs(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def count(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


@dataclass(frozen=True)
class Column:
    """One column: ``name`` is its header and its ``--columns`` name, ``key`` the JSON field it
    shows (a row of the report), ``meaning`` the line ``--help`` and docs/metrics.md print."""

    name: str
    key: str
    meaning: str
    text: Callable[[Any], str] = str
    left: bool = False
    value: Callable[[dict], Any] | None = None  # when the cell is not simply row[key]

    def raw(self, row: dict) -> Any:
        return self.value(row) if self.value is not None else row.get(self.key)

    def cell(self, row: dict) -> str:
        return self.text(self.raw(row))


def _max_utilisation(row: dict) -> float | None:
    return max(row["utilisation"]) if row.get("utilisation") else None


def _assignments(value: Any) -> str:
    return " ".join(map(str, value)) if value else "-"


# The simulate and sweep tables (one row per policy, or per grid point and policy).
POLICY_COLUMNS: tuple[Column, ...] = (
    Column("policy", "policy", "the routing policy and its parameters (NAME:key=value)",
           left=True),
    Column("replicas", "replicas", "replicas in the fleet (sweep grid value)"),
    Column("cache blocks", "cache_blocks", "usable KV blocks per replica (sweep grid value)",
           count),
    Column("token hit", "token_hit_rate",
           "prompt tokens served from a replica's prefix cache / all prompt tokens (what "
           "saves prefill work; vLLM's prefix_cache_hits / prefix_cache_queries)", pct),
    Column("req hit", "request_hit_rate",
           "requests with at least one cached token / all requests (a request that reuses one "
           "block counts as fully as one that reuses all: read token hit first)", pct),
    Column("reused tok", "reused_prefix_tokens",
           "prompt tokens served from cache, summed over the run", count),
    Column("lost vs ideal", "recomputed_prefill_tokens",
           "prompt tokens one infinite cache shared by the whole fleet would have reused but "
           "this fleet recomputed: the price of routing and finite caches (0 is ideal)", count),
    Column("TTFT p50", "ttft_p50_s",
           "time to first token (arrival to first output token), median over requests", secs),
    Column("TTFT p90", "ttft_p90_s", "time to first token, 90th percentile", secs),
    Column("TTFT p99", "ttft_p99_s",
           "time to first token, 99th percentile: 1 request in 100 waits longer", secs),
    Column("e2e p50", "e2e_p50_s", "end-to-end latency (arrival to last token), median", secs),
    Column("e2e p99", "e2e_p99_s", "end-to-end latency, 99th percentile", secs),
    Column("assignments", "assignments", "requests routed to each replica, in replica order",
           _assignments, left=True),
    Column("skew", "max_assignment_skew",
           "requests on the busiest replica minus requests on the idlest one (0: even)"),
    Column("evictions", "evictions", "cached KV blocks evicted from all replicas' pools",
           count),
    Column("util max", "utilisation",
           "the busiest replica's utilisation: fraction of the run it spent computing steps "
           "(JSON: utilisation, one value per replica)", pct, value=_max_utilisation),
    Column("rejected", "rejected", "requests no replica accepted (prompt longer than a "
           "replica's cache, or refused by the policy)", count),
)

SIMULATE_DEFAULT = ("policy", "token hit", "req hit", "lost vs ideal", "TTFT p50", "TTFT p99",
                    "e2e p50", "skew", "util max")  # 95 columns with an 18-letter policy name
SWEEP_DEFAULT = ("replicas", "cache blocks", "policy", "token hit", "TTFT p50", "TTFT p99",
                 "skew", "evictions")


def _static_region(row: dict) -> str:
    units = row.get("static_region_units")
    if not units:
        return "-"
    text = f"{units} line{'' if units == 1 else 's'}"
    if row.get("static_region_tokens") is not None:
        text += f", ~{row['static_region_tokens']} tok"
    return text


def _divergence(row: dict) -> str:
    divergence = row["first_divergence"]
    if not divergence.get("pairs"):
        return "-"
    cause = next(iter(divergence["causes"]))
    return f"token {divergence['median_token']:g} ({cause})"


# The lint table: one row per tenant of the log (LintReport.to_dict()["tenants"]).
LINT_COLUMNS: tuple[Column, ...] = (
    Column("tenant", "tenant", "who sent the requests (the log's tenant field)", left=True),
    Column("requests", "requests", "requests of the tenant in the log", count),
    Column("tokens", "total_tokens", "their prompt tokens, as the tokenizer counts them", count),
    Column("static region", "static_region_units",
           "lines at the start of the prompt every request shares in shape (JSON also "
           "static_region_tokens)", left=True, value=_static_region),
    Column("first divergence", "first_divergence",
           "median token where consecutive requests first differ, and what differs there",
           left=True, value=_divergence),
    Column("hit now", "token_hit_rate_now", "token hit rate of the log as it is", pct),
    Column("hit after", "token_hit_rate_after",
           "token hit rate after moving the volatile values behind the static region", pct),
    Column("findings", "findings", "volatile values or unstable structure in the static region",
           value=lambda row: len(row["findings"])),
)
LINT_DEFAULT = tuple(c.name for c in LINT_COLUMNS)


def by_name(columns: Sequence[Column]) -> dict[str, Column]:
    return {c.name: c for c in columns}


def add_table_arguments(parser: argparse.ArgumentParser, columns: Sequence[Column],
                        default: Sequence[str]) -> None:
    parser.add_argument("--format", dest="table_format", choices=FORMATS, default="table",
                        help="how to print the table: table (default), markdown or csv (raw "
                             "values: fractions, seconds)")
    parser.add_argument("--columns", metavar="NAME,...|all",
                        help=f"table columns, comma-separated, or 'all' (default: "
                             f"{','.join(default)}); names under 'metrics' below")


def metrics_epilog(columns: Sequence[Column], width: int = 78) -> str:
    """The ``--help`` lines that say what every column means and its JSON key."""
    lines = ["metrics (table column [JSON key]: meaning):"]
    for column in columns:
        key = "" if column.key == column.name else f" [{column.key}]"
        lines.extend(textwrap.wrap(f"{column.name}{key}: {column.meaning}", width=width,
                                   initial_indent="  ", subsequent_indent="      "))
    return "\n".join(lines)


def choose_columns(text: str | None, columns: Sequence[Column], default: Sequence[str],
                   present: set[str] | None = None) -> list[Column]:
    """The columns to print: ``--columns`` names in their given order, ``all``, or the
    default. ``present`` limits ``all`` to the columns the rows carry."""
    named = by_name(columns)
    if not text:
        return [named[name] for name in default]
    if text.strip() == "all":
        return [c for c in columns if present is None or c.key in present]
    chosen = []
    for name in (part.strip() for part in text.split(",")):
        if name not in named:
            import difflib
            close = difflib.get_close_matches(name, list(named), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"--columns: unknown column {name!r}{hint} (known: "
                              f"{', '.join(named)})")
        chosen.append(named[name])
    return chosen


def print_rows(rows: Sequence[dict], columns: Sequence[Column], fmt: str, console=None) -> None:
    """Print ``rows`` (report dicts) as a rich table, a Markdown table or CSV."""
    if fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow([c.name for c in columns])
        for row in rows:
            values = []
            for column in columns:
                value = column.raw(row)
                values.append(" ".join(map(str, value)) if isinstance(value, list) else
                              "" if value is None else value)
            writer.writerow(values)
        return
    if fmt == "markdown":
        print("| " + " | ".join(c.name for c in columns) + " |")
        print("|" + "|".join("---" if c.left else "---:" for c in columns) + "|")
        for row in rows:
            print("| " + " | ".join(c.cell(row) for c in columns) + " |")
        return
    from rich import box
    from rich.table import Table
    # No vertical rules: nine columns of figures and a policy name fit 100 terminal columns.
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False)
    for column in columns:
        # Names stay whole (a folded "least_loade/d" reads as two policies); figures wrap.
        table.add_column(column.name, justify="left" if column.left else "right",
                         no_wrap=column.left and column.name == "policy", overflow="fold")
    for row in rows:
        table.add_row(*(column.cell(row) for column in columns))
    console.print(table)
