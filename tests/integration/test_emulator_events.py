"""KV events from the emulator, read by our own subscriber over real ZMQ sockets, and its
time model seen from a client.

The subscriber binds; the emulator connects to the concrete tcp address (vLLM's rule). Block
hashes are checked against :class:`BlockHasher` (the ``vllm`` profile), the one place every
block key comes from.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored
from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.kvevents.zmq import KVEventSubscriber
from prefixroute.edges.listen import free_port

BLOCK = 16
HASHER = BlockHasher("vllm", "sha256", BLOCK)
REPLY = 9  # replies pinned with allowed_token_ids, so decode blocks are predictable


def ids(seed: int, n: int) -> list[int]:
    return [100 + (seed * 7919 + i * 31) % 3000 for i in range(n)]


def event_ids(tokens, salt=None) -> list[int]:
    keys = HASHER.block_hashes(tokens, CacheIdentity(cache_salt=salt))
    return [HASHER.event_block_hash(k) for k in keys]


def start_emulator(extra=()):
    subscriber = KVEventSubscriber("tcp://127.0.0.1:0", bind=True, topic="kv")
    port = int(subscriber.endpoint.rsplit(":", 1)[1])
    replay = free_port()  # never a bound port such as the subscriber's
    subscriber.replay_endpoint = f"tcp://127.0.0.1:{replay}"
    subscriber.start()
    process = EmulatorProcess(["--block-size", str(BLOCK), "--num-blocks", "17",
                               "--time-scale", "0", "--kv-events", f"tcp://127.0.0.1:{port}",
                               "--kv-events-topic", "kv",
                               "--kv-events-replay", f"tcp://127.0.0.1:{replay}", *extra])
    process.start()
    return process, subscriber


@pytest.fixture(scope="module")
def emulator():
    process, subscriber = start_emulator()
    yield process, subscriber
    process.stop()
    subscriber.stop()


def complete(url, prompt, max_tokens=1, client=None, **extra):
    body = {"prompt": prompt, "max_tokens": max_tokens, "allowed_token_ids": [REPLY], **extra}
    response = (client or httpx).post(url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()


def drain(subscriber, settle=0.5):
    events = []
    while (batch := subscriber.get(timeout=settle)) is not None:
        events.extend(batch.batch.events)
    return events


def test_a_new_prompt_publishes_its_full_blocks(emulator):
    process, subscriber = emulator
    drain(subscriber)
    prompt = ids(1, 40)
    complete(process.url, prompt)
    events = drain(subscriber)
    assert len(events) == 1 and isinstance(events[0], BlockStored)
    stored = events[0]
    assert list(stored.block_hashes) == event_ids(prompt)  # 2 full blocks; 8 tokens left
    assert stored.parent_block_hash is None
    assert stored.token_ids == tuple(prompt[:32])
    assert (stored.block_size, stored.medium, stored.group_idx) == (BLOCK, "GPU", 0)
    assert stored.extra_keys == (None, None)


def test_a_salted_prompt_carries_its_salt_in_the_first_block_extra_keys(emulator):
    process, subscriber = emulator
    drain(subscriber)
    prompt = ids(2, 33)
    complete(process.url, prompt, cache_salt="tenant-a")
    (stored,) = drain(subscriber)
    assert list(stored.block_hashes) == event_ids(prompt, "tenant-a")
    assert stored.extra_keys == (("tenant-a",), None)


def test_decode_blocks_are_published_as_they_fill(emulator):
    process, subscriber = emulator
    drain(subscriber)
    prompt = ids(3, 20)
    complete(process.url, prompt, max_tokens=30)
    events = drain(subscriber)
    # 20 + 30 - 1 = 49 tokens get KV: blocks 0..2 full; block 0 at prefill, 1 and 2 in decode.
    hashes = [h for e in events for h in e.block_hashes]
    assert hashes == event_ids(prompt + [REPLY] * 30)[:3]
    assert [len(e.block_hashes) for e in events] == [1, 1, 1]


def test_eviction_publishes_block_removed_tail_first(emulator):
    process, subscriber = emulator
    assert httpx.post(process.url + "/reset_prefix_cache").json()["success"]
    old = ids(4, 64)  # 4 blocks
    complete(process.url, old)
    drain(subscriber)
    # 16 usable blocks: 12 are free (never cached), so a 14-block prompt evicts 2 of old's.
    complete(process.url, ids(5, 14 * 16))
    events = drain(subscriber)
    removed = [e.block_hashes[0] for e in events if isinstance(e, BlockRemoved)]
    old_ids = event_ids(old)
    assert removed == [old_ids[3], old_ids[2]]


def test_a_reset_is_announced_with_the_next_step(emulator):
    process, subscriber = emulator
    complete(process.url, ids(6, 20))
    drain(subscriber)
    assert httpx.post(process.url + "/reset_prefix_cache").json()["success"]
    assert drain(subscriber) == []  # vLLM publishes it with its next engine step
    complete(process.url, ids(7, 20))
    events = drain(subscriber)
    assert isinstance(events[0], AllBlocksCleared)


def test_missed_batches_can_be_replayed(emulator):
    process, subscriber = emulator
    drain(subscriber)
    complete(process.url, ids(8, 17))
    (batch_event,) = drain(subscriber)
    import zmq

    from prefixroute.edges.kvevents.zmq import END_SEQ, seq_to_bytes

    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(subscriber.replay_endpoint)
    try:
        socket.send_multipart((b"", seq_to_bytes(0)))
        frames = []
        while True:
            assert socket.poll(5000), "no replay answer"
            _, topic, seq, payload = socket.recv_multipart()
            if seq == END_SEQ:
                break
            frames.append(int.from_bytes(seq, "big"))
    finally:
        socket.close()
    assert frames == list(range(len(frames))) and len(frames) >= 5


def test_legacy_format_sends_positional_arrays():
    import msgpack

    process, subscriber = start_emulator(["--kv-events-format", "legacy"])
    try:
        prompt = ids(9, 16 * 2 + 1)
        complete(process.url, prompt)
        batch = subscriber.get(timeout=5)
        assert batch is not None
        raw = msgpack.unpackb(batch.payload)
        assert raw[1][0][0] == "BlockStored"  # an array, not a map
        assert list(batch.batch.events[0].block_hashes) == event_ids(prompt)
    finally:
        process.stop()
        subscriber.stop()


def test_ttft_grows_with_uncached_prompt_tokens(tmp_path):
    # A slow engine: 20 ms per step, 0.2 ms per prompt token. 1,000 uncached tokens cost
    # 0.22 s; the cached repeat (992 tokens hit) recomputes 8 and costs about 0.02 s.
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"base": "instant", "name": "slow",
                                   "step_overhead_s": 0.02, "prefill_s_per_token": 2e-4,
                                   "decode_s_per_seq": 1e-3}))
    with EmulatorProcess(["--block-size", str(BLOCK), "--num-blocks", "200",
                          "--profile", str(profile)]) as process:
        prompt = ids(10, 1000)

        client = httpx.Client()  # made outside the timing: only the requests are timed

        def timed():
            start = time.perf_counter()
            data = complete(process.url, prompt, client=client)
            return time.perf_counter() - start, data["usage"]["prompt_tokens_details"]

        with client:
            cold, cold_usage = timed()
            warm, warm_usage = timed()
    assert cold_usage["cached_tokens"] == 0 and warm_usage["cached_tokens"] == 992
    assert cold >= 0.22 and warm < 0.15


def test_a_client_that_leaves_a_stream_frees_its_sequence(tmp_path):
    profile = tmp_path / "steps.json"
    profile.write_text(json.dumps({"base": "instant", "name": "steps",
                                   "step_overhead_s": 0.02}))
    with EmulatorProcess(["--block-size", str(BLOCK), "--num-blocks", "64",
                          "--profile", str(profile)]) as process:
        body = {"prompt": ids(11, 40), "max_tokens": 500, "stream": True}  # 10 s of decode
        with httpx.stream("POST", process.url + "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.monotonic() + 5
        while True:
            text = httpx.get(process.url + "/metrics").text
            if "vllm:num_requests_running{engine=\"0\",model_name=\"emulated\"} 0.0" in text:
                break
            assert time.monotonic() < deadline, "the abandoned sequence is still running"
            time.sleep(0.1)
        assert 'finished_reason="abort",model_name="emulated"} 1.0' in text
