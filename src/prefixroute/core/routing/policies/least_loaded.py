"""``least_loaded``: the replica with the fewest requests in flight (ties: lowest index).

Load is :attr:`ReplicaView.load` (in-flight count, or waiting + running from engine
metrics). No parameters. Cache-blind: a load-only baseline.
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.core.routing.base import (BasePolicy, Decision, ReplicaView, RequestView,
                                           least_loaded)
from prefixroute.core.routing.registry import register


@register("least_loaded")
class LeastLoaded(BasePolicy):
    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        choice = least_loaded(replicas)
        scores = {r.index: {"load": float(r.load)} for r in replicas}
        return Decision(choice.index, "least_loaded",
                        f"lowest load {choice.load} on replica {choice.index}", scores)
