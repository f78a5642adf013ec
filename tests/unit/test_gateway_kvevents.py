"""KV events into the gateway's cache views: the keys the gateway computes are the ids engines
publish, so a replica announcing a prefix attracts the requests that share it."""

import asyncio
import json
import time

import httpx
import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import CacheIdentity, derive_trust_group_salt
from prefixroute.core.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from prefixroute.edges.gateway.app import Gateway
from prefixroute.core.routing.base import RequestView
from prefixroute.core.routing.views import EVENT_GRACE_S, LiveEventView
from prefixroute.edges.gateway.config import hash_api_key, parse_config
from prefixroute.edges.kvevents.zmq import KVEventPublisher, ReceivedBatch
from prefixroute.edges.listen import free_port

SECRET = "e" * 64
BLOCK = 16


def config(monkeypatch, ports):
    monkeypatch.setenv("PR_KV_TEST_SECRET", SECRET)
    return parse_config({
        "server_secret": {"env": "PR_KV_TEST_SECRET"},
        "backends": [{"name": f"r{i}", "url": f"http://r{i}.test", "models": ["tiny"],
                      "kv_events": {"endpoint": f"tcp://127.0.0.1:{port}", "topic": "kv"}}
                     for i, port in enumerate(ports)],
        "tenants": [{"name": "alice", "api_key_sha256": hash_api_key("key-alice"),
                     "trust_group": "g1"}],
        "hashing": {"block_size": BLOCK},
        "policy": "hybrid:max_skew=100",
        "health": {"interval_s": 60, "metrics_interval_s": 60},
    }, "test.yaml")


def event_keys(token_ids, group="g1"):
    hasher = BlockHasher("vllm", "sha256", BLOCK)
    salt = derive_trust_group_salt(SECRET.encode(), group)
    return [hasher.event_block_hash(d)
            for d in hasher.block_hashes(token_ids, CacheIdentity(cache_salt=salt))]


async def backend(request: httpx.Request) -> httpx.Response:
    if request.url.path in ("/health", "/metrics"):
        return httpx.Response(200, text="")
    body = json.loads(request.content)
    return httpx.Response(200, json={"choices": [{"index": 0, "text": "x"}], "usage": {
        "prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 0}}})


def book(gateway, keys, replica=0):
    """A request with ``keys`` routed to ``replica`` through the gateway's lifecycle runner."""
    request = RequestView("q", len(keys) * BLOCK + 1, BLOCK, block_keys=keys)
    return gateway.router.runner.route(request, [replica])


def received(events, *, restarted=False, missing=0):
    return ReceivedBatch(seq=0, topic=b"kv", batch=EventBatch(0.0, tuple(events)), payload=b"",
                         restarted=restarted, missing_before=missing)


def test_events_feed_the_view_and_removals_and_clears_drain_it(monkeypatch):
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=ManualClock())
    r0 = gateway.pool.backends[0]
    assert isinstance(r0.view, LiveEventView)
    keys = event_keys(list(range(64)))
    r0.apply_events(received([BlockStored(tuple(keys), None, tuple(range(64)), BLOCK)]))
    assert r0.view.match(keys) == 4
    r0.apply_events(received([BlockRemoved((keys[2],))]))
    assert r0.view.match(keys) == 2  # the chain breaks at the removed block
    r0.apply_events(received([AllBlocksCleared()]))
    assert r0.view.match(keys) == 0


def test_an_ended_request_holds_its_blocks_until_the_events_come_or_the_grace_ends(monkeypatch):
    # vLLM publishes a step's events after the step; on a loaded machine the answer can reach
    # the gateway first. The next turn of the conversation must still find the prefix.
    clock = ManualClock()
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=clock)
    r0 = gateway.pool.backends[0]
    keys = event_keys(list(range(64)))
    gateway.router.runner.completed(book(gateway, keys), 0)
    assert r0.view.match(keys) == 4  # no event yet: held on the answer's word
    clock.advance(EVENT_GRACE_S)
    assert r0.view.match(keys) == 4
    clock.advance(0.001)
    assert r0.view.match(keys) == 0  # the events never came: forgotten

    gateway.router.runner.completed(book(gateway, keys), 0)
    r0.apply_events(received([BlockRemoved((keys[1],))]))
    assert r0.view.match(keys) == 1  # the engine evicted block 1: the grace ends for it


def test_digest_bytes_and_offloaded_media_are_read_like_vllm(monkeypatch):
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=ManualClock())
    r0 = gateway.pool.backends[0]
    hasher = BlockHasher("vllm", "sha256", BLOCK)
    digests = hasher.block_hashes(list(range(32)))
    r0.apply_events(received([BlockStored(tuple(digests), None, tuple(range(32)), BLOCK)]))
    assert r0.view.match([hasher.event_block_hash(d) for d in digests]) == 2
    cpu = [7, 8]
    r0.apply_events(received([BlockStored(tuple(cpu), None, tuple(range(32)), BLOCK,
                                          medium="CPU")]))
    assert r0.view.match(cpu) == 0  # only the GPU prefix cache serves hits


