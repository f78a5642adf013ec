"""Publishing this instance's bookings and reading the others', over one Redis stream.

Why a stream (``XADD`` / ``XREAD``) rather than pub/sub: pub/sub delivers only to whoever is
subscribed at that instant, so an instance that starts, restarts or loses its connection for
a second misses bookings for good, and a new instance would have nothing to bootstrap from.
A stream is the same fan-out with a bounded history (``MAXLEN ~``): a new instance reads the
recent bookings (``XREVRANGE``) to rebuild load and policy state, and an instance that lost
Redis reads on from the last entry id it applied. Its cost is the same one round trip per
batch.

Nothing here is on a request's path: :meth:`SharedBookings.publish` appends the encoded event
to an in-memory outbox (bounded; the oldest go first when an outage lasts), and a background
task writes the outbox in pipelined batches. Another task blocks on ``XREAD`` and applies the
others' events to the runner (:class:`~prefixroute.edges.shared_state.apply.RemoteBookings`).
While Redis is unavailable both tasks retry every ``retry_s``; on its return the outbox is
written (the peers learn what this instance did meanwhile) and reading resumes after the last
id applied (stream ids are times in milliseconds, so a Redis restarted empty still hands out
later ids).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Callable

from prefixroute.edges.shared_state.apply import RemoteBookings
from prefixroute.edges.shared_state.codec import (CodecError, Event, Routed, UnknownKind,
                                                 decode, encode)
from prefixroute.edges.shared_state.link import REDIS_ERRORS, RedisLink

log = logging.getLogger("prefixroute.shared_state")

DEFAULT_HISTORY = 20_000  # stream entries kept (about the bookings of a busy minute)
DEFAULT_BOOTSTRAP = 5_000  # entries a new instance reads at start
DEFAULT_OUTBOX = 50_000  # events held during an outage
BATCH = 500  # entries per XADD pipeline / XREAD
# Liveness: each instance refreshes a key with this lifetime every HEARTBEAT_S; an instance
# whose key is missing at two checks in a row (CHECK_S apart, so a Redis restarted empty has
# time to hear from everyone again) is gone, and its open bookings end.
HEARTBEAT_S, HEARTBEAT_TTL_S, CHECK_S = 1.0, 5.0, 5.0
READ_BLOCK_MS = 1000
APPLY_CHUNK = 4  # remote events applied between two turns of the loop
# This instance's recent decisions kept to tell which were made blind to a concurrent remote
# booking (far above the remote lag's p99 on a loaded host, ~0.1-0.9 s).
BLIND_WINDOW_S = 5.0
FIELD = b"m"  # the encoded event
# The writing instance's id beside it: a reader skips its own events (every instance reads
# the whole stream, its own writes included) without decoding them; an entry without it is
# decoded and told apart by the event's own instance field.
INSTANCE_FIELD = b"i"


class SharedBookings:
    """This instance's side of the fleet's booking stream ``{namespace}:bookings``."""

    def __init__(self, link: RedisLink, remote: RemoteBookings, *, namespace: str,
                 now: Callable[[], float], history: int = DEFAULT_HISTORY,
                 bootstrap: int = DEFAULT_BOOTSTRAP, outbox: int = DEFAULT_OUTBOX):
        self.link = link
        self.remote = remote
        self.key = f"{namespace}:bookings"
        self.history = history
        self.bootstrap_entries = bootstrap
        self._now = now
        self.outbox: deque[bytes] = deque()
        self._entry_instance = remote.instance.encode()
        self.outbox_max = outbox
        self.last_id: bytes | None = None  # the last stream entry applied
        self.bootstrapped = False
        self.namespace = namespace
        self._missing_once: set[str] = set()
        self._unknown_kinds: set = set()  # message kinds of newer peers, logged once each
        # (wall time, replica, branch) of this instance's bookings in the last BLIND_WINDOW_S.
        self.recent: deque[tuple[float, str, str]] = deque()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        # The loops also end on this flag: the client may turn a cancellation in the middle of
        # a command into a connection error, which the loops would otherwise retry.
        self._stopping = False

    # -- this instance's events ---------------------------------------------------------

    def publish(self, event: Event) -> None:
        """Queue one of this instance's events (no I/O here)."""
        if len(self.outbox) >= self.outbox_max:
            self.outbox.popleft()
            self.link.metrics.dropped.inc()
        self.outbox.append(encode(event))
        self._wake.set()

    def decided(self, wall_time: float, replica: str, branch: str) -> None:
        """Note one of this instance's routing decisions (for :meth:`_blind`)."""
        recent = self.recent
        recent.append((wall_time, replica, branch))
        while recent[0][0] < wall_time - BLIND_WINDOW_S:
            recent.popleft()

    def _blind(self, event: Routed) -> None:
        """Count this instance's decisions that ``event`` (another instance's booking, just
        applied) would have been part of had it arrived in time: same replica, made after
        it. How often the instances herd onto a replica because their bookings travel."""
        for wall_time, replica, branch in reversed(self.recent):
            if wall_time <= event.wall_time:
                break
            if replica == event.replica:
                self.link.metrics.blind_decisions.labels(branch).inc()

    # -- tasks --------------------------------------------------------------------------

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._write_loop(), name="shared-state-write"),
                       asyncio.create_task(self._read_loop(), name="shared-state-read"),
                       asyncio.create_task(self._liveness_loop(), name="shared-state-alive")]

    async def stop(self, flush_s: float = 1.0) -> None:
        """Stop, then write what is left in the outbox (for up to ``flush_s``)."""
        self._stopping = True
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=flush_s)
        self._tasks = []
        if self.link.usable():
            try:
                await asyncio.wait_for(self._flush(), flush_s)
                # A clean stop: the others need not wait for the heartbeat to lapse.
                await self.link.client.delete(self._alive_key(self.remote.instance))
            except (asyncio.TimeoutError, *REDIS_ERRORS):
                pass

    def _alive_key(self, instance: str) -> str:
        return f"{self.namespace}:alive:{instance}"

    async def _liveness_loop(self) -> None:
        mine = self._alive_key(self.remote.instance)
        last_check = asyncio.get_running_loop().time()
        while not self._stopping:
            try:
                await self.link.client.set(mine, b"1", px=int(HEARTBEAT_TTL_S * 1000))
                self.link.metrics.operations.labels("heartbeat").inc()
                now = asyncio.get_running_loop().time()
                if now - last_check >= CHECK_S:
                    last_check = now
                    await self.check_instances()
            except REDIS_ERRORS as exc:
                self.link.failed("heartbeat", exc)
            await asyncio.sleep(HEARTBEAT_S)

    async def check_instances(self) -> None:
        """End the open bookings of instances missing at two checks in a row."""
        others = sorted(self.remote.instances())
        if not others:
            self._missing_once.clear()
            return
        pipe = self.link.client.pipeline(transaction=False)
        for instance in others:
            pipe.exists(self._alive_key(instance))
        alive = await pipe.execute()
        self.link.metrics.operations.labels("exists").inc(len(others))
        missing = {i for i, present in zip(others, alive) if not present}
        for instance in missing & self._missing_once:
            ended = self.remote.forget_instance(instance)
            log.warning("router instance gone; its bookings ended", extra={"fields": {
                "event": "shared_state_instance_gone", "instance": instance,
                "bookings": ended}})
        self._missing_once = missing - self._missing_once

    async def _write_loop(self) -> None:
        while not self._stopping:
            await self._wake.wait()
            self._wake.clear()
            while self.outbox and not self._stopping:
                try:
                    await self._flush()
                    self.link.ok()
                except REDIS_ERRORS as exc:
                    self.link.failed("xadd", exc)
                    await asyncio.sleep(self.link.retry_s)

    async def _flush(self) -> None:
        while self.outbox:
            batch = [self.outbox[i] for i in range(min(BATCH, len(self.outbox)))]
            pipe = self.link.client.pipeline(transaction=False)
            for data in batch:
                pipe.xadd(self.key, {FIELD: data, INSTANCE_FIELD: self._entry_instance},
                          maxlen=self.history, approximate=True)
            await pipe.execute()
            self.link.metrics.operations.labels("xadd").inc(len(batch))
            self.link.metrics.published.inc(len(batch))
            for _ in batch:  # written: only now do they leave the outbox
                self.outbox.popleft()

    async def _read_loop(self) -> None:
        while not self._stopping:
            try:
                if not self.bootstrapped:
                    await self.bootstrap()
                await self._read_once()
                self.link.ok()
            except REDIS_ERRORS as exc:
                self.link.failed("xread", exc)
                await asyncio.sleep(self.link.retry_s)
            self.remote.expire(self._now())

    async def bootstrap(self) -> int:
        """Apply the stream's most recent bookings (a new or restarted instance); returns
        how many entries were read."""
        entries = await self.link.reader.xrevrange(self.key, count=self.bootstrap_entries)
        self.link.metrics.operations.labels("xrevrange").inc()
        entries.reverse()
        self._apply(entries)
        if self.last_id is None:
            self.last_id = entries[-1][0] if entries else b"0-0"
        self.bootstrapped = True
        log.info("shared state bootstrapped", extra={"fields": {
            "event": "shared_state_bootstrap", "entries": len(entries),
            "remote_in_flight": len(self.remote.open)}})
        return len(entries)

    async def _read_once(self) -> None:
        answer = await self.link.reader.xread({self.key: self.last_id}, count=BATCH,
                                              block=READ_BLOCK_MS)
        self.link.metrics.operations.labels("xread").inc()
        for _stream, entries in answer or ():
            # A remote booking costs what a local one does in the policy (milliseconds for a
            # long prompt): a batch applied in one go would hold this instance's own requests
            # behind it, so the loop gets a turn every APPLY_CHUNK events.
            for start in range(0, len(entries), APPLY_CHUNK):
                if start:
                    await asyncio.sleep(0)
                self._apply(entries[start:start + APPLY_CHUNK])

    def _apply(self, entries: list) -> None:
        metrics = self.link.metrics.remote_events
        wall = time.time
        own = self._entry_instance
        for entry_id, fields in entries:
            self.last_id = entry_id
            data = fields.get(FIELD)
            if data is None or fields.get(INSTANCE_FIELD) == own:
                continue
            try:
                event = decode(data)
            except UnknownKind as exc:
                # A newer peer's: logged once per kind (a few kinds at most are remembered).
                if exc.kind not in self._unknown_kinds and len(self._unknown_kinds) < 16:
                    self._unknown_kinds.add(exc.kind)
                    log.warning("booking messages of an unknown kind skipped (a newer "
                                "instance wrote them)", extra={"fields": {
                                    "event": "shared_state_unknown_kind",
                                    "kind": repr(exc.kind)}})
                continue
            except CodecError as exc:
                log.warning("unreadable booking message skipped", extra={"fields": {
                    "event": "shared_state_bad_message", "id": entry_id.decode(),
                    "error": str(exc)}})
                continue
            if self.remote.apply(event):
                metrics.labels(type(event).__name__.lower()).inc()
                if isinstance(event, Routed) and self.bootstrapped:
                    # Wall clocks of two hosts: a lag is as exact as their synchronisation.
                    self.link.metrics.remote_lag.observe(max(0.0, wall() - event.wall_time))
                    self._blind(event)
