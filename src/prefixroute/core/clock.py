"""Injected time. Core logic takes a :class:`Clock`; only edges construct a wall clock."""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary epoch, monotonic."""
        ...


class ManualClock:
    """A clock that moves only when told to: the simulator's and the tests' clock."""

    def __init__(self, start: float = 0.0):
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"time cannot go backwards: {t} < {self._now}")
        self._now = t

    def advance(self, dt: float) -> None:
        self.advance_to(self._now + dt)


class MonotonicClock:
    """Wall time for the edges (gateway, emulator server); never used inside the core."""

    def now(self) -> float:
        return time.monotonic()
