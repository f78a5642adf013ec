"""``dynamo_kv_cost``: NVIDIA Dynamo's KV router cost function.

Source: ``ai-dynamo/dynamo``, ``lib/llm/src/kv_router/scheduler.rs``
(``DefaultWorkerSelector::select_worker`` and ``softmax_sample``), the router-side bookkeeping
of active sequences in ``lib/llm/src/kv_router/sequence.rs`` (``ActiveSequences``:
``potential_blocks_and_tokens``, ``new_blocks``, ``new_tokens``, ``free``) and the defaults in
``lib/llm/src/kv_router/config.rs`` (``KvRouterConfig::default``): ``overlap_score_weight =
1.0``, ``router_temperature = 0.0``, ``use_kv_events = true``, ``router_ttl_secs = 120``
(the approximate indexer used with ``--no-kv-events``), ``router_track_active_blocks = true``.

For each worker ``w`` (lower is better)::

    logit(w) = overlap_score_weight * prefill_tokens(w) / block_size + decode_blocks(w)
    prefill_tokens(w) = active prefill tokens on w + (isl - overlap(w) * block_size)
    decode_blocks(w)  = active blocks on w + request blocks not already active on w

``overlap(w)`` is the number of leading blocks the KV indexer says ``w`` holds. With
``router_temperature = 0`` the lowest logit wins; ties go to the worker with the smallest
indexed tree, then at random (branches ``lowest_cost``, ``lowest_cost_tree_size_tiebreak``,
``lowest_cost_random_tiebreak``). With a positive temperature a worker is sampled with
probability proportional to ``exp(-(logit / (max - min)) / temperature)`` (``softmax_sample``).

Inputs here: ``overlap`` comes from the runner's cache view (:attr:`ReplicaView.cache`, the
event-driven view in a faithful setup: Dynamo's ``KvIndexer`` is fed by engine KV events); with
``use_kv_events=false`` it comes from the router's own index of routed blocks, each expiring
``router_ttl_secs`` after it was last routed (Dynamo's ``ApproxKvIndexer``). Active blocks are
tracked by the policy itself, as Dynamo's router does: a request's block keys are added to its
worker on :meth:`on_routed` and freed on :meth:`on_completed` (the runner must call it when a
request finishes). Active prefill tokens are :attr:`ReplicaView.pending_prefill_tokens` (the
uncached prompt tokens not yet computed), which is what Dynamo's ``active_tokens`` counts
between routing and ``mark_prefill_completed``.

Approximations: a worker whose view reports no load (``load == 0``) has its tracked sequences
cleared, so a runner that never reports completions cannot inflate decode blocks forever;
output-block tracking (``router_track_output_blocks``, off by default), data-parallel ranks,
pruning of the approximate tree and per-request overrides are not modelled.

Parameters: ``overlap_score_weight``, ``router_temperature``, ``use_kv_events``,
``router_ttl_secs``, ``seed``.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from typing import Hashable, Sequence

from prefixroute.core.caches.key_lru import KeyLRUCache
from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import expected_cached_tokens
from prefixroute.core.routing.registry import register

_UNBOUNDED = 1 << 62


class ActiveSequences:
    """The blocks of one worker's requests in flight, counted once per distinct block."""

    def __init__(self) -> None:
        self.requests: dict[str, tuple[Hashable, ...]] = {}
        self.unique: Counter[Hashable] = Counter()

    @property
    def active_blocks(self) -> int:
        return len(self.unique)

    def new_blocks(self, keys: Sequence[Hashable]) -> int:
        return sum(1 for key in keys if key not in self.unique)

    def add(self, request_id: str, keys: Sequence[Hashable]) -> None:
        if request_id in self.requests:
            self.free(request_id)
        self.requests[request_id] = tuple(keys)
        self.unique.update(keys)

    def free(self, request_id: str) -> None:
        keys = self.requests.pop(request_id, ())
        self.unique.subtract(keys)
        for key in keys:
            if self.unique[key] <= 0:
                del self.unique[key]

    def clear(self) -> None:
        self.requests.clear()
        self.unique.clear()


