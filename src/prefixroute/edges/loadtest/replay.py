"""Sending requests over real HTTP and measuring each one: TTFT, latency, cached tokens.

Two ways to drive load, both bounded in count and in time:

:func:`replay`
    open loop: each request leaves at its arrival time (engine seconds x ``time_scale``),
    whatever the server's state, as real users arrive; TTFT then shows queueing.
:func:`closed_loop`
    ``concurrency`` workers, each sending its next request as soon as the last one ended:
    the most the server can take at that concurrency.

Responses are read as they arrive (:mod:`prefixroute.edges.http1`, cheap enough that the load
generator is not what is measured). A stream's TTFT is the time to its first event; its
``cached_tokens`` come from the usage chunk (``stream_options.include_usage``). A request
counts as ok only with status 200 and, for a stream, no error event and a ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from prefixroute.core.simulator.metrics import percentile
from prefixroute.edges.http1 import Client, TransportError
from prefixroute.edges.loadtest.workload import WireRequest

DEFAULT_REQUEST_TIMEOUT_S = 120.0
_ERROR_SNIPPET = 200


@dataclass(slots=True)
class Outcome:
    """What one request got."""

    index: int
    tenant: str
    ok: bool
    status: int | None
    latency_s: float
    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


def _usage(obj: object) -> tuple[int | None, int | None]:
    usage = obj.get("usage") if isinstance(obj, dict) else None
    if not isinstance(usage, dict):
        return None, None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return usage.get("prompt_tokens"), cached if cached is not None else 0


async def send(client: Client, url: str, request: WireRequest,
               headers: Mapping[str, str], *, stream: bool,
               timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
               parse_usage: bool = True) -> Outcome:
    """POST one request and read the whole answer."""
    started = time.perf_counter()
    outcome = Outcome(request.index, request.tenant, False, None, 0.0)
    try:
        async with asyncio.timeout(timeout_s):
            response = await client.request("POST", url, body=request.body, headers=headers)
            outcome.status = response.status
            if response.status != 200:
                text = (await response.aread())[:_ERROR_SNIPPET].decode("utf-8", "replace")
                outcome.error = f"HTTP {response.status}: {text}"
            elif stream:
                await _read_stream(response, outcome, started)
            else:
                content = await response.aread()
                outcome.ttft_s = time.perf_counter() - started
                if parse_usage:
                    outcome.prompt_tokens, outcome.cached_tokens = _usage(json.loads(content))
                outcome.ok = True
    except TimeoutError:
        outcome.error = f"no complete answer within {timeout_s:g} s"
    except TransportError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    except ValueError as exc:  # a body that is not JSON
        outcome.error = f"unreadable answer: {exc}"
    outcome.latency_s = time.perf_counter() - started
    return outcome


async def _read_stream(response, outcome: Outcome, started: float) -> None:
    buffer = b""
    done = False
    async for chunk in response.aiter_raw():
        if outcome.ttft_s is None:
            outcome.ttft_s = time.perf_counter() - started
        buffer += chunk
        while True:
            cut = buffer.find(b"\n\n")
            if cut < 0:
                break
            event, buffer = buffer[:cut], buffer[cut + 2:]
            if not event.startswith(b"data:"):
                continue
            data = event[5:].strip()
            if data == b"[DONE]":
                done = True
            elif b'"error"' in data or b'"usage"' in data:
                obj = json.loads(data)
                if isinstance(obj, dict) and obj.get("error"):
                    error = obj["error"]
                    outcome.error = "stream error: " + (error.get("message", "") if isinstance(
                        error, dict) else str(error))[:_ERROR_SNIPPET]
                elif isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    outcome.prompt_tokens, outcome.cached_tokens = _usage(obj)
    if outcome.error is None and not done:
        outcome.error = "the stream ended without [DONE]"
    outcome.ok = outcome.error is None


async def replay(url: str | Sequence[str], requests: Sequence[WireRequest], *,
                 headers_for: Callable[[WireRequest], Mapping[str, str]],
                 time_scale: float = 1.0, stream: bool = True,
                 timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                 deadline_s: float | None = None,
                 on_outcome: Callable[[Outcome], None] | None = None,
                 client: Client | None = None,
                 pick: Callable[[int, WireRequest], int] | None = None) -> list[Outcome]:
    """Open loop: request i leaves at ``arrival_s * time_scale`` wall seconds after the first.
    Past ``deadline_s`` (wall seconds from the start) what has not finished is cancelled and
    counted as failed, so a stuck server cannot hang the caller. Several URLs take turns
    (a client-side round robin, for the no-router baseline), or ``pick(i, request)`` names
    the index of the URL request i goes to (a load balancer with affinity in front)."""
    urls = [url] if isinstance(url, str) else list(url)
    own = client is None
    client = client or Client(read_timeout=timeout_s)
    outcomes: list[Outcome | None] = [None] * len(requests)
    first_arrival = requests[0].arrival_s if requests else 0.0

    async def one(slot: int, request: WireRequest) -> None:
        at = slot if pick is None else pick(slot, request)
        outcome = await send(client, urls[at % len(urls)], request, headers_for(request),
                             stream=stream, timeout_s=timeout_s)
        outcomes[slot] = outcome
        if on_outcome is not None:
            on_outcome(outcome)

    async def pace() -> None:
        tasks = []
        start = time.perf_counter()
        try:
            for slot, request in enumerate(requests):
                delay = start + (request.arrival_s - first_arrival) * time_scale \
                    - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(slot, request)))
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        try:
            async with asyncio.timeout(deadline_s):
                await pace()
        except TimeoutError:
            pass
    finally:
        if own:
            await client.aclose()
    return _fill(outcomes, requests, on_outcome, deadline_s)


async def closed_loop(url: str | Sequence[str], requests: Sequence[WireRequest], *,
                      concurrency: int,
                      headers_for: Callable[[WireRequest], Mapping[str, str]],
                      duration_s: float, stream: bool = False, parse_usage: bool = False,
                      timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
                      warmup_s: float = 0.0) -> tuple[list[Outcome], float]:
    """``concurrency`` workers send ``requests`` round and round for ``duration_s`` seconds
    (after ``warmup_s`` seconds whose requests are not counted); several URLs take turns
    (a client-side round robin, for the no-router baseline). Returns the counted outcomes
    and the measured seconds."""
    urls = [url] if isinstance(url, str) else list(url)
    client = Client(read_timeout=timeout_s, max_idle_per_origin=max(256, concurrency))
    outcomes: list[Outcome] = []
    counter = 0
    measuring_from = time.perf_counter() + warmup_s
    stop_at = measuring_from + duration_s

    async def worker() -> None:
        nonlocal counter
        while True:
            now = time.perf_counter()
            if now >= stop_at:
                return
            request = requests[counter % len(requests)]
            target = urls[counter % len(urls)]
            counter += 1
            outcome = await send(client, target, request, headers_for(request), stream=stream,
                                 timeout_s=timeout_s, parse_usage=parse_usage)
            if now >= measuring_from:
                outcomes.append(outcome)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))
    finally:
        await client.aclose()
    return outcomes, time.perf_counter() - measuring_from


def _fill(outcomes: list[Outcome | None], requests: Sequence[WireRequest],
          on_outcome: Callable[[Outcome], None] | None,
          deadline_s: float | None) -> list[Outcome]:
    done = []
    for slot, outcome in enumerate(outcomes):
        if outcome is None:
            request = requests[slot]
            outcome = Outcome(request.index, request.tenant, False, None, 0.0,
                              error=f"not finished within the {deadline_s:g} s deadline")
            if on_outcome is not None:
                on_outcome(outcome)
        done.append(outcome)
    return done


def summarize(outcomes: Sequence[Outcome], *, time_scale: float = 1.0) -> dict:
    """Counts, token hit rate (reported cached / prompt tokens over the ok requests), and TTFT
    and latency percentiles. With ``time_scale`` (the engines' speed-up) the times are turned
    back into engine seconds: measured / ``time_scale``."""
    ok = [o for o in outcomes if o.ok]
    prompt = sum(o.prompt_tokens or 0 for o in ok)
    cached = sum(o.cached_tokens or 0 for o in ok)
    scale = 1.0 / time_scale if time_scale > 0 else 1.0

    def pct(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return None if value is None else round(value * scale, 4)

    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    latencies = [o.latency_s for o in ok]
    errors: dict[str, int] = {}
    for o in outcomes:
        if not o.ok:
            key = (o.error or "failed")[:80]
            errors[key] = errors.get(key, 0) + 1
    return {"requests_ok": len(ok), "requests_failed": len(outcomes) - len(ok),
            "token_hit_rate": round(cached / prompt, 4) if prompt else None,
            "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_p50_s": pct(ttfts, 50), "ttft_p99_s": pct(ttfts, 99),
            "latency_p50_s": pct(latencies, 50), "latency_p99_s": pct(latencies, 99),
            "errors": errors}
