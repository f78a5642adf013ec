"""``affinity_only``: always a replica that holds the prefix, if any does.

SPEC section 3 item 3: pick a replica holding the request's prefix with the fewest cumulative
assignments; on a miss, the least-assigned replica; ties go to the lowest index. For general
workloads, where holders differ in how much of the prefix they hold, the longest match comes
first, then the fewest assignments, then the lowest index.

"Holds" means the router's view of the replica's cache (:attr:`ReplicaView.cache`) matches at
least one leading block of ``request.block_keys``; the view may be approximate, event-driven or
an oracle (:mod:`prefixroute.core.routing.views`). Assignments are
:attr:`ReplicaView.assignments`, requests routed there so far, kept by the runner (gateway or
simulator), so the policy itself holds no state.

This is the pure-affinity extreme of SPEC section 2: it maximises reuse and builds hot
replicas (in section 3 item 3 it ends with assignments [10, 5, 5]); ``hybrid`` caps it.
No parameters.
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.registry import register


def prefix_matches(request: RequestView, replicas: Sequence[ReplicaView]) -> dict[int, int]:
    """Leading blocks of the request each replica is believed to hold, by replica index."""
    keys = request.block_keys
    if not keys:
        return {r.index: 0 for r in replicas}
    return {r.index: r.cache.match(keys) for r in replicas}


def least_assigned(replicas: Sequence[ReplicaView]) -> ReplicaView:
    """Fewest cumulative assignments, ties to the lowest index (SPEC section 3 item 3)."""
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
    return {r.index: {"matched_blocks": float(matches[r.index]),
                      "assignments": float(r.assignments)} for r in replicas}


def cached_tokens(request: RequestView, matched_blocks: int) -> int:
    return min(matched_blocks * request.block_size, request.num_tokens)


@register("affinity_only")
class AffinityOnly(BasePolicy):
    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        matches = prefix_matches(request, replicas)
        scores = affinity_scores(replicas, matches)
        holder = best_holder(replicas, matches)
        if holder is not None:
            blocks = matches[holder.index]
            return Decision(holder.index, "affinity",
                            f"replica {holder.index} holds {blocks} leading blocks "
                            f"({holder.assignments} assignments)", scores,
                            cached_tokens(request, blocks))
        choice = least_assigned(replicas)
        return Decision(choice.index, "miss_least_assigned",
                        f"no replica holds the prefix: least-assigned replica {choice.index} "
                        f"({choice.assignments} assignments)", scores)
