"""A circuit breaker per backend: stop sending requests to a replica that keeps failing.

Closed (normal) until ``failure_threshold`` consecutive request failures (connect errors,
timeouts, 5xx answers); then open for ``open_s`` seconds, when the replica gets no requests;
then half-open, when exactly one trial request may go: its success closes the breaker, its
failure opens it again. Defaults (5 failures, 10 s) follow Envoy's outlier detection
(``consecutive_5xx`` = 5) with a shorter ejection than its 30 s, because a gateway in front of
two or three replicas cannot afford to lose one for long.

A passing health check counts as the trial: a replica that answers its health checks again
(most often one that restarted) closes its breaker as soon as the open period is over,
rather than waiting, half-open, for one request to prove it while every other request must
avoid it. A replica that passes health checks but fails requests reopens after another
``failure_threshold`` failures, which are retried elsewhere.

Time comes from an injected clock.
"""

from __future__ import annotations

from prefixroute.core.clock import Clock

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
STATE_CODES = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}  # the metric's values


class CircuitBreaker:
    def __init__(self, clock: Clock, failure_threshold: int = 5, open_s: float = 10.0):
        self._clock = clock
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.consecutive_failures = 0
        self.opened = 0  # times it opened, for metrics and logs
        self._state = CLOSED
        self._open_until = 0.0
        self._trial_in_flight = False
        self._health_passed = False  # a health check passed since the breaker opened

    @property
    def state(self) -> str:
        if self._state == OPEN and self._clock.now() >= self._open_until:
            if not self._health_passed:
                return HALF_OPEN
            self._state = CLOSED  # the passing health check was the trial
            self.consecutive_failures = 0
        return self._state

    def available(self) -> bool:
        """May a request be sent now? (Does not reserve the half-open trial.)"""
        state = self.state
        return state == CLOSED or (state == HALF_OPEN and not self._trial_in_flight)

    def on_dispatch(self) -> None:
        """A request is being sent: in half-open, it is the one trial."""
        if self.state == HALF_OPEN:
            self._state = HALF_OPEN
            self._trial_in_flight = True

    def record_health_ok(self) -> None:
        """A health check passed: the half-open trial, now or when the open period ends."""
        if self.state == HALF_OPEN:
            self.record_success()
        elif self._state == OPEN:
            self._health_passed = True

    def record_success(self) -> None:
        self.consecutive_failures = 0
        self._trial_in_flight = False
        self._state = CLOSED

    def record_failure(self) -> None:
        state = self.state  # first: settling an ended open period resets the count
        self.consecutive_failures += 1
        self._trial_in_flight = False
        if state == HALF_OPEN or (state == CLOSED
                                  and self.consecutive_failures >= self.failure_threshold):
            self._state = OPEN
            self._open_until = self._clock.now() + self.open_s
            self._health_passed = False
            self.opened += 1

    def release(self) -> None:
        """A dispatched request ended without telling success or failure (the caller left)."""
        self._trial_in_flight = False
