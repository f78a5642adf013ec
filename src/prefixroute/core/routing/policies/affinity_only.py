"""``affinity_only``: always a replica that holds the prefix, if any does.

Pick a replica holding the request's prefix with the fewest cumulative assignments; on a miss,
the least-assigned replica; ties go to the lowest index. For general workloads, where holders
differ in how much of the prefix they hold, the longest match comes first, then the fewest
assignments, then the lowest index.

"Holds" means the router's view of the replica's cache (:attr:`ReplicaView.cache`) matches at
least one leading block of ``request.block_keys``; the view may be approximate, event-driven or
an oracle (:mod:`prefixroute.core.routing.views`). Assignments are
:attr:`ReplicaView.assignments`, requests routed there so far, kept by the runner (gateway or
simulator), so the policy itself holds no state.

This is the pure-affinity extreme of the reuse-versus-balance trade-off: it maximises reuse
and builds hot replicas (on the skewed routing trace, 3 replicas of 2 prefix families each and
arrivals ``AABACABDAACBADABCABA``, it reuses 13,800 tokens and ends with assignments
[10, 5, 5]); ``hybrid`` caps it. No parameters.

The predicted cached tokens of a hit follow the engine's last-token rule like every other
policy's (:func:`~prefixroute.core.routing.policies.common.expected_cached_tokens`: whole
matched blocks, at most ``floor((n - 1) / B) * B``). The skewed routing trace does not use the
prediction: it counts a hit on a family as that family's whole length reused (a key-level
cache, one entry per family), so its figures (10,000 / 13,800 / 12,000 reused tokens for
round robin / affinity / hybrid) are the same under this rule.
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import (affinity_scores, best_holder,
                                                      expected_cached_tokens, least_assigned,
                                                      prefix_matches)
from prefixroute.core.routing.registry import register


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
                            expected_cached_tokens(request, blocks, request.block_size))
        choice = least_assigned(replicas)
        return Decision(choice.index, "miss_least_assigned",
                        f"no replica holds the prefix: least-assigned replica {choice.index} "
                        f"({choice.assignments} assignments)", scores)
