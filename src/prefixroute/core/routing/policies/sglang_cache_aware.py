"""``sglang_cache_aware``: the SGLang model gateway's ``cache_aware`` policy.

Source: ``sgl-project/sglang``, ``sgl-model-gateway/src/policies/cache_aware.rs`` (formerly
``sgl-router/src/policies/cache_aware.rs``), ``CacheAwarePolicy::select_worker`` with
``select_worker_min_load`` / ``select_worker_with_tokens`` / ``select_worker_with_text``; the
approximate tree is ``sgl-router/src/policies/tree.rs`` (``Tree::insert``, ``prefix_match``,
``get_smallest_tenant``, ``evict_tenant_by_size``). Defaults are the published launcher's,
``sgl-router/py_src/sglang_router/router_args.py`` (``RouterArgs``): ``cache_threshold = 0.3``,
``balance_abs_threshold = 64``, ``balance_rel_threshold = 1.5``,
``eviction_interval_secs = 120``, ``max_tree_size = 2**26``. (The Rust ``CacheAwareConfig``
default of 0.5 / 32 / 1.1 only applies when the router is embedded without the launcher.)

The rule, per request:

1. Loads are the router's in-flight counts. The fleet is *imbalanced* when
   ``max_load - min_load > balance_abs_threshold`` **and**
   ``max_load > balance_rel_threshold * min_load``; then the least-loaded worker wins
   (branch ``imbalanced_shortest_queue``) and the request still goes into the tree.
2. Otherwise the request is matched against the approximate tree: one radix tree per worker
   (a *tenant*), built from what the router itself sent there. ``match_rate`` is the longest
   match over all tenants divided by the request length. If ``match_rate > cache_threshold``
   the tenant holding that match wins (``cache_hit``).
3. Below the threshold the current source routes to the **least-loaded** worker
   (``low_match_min_load``): SGLang PR #14650 (Dec 2025, "cache-aware router should pick min
   load instead of min tenant size") replaced the older rule, which sent the request to the
   tenant with the **smallest tree** (``get_smallest_tenant``), still described in the file's
   header comment. ``low_match="smallest_tree"`` restores the older behaviour
   (``low_match_smallest_tree``); PyPI ``sglang-router`` 0.3.x ships the min-load rule.
4. When the chosen tenant is not a candidate (a worker the tree knows but that is not healthy
   now), the source falls back to the first healthy worker without updating the tree
   (``fallback_first_healthy``).

The tree stores what SGLang's gateway stores: token ids when the router tokenized the prompt
(its gRPC ``TokenTree``), otherwise units of the prompt (its HTTP string tree stores
characters; here, block keys). The two kinds live in separate trees, as the gateway keeps
``string_trees`` and ``token_trees`` apart. A tenant's size is the number of units it holds
(``tenant_char_count``); every ``eviction_interval_secs`` (measured on ``RequestView.now``)
each tenant above ``max_tree_size`` loses least recently used leaves until it fits, as
``evict_tenant_by_size`` does on its background thread.

Approximations: the source's multi-tenant tree is modelled as one :class:`RadixCache` per
tenant (same match lengths and sizes); the source's ``prefix_match`` also refreshes the matched
tenant's access time, here only the insert after routing does; ties between tenants holding the
same deepest match (a hash-map order in the source) go to the lowest candidate index; loads
are taken over the candidates offered (the source also counts unhealthy workers).

Parameters: ``cache_threshold``, ``balance_abs_threshold``, ``balance_rel_threshold``,
``eviction_interval_secs``, ``max_tree_size`` (units per tenant) and ``low_match``
(``min_load`` | ``smallest_tree``).
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.core.caches.radix_tree import RadixCache
from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import (PeriodicTimer, expected_cached_tokens,
                                                      request_units)
from prefixroute.core.routing.registry import register

_UNBOUNDED = 1 << 62
LOW_MATCH_RULES = ("min_load", "smallest_tree")


@register("sglang_cache_aware")
class SGLangCacheAware(BasePolicy):
    def __init__(self, cache_threshold: float = 0.3, balance_abs_threshold: int = 64,
                 balance_rel_threshold: float = 1.5, eviction_interval_secs: float = 120.0,
                 max_tree_size: int = 2 ** 26, low_match: str = "min_load") -> None:
        if not 0.0 <= cache_threshold <= 1.0:
            raise ConfigError(f"cache_threshold must be in [0, 1], got {cache_threshold!r}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ConfigError("balance thresholds must be non-negative")
        if eviction_interval_secs < 0 or max_tree_size < 0:
            raise ConfigError("eviction_interval_secs and max_tree_size must be non-negative")
        if low_match not in LOW_MATCH_RULES:
            raise ConfigError(f"low_match must be one of {', '.join(LOW_MATCH_RULES)}, "
                              f"got {low_match!r}")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.eviction_interval_secs = eviction_interval_secs
        self.max_tree_size = max_tree_size
        self.low_match = low_match
        self._trees: dict[tuple[str, int], RadixCache] = {}  # (unit kind, replica) -> tree
        self._eviction_timer = PeriodicTimer(eviction_interval_secs)

    # -- the approximate tree -----------------------------------------------------------------
    def _tree(self, kind: str, index: int) -> RadixCache:
        tree = self._trees.get((kind, index))
        if tree is None:
            tree = self._trees[(kind, index)] = RadixCache(_UNBOUNDED)
        return tree

    def tree_size(self, index: int, kind: str = "blocks") -> int:
        """Units the router believes replica ``index`` holds (``tenant_char_count``)."""
        tree = self._trees.get((kind, index))
        return tree.total_units if tree is not None else 0

    def _maybe_evict(self, now: float) -> None:
        if self.eviction_interval_secs <= 0 or not self._eviction_timer.due(now):
            return
        for tree in self._trees.values():
            if tree.total_units > self.max_tree_size:
                tree.evict_units(tree.total_units - self.max_tree_size)

    # -- routing ------------------------------------------------------------------------------
    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        self._maybe_evict(request.now)
        kind, units, unit_tokens = request_units(request)
        for replica in replicas:  # init_workers / add_worker: every worker is a tenant
            self._tree(kind, replica.index)
        by_index = {r.index: r for r in replicas}
        tenants = sorted(i for (k, i) in self._trees if k == kind)
        matched = {i: (self._trees[(kind, i)].match(units) if units else 0) for i in tenants}
        scores = {r.index: {"load": float(r.load), "matched_units": float(matched[r.index]),
                            "match_rate": matched[r.index] / len(units) if units else 0.0,
                            "tree_size": float(self.tree_size(r.index, kind))}
                  for r in replicas}
        least = min(replicas, key=lambda r: (r.load, r.index))
        max_load = max(r.load for r in replicas)
        min_load = least.load
        if (max_load - min_load > self.balance_abs_threshold
                and max_load > self.balance_rel_threshold * min_load):
            return Decision(least.index, "imbalanced_shortest_queue",
                            f"loads {min_load}..{max_load}: difference > "
                            f"{self.balance_abs_threshold} and max > "
                            f"{self.balance_rel_threshold} x min, shortest queue is replica "
                            f"{least.index}", scores,
                            expected_cached_tokens(request, matched[least.index], unit_tokens))

        best = max(matched.values(), default=0)
        match_rate = best / len(units) if units else 0.0
        if match_rate > self.cache_threshold:
            holders = [i for i in tenants if matched[i] == best]
            live = [i for i in holders if i in by_index]
            if not live:
                return self._first_healthy(replicas, scores, f"tenant {holders[0]}")
            choice = live[0]
            return Decision(choice, "cache_hit",
                            f"match rate {match_rate:.3f} > cache_threshold "
                            f"{self.cache_threshold}: replica {choice} holds {best} of "
                            f"{len(units)} units", scores,
                            expected_cached_tokens(request, best, unit_tokens))
        if self.low_match == "min_load":
            return Decision(least.index, "low_match_min_load",
                            f"match rate {match_rate:.3f} <= cache_threshold "
                            f"{self.cache_threshold}: least-loaded replica {least.index} "
                            f"(load {least.load})", scores,
                            expected_cached_tokens(request, matched[least.index], unit_tokens))
        smallest = min(tenants, key=lambda i: (self.tree_size(i, kind), i))
        if smallest not in by_index:
            return self._first_healthy(replicas, scores, f"smallest tenant {smallest}")
        return Decision(smallest, "low_match_smallest_tree",
                        f"match rate {match_rate:.3f} <= cache_threshold "
                        f"{self.cache_threshold}: smallest tree is replica {smallest} "
                        f"({self.tree_size(smallest, kind)} units)", scores,
                        expected_cached_tokens(request, matched[smallest], unit_tokens))

    @staticmethod
    def _first_healthy(replicas: Sequence[ReplicaView], scores: dict, what: str) -> Decision:
        first = min(r.index for r in replicas)
        return Decision(first, "fallback_first_healthy",
                        f"{what} is not a candidate: first healthy replica {first} "
                        f"(the tree is not updated)", scores)

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        if decision.branch == "fallback_first_healthy":
            return  # the source returns before inserting on this path
        kind, units, _ = request_units(request)
        self._tree(kind, decision.replica).insert(units)
