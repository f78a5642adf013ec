"""KV cache events: what an engine tells a router about the blocks it stores and drops.

vLLM publishes one *batch* per scheduler step that changed its prefix cache
(``Scheduler.update_from_output`` -> ``KVEventBatch(ts=time.time(), events=...)``,
``vllm/v1/core/sched/scheduler.py``). A batch is a msgpack array ``[ts, [events...],
data_parallel_rank]``; the three event kinds are :class:`BlockStored`, :class:`BlockRemoved`
and :class:`AllBlocksCleared` (``vllm/distributed/kv_events.py``).

Two wire formats exist, and consumers must read both:

``tagged`` (vLLM 0.32)
    Each event is a msgpack map whose first key ``"type"`` names the event, followed by the
    fields in declaration order. vLLM encodes its events with msgspec's ``omit_defaults=True``:
    a field that has a default (``extra_keys``, ``group_idx``, ``kv_cache_spec_kind``, ...) is
    left out when it equals that default (``None``), while the fields declared without a
    default (``lora_id``, ``medium``, ``lora_name`` for ``BlockStored``; ``medium`` for
    ``BlockRemoved``) are always written, ``None`` included. :func:`encode_event_batch` with
    ``wire_format="tagged"`` reproduces vLLM 0.32's bytes exactly (checked against recorded
    frames in ``tests/fixtures/vllm_0.32``).

``positional`` (vLLM before the tagged maps, and msgspec ``array_like`` publishers)
    Each event is an array ``["BlockStored", block_hashes, parent_block_hash, token_ids,
    block_size, lora_id, medium, lora_name, extra_keys, ...]``. Older engines sent fewer
    fields, so a missing trailing field reads as ``None``; trailing fields beyond the ones
    known here are ignored, as msgspec-based consumers ignore unknown map keys.

The batch itself is an array in both formats. vLLM always writes ``data_parallel_rank``
(msgspec does not omit defaults of ``array_like`` structs, and the publisher fills the rank
in); a two-element batch from an older engine reads with ``data_parallel_rank=None``.

A block hash in an event is the low 64 bits of the engine's block digest as an unsigned int
(``maybe_convert_block_hash``; ``hashing.vllm_event_block_hash`` computes it). With
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`` vLLM sends the raw digest as bytes instead, and very
old engines sent Python's signed ``hash()``; all three are accepted.

Event ``extra_keys`` are *untagged* (``to_event_extra_keys``): one entry per stored block,
``None`` or a tuple holding the LoRA name, ``(mm_identifier, offset)`` pairs, the cache salt
and prompt-embedding digests, in that order. The block hash itself uses the tagged form
(``("cache_salt", salt)``), see ``prefixroute.core.identity.hashing``.

Pure: no sockets, no clock. The ZMQ transport lives in ``prefixroute.edges.kvevents.zmq``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

import msgpack

from prefixroute.core.errors import InputError

WireFormat = Literal["tagged", "positional"]
WIRE_FORMATS: tuple[str, ...] = ("tagged", "positional")

BlockHashValue = Union[int, bytes]
"""A block id as published: unsigned low 64 bits (default), raw digest bytes, or (old engines)
a signed 64-bit Python ``hash()``."""

_MIN_HASH = -(1 << 63)
_MAX_HASH = (1 << 64) - 1

# Storage media vLLM names in events (``MEDIUM_*`` in kv_events.py).
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A run of consecutive full blocks became reusable (or, in ``kv_cache_report_mode=full``,
    was reused) on the engine.

    ``block_hashes[i]`` covers ``token_ids[i*block_size:(i+1)*block_size]``; the run chains onto
    ``parent_block_hash`` (``None`` when it starts at the prompt's first block). Field order and
    names are vLLM 0.32's ``BlockStored``.
    """

    block_hashes: tuple[BlockHashValue, ...]
    parent_block_hash: BlockHashValue | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None  # deprecated in vLLM; lora_name is what the hash uses
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks were evicted from the engine's prefix cache (vLLM emits one per block, at the
    moment a freed block is handed out again, not when it is freed)."""

    block_hashes: tuple[BlockHashValue, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole prefix cache (``/reset_prefix_cache``)."""


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The events of one engine step, stamped with the engine's wall time (seconds)."""

    ts: float
    events: tuple[KVEvent, ...] = field(default_factory=tuple)
    data_parallel_rank: int | None = None


# -- schema --------------------------------------------------------------------------------
# (name, kind, required): ``required`` fields have no default in vLLM's msgspec struct, so the
# tagged encoding always writes them; the others are omitted when None (omit_defaults=True).
_HASH, _HASH_OPT, _INT, _INT_OPT, _STR_OPT, _HASHES, _TOKENS, _EXTRA = range(8)

