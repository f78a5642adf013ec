"""Diff two prompts at token and block level: where they part and what it costs.

Usage: ``prefixroute diff A B``.

A and B are files holding prompt text, OpenAI chat JSON (a message list, or a body with
``messages`` and optional ``tools``), or a JSON list of token ids; the format is detected unless
``--format`` names it. Text is tokenized as vLLM's ``/v1/completions`` does (with the
tokenizer's special tokens), chat by rendering the tokenizer's chat template. A is the cached
prompt, B the new one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from prefixroute.core.diagnostics.diff import PromptDiff, diff_tokens, verdict
from prefixroute.core.diagnostics.lint import DEFAULT_BLOCK_SIZE
from prefixroute.core.diagnostics.prompts import parse_body
from prefixroute.core.diagnostics.volatile import CHANGED_CONTENT, classify_change
from prefixroute.core.errors import InputError
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          positive_int, stdout_console, take_positional_from_json)
from prefixroute.edges.cli.lint import show_notes

FORMATS = ("auto", "text", "chat", "ids")
CONTEXT_TOKENS = 12  # decoded tokens shown either side of the divergence
BAR_WIDTH = 64  # characters of the block bar


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "diff", help="diff two prompts at token and block level",
        description=__doc__.splitlines()[0])
    parser.add_argument("a", metavar="A", nargs="?", help="the cached prompt (text, chat JSON or token ids)")
    parser.add_argument("b", metavar="B", nargs="?", help="the new prompt")
    parser.add_argument("--tokenizer", metavar="DIR",
                        help="your model's tokenizer directory (tokenizer.json, "
                             "tokenizer_config.json), needed unless both are token ids; "
                             "offline: 'prefixroute tokenizer --tiny DIR' makes a small one")
    parser.add_argument("--block-size", type=positive_int, default=DEFAULT_BLOCK_SIZE,
                        help="KV block size in tokens (default 16, vLLM's GPU default)")
    parser.add_argument("--format", choices=FORMATS, default="auto",
                        help="format of A and B (default: detect)")
    add_json_argument(parser, "the diff")
    parser.set_defaults(handler=run)


def read_prompt(path: str, fmt: str) -> tuple[str, Any]:
    """(format, payload) of one prompt file: ("text", str), ("chat", (messages, tools)) or
    ("ids", list[int])."""
    try:
        content = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("file not found", where=path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read: {exc}", where=path) from None
    if fmt == "text":
        return "text", content
    try:
        data = json.loads(content)
    except json.JSONDecodeError as exc:
        if fmt == "auto":
            return "text", content
        raise InputError(f"not valid JSON ({exc.msg} at line {exc.lineno})", where=path) from None
    if isinstance(data, str) and fmt == "auto":
        return "text", data
    if isinstance(data, list) and data and all(
            isinstance(t, int) and not isinstance(t, bool) for t in data):
        if fmt not in ("auto", "ids"):
            raise InputError(f"holds token ids, not {fmt}", where=path)
        if any(t < 0 for t in data):
            raise InputError("token ids must not be negative", where=path)
        return "ids", data
    if fmt == "ids":
        raise InputError("expected a JSON list of token ids", where=path)
    if isinstance(data, (list, dict)):
        request = parse_body(data, where=path)
        show_notes([request.notes])
        if request.kind == "chat":
            if fmt not in ("auto", "chat"):
                raise InputError(f"holds chat messages, not {fmt}", where=path)
            return "chat", (list(request.messages or ()), request.tools)
        if request.prompt_token_ids is not None:
            return "ids", list(request.prompt_token_ids)
        if fmt == "chat":
            raise InputError("holds a completions prompt, not chat messages", where=path)
        return "text", request.prompt
    if fmt == "auto":
        return "text", content
    raise InputError(f"expected {fmt} input", where=path)


def _tokenize(path: str, fmt: str, payload: Any, tokenizer: Any) -> list[int]:
    if fmt == "ids":
        return list(payload)
    if tokenizer is None:
        raise InputError(f"holds {'chat messages' if fmt == 'chat' else 'text'}: "
                         "give --tokenizer DIR to tokenize it", where=path)
    if fmt == "chat":
        messages, tools = payload
        return tokenizer.encode_chat(messages, tools=tools)
    return tokenizer.encode(payload, add_special_tokens=True)


def _context(tokenizer: Any, ids: list[int], at: int) -> tuple[str, str]:
    """Decoded text before the divergence and from it on."""
    start = max(0, at - CONTEXT_TOKENS)
    return tokenizer.decode(ids[start:at]), tokenizer.decode(ids[at:at + CONTEXT_TOKENS])


def run(args: argparse.Namespace) -> int:
    take_positional_from_json(args, "a", "b")
    check_json_destination(args.json)
    tokenizer = None
    if args.tokenizer:
        from prefixroute.edges.tokenization import load_tokenizer

        tokenizer = load_tokenizer(args.tokenizer)
    fmt_a, payload_a = read_prompt(args.a, args.format)
    fmt_b, payload_b = read_prompt(args.b, args.format)
    ids_a = _tokenize(args.a, fmt_a, payload_a, tokenizer)
    ids_b = _tokenize(args.b, fmt_b, payload_b, tokenizer)
    diff = diff_tokens(ids_a, ids_b, args.block_size)

    change = CHANGED_CONTENT
    context = None
    at = diff.first_divergence_token
    if tokenizer is not None and at is not None:
        before_a, after_a = _context(tokenizer, ids_a, at)
        before_b, after_b = _context(tokenizer, ids_b, at)
        change = classify_change(before_a + after_a, before_b + after_b)
        context = {"before": before_b, "a": after_a, "b": after_b}
    sentence = verdict(diff, change)

    if args.json:
        out = {"a": args.a, "b": args.b, "format_a": fmt_a, "format_b": fmt_b}
        out.update(diff.to_dict())
        out["change"] = None if diff.identical or diff.extends else change
        out["verdict"] = sentence
        out["context"] = context
        emit_json(out, args.json)
        return 0
    _print_human(args, diff, sentence, context, fmt_a, fmt_b)
    return 0


def block_bar(diff: PromptDiff, width: int = BAR_WIDTH) -> str:
    """B's full blocks as characters: reused (#) then invalidated (.), scaled to ``width``."""
    if diff.total_blocks == 0:
        return ""
    if diff.total_blocks <= width:
        return "#" * diff.reusable_blocks + "." * diff.invalidated_blocks
    reused = round(width * diff.reusable_blocks / diff.total_blocks)
    return "#" * reused + "." * (width - reused)


