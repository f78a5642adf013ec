"""KV events over ZeroMQ, wire-compatible with vLLM 0.32's ``ZmqEventPublisher``.

Live stream (PUB -> SUB): every batch is one three-frame message ``[topic, seq, payload]``:
the topic bytes, the sequence number as 8 bytes big-endian (0, 1, 2, ... per publisher
process), and the msgpack batch (``prefixroute.core.kvevents``).

Replay (ROUTER <- DEALER/REQ): a client sends ``[b"", start_seq]`` (8 bytes big-endian; a REQ
socket adds the empty frame itself). The publisher answers with every batch it still buffers
whose sequence is ``>= start_seq``, each as ``[b"", topic, seq, payload]``, then an end marker
``[b"", b"", 0xffffffffffffffff, b""]`` (``ZmqEventPublisher._service_replay``). The buffer is
bounded (vLLM keeps the last ``buffer_steps`` = 10,000 batches), so old gaps cannot be filled.

Who binds: vLLM binds its PUB socket when the endpoint has a wildcard (``tcp://*:5557``) or is
ipc/inproc, and *connects* otherwise, so with ``tcp://127.0.0.1:5557`` the subscriber must bind.
The replay socket is always bound by the publisher.

Threading: :class:`KVEventPublisher` and :class:`KVEventSubscriber` each own one background
thread that alone touches their sockets (ZMQ sockets are not thread-safe). ``publish`` may be
called from any thread. The subscriber hands each :class:`ReceivedBatch` to ``on_batch`` *on
its own thread*, or, without a callback, to an internal queue read with :meth:`get` or by
iterating. In an asyncio app pass ``on_batch=asyncio_queue_callback(loop, queue)``: it hops
each batch onto the loop with ``call_soon_threadsafe`` so coroutines ``await queue.get()``.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.kvevents import (
    WIRE_FORMATS,
    EventBatch,
    WireFormat,
    decode_event_batch,
    encode_event_batch,
)
from prefixroute.edges.listen import port_in_use_hint

log = logging.getLogger(__name__)

END_SEQ = b"\xff" * 8
"""Sequence frame that ends a replay answer (vLLM: ``(-1).to_bytes(8, "big", signed=True)``)."""
DEFAULT_REPLAY_BUFFER = 10_000  # vLLM KVEventsConfig.buffer_steps default
DEFAULT_HWM = 100_000  # vLLM KVEventsConfig.hwm default
_POLL_MS = 100  # how often background threads notice stop()


def seq_to_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_from_bytes(frame: bytes) -> int:
    return int.from_bytes(frame, "big")


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule for its PUB socket: bind wildcards and ipc/inproc, connect to the rest."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def _topic_bytes(topic: str | bytes) -> bytes:
    return topic.encode() if isinstance(topic, str) else bytes(topic)


def _connect(sock: zmq.Socket, endpoint: str) -> str:
    if endpoint.endswith((":0", ":*")):
        raise ConfigError(f"cannot connect to {endpoint}: a wildcard port only makes sense "
                          "when binding (pass bind=True)")
    try:
        sock.connect(endpoint)
    except zmq.ZMQError as exc:
        raise ConfigError(f"cannot connect to {endpoint}: {exc}") from None
    return endpoint


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the actual endpoint (``tcp://127.0.0.1:0`` picks a free port)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        port = endpoint.rpartition(":")[2]
        hint = (port_in_use_hint(int(port), exc.errno)
                if endpoint.startswith("tcp://") and port.isascii() and port.isdigit() else "")
        raise ConfigError(f"cannot bind {endpoint}: {exc}{hint}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


# -- publisher -----------------------------------------------------------------------------
class KVEventPublisher:
    """Publishes event batches on a PUB socket and serves replays from a bounded buffer.

    ``publish`` assigns the next sequence number and returns it; a background thread sends the
    batch and keeps it for replay. ``live=False`` buffers a batch without sending it: the
    message is "lost" on the live stream, which is how tests provoke a gap.
    """

    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None,
                 topic: str | bytes = "", bind: bool | None = None,
                 buffer_batches: int = DEFAULT_REPLAY_BUFFER, hwm: int = DEFAULT_HWM,
                 wire_format: WireFormat = "tagged", first_seq: int = 0,
                 context: zmq.Context | None = None):
        if wire_format not in WIRE_FORMATS:
            raise ConfigError(f"unknown wire format {wire_format!r}; choose one of "
                              f"{', '.join(WIRE_FORMATS)}")
        if buffer_batches < 0:
            raise ConfigError(f"replay buffer size must be >= 0, got {buffer_batches}")
        self.topic = _topic_bytes(topic)
        self.wire_format = wire_format
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        if bind is None:
            bind = is_bind_endpoint(endpoint)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self.endpoint = (_bind if bind else _connect)(self._pub, endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = _bind(self._replay, replay_endpoint)
        except ConfigError:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_batches)
        self._outbox: queue.SimpleQueue[tuple[int, bytes, bool] | None] = queue.SimpleQueue()
        self._seq_lock = threading.Lock()
        self._next_seq = first_seq
        self._sent_seq = first_seq - 1
        self._sent = threading.Condition()
        # A socket pair wakes the thread's zmq poller when publish() enqueues.
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher",
                                        daemon=True)
        self._thread.start()

    # -- public -------------------------------------------------------------------------
    def publish(self, batch: EventBatch, *, live: bool = True) -> int:
        """Queue ``batch`` for sending; returns its sequence number."""
        return self.publish_payload(encode_event_batch(batch, self.wire_format), live=live)

    def publish_payload(self, payload: bytes, *, live: bool = True) -> int:
        """Queue an already encoded batch (e.g. a frame recorded from a real engine)."""
        if self._closed:
            raise RuntimeError("publisher is closed")
        with self._seq_lock:
            seq = self._next_seq
            self._next_seq += 1
            self._outbox.put((seq, bytes(payload), live))
        self._wake()
        return seq

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued batch has been sent (True) or ``timeout`` passes (False)."""
        target = self._next_seq - 1
        with self._sent:
            return self._sent.wait_for(lambda: self._sent_seq >= target, timeout)

    def close(self) -> None:
        """Send what is queued, stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)
        self._wake()
        self._thread.join(timeout=5.0)
        self._wake_r.close()
        self._wake_w.close()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- thread -------------------------------------------------------------------------
    def _wake(self) -> None:
        try:
            self._wake_w.send(b"\x00")
        except (BlockingIOError, OSError):
            pass  # the pipe is full (the thread will drain it) or already closed

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll(_POLL_MS))
                if self._replay is not None and self._replay in ready:
                    self._serve_replays()
                try:
                    self._wake_r.recv(4096)
                except (BlockingIOError, OSError):
                    pass
                if not self._drain_outbox():
                    return
        finally:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _drain_outbox(self) -> bool:
        """Send queued batches; False once close() has been requested."""
        while True:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if item is None:
                return False
            seq, payload, live = item
            if live:
                try:
                    self._pub.send_multipart((self.topic, seq_to_bytes(seq), payload))
                except zmq.ZMQError as exc:  # keep the batch for replay; the stream goes on
                    log.warning("KV event publish of seq %d failed: %s", seq, exc)
            self._buffer.append((seq, payload))
            with self._sent:
                self._sent_seq = seq
                self._sent.notify_all()

    def _serve_replays(self) -> None:
        assert self._replay is not None
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or frames[1] != b"":
                log.warning("ignoring malformed KV event replay request (%d frames)",
                            len(frames))
                continue
            client, _, start = frames
            start_seq = seq_from_bytes(start)
            for seq, payload in self._buffer:
                if seq >= start_seq:
                    self._replay.send_multipart(
                        (client, b"", self.topic, seq_to_bytes(seq), payload))
            self._replay.send_multipart((client, b"", b"", END_SEQ, b""))


# -- subscriber ----------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One decoded batch as delivered to the consumer.

    ``replayed`` says it came from the replay socket rather than the live stream.
    ``missing_before`` counts sequence numbers right before this one that were lost and could
    not be replayed: a router's view of the engine is incomplete from here on. ``restarted``
    marks the first batch after the sequence went backwards (the engine restarted with an empty
    cache; vLLM sends no AllBlocksCleared for that).
    """

    seq: int
    topic: bytes
    batch: EventBatch
    payload: bytes
    replayed: bool = False
    missing_before: int = 0
    restarted: bool = False


