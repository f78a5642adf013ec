"""``ray_prefix_affinity``: Ray Serve LLM's ``PrefixCacheAffinityRouter``.

Source: ``ray-project/ray``,
``python/ray/llm/_internal/serve/request_router/prefix_aware/prefix_aware_router.py``
(``PrefixCacheAffinityRouter.initialize_state``, ``_prefix_match_best_replicas``,
``choose_replicas``, ``on_request_routed``, ``update_replicas``), its tree
``prefix_aware/prefix_tree.py`` (``PrefixTree.prefix_match``, ``get_smallest_tenants``,
``evict_tenant_by_lru``, ``_run_eviction_loop``) and the power-of-two fallback
``python/ray/serve/_private/request_router/pow_2_router.py``
(``PowerOfTwoChoicesRequestRouter.choose_replicas``). Defaults from ``initialize_state``:
``imbalanced_threshold = 10``, ``match_rate_threshold = 0.1``, ``do_eviction = False``,
``eviction_threshold_chars = 400_000``, ``eviction_target_chars = 360_000``,
``eviction_interval_secs = 10``.

The rule, per request (``choose_replicas`` returns a candidate group; Ray's base router then
sends the request to the member with the shortest queue, ties to the first listed):

1. Two random candidates are drawn first, as power-of-two-choices does (the fallback group).
2. Queue lengths are the replicas' ongoing requests. If ``max - min > imbalanced_threshold``
   the fallback pair is the group (``imbalanced_power_of_two``).
3. Otherwise the prompt is matched against a multi-tenant prefix tree restricted to the
   candidates; ``match_rate`` = matched units / prompt units. If ``match_rate <
   match_rate_threshold`` the group is the tenants with the fewest units in the tree
   (``low_match_smallest_tree``); otherwise the tenants that hold the longest match
   (``prefix_match``).
4. After routing, the prompt is inserted into the chosen replica's tree
   (``on_request_routed``). Tenants are added when a replica appears and removed, with their
   whole subtree, when it leaves the candidate set (``update_replicas``).

The tree stores token ids when the router has them, otherwise block keys (Ray stores the
prompt's characters). With ``do_eviction`` every ``eviction_interval_secs`` (on
``RequestView.now``) a tenant above ``eviction_threshold_chars`` units loses least recently
used leaves until it holds ``eviction_target_chars``.

Approximations: one :class:`RadixCache` per tenant instead of Ray's shared tree with per-tenant
LRU lists (the same match lengths, sizes and LRU order); an empty prompt counts as a zero match
(Ray divides by its length); the random draws come from a seeded generator.

Parameters: ``imbalanced_threshold``, ``match_rate_threshold``, ``do_eviction``,
``eviction_threshold_chars``, ``eviction_target_chars``, ``eviction_interval_secs``, ``seed``.
"""

from __future__ import annotations

import random
from typing import Sequence

from prefixroute.core.caches.radix_tree import RadixCache
from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import (PeriodicTimer, expected_cached_tokens,
                                                      request_units)
from prefixroute.core.routing.registry import register

_UNBOUNDED = 1 << 62


