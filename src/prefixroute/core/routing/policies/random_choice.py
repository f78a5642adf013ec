"""``random``: a uniformly random replica (seeded, so simulations repeat).

Parameters: ``seed`` (default 0; the simulator passes its ``--seed``).
"""

from __future__ import annotations

import random
from typing import Sequence

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.registry import register


@register("random")
class RandomChoice(BasePolicy):
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        choice = replicas[self._rng.randrange(len(replicas))]
        return Decision(choice.index, "random", f"uniform draw: replica {choice.index}")
