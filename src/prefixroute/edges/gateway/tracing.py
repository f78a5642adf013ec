"""OpenTelemetry tracing of the gateway's requests (optional: ``pip install
prefixroute[tracing]``).

One trace per request, continuing the caller's W3C ``traceparent`` if it sent one:

=====================  =====================================================================
span                   what it covers, and its attributes
=====================  =====================================================================
``gateway.request``    arrival to the last byte (SERVER): ``prefixroute.tenant``,
                       ``http.response.status_code``, ``prefixroute.model``
``auth``               finding the tenant by its key (and the rate limit)
``prompt.prepare``     tokenizing and hashing the prompt: ``prefixroute.prompt_tokens``,
                       ``prefixroute.tokenization``
``route``              the routing decision, one per attempt: ``prefixroute.replica``,
                       ``prefixroute.branch``, ``prefixroute.predicted_cached_tokens``,
                       ``prefixroute.policy``, ``prefixroute.attempt``
``upstream``           the request to the replica (CLIENT), sent with a ``traceparent``
                       naming this span, so an engine that traces (vLLM
                       ``--otlp-traces-endpoint``) continues the trace: its outcome, and
                       ``prefixroute.reported_cached_tokens`` when the replica said
``first_token``        from sending to the replica's first byte (a stream's first event):
                       the time to first token the replica added
=====================  =====================================================================

Spans go to an OTLP collector through a batch processor, off the request path. Without a
``tracing`` section nothing of this runs (the gateway holds ``None``).
"""

from __future__ import annotations

from typing import Any, Mapping

from prefixroute.core.errors import ConfigError
from prefixroute.edges.gateway.config import TracingConfig

try:
    from opentelemetry import trace
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBasedTraceIdRatio
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # pragma: no cover - the optional extra is missing
    trace = None  # type: ignore[assignment]

_PROPAGATOR = TraceContextTextMapPropagator() if trace is not None else None


class TracingUnavailable(ConfigError):
    """The config asks for tracing but the ``tracing`` extra is not installed."""


def provider_from_config(config: TracingConfig) -> Any:
    """A tracer provider exporting to the configured OTLP endpoint."""
    if trace is None:
        raise TracingUnavailable("tracing is configured but OpenTelemetry is not installed: "
                                 "pip install 'prefixroute[tracing]'")
    if config.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    exporter = OTLPSpanExporter(endpoint=config.endpoint) if config.endpoint \
        else OTLPSpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": config.service_name}),
                              sampler=ParentBasedTraceIdRatio(config.sample_ratio))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class GatewayTracing:
    """The spans of the gateway's requests (module docstring), from ``provider`` (an
    OpenTelemetry ``TracerProvider``; tests give one with an in-memory exporter)."""

    def __init__(self, provider: Any):
        self.provider = provider
        self.tracer = provider.get_tracer("prefixroute.gateway")
        self._requests: dict[str, Any] = {}  # request id -> its gateway.request span

    # -- the request ----------------------------------------------------------------------

    def request_started(self, request_id: str, endpoint: str,
                        headers: Mapping[str, str]) -> None:
        parent = _PROPAGATOR.extract(headers)
        span = self.tracer.start_span("gateway.request", context=parent,
                                      kind=trace.SpanKind.SERVER,
                                      attributes={"prefixroute.request_id": request_id,
                                                  "prefixroute.endpoint": endpoint})
        self._requests[request_id] = span

    def request_ended(self, request_id: str, status: str, **attributes: Any) -> None:
        span = self._requests.pop(request_id, None)
        if span is None:
            return
        span.set_attribute("http.response.status_code", status)
        for key, value in attributes.items():
            if value is not None:
                span.set_attribute(f"prefixroute.{key}", value)
        if not status.startswith("2"):
            span.set_status(trace.Status(trace.StatusCode.ERROR, status))
        span.end()

    def span(self, request_id: str, name: str) -> Any:
        """A child span of the request as a context manager (``auth``, ``prompt.prepare``)."""
        parent = self._requests.get(request_id)
        context = trace.set_span_in_context(parent) if parent is not None else None
        return self.tracer.start_as_current_span(name, context=context)

    # -- attempts -------------------------------------------------------------------------

    def routed(self, request_id: str, attributes: dict[str, Any]) -> tuple[Any, dict]:
        """The routing decision of one attempt, and the ``upstream`` span that starts now;
        returns that span and the ``traceparent`` headers naming it."""
        parent = self._requests.get(request_id)
        context = trace.set_span_in_context(parent) if parent is not None else None
        route = self.tracer.start_span("route", context=context, attributes=attributes)
        route.end()
        upstream = self.tracer.start_span(
            "upstream", context=context, kind=trace.SpanKind.CLIENT,
            attributes={"prefixroute.replica": attributes["prefixroute.replica"]})
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(upstream))
        return upstream, headers

    def first_token(self, upstream: Any) -> None:
        start = getattr(upstream, "start_time", None)
        span = self.tracer.start_span("first_token", context=trace.set_span_in_context(
            upstream), start_time=start)
        span.end()

    def attempt_ended(self, upstream: Any, outcome: str,
                      reported_cached_tokens: int | None) -> None:
        upstream.set_attribute("prefixroute.outcome", outcome)
        if reported_cached_tokens is not None:
            upstream.set_attribute("prefixroute.reported_cached_tokens",
                                   reported_cached_tokens)
        if outcome != "ok":
            upstream.set_status(trace.Status(trace.StatusCode.ERROR, outcome))
        upstream.end()

    def shutdown(self) -> None:
        shutdown = getattr(self.provider, "shutdown", None)
        if shutdown is not None:
            shutdown()
