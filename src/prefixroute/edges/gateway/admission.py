"""Admission: at most ``max_concurrent`` requests proxied at once, at most ``max_queued``
waiting for a turn; beyond that a request is refused at once with 429, and one that waits
longer than ``queue_timeout_s`` gets 503. Either way the caller hears back: nothing is dropped.
"""

from __future__ import annotations

import asyncio

from prefixroute.edges.gateway.errors import GatewayError


class AdmissionQueue:
    def __init__(self, max_concurrent: int, max_queued: int, queue_timeout_s: float):
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.active = 0
        self.waiting = 0
        self._slots = asyncio.Semaphore(max_concurrent)
        self._withheld = 0  # slots a shrink still has to take back as requests end

    async def acquire(self) -> None:
        """Wait for a slot; 429 when the queue is full, 503 after the queue timeout."""
        if self._slots.locked() or self.waiting:
            if self.waiting >= self.max_queued:
                raise GatewayError(429, f"the gateway is at capacity ({self.active} requests "
                                   f"in progress, {self.waiting} queued); retry shortly",
                                   code="queue_full", headers={"retry-after": "1"})
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
            except asyncio.TimeoutError:
                raise GatewayError(503, f"no capacity freed up within {self.queue_timeout_s:g} "
                                   "s in the gateway's queue; retry later",
                                   code="queue_timeout", headers={"retry-after": "1"}) from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.active += 1

    def release(self) -> None:
        self.active -= 1
        if self._withheld:  # a shrink takes this slot back
            self._withheld -= 1
            return
        self._slots.release()

    async def resize(self, max_concurrent: int, max_queued: int, queue_timeout_s: float) -> None:
        """New limits (a configuration reload), without dropping anyone: a larger
        ``max_concurrent`` frees slots at once; a smaller one takes slots back as the
        requests holding them end. Requests waiting keep their place."""
        grow = max_concurrent - self.max_concurrent
        self.max_concurrent = max_concurrent
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        if grow > 0:
            undo = min(grow, self._withheld)
            self._withheld -= undo
            for _ in range(grow - undo):
                self._slots.release()
        elif grow < 0:
            shrink = -grow
            while shrink and not self._slots.locked():  # free slots go at once
                await self._slots.acquire()  # a free slot: returns without waiting
                shrink -= 1
            self._withheld += shrink
