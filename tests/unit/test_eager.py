"""Starting a coroutine in the caller's callback (edges/eager.py): a coroutine that never
waits finishes inside :func:`start`, with no task; one that waits goes on in a task exactly
as if the task had run it from the start (values, errors and cancellation reach it)."""

import asyncio
import contextvars

import pytest

from prefixroute.edges.eager import in_task, start
from tests.helpers.loop import from_callback

SEEN = contextvars.ContextVar("seen", default="unset")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def start_from_callback(coro, then=None):
    """:func:`start` as a transport's read callback calls it: outside any task."""
    return from_callback(start, coro, then=then)


def test_a_coroutine_that_never_waits_finishes_inside_start_and_leaves_no_task():
    steps = []

    async def work():
        steps.append("ran")
        SEEN.set("inside")
        return 42

    async def scenario():
        started = await start_from_callback(work())
        assert steps == ["ran"]
        assert started.task is None and started.result == 42 and started.error is None
        assert SEEN.get() == "unset"  # it ran in a copy of the caller's context
    run(scenario())


def test_an_error_before_any_wait_is_handed_back():
    async def work():
        raise ValueError("bad")

    async def scenario():
        started = await start_from_callback(work())
        assert started.task is None and isinstance(started.error, ValueError)
    run(scenario())


def test_a_coroutine_that_waits_runs_up_to_the_wait_then_on_in_a_task():
    steps = []

    async def work(future):
        steps.append("before")
        value = await future
        steps.append(f"after {value}")
        return value * 2

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        started = await start_from_callback(work(future))
        assert steps == ["before"] and started.task is not None
        future.set_result(5)
        assert await started.task == 10
        assert steps == ["before", "after 5"]
    run(scenario())


def test_the_waited_futures_error_reaches_the_coroutine():
    async def work(future):
        try:
            await future
        except KeyError:
            return "caught"

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        started = await start_from_callback(work(future))
        future.set_exception(KeyError("x"))
        assert await started.task == "caught"
    run(scenario())


def test_cancelling_the_task_cancels_the_coroutine_where_it_waits():
    cleaned = []

    async def work(future):
        try:
            await future
        finally:
            cleaned.append(True)

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        started = await start_from_callback(work(future))
        started.task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await started.task
        assert cleaned == [True] and future.cancelled()
    run(scenario())


def test_cancelled_before_its_tasks_first_step_the_wait_is_cancelled_with_its_message():
    """(As when the stream is cut in the same read that brought the request.)"""
    seen = []

    async def work(future):
        try:
            await future
        except asyncio.CancelledError as error:
            seen.append(error.args)
            raise

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        started = await start_from_callback(work(future),
                                            then=lambda s: s.task.cancel("stream reset"))
        with pytest.raises(asyncio.CancelledError):
            await started.task
        assert future.cancelled() and seen == [("stream reset",)]
    run(scenario())


def test_a_future_done_before_the_tasks_first_step_is_read_by_the_task():
    async def work(future):
        return await future + 1

    async def scenario():
        future = asyncio.get_running_loop().create_future()
        started = await start_from_callback(work(future),
                                            then=lambda s: future.set_result(1))
        assert await started.task == 2
    run(scenario())


def test_an_error_raised_after_the_wait_ends_the_task_with_it():
    async def work():
        await asyncio.sleep(0)
        raise LookupError("later")

    async def scenario():
        started = await start_from_callback(work())
        with pytest.raises(LookupError, match="later"):
            await started.task
    run(scenario())


def test_several_waits_and_a_bare_yield_in_a_row():
    async def work():
        await asyncio.sleep(0)  # a bare yield: the task steps again next turn
        await asyncio.sleep(0.001)
        SEEN.set("task")
        await asyncio.sleep(0)
        return SEEN.get()

    async def scenario():
        started = await start_from_callback(work())
        assert await started.task == "task"
        assert SEEN.get() == "unset"
    run(scenario())


def test_a_first_wait_for_one_turn_of_the_loop_costs_one_turn():
    """(A bare yield, as ``in_task`` makes: the turn it asks for passes while the task waits
    for its first step, which then goes straight on.)"""
    steps = []

    async def work():
        await asyncio.sleep(0)
        steps.append("on")

    async def scenario():
        started = await start_from_callback(work())
        assert steps == ["on"]  # the task's first step ran ahead of this one's wake-up
        await started.task
    run(scenario())


def test_in_task_puts_what_follows_in_the_task_so_asyncio_timeout_works():
    async def work():
        await in_task()
        async with asyncio.timeout(5):  # needs the current task
            await asyncio.sleep(0)
        return asyncio.current_task()

    async def scenario():
        started = await start_from_callback(work())
        assert started.task is not None
        assert await started.task is started.task
    run(scenario())


def test_in_task_inside_a_task_does_not_wait():
    async def scenario():
        steps = []

        async def inner():
            await in_task()
            steps.append("on")

        task = asyncio.create_task(inner())
        await asyncio.sleep(0)  # one step of the task: in_task returned at once
        assert steps == ["on"]
        await task
    run(scenario())


def test_a_cancelled_wait_for_a_semaphore_gives_back_no_slot_it_never_had():
    """Cancelled before the task's first step, the wait is cancelled as a task cancels what
    it waits on: the semaphore sees a cancelled waiter, not a slot granted and handed back
    (which would leave it one slot too many)."""
    async def scenario():
        slots = asyncio.Semaphore(1)
        await slots.acquire()

        async def wait_for_slot():
            await slots.acquire()

        started = await start_from_callback(wait_for_slot(), then=lambda s: s.task.cancel())
        with pytest.raises(asyncio.CancelledError):
            await started.task
        slots.release()
        assert await asyncio.wait_for(slots.acquire(), 1) is True
        assert slots.locked()  # one slot, taken: none was added
    run(scenario())


def test_started_from_a_task_the_coroutine_never_runs_as_part_of_that_task():
    """(On Python 3.11, where no public call makes a task current, it then simply runs in a
    task of its own.)"""
    async def work():
        return asyncio.current_task()

    async def scenario():
        caller = asyncio.current_task()
        started = start(work())
        ran_in = started.result if started.task is None else await started.task
        assert ran_in is not caller
    run(scenario())
