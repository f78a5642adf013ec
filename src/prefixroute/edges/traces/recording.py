"""Recordings of served traffic (``serve`` or ``epp`` with ``record:``; docs/trace-format.md,
"Recordings"), read back as a trace, with what the live fleet did beside it.

A recording is a file or a directory of files (``*.jsonl``, a gateway's rotated files, from
one gateway or several). Every file opens with a header line (``prefixroute_recording``: the
version, ``block_size``, the live ``policy``, ``replicas`` and ``cache_blocks``); every other
line is one request: Mooncake's ``timestamp`` (Unix milliseconds), ``input_length``,
``output_length`` and ``hash_ids`` (one id per full block), its ``trust_group`` and the live
outcome (``live_replica``, ``live_prompt_tokens``, ``live_cached_tokens``,
``live_ttft_ms``, ``live_latency_ms``, ``status``, ``attempts``).

Lines are written as requests end, so they are only nearly in arrival order: the reader loads
every file, checks every field (errors name ``file:line`` and the field), orders the requests
by arrival and replays them from the first arrival. Memory holds the whole recording. Each
trust group is its own block namespace: equal ids in two groups are different blocks, as
they were on the engines (salted per group).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from prefixroute.core.errors import InputError
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.simulator.metrics import percentile
from prefixroute.core.simulator.request import Request
from prefixroute.edges.traces.common import (check_block_ids, id_list, integer, number,
                                             numbered_lines, require, unknown_field_checker,
                                             warn)

RECORDING_KEY = "prefixroute_recording"  # the header's key; its value is the format version
RECORDING_VERSION = 1  # what the gateway's recorder writes and this reader reads
HEADER_FIELDS = frozenset((RECORDING_KEY, "block_size", "policy", "replicas", "cache_blocks",
                           "started_unix_ms"))
LINE_FIELDS = frozenset(("timestamp", "input_length", "output_length", "hash_ids",
                         "trust_group", "model", "live_replica", "live_prompt_tokens",
                         "live_cached_tokens",
                         "live_ttft_ms", "live_latency_ms", "status", "attempts",
                         "input_estimated"))


@dataclass(slots=True)
class LiveOutcome:
    """What the live fleet did with one recorded request (times in seconds)."""

    prompt_tokens: int  # as the engine counted them, else the recorded input length
    replica: str | None
    cached_tokens: int | None
    ttft_s: float | None
    latency_s: float | None
    status: str


def recording_files(path: str | os.PathLike) -> list[Path]:
    """The files of a recording: ``path`` itself, or a directory's ``*.jsonl`` in name
    order (a gateway's rotated files sort by start time, then process, then number)."""
    path = Path(path)
    if not path.is_dir():
        return [path]
    files = sorted(p for p in path.iterdir() if p.suffix == ".jsonl" and p.is_file())
    if not files:
        raise InputError("no *.jsonl recording files in this directory", where=str(path))
    return files


def is_recording(path: str | os.PathLike) -> bool:
    """Whether ``path`` (a file, or a directory's first ``*.jsonl``) starts with a recording
    header."""
    import json

    try:
        first = recording_files(path)[0]
        with open(first, encoding="utf-8") as handle:
            line = handle.readline(1 << 16)
        return isinstance(record := json.loads(line), dict) and RECORDING_KEY in record
    except (OSError, InputError, UnicodeDecodeError, ValueError):
        return False


class Recording:
    """A recording as a request stream (iterate it) and, after that, :attr:`live`: the live
    outcome of each request yielded, in the same order.

    The headers (first lines) are read and checked at once; the requests when iterated.
    ``block_size`` (``--trace-block-size``) must agree with the headers. :attr:`policy`,
    :attr:`replicas` and :attr:`cache_blocks` are what the headers agree on (``None`` where
    they differ or do not say)."""

    def __init__(self, path: str | os.PathLike, block_size: int | None = None):
        self.path = str(path)
        self.files = recording_files(path)
        self.live: list[LiveOutcome] = []
        self.headers: list[dict] = []
        self.block_size = block_size
        for file in self.files:  # the headers first: the fleet's defaults come from them
            first = next(_records(file), None)
            if first is None:
                raise InputError("empty recording file (no header line)", where=str(file))
            self.block_size = self._header(first[2], first[1], self.block_size)["block_size"]

    def _agreed(self, name: str) -> Any:
        values = {repr(h.get(name)) for h in self.headers}
        return self.headers[0].get(name) if len(values) == 1 else None

    @property
    def policy(self) -> str | None:
        return self._agreed("policy")

    @property
    def replicas(self) -> int | None:
        return self._agreed("replicas")

    @property
    def cache_blocks(self) -> int | None:
        return self._agreed("cache_blocks")

    def __iter__(self) -> Iterator[Request]:
        rows: list[tuple[float, int, Request, LiveOutcome]] = []
        block_size = self.block_size
        check_fields = unknown_field_checker(LINE_FIELDS | HEADER_FIELDS)
        for file in self.files:
            records = _records(file)
            next(records)  # the header, read and checked already
            for line_number, where, record in records:
                check_fields(record, where)
                if RECORDING_KEY in record:
                    raise InputError("a second header inside the file", where=where,
                                     field=RECORDING_KEY)
                request, live = _request(record, where, block_size,
                                         f"{file.name}:{line_number}")
                rows.append((request.arrival_s, len(rows), request, live))
        rows.sort(key=lambda row: (row[0], row[1]))
        origin = rows[0][0] if rows else 0.0
        self.live = []
        for arrival, _, request, live in rows:
            request.arrival_s = arrival - origin
            self.live.append(live)
            yield request

    def _header(self, record: dict, where: str, block_size: int | None) -> dict:
        unknown_field_checker(HEADER_FIELDS)(record, where)
        if RECORDING_KEY not in record:
            raise InputError("expected the recording header first", where=where,
                             field=RECORDING_KEY)
        version = record[RECORDING_KEY]
        if version != RECORDING_VERSION:
            raise InputError(f"unsupported recording version {version!r} (this reader knows "
                             f"{RECORDING_VERSION})", where=where, field=RECORDING_KEY)
        size = integer(record, "block_size", where, minimum=1)
        if block_size is not None and size != block_size:
            raise InputError(f"block-size mismatch: this file says {size}, expected "
                             f"{block_size}", where=where, field="block_size")
        for name in ("replicas", "cache_blocks"):
            value = record.get(name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 1):
                raise InputError(f"expected a positive integer or null, got {value!r}",
                                 where=where, field=name)
        if record.get("policy") is not None and not isinstance(record["policy"], str):
            raise InputError(f"expected a string, got {record['policy']!r}", where=where,
                             field="policy")
        self.headers.append(record)
        return record

    def live_summary(self, count: int | None = None, time_scale: float = 1.0) -> dict[str, Any]:
        """The live fleet's figures over the first ``count`` requests (all by default), in
        the units the replay reports: ``time_scale`` stretches the recorded latencies as
        ``--time-scale`` stretches arrivals. The token hit rate counts the requests whose
        answer reported cached tokens (the others had no usage to read)."""
        outcomes = self.live[:count] if count is not None else self.live
        reported = [o for o in outcomes if o.cached_tokens is not None]
        prompt = sum(o.prompt_tokens for o in reported)
        cached = sum(o.cached_tokens for o in reported)
        ttfts = [o.ttft_s * time_scale for o in outcomes if o.ttft_s is not None]
        latencies = [o.latency_s * time_scale for o in outcomes if o.latency_s is not None]
        statuses: dict[str, int] = {}
        per_replica: dict[str, int] = {}
        for o in outcomes:
            statuses[o.status] = statuses.get(o.status, 0) + 1
            if o.replica is not None:
                per_replica[o.replica] = per_replica.get(o.replica, 0) + 1
        return {
            "policy": self.policy, "replicas": self.replicas or len(per_replica) or None,
            "cache_blocks": self.cache_blocks, "requests": len(outcomes),
            "requests_reported": len(reported), "statuses": dict(sorted(statuses.items())),
            "token_hit_rate": cached / prompt if prompt else None,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_requests": len(ttfts),
            "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
            "ttft_p99_s": percentile(ttfts, 99),
            "e2e_p50_s": percentile(latencies, 50), "e2e_p99_s": percentile(latencies, 99),
            "assignments": dict(sorted(per_replica.items()))}


def _records(file: Path) -> Iterator[tuple[int, str, dict]]:
    """The file's JSON lines (``json_records``'s checks); a last line cut short (the writer
    was killed mid-line: no newline at its end, not JSON) is left out with a warning rather
    than refused."""
    import json

    for line_number, line in numbered_lines(file):
        where = f"{file}:{line_number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            if not line.endswith("\n"):
                warn(f"{where}: an unfinished last line left out (the writer stopped "
                     "mid-line)")
                return
            raise InputError(f"not valid JSON ({exc.msg})", where=where) from None
        if not isinstance(record, dict):
            raise InputError("expected a JSON object", where=where)
        yield line_number, where, record


def _optional(record: dict, name: str, where: str, kind: str) -> Any:
    value = record.get(name)
    if value is None:
        return None
    if kind == "int":
        return integer(record, name, where)
    if kind == "number":
        return number(record, name, where)
    if not isinstance(value, str):
        raise InputError(f"expected a string or null, got {value!r}", where=where, field=name)
    return value


def _request(record: dict, where: str, block_size: int, request_id: str
             ) -> tuple[Request, LiveOutcome]:
    timestamp_ms = number(record, "timestamp", where)
    input_tokens = integer(record, "input_length", where, minimum=1)
    output_tokens = integer(record, "output_length", where, minimum=0)
    hash_ids = id_list(record, "hash_ids", where)
    check_block_ids(hash_ids, input_tokens, block_size, where)
    group = require(record, "trust_group", where)
    if not isinstance(group, str) or not group:
        raise InputError(f"expected a non-empty string, got {group!r}", where=where,
                         field="trust_group")
    model = _optional(record, "model", where, "str") or ""
    ttft_ms = _optional(record, "live_ttft_ms", where, "number")
    latency_ms = _optional(record, "live_latency_ms", where, "number")
    prompt_tokens = _optional(record, "live_prompt_tokens", where, "int")
    live = LiveOutcome(input_tokens if prompt_tokens is None else prompt_tokens,
                       _optional(record, "live_replica", where, "str"),
                       _optional(record, "live_cached_tokens", where, "int"),
                       None if ttft_ms is None else ttft_ms / 1000.0,
                       None if latency_ms is None else latency_ms / 1000.0,
                       _optional(record, "status", where, "str") or "unknown")
    _optional(record, "attempts", where, "int")
    request = Request(request_id, timestamp_ms / 1000.0, input_tokens, max(1, output_tokens),
                      block_size, hash_ids=hash_ids, tenant=group,
                      identity=CacheIdentity(model=model), namespace=group)
    return request, live


def read_recording(path: str | os.PathLike, block_size: int | None = None) -> Recording:
    return Recording(path, block_size)
