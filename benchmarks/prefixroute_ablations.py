"""``prefixroute`` with single mechanisms switched off, for the benchmark's ablation rows.

The production policy has no switches for these: each is one small hook method of
:class:`~prefixroute.core.routing.policies.prefixroute.PrefixRoute`, overridden here. After
:func:`register_ablations` a benchmark names a variant as
``prefixroute_ablation:feedback=false`` (every ``prefixroute`` parameter is accepted too).
Register it after reading the catalogue (``policy_names()`` lists it from then on, and it is
no peer) and before forking worker processes (they inherit the registration).

Switches (all default to the production behaviour):

``learn_speed`` (auto | true | false)
    true: learn the prefill speed even where the runner states it; false: never learn it.
``feedback`` (true)
    false: the engine's reported ``cached_tokens`` correct neither the eviction horizon nor
    the insert clock.
``follow_inflight`` (true)
    false: a view of the engine vetoes the blocks of requests still in flight too, so a
    burst does not follow the replica computing its prefix.
``drop_ended`` (true)
    false: a request that ends behind the head stays in the queue record (the rule before
    2026-11-30: a rejected prompt reads as queue).
``debias`` (true)
    false: the utilisation without its start-up bias correction.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing import registry
from prefixroute.core.routing.base import ReplicaView
from prefixroute.core.routing.policies.prefixroute import PrefixRoute, PrefixRouteParams
from prefixroute.core.routing.policies.prefixroute.policy import Prediction, ReplicaState

NAME = "prefixroute_ablation"


@dataclass(frozen=True, slots=True)
class AblationParams(PrefixRouteParams):
    learn_speed: str = "auto"
    feedback: bool = True
    follow_inflight: bool = True
    drop_ended: bool = True
    debias: bool = True

    def __post_init__(self) -> None:
        PrefixRouteParams.__post_init__(self)
        if self.learn_speed not in ("auto", "true", "false"):
            raise ConfigError(f"learn_speed must be auto, true or false, got "
                              f"{self.learn_speed!r}")


class PrefixRouteAblation(PrefixRoute):
    params_type = AblationParams
    params: AblationParams

    def _learns_speed(self, replica: ReplicaView) -> bool:
        mode = self.params.learn_speed
        return mode == "true" or (mode == "auto" and super()._learns_speed(replica))

    def _prefill_busy(self, state: ReplicaState) -> float:
        if self.params.debias:
            return super()._prefill_busy(state)
        return state.queue.utilisation

    def _inflight_floor(self, state: ReplicaState) -> int | None:
        return super()._inflight_floor(state) if self.params.follow_inflight else None

    def _leave_queue(self, state: ReplicaState, request_id: str) -> None:
        if self.params.drop_ended:
            super()._leave_queue(state, request_id)

    def _learn_from_report(self, state: ReplicaState, prediction: Prediction,
                           reported: int) -> None:
        if self.params.feedback:
            super()._learn_from_report(state, prediction, reported)


def register_ablations() -> str:
    """Make ``prefixroute_ablation`` buildable by name (idempotent); returns the name."""
    registry.policy_names()  # the catalogue first, so the variant is never part of it
    registry.register(NAME)(PrefixRouteAblation)
    PrefixRouteAblation.name = NAME
    return NAME
