"""``round_robin``: replicas in turn, ignoring caches and load.

The baseline of every router (vLLM router, SGLang router ``round_robin``). It computes each
prefix on every replica, so every cache must hold the whole working set and small caches thrash.
No parameters.
"""

from __future__ import annotations

from typing import Sequence

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.registry import register


@register("round_robin")
class RoundRobin(BasePolicy):
    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        # Cycle over replica indices, skipping ones that are not candidates (unhealthy).
        by_index = {r.index: r for r in replicas}
        top = max(by_index) + 1
        for step in range(top):
            index = (self._next + step) % top
            if index in by_index:
                self._next = index + 1
                return Decision(index, "round_robin", f"next in turn: replica {index}")
        raise AssertionError("route() needs at least one replica")