_SCHEMAS: dict[str, tuple[type, tuple[tuple[str, int, bool], ...]]] = {
    "BlockStored": (BlockStored, (
        ("block_hashes", _HASHES, True),
        ("parent_block_hash", _HASH_OPT, True),
        ("token_ids", _TOKENS, True),
        ("block_size", _INT, True),
        ("lora_id", _INT_OPT, True),
        ("medium", _STR_OPT, True),
        ("lora_name", _STR_OPT, True),
        ("extra_keys", _EXTRA, False),
        ("group_idx", _INT_OPT, False),
        ("kv_cache_spec_kind", _STR_OPT, False),
        ("kv_cache_spec_sliding_window", _INT_OPT, False),
        ("locality", _STR_OPT, False),
        ("ownership", _STR_OPT, False),
        ("session_id", _STR_OPT, False),
    )),
    "BlockRemoved": (BlockRemoved, (
        ("block_hashes", _HASHES, True),
        ("medium", _STR_OPT, True),
        ("group_idx", _INT_OPT, False),
        ("locality", _STR_OPT, False),
        ("ownership", _STR_OPT, False),
    )),
    "AllBlocksCleared": (AllBlocksCleared, ()),
}
_TYPE_NAMES: dict[type, str] = {cls: name for name, (cls, _) in _SCHEMAS.items()}

# Positional arrays from engines that predate a field simply end early; these are the fields
# every positional BlockStored/BlockRemoved must carry (the vLLM 0.8 shape).
_MIN_POSITIONAL = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}
# The positional encoder always writes the fields up to lora_name (the shape older vLLM sent),
# then later fields only as far as the last one that is set.
_POSITIONAL_ALWAYS = {"BlockStored": 7, "BlockRemoved": 2, "AllBlocksCleared": 0}


# -- decoding ------------------------------------------------------------------------------
def decode_event_batch(payload: bytes, *, where: str | None = None,
                       skip_unknown: bool = False) -> EventBatch:
    """Decode one msgpack batch, tagged or positional (each event is read as it comes).

    Raises :class:`InputError` naming the offending field on malformed input. An event type
    this module does not know raises too, unless ``skip_unknown`` (then it is dropped).
    """
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise InputError(f"a KV event batch must be bytes, got {type(payload).__name__}",
                         where=where)
    try:
        obj = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise InputError(f"not a msgpack KV event batch: {exc}", where=where) from None
    return batch_from_obj(obj, where=where, skip_unknown=skip_unknown)


def batch_from_obj(obj: Any, *, where: str | None = None,
                   skip_unknown: bool = False) -> EventBatch:
    """Build an :class:`EventBatch` from an already unpacked msgpack value."""
    if not isinstance(obj, (list, tuple)) or not 2 <= len(obj) <= 3:
        raise InputError("a KV event batch must be an array [ts, events, "
                         "data_parallel_rank?]", where=where, field="batch")
    ts = obj[0]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)):
        raise InputError(f"timestamp must be a number, got {_kind(ts)}", where=where,
                         field="ts")
    raw_events = obj[1]
    if not isinstance(raw_events, (list, tuple)):
        raise InputError(f"events must be an array, got {_kind(raw_events)}", where=where,
                         field="events")
    rank = obj[2] if len(obj) == 3 else None
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int)):
        raise InputError(f"data_parallel_rank must be an integer or nil, got {_kind(rank)}",
                         where=where, field="data_parallel_rank")
    events = []
    for i, raw in enumerate(raw_events):
        event = event_from_obj(raw, where=where, path=f"events[{i}]",
                               skip_unknown=skip_unknown)
        if event is not None:
            events.append(event)
    return EventBatch(float(ts), tuple(events), rank)


def event_from_obj(obj: Any, *, where: str | None = None, path: str = "event",
                   skip_unknown: bool = False) -> KVEvent | None:
    """One event from its tagged map or positional array (``None`` if skipped as unknown)."""
    if isinstance(obj, dict):
        type_name = obj.get("type")
        values = obj
        positional = False
    elif isinstance(obj, (list, tuple)) and obj:
        type_name = obj[0]
        values = obj[1:]
        positional = True
    else:
        raise InputError(f"an event must be a map with 'type' or an array starting with the "
                         f"event name, got {_kind(obj)}", where=where, field=path)
    if not isinstance(type_name, str):
        raise InputError(f"event type must be a string, got {_kind(type_name)}", where=where,
                         field=f"{path}.type")
    schema = _SCHEMAS.get(type_name)
    if schema is None:
        if skip_unknown:
            return None
        raise InputError(f"unknown KV event type {type_name!r}; expected one of "
                         f"{', '.join(_SCHEMAS)}", where=where, field=f"{path}.type")
    cls, fields = schema
    kwargs: dict[str, Any] = {}
    if positional:
        if len(values) < _MIN_POSITIONAL[type_name]:
            raise InputError(f"{type_name} array has {len(values)} fields, needs at least "
                             f"{_MIN_POSITIONAL[type_name]}", where=where, field=path)
        for (name, kind, _), value in zip(fields, values):
            kwargs[name] = _check(kind, value, where, f"{path}.{name}")
    else:
        for name, kind, required in fields:
            if name in values:
                kwargs[name] = _check(kind, values[name], where, f"{path}.{name}")
            elif required and name in ("block_hashes", "token_ids", "block_size"):
                raise InputError(f"{type_name} lacks {name!r}", where=where,
                                 field=f"{path}.{name}")
    return cls(**kwargs)


