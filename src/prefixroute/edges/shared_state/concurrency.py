"""How many of the other instances' decisions this instance has not seen yet, and its own
draw to spread its decisions away from theirs.

The other instances' bookings reach this one through the booking stream some milliseconds
after they were made (the *remote lag*, measured on every booking applied). By Little's law
the number of bookings on their way at any moment is their arrival rate times their mean
time on the way: over the last ``window_s`` seconds, the sum of the lags of the bookings
that arrived divided by ``window_s``. That is the ``unseen`` count of
:func:`prefixroute.core.routing.concurrent.spread`, which this object applies to each local
decision when it is the runner's ``concurrent`` hook (``shared_state.spread_concurrent``; off
by default: on the benchmark it lengthened the TTFT tail) with a draw from a generator
seeded by the instance's id: the instances' draws differ, so their choices do. Every input
is measured on this host, now: a quiet fleet, a lone instance or a Redis outage gives
``unseen`` 0 and the policy's decisions unchanged.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import Callable

from prefixroute.core.routing.base import Decision, RequestView
from prefixroute.core.routing.concurrent import spread

# The rate's window (wall seconds): short enough to follow a burst of new sessions (the ones
# that herd: cold prompts a few tens of milliseconds apart), long enough to hold several
# bookings of a busy fleet.
WINDOW_S = 1.0


class ConcurrentDecisions:
    """``arrived(lag)`` for each remote booking applied; called as the runner's
    ``concurrent`` hook for each local decision."""

    def __init__(self, seed: str | int, *, window_s: float = WINDOW_S,
                 wall: Callable[[], float] = time.time):
        self.window_s = window_s
        self._wall = wall
        self._random = random.Random(seed)
        self._arrivals: deque[tuple[float, float]] = deque()  # (wall time applied, lag)
        self._lag_sum = 0.0
        self.spread = 0  # decisions moved (tests and the benchmark read it)

    def arrived(self, lag_s: float) -> None:
        """Another instance's booking was applied here ``lag_s`` after it was made."""
        now = self._wall()
        lag = max(0.0, lag_s)
        self._arrivals.append((now, lag))
        self._lag_sum += lag
        self._forget(now)

    def unseen(self) -> float:
        """Other instances' bookings expected on their way to this one now."""
        self._forget(self._wall())
        return max(0.0, self._lag_sum) / self.window_s

    def _forget(self, now: float) -> None:
        arrivals = self._arrivals
        while arrivals and arrivals[0][0] <= now - self.window_s:
            self._lag_sum -= arrivals.popleft()[1]
        if not arrivals:
            self._lag_sum = 0.0  # (no drift from float sums)

    def __call__(self, request: RequestView, decision: Decision) -> Decision:
        unseen = self.unseen()
        if unseen <= 0:
            return decision
        moved = spread(decision, unseen, self._random.random())
        if moved is not decision:
            self.spread += 1
        return moved
