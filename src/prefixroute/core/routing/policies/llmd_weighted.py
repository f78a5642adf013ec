"""``llmd_weighted``: the llm-d / Gateway API Inference Extension default scheduling profile.

Sources (``kubernetes-sigs/gateway-api-inference-extension``, the endpoint picker that the
llm-d inference scheduler extends):

* the default profile, ``config/charts/inferencepool/templates/epp-config.yaml``
  (``default-plugins.yaml``): ``queue-scorer`` weight 2, ``kv-cache-utilization-scorer``
  weight 2, ``prefix-cache-scorer`` weight 3, no filter, ``max-score-picker``; the same
  weights are llm-d's "intelligent inference scheduling" well-lit path;
* ``pkg/epp/scheduling/framework/plugins/scorer/queue.go`` (``QueueScorer.Score``): waiting
  queue ``q`` scores ``(max_q - q) / (max_q - min_q)``, or 1.0 when all queues are equal;
* ``.../scorer/kvcache_utilization.go`` (``KVCacheUtilizationScorer.Score``):
  ``1 - kv_cache_usage``;
* ``.../plugins/prefixcachescorer/plugin.go`` (``Plugin.Score``, ``matchLongestPrefix``,
  ``PreRequest``) and ``indexer.go``: the approximate prefix cache. The prompt is cut into
  chained block hashes (at most ``DefaultMaxPrefixBlocks = 256``); each server's longest run of
  leading blocks found in the router's index scores ``matched / total``; after scheduling the
  request's blocks are added to the chosen server's LRU (``DefaultLRUCapacityPerServer =
  31250`` entries, or the pod's number of GPU blocks with ``autoTune``, the default);
* ``.../plugins/picker/max_score_picker.go`` (``MaxScorePicker.Pick``): highest weighted sum,
  ties broken at random (shuffle, then a stable sort).

The weighted sum is ``2 * queue + 2 * kv + 3 * prefix``. Branch ``max_score``, or
``max_score_random_tiebreak`` when several replicas share the top score.

Signals: ``queue`` is :attr:`ReplicaView.queued` (vLLM ``num_requests_waiting``, what the
scorer reads: when a runner leaves it at 0 the scorer is neutral); ``kv`` is
:attr:`ReplicaView.kv_usage`. The index uses the request's block keys (the router's own chained
hashes) instead of 64-character text blocks; with ``prefix_source="precise"`` the prefix score
reads the runner's cache view instead (llm-d's ``precise-prefix-cache-scorer``, fed by KV
events).

Parameters: ``queue_weight``, ``kv_cache_weight``, ``prefix_weight``, ``max_prefix_blocks``,
``lru_capacity_per_server``, ``auto_tune``, ``prefix_source`` (``approximate`` | ``precise``),
``seed``.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import Hashable, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import expected_cached_tokens
from prefixroute.core.routing.registry import register

PREFIX_SOURCES = ("approximate", "precise")


class PrefixIndexer:
    """Which servers may hold each block hash: a per-server LRU plus the reverse map.

    Mirrors the endpoint picker's ``indexer``: ``add`` touches or inserts every hash in the
    server's LRU (evicting its oldest beyond capacity, which also drops the server from that
    hash's set); ``servers`` is a read that refreshes nothing, like ``indexer.Get``.
    """

    def __init__(self, default_capacity: int) -> None:
        self.default_capacity = default_capacity
        self._lru: dict[int, OrderedDict[Hashable, None]] = {}
        self._capacity: dict[int, int] = {}
        self._servers: dict[Hashable, set[int]] = {}

    def servers(self, key: Hashable) -> set[int]:
        return self._servers.get(key, set())

    def add(self, keys: Sequence[Hashable], server: int, capacity: int | None = None) -> None:
        lru = self._lru.get(server)
        if lru is None:  # the LRU is sized once, when the server is first seen
            lru = self._lru[server] = OrderedDict()
            self._capacity[server] = capacity if capacity else self.default_capacity
        limit = self._capacity[server]
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            else:
                lru[key] = None
                self._servers.setdefault(key, set()).add(server)
                while len(lru) > limit:
                    old, _ = lru.popitem(last=False)
                    holders = self._servers.get(old)
                    if holders is not None:
                        holders.discard(server)
                        if not holders:
                            del self._servers[old]

    def longest_prefix(self, keys: Sequence[Hashable]) -> dict[int, int]:
        """``matchLongestPrefix``: walk the blocks while any server holds the next one."""
        counts: dict[int, int] = {}
        for key in keys:
            holders = self._servers.get(key)
            if not holders:
                break
            for server in holders:
                counts[server] = counts.get(server, 0) + 1
        return counts

    def size(self, server: int) -> int:
        return len(self._lru.get(server, ()))


@register("llmd_weighted")
class LlmdWeighted(BasePolicy):
    def __init__(self, queue_weight: float = 2.0, kv_cache_weight: float = 2.0,
                 prefix_weight: float = 3.0, max_prefix_blocks: int = 256,
                 lru_capacity_per_server: int = 31250, auto_tune: bool = True,
                 prefix_source: str = "approximate", seed: int = 0) -> None:
        if min(queue_weight, kv_cache_weight, prefix_weight) < 0:
            raise ConfigError("scorer weights must be non-negative")
        if max_prefix_blocks < 1 or lru_capacity_per_server < 1:
            raise ConfigError("max_prefix_blocks and lru_capacity_per_server must be >= 1")
        if prefix_source not in PREFIX_SOURCES:
            raise ConfigError(f"prefix_source must be one of {', '.join(PREFIX_SOURCES)}, "
                              f"got {prefix_source!r}")
        self.queue_weight = queue_weight
        self.kv_cache_weight = kv_cache_weight
        self.prefix_weight = prefix_weight
        self.max_prefix_blocks = max_prefix_blocks
        self.lru_capacity_per_server = lru_capacity_per_server
        self.auto_tune = auto_tune
        self.prefix_source = prefix_source
        self.seed = seed
        self._rng = random.Random(seed)
        self._indexer = PrefixIndexer(lru_capacity_per_server)
        self._capacity_seen: dict[int, int] = {}

    def _hashes(self, request: RequestView) -> Sequence[Hashable]:
        return request.block_keys[:self.max_prefix_blocks]

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        hashes = self._hashes(request)
        total = len(hashes)
        if self.prefix_source == "precise":
            matched = {r.index: r.cache.match(hashes) if total else 0 for r in replicas}
        else:
            longest = self._indexer.longest_prefix(hashes)
            matched = {r.index: longest.get(r.index, 0) for r in replicas}
        queues = [r.queued for r in replicas]
        max_q, min_q = max(queues), min(queues)
        scores: dict[int, dict[str, float]] = {}
        for replica in replicas:
            self._capacity_seen[replica.index] = replica.capacity_blocks
            queue = 1.0 if max_q == min_q else (max_q - replica.queued) / (max_q - min_q)
            kv = 1.0 - replica.kv_usage
            prefix = matched[replica.index] / total if total else 0.0
            scores[replica.index] = {
                "queue": queue, "kv_cache": kv, "prefix": prefix,
                "total": (self.queue_weight * queue + self.kv_cache_weight * kv
                          + self.prefix_weight * prefix)}
        top = max(s["total"] for s in scores.values())
        leaders = [r.index for r in replicas if scores[r.index]["total"] == top]
        choice = leaders[0] if len(leaders) == 1 else self._rng.choice(leaders)
        parts = scores[choice]
        reason = (f"replica {choice} scores {top:.3f} = {self.queue_weight:g} x queue "
                  f"{parts['queue']:.3f} + {self.kv_cache_weight:g} x kv "
                  f"{parts['kv_cache']:.3f} + {self.prefix_weight:g} x prefix "
                  f"{parts['prefix']:.3f}")
        branch = "max_score"
        if len(leaders) > 1:
            branch = "max_score_random_tiebreak"
            reason += f"; tied with {[i for i in leaders if i != choice]}, drawn at random"
        return Decision(choice, branch, reason, scores,
                        expected_cached_tokens(request, matched[choice], request.block_size))

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        if self.prefix_source != "approximate":
            return
        capacity = self._capacity_seen.get(decision.replica, 0) if self.auto_tune else 0
        self._indexer.add(self._hashes(request), decision.replica, capacity or None)
