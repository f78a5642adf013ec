"""Lint a request log for volatile content in the static region, and what it costs in hits.

Usage: ``prefixroute lint LOG``.

LOG is JSONL, one OpenAI chat or completions body per line, with an optional ``tenant`` field.
Requests are tokenized as vLLM does (chat template for chat, special tokens for completions)
with the tokenizer directory given. See :mod:`prefixroute.core.diagnostics.lint` for the rules,
the static region and the cache model behind the hit rates.
"""

from __future__ import annotations

import argparse

from prefixroute.core.diagnostics.lint import DEFAULT_BLOCK_SIZE, LintReport, lint_requests
from prefixroute.core.diagnostics.prompts import parse_log
from prefixroute.core.errors import InputError
from prefixroute.edges.cli.columns import (LINT_COLUMNS, LINT_DEFAULT, add_table_arguments,
                                           choose_columns, metrics_epilog, print_rows)
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          positive_int, stdout_console, take_positional_from_json)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "lint", help="lint a request log for volatile content in the static region",
        description=__doc__.splitlines()[0], epilog=metrics_epilog(LINT_COLUMNS),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", metavar="LOG", nargs="?",
                        help="JSONL of OpenAI chat or completions bodies")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="your model's tokenizer directory (tokenizer.json, "
                             "tokenizer_config.json), needed for text prompts; offline: "
                             "'prefixroute tokenizer --tiny DIR' makes a small one")
    parser.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                        help="KV block size in tokens (default 16, vLLM's GPU default)")
    add_json_argument(parser, "the report")
    add_table_arguments(parser, LINT_COLUMNS, LINT_DEFAULT)
    parser.set_defaults(handler=run)


def read_log(path: str):
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_log(handle, source=path)
    except FileNotFoundError:
        raise InputError("file not found", where=path) from None
    except UnicodeDecodeError as exc:
        raise InputError(f"not UTF-8 text ({exc.reason} at byte {exc.start})", where=path) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", where=path) from None


def run(args: argparse.Namespace) -> int:
    take_positional_from_json(args, "log")
    choose_columns(args.columns, LINT_COLUMNS, LINT_DEFAULT)  # a typo fails before the work
    check_json_destination(args.json)
    tokenizer = None
    if args.tokenizer:
        from prefixroute.edges.tokenization import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    requests = read_log(args.log)
    show_notes(request.notes for request in requests)
    if tokenizer is None:
        text = next((r for r in requests if r.prompt_token_ids is None), None)
        if text is not None:
            raise InputError("this request has a text prompt: give --tokenizer DIR to tokenize "
                             "the log as the engine does", where=text.where)
    report = _lint_with_progress(requests, tokenizer, args.block_size)
    if args.json:
        out = {"log": args.log, "tokenizer": args.tokenizer}
        out.update(report.to_dict())
        emit_json(out, args.json)
    else:
        print_report(report, args.log, args.table_format, args.columns)
    return 0


def show_notes(groups, limit: int = 5) -> None:
    """Likely mistakes in the input, on stderr: the first ``limit``, then how many more."""
    import sys

    notes = [note for group in groups for note in group]
    for note in notes[:limit]:
        print(f"prefixroute: warning: {note}", file=sys.stderr)
    if len(notes) > limit:
        print(f"prefixroute: warning: {len(notes) - limit} more like these", file=sys.stderr)


def _lint_with_progress(requests, tokenizer, block_size: int) -> LintReport:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/"
                  "{task.total}"), TimeElapsedColumn(), console=console, transient=True,
                  disable=not console.is_terminal) as progress:
        tasks: dict[str, int] = {}

        def advance(stage: str, done: int, total: int) -> None:
            if stage not in tasks:
                tasks[stage] = progress.add_task(stage, total=total)
            progress.update(tasks[stage], completed=done)

        return lint_requests(requests, tokenizer, block_size, progress=advance)


def _rate(value: float) -> str:
    return f"{value:.1%}"


def print_report(report: LintReport, source: str, fmt: str = "table",
                 columns: str | None = None) -> None:
    from rich.text import Text

    from dataclasses import asdict

    rows = [asdict(tenant) for tenant in report.tenants]
    chosen = choose_columns(columns, LINT_COLUMNS, LINT_DEFAULT)
    if fmt == "csv":
        print_rows(rows, chosen, fmt)
        return
    console = stdout_console()
    say = console.print if fmt == "table" else print
    say(Text(f"{source}: {report.requests} requests, {len(report.tenants)} tenants, "
             f"{report.total_tokens:,} tokens, block size {report.block_size}", style="bold")
        if fmt == "table" else f"{source}: {report.requests} requests, "
        f"{len(report.tenants)} tenants, {report.total_tokens:,} tokens, block size "
        f"{report.block_size}")
    say(f"token hit rate now {_rate(report.token_hit_rate_now)}, after moving volatile "
        f"parts behind the static region {_rate(report.token_hit_rate_after)}")
    if fmt == "markdown":
        print()
    print_rows(rows, chosen, fmt, console)
    if not report.findings:
        unexplained = [t for t in report.tenants
                       if not t.static_region_units and t.first_divergence["pairs"]]
        if not unexplained:
            console.print(Text("no volatile content found in any static region", style="green"))
        for tenant in unexplained:
            # No static region: the prompts differ from the start, but by nothing this lint
            # recognises; say so rather than "nothing found" beside a divergence at token 1.
            console.print(Text(
                f"tenant {tenant.tenant}: its requests differ from about token "
                f"{tenant.first_divergence['median_token']:g} on, so no static region was "
                f"found and nothing could be checked; compare two of them with 'prefixroute "
                f"diff' to see what changes there", style="yellow"))
    for tenant in report.tenants:
        if not tenant.findings:
            continue
        console.print(Text(f"tenant {tenant.tenant}", style="bold"))
        for finding in tenant.findings:
            line = Text("  ")
            line.append(finding.kind, style="bold red")
            where = f" at about token {finding.token}" if finding.token is not None else ""
            line.append(f"{where}: {finding.message}")
            console.print(line)
            console.print(Text(f"    e.g. {finding.example_where}: {finding.example}", style="dim"))
            console.print(Text(f"    fix: {finding.fix}", style="cyan"))
    console.print(Text(f"hit rates assume an {report.cache_model}", style="dim"))

