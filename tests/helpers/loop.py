"""Calling code as an event loop's transport callbacks do: outside any task."""

from __future__ import annotations

import asyncio
from typing import Any, Callable


async def from_callback(fn: Callable[..., Any], *args: Any,
                        then: Callable[[Any], Any] | None = None) -> Any:
    """``fn(*args)`` from a plain event-loop callback, outside any task, as a transport's
    read callback calls a server; ``then(result)`` runs in the same callback, right after."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()

    def call() -> None:
        try:
            result = fn(*args)
            if then is not None:
                then(result)
            done.set_result(result)
        except BaseException as exc:
            done.set_exception(exc)
    loop.call_soon(call)
    return await done
