"""Mooncake traces (FAST'25 release): one JSON object per line.

``timestamp`` (ms since the trace start), ``input_length``, ``output_length``, ``hash_ids``:
prefix-chained ids of 512-token blocks, ``len(hash_ids) == ceil(input_length / 512)`` (the
last block usually partial). Ids are global to one trace file, so they need no namespace.
"""

from __future__ import annotations

import os
from typing import Iterator

from prefixroute.core.simulator.request import Request
from prefixroute.edges.traces.common import (check_block_ids, check_time_order, id_list, integer,
                                             json_records, number, unknown_field_checker)

MOONCAKE_BLOCK_SIZE = 512
KNOWN_FIELDS = frozenset(("timestamp", "input_length", "output_length", "hash_ids"))


def read_mooncake(path: str | os.PathLike, block_size: int | None = None) -> Iterator[Request]:
    block_size = block_size or MOONCAKE_BLOCK_SIZE
    stem = os.path.basename(str(path))
    previous = 0.0
    check_fields = unknown_field_checker(KNOWN_FIELDS)
    for number_, where, record in json_records(path):
        check_fields(record, where)
        timestamp_ms = number(record, "timestamp", where)
        check_time_order(timestamp_ms, previous, where, "timestamp")
        previous = timestamp_ms
        input_tokens = integer(record, "input_length", where, minimum=1)
        output_tokens = integer(record, "output_length", where, minimum=0)
        hash_ids = id_list(record, "hash_ids", where)
        check_block_ids(hash_ids, input_tokens, block_size, where, allow_floor=False)
        yield Request(f"{stem}:{number_}", timestamp_ms / 1000.0, input_tokens,
                      max(1, output_tokens), block_size, hash_ids=hash_ids)


def request_to_mooncake(request: Request) -> dict:
    """A request with ``hash_ids`` as one Mooncake trace line (``timestamp`` in whole
    milliseconds, rounded down, so times in order stay in order)."""
    return {"timestamp": int(request.arrival_s * 1000.0), "input_length": request.input_tokens,
            "output_length": request.output_tokens, "hash_ids": list(request.hash_ids)}
