"""What every trace reader shares: opening files, typed field checks that name file:line."""

from __future__ import annotations

import difflib
import json
import math
import os
import sys
from typing import Any, Callable, Collection, Iterator

import orjson

from prefixroute.core.errors import InputError

MAX_ID = (1 << 32) - 1  # block and token ids are hashed as uint32


def open_text(path: str | os.PathLike):
    try:
        return open(path, encoding="utf-8")
    except FileNotFoundError:
        raise InputError("no such file", where=str(path)) from None
    except IsADirectoryError:
        raise InputError("is a directory, expected a file", where=str(path)) from None
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror}", where=str(path)) from None


def numbered_lines(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number from 1, text) for non-blank lines, read lazily."""
    with open_text(path) as fh:
        try:
            for number, line in enumerate(fh, 1):
                if line.strip():
                    yield number, line
        except UnicodeDecodeError:
            raise InputError("not UTF-8 text", where=str(path)) from None


def json_records(path: str | os.PathLike) -> Iterator[tuple[int, str, dict]]:
    """(line number, "file:line", object) for each non-blank line of a JSONL file; a line that
    is not a JSON object is an :class:`InputError` naming the file and line.

    Lines are parsed by orjson (five times as fast as the standard library: most of reading a
    long trace). What orjson refuses goes to the standard library's parser, which takes what
    Python's ``json`` writes beyond strict JSON (``NaN``, ``Infinity``, lone surrogates), so
    a file is read the same either way; only a line neither takes is an error. (orjson reads
    an integer past 64 bits as a float, which a field that takes integers refuses.)"""
    for line_number, line in numbered_lines(path):
        where = f"{path}:{line_number}"
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise InputError(f"not valid JSON ({exc.msg})", where=where) from None
        if not isinstance(record, dict):
            raise InputError("expected a JSON object", where=where)
        yield line_number, where, record


def require(record: dict, name: str, where: str) -> Any:
    if name not in record:
        raise InputError("missing field", where=where, field=name)
    return record[name]


def number(record: dict, name: str, where: str, *, minimum: float = 0.0) -> float:
    value = require(record, name, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InputError(f"expected a number, got {value!r}", where=where, field=name)
    if value < minimum:
        raise InputError(f"must be at least {minimum:g}, got {value!r}", where=where, field=name)
    return float(value)


def integer(record: dict, name: str, where: str, *, minimum: int = 0) -> int:
    value = require(record, name, where)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InputError(f"expected an integer, got {value!r}", where=where, field=name)
    if value < minimum:
        raise InputError(f"must be at least {minimum}, got {value}", where=where, field=name)
    return value


def id_list(record: dict, name: str, where: str) -> list[int]:
    value = require(record, name, where)
    if not isinstance(value, list):
        raise InputError(f"expected a list of integers, got {type(value).__name__}",
                         where=where, field=name)
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item <= MAX_ID:
            raise InputError(f"expected integers in 0..{MAX_ID}, got {item!r}", where=where,
                             field=name)
    return value


def check_block_ids(hash_ids: list, input_tokens: int, block_size: int, where: str,
                    *, allow_floor: bool = True, name: str = "hash_ids") -> None:
    """A trace's block ids cover the prompt in ``block_size``-token blocks: one id per block,
    the last block possibly partial (``ceil``), or only full blocks (``floor``)."""
    ceil_blocks = -(-input_tokens // block_size)
    floor_blocks = input_tokens // block_size
    if len(hash_ids) == ceil_blocks or (allow_floor and len(hash_ids) == floor_blocks):
        return
    expected = (f"{floor_blocks} or {ceil_blocks}" if allow_floor and floor_blocks != ceil_blocks
                else str(ceil_blocks))
    raise InputError(f"block-size mismatch: {len(hash_ids)} block ids for {input_tokens} "
                     f"tokens, expected {expected} with {block_size}-token blocks",
                     where=where, field=name)


def check_time_order(value: float, previous: float, where: str, name: str) -> None:
    if value < previous:
        raise InputError(f"timestamps go backwards: {value:g} after {previous:g}", where=where,
                         field=name)


def warn(message: str) -> None:
    """A likely mistake in an input that does not stop the run: one line on stderr."""
    print(f"prefixroute: warning: {message}", file=sys.stderr)


def unknown_field_checker(known: Collection[str],
                          report: Callable[[str], None] = warn) -> Callable[[dict, str], None]:
    """A check for fields no reader uses: each unknown name is reported once (where first
    seen), with the closest known name, since a typo ("tenat") would otherwise silently drop
    what the field was meant to say."""
    seen: set[str] = set()

    def check(record: dict, where: str) -> None:
        for name in record:
            if name in known or name in seen:
                continue
            seen.add(name)
            close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            report(f"{where}: unknown field {name!r} ignored{hint}")

    return check
