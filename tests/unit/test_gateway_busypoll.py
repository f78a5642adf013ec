"""BusyPoller (edges/gateway/busypoll.py): the loop keeps polling while the gateway is busy
and for ``linger_s`` after, then sleeps again until kicked."""

import asyncio

import pytest
import uvloop

from prefixroute.edges.gateway.busypoll import BusyPoller


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def now(self) -> float:
        return self.t


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_polls_while_busy_then_lingers_then_stops():
    async def main():
        clock, busy = FakeClock(), [True]
        poller = BusyPoller(asyncio.get_running_loop(), 0.1, lambda: busy[0], clock.now)
        assert not poller.running
        poller.kick()
        await turns(10)
        assert poller.running and poller.ticks >= 9  # one tick per loop iteration
        busy[0] = False       # the last request ended at t = 0: idle from the next tick
        await turns(3)
        clock.t = 0.05        # within the linger
        await turns(3)
        assert poller.running
        clock.t = 0.1         # linger over: the next tick stops
        await turns(3)
        assert not poller.running
        stopped_at = poller.ticks
        await turns(5)
        assert poller.ticks == stopped_at  # nothing runs while stopped

    asyncio.run(main())


def test_a_request_during_the_linger_resets_it():
    async def main():
        clock, busy = FakeClock(), [False]
        poller = BusyPoller(asyncio.get_running_loop(), 0.1, lambda: busy[0], clock.now)
        poller.kick()
        await turns(2)        # idle since t = 0
        clock.t, busy[0] = 0.08, True
        await turns(2)
        clock.t, busy[0] = 0.15, False  # idle again since 0.15, not 0
        await turns(2)
        clock.t = 0.2
        await turns(2)
        assert poller.running
        clock.t = 0.25
        await turns(2)
        assert not poller.running

    asyncio.run(main())


def test_kick_restarts_and_close_stops_for_good():
    async def main():
        clock = FakeClock()
        poller = BusyPoller(asyncio.get_running_loop(), 0.0, lambda: False, clock.now)
        poller.kick()
        await turns(3)
        assert not poller.running  # no linger: stops on its second tick
        poller.kick()
        assert poller.running
        poller.close()
        await turns(2)
        assert not poller.running
        poller.kick()
        assert not poller.running

    asyncio.run(main())


@pytest.mark.parametrize("loop_factory", [asyncio.new_event_loop, uvloop.new_event_loop],
                         ids=["asyncio", "uvloop"])
def test_the_loop_does_not_sleep_while_polling(loop_factory):
    """A 20 ms sleep of one task: without polling the loop blocks in its poller for the
    whole 20 ms (one iteration); with it, it goes round hundreds of times. uvloop is what
    ``prefixroute serve`` runs."""
    async def main():
        poller = BusyPoller(asyncio.get_running_loop(), 1.0, lambda: True)
        poller.kick()
        await asyncio.sleep(0.02)
        poller.close()
        return poller.ticks

    loop = loop_factory()
    try:
        assert loop.run_until_complete(main()) > 200
    finally:
        loop.close()


def test_negative_linger_is_refused():
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="linger_s"):
            BusyPoller(loop, -1.0, lambda: True)
    finally:
        loop.close()
