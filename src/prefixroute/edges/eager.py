"""Run a coroutine at once, in the caller's callback, until it first has to wait.

A server that answers from a transport's read callback pays for every hop through the event
loop: ``create_task`` only schedules the coroutine's first step for the next turn of the
loop, and in that turn the loop polls its sockets and runs whatever else is ready first. When
the coroutine rarely waits (a request admitted at once, routed, answered), starting it in
the callback answers in the same turn, and its write leaves with the read's.

:func:`start` does that. The coroutine's first step runs in a copy of the caller's context
(as a task's would); if it finishes there, its result (or its exception) is returned and no
task exists; if it suspends, a task goes on from where it stopped. Python 3.12 and later have
this as :func:`asyncio.eager_task_factory`, used as it is. Python 3.11 has no public way to
make a task current, so there the first step runs eagerly only when called outside any task
(a transport's callback), and outside any task: code that needs the current task
(``asyncio.timeout``, and libraries built on it) must not run before the coroutine's first
wait. Such code starts with ``await in_task()`` (:func:`in_task`), which waits one turn of
the loop only when there is no task yet.
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
        loop = asyncio.get_running_loop()
        task = asyncio.eager_task_factory(loop, coro, context=contextvars.copy_context())
        if not task.done():
            return Started(task)
        if task.cancelled():
            return Started(None, error=asyncio.CancelledError())
        error = task.exception()
        return Started(None, None if error is not None else task.result(), error)
else:
    def start(coro: Coroutine[Any, Any, Any]) -> Started:
        context = contextvars.copy_context()
        if asyncio.current_task() is not None:
            # Called from a task: a first step run here would run inside that task (whose
            # timeouts it would take for its own), so it runs in a task of its own.
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
    """The coroutine a task runs to go on with one :func:`start` began: its first step hands
    the task the wait the coroutine stopped at; from then on every value and exception the
    task sends (a cancellation included, even one before that first step) goes to the
    coroutine, as if the task had run it from the start."""

    __slots__ = ("coro", "waits_on", "fresh")

    def __init__(self, coro: Coroutine[Any, Any, Any], waits_on: Any):
        self.coro = coro
        self.waits_on = waits_on
        self.fresh = True

    def send(self, value: Any) -> Any:
        if self.fresh:
            self.fresh = False
            return self.waits_on
        return self.coro.send(value)

    def throw(self, typ: Any, val: Any = None, tb: Any = None) -> Any:
        if self.fresh:
            self.fresh = False
            waits_on = self.waits_on
            if (isinstance(typ, asyncio.CancelledError) and asyncio.isfuture(waits_on)
                    and waits_on.cancel()):
                # Cancelled before its first step: as a task cancels the future it waits
                # on, and the coroutine learns of it from that future (a semaphore, say,
                # then knows its slot was not granted).
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

