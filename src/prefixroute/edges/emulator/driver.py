"""Drives an :class:`EmulatedReplica` in real (or scaled) time on the asyncio loop.

The engine is step-driven and reads no clock; this driver is its clock. Engine time is
``time.monotonic()`` minus the start time, in seconds; the service-time model was already
scaled by ``--time-scale`` (0 makes every step instant). A request is submitted the moment
it arrives, the engine is advanced to "now" right away (so an instant engine answers within
the same call), and one loop timer is kept at the engine's next event time: when it fires the
driver advances the engine, resolves the futures of requests whose first token or end came,
and publishes the KV events of the steps that ended, one batch per advance.

Streaming: the engine reports a request's first token and its end, not each decode step (it
takes runs of pure-decode steps in closed form). Tokens in between are paced by the service
model's decode-step time for the batch running when the first token came; the last token is
never sent before the engine says the request finished, so a slower engine stalls the stream
rather than letting it run ahead.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Callable, Sequence

from prefixroute.core.kvevents import EventBatch
from prefixroute.edges.emulator.metrics import EmulatorMetrics
from prefixroute.edges.emulator.protocol import APIError
from prefixroute.edges.emulator.replica import EmulatedReplica, SequenceMeta

log = logging.getLogger(__name__)


class EngineSequence:
    """One sequence in the engine (one choice of one HTTP request) and its two futures:
    ``first`` (resolved with the cached tokens when the first token is sampled) and ``done``
    (resolved when the last one is)."""

    __slots__ = ("seq_id", "prompt_len", "output_ids", "arrival", "cached_tokens",
                 "first_token_at", "finished_at", "first", "done")

    def __init__(self, seq_id: int, prompt_len: int, output_ids: Sequence[int],
                 arrival: float, loop: asyncio.AbstractEventLoop):
        self.seq_id = seq_id
        self.prompt_len = prompt_len
        self.output_ids = output_ids
        self.arrival = arrival
        self.cached_tokens = 0
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.first: asyncio.Future = loop.create_future()
        self.done: asyncio.Future = loop.create_future()


class EngineDriver:
    """Owns the engine's clock, its waiting requests and the KV event stream."""

    def __init__(self, replica: EmulatedReplica, metrics: EmulatorMetrics, *,
                 publish: Callable[[EventBatch], object] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        self.replica = replica
        self.engine = replica.engine
        self.metrics = metrics
        self._publish = publish
        self._clock = clock
        self._wall_clock = wall_clock
        self._t0 = clock()
        self._ids = itertools.count()
        self._sequences: dict[int, EngineSequence] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._steps_published = self.engine.steps

    def now(self) -> float:
        return self._clock() - self._t0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        return self._loop

    # -- requests -------------------------------------------------------------------------
    def submit(self, prompt_ids: Sequence[int], output_ids: Sequence[int],
               meta: SequenceMeta) -> EngineSequence:
        """Queue a sequence now; its futures resolve as the engine serves it."""
        now = self.now()
        seq = EngineSequence(next(self._ids), len(prompt_ids), output_ids, now, self.loop)
        self._sequences[seq.seq_id] = seq
        self.replica.submit(seq.seq_id, prompt_ids, output_ids, now, meta)
        self._pump(now)
        return seq

    def abort(self, seq: EngineSequence) -> None:
        """The client went away: drop the sequence (no events, nothing counted)."""
        if self._sequences.pop(seq.seq_id, None) is None:
            return
        now = self.now()
        self.replica.abort(seq.seq_id, now)
        self.metrics.success["abort"] += 1
        self._pump(now)

    def abort_all(self, error: APIError) -> int:
        """Shutdown: abort every sequence in the engine and fail its futures with ``error``,
        so handlers waiting on them answer at once. Returns how many were aborted."""
        sequences, self._sequences = self._sequences, {}
        if not sequences:
            return 0
        now = self.now()
        for seq in sequences.values():
            self.replica.abort(seq.seq_id, now)
            self.metrics.success["abort"] += 1
            for future in (seq.first, seq.done):
                if not future.done():
                    future.set_exception(error)
                    future.exception()  # mark retrieved: the handler may await only one
        self._pump(now)
        return len(sequences)

    @property
    def in_flight(self) -> int:
        """Sequences submitted and not yet finished, rejected or aborted."""
        return len(self._sequences)

    def reset_prefix_cache(self) -> bool:
        ok = self.replica.reset_prefix_cache()
        # vLLM publishes the AllBlocksCleared with its next step's batch.
        return ok

    def itl_estimate(self, seq: EngineSequence) -> float:
        """Seconds between streamed tokens: one decode step of the batch running now."""
        running = max(1, self.engine.running)
        context = running * (seq.prompt_len + len(seq.output_ids) // 2)
        return self.engine.service.decode_step_time(running, context)

    # -- the clock ------------------------------------------------------------------------
    def _tick(self) -> None:
        self._timer = None
        self._timer_at = None
        self._pump(self.now())

    def _pump(self, now: float) -> None:
        events = self.replica.advance(now)
        if events:
            self._dispatch(events)
        if self._publish is not None and self.engine.steps != self._steps_published:
            self._steps_published = self.engine.steps
            batch = self.replica.take_events()
            if batch:
                self._publish(EventBatch(self._wall_clock(), tuple(batch), 0))
        self._schedule()

    def _schedule(self) -> None:
        at = self.engine.next_event_time()
        if at is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = self._timer_at = None
            return
        if self._timer is not None:
            if self._timer_at == at:
                return
            self._timer.cancel()
        self._timer_at = at
        self._timer = self.loop.call_later(max(0.0, at - self.now()), self._tick)

    def _dispatch(self, events) -> None:
        sequences = self._sequences
        metrics = self.metrics
        for event in events:
            seq = sequences.get(event.request_id)
            if seq is None:
                continue  # aborted
            kind = event.kind
            if kind == "first_token":
                seq.cached_tokens = event.cached_tokens
                seq.first_token_at = event.time
                metrics.first_token(event.time - seq.arrival)
                if not seq.first.done():
                    seq.first.set_result(event.cached_tokens)
            elif kind == "finished":
                del sequences[event.request_id]
                seq.cached_tokens = event.cached_tokens
                seq.finished_at = event.time
                if seq.first_token_at is None:  # pragma: no cover - engine reports both
                    seq.first_token_at = event.time
                    seq.first.set_result(event.cached_tokens)
                if not seq.done.done():
                    seq.done.set_result(event.cached_tokens)
            else:  # rejected: the sequence can never fit in the KV cache
                del sequences[event.request_id]
                error = APIError(f"the request needs more KV cache blocks than the replica has "
                                 f"({self.replica.pool.capacity_blocks} of "
                                 f"{self.replica.block_size} tokens)", param="max_tokens")
                for future in (seq.first, seq.done):
                    if not future.done():
                        future.set_exception(error)
                        future.exception()  # mark retrieved: the handler may await only one
