"""Recording served traffic as a trace the simulator replays (docs/trace-format.md,
"Recordings").

Each request that reached the router (``serve`` and the EPP both end a request in
``Gateway._job_done``) becomes one JSON line: its arrival time, the Mooncake trace's four
fields (``timestamp``, ``input_length``, ``output_length``, ``hash_ids``), an opaque id of its
trust group, and what the live fleet did with it (replica, reported cached tokens, TTFT,
latency, status). ``prefixroute simulate --trace DIR`` replays the files through any policy
and fleet size and sets each policy's counterfactual beside the live figures.

What the file can and cannot tell:

* No prompt text, no token ids, no tenant names, no salts. Block ids are
  ``HMAC-SHA256(server secret, trust group id || engine block key)`` cut to 32 bits: without
  the secret they say nothing about the prompt, and since the engine's block keys are already
  salted per trust group and the group is in the HMAC too, two groups never share an id for
  the same prompt, while inside a group equal prefixes keep equal ids (what replay needs).
  32 bits because the simulator reads block ids as ``uint32``; ids only have to tell apart
  two different blocks that follow the same prefix (the simulator chains each id onto the
  ones before it), so a collision that matters has odds of 2^-32 per such pair.
* The trust group id is ``"tg-"`` and 16 hex digits of an HMAC of the group's cache salt:
  stable while the secret is, unlinkable to the group's name or salt without it. Model names
  are HMACed the same way (``"m-"``): an adapter's name can name a customer.

Writing never slows or fails a request: :meth:`TrafficRecorder.record` copies a few fields
into a bounded queue (``record.queue``) and returns; a thread hashes, encodes and writes.
A full queue or a write error drops the record and counts it
(``prefixroute_gateway_trace_records_dropped_total{reason}``). Lines are written when
requests end, so arrival times in a file are only nearly in order; the reader sorts them.

Files: ``DIR/prefixroute-trace-<start>-<pid>-<n>.jsonl`` (a name per process, so several
gateways may share a directory). Each starts with a header line (block size, policy, fleet
size and KV blocks per replica as known then); past ``rotate_mb`` megabytes the
writer starts the next file and deletes this process's oldest beyond ``keep``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

from prometheus_client import CollectorRegistry, Counter

from prefixroute.core.errors import ConfigError
from prefixroute.edges.gateway.config import RecordConfig
from prefixroute.edges.gateway.prompts import CHARS
from prefixroute.edges.traces.recording import RECORDING_KEY, RECORDING_VERSION

log = logging.getLogger("prefixroute.gateway")

FILE_PREFIX = "prefixroute-trace-"
_ID_DOMAIN = b"prefixroute-trace/v1/block\x00"
_GROUP_DOMAIN = b"prefixroute-trace/v1/trust-group\x00"
_MODEL_DOMAIN = b"prefixroute-trace/v1/model\x00"
# Block key -> id, per writer: prompts that share a prefix hash its blocks once. 200,000
# entries: about 3M tokens of distinct prefixes at block 16, some 30 MB.
ID_MEMO_BLOCKS = 200_000
_STOP = object()
DROP_REASONS = ("queue_full", "write_error", "stopped", "error", "empty_prompt")


def trust_group_id(secret: bytes, cache_salt: str | None) -> str:
    """The opaque id of the trust group whose requests carry ``cache_salt`` (``"tg-none"``
    for a request without one)."""
    if not cache_salt:
        return "tg-none"
    digest = hmac.new(secret, _GROUP_DOMAIN + cache_salt.encode(), hashlib.sha256).hexdigest()
    return "tg-" + digest[:16]


def model_id(secret: bytes, model: str) -> str:
    """The opaque id of a model name: ``"m-"`` and 12 hex digits of its HMAC. Names are
    not written as they are because an adapter's name can name a customer."""
    return "m-" + hmac.new(secret, _MODEL_DOMAIN + model.encode(), hashlib.sha256).hexdigest()[:12]


def block_id(secret: bytes, group: str, block_key: int) -> int:
    """A block's id in a recording: keyed with the server secret, scoped to its trust group."""
    message = _ID_DOMAIN + group.encode() + b"\x00" + (block_key & ((1 << 64) - 1)).to_bytes(
        8, "big")
    return int.from_bytes(hmac.new(secret, message, hashlib.sha256).digest()[:4], "big")


class BlockIds:
    """:func:`block_id` with a bounded memo (the writer thread's only)."""

    def __init__(self, secret: bytes, memo_blocks: int = ID_MEMO_BLOCKS):
        self._secret = secret
        self._memo: OrderedDict[tuple[str, int], int] = OrderedDict()
        self._size = memo_blocks

    def __call__(self, group: str, keys: Sequence[int]) -> list[int]:
        memo, out = self._memo, []
        for key in keys:
            found = memo.get((group, key))
            if found is None:
                found = memo[(group, key)] = block_id(self._secret, group, key)
                if len(memo) > self._size:
                    memo.popitem(last=False)
            out.append(found)
        return out