def _print_human(args: argparse.Namespace, diff: PromptDiff, sentence: str,
                 context: dict | None, fmt_a: str, fmt_b: str) -> None:
    from rich.table import Table
    from rich.text import Text

    console = stdout_console()
    console.print(Text(sentence, style="bold red" if diff.invalidated_blocks else "bold green"))
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="dim")
    table.add_column()
    table.add_row("A", f"{args.a} ({fmt_a}, {diff.tokens_a} tokens)")
    table.add_row("B", f"{args.b} ({fmt_b}, {diff.tokens_b} tokens)")
    table.add_row("block size", str(diff.block_size))
    table.add_row("first divergence", "none" if diff.identical else
                  f"token {diff.first_divergence_token}, block {diff.first_divergence_block}")
    table.add_row("reusable", f"{diff.reusable_blocks} of {diff.total_blocks} full blocks, "
                              f"{diff.reusable_tokens} of {diff.total_tokens} tokens "
                              f"(vLLM would report {diff.engine_cached_tokens} cached)")
    bar = Text()
    bar.append("#" * block_bar(diff).count("#"), style="green")
    bar.append("." * block_bar(diff).count("."), style="red")
    table.add_row("blocks of B", bar)
    console.print(table)
    if context:
        for label, key in (("A", "a"), ("B", "b")):
            line = Text(f"{label}: ", style="dim")
            line.append(repr(context["before"])[1:-1])
            line.append(repr(context[key])[1:-1], style="reverse")
            console.print(line)
