"""The driver times the engine on the asyncio loop; config and metrics pieces."""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.identity import CacheIdentity
from prefixroute.core.replica.service_time import INSTANT, ServiceTimeModel
from prefixroute.edges.emulator.config import (
    EmulatorConfig,
    resolve_max_model_len,
    resolve_num_blocks,
)
from prefixroute.edges.emulator.driver import EngineDriver
from prefixroute.edges.emulator.metrics import EmulatorMetrics, request_tokens_buckets
from prefixroute.edges.emulator.protocol import APIError
from prefixroute.edges.emulator.replica import EmulatedReplica, SequenceMeta

META = SequenceMeta(CacheIdentity())
SLACK_S = 0.2  # wall-clock lateness allowed: a shared CI core can stall an event loop, but a
# driver that slept three steps for one would still be caught
SLOW = ServiceTimeModel("slow", step_overhead_s=0.05, prefill_s_per_token=0.0,
                        attention_s_per_token_context=0.0, decode_s_per_seq=0.0,
                        decode_s_per_context_token=0.0)


def make_driver(service, published=None):
    replica = EmulatedReplica(num_blocks=64, block_size=16, service=service,
                              record_events=published is not None)
    metrics = EmulatorMetrics(replica.engine, "m", 1008)
    publish = published.append if published is not None else None
    return EngineDriver(replica, metrics, publish=publish)


def test_an_instant_engine_answers_within_the_submit_call():
    async def scenario():
        driver = make_driver(INSTANT)
        seq = driver.submit(list(range(40)), [5, 5, 5], META)
        assert seq.done.done() and seq.cached_tokens == 0
        again = driver.submit(list(range(40)), [5, 5, 5], META)
        assert again.done.result() == 32

    asyncio.run(scenario())


def test_a_timed_engine_resolves_when_its_steps_end():
    # 3 steps of 50 ms: the prefill (first token), then two decode steps.
    async def scenario():
        driver = make_driver(SLOW)
        start = time.perf_counter()
        seq = driver.submit(list(range(20)), [1, 2, 3], META)
        await seq.first
        first = time.perf_counter() - start
        await seq.done
        done = time.perf_counter() - start
        return first, done, driver

    first, done, driver = asyncio.run(scenario())
    # The engine's own clock is exact; the wall clock can be late on a loaded machine, by up to
    # SLACK_S, never early.
    assert driver.metrics.ttft.total == pytest.approx(0.05)
    assert driver.engine.busy_s == pytest.approx(0.15)
    assert 0.045 <= first < 0.045 + SLACK_S
    assert 0.145 <= done < 0.145 + SLACK_S


def test_the_request_overhead_delays_the_first_token_not_the_steps():
    # 40 ms outside the engine, then the same three 50 ms steps.
    from dataclasses import replace

    async def scenario():
        driver = make_driver(replace(SLOW, request_overhead_s=0.04))
        start = time.perf_counter()
        seq = driver.submit(list(range(20)), [1, 2, 3], META)
        assert driver.engine.entering == 1 and driver.engine.waiting == 0
        await seq.first
        first = time.perf_counter() - start
        await seq.done
        return first, time.perf_counter() - start, driver

    first, done, driver = asyncio.run(scenario())
    assert 0.085 <= first < 0.085 + SLACK_S
    assert 0.185 <= done < 0.185 + SLACK_S
    assert driver.engine.busy_s == pytest.approx(0.15)
    assert driver.metrics.ttft.total == pytest.approx(0.09)  # TTFT counts it


def test_kv_events_are_published_once_a_step_ends():
    async def scenario():
        published = []
        driver = make_driver(SLOW, published)
        seq = driver.submit(list(range(40)), [1], META)
        assert published == []  # the prefill step has begun, not ended
        await seq.done
        return published

    (batch,) = asyncio.run(scenario())
    assert [len(e.block_hashes) for e in batch.events] == [2]


def test_an_aborted_sequence_leaves_the_engine():
    async def scenario():
        driver = make_driver(SLOW)
        seq = driver.submit(list(range(20)), [1] * 50, META)
        await seq.first
        driver.abort(seq)
        await asyncio.sleep(0.12)
        return driver

    driver = asyncio.run(scenario())
    assert driver.engine.running == 0 and driver.metrics.success["abort"] == 1


