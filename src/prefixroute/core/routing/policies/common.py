"""Helpers that several routing policies share; no policy lives here.

A policy file holds one policy. What two or more of them compute the same way lives in this
module, so a peer policy never imports from another peer (changing ``sglang_cache_aware``
must not change ``dynamo_kv_cost``):

* :func:`expected_cached_tokens`: the prefill a predicted match saves, under the engine's
  last-token rule (every policy's ``Decision.predicted_cached_tokens``);
* :func:`prefix_matches`, :func:`best_holder`, :func:`least_assigned`,
  :func:`affinity_scores`: the affinity family (``affinity_only``, ``hybrid``), which chooses
  by leading blocks held and cumulative assignments;
* :func:`request_units`, :class:`PeriodicTimer`: the approximate-tree routers
  (``sglang_cache_aware``, ``ray_prefix_affinity``);
* :func:`stable_key_bytes`: the hash routers (``prefix_hash``, ``consistent_hash``).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from prefixroute.core.caches.base import cacheable_tokens
from prefixroute.core.routing.base import ReplicaView, RequestView


def expected_cached_tokens(request: RequestView, matched_units: int, unit_tokens: int) -> int:
    """Tokens an engine would reuse for a predicted match of ``matched_units`` units of
    ``unit_tokens`` tokens each: whole blocks only, and never the prompt's last token, so at
    most :func:`~prefixroute.core.caches.base.cacheable_tokens` (``floor((n - 1) / B) * B``).
    A 32-token prompt fully matched in 16-token blocks is predicted 16 cached tokens, as vLLM
    reports."""
    block = request.block_size
    return min(matched_units * unit_tokens // block * block,
               cacheable_tokens(request.num_tokens, block))


# -- the affinity family ---------------------------------------------------------------------

def prefix_matches(request: RequestView, replicas: Sequence[ReplicaView]) -> dict[int, int]:
    """Leading blocks of the request each replica is believed to hold, by replica index."""
    keys = request.block_keys
    if not keys:
        return {r.index: 0 for r in replicas}
    return {r.index: r.cache.match(keys) for r in replicas}


def least_assigned(replicas: Sequence[ReplicaView]) -> ReplicaView:
    """Fewest cumulative assignments, ties to the lowest index."""
    return min(replicas, key=lambda r: (r.assignments, r.index))


def best_holder(replicas: Sequence[ReplicaView], matches: dict[int, int]) -> ReplicaView | None:
    """Among replicas holding some of the prefix: longest match, then fewest assignments,
    then lowest index; ``None`` when none holds any."""
    holders = [r for r in replicas if matches[r.index] > 0]
    if not holders:
        return None
    return min(holders, key=lambda r: (-matches[r.index], r.assignments, r.index))


def affinity_scores(replicas: Sequence[ReplicaView],
                    matches: dict[int, int]) -> dict[int, dict[str, float]]:
    """What the affinity family compares, per replica: leading blocks held, assignments."""
    return {r.index: {"matched_blocks": float(matches[r.index]),
                      "assignments": float(r.assignments)} for r in replicas}


# -- the approximate-tree routers ------------------------------------------------------------

def request_units(request: RequestView) -> tuple[str, tuple[Hashable, ...], int]:
    """What an approximate text tree stores for a request: (kind, units, tokens per unit)."""
    if request.token_ids is not None:
        return "tokens", tuple(request.token_ids), 1
    return "blocks", tuple(request.block_keys), request.block_size


class PeriodicTimer:
    """Says when a periodic job is due: first one interval after the first call, then at most
    once per interval (both routers' background tree eviction, run here on request time)."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last: float | None = None

    def due(self, now: float) -> bool:
        if self._last is None:
            self._last = now
            return False
        if now - self._last < self.interval_s:
            return False
        self._last = now
        return True


# -- the hash routers ------------------------------------------------------------------------

def stable_key_bytes(key: Hashable) -> bytes:
    """Bytes of a block key or routing key that are the same in every process.

    Python's ``hash()`` is salted per process, so hash policies cannot use it. Keys in this
    project are ints (native block hashes, trace block ids), bytes (vLLM digests) or strings
    (session keys, prefix family names); anything else is taken by its ``repr``.
    """
    if isinstance(key, bytes):
        return key
    if isinstance(key, str):
        return key.encode("utf-8")
    return repr(key).encode("utf-8")
