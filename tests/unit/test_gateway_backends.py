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
    monkeypatch.setenv("PR_BACKEND_TEST_SECRET", "b" * 64)
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


def test_the_kv_size_is_read_only_when_asked_for():
    assert "num_gpu_blocks" not in parse_engine_metrics(METRICS, cache_config=False)
    assert parse_engine_metrics(METRICS, cache_config=False)["vllm:num_requests_waiting"] == 4.0


def test_a_page_the_parser_refuses_is_ignored_whole():
    # A truncated page must not half-update the gauges: the second line has no closing brace.
    broken = 'vllm:num_requests_waiting 3.0\nvllm:num_requests_running{engine="0 2.0\n'
    assert parse_engine_metrics(broken) == {}


def test_label_values_with_braces_and_quotes_do_not_hide_the_kv_size():
    text = ('vllm:cache_config_info{note="x} 5",model="a \\"b\\"",num_gpu_blocks="801"} 1.0\n'
            'vllm:num_requests_waiting{model_name="a} b"} 2.0\n')
    assert parse_engine_metrics(text) == {"num_gpu_blocks": 801.0,
                                          "vllm:num_requests_waiting": 2.0}


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
    first = backend.dispatch(100)
    backend.dispatch(50)
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


def test_character_block_units_scale_the_kv_size_and_speed_the_policy_sees(monkeypatch):
    # Text at 6 characters per token: 1.5 estimated tokens (characters / 4) per real one, so
    # 800 engine blocks hold 1,200 character blocks and a real token's 30 us is 20 us per
    # estimated token.
    backend = make_backend(monkeypatch, ManualClock(), prefill_s_per_token=3e-5)
    asyncio.run(backend.scrape_metrics(client_answering(METRICS), 1.0))
    assert backend.view.capacity_blocks == 800
    backend.observe_units(15_453, 10_302)
    assert backend.units_per_token == 1.5
    assert backend.status()["chars_units_per_token"] == 1.5
    assert backend.view.capacity_blocks == 1200
    view = backend.replica_view()
    assert view.capacity_blocks == 1201  # num_gpu_blocks 801, as the policy is told
    assert abs(view.prefill_s_per_token - 2e-5) < 1e-12
    # A small drift of the running average is not applied: the policy restarts its learned
    # capacity whenever the size it is shown changes.
    backend.observe_units(1_520, 1_000)
    assert backend.units_per_token == 1.5
    # One answer at 3 characters per token moves the average by a tenth of the way to 0.75:
    # 1.427, under a 5% move, still within the step; a second one passes it.
    backend.observe_units(750, 1_000)
    backend.observe_units(750, 1_000)
    assert backend.units_per_token < 1.5
    assert backend.view.capacity_blocks == int(800 * backend.units_per_token)


def test_a_shrunk_approximate_view_forgets_the_least_recently_routed_blocks():
    from prefixroute.core.routing.views import ApproximateView
    view = ApproximateView(4)
    view.record(["a", "b", "c", "d"])  # recorded tail first: d is the least recent
    view.resize(2)
    assert (len(view), view.match(["a", "b"]), view.match(["c"])) == (2, 2, 0)
    view.resize(3)
    view.record(["e"])
    assert view.match(["a", "b"]) == 2


def test_a_prompt_longer_than_the_replica_is_not_recorded():
    # The replica rejects it and caches nothing; recorded, its 5 blocks would push every
    # block out of a 4-block view.
    from prefixroute.core.routing.views import ApproximateView
    view = ApproximateView(4)
    view.record(["a", "b"])
    view.record(["h1", "h2", "h3", "h4", "h5"])
    assert (len(view), view.match(["a", "b"]), view.match(["h1"])) == (2, 2, 0)
    view.record(["c", "d", "e", "f"])  # exactly the capacity is a prompt that fits
    assert (view.match(["c", "d", "e", "f"]), view.match(["a"])) == (4, 0)


def test_a_character_block_answer_reaches_the_policy_in_estimated_tokens(monkeypatch):
    from prefixroute.core.routing.base import Decision
    from prefixroute.edges.gateway.prompts import CHARS, PreparedPrompt
    from prefixroute.edges.gateway.router import GatewayRouter

    class Recorder:
        name = "recorder"

        def __init__(self):
            self.completed = []

        def route(self, request, replicas):
            return Decision(replicas[0].index, "only")

        def on_routed(self, request, decision):
            pass

        def on_completed(self, request, replica, cached_tokens):
            self.completed.append(cached_tokens)

    backend = make_backend(monkeypatch, ManualClock())
    policy = Recorder()
    router = GatewayRouter(policy, [backend], GatewayMetrics(), ManualClock())
    # 6,000 characters: 1,500 estimated tokens in 93 blocks of 16; the engine counts 1,000.
    prompt = PreparedPrompt(1_500, tuple(range(93)), None, CHARS)
    attempt = router.route(request_id="a", tenant="t", model="tiny", prompt=prompt,
                           block_size=16, candidates=[backend], attempt=0)
    router.succeeded(attempt, {"prompt_tokens": 1_000,
                               "prompt_tokens_details": {"cached_tokens": 960}})
    # (960 + 16) x 1.5 = 1,464 estimated tokens, not the 960 real ones.
    assert policy.completed == [1_464]
    assert attempt.record.reported_cached_tokens == 960  # /debug/decisions: the engine's
    assert backend.units_per_token == 1.5


def test_configured_models_the_replica_does_not_list_are_reported(monkeypatch, caplog):
    # The replica was started without --served-model-name: it serves "emulated", the config
    # says "tiny", and every request for "tiny" would come back 404.
    backend = make_backend(monkeypatch, ManualClock())
    listing = '{"object": "list", "data": [{"id": "emulated", "object": "model"}]}'
    with caplog.at_level("WARNING", logger="prefixroute.gateway"):
        missing = asyncio.run(backend.check_configured_models(client_answering(listing), 1.0))
    assert missing == ["tiny"]
    assert [r.fields["missing"] for r in caplog.records] == [["tiny"]]
    served = '{"object": "list", "data": [{"id": "tiny", "object": "model"}]}'
    assert asyncio.run(backend.check_configured_models(client_answering(served), 1.0)) == []
    # No usable answer says nothing either way.
    assert asyncio.run(backend.check_configured_models(client_answering("", 500), 1.0)) == []


def test_the_models_check_runs_once_when_the_replica_first_answers(monkeypatch, caplog):
    # A LoRA adapter the gateway serves through this replica is not in its base listing.
    backend = make_backend(monkeypatch, ManualClock(), adapters={"sql": "/lora/sql"},
                           models=["tiny", "sql"])
    listing = client_answering('{"data": [{"id": "emulated"}]}')
    with caplog.at_level("WARNING", logger="prefixroute.gateway"):
        asyncio.run(backend.check_health(client_answering("", 503), 1.0))  # not up yet
        asyncio.run(backend.check_health(listing, 1.0))
        asyncio.run(backend.check_health(listing, 1.0))
    assert [r.fields["missing"] for r in caplog.records
            if getattr(r, "fields", {}).get("event") == "models_missing"] == [["tiny"]]