@register("ray_prefix_affinity")
class RayPrefixAffinity(BasePolicy):
    def __init__(self, imbalanced_threshold: int = 10, match_rate_threshold: float = 0.1,
                 do_eviction: bool = False, eviction_threshold_chars: int = 400_000,
                 eviction_target_chars: int = 360_000, eviction_interval_secs: float = 10.0,
                 seed: int = 0) -> None:
        if imbalanced_threshold < 0:
            raise ConfigError(f"imbalanced_threshold must be >= 0, got {imbalanced_threshold!r}")
        if not 0.0 <= match_rate_threshold <= 1.0:
            raise ConfigError(f"match_rate_threshold must be in [0, 1], "
                              f"got {match_rate_threshold!r}")
        if eviction_target_chars > eviction_threshold_chars:
            raise ConfigError("eviction_target_chars must not exceed eviction_threshold_chars")
        self.imbalanced_threshold = imbalanced_threshold
        self.match_rate_threshold = match_rate_threshold
        self.do_eviction = do_eviction
        self.eviction_threshold_chars = eviction_threshold_chars
        self.eviction_target_chars = eviction_target_chars
        self.eviction_interval_secs = eviction_interval_secs
        self.seed = seed
        self._rng = random.Random(seed)
        self._tenants: dict[int, dict[str, RadixCache]] = {}  # replica -> unit kind -> tree
        self._eviction_timer = PeriodicTimer(eviction_interval_secs)

    # -- the prefix tree ----------------------------------------------------------------------
    def _tree(self, index: int, kind: str) -> RadixCache:
        trees = self._tenants.setdefault(index, {})
        tree = trees.get(kind)
        if tree is None:
            tree = trees[kind] = RadixCache(_UNBOUNDED)
        return tree

    def tree_size(self, index: int, kind: str = "blocks") -> int:
        tree = self._tenants.get(index, {}).get(kind)
        return tree.total_units if tree is not None else 0

    def _update_replicas(self, replicas: Sequence[ReplicaView]) -> None:
        current = {r.index for r in replicas}
        for gone in [i for i in self._tenants if i not in current]:
            del self._tenants[gone]  # remove_tenants: the replica's whole subtree goes
        for index in current:
            self._tenants.setdefault(index, {})  # add_tenants: a new tenant holds nothing

    def _maybe_evict(self, now: float) -> None:
        if not self.do_eviction or not self._eviction_timer.due(now):
            return
        for trees in self._tenants.values():
            for tree in trees.values():
                if tree.total_units > self.eviction_threshold_chars:
                    tree.evict_units(tree.total_units - self.eviction_target_chars)

    def _power_of_two_pair(self, replicas: Sequence[ReplicaView]) -> list[ReplicaView]:
        n = len(replicas)
        if n == 1:
            return [replicas[0]]
        if n == 2:
            return list(replicas) if self._rng.getrandbits(1) else [replicas[1], replicas[0]]
        i = self._rng.randrange(n)
        j = self._rng.randrange(n - 1)
        if j >= i:
            j += 1
        return [replicas[i], replicas[j]]

    # -- routing ------------------------------------------------------------------------------
    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        self._update_replicas(replicas)
        self._maybe_evict(request.now)
        fallback = self._power_of_two_pair(replicas)
        kind, units, unit_tokens = request_units(request)
        matched = {r.index: (self._tree(r.index, kind).match(units) if units else 0)
                   for r in replicas}
        scores = {r.index: {"queue_len": float(r.load), "matched_units": float(matched[r.index]),
                            "match_rate": matched[r.index] / len(units) if units else 0.0,
                            "tree_size": float(self.tree_size(r.index, kind))}
                  for r in replicas}
        highest = max(r.load for r in replicas)
        lowest = min(r.load for r in replicas)
        if highest - lowest > self.imbalanced_threshold:
            choice = _shortest_queue(fallback)
            return Decision(choice.index, "imbalanced_power_of_two",
                            f"queue lengths {lowest}..{highest} differ by more than "
                            f"{self.imbalanced_threshold}: power of two drew "
                            f"{[r.index for r in fallback]}, shorter queue is replica "
                            f"{choice.index}", scores,
                            expected_cached_tokens(request, matched[choice.index], unit_tokens))

        best = max(matched.values())
        match_rate = best / len(units) if units else 0.0
        if match_rate < self.match_rate_threshold:
            smallest = min(self.tree_size(r.index, kind) for r in replicas)
            group = sorted((r for r in replicas if self.tree_size(r.index, kind) == smallest),
                           key=lambda r: r.index)
            choice = _shortest_queue(group)
            return Decision(choice.index, "low_match_smallest_tree",
                            f"match rate {match_rate:.3f} < {self.match_rate_threshold}: "
                            f"smallest trees ({smallest} units) on {[r.index for r in group]}, "
                            f"shortest queue is replica {choice.index}", scores,
                            expected_cached_tokens(request, matched[choice.index], unit_tokens))
        group = [r for r in replicas if matched[r.index] == best]
        choice = _shortest_queue(group)
        return Decision(choice.index, "prefix_match",
                        f"match rate {match_rate:.3f} >= {self.match_rate_threshold}: "
                        f"{[r.index for r in group]} hold {best} of {len(units)} units, "
                        f"shortest queue is replica {choice.index}", scores,
                        expected_cached_tokens(request, best, unit_tokens))

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        kind, units, _ = request_units(request)
        self._tree(decision.replica, kind).insert(units)


def _shortest_queue(group: Sequence[ReplicaView]) -> ReplicaView:
    """Ray's ``select_from_candidate_replicas``: lowest queue length, the first one on ties."""
    best = group[0]
    for replica in group[1:]:
        if replica.load < best.load:
            best = replica
    return best