@dataclass(slots=True)
class Finished:
    """What the request path hands the writer: plain values, copied at the request's end."""

    arrival_unix_s: float
    cache_salt: str | None
    model: str
    block_keys: Sequence[int]  # a prepared prompt's tuple: immutable, shared, not copied
    input_tokens: int
    estimated: bool  # character blocks: input_tokens is the gateway's estimate
    output_tokens: int
    replica: str | None
    prompt_tokens: int | None  # the engine's count (usage.prompt_tokens)
    cached_tokens: int | None
    ttft_s: float | None
    latency_s: float
    status: str
    attempts: int
    policy: str | None = None  # the gateway's policy when the request ended (set on queueing)


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 \
        else None


def output_tokens_of(usage: dict | None, body: dict) -> int:
    """Tokens the reply had (``usage.completion_tokens``), else what the caller asked for at
    most, else 1 (an engine samples at least one token)."""
    for value in ((usage or {}).get("completion_tokens"), body.get("max_tokens"),
                  body.get("max_completion_tokens")):
        if _count(value) is not None:
            return max(1, value)
    return 1


class TrafficRecorder:
    """Writes finished requests to rotating trace files on a thread of its own.

    ``fleet`` returns the header's fleet description (``replicas``, ``cache_blocks``) when a
    file starts; ``wall`` and ``now`` are the wall clock and the gateway's clock, to date
    arrivals (kept on the gateway's clock) in Unix time."""

    def __init__(self, config: RecordConfig, secret: bytes, registry: CollectorRegistry, *,
                 block_size: int, policy: str,
                 fleet: Callable[[], dict[str, Any]] = dict,
                 now: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time):
        self.config = config
        self.directory = Path(config.path)
        self._secret = secret
        self._ids = BlockIds(secret)
        self._models: dict[str, str] = {}  # the writer thread's
        self._header = {RECORDING_KEY: RECORDING_VERSION, "block_size": block_size}
        self._policy = policy  # the request path's; each record carries its own copy
        self._file_policy: str | None = None  # the writer thread's: the open file's header
        self._fleet = fleet
        self._offset = wall() - now()  # gateway clock -> Unix time
        self._queue: queue.Queue = queue.Queue(maxsize=config.queue)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._stem = f"{FILE_PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime(wall()))}" \
                     f"-{os.getpid()}-"
        self._files: list[Path] = []  # this writer's, oldest first
        self._file_number = 0
        self._handle: Any = None
        self._size = 0
        self._limit = int(config.rotate_mb * 1_000_000)
        p = "prefixroute_gateway_trace_"
        self.written = Counter(p + "records_total", "Requests written to the traffic "
                               "recording", registry=registry)
        self.dropped = Counter(p + "records_dropped_total", "Requests the traffic recording "
                               "left out: its queue was full or a write failed",
                               ["reason"], registry=registry)
        for reason in DROP_REASONS:  # shown as 0 from the start, not from the first drop
            self.dropped.labels(reason)

    # -- the request path -------------------------------------------------------------------

    def set_policy(self, policy: str) -> None:
        """A reload changed the policy: records queued from now on carry the new name, and the
        writer starts a new file at the first of them, so each file holds one policy's
        decisions even when records of the old policy are still queued."""
        self._policy = policy

    def record(self, job: Any, now: float) -> None:
        """Queue ``job`` (a finished :class:`~prefixroute.edges.gateway.proxy.Job`) for
        writing, or count it dropped; never blocks, never raises."""
        try:
            body = job.checked.body
            item = Finished(
                job.started + self._offset, body.get("cache_salt"), job.checked.model,
                job.prompt.block_keys, job.prompt.num_tokens, job.prompt.mode == CHARS,
                output_tokens_of(job.usage, body), job.replica,
                _count((job.usage or {}).get("prompt_tokens")), job.cached_tokens,
                job.ttft_s, now - job.started, job.status, job.attempts)
        except Exception as exc:  # a bug of ours must not reach the request
            log.error("could not record a request", exc_info=exc,
                      extra={"fields": {"event": "record_failed"}})
            self.dropped.labels("error").inc()
            return
        self.record_finished(item)

    def record_finished(self, item: Finished) -> None:
        """Queue ``item`` for writing, or count it dropped (the queue is full, or the
        recorder stopped, or the prompt had no tokens: nothing to replay)."""
        if item.input_tokens < 1:  # an empty prompt measured in character blocks
            self.dropped.labels("empty_prompt").inc()
            return
        if self._closed:
            self.dropped.labels("stopped").inc()
            return
        if item.policy is None:
            item.policy = self._policy
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped.labels("queue_full").inc()

    # -- start and stop ---------------------------------------------------------------------

    def check_directory(self, source: str = "config") -> None:
        """Create the directory, or raise :class:`ConfigError` saying why it cannot be
        written (``source``: the configuration file, named in the message)."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".{self._stem}probe"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as exc:
            raise ConfigError(f"{source}: record.path: cannot write to {self.directory}: "
                              f"{exc.strerror or exc}") from None

    def start(self) -> None:
        """Start the writer thread."""
        if self._thread is not None or self._closed:
            return
        self._thread = threading.Thread(target=self._run, name="prefixroute-recorder",
                                        daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = 10.0) -> None:
        """Write what is queued, close the file, stop the thread (blocking: call it from a
        worker thread in async code)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is None:
            return
        try:  # a writer that stopped writing leaves a full queue: never wait on it for ever
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            return
        self._thread.join(timeout_s)

    # -- the writer thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                break
            self._write(item)
            if self._queue.empty() and self._handle is not None:
                self._flush()
        if self._handle is not None:
            self._flush()
            if self._handle is not None:
                self._handle.close()
                self._handle = None

    def line(self, item: Finished) -> bytes:
        """One request as a line of the recording (the format's documentation lists the
        fields)."""
        group = trust_group_id(self._secret, item.cache_salt)
        record = {
            "timestamp": round(item.arrival_unix_s * 1000.0, 3),
            "input_length": item.input_tokens, "output_length": item.output_tokens,
            "hash_ids": self._ids(group, item.block_keys),
            "trust_group": group, "model": self._model_id(item.model),
            "live_replica": item.replica,
            "live_prompt_tokens": item.prompt_tokens, "live_cached_tokens": item.cached_tokens,
            "live_ttft_ms": None if item.ttft_s is None else round(item.ttft_s * 1000.0, 3),
            "live_latency_ms": round(item.latency_s * 1000.0, 3),
            "status": item.status, "attempts": item.attempts}
        if item.estimated:
            record["input_estimated"] = True
        return json.dumps(record, separators=(",", ":")).encode() + b"\n"

    def _write(self, item: Finished) -> None:
        try:
            data = self.line(item)
            if self._handle is None or self._size >= self._limit \
                    or item.policy != self._file_policy:
                self._rotate(item.policy)
            self._handle.write(data)
            self._size += len(data)
            self.written.inc()
        except Exception as exc:  # a full disk, a removed directory: drop, say so, go on
            self._failed(exc)

    def _failed(self, exc: Exception) -> None:
        """A write or flush failed: count the loss, log it, drop the file handle (the next
        record starts a new file)."""
        self.dropped.labels("write_error").inc()
        log.error("could not write to the traffic recording", exc_info=exc,
                  extra={"fields": {"event": "record_write_failed", "path": str(self.directory)}})
        if self._handle is not None:
            try:
                self._handle.close()
            except OSError:
                pass
            self._handle = None

    def _rotate(self, policy: str | None) -> None:
        if self._handle is not None:
            self._flush()
        if self._handle is not None:
            self._handle.close()
            self._handle = None
        path = self.directory / f"{self._stem}{self._file_number:05d}.jsonl"
        self._file_number += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        handle = open(path, "xb")
        header = {**self._header, "policy": policy, **self._fleet(),
                  "started_unix_ms": round(time.time() * 1000.0, 3)}
        data = json.dumps(header, separators=(",", ":")).encode() + b"\n"
        handle.write(data)
        self._handle, self._size, self._file_policy = handle, len(data), policy
        self._files.append(path)
        while len(self._files) > self.config.keep:
            oldest = self._files.pop(0)
            try:
                oldest.unlink()
            except FileNotFoundError:
                pass

    def _model_id(self, model: str) -> str:
        found = self._models.get(model)
        if found is None:
            found = self._models[model] = model_id(self._secret, model)
        return found

    def _flush(self) -> None:
        """Buffered lines go to the file; a full disk shows here as often as at a write, and
        gets the same treatment (the buffered lines dropped and counted, the writer goes on
        with a new file)."""
        try:
            self._handle.flush()
        except OSError as exc:
            self._failed(exc)


def fleet_description(backends: Sequence[Any]) -> dict[str, Any]:
    """The header's fleet: how many replicas, and the fewest usable KV blocks any of them
    has as known now (configured ``capacity_blocks``, else the engine's reported count less
    vLLM's reserved null block), or ``None`` when none is known yet."""
    capacities = []
    for backend in backends:
        blocks = backend.config.capacity_blocks
        if blocks is None and backend.num_gpu_blocks and backend.num_gpu_blocks > 1:
            blocks = backend.num_gpu_blocks - 1
        if blocks:
            capacities.append(int(blocks))
    return {"replicas": len(backends), "cache_blocks": min(capacities) if capacities else None}
