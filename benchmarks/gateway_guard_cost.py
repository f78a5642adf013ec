"""What the gateway's request-head guard and its way of finding uvicorn's cycle cost per request.

Run: ``python benchmarks/gateway_guard_cost.py`` (a few seconds). CPU time (``process_time``),
so other work on the machine moves the figures little. Two measurements:

* the head guard (``edges/gateway/guard.py``) alone: one typical streaming request (about
  700 bytes, head and body in one read) fed repeatedly to a guard whose inner protocol does
  nothing, on one kept-alive connection; the httptools parse it adds is shown beside it;
* how a stream finds where to splice: reading the request task's coroutine frame
  (``cr_frame.f_locals``, how the gateway did it first) against the context variables it
  reads now: the app's ``proxy.caller_send`` (set, read, reset around its handler) and the
  guard's ``guard.connection`` (read; its set and reset around each read are in the head
  guard's figure), inside a task shaped like uvicorn's (a coroutine method ``run_asgi`` of
  a ``RequestResponseCycle``).
"""

from __future__ import annotations

import asyncio
import time
from contextvars import ContextVar

import httptools

from prefixroute.edges.gateway import guard
from prefixroute.edges.gateway.guard import connection

N = 100_000
RUNS = 5
BODY = b'{"model":"tiny","prompt":"' + b"x" * 400 + b'","max_tokens":16,"stream":true}'
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: */*\r\n"
           b"Accept-Encoding: gzip, deflate\r\nConnection: keep-alive\r\n"
           b"Authorization: Bearer sk-0123456789abcdef\r\nContent-Type: application/json\r\n"
           b"User-Agent: OpenAI/Python 1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY))


class _Nothing(asyncio.Protocol):
    def __init__(self, *args, **kwargs):
        pass

    def data_received(self, data: bytes) -> None:
        pass


class _Transport:
    def is_closing(self) -> bool:
        return False


def _best_us(step, n: int = N) -> float:
    best = float("inf")
    for _ in range(RUNS):
        started = time.process_time()
        for _ in range(n):
            step()
        best = min(best, (time.process_time() - started) / n * 1e6)
    return best


async def _guard_cost() -> tuple[float, float]:
    inner, guard.HTTPTOOLS_PROTOCOL = guard.HTTPTOOLS_PROTOCOL, _Nothing
    try:
        protocol = guard.guarded_protocol(65536, 10.0)()
        protocol.connection_made(_Transport())  # type: ignore[arg-type]
        guarded = _best_us(lambda: protocol.data_received(REQUEST))
        protocol.connection_lost(None)
    finally:
        guard.HTTPTOOLS_PROTOCOL = inner

    class Marks:
        def on_message_begin(self) -> None:
            pass

        def on_headers_complete(self) -> None:
            pass

    parser = httptools.HttpRequestParser(Marks())
    return guarded, _best_us(lambda: parser.feed_data(REQUEST))


caller_send: ContextVar = ContextVar("caller_send", default=None)


class RequestResponseCycle:
    async def send(self, message: dict) -> None:
        pass

    async def run_asgi(self) -> tuple[float, float]:
        def frame_lookup() -> None:
            task = asyncio.current_task()
            coro = task.get_coro() if task is not None else None
            if getattr(coro, "__qualname__", None) == "RequestResponseCycle.run_asgi":
                frame = getattr(coro, "cr_frame", None)
                frame.f_locals.get("self")

        def context_variable() -> None:
            token = caller_send.set(self.send)
            connection.get()
            caller_send.get()
            caller_send.reset(token)

        return _best_us(frame_lookup), _best_us(context_variable)


def main() -> None:
    guarded, parse = asyncio.run(_guard_cost())
    print(f"head guard: {guarded:.2f} us CPU per request (of which the httptools parse "
          f"{parse:.2f} us); best of {RUNS} x {N}")
    frame, variable = asyncio.run(RequestResponseCycle().run_asgi())
    print(f"finding where to splice: frame lookup {frame * 1000:.0f} ns, context variables "
          f"{variable * 1000:.0f} ns per request")


if __name__ == "__main__":
    main()
