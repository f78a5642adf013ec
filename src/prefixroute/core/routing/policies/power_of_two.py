"""``power_of_two``: two random candidates, the less loaded one wins.

The "power of two choices" (Mitzenmacher, *The Power of Two Choices in Randomized Load
Balancing*, 2001): sampling two replicas and keeping the lighter one brings the maximum load
down from ``log n / log log n`` to ``log log n`` above the mean, while reading only two load
counters. It is the ``power_of_two`` policy of the SGLang router and the vLLM router, which
draw two distinct workers and send the request to the one with fewer requests in flight.

Cache-blind: a load-only baseline that balances better than ``random`` without the full scan of
``least_loaded``.

Parameters:

``seed`` (default 0)
    seeds the candidate draws so a simulation repeats; the simulator passes its ``--seed``.

Load is :attr:`ReplicaView.load` (in-flight count, or waiting + running from engine metrics).
Two distinct candidates are drawn (one when only one replica is offered); equal loads go to the
lower index, the project's tie rule (reproducible runs).
"""

from __future__ import annotations

import random
from typing import Sequence

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.registry import register


@register("power_of_two")
class PowerOfTwo(BasePolicy):
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._rng = random.Random(seed)

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        if len(replicas) == 1:
            only = replicas[0]
            return Decision(only.index, "single_candidate",
                            f"only replica {only.index} is a candidate",
                            {only.index: {"load": float(only.load)}})
        first, second = (replicas[i] for i in self._rng.sample(range(len(replicas)), 2))
        choice = min(first, second, key=lambda r: (r.load, r.index))
        other = second if choice is first else first
        scores = {r.index: {"load": float(r.load)} for r in (first, second)}
        return Decision(choice.index, "power_of_two",
                        f"drew replicas {first.index} and {second.index}; "
                        f"replica {choice.index} has load {choice.load} "
                        f"vs {other.load} on replica {other.index}", scores)
