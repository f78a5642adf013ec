"""Run a coroutine at once, in the caller's callback, until it first has to wait.

A server that answers from a transport's read callback pays for every hop through the event
loop: ``create_task`` only schedules the coroutine's first step for the next turn of the
loop, and in that turn the loop polls its sockets and runs whatever else is ready first. When
the coroutine rarely waits (a request admitted at once, routed, answered), starting it in
the callback answers in the same turn, and its write leaves with the read's.

:func:`start` does that. The coroutine's first step runs in a copy of the caller's context
(as a task's would); if it finishes there, its result (or its exception) is handed back at
once; if it suspends, a task goes on from where it stopped. Python 3.12 and later have this
as :func:`asyncio.eager_task_factory`, used as it is.

Python 3.11 has no public way to make a task current while a step runs. There the first step
runs eagerly only when :func:`start` is called outside any task (a transport's callback), and
then it runs outside any task too: code that needs the current task (``asyncio.timeout``,
``asyncio.TaskGroup``, and libraries built on them such as the Redis client) must not run
before the coroutine's first wait, so it first awaits :func:`in_task`. Called from inside a
task, :func:`start` simply creates one.
"""

from __future__ import annotations

import asyncio
import contextvars
import sys
from collections.abc import Coroutine
from typing import Any


class Started:
    """What :func:`start` gives back: ``task`` when the coroutine waits, else its outcome
    (``result``, or ``error`` when it raised)."""

    __slots__ = ("task", "result", "error")

    def __init__(self, task: asyncio.Task | None, result: Any = None,
                 error: BaseException | None = None):
        self.task = task
        self.result = result
        self.error = error


if sys.version_info >= (3, 12):
    def start(coro: Coroutine[Any, Any, Any]) -> Started:
        """Run ``coro`` until its first wait; the rest, if any, in a task."""
        loop = asyncio.get_running_loop()
        task = asyncio.eager_task_factory(loop, coro, context=contextvars.copy_context())
        if not task.done():
            return Started(task)
        try:  # (retrieving the outcome also marks an exception as seen)
            return Started(None, task.result())
        except BaseException as error:
            return Started(None, error=error)
else:
    def start(coro: Coroutine[Any, Any, Any]) -> Started:
        """Run ``coro`` until its first wait; the rest, if any, in a task."""
        context = contextvars.copy_context()
        if asyncio.current_task() is not None:
            # A first step run here would run as part of the calling task (and take that
            # task's timeouts and cancellation for its own): it runs in a task of its own.
            return Started(asyncio.get_running_loop().create_task(coro, context=context))
        try:
            waits_on = context.run(coro.send, None)
        except StopIteration as done:
            return Started(None, done.value)
        except BaseException as error:  # its outcome, for the caller to handle
            return Started(None, error=error)
        loop = asyncio.get_running_loop()
        return Started(loop.create_task(_Resumed(coro, waits_on), context=context))


class _Resumed(Coroutine):
    """What the task runs to go on with a coroutine :func:`start` began (Python 3.11).

    Its first step hands the task the wait the coroutine stopped at; from then on every value
    and exception the task sends goes to the coroutine, as if the task had run it from the
    start. A cancellation before that first step does what a task's cancellation does to a
    wait: it cancels the awaited future, and the coroutine learns of it from that future (a
    semaphore, say, then knows its slot was not granted)."""

    __slots__ = ("coro", "waits_on", "fresh")

    def __init__(self, coro: Coroutine[Any, Any, Any], waits_on: Any):
        self.coro = coro
        self.waits_on = waits_on
        self.fresh = True

    def send(self, value: Any) -> Any:
        if self.fresh:
            self.fresh = False
            waits_on, self.waits_on = self.waits_on, None
            if waits_on is not None:
                return waits_on
            # A bare yield (``asyncio.sleep(0)``): the turn of the loop it asked for has
            # passed while this task waited for its first step.
        return self.coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self.fresh:
            self.fresh = False
            waits_on, self.waits_on = self.waits_on, None
            if (isinstance(typ, asyncio.CancelledError) and asyncio.isfuture(waits_on)
                    and waits_on.cancel(msg=typ.args[0] if typ.args else None)):
                return waits_on
        if val is None and tb is None:
            return self.coro.throw(typ)
        return self.coro.throw(typ, val, tb)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> "_Resumed":
        return self

    def __next__(self) -> Any:
        return self.send(None)


async def in_task() -> None:
    """Go on inside a task: outside one (a coroutine :func:`start` runs on Python 3.11,
    before its first wait) wait one turn of the loop, so that what follows runs in the task
    :func:`start` made; inside one, return at once."""
    if asyncio.current_task() is None:
        await asyncio.sleep(0)
