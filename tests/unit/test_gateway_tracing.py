"""OpenTelemetry spans of a request through the gateway (the SDK's in-memory exporter; fake
replicas behind ``httpx.MockTransport`` that record the ``traceparent`` they receive)."""

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is not installed")

from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter)

from prefixroute.core.clock import ManualClock  # noqa: E402
from prefixroute.edges.gateway.app import Gateway  # noqa: E402
from tests.unit.test_gateway_app import Harness, make_config, run  # noqa: E402

ALICE = {"authorization": "Bearer key-alice"}
CALLER_TRACE = "0af7651916cd43dd8448eb211c80319c"
CALLER_PARENT = f"00-{CALLER_TRACE}-b7ad6b7169203331-01"


class TracedHarness(Harness):
    def __init__(self, config):
        super().__init__(config)
        self.exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.exporter))
        self.traceparents = []
        replicas = self.replicas

        async def route(request):
            if request.method == "POST":
                self.traceparents.append(request.headers.get("traceparent"))
            return await replicas[request.url.host].handle(request)

        self.gateway = Gateway(config, transport=httpx.MockTransport(route),
                               clock=ManualClock(), tracer_provider=provider)
        self.http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.gateway.app),
                                      base_url="http://gateway")

    def spans(self):
        return {span.name: span for span in self.exporter.get_finished_spans()}


def test_a_request_is_one_trace_continuing_the_callers_and_reaching_the_replica(monkeypatch):
    async def scenario():
        async with TracedHarness(make_config(monkeypatch)) as h:
            response = await h.http.post(
                "/v1/completions", headers={**ALICE, "traceparent": CALLER_PARENT},
                json={"model": "tiny", "prompt": "hello traced world", "stream": True,
                      "max_tokens": 2})
            assert response.status_code == 200
            spans = h.spans()
            assert set(spans) == {"gateway.request", "auth", "prompt.prepare", "route",
                                  "upstream", "first_token"}
            root = spans["gateway.request"]
            assert format(root.context.trace_id, "032x") == CALLER_TRACE
            assert format(root.parent.span_id, "016x") == "b7ad6b7169203331"
            for name in ("auth", "prompt.prepare", "route", "upstream"):
                assert spans[name].parent.span_id == root.context.span_id, name
            assert spans["first_token"].parent.span_id == spans["upstream"].context.span_id
            route = spans["route"].attributes
            decision = h.gateway.router.decisions[-1]
            assert route["prefixroute.replica"] == decision.replica
            assert route["prefixroute.branch"] == decision.branch
            assert route["prefixroute.predicted_cached_tokens"] == 0  # a cold fleet
            assert spans["upstream"].attributes["prefixroute.outcome"] == "ok"
            assert spans["upstream"].attributes["prefixroute.reported_cached_tokens"] == 0
            assert spans["prompt.prepare"].attributes["prefixroute.prompt_tokens"] > 0
            assert root.attributes["http.response.status_code"] == "200"
            assert root.attributes["prefixroute.tenant"] == "alice"
            upstream = spans["upstream"].context
            assert h.traceparents == [
                f"00-{CALLER_TRACE}-{upstream.span_id:016x}-01"]  # names the upstream span
    run(scenario())


def test_a_retried_request_has_one_upstream_span_per_attempt(monkeypatch):
    async def scenario():
        async with TracedHarness(make_config(monkeypatch)) as h:
            h.r("r0").fault = "500"
            for i in range(4):
                response = await h.http.post("/v1/completions", headers=ALICE,
                                             json={"model": "tiny", "prompt": f"p{i} " * 9})
                assert response.status_code == 200
            upstream = [s for s in h.exporter.get_finished_spans() if s.name == "upstream"]
            outcomes = [s.attributes["prefixroute.outcome"] for s in upstream]
            assert outcomes.count("ok") == 4 and "failed:http_500" in outcomes
            assert all(s.attributes["prefixroute.replica"] == "r0"
                       for s in upstream if s.attributes["prefixroute.outcome"] != "ok")
            # Each attempt sent its own span id; every traceparent names a distinct span.
            assert len(h.traceparents) == len(upstream)
            assert {p.split("-")[2] for p in h.traceparents} == \
                {format(s.context.span_id, "016x") for s in upstream}
    run(scenario())


def test_tracing_config_is_validated(monkeypatch):
    from prefixroute.core.errors import InputError

    config = make_config(monkeypatch, tracing={"endpoint": "http://127.0.0.1:4318/v1/traces"})
    assert config.tracing.protocol == "http/protobuf" and config.tracing.sample_ratio == 1.0
    with pytest.raises(InputError) as info:
        make_config(monkeypatch, tracing={"protocol": "carrier-pigeon"})
    assert "tracing.protocol" in str(info.value)
