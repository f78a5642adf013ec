"""The booking messages router instances exchange, and their wire form.

A booking is told in up to three messages: :class:`Routed` when an instance sends a request to
a replica, :class:`Prefilled` when its prefill is over (the first streamed byte came back),
then one end, :class:`Completed` (the replica reported ``cached_tokens``) or :class:`Ended`
(no report; ``ran``: the engine ran it). The booking and its end are exactly the lifecycle
runner's events (:mod:`prefixroute.core.routing.lifecycle`), so a peer that applies them feeds
its policy as it would have fed it had it routed the request itself; :class:`Prefilled` is
what the instance's own replica load learns at the first byte (the replica's pending
prefill), so every instance counts the fleet's pending prefill, not only its own. A request
that ends before any byte sends no :class:`Prefilled` (its end says it).

Replicas travel by name, not index: instances may list their backends in different orders.
Times travel as wall-clock seconds (each instance's routing clock is its own monotonic one);
the receiver moves them onto its clock. The wire form is a msgpack array whose first item is
a format version, so a newer instance can still be read by an older one or refused clearly.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgpack

VERSION = 1
ROUTED, PREFILLED, COMPLETED, ENDED = "r", "p", "c", "e"


class CodecError(ValueError):
    """A message that is not a booking event of a version this instance reads."""


class UnknownKind(CodecError):
    """A message of a kind this version does not know (written by a newer instance): skipped,
    its kind logged once."""

    def __init__(self, kind: object):
        super().__init__(f"unknown booking message kind {kind!r}")
        self.kind = kind


@dataclass(frozen=True, slots=True)
class Routed:
    """``instance`` sent ``request_id`` to ``replica`` at ``wall_time``; the router's view
    predicted ``predicted_cached_tokens`` of its ``num_tokens`` cached (so
    ``num_tokens - predicted_cached_tokens`` to prefill). ``priority_wall_ms``: the priority
    sent to the replica, in wall milliseconds, if any."""

    instance: str
    request_id: str
    replica: str
    tenant: str
    num_tokens: int
    block_size: int
    block_keys: tuple[int, ...]
    wall_time: float
    branch: str
    predicted_cached_tokens: int
    priority_wall_ms: int | None = None


@dataclass(frozen=True, slots=True)
class Prefilled:
    """The prefill of ``request_id`` is over: its replica sent the first byte."""

    instance: str
    request_id: str


@dataclass(frozen=True, slots=True)
class Completed:
    """The replica answered ``request_id`` and reported ``cached_tokens`` (in the units the
    request was routed in)."""

    instance: str
    request_id: str
    cached_tokens: int


@dataclass(frozen=True, slots=True)
class Ended:
    """``request_id`` ended without a report; ``ran``: the engine ran it."""

    instance: str
    request_id: str
    ran: bool


Event = Routed | Prefilled | Completed | Ended


def encode(event: Event) -> bytes:
    if isinstance(event, Routed):
        body = [VERSION, ROUTED, event.instance, event.request_id, event.replica, event.tenant,
                event.num_tokens, event.block_size, list(event.block_keys), event.wall_time,
                event.branch, event.predicted_cached_tokens, event.priority_wall_ms]
    elif isinstance(event, Prefilled):
        body = [VERSION, PREFILLED, event.instance, event.request_id]
    elif isinstance(event, Completed):
        body = [VERSION, COMPLETED, event.instance, event.request_id, event.cached_tokens]
    elif isinstance(event, Ended):
        body = [VERSION, ENDED, event.instance, event.request_id, event.ran]
    else:
        raise TypeError(f"not a booking event: {event!r}")
    return msgpack.packb(body, use_bin_type=True)


def decode(data: bytes) -> Event:
    """The event in ``data``; :class:`CodecError` if it is not one."""
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on bad input
        raise CodecError(f"not a msgpack booking message: {exc}") from None
    if not isinstance(body, list) or len(body) < 2:
        raise CodecError("a booking message is an array [version, kind, ...]")
    if body[0] != VERSION:
        raise CodecError(f"booking message version {body[0]!r}; this instance reads {VERSION}")
    kind, fields = body[1], body[2:]
    try:
        if kind == ROUTED and len(fields) == 11:
            (instance, request_id, replica, tenant, num_tokens, block_size, keys, wall,
             branch, predicted, priority) = fields
            if not isinstance(keys, list):
                raise CodecError("block_keys must be an array")
            if not all(isinstance(text, str) for text in (replica, tenant, branch)):
                raise CodecError("replica, tenant and branch must be strings")
            # msgpack hands back ints already; one int() per key would cost more than the
            # rest of the message (600 keys for a 9,600-token prompt).
            event: Event = Routed(instance, request_id, replica, tenant, int(num_tokens),
                                  int(block_size), tuple(keys), float(wall),
                                  branch, int(predicted),
                                  None if priority is None else int(priority))
        elif kind == PREFILLED and len(fields) == 2:
            event = Prefilled(fields[0], fields[1])
        elif kind == COMPLETED and len(fields) == 3:
            event = Completed(fields[0], fields[1], int(fields[2]))
        elif kind == ENDED and len(fields) == 3:
            event = Ended(fields[0], fields[1], bool(fields[2]))
        elif isinstance(kind, str) and kind not in (ROUTED, PREFILLED, COMPLETED, ENDED):
            raise UnknownKind(kind)
        else:
            raise CodecError(f"booking message kind {kind!r} with {len(fields)} fields")
    except (TypeError, ValueError) as exc:
        if isinstance(exc, CodecError):
            raise
        raise CodecError(f"malformed {kind!r} booking message: {exc}") from None
    if not isinstance(event.instance, str) or not isinstance(event.request_id, str):
        raise CodecError("instance and request_id must be strings")
    return event
