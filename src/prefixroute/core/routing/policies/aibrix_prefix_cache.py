"""``aibrix_prefix_cache``: AIBrix gateway's ``prefix-cache`` routing algorithm.

Source: ``vllm-project/aibrix``, ``pkg/plugins/gateway/algorithms/prefix_cache.go``
(``prefixCacheRouter.routeOriginal``, ``getTargetPodListOnLoadImbalance``,
``getTargetPodFromMatchedPodsFromCounts``), the least-request fallback in
``.../algorithms/least_request.go`` (``selectTargetPodWithLeastRequestCountFromCounts``), the
statistics in ``.../algorithms/util.go`` (``mean``, ``standardDeviation``: sample deviation,
``n - 1``) and the router-side prefix index ``pkg/utils/prefixcacheindexer/hash.go``
(``PrefixHashTable.MatchPrefix`` / ``AddPrefix``) over ``pkg/utils/lrustore/lru_store.go``.
Defaults from those files: ``AIBRIX_PREFIX_CACHE_STANDARD_DEVIATION_FACTOR = 1``,
``AIBRIX_PREFIX_CACHE_LOAD_IMBALANCE_FACTOR = 2.0``,
``AIBRIX_PREFIX_CACHE_LOAD_IMBALANCE_MIN_GAP = 8``, ``AIBRIX_PREFIX_CACHE_BLOCK_NUMBER =
200000`` entries, ``AIBRIX_PREFIX_CACHE_EVICTION_DURATION_MINS = 20``.

Load is each pod's running-request count as the gateway tracks it (here
:attr:`ReplicaView.load`). The rule, per request:

1. Load gate: with mean ``m`` over the candidates, the load is severely imbalanced when
   ``max > load_imbalance_factor * (m + 1)`` **and** ``max - min >= load_imbalance_min_gap``;
   prefix matching is then restricted to the pods with the minimum count.
2. Prefix match: the prompt's chained block hashes are looked up in order; each pod's score is
   the integer percentage ``(i + 1) * 100 // n`` of the deepest block ``i`` it holds
   contiguously from the start.
3. Among matched pods, sorted by decreasing match, then increasing load (random before the
   stable sort), the first whose load is ``<= mean + standard_deviation_factor * stddev``
   (over all candidates) wins (``prefix_match``, or ``imbalanced_prefix_match`` under the
   gate).
4. Otherwise the least-loaded pod, ties at random (``least_request_fallback`` when nothing
   matched, ``prefix_match_skipped`` when every matching pod was too loaded,
   ``imbalanced_least_request`` under the gate).
5. The request's hashes are recorded for the chosen pod (``AddPrefix``).

``load_gate="abs"`` reproduces the gate of earlier releases (``getTargetPodOnLoadImbalance``):
when ``max - min > imbalance_abs_count`` (8) a random least-loaded pod is taken without
matching (``imbalanced_least_request``).

The index is global, as in AIBrix: block hash -> pods, an LRU of ``block_number`` entries whose
entries expire ``eviction_duration_s`` after their last write (a read refreshes nothing). Here
the hashes are the request's block keys (engine-sized blocks) rather than AIBrix's own 4-token
blocks; expiry is applied when the next request is routed (AIBrix sweeps every second).

Parameters: ``standard_deviation_factor``, ``load_imbalance_factor``,
``load_imbalance_min_gap``, ``load_gate`` (``restrict`` | ``abs``), ``imbalance_abs_count``,
``block_number``, ``eviction_duration_s``, ``seed``.
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from typing import Hashable, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import expected_cached_tokens
from prefixroute.core.routing.registry import register

LOAD_GATES = ("restrict", "abs")


class PrefixHashTable:
    """Block hash -> {pod: last write}: one LRU over hashes, entries expire after a TTL."""

    def __init__(self, capacity: int, ttl: float) -> None:
        self.capacity = capacity
        self.ttl = ttl
        self._entries: OrderedDict[Hashable, tuple[float, dict[int, float]]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def expire(self, now: float) -> None:
        # Writes move an entry to the end with the current time, so the front is the oldest.
        entries = self._entries
        while entries:
            key, (written, _) = next(iter(entries.items()))
            if now - written <= self.ttl:
                break
            del entries[key]

    def match(self, keys: Sequence[Hashable], pods: set[int]) -> dict[int, int]:
        """``seqSearchPrefix``: pod -> leading blocks it holds contiguously (the source reports
        ``depth * 100 // len(keys)`` percent). A pod drops out at its first missing block; the
        walk stops when no pod is left or a block is unknown."""
        ready = set(pods)
        depth_by_pod: dict[int, int] = {}
        for depth, key in enumerate(keys, start=1):
            entry = self._entries.get(key)
            if entry is None or not entry[1]:
                break
            holders = entry[1]
            for pod in list(ready):
                if pod in holders:
                    depth_by_pod[pod] = depth
                else:
                    ready.discard(pod)
            if not ready:
                break
        return depth_by_pod

    def add(self, keys: Sequence[Hashable], pod: int, now: float) -> None:
        entries = self._entries
        for key in keys:
            entry = entries.get(key)
            holders = entry[1] if entry is not None else {}
            holders[pod] = now
            entries[key] = (now, holders)
            entries.move_to_end(key)
            if len(entries) > self.capacity:
                entries.popitem(last=False)


@register("aibrix_prefix_cache")
class AIBrixPrefixCache(BasePolicy):
    def __init__(self, standard_deviation_factor: float = 1.0,
                 load_imbalance_factor: float = 2.0, load_imbalance_min_gap: int = 8,
                 load_gate: str = "restrict", imbalance_abs_count: int = 8,
                 block_number: int = 200_000, eviction_duration_s: float = 1200.0,
                 seed: int = 0) -> None:
        if load_gate not in LOAD_GATES:
            raise ConfigError(f"load_gate must be one of {', '.join(LOAD_GATES)}, "
                              f"got {load_gate!r}")
        if block_number < 1 or eviction_duration_s <= 0:
            raise ConfigError("block_number must be >= 1 and eviction_duration_s positive")
        self.standard_deviation_factor = standard_deviation_factor
        self.load_imbalance_factor = load_imbalance_factor
        self.load_imbalance_min_gap = load_imbalance_min_gap
        self.load_gate = load_gate
        self.imbalance_abs_count = imbalance_abs_count
        self.block_number = block_number
        self.eviction_duration_s = eviction_duration_s
        self.seed = seed
        self._rng = random.Random(seed)
        self._table = PrefixHashTable(block_number, eviction_duration_s)

    def _least_request(self, replicas: Sequence[ReplicaView]) -> ReplicaView:
        low = min(r.load for r in replicas)
        return self._rng.choice([r for r in replicas if r.load == low])

    def _gate(self, replicas: Sequence[ReplicaView]) -> list[ReplicaView] | None:
        """The least-loaded pods when load is severely imbalanced, else ``None``."""
        loads = [r.load for r in replicas]
        high, low = max(loads), min(loads)
        if self.load_gate == "abs":
            imbalanced = high - low > self.imbalance_abs_count
        else:
            mean = sum(loads) / len(loads)
            imbalanced = (high > self.load_imbalance_factor * (mean + 1)
                          and high - low >= self.load_imbalance_min_gap)
        return [r for r in replicas if r.load == low] if imbalanced else None

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        self._table.expire(request.now)
        keys = request.block_keys
        loads = [float(r.load) for r in replicas]
        mean = sum(loads) / len(loads)
        stddev = (math.sqrt(sum((x - mean) ** 2 for x in loads) / (len(loads) - 1))
                  if len(loads) > 1 else 0.0)
        limit = mean + self.standard_deviation_factor * stddev
        gated = self._gate(replicas)

        def decide(choice: ReplicaView, branch: str, reason: str,
                   depths: dict[int, int]) -> Decision:
            scores = {r.index: {"load": float(r.load),
                                "prefix_match_percent":
                                    float(depths.get(r.index, 0) * 100 // len(keys)) if keys
                                    else 0.0,
                                "matched_blocks": float(depths.get(r.index, 0)),
                                "load_limit": limit} for r in replicas}
            return Decision(choice.index, branch, reason, scores,
                            expected_cached_tokens(request, depths.get(choice.index, 0),
                                                   request.block_size))

        if gated is not None and self.load_gate == "abs":
            choice = self._rng.choice(gated)
            return decide(choice, "imbalanced_least_request",
                          f"max - min load > {self.imbalance_abs_count}: random least-loaded "
                          f"replica {choice.index}", {})

        pool = gated if gated is not None else list(replicas)
        depths = self._table.match(keys, {r.index for r in pool}) if keys else {}
        percents = {i: d * 100 // len(keys) for i, d in depths.items()}
        if percents:
            order = list(percents)
            self._rng.shuffle(order)
            by_index = {r.index: r for r in replicas}
            order.sort(key=lambda i: (-percents[i], by_index[i].load))
            for index in order:
                if by_index[index].load <= limit:
                    branch = "imbalanced_prefix_match" if gated is not None else "prefix_match"
                    return decide(by_index[index], branch,
                                  f"replica {index} matches {percents[index]}% with load "
                                  f"{by_index[index].load} <= mean {mean:.2f} + "
                                  f"{self.standard_deviation_factor:g} x stddev {stddev:.2f}",
                                  depths)
        choice = self._least_request(replicas)
        if gated is not None:
            branch = "imbalanced_least_request"
            reason = (f"load gate (max > {self.load_imbalance_factor:g} x (mean + 1), gap >= "
                      f"{self.load_imbalance_min_gap}) and no usable match among the least "
                      f"loaded: "
                      f"least-loaded replica {choice.index}")
        elif percents:
            branch = "prefix_match_skipped"
            reason = (f"every matching replica is above mean {mean:.2f} + "
                      f"{self.standard_deviation_factor:g} x stddev {stddev:.2f}: "
                      f"least-loaded replica {choice.index}")
        else:
            branch = "least_request_fallback"
            reason = f"no prefix match: least-loaded replica {choice.index}"
        return decide(choice, branch, reason, depths)

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        if request.block_keys:
            self._table.add(request.block_keys, decision.replica, request.now)
