"""The fleet's working set against its total cache: the pressure that prices a copy.

Whether spreading a prefix over replicas pays is a property of the whole fleet, not of one
replica. When the blocks the fleet's traffic asks for (its *working set*) fit in the sum of
the replicas' caches, a prefix copied to a second replica still leaves room for the rest,
and spreading balances the load. When they do not fit, every copy pushes out a block that
some other request will ask for again, and keeping requests with the replica that holds
their prefix keeps at least that replica's share of the working set whole. One replica's
own eviction signals do not tell the two apart (the replicas look alike either way); the
fleet's working set against the fleet's capacity does.

The working set is Denning's: the distinct blocks referenced within the last ``horizon_s``
seconds, every block of every prompt routed. Blocks referenced once count too: in
multi-turn traffic the newest turn's blocks are the next turn's prefix, so the count leads
the blocks that will be asked for again. Each key lives in an ordered map by its latest
reference: a request costs one O(1) update per block, and each key leaves the window once
(amortised O(1)).

When the working set exceeds the sum of the replicas' capacities (both in blocks), a copy
costs ``copy_pressure`` times its recompute (5: the copy's price times four was worth 2 points
of token hit rate on the real-engine benchmark's sessions at 96 blocks and cost 1.4 at 160,
where the working set fits and this leaves the price alone; a steeper price, up to never
leaving a holder, gained about one point more there and cost Mooncake synthetic and the
agentic sessions at 5 replicas 6 to 50% of p99 TTFT). Only while the fleet's prefill
utilisation is below one half (``PRESSURE_RHO_MAX``): under load the holder's queue is what
decides a request's TTFT, and there the dearer copy cost the Mooncake synthetic trace (5
replicas, 97% busy) 1.5 s of p99 TTFT. Figures: docs/routing-policy.md.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence


class WorkingSet:
    """Distinct block keys referenced within a sliding time window of ``horizon_s``."""

    __slots__ = ("horizon_s", "_seen")

    def __init__(self, horizon_s: float) -> None:
        self.horizon_s = horizon_s
        self._seen: OrderedDict[Hashable, float] = OrderedDict()  # key -> latest, oldest first

    def touch(self, keys: Sequence[Hashable], now: float) -> None:
        """``keys`` were referenced at ``now`` (a time before an earlier one counts as that
        one: the window only moves forward)."""
        seen = self._seen
        if seen:
            now = max(now, next(reversed(seen.values())))
        move = seen.move_to_end
        for key in keys:
            if key in seen:
                move(key)
            seen[key] = now
        self._expire(now)

    def blocks(self, now: float) -> int:
        """Distinct blocks referenced within the window ending at ``now``: referenced at
        ``now - horizon_s`` or later."""
        self._expire(now)
        return len(self._seen)

    def _expire(self, now: float) -> None:
        seen = self._seen
        oldest = now - self.horizon_s
        pop = seen.popitem
        while seen and seen[next(iter(seen))] < oldest:
            pop(last=False)


# Fleet prefill utilisation from which the pressure no longer prices the copy (measured).
PRESSURE_RHO_MAX = 0.5


def copy_factor(working_blocks: int, capacity_blocks: int, price: float) -> float:
    """How many times its recompute a copy costs: ``price`` while the fleet's working set
    overflows its total cache, else 1 (also with no capacity known)."""
    if capacity_blocks <= 0 or working_blocks <= capacity_blocks:
        return 1.0
    return price
