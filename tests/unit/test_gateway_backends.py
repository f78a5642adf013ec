"""One backend's state: engine gauges, pending prefill, health, the approximate view's size."""

import asyncio

import httpx

from prefixroute.core.clock import ManualClock
from prefixroute.edges.gateway.backends import Backend, parse_engine_metrics
from prefixroute.edges.gateway.config import hash_api_key, parse_config
from prefixroute.edges.gateway.metrics import GatewayMetrics

METRICS = """\
# HELP vllm:num_requests_waiting Number of requests waiting.
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:num_requests_running{engine="0",model_name="tiny"} 2.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.5
vllm:cache_config_info{block_size="32",num_gpu_blocks="801",engine="0"} 1.0
vllm:prefix_cache_hits_total{engine="0"} 99.0
vllm:num_requests_running 1.0 1700000000000
"""


def make_backend(monkeypatch, clock, **backend):
    monkeypatch.setenv("PR_BACKEND_TEST_SECRET", "b" * 32)
    config = parse_config({
        "server_secret": {"env": "PR_BACKEND_TEST_SECRET"},
        "backends": [{"url": "http://r0.test", "models": ["tiny"], **backend}],
        "tenants": [{"name": "t", "api_key_sha256": hash_api_key("k")}],
    }, "test.yaml")
    return Backend(0, config.backends[0], config, clock, GatewayMetrics())


def client_answering(text, status=200):
    return httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: httpx.Response(status, text=text)))


def test_engine_gauges_are_summed_over_engines():
    values = parse_engine_metrics(METRICS)
    assert values == {"vllm:num_requests_waiting": 4.0, "vllm:num_requests_running": 3.0,
                      "vllm:kv_cache_usage_perc": 0.5, "num_gpu_blocks": 801.0}


def test_scrape_fills_load_and_sizes_the_approximate_view(monkeypatch):
    backend = make_backend(monkeypatch, ManualClock())
    asyncio.run(backend.scrape_metrics(client_answering(METRICS), 1.0))
    view = backend.replica_view()
    assert (view.queued, view.running, view.kv_usage) == (4, 3, 0.5)
    assert backend.view.capacity_blocks == 800  # block 0 is vLLM's null block
    assert view.load == 7  # waiting + running beats an in-flight count of 0


def test_configured_capacity_wins_over_the_engines(monkeypatch):
    backend = make_backend(monkeypatch, ManualClock(), capacity_blocks=100)
    asyncio.run(backend.scrape_metrics(client_answering(METRICS), 1.0))
    assert backend.view.capacity_blocks == 100


def test_pending_prefill_ends_at_first_byte_or_when_nothing_waits(monkeypatch):
    clock = ManualClock()
    backend = make_backend(monkeypatch, clock)
    clock.advance(0.1)
    first = backend.dispatch([1], 100)
    backend.dispatch([2], 50)
    assert backend.pending_prefill_tokens == 150
    backend.prefill_done(first)
    assert backend.pending_prefill_tokens == 50
    idle = "vllm:num_requests_waiting 0\n"
    asyncio.run(backend.scrape_metrics(client_answering(idle), 1.0))
    assert backend.pending_prefill_tokens == 50  # sent after the previous scrape: too recent
    clock.advance(1.0)
    asyncio.run(backend.scrape_metrics(client_answering(idle), 1.0))
    assert backend.pending_prefill_tokens == 0


def test_health_needs_consecutive_failures_and_one_success(monkeypatch):
    backend = make_backend(monkeypatch, ManualClock())
    down = client_answering("", status=503)
    asyncio.run(backend.check_health(down, 1.0))
    assert backend.healthy  # one failure can be a hiccup
    asyncio.run(backend.check_health(down, 1.0))
    assert not backend.healthy and "503" in backend.last_health_error
    asyncio.run(backend.check_health(client_answering(""), 1.0))
    assert backend.healthy
