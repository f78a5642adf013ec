"""Agentic coding-session traces of kv-cache-tester: one JSON document per session.

Top level: ``block_size`` (64), ``hash_id_scope`` (``"local"``: ids are unique only within the
file), ``requests``: ``t`` (seconds since the session start), ``in``, ``out``, ``hash_ids``
(one id per *full* block of ``in``), ``think_time`` (seconds the user or agent took after
the previous reply; kept as :attr:`Request.think_s` for a closed-loop replay), plus ``type``
and ``api_time`` we do not need (for most turns ``t`` is the previous one's plus its
``api_time`` plus the turn's ``think_time`` to within a second; ``docs/trace-format.md``).
Files are replayed as concurrent sessions, every one starting at 0 (plus ``stagger_s`` x
its position); each file's ids are namespaced by its name so that equal local ids in two
files stay different blocks. An ``out`` of 0 is replayed as 1 token (an engine always
samples one).

``copies`` replays every file that many times as different users' sessions (copy ``c`` of
``s1`` is session ``s1#c``, its ids its own, starting ``c x copy_interval_s`` later; copy 0 is
the file as it is). That raises the load and keeps each session's recorded pacing (a turn
``t`` seconds into its session). Compressing time (``--time-scale``) raises the load too,
but sends turns long before the replies they follow: at a tenth of the recorded times, 90%
of this data set's turns arrived while an earlier turn of their session was still running
(mean 8.5 of them, up to 38), against 2% as recorded and 37% with 5 copies 600 s apart, all
on 8 replicas (``benchmarks/agentic_pacing.py``, 2026-11-30). Either way the recorded times
are an open loop: turns keep them however late the replies come. ``simulate --closed-loop``
replays the sessions as kv-cache-tester itself does: each turn ``think_time`` after the
previous reply (:func:`~prefixroute.core.simulator.simulation.prepare_workload`).

A document is one JSON line, so errors name ``file:requests[i]`` rather than a line.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from pathlib import Path
from typing import Iterator, Sequence

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.simulator.request import Request
from prefixroute.edges.traces.common import (check_block_ids, check_time_order, id_list, integer,
                                             number, open_text, require)


def session_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The ``*.json`` files of the given files and directories, sorted by name."""
    out: list[Path] = []
    for path in paths:
        p = Path(path)
        if p.is_dir():
            out.extend(sorted(q for q in p.glob("*.json") if q.is_file()))
        elif p.exists():
            out.append(p)
        else:
            raise InputError("no such file or directory", where=str(p))
    if not out:
        raise InputError("no session files (*.json)", where=", ".join(map(str, paths)))
    return out


def _read_session(path: Path, index: int, block_size: int | None, stagger_s: float,
                  copies: int, copy_interval_s: float) -> tuple[int, list[list[Request]]]:
    """The file's block size and its requests, one list per copy (each in time order)."""
    with open_text(path) as fh:
        try:
            document = json.load(fh)
        except json.JSONDecodeError as exc:
            raise InputError(f"not valid JSON ({exc.msg})", where=f"{path}:{exc.lineno}") from None
    where = str(path)
    if not isinstance(document, dict):
        raise InputError("expected a JSON object", where=where)
    file_block_size = integer(document, "block_size", where, minimum=1)
    if block_size is not None and file_block_size != block_size:
        raise InputError(f"block-size mismatch: the file says {file_block_size}, expected "
                         f"{block_size}", where=where, field="block_size")
    requests = require(document, "requests", where)
    if not isinstance(requests, list):
        raise InputError("expected a list", where=where, field="requests")
    namespace = str(document.get("id") or path.stem)
    if copies > 1 and "#" in namespace:
        raise InputError(f"session {namespace!r} has a '#', which names the copies of sessions",
                         where=where, field="id" if document.get("id") else None)
    offset = index * stagger_s
    previous = 0.0
    out: list[list[Request]] = []
    records = []
    for i, record in enumerate(requests):
        at = f"{path}:requests[{i}]"
        if not isinstance(record, dict):
            raise InputError("expected a JSON object", where=at)
        t = number(record, "t", at)
        check_time_order(t, previous, at, "t")
        previous = t
        input_tokens = integer(record, "in", at, minimum=1)
        output_tokens = integer(record, "out", at, minimum=0)
        hash_ids = id_list(record, "hash_ids", at)
        check_block_ids(hash_ids, input_tokens, file_block_size, at)
        think = number(record, "think_time", at) if "think_time" in record else None
        records.append((t, input_tokens, max(1, output_tokens), hash_ids, think))
    for copy in range(copies):
        name = namespace if copy == 0 else f"{namespace}#{copy}"
        start = offset + copy * copy_interval_s
        out.append([Request(f"{name}:{i}", start + t, n, out_tokens, file_block_size,
                            hash_ids=ids, session=name, turn=i, tenant=name, namespace=name,
                            think_s=think if i else None)
                    for i, (t, n, out_tokens, ids, think) in enumerate(records)])
    return file_block_size, out


def check_copies(copies: int, copy_interval_s: float) -> None:
    """Refuse copy settings that mean nothing (messages name the ``simulate`` flags)."""
    if isinstance(copies, bool) or not isinstance(copies, int) or copies < 1:
        raise ConfigError(f"--session-copies: must be an integer of at least 1, got {copies!r}")
    if not math.isfinite(copy_interval_s) or copy_interval_s < 0:
        raise ConfigError(f"--copy-interval: must be a non-negative number of seconds, got "
                          f"{copy_interval_s!r}")
    if copy_interval_s and copies == 1:
        raise ConfigError("--copy-interval needs --session-copies of 2 or more")


def read_kvtester(paths: str | os.PathLike | Sequence[str | os.PathLike],
                  block_size: int | None = None, stagger_s: float = 0.0, copies: int = 1,
                  copy_interval_s: float = 0.0) -> Iterator[Request]:
    """Merge every session file's requests by time (ties: file order, then copy, then
    request order); ``copies`` and ``copy_interval_s`` as in the module docstring, checked
    at the call (the files are read as the requests are taken)."""
    check_copies(copies, copy_interval_s)
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    return _merged(paths, block_size, stagger_s, copies, copy_interval_s)


def _merged(paths: Sequence[str | os.PathLike], block_size: int | None, stagger_s: float,
            copies: int, copy_interval_s: float) -> Iterator[Request]:
    streams = []
    for index, path in enumerate(session_files(paths)):
        file_block_size, copied = _read_session(path, index, block_size, stagger_s, copies,
                                                copy_interval_s)
        if block_size is None:
            block_size = file_block_size
        streams.extend([((r.arrival_s, index, c, i), r) for i, r in enumerate(requests)]
                       for c, requests in enumerate(copied))
    for _, request in heapq.merge(*streams, key=lambda item: item[0]):
        yield request
