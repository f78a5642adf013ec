"""The gateway's Prometheus metrics, in a registry of its own (one per app, so tests can run
several gateways in one process).

Names start with ``prefixroute_gateway_``. Label ``replica`` is the backend's configured name;
tenants never appear as labels except on the rate-limit counter (they are few and configured).
"""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Latency buckets: proxy overheads of a millisecond up to long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        p = "prefixroute_gateway_"
        self.requests = Counter(p + "requests_total", "Requests answered, by endpoint and "
                                "HTTP status", ["endpoint", "status"], registry=r)
        self.latency = Histogram(p + "request_latency_seconds", "Time from a request's arrival "
                                 "to its last byte", ["endpoint"], buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.ttft = Histogram(p + "ttft_seconds", "Time from a streaming request's arrival to "
                              "its first token event", ["endpoint"], buckets=LATENCY_BUCKETS,
                              registry=r)
        self.overhead = Histogram(p + "routing_seconds", "Time spent in the gateway before the "
                                  "routing decision (auth, limits, tokenize, hash, admission)",
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens the replicas "
                                     "reported", ["replica"], registry=r)
        self.predicted_cached = Counter(p + "predicted_cached_tokens_total", "Cached prompt "
                                        "tokens the policy predicted", ["replica"], registry=r)
        self.reported_cached = Counter(p + "reported_cached_tokens_total", "Cached prompt "
                                       "tokens the replicas reported (usage.prompt_tokens_"
                                       "details.cached_tokens)", ["replica"], registry=r)
        # Per tenant and replica: token hit rate per tenant (sum by tenant) and per replica.
        self.tenant_prompt_tokens = Counter(
            p + "tenant_prompt_tokens_total", "Prompt tokens the replicas reported, by tenant "
            "and replica", ["tenant", "replica"], registry=r)
        self.tenant_cached_tokens = Counter(
            p + "tenant_cached_tokens_total", "Cached prompt tokens the replicas reported, by "
            "tenant and replica", ["tenant", "replica"], registry=r)
        self.decisions = Counter(p + "decisions_total", "Routing decisions by policy branch",
                                 ["policy", "branch"], registry=r)
        self.retries = Counter(p + "retries_total", "Attempts retried on another replica, by "
                               "reason", ["reason"], registry=r)
        self.backend_failures = Counter(p + "backend_failures_total", "Failed attempts by "
                                        "replica and reason", ["replica", "reason"], registry=r)
        self.rate_limited = Counter(p + "rate_limited_total", "Requests refused by a tenant's "
                                    "rate limit", ["tenant"], registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Requests waiting for a slot", registry=r)
        self.active = Gauge(p + "active_requests", "Requests being proxied", registry=r)
        self.in_flight = Gauge(p + "replica_in_flight", "Requests in flight per replica",
                               ["replica"], registry=r)
        self.healthy = Gauge(p + "replica_healthy", "1 if the replica's health check passes",
                             ["replica"], registry=r)
        self.breaker = Gauge(p + "replica_breaker_state", "Circuit breaker: 0 closed, "
                             "1 half-open, 2 open", ["replica"], registry=r)
        self.kv_events = Counter(p + "kv_events_total", "KV events applied to a replica's "
                                 "view, by kind", ["replica", "kind"], registry=r)
        self.kv_event_gaps = Counter(p + "kv_event_missing_total", "KV event batches lost and "
                                     "not replayed (the view may be stale)", ["replica"],
                                     registry=r)
        self.view_exact = Gauge(p + "replica_view_exact", "1 while the replica's event view "
                                "has every KV event batch, 0 once one was lost for good "
                                "(degraded until the engine restarts or clears)", ["replica"],
                                registry=r)
        self.view_blocks = Gauge(p + "replica_view_blocks", "Blocks the gateway believes the "
                                 "replica holds", ["replica"], registry=r)
        self.tokenize_fallbacks = Counter(p + "tokenize_fallbacks_total", "Requests the "
                                          "tokenizer or template could not render, routed on "
                                          "character blocks instead", registry=r)

        for metric in vars(self).values():
            if getattr(metric, "_labelnames", None):
                metric.labels = _memoized_labels(metric.labels)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _memoized_labels(labels: Callable[..., Any]) -> Callable[..., Any]:
    """``metric.labels(*values)`` remembered per value tuple: prometheus_client checks the
    values and takes a lock on every call, a dozen times per proxied request. The children
    are prometheus_client's own (the gateway never removes one), so nothing else changes."""
    children: dict[tuple, Any] = {}

    def cached(*values: str) -> Any:
        child = children.get(values)
        if child is None:
            child = children[values] = labels(*values)
        return child

    return cached
