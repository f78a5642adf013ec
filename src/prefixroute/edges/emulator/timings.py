"""Opt-in per-request timing records: when a generation request arrived, when its first
response body bytes (a stream's first event) were written.

Off unless ``PREFIXROUTE_EMULATOR_TIMINGS=N`` (N > 0) is set in the replica's environment;
then the last N records of ``POST /v1/completions`` and ``POST /v1/chat/completions`` are
kept in memory and served by ``GET /debug/timings`` (``DELETE /debug/timings`` empties
them). Normal serving does not go through this code at all.

What a record holds (times are ``time.perf_counter_ns()`` of the replica's process,
CLOCK_MONOTONIC on Linux, so they compare with other processes' on the same machine, but
only their *difference* is meant to be used):

``received_ns``
    when the ASGI application was called for the request: uvicorn has read and parsed its
    head (for small bodies the body came in the same read);
``first_event_ns``
    just after the first non-empty ``http.response.body`` message was handed to the server
    (uvicorn writes it to the socket's transport at once). For a stream this is the first
    SSE event; for a non-streaming request, the whole body;
``request_id``
    the ``x-request-id`` header, if any;
``user``
    the body's ``"user"`` string, if any (a per-request tag a load generator can set and
    every router forwards with the body).

The benchmark (``benchmarks/gateway_bench.py``) subtracts ``first_event_ns - received_ns``
from the client's TTFT of the same request: what is left is the hop (client, network, router
and back), without the wait for the engine step.
"""

from __future__ import annotations

import collections
import os
import re
import time
from typing import Any

ENV = "PREFIXROUTE_EMULATOR_TIMINGS"
PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
_USER = re.compile(rb'"user"\s*:\s*"((?:[^"\\]|\\.)*)"')


def capacity_from_env(environ=os.environ) -> int:
    """The number of records to keep, 0 (off) unless :data:`ENV` is a positive integer."""
    value = environ.get(ENV, "").strip()
    if not value:
        return 0
    try:
        count = int(value)
    except ValueError:
        raise ValueError(f"{ENV} must be an integer, got {value!r}") from None
    return max(0, count)


class TimingRecords:
    """The last ``capacity`` records, as tuples (request_id, user, received_ns,
    first_event_ns)."""

    def __init__(self, capacity: int):
        self.records: collections.deque = collections.deque(maxlen=capacity)

    def as_json(self) -> dict[str, Any]:
        return {"clock": "time.perf_counter_ns", "capacity": self.records.maxlen,
                "records": [{"request_id": rid, "user": user, "received_ns": received,
                             "first_event_ns": first}
                            for rid, user, received, first in self.records]}

    def clear(self) -> None:
        self.records.clear()


class TimingMiddleware:
    """Pure ASGI middleware that keeps one record per generation request that wrote a
    body (requests that never wrote one, e.g. a client gone first, leave none)."""

    def __init__(self, app, records: TimingRecords):
        self.app = app
        self.records = records

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] not in PATHS \
                or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        received = time.perf_counter_ns()
        request_id = None
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                request_id = value.decode("latin-1")
                break
        chunks: list[bytes] = []

        async def receive_body():
            message = await receive()
            if message["type"] == "http.request":
                chunks.append(message.get("body", b""))
            return message

        written = False

        async def send_timed(message) -> None:
            nonlocal written
            await send(message)
            if not written and message["type"] == "http.response.body" \
                    and message.get("body"):
                written = True
                first = time.perf_counter_ns()
                user = None
                if chunks:
                    found = _USER.search(b"".join(chunks))
                    if found:
                        user = found.group(1).decode("utf-8", "replace")
                self.records.records.append((request_id, user, received, first))

        await self.app(scope, receive_body, send_timed)
