"""KV events over real ZMQ tcp sockets on 127.0.0.1: sequence numbers, gaps, replay, vLLM frames.

Every socket binds port 0 (the kernel picks a free port). PUB/SUB has a "slow joiner" window:
messages published before the subscription reaches the publisher are dropped. ``connected``
publishes warm-up batches until one arrives; gap replay delivers any dropped earlier ones, so
the stream is complete and in order before a test starts.
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import pytest
import zmq

from prefixroute.core.errors import ConfigError
from prefixroute.core.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_event_batch,
)
from prefixroute.edges.kvevents.zmq import (
    END_SEQ,
    KVEventPublisher,
    KVEventSubscriber,
    asyncio_queue_callback,
)

LOCAL = "tcp://127.0.0.1:0"
FRAMES = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "vllm_0.32"
                     / "frames.json").read_text())["frames"]
TIMEOUT = 5.0


def batch(n: int) -> EventBatch:
    return EventBatch(float(n), (BlockStored((n,), None, (n, n + 1), 2, medium="GPU"),), 0)


def connected(pub: KVEventPublisher, sub: KVEventSubscriber) -> list:
    """Publish warm-up batches until the subscriber sees one; return everything delivered."""
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        seq = pub.publish(EventBatch(0.0, (), 0))
        got = []
        item = sub.get(timeout=0.05)
        while item is not None:
            got.append(item)
            if item.seq == seq:
                return got
            item = sub.get(timeout=0.2)
    raise AssertionError("subscriber never connected")


@pytest.fixture
def pub():
    publisher = KVEventPublisher(LOCAL, bind=True, replay_endpoint=LOCAL, topic="kv")
    yield publisher
    publisher.close()


@pytest.fixture
def sub(pub):
    subscriber = KVEventSubscriber(pub.endpoint, topic="kv",
                                   replay_endpoint=pub.replay_endpoint).start()
    connected(pub, subscriber)
    yield subscriber
    subscriber.stop()


def receive(sub: KVEventSubscriber, n: int) -> list:
    items = [sub.get(timeout=TIMEOUT) for _ in range(n)]
    assert None not in items, f"only {items.index(None)} of {n} batches arrived"
    return items


def test_batches_arrive_in_order_with_consecutive_sequence_numbers(pub, sub):
    first = pub.publish(batch(1))
    pub.publish(batch(2))
    pub.publish(batch(3))
    items = receive(sub, 3)
    assert [i.seq for i in items] == [first, first + 1, first + 2]
    assert [i.batch for i in items] == [batch(1), batch(2), batch(3)]
    assert all(i.topic == b"kv" and not i.replayed for i in items)


def test_a_dropped_sequence_is_fetched_from_the_replay_socket(pub, sub):
    requests_before = sub.stats.replay_requests
    first = pub.publish(batch(1))
    pub.publish(batch(2), live=False)  # lost on the live stream, kept for replay
    pub.publish(batch(3))
    items = receive(sub, 3)
    assert [(i.seq, i.replayed) for i in items] == [(first, False), (first + 1, True),
                                                   (first + 2, False)]
    assert items[1].batch == batch(2)
    assert all(i.missing_before == 0 for i in items)
    assert sub.stats.replay_requests == requests_before + 1
    assert sub.stats.missing == 0


def test_a_gap_older_than_the_replay_buffer_is_reported_as_missing():
    with KVEventPublisher(LOCAL, bind=True, replay_endpoint=LOCAL, topic="kv",
                          buffer_batches=1) as pub:
        with KVEventSubscriber(pub.endpoint, topic="kv",
                               replay_endpoint=pub.replay_endpoint) as sub:
            connected(pub, sub)  # a dropped warm-up may already count as missing here
            missing_before = sub.stats.missing
            pub.publish(batch(1), live=False)
            pub.publish(batch(2), live=False)
            seq = pub.publish(batch(3))
            (item,) = receive(sub, 1)
            assert (item.seq, item.missing_before) == (seq, 2)
            assert sub.stats.missing == missing_before + 2


def test_without_a_replay_endpoint_a_gap_is_reported_as_missing():
    with KVEventPublisher(LOCAL, bind=True, topic="kv") as pub:
        with KVEventSubscriber(pub.endpoint, topic="kv") as sub:
            connected(pub, sub)
            requests_before = sub.stats.replay_requests
            pub.publish(batch(1), live=False)
            seq = pub.publish(batch(2))
            (item,) = receive(sub, 1)
            assert (item.seq, item.missing_before, item.replayed) == (seq, 1, False)
            assert sub.stats.replay_requests == requests_before == 0


def test_subscriber_binds_and_publisher_connects_like_vllm_with_a_concrete_address():
    with KVEventSubscriber(LOCAL, bind=True, topic="kv") as sub:
        with KVEventPublisher(sub.endpoint, topic="kv") as pub:  # concrete address: connect
            connected(pub, sub)
            seq = pub.publish(batch(7))
            (item,) = receive(sub, 1)
            assert (item.seq, item.batch) == (seq, batch(7))


def test_topic_filter_drops_other_topics():
    with KVEventSubscriber(LOCAL, bind=True, topic="kv") as sub:
        with KVEventPublisher(sub.endpoint, topic="other") as other:
            for n in range(20):
                other.publish(batch(n))
                time.sleep(0.01)
            assert sub.get(timeout=0.5) is None
            assert sub.stats.received == 0


def test_a_sequence_that_goes_back_is_flagged_as_a_publisher_restart():
    with KVEventSubscriber(LOCAL, bind=True, topic="kv") as sub:
        with KVEventPublisher(sub.endpoint, topic="kv", first_seq=0) as first:
            connected(first, sub)
            for n in range(10):
                first.publish(batch(n))
            receive(sub, 10)
        with KVEventPublisher(sub.endpoint, topic="kv", first_seq=0) as second:
            items = connected(second, sub)
            assert items[0].restarted and items[0].seq < 10
            assert sub.stats.restarts == 1


def test_a_malformed_payload_is_counted_and_the_stream_goes_on(pub):
    errors = []
    with KVEventSubscriber(pub.endpoint, topic="kv", replay_endpoint=pub.replay_endpoint,
                           on_error=lambda exc, seq, payload: errors.append(seq)) as sub:
        connected(pub, sub)
        bad = pub.publish_payload(b"\xc1 not msgpack")
        good = pub.publish(batch(4))
        (item,) = receive(sub, 1)
        assert item.seq == good
        assert errors == [bad]
        assert sub.stats.decode_errors == 1


def test_replay_protocol_matches_vllm():
    """ROUTER answers [b"", start_seq] with [b"", topic, seq, payload]... then the end marker."""
    with KVEventPublisher(LOCAL, bind=True, replay_endpoint=LOCAL, topic="kv") as pub:
        for n in range(3):
            pub.publish(batch(n), live=False)
        assert pub.flush()
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(pub.replay_endpoint)
            dealer.send_multipart([b"", (1).to_bytes(8, "big")])
            frames = []
            while True:
                assert dealer.poll(TIMEOUT * 1000)
                frames.append(dealer.recv_multipart())
                if frames[-1][2] == END_SEQ:
                    break
        finally:
            dealer.close()
        assert [f[:3] for f in frames[:-1]] == [[b"", b"kv", (1).to_bytes(8, "big")],
                                                [b"", b"kv", (2).to_bytes(8, "big")]]
        assert decode_event_batch(frames[0][3]) == batch(1)
        assert frames[-1] == [b"", b"", b"\xff" * 8, b""]


def test_recorded_vllm_frames_replayed_through_the_publisher_decode_identically(pub, sub):
    payloads = [base64.b64decode(f["payload_b64"]) for f in FRAMES]
    seqs = [pub.publish_payload(p) for p in payloads]
    items = receive(sub, len(payloads))
    assert [i.seq for i in items] == seqs
    assert [i.payload for i in items] == payloads
    assert [i.batch for i in items] == [decode_event_batch(p) for p in payloads]
    kinds = {type(e) for i in items for e in i.batch.events}
    assert kinds == {BlockStored, BlockRemoved, AllBlocksCleared}


def test_asyncio_consumer_receives_batches_on_its_loop(pub):
    async def consume():
        queue: asyncio.Queue = asyncio.Queue()
        callback = asyncio_queue_callback(asyncio.get_running_loop(), queue)
        with KVEventSubscriber(pub.endpoint, topic="kv", replay_endpoint=pub.replay_endpoint,
                               on_batch=callback):
            seen = []
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline:
                seq = pub.publish(batch(9))
                try:
                    item = await asyncio.wait_for(queue.get(), 0.2)
                except asyncio.TimeoutError:
                    continue
                seen.append(item)
                while item.seq != seq:
                    item = await asyncio.wait_for(queue.get(), TIMEOUT)
                    seen.append(item)
                return seen
        return []

    seen = asyncio.run(consume())
    assert seen and [i.seq for i in seen] == list(range(seen[0].seq, seen[-1].seq + 1))
    assert seen[-1].batch == batch(9)


def test_stop_ends_iteration_and_is_idempotent(pub):
    sub = KVEventSubscriber(pub.endpoint, topic="kv").start()
    sub.stop()
    sub.stop()
    assert not sub.running
    assert list(sub) == []


def test_an_endpoint_in_use_is_a_config_error():
    with KVEventSubscriber(LOCAL, bind=True, topic="kv") as sub:
        with pytest.raises(ConfigError, match="cannot bind"):
            KVEventSubscriber(sub.endpoint, bind=True)
        with pytest.raises(ConfigError, match="cannot bind"):
            KVEventPublisher(sub.endpoint, bind=True)
        with pytest.raises(ConfigError, match="wildcard port"):
            KVEventPublisher(LOCAL, bind=False)
