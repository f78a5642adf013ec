"""Balance rules: after the cheapest replica is found, each rule in turn may hand the request
to another; the first that does decides (its name is the decision's branch).

They act on a *quiet fleet* only: fleet prefill utilisation below ``cold_rho_max`` (10%), more
than one candidate, and every candidate able to hold the request. There the momentary queues
are mostly empty, so the cheapest replica is picked on noise, and the prefill a move adds is
cheap. Once prefill is busy the momentary queue is the real signal and moving requests by a
longer-horizon load only costs TTFT.

Rules, in order (``default_rules``):

:class:`SessionMove` (branch ``session_move``)
    A session that runs stays with its cache however its replica fills up; when sessions end
    unevenly some replicas idle while others carry several. A replica with work more than
    ``cap`` times the fleet's mean occupancy, and more than ``floor`` of the time, hands the
    request to a replica with nothing in flight and below the mean, at most ``max_s``
    dearer; the session's next turns follow their cache there.
:class:`ColdBalance` (branch ``cold_balance``)
    A request no replica holds much of (a new session, a tenant's first document) starts what
    later requests follow. Placed by the momentary queue, sessions stack up where a queue
    happened to be short; so it avoids a replica whose prefill routed over the balance
    horizon is above ``cap`` times the fleet mean, taking the cheapest replica at or below it
    that holds no less of the request (within ``free_share`` of the prompt).

Both exist for the busiest replica's load to stay within 1.25x the mean; the benchmark's
figures are in ``docs/routing-policy.md``.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol, Sequence

from .costs import CostTerms
from .params import PrefixRouteParams


class Candidate(NamedTuple):
    """One replica's figures for the request, as the decision's scores show them. The rules
    read the first six; the policy keeps the rest of the replica's scores beside them (one
    record per replica and decision: a 32-replica fleet makes 32 per request)."""

    index: int  # type: ignore[assignment]  # (named as tuple.index; by design)
    cost_s: float
    expected_cached_tokens: float
    load: float          # requests in flight (ReplicaView.load)
    occupancy: float     # share of recent time with requests in flight
    long_load_s: float   # predicted prefill seconds routed here over the balance horizon
    recent: float = 0.0  # requests routed here recently, unrounded
    prefill_busy: float = 0.0  # its prefill utilisation
    deadline_s: float | None = None  # the deadline a priority replica would get
    terms: CostTerms | None = None  # its cost evaluation (shared by replicas alike)


class Move(NamedTuple):
    replica: int
    reason: str


class BalanceRule(Protocol):
    branch: str

    def move(self, chosen: Candidate, candidates: Sequence[Candidate], prompt_tokens: int,
             best_hit: float) -> Move | None:
        """Another replica for the request than ``chosen`` (the cheapest), or None.
        ``best_hit``: the most tokens any candidate is expected to hold."""
        ...


class SessionMove:
    branch = "session_move"

    def __init__(self, cap: float, floor: float, max_s: float, horizon_s: float) -> None:
        self.cap, self.floor, self.max_s, self.horizon_s = cap, floor, max_s, horizon_s

    def move(self, chosen: Candidate, candidates: Sequence[Candidate], prompt_tokens: int,
             best_hit: float) -> Move | None:
        mean = sum(c.occupancy for c in candidates) / len(candidates)
        if not (mean > 0 and chosen.occupancy > max(self.cap * mean, self.floor)):
            return None
        idle = [c for c in candidates if c.load == 0 and c.occupancy < mean
                and c.cost_s - chosen.cost_s <= self.max_s]
        if not idle:
            return None
        other = min(idle, key=lambda c: (c.occupancy, c.cost_s, c.index))
        return Move(other.index, (
            f"replica {chosen.index} had work {chosen.occupancy:.0%} of the last "
            f"{self.horizon_s:g} s, over {self.cap:g} x the mean {mean:.0%}; idle replica "
            f"{other.index} ({other.occupancy:.0%}) takes this request for "
            f"{other.cost_s - chosen.cost_s:.3f} s more cost"))


class ColdBalance:
    branch = "cold_balance"

    def __init__(self, cap: float, free_share: float, cold_share: float,
                 horizon_s: float) -> None:
        self.cap, self.free_share, self.cold_share = cap, free_share, cold_share
        self.horizon_s = horizon_s

    def move(self, chosen: Candidate, candidates: Sequence[Candidate], prompt_tokens: int,
             best_hit: float) -> Move | None:
        if best_hit > self.cold_share * prompt_tokens:
            return None  # a replica holds much of it: not a cold request
        mean = sum(c.long_load_s for c in candidates) / len(candidates)
        cap = self.cap * mean
        if not (mean > 0 and chosen.long_load_s > cap):
            return None
        floor = chosen.expected_cached_tokens - self.free_share * prompt_tokens
        below = [c for c in candidates
                 if c.long_load_s <= cap and c.expected_cached_tokens >= floor]
        if not below:
            return None
        other = min(below, key=lambda c: (c.cost_s, c.index))
        return Move(other.index, (
            f"replica {chosen.index} got {chosen.long_load_s:.1f} s of prefill over the last "
            f"{self.horizon_s:g} s, over {self.cap:g} x the mean {mean:.1f} s, and holds no "
            f"more of this request than replica {other.index} "
            f"({other.expected_cached_tokens:.0f} tokens expected cached), which takes it for "
            f"{other.cost_s - chosen.cost_s:.3f} s more cost"))


def default_rules(params: PrefixRouteParams) -> list[BalanceRule]:
    """The rules the parameters turn on (a cap of 0 turns its rule off), in order."""
    rules: list[BalanceRule] = []
    if params.move_cap:
        rules.append(SessionMove(params.move_cap, params.move_floor, params.move_max_s,
                                 params.balance_horizon_s))
    if params.cold_cap:
        rules.append(ColdBalance(params.cold_cap, params.free_share, params.cold_share,
                                 params.balance_horizon_s))
    return rules
