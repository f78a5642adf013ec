"""Trace readers: files in, :class:`~prefixroute.core.simulator.request.Request` streams out.

Formats: ``jsonl`` (prefixroute's own, docs/trace-format.md), ``mooncake`` (512-token block
ids), ``kvtester`` (agentic sessions, a directory or files), ``azure`` (arrivals and lengths,
given prefixes by a generator), ``recording`` (a gateway's recorded traffic, a file or a
directory, with the live outcomes beside it). Every reader streams (a recording is sorted by
arrival in memory first), checks every field it uses, and raises
:class:`~prefixroute.core.errors.InputError` naming the file and line (or request) and the
field: missing fields, timestamps going backwards, block-size mismatches.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Iterable

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.simulator.generators import with_prefixes
from prefixroute.core.simulator.request import Request
from prefixroute.edges.traces.azure import read_azure
from prefixroute.edges.traces.jsonl import read_jsonl
from prefixroute.edges.traces.kvtester import read_kvtester
from prefixroute.edges.traces.mooncake import MOONCAKE_BLOCK_SIZE, read_mooncake
from prefixroute.edges.traces.recording import RECORDING_KEY, is_recording, read_recording

FORMATS = ("mooncake", "kvtester", "jsonl", "azure", "recording")


def detect_format(path: str | os.PathLike) -> str:
    """The format of a trace, from its first record: a file or directory of files starting
    with the ``prefixroute_recording`` header is a ``recording``; another directory or a
    JSON document with ``requests`` is ``kvtester``; a JSON line with ``timestamp`` and ``input_length`` is
    ``mooncake``, with ``arrival_s`` or the ``prefixroute_trace`` header ``jsonl``; a CSV
    header starting ``TIMESTAMP,ContextTokens`` is ``azure``. Anything else is an
    :class:`InputError` that names the formats and the flag to give."""
    import json

    from prefixroute.edges.traces.common import open_text

    if is_recording(path):
        return "recording"
    if os.path.isdir(path):
        return "kvtester"
    with open_text(path) as handle:
        try:
            head = handle.read(1 << 16)
        except UnicodeDecodeError:
            raise InputError("not UTF-8 text", where=str(path)) from None
    first = next((line.strip() for line in head.splitlines() if line.strip()), "")
    if first.replace(" ", "").startswith("TIMESTAMP,ContextTokens"):
        return "azure"
    record = None
    try:
        record = json.loads(first)
    except json.JSONDecodeError:
        try:
            with open_text(path) as handle:  # one document over several lines
                record = json.load(handle)
        except (json.JSONDecodeError, UnicodeDecodeError):
            record = None
    if isinstance(record, dict):
        if isinstance(record.get("requests"), list):
            return "kvtester"
        if "timestamp" in record and "input_length" in record:
            return "mooncake"
        if "arrival_s" in record or "prefixroute_trace" in record:
            return "jsonl"
    raise InputError(f"cannot tell the trace format from the first record; give "
                     f"--trace-format ({', '.join(FORMATS)}; docs/trace-format.md)",
                     where=str(path))


def read_trace(path: str | os.PathLike, fmt: str, block_size: int | None = None,
               prefixes: dict[str, Any] | None = None, seed: int = 0, copies: int = 1,
               copy_interval_s: float = 0.0) -> Iterable[Request]:
    """Requests of a trace file (or, for ``kvtester``, a directory of sessions).

    ``block_size`` overrides the format's (Mooncake 512, kvtester from the file, jsonl from
    the file or 16) and must agree with the ids. ``prefixes`` are
    :func:`~prefixroute.core.simulator.generators.with_prefixes` parameters for ``azure``.
    ``copies`` and ``copy_interval_s`` replay ``kvtester`` sessions as more users
    (:mod:`~prefixroute.edges.traces.kvtester`); other formats have no sessions to copy.
    """
    if fmt != "kvtester" and (copies != 1 or copy_interval_s):
        raise ConfigError(f"--session-copies: kvtester traces only have sessions to copy, not "
                          f"{fmt}")
    if fmt == "mooncake":
        return read_mooncake(path, block_size)
    if fmt == "kvtester":
        return read_kvtester(path, block_size, copies=copies, copy_interval_s=copy_interval_s)
    if fmt == "jsonl":
        return read_jsonl(path, block_size)
    if fmt == "recording":
        return read_recording(path, block_size)
    if fmt == "azure":
        options = dict(prefixes or {})
        options.setdefault("seed", seed)
        if block_size is not None:
            options["block_size"] = block_size
        return with_prefixes(read_azure(path), **options)
    raise ConfigError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")


def resolve_format(path: str | os.PathLike, given: str | None) -> str:
    """The format to read ``path`` with: ``given``, else detected (and said on stderr). A
    given format that contradicts a clear detection is read as given, with a warning: the
    reader's "missing field" would otherwise not say that another format exists."""
    from prefixroute.edges.traces.common import warn

    if given is None:
        detected = detect_format(path)
        print(f"prefixroute: reading {path} as format {detected} (detected; --trace-format "
              f"to override)", file=sys.stderr)
        return detected
    try:
        detected = detect_format(path)
    except InputError:
        return given
    if detected != given:
        warn(f"{path} looks like format {detected}, not {given}: if the reader stops at a "
             f"missing field, try --trace-format {detected}")
    return given


__all__ = ["FORMATS", "detect_format", "resolve_format", "read_trace", "read_mooncake", "read_kvtester", "read_jsonl",
           "read_azure", "read_recording", "MOONCAKE_BLOCK_SIZE", "RECORDING_KEY"]