def test_abort_all_fails_every_request_and_empties_the_engine():
    async def scenario():
        driver = make_driver(SLOW)
        running = driver.submit(list(range(20)), [1] * 50, META)
        queued = [driver.submit(list(range(100 + i, 140 + i)), [1] * 50, META)
                  for i in range(2)]
        await running.first
        error = APIError("stopping", status=503)
        assert driver.abort_all(error) == 3 and driver.in_flight == 0
        for seq in (running, *queued):
            with pytest.raises(APIError):
                seq.done.result()
        assert driver.abort_all(error) == 0
        await asyncio.sleep(0.12)  # the step in progress ends; nothing is scheduled after it
        return driver

    driver = asyncio.run(scenario())
    assert driver.engine.running == 0 and driver.engine.waiting == 0
    assert driver.metrics.success["abort"] == 3 and driver.engine.next_event_time() is None


def test_a_stream_stops_at_the_first_token_after_a_shutdown_abort():
    from prefixroute.edges.emulator.server import EmulatorServer

    async def scenario():
        server = EmulatorServer(EmulatorConfig(num_blocks=64, time_scale=5))  # 30 ms steps
        seq = server.driver.submit(list(range(20)), [1] * 50, META)
        positions = server._paced(seq)
        assert await positions.__anext__() == 0
        assert server.begin_shutdown() == 1
        with pytest.raises(APIError) as raised:
            await positions.__anext__()  # not the 49 tokens left, all at once
        assert raised.value.status == 503
        with pytest.raises(APIError):  # and nothing new is accepted
            server._submit(object())
        await asyncio.sleep(0.05)
        return server

    server = asyncio.run(scenario())
    assert server.replica.engine.running == 0


def test_capacity_comes_from_blocks_memory_or_the_profile():
    config = EmulatorConfig(block_size=16, num_blocks=65)
    assert resolve_num_blocks(config, INSTANT) == (65, "--num-blocks")
    # tiny: 2 x 2 layers x 2 kv heads x 32 x 2 bytes = 512 B/token; 1 MiB / (512 x 16) = 128.
    config = EmulatorConfig(block_size=16, kv_memory_gib=1 / 1024, model_config="tiny")
    assert resolve_num_blocks(config, INSTANT)[0] == 128
    with pytest.raises(ConfigError, match="needs --model-config"):
        resolve_num_blocks(EmulatorConfig(kv_memory_gib=1.0), INSTANT)


def test_the_context_limit_must_fit_in_the_cache():
    config = EmulatorConfig(block_size=32, max_model_len=2048)
    assert resolve_max_model_len(config, 65) == 2048
    with pytest.raises(ConfigError, match="does not fit"):
        resolve_max_model_len(config, 64)
    assert resolve_max_model_len(EmulatorConfig(block_size=32), 65) == 2048


def test_request_token_buckets_are_vllms_1_2_5_series():
    assert request_tokens_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)


def test_metrics_render_vllm_names():
    replica = EmulatedReplica(num_blocks=8, block_size=16, service=INSTANT)
    metrics = EmulatorMetrics(replica.engine, "m", 100)
    metrics.first_token(0.003)
    metrics.finished(10, 2, 0.004, "length")
    text = metrics.render().decode()
    assert 'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 0.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 1.0' \
        in text
    assert 'vllm:time_to_first_token_seconds_bucket{engine="0",le="0.005",model_name="m"} 1.0' \
        in text


def test_a_priority_replica_serves_the_lowest_priority_first_and_a_fcfs_one_ignores_it():
    # One sequence runs at a time (50 ms steps); b (priority 5) and c (priority 1) wait
    # behind a.
    order = {}
    for scheduling in ("fcfs", "priority"):
        replica = EmulatedReplica(num_blocks=64, block_size=16, service=SLOW,
                                  max_num_seqs=1, scheduling_policy=scheduling)
        events = []
        for name, priority in (("a", 9), ("b", 5), ("c", 1)):
            replica.submit(name, list(range(20)) if name == "a" else [7] * 20, [1], 0.0,
                           SequenceMeta(CacheIdentity(), priority=priority))
        while (t := replica.engine.next_event_time()) is not None:
            events += replica.advance(t)
        order[scheduling] = [e.request_id for e in events if e.kind == "finished"]
    assert order == {"fcfs": ["a", "b", "c"], "priority": ["a", "c", "b"]}
