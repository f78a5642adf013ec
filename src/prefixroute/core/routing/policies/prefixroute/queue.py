"""The prefill queue the router sent to one replica, and the speed it learns from it.

The router keeps the requests it routed to a replica as a queue of predicted prefill work, in
the order the replica serves them: first come, first served, or by deadline on a replica
started with ``--scheduling-policy priority`` (vLLM's ``PriorityRequestQueue``: lower
priority first). At every decision it reconciles that queue with the replica's
``pending_prefill_tokens``.

Invariants:

* The pending tokens belong to the *last* entries in serving order, so the first entries
  beyond them are done and the first one left is done in part (admission drops a request's
  cached tokens at once; its uncached ones are computed).
* The head entry never leaves except through reconciliation: vLLM serves a running prefill
  before it admits anyone, so nothing is ordered ahead of it and :meth:`PrefillQueue.drop`
  keeps it.
* A request that ends while one ordered before it is still queued has no work left (the
  replica rejected it, longer than its KV, or it was aborted) and leaves at once. Kept, it
  would stay the newest entry and the reconciliation would give it the pending tokens of the
  requests before it: a phantom queue of minutes.

Speed. The queue prices its work at a :class:`~.speed.SpeedEstimate` (shared by the replicas
of one kind, bounded around its anchor) and feeds it the busy seconds and the work done
between two observations while the replica stayed busy; no timing feedback from the engine
is needed.

Utilisation. Prefill seconds done per second, an exponential average over the load horizon.
It starts at 0, so in its first horizon it shows only ``1 - exp(-t / horizon)`` of a steady
load; :meth:`PrefillQueue.prefill_busy` divides that share out (the bias correction of Adam's
moment estimates, Kingma and Ba 2015).
"""

from __future__ import annotations

from math import exp, expm1
from collections import deque
from typing import NamedTuple

from .speed import SpeedEstimate


class QueuedPrefill(NamedTuple):
    """One routed request in the replica's queue."""

    units: float       # tokens as the runner counts them in ``pending_prefill_tokens``
    uncached: float    # of which the replica must compute
    work: float        # predicted prefill, token-equivalents (cost model)
    request_id: str
    order: float       # routing time (first come, first served) or the deadline sent


class PrefillQueue:
    """Predicted prefill work queued on one replica, its learned speed and utilisation."""

    __slots__ = ("entries", "units", "work", "pending_work", "observed_at", "progress_at",
                 "utilisation", "started_at", "busy", "speed")

    def __init__(self, speed: SpeedEstimate) -> None:
        self.entries: deque[QueuedPrefill] = deque()
        self.units = 0.0          # sum of the entries' units
        self.work = 0.0           # sum of the entries' work
        self.pending_work = 0.0   # work not yet done, as of the last observation
        self.observed_at = 0.0
        self.progress_at = 0.0    # when the replica was last seen to make progress
        self.utilisation = 0.0    # prefill seconds per second, recently
        self.started_at: float | None = None  # the first observation
        self.busy = False         # pending prefill at the last observation
        self.speed = speed

    @property
    def s_per_token(self) -> float:
        return self.speed.value

    def prefill_busy(self, horizon_s: float) -> float:
        """The utilisation with its start-up bias removed (module docstring)."""
        started_at, observed_at = self.started_at, self.observed_at
        if started_at is None or observed_at <= started_at:
            return self.utilisation
        filled = -expm1(-(observed_at - started_at) / horizon_s)
        return min(1.0, self.utilisation / filled)

    def wait_s(self, order: float | None = None) -> tuple[float, int]:
        """Seconds of queued work a new request waits for, and how many queued requests it
        goes ahead of. With ``order`` (a priority engine), only the work ordered before it
        counts, and the head, which is in progress."""
        pending = self.pending_work
        behind = 0
        if order is not None:
            entries = self.entries
            for i in range(len(entries) - 1, 0, -1):
                entry = entries[i]
                if entry.order <= order:
                    break
                pending -= entry.work
                behind += 1
        return max(0.0, pending) * self.s_per_token, behind

    def observe(self, pending_prefill_tokens: int, now: float, forget: float,
                horizon_s: float = 30.0) -> None:
        """Reconcile the queue with the replica's pending prefill; learn speed and
        utilisation from the work done since the last observation. (Under priority
        scheduling the reconciliation is approximate: requests behind the head that vLLM
        admitted into a step's leftover budget already run.)"""
        if pending_prefill_tokens <= 0 and not self.busy and self.started_at is not None:
            # Idle now and at the last observation, so nothing is queued (only add() queues,
            # and it marks the queue busy): the utilisation decays, nothing else moves. Most
            # replicas of a quiet fleet take this path at every decision.
            observed_at = self.observed_at
            if now > observed_at:
                self.utilisation *= exp(-(now - observed_at) / horizon_s)
            self.pending_work = 0.0
            self.progress_at = self.observed_at = now
            return
        entries = self.entries
        if pending_prefill_tokens <= 0:
            entries.clear()
            self.units = self.work = 0.0
            pending = 0.0
        else:
            while len(entries) > 1 and self.units - entries[0].units >= pending_prefill_tokens:
                gone = entries.popleft()
                self.units -= gone.units
                self.work -= gone.work
            pending = self.work
            if entries:
                head = entries[0]
                left = pending_prefill_tokens - (self.units - head.units)
                remaining = min(1.0, max(0.0, left / head.uncached)) \
                    if head.uncached > 0 else 0.0
                pending -= head.work * (1.0 - remaining)
            # Pending tokens we know nothing of (preempted requests, another router).
            pending += max(0.0, pending_prefill_tokens - self.units)
        if self.started_at is None:  # the first observation: the clock may start anywhere
            self.started_at = now
        elif now > self.observed_at:
            elapsed = now - self.observed_at
            # Work shows up done at step ends. A request that hit more than predicted drops
            # its cached tokens at admission and looks like work done: never credit more than
            # twice the believed speed since the last progress.
            done = max(0.0, self.pending_work - pending) if self.busy else 0.0
            if done > 0:
                done = min(done, 2.0 * (now - self.progress_at) / self.s_per_token)
                self.progress_at = now
            if self.busy and pending_prefill_tokens > 0:
                self.speed.learn(elapsed, done, forget)
            self.utilisation *= exp(-elapsed / horizon_s)
            if done > 0:  # (an idle replica, most of a fleet, adds nothing)
                self.utilisation += min(1.0, done * self.s_per_token / horizon_s)
        self.pending_work = pending
        if not self.busy:
            self.progress_at = now
        self.observed_at = now
        self.busy = pending_prefill_tokens > 0

    def add(self, entry: QueuedPrefill) -> None:
        """A request was routed here: behind every entry ordered up to its own, never ahead
        of the head."""
        entries = self.entries
        if len(entries) <= 1 or entries[-1].order <= entry.order:
            entries.append(entry)
        else:
            at = len(entries) - 1
            while at > 1 and entries[at - 1].order > entry.order:
                at -= 1
            entries.insert(at, entry)
        self.units += entry.units
        self.work += entry.work
        self.pending_work += entry.work
        self.busy = True

    def drop(self, request_id: str) -> None:
        """The request ended: if it is still queued behind the head, it leaves (module
        docstring). The head stays: it ran, and the reconciliation retires it."""
        entries = self.entries
        for i in range(len(entries) - 1, 0, -1):
            entry = entries[i]
            if entry.request_id == request_id:
                del entries[i]
                self.units -= entry.units
                self.work -= entry.work
                self.pending_work = max(0.0, self.pending_work - entry.work)
                return
