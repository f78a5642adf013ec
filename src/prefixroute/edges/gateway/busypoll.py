"""Busy polling: the event loop polls its sockets without sleeping while requests are open.

An event loop with nothing to run blocks in ``epoll_wait`` and its thread sleeps; the next
packet has to wake it. On a virtual machine that wake-up is slow (the idle vCPU halts and
the hypervisor must run it again), and a router at moderate load sleeps between most of its
packets, so most requests and first events pay it. HAProxy's ``busy-polling`` global
directive is the same remedy (HAProxy 2.6 configuration manual, section 3.2: a null poller
timeout, for low latency inside virtual machines, 30 to 100 us saved there, off by default
for the CPU it burns); tokio's and Go's schedulers spin briefly before parking a thread for
the same reason.

Here the loop is kept busy by one callback that reschedules itself with ``call_soon``: a loop
with a callback ready polls with a zero timeout (libuv's idle handle under uvloop, the
selector's timeout under asyncio), so the thread never sleeps. It runs only while the
gateway has requests open and for ``linger_s`` after the last one ends, so an idle gateway
sleeps as usual; the first request after an idle spell pays one wake-up and starts the
polling again.

The price is the router's core: it shows 100% busy while it serves, so keep this off where
the gateway shares its CPU or runs under a CPU quota (a throttled poller is slower than a
loop that sleeps). What it bought on this 2-core VM: docs/gateway.md, Performance.
"""

from __future__ import annotations

import asyncio
from typing import Callable


class BusyPoller:
    """Keeps ``loop`` polling while ``busy()`` is true and for ``linger_s`` after.

    Call :meth:`kick` when work arrives (a request starts): it starts the polling if it had
    stopped, and restarts the linger if it had not (a request answered at once, a 401, never
    shows as busy). ``now`` is the clock (injected, the gateway's; the loop's by default): a
    clock that does not move (a test's ManualClock) never ends the linger."""

    __slots__ = ("loop", "linger_s", "busy", "now", "running", "ticks", "_idle_since",
                 "_closed")

    def __init__(self, loop: asyncio.AbstractEventLoop, linger_s: float,
                 busy: Callable[[], bool], now: Callable[[], float] | None = None):
        if linger_s < 0:
            raise ValueError(f"linger_s must be >= 0, got {linger_s!r}")
        self.loop = loop
        self.linger_s = linger_s
        self.busy = busy
        self.now = now or loop.time
        self.running = False
        self.ticks = 0  # loop iterations spent polling (for tests and curiosity)
        self._idle_since: float | None = None
        self._closed = False

    def kick(self) -> None:
        if self._closed:
            return
        self._idle_since = None  # work arrived: the linger counts from after it
        if not self.running:
            self.running = True
            self.loop.call_soon(self._tick)

    def close(self) -> None:
        """Stop for good (shutdown): the loop may sleep again."""
        self._closed = True

    def _tick(self) -> None:
        self.ticks += 1
        self.running = False  # until this tick decides to go on (an exception stops it)
        if self._closed:
            return
        if self.busy():
            self._idle_since = None
        else:
            now = self.now()
            if self._idle_since is None:
                self._idle_since = now
            elif now - self._idle_since >= self.linger_s:
                return
        self.running = True
        self.loop.call_soon(self._tick)