@dataclass(slots=True)
class SubscriberStats:
    received: int = 0
    replayed: int = 0
    gaps: int = 0  # live jumps in the sequence
    missing: int = 0  # sequence numbers that replay could not recover
    restarts: int = 0
    decode_errors: int = 0
    callback_errors: int = 0
    replay_requests: int = 0
    errors: list[str] = field(default_factory=list)  # the last few, for diagnostics


class KVEventSubscriber:
    """Receives event batches, fills sequence gaps from the replay socket, delivers in order.

    ``bind=True`` binds the SUB socket (needed when vLLM's endpoint is a concrete tcp address:
    vLLM then connects to us); otherwise it connects. ``topic`` is a prefix filter.
    ``expect_first_seq`` (default 0, where vLLM starts) makes a subscriber that joins late ask
    for the batches it missed; ``None`` accepts whatever arrives first.

    Malformed batches are counted in :attr:`stats` and passed to ``on_error`` (or logged);
    they still advance the sequence, so they are not replayed.
    """

    def __init__(self, endpoint: str, *, bind: bool = False, topic: str | bytes = "",
                 replay_endpoint: str | None = None,
                 on_batch: Callable[[ReceivedBatch], None] | None = None,
                 on_error: Callable[[Exception, int, bytes], None] | None = None,
                 expect_first_seq: int | None = 0, replay_timeout: float = 2.0,
                 skip_unknown_events: bool = False, max_queue: int = 100_000,
                 context: zmq.Context | None = None):
        self.topic = _topic_bytes(topic)
        self.replay_endpoint = replay_endpoint
        self.stats = SubscriberStats()
        self._on_batch = on_batch
        self._on_error = on_error
        self._skip_unknown = skip_unknown_events
        self._replay_timeout = replay_timeout
        self._queue: queue.Queue[ReceivedBatch] = queue.Queue(maxsize=max_queue)
        self._ctx = context or zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        try:
            self.endpoint = (_bind if bind else _connect)(self._sub, endpoint)
        except ConfigError:
            self._sub.close(linger=0)
            raise
        self._replay_sock: zmq.Socket | None = None
        self._next_seq: int | None = expect_first_seq
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "KVEventSubscriber":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kv-event-subscriber",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close the sockets (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        else:
            self._close_sockets()

    def __enter__(self) -> "KVEventSubscriber":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # -- consumer side (without on_batch) -----------------------------------------------
    def get(self, timeout: float | None = None) -> ReceivedBatch | None:
        """Next batch, or None after ``timeout`` seconds."""
        try:
            return self._queue.get(timeout=timeout)
        except queue.Empty:
            return None

    def __iter__(self) -> Iterator[ReceivedBatch]:
        """Batches until stop(); polls so that a stopped subscriber ends the loop."""
        while True:
            item = self.get(timeout=_POLL_MS / 1000)
            if item is not None:
                yield item
            elif self._stop.is_set() and self._queue.empty():
                return

    # -- thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if not self._sub.poll(_POLL_MS):
                    continue
                frames = self._sub.recv_multipart()
                if len(frames) != 3:
                    self._note_error(f"ignored a live message with {len(frames)} frames")
                    continue
                topic, seq_frame, payload = frames
                self._on_live(topic, seq_from_bytes(seq_frame), payload)
        except Exception as exc:  # never die silently: record, then stop
            log.exception("KV event subscriber stopped: %s", exc)
            self._note_error(f"subscriber thread failed: {exc!r}")
        finally:
            self._close_sockets()

    def _on_live(self, topic: bytes, seq: int, payload: bytes) -> None:
        expected = self._next_seq
        missing_before = 0
        restarted = False
        if expected is not None and seq > expected:
            self.stats.gaps += 1
            missing_before = self._fill_gap(expected, seq)
        elif expected is not None and seq < expected:
            self.stats.restarts += 1
            restarted = True
            log.warning("KV event sequence went back from %d to %d: publisher restarted",
                        expected, seq)
        self._deliver(topic, seq, payload, replayed=False, missing_before=missing_before,
                      restarted=restarted)

    def _fill_gap(self, first: int, end: int) -> int:
        """Replay sequences [first, end); deliver what comes back; return the unfilled tail."""
        recovered = self._request_replay(first, end) if self.replay_endpoint else {}
        missing_run = 0
        for seq in range(first, end):
            item = recovered.get(seq)
            if item is None:
                missing_run += 1
                self.stats.missing += 1
                continue
            topic, payload = item
            self._deliver(topic, seq, payload, replayed=True, missing_before=missing_run)
            missing_run = 0
        if missing_run:
            log.warning("KV events %d..%d lost and not replayable", end - missing_run,
                        end - 1)
        return missing_run

    def _request_replay(self, first: int, end: int) -> dict[int, tuple[bytes, bytes]]:
        self.stats.replay_requests += 1
        if self._replay_sock is None:
            self._replay_sock = self._ctx.socket(zmq.DEALER)
            self._replay_sock.setsockopt(zmq.LINGER, 0)
            self._replay_sock.connect(self.replay_endpoint)
        sock = self._replay_sock
        sock.send_multipart((b"", seq_to_bytes(first)))
        got: dict[int, tuple[bytes, bytes]] = {}
        deadline = time.monotonic() + self._replay_timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or self._stop.is_set():
                # No end marker: drop the socket so late answers cannot mix with the next ask.
                self._note_error(f"replay of {first}..{end - 1} timed out")
                sock.close(linger=0)
                self._replay_sock = None
                return got
            if not sock.poll(min(int(remaining * 1000) + 1, _POLL_MS)):
                continue
            frames = sock.recv_multipart()
            if len(frames) != 4:
                continue
            _, topic, seq_frame, payload = frames
            if seq_frame == END_SEQ:
                return got
            seq = seq_from_bytes(seq_frame)
            if first <= seq < end:
                got[seq] = (topic, payload)

    def _deliver(self, topic: bytes, seq: int, payload: bytes, *, replayed: bool,
                 missing_before: int = 0, restarted: bool = False) -> None:
        self._next_seq = seq + 1
        try:
            batch = decode_event_batch(payload, where=f"KV event batch seq {seq}",
                                       skip_unknown=self._skip_unknown)
        except InputError as exc:
            self.stats.decode_errors += 1
            if self._on_error is not None:
                self._call(self._on_error, exc, seq, payload)
            else:
                self._note_error(str(exc))
            return
        self.stats.received += 1
        if replayed:
            self.stats.replayed += 1
        item = ReceivedBatch(seq, topic, batch, payload, replayed, missing_before, restarted)
        if self._on_batch is not None:
            self._call(self._on_batch, item)
            return
        while not self._stop.is_set():  # back-pressure: block rather than drop
            try:
                self._queue.put(item, timeout=_POLL_MS / 1000)
                return
            except queue.Full:
                continue

    def _call(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception as exc:  # a consumer bug must not kill the stream
            self.stats.callback_errors += 1
            log.exception("KV event callback failed: %s", exc)
            self._note_error(f"callback failed: {exc!r}")

    def _note_error(self, message: str) -> None:
        log.warning("%s", message)
        self.stats.errors.append(message)
        del self.stats.errors[:-20]

    def _close_sockets(self) -> None:
        self._sub.close(linger=0)
        if self._replay_sock is not None:
            self._replay_sock.close(linger=0)
            self._replay_sock = None


def asyncio_queue_callback(loop: Any, target: Any) -> Callable[[ReceivedBatch], None]:
    """An ``on_batch`` that puts each batch on an ``asyncio.Queue`` owned by ``loop``."""
    def deliver(item: ReceivedBatch) -> None:
        loop.call_soon_threadsafe(target.put_nowait, item)
    return deliver


__all__ = ["END_SEQ", "KVEventPublisher", "KVEventSubscriber", "ReceivedBatch",
           "SubscriberStats", "asyncio_queue_callback", "is_bind_endpoint", "seq_from_bytes",
           "seq_to_bytes"]