def test_a_restarted_engine_starts_with_an_empty_view(monkeypatch):
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=ManualClock())
    r0 = gateway.pool.backends[0]
    r0.apply_events(received([BlockStored((1, 2), None, tuple(range(32)), BLOCK)]))
    r0.apply_events(received([], restarted=True))
    assert r0.view.match([1, 2]) == 0


def test_in_flight_requests_count_as_held_and_failed_ones_leave_nothing(monkeypatch):
    gateway = Gateway(config(monkeypatch, [free_port()]), transport=httpx.MockTransport(backend),
                      clock=ManualClock())
    r0 = gateway.pool.backends[0]
    booking = book(gateway, [5, 6, 7])
    assert r0.view.match([5, 6, 7, 8]) == 3
    gateway.router.runner.ended(booking, ran=False)
    assert r0.view.match([5, 6, 7]) == 0  # refused or failed: never cached, nothing held


def test_a_replica_announcing_a_prefix_over_zmq_attracts_the_request(monkeypatch):
    ports = [free_port(), free_port()]

    async def scenario():
        gateway = Gateway(config(monkeypatch, ports), transport=httpx.MockTransport(backend),
                          clock=ManualClock())
        await gateway.start()
        publisher = KVEventPublisher(f"tcp://127.0.0.1:{ports[1]}", topic="kv", bind=False,
                                     replay_endpoint="tcp://127.0.0.1:0")
        try:
            prompt = list(range(1, 70))
            keys = event_keys(prompt)
            r1 = gateway.pool.backends[1]
            deadline = time.monotonic() + 10
            while r1.view.match(keys) < len(keys):  # PUB/SUB joins late: repeat until seen
                assert time.monotonic() < deadline, "events never reached the gateway"
                publisher.publish(EventBatch(0.0, (BlockStored(tuple(keys), None,
                                                               tuple(prompt[:64]), BLOCK),)))
                await asyncio.sleep(0.05)
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=gateway.app),
                                         base_url="http://gw") as client:
                response = await client.post("/v1/completions", json={
                    "model": "tiny", "prompt": prompt},
                    headers={"authorization": "Bearer key-alice"})
            assert response.status_code == 200
            decision = gateway.router.decisions[-1]
            assert decision.replica == "r1" and decision.branch == "affinity"
            assert decision.predicted_cached_tokens == 64  # 4 blocks; (69 - 1) // 16 * 16
        finally:
            publisher.close()
            await gateway.stop()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_taken_event_port_is_a_start_up_error(monkeypatch):
    from prefixroute.core.errors import ConfigError

    port = free_port()
    first = Gateway(config(monkeypatch, [port]), transport=httpx.MockTransport(backend))
    first.pool.open_event_streams()
    try:
        second = Gateway(config(monkeypatch, [port]), transport=httpx.MockTransport(backend))
        with pytest.raises(ConfigError, match="cannot bind KV events endpoint"):
            second.pool.open_event_streams()
    finally:
        first.pool.close_event_streams()
