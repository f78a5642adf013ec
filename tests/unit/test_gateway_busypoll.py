"""BusyPoller (edges/gateway/busypoll.py): the loop keeps polling while the gateway is busy
and for ``linger_s`` after, then sleeps again until kicked."""

import asyncio

import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.edges.gateway.busypoll import BusyPoller


async def turns(n: int) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


def test_polls_while_busy_then_lingers_then_stops():
    async def main():
        clock, busy = ManualClock(), [True]
        poller = BusyPoller(asyncio.get_running_loop(), 0.1, lambda: busy[0], clock.now)
        assert not poller.running
        poller.kick()
        await turns(10)
        assert poller.running and poller.ticks >= 9  # one tick per loop iteration
        busy[0] = False       # the last request ended at t = 0: idle from the next tick
        await turns(3)
        clock.advance_to(0.05)  # within the linger
        await turns(3)
        assert poller.running
        clock.advance_to(0.1)   # linger over: the next tick stops
        await turns(3)
        assert not poller.running
        stopped_at = poller.ticks
        await turns(5)
        assert poller.ticks == stopped_at  # nothing runs while stopped

    asyncio.run(main())


@pytest.mark.parametrize("work", ["busy at a tick", "a kick"])
def test_work_during_the_linger_restarts_it(work):
    """Work at t = 0.08 moves the linger's start from 0 to 0.08, whether a tick saw the
    gateway busy or a request came and went between ticks (a 401) and only kicked."""
    async def main():
        clock, busy = ManualClock(), [False]
        poller = BusyPoller(asyncio.get_running_loop(), 0.1, lambda: busy[0], clock.now)
        poller.kick()
        await turns(2)        # idle since 0
        clock.advance_to(0.08)
        if work == "a kick":
            poller.kick()
        else:
            busy[0] = True
            await turns(2)
            busy[0] = False
        await turns(2)        # idle since 0.08
        clock.advance_to(0.15)  # idle 0.07 s: lingering
        await turns(2)
        assert poller.running
        clock.advance_to(0.19)  # idle 0.11 s: over
        await turns(2)
        assert not poller.running

    asyncio.run(main())


def test_kick_restarts_and_close_stops_for_good():
    async def main():
        clock = ManualClock()
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


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_the_loop_does_not_sleep_while_polling(loop_kind):
    """A 200 ms sleep of one task: without polling the loop blocks in its poller for the
    whole 200 ms (one or two iterations; a 1 ms timer would make 200); with it, it goes round
    thousands of times even on a loaded machine (about 5,800 at the least with both cores
    taken by 12 other processes). uvloop is what ``prefixroute serve`` runs."""
    if loop_kind == "uvloop":
        loop = pytest.importorskip("uvloop").new_event_loop()
    else:
        loop = asyncio.new_event_loop()

    async def main():
        poller = BusyPoller(asyncio.get_running_loop(), 1.0, lambda: True)
        poller.kick()
        await asyncio.sleep(0.2)
        poller.close()
        return poller.ticks

    try:
        assert loop.run_until_complete(main()) > 1000
    finally:
        loop.close()


def test_an_error_in_a_tick_stops_the_polling_and_a_kick_restarts_it():
    async def main():
        loop = asyncio.get_running_loop()
        errors = []
        loop.set_exception_handler(lambda _, context: errors.append(context["exception"]))
        broken = [True]

        def busy() -> bool:
            if broken[0]:
                raise RuntimeError("broken")
            return True

        poller = BusyPoller(loop, 0.1, busy)
        poller.kick()
        await turns(3)
        assert not poller.running and len(errors) == 1
        broken[0] = False
        poller.kick()
        await turns(3)
        assert poller.running
        poller.close()
        await turns(2)

    asyncio.run(main())


def test_negative_linger_is_refused():
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="linger_s"):
            BusyPoller(loop, -1.0, lambda: True)
    finally:
        loop.close()
