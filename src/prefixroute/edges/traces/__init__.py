"""Trace readers: files in, :class:`~prefixroute.core.simulator.request.Request` streams out.

Formats: ``jsonl`` (prefixroute's own, docs/trace-format.md), ``mooncake`` (512-token block
ids), ``kvtester`` (agentic sessions, a directory or files), ``azure`` (arrivals and lengths,
given prefixes by a generator). Every reader streams, checks every field it uses, and raises
:class:`~prefixroute.core.errors.InputError` naming the file and line (or request) and the
field: missing fields, timestamps going backwards, block-size mismatches.
"""

from __future__ import annotations

import os
from typing import Any, Iterable

from prefixroute.core.errors import ConfigError
from prefixroute.core.simulator.generators import with_prefixes
from prefixroute.core.simulator.request import Request
from prefixroute.edges.traces.azure import read_azure
from prefixroute.edges.traces.jsonl import read_jsonl
from prefixroute.edges.traces.kvtester import read_kvtester
from prefixroute.edges.traces.mooncake import MOONCAKE_BLOCK_SIZE, read_mooncake

FORMATS = ("mooncake", "kvtester", "jsonl", "azure")


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
    if fmt == "azure":
        options = dict(prefixes or {})
        options.setdefault("seed", seed)
        if block_size is not None:
            options["block_size"] = block_size
        return with_prefixes(read_azure(path), **options)
    raise ConfigError(f"unknown trace format {fmt!r}; choose one of {', '.join(FORMATS)}")


__all__ = ["FORMATS", "read_trace", "read_mooncake", "read_kvtester", "read_jsonl",
           "read_azure", "MOONCAKE_BLOCK_SIZE"]
