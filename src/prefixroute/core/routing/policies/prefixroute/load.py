"""Recent load per replica, the signals the balance rules read.

* ``routed``: requests routed here, decayed over the load horizon (ties between equal costs
  go to the replica with the fewest).
* ``routed_s``: predicted prefill seconds routed here, decayed over the balance horizon (the
  cold-balance rule's load; a prompt longer than the replica's KV adds nothing: it is
  rejected at once).
* ``occupancy``: the share of the last balance horizon or so with requests in flight here,
  the time a replica has work, decode included, which is what its busy seconds count (the
  session-move rule's signal). Seen at each decision and set as the policy routes there: a
  replica that just took a request must not look idle.
"""

from __future__ import annotations

from math import exp


class Decayed:
    """A count that decays exponentially with time, brought up to date when read."""

    __slots__ = ("value", "at")

    def __init__(self) -> None:
        self.value = 0.0
        self.at = 0.0

    def read(self, now: float, horizon_s: float) -> float:
        at = self.at
        if now > at:
            self.value *= exp(-(now - at) / horizon_s)
            self.at = now
        return self.value

    def add(self, amount: float, now: float, horizon_s: float) -> None:
        self.read(now, horizon_s)
        self.value += amount


class Occupancy:
    """Exponentially weighted share of time with requests in flight, each interval counted
    by the state seen at its start."""

    __slots__ = ("share", "occupied", "at")

    def __init__(self) -> None:
        self.share = 0.0
        self.occupied = False
        self.at: float | None = None

    def observe(self, occupied: bool, now: float, horizon_s: float) -> None:
        at = self.at
        if at is None:
            self.at = now
        elif now >= at:
            if now > at:
                weight = exp(-(now - at) / horizon_s)
                self.share = self.share * weight + (1.0 - weight) * self.occupied
            self.at = now
        self.occupied = occupied


class RecentLoad:
    __slots__ = ("routed", "routed_s", "occupancy")

    def __init__(self) -> None:
        self.routed = Decayed()
        self.routed_s = Decayed()
        self.occupancy = Occupancy()