@register("dynamo_kv_cost")
class DynamoKvCost(BasePolicy):
    def __init__(self, overlap_score_weight: float = 1.0, router_temperature: float = 0.0,
                 use_kv_events: bool = True, router_ttl_secs: float = 120.0,
                 seed: int = 0) -> None:
        if overlap_score_weight < 0 or router_temperature < 0:
            raise ConfigError("overlap_score_weight and router_temperature must be >= 0")
        if router_ttl_secs <= 0:
            raise ConfigError(f"router_ttl_secs must be positive, got {router_ttl_secs!r}")
        self.overlap_score_weight = overlap_score_weight
        self.router_temperature = router_temperature
        self.use_kv_events = use_kv_events
        self.router_ttl_secs = router_ttl_secs
        self.seed = seed
        self._rng = random.Random(seed)
        self._active: dict[int, ActiveSequences] = {}
        self._approx: dict[int, KeyLRUCache] = {}
        self._last_purge = 0.0

    def _sequences(self, index: int) -> ActiveSequences:
        seqs = self._active.get(index)
        if seqs is None:
            seqs = self._active[index] = ActiveSequences()
        return seqs

    def _approx_index(self, index: int) -> KeyLRUCache:
        idx = self._approx.get(index)
        if idx is None:
            idx = self._approx[index] = KeyLRUCache(_UNBOUNDED, ttl=self.router_ttl_secs,
                                                    refresh_on_hit=False)
        return idx

    def _overlap(self, replica: ReplicaView, keys: Sequence[Hashable], now: float) -> int:
        if self.use_kv_events:
            return replica.cache.match(keys)
        return self._approx_index(replica.index).match(keys, now)

    def _tree_size(self, replica: ReplicaView) -> int:
        if not self.use_kv_events:
            return len(self._approx_index(replica.index))
        try:
            return len(replica.cache)  # type: ignore[arg-type]
        except TypeError:
            return 0

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        keys = request.block_keys
        block = request.block_size
        isl = request.num_tokens
        logits: dict[int, float] = {}
        overlaps: dict[int, int] = {}
        scores: dict[int, dict[str, float]] = {}
        for replica in replicas:
            seqs = self._sequences(replica.index)
            if replica.load == 0 and seqs.requests:
                seqs.clear()  # nothing runs there: whatever we tracked has finished
            overlap = self._overlap(replica, keys, request.now)
            prefill_tokens = replica.pending_prefill_tokens + max(0, isl - overlap * block)
            prefill_blocks = prefill_tokens / block
            decode_blocks = seqs.active_blocks + seqs.new_blocks(keys)
            logit = self.overlap_score_weight * prefill_blocks + decode_blocks
            logits[replica.index] = logit
            overlaps[replica.index] = overlap
            scores[replica.index] = {"overlap_blocks": float(overlap),
                                     "prefill_blocks": prefill_blocks,
                                     "decode_blocks": float(decode_blocks), "logit": logit}
        if self.router_temperature > 0:
            choice = self._softmax_sample(logits)
            branch = "softmax_sample"
            reason = (f"sampled replica {choice} (logit {logits[choice]:.3f}) at temperature "
                      f"{self.router_temperature}")
        else:
            low = min(logits.values())
            tied = [r for r in replicas if logits[r.index] == low]
            if len(tied) == 1:
                choice, branch = tied[0].index, "lowest_cost"
            else:
                sizes = [(self._tree_size(r), r.index) for r in tied]
                if all(size == sizes[0][0] for size, _ in sizes):
                    choice = self._rng.choice([index for _, index in sizes])
                    branch = "lowest_cost_random_tiebreak"
                else:  # min_by_key: the first of the smallest trees
                    choice = min(sizes, key=lambda pair: pair[0])[1]
                    branch = "lowest_cost_tree_size_tiebreak"
            reason = (f"replica {choice} has the lowest cost {logits[choice]:.3f} = "
                      f"{self.overlap_score_weight:g} x {scores[choice]['prefill_blocks']:.3f} "
                      f"prefill blocks + {scores[choice]['decode_blocks']:g} decode blocks")
        return Decision(choice, branch, reason, scores,
                        expected_cached_tokens(request, overlaps[choice], block))

    def _softmax_sample(self, logits: dict[int, float]) -> int:
        indices = list(logits)
        values = [logits[i] for i in indices]
        low, high = min(values), max(values)
        if low == high:
            return indices[self._rng.randrange(len(indices))]
        spread = high - low
        scaled = [-(v / spread) / self.router_temperature for v in values]
        top = max(scaled)
        weights = [math.exp(s - top) for s in scaled]
        total = sum(weights)
        draw = self._rng.random()
        cumulative = 0.0
        for index, weight in zip(indices, weights):
            cumulative += weight / total
            if draw <= cumulative:
                return index
        return indices[-1]

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        self._sequences(decision.replica).add(request.request_id, request.block_keys)
        if not self.use_kv_events:
            now = request.now
            if now - self._last_purge >= self.router_ttl_secs:
                self._last_purge = now  # drop expired entries now and then, not per request
                for idx in self._approx.values():
                    idx.expire(now)
            index = self._approx_index(decision.replica)
            for key in request.block_keys:
                index.put(key, now)

    def on_completed(self, request: RequestView, replica: int, cached_tokens: int) -> None:
        seqs = self._active.get(replica)
        if seqs is not None:
            seqs.free(request.request_id)

    def on_unreported(self, request: RequestView, replica: int, ran: bool) -> None:
        # Ended all the same (refused, failed, no usage in the answer): its blocks are no
        # longer active on the worker.
        self.on_completed(request, replica, 0)
