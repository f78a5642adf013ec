"""prefixroute's native trace format: JSON Lines, one request per line (docs/trace-format.md).

An optional first line ``{"prefixroute_trace": 1, "block_size": 16}`` sets the block size for
the file. Each request has ``arrival_s``, ``output_tokens`` and exactly one of ``token_ids``
(the prompt's token ids; ``input_tokens`` optional, must equal their count) or ``hash_ids``
(prefix-chained block ids, with ``input_tokens`` and a block size); optional ``request_id``,
``tenant``, ``session``, ``turn``, ``prefix_group``, ``namespace``, ``cache_salt``, ``model``,
``adapter`` and ``output_token_ids``.
"""

from __future__ import annotations

import os
from array import array
from typing import Iterator

from prefixroute.core.errors import InputError
from prefixroute.core.identity.identity import Adapter, CacheIdentity
from prefixroute.core.simulator.request import Request
from prefixroute.edges.traces.common import (check_block_ids, check_time_order, id_list, integer,
                                             json_records, number, unknown_field_checker)

DEFAULT_TOKEN_BLOCK_SIZE = 16  # vLLM's default block size, for token-id traces
HEADER_KEY = "prefixroute_trace"
_STRING_FIELDS = ("request_id", "tenant", "session", "prefix_group", "namespace", "cache_salt",
                  "model", "adapter")
KNOWN_FIELDS = frozenset(_STRING_FIELDS + ("arrival_s", "output_tokens", "token_ids", "hash_ids",
                                           "input_tokens", "block_size", "turn",
                                           "output_token_ids", HEADER_KEY))


def read_jsonl(path: str | os.PathLike, block_size: int | None = None) -> Iterator[Request]:
    stem = os.path.basename(str(path))
    file_block_size: int | None = None
    previous = 0.0
    identities: dict[tuple, CacheIdentity] = {}
    check_fields = unknown_field_checker(KNOWN_FIELDS)
    for line_number, where, record in json_records(path):
        check_fields(record, where)
        if HEADER_KEY in record:
            if record[HEADER_KEY] != 1:
                raise InputError(f"unsupported format version {record[HEADER_KEY]!r} (this "
                                 f"reader knows 1)", where=where, field=HEADER_KEY)
            if "block_size" in record:
                file_block_size = integer(record, "block_size", where, minimum=1)
                if block_size is not None and file_block_size != block_size:
                    raise InputError(f"block-size mismatch: the header says {file_block_size}, "
                                     f"expected {block_size}", where=where, field="block_size")
            continue
        for name in _STRING_FIELDS:
            if name in record and not isinstance(record[name], str):
                raise InputError(f"expected a string, got {record[name]!r}", where=where,
                                 field=name)
        arrival = number(record, "arrival_s", where)
        check_time_order(arrival, previous, where, "arrival_s")
        previous = arrival
        output_tokens = integer(record, "output_tokens", where, minimum=1)
        line_block_size = None
        if "block_size" in record:
            line_block_size = integer(record, "block_size", where, minimum=1)
        expected = block_size or file_block_size
        if line_block_size is not None and expected is not None and line_block_size != expected:
            raise InputError(f"block-size mismatch: {line_block_size}, expected {expected}",
                             where=where, field="block_size")
        request_block_size = line_block_size or expected
        has_tokens, has_ids = "token_ids" in record, "hash_ids" in record
        if has_tokens == has_ids:
            raise InputError("give exactly one of token_ids and hash_ids", where=where,
                             field="token_ids" if not has_tokens else "hash_ids")
        token_ids = hash_ids = None
        if has_tokens:
            token_ids = array("I", id_list(record, "token_ids", where))
            input_tokens = len(token_ids)
            if "input_tokens" in record and integer(record, "input_tokens", where) != input_tokens:
                raise InputError(f"input_tokens is {record['input_tokens']} but token_ids has "
                                 f"{input_tokens}", where=where, field="input_tokens")
            if input_tokens < 1:
                raise InputError("empty prompt", where=where, field="token_ids")
            request_block_size = request_block_size or DEFAULT_TOKEN_BLOCK_SIZE
        else:
            hash_ids = id_list(record, "hash_ids", where)
            input_tokens = integer(record, "input_tokens", where, minimum=1)
            if request_block_size is None:
                raise InputError("block ids need a block size (on the line, in the header, or "
                                 "--trace-block-size)", where=where, field="block_size")
            check_block_ids(hash_ids, input_tokens, request_block_size, where)
        output_token_ids = None
        if "output_token_ids" in record:
            output_token_ids = array("I", id_list(record, "output_token_ids", where))
        identity_fields = (record.get("model", ""), record.get("cache_salt"),
                           record.get("adapter"))
        identity = identities.get(identity_fields)
        if identity is None:
            model, salt, adapter = identity_fields
            identity = identities[identity_fields] = CacheIdentity(
                model=model, cache_salt=salt, adapter=Adapter(adapter) if adapter else None)
        turn = record.get("turn", 0)
        if isinstance(turn, bool) or not isinstance(turn, int):
            raise InputError(f"expected an integer, got {turn!r}", where=where, field="turn")
        yield Request(record.get("request_id") or f"{stem}:{line_number}", arrival,
                      input_tokens, output_tokens, request_block_size, token_ids=token_ids,
                      hash_ids=hash_ids, tenant=record.get("tenant", ""), identity=identity,
                      session=record.get("session"), turn=turn,
                      prefix_group=record.get("prefix_group"),
                      namespace=record.get("namespace", ""),
                      output_token_ids=output_token_ids)


def request_to_record(request: Request) -> dict:
    """A request as one line of the native format (what :func:`read_jsonl` reads back)."""
    record: dict = {"request_id": request.request_id, "arrival_s": request.arrival_s,
                    "input_tokens": request.input_tokens, "output_tokens": request.output_tokens,
                    "block_size": request.block_size}
    if request.token_ids is not None:
        record["token_ids"] = list(request.token_ids)
    elif request.hash_ids is not None:
        record["hash_ids"] = list(request.hash_ids)
    for name in ("tenant", "session", "prefix_group", "namespace"):
        value = getattr(request, name)
        if value:
            record[name] = value
    if request.turn:
        record["turn"] = request.turn
    identity = request.identity
    if identity.model:
        record["model"] = identity.model
    if identity.cache_salt:
        record["cache_salt"] = identity.cache_salt
    if identity.adapter is not None:
        record["adapter"] = identity.adapter.name
    if request.output_token_ids is not None:
        record["output_token_ids"] = list(request.output_token_ids)
    return record