def _check(kind: int, value: Any, where: str | None, path: str) -> Any:
    """Validate one field value and convert arrays to tuples (events are immutable)."""
    if kind == _HASHES:
        if not isinstance(value, (list, tuple)):
            raise InputError(f"expected an array of block hashes, got {_kind(value)}",
                             where=where, field=path)
        return tuple(_check(_HASH, v, where, f"{path}[{i}]") for i, v in enumerate(value))
    if kind == _HASH or (kind == _HASH_OPT and value is not None):
        if isinstance(value, (bytes, bytearray)):
            return bytes(value)
        if isinstance(value, bool) or not isinstance(value, int) \
                or not _MIN_HASH <= value <= _MAX_HASH:
            raise InputError(f"a block hash must be a 64-bit integer or bytes, got "
                             f"{_kind(value)}", where=where, field=path)
        return value
    if kind == _TOKENS:
        if not isinstance(value, (list, tuple)):
            raise InputError(f"expected an array of token ids, got {_kind(value)}",
                             where=where, field=path)
        for i, v in enumerate(value):
            if isinstance(v, bool) or not isinstance(v, int):
                raise InputError(f"token id must be an integer, got {_kind(v)}",
                                 where=where, field=f"{path}[{i}]")
        return tuple(value)
    if kind == _INT or (kind == _INT_OPT and value is not None):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"expected an integer, got {_kind(value)}", where=where,
                             field=path)
        return value
    if kind == _STR_OPT:
        if value is not None and not isinstance(value, str):
            raise InputError(f"expected a string or nil, got {_kind(value)}", where=where,
                             field=path)
        return value
    if kind == _EXTRA:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)):
            raise InputError(f"extra_keys must be an array or nil, got {_kind(value)}",
                             where=where, field=path)
        out = []
        for i, keys in enumerate(value):
            if keys is None:
                out.append(None)
            elif isinstance(keys, (list, tuple)):
                out.append(_freeze(keys))
            else:
                raise InputError(f"each extra_keys entry must be an array or nil, got "
                                 f"{_kind(keys)}", where=where, field=f"{path}[{i}]")
        return tuple(out)
    return value  # _HASH_OPT / _INT_OPT with None


def _freeze(value: Any) -> Any:
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


def _kind(value: Any) -> str:
    if value is None:
        return "nil"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    if isinstance(value, (list, tuple)):
        return f"an array of {len(value)}"
    if isinstance(value, dict):
        return "a map"
    return f"{type(value).__name__} {value!r}"[:80]


# -- encoding ------------------------------------------------------------------------------
def event_to_obj(event: KVEvent, wire_format: WireFormat = "tagged") -> dict | list:
    """The msgpack value of one event in the chosen wire format."""
    type_name = _TYPE_NAMES.get(type(event))
    if type_name is None:
        raise InputError(f"not a KV event: {type(event).__name__}")
    _, fields = _SCHEMAS[type_name]
    if wire_format == "tagged":
        obj: dict[str, Any] = {"type": type_name}
        for name, _, required in fields:
            value = getattr(event, name)
            if required or value is not None:
                obj[name] = value
        return obj
    if wire_format == "positional":
        values = [getattr(event, name) for name, _, _ in fields]
        keep = _POSITIONAL_ALWAYS[type_name]
        while len(values) > keep and values[-1] is None:
            values.pop()
        return [type_name, *values]
    raise InputError(f"unknown wire format {wire_format!r}; choose one of "
                     f"{', '.join(WIRE_FORMATS)}")


def encode_event_batch(batch: EventBatch, wire_format: WireFormat = "tagged") -> bytes:
    """msgpack bytes of ``batch``; ``tagged`` matches vLLM 0.32 byte for byte."""
    obj = [float(batch.ts), [event_to_obj(e, wire_format) for e in batch.events],
           batch.data_parallel_rank]
    return msgpack.packb(obj, use_bin_type=True)


def batch_from_events(ts: float, events: Sequence[KVEvent],
                      data_parallel_rank: int | None = None) -> EventBatch:
    """Convenience constructor taking any sequence of events."""
    return EventBatch(float(ts), tuple(events), data_parallel_rank)


__all__ = [
    "AllBlocksCleared", "BlockHashValue", "BlockRemoved", "BlockStored", "EventBatch",
    "KVEvent", "MEDIUM_CPU", "MEDIUM_GPU", "MEDIUM_STORAGE", "WIRE_FORMATS", "WireFormat",
    "batch_from_events", "batch_from_obj", "decode_event_batch", "encode_event_batch",
    "event_from_obj", "event_to_obj",
]
