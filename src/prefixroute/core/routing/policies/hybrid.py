"""``hybrid``: affinity, capped by assignment skew.

Pick a replica holding the prefix only if its cumulative assignments *before* this request are
at most ``least + max_skew`` (``least`` = the fewest assignments of any candidate); otherwise
the least-assigned replica. Ties go to the lowest index.

Among holders within the cap, the longest match comes first, then the fewest assignments, then
the lowest index (as ``affinity_only``). The cap filters *before* the longest match is chosen,
so a holder of a shorter prefix that is within the cap beats sending the request to a cold
replica. On the skewed routing trace (docs/concepts.md, worked example 3) every holder
matches the same one key, so there this is exactly the rule stated with it.

Because the check runs before the increment, the chosen replica may end one above the cap:
assignment skew (max minus min) never exceeds ``max_skew + 1`` while every replica is a
candidate, and touches it (2 with the default) mid-run on the skewed routing trace.

Parameters:

``max_skew`` (default 1, the cap of the skewed routing trace)
    how many assignments a holder may be above the least-assigned replica and still win;
    0 allows affinity only to replicas tied for least, and a very large value is
    ``affinity_only``.

Assignments are :attr:`ReplicaView.assignments`, kept by the runner; the policy is stateless.
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import (affinity_scores, best_holder,
                                                      expected_cached_tokens, least_assigned,
                                                      prefix_matches)
from prefixroute.core.routing.registry import register


@register("hybrid")
class Hybrid(BasePolicy):
    def __init__(self, max_skew: int = 1) -> None:
        if not isinstance(max_skew, int) or isinstance(max_skew, bool) or max_skew < 0:
            raise ConfigError(f"max_skew must be a non-negative integer, got {max_skew!r}")
        self.max_skew = max_skew

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        matches = prefix_matches(request, replicas)
        scores = affinity_scores(replicas, matches)
        fallback = least_assigned(replicas)
        cap = fallback.assignments + self.max_skew
        within_cap = [r for r in replicas if r.assignments <= cap]
        holder = best_holder(within_cap, matches)
        if holder is not None:
            blocks = matches[holder.index]
            return Decision(holder.index, "affinity",
                            f"replica {holder.index} holds {blocks} leading blocks with "
                            f"{holder.assignments} assignments <= {fallback.assignments} + "
                            f"max_skew {self.max_skew}", scores,
                            expected_cached_tokens(request, blocks, request.block_size))
        if any(m > 0 for m in matches.values()):
            return Decision(fallback.index, "skew_cap",
                            f"every holder has more than {fallback.assignments} + max_skew "
                            f"{self.max_skew} assignments: least-assigned replica "
                            f"{fallback.index}", scores)
        return Decision(fallback.index, "miss_least_assigned",
                        f"no replica holds the prefix: least-assigned replica {fallback.index} "
                        f"({fallback.assignments} assignments)", scores)
