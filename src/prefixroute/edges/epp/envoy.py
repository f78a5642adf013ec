"""An Envoy bootstrap that puts the Endpoint Picker in front of the configured replicas.

What it sets up, and why:

* **The replicas cluster** is ``STATIC`` (the config's backends; ``STRICT_DNS`` with DNS
  discovery, Envoy resolving the same name as the EPP) with Envoy's ``override_host`` load
  balancer: it sends each request to the first endpoint named in the
  ``x-gateway-destination-endpoint`` header (or the ``envoy.lb`` metadata), and on a retry to
  the next one of the comma-separated list the EPP gave: the Endpoint Picker Protocol's
  fallbacks. A request the EPP named nothing for (only when the filter fails open) goes
  round robin. ``--original-dst`` writes the protocol's other form instead: an
  ``ORIGINAL_DST`` cluster that connects to whatever address the header names (no list,
  so no fallback; retries go to the same replica).
* **A header filter before the EPP** removes any ``x-gateway-destination-endpoint`` the
  caller sent, so only the EPP can choose a replica.
* **The ext_proc filter** sends the EPP as few messages as carry what it needs, since each
  costs Envoy and the EPP a wake-up, a parse and a write, and adds a round trip to the
  request's latency. On the **fast route**
  (``POST`` to the completions or chat path with a non-zero ``content-length``) the request
  headers are not sent: the EPP reads path, method, API key (and the trusted tenant header)
  from ``request_attributes`` that come with the body, buffered whole (the EPP reads the JSON
  to prepare the prompt and replaces it with the salted one). Every other request (a
  ``GET``, a chunked body, another path) takes the **full route**: headers first, so the EPP
  answers or refuses it before anything reaches a replica. Then the response body,
  streamed (SSE passes through event by event while the EPP reads usage; a non-streamed
  answer is its data and an end message). No response headers message: the status and the
  replica that served (``upstream.address``) come as attributes with the first body
  message. ``request_body="streamed"`` sends the request body in ``FULL_DUPLEX_STREAMED``
  chunks instead (the Inference Extension's EPP mode: no whole-body buffer in Envoy); the
  EPP holds its headers answer until the body is complete.
* **Answers by access log** (one EPP, no shared state): the ext_proc stream's initial
  metadata tells the EPP that Envoy logs answers to it. The EPP then closes a non-streamed
  request's stream with its routing answer, which tags the request in the ``prefixroute``
  metadata namespace, so the answer goes back to the caller with no message to the EPP on
  its way. A ``json_to_metadata`` filter reads the answer's usage into the same namespace
  (only an answer of a declared length under :data:`ANSWER_READ_BYTES`: it holds the answer
  whole to parse it), and the HTTP connection manager's gRPC access log sends the EPP the
  entry of each tagged request when it ends, in batches every :data:`ACCESS_LOG_FLUSH_S`.
  Streamed answers keep the response body messages above (the EPP cuts the usage chunk it
  asked for). With several EPPs, or instances sharing state, a request's entry could reach
  another EPP than the one that routed it, so answers stay on each request's stream.
* **The protocol's endpoint subset** (``envoy.lb.subset_hint`` metadata, set by a gateway in
  front) is forwarded to the EPP, which then picks only among those endpoints.
  ``failure_mode_allow`` is ``--fail-open``: with it, when the EPP is down or too slow
  requests still flow, but **unauthenticated and unsalted**, routed round robin (see
  docs/envoy.md); without it Envoy answers 503 and nothing reaches a replica unchecked.
* **The route** retries on connect failures, resets and 502/503/504 (``retries`` of the
  config, the same count ``serve`` uses). The response carries the EPP's ``x-request-id``
  (``always_set_request_id_in_response``).
* **Limits**: request bodies up to the config's ``max_body_bytes`` (Envoy buffers them for
  the EPP), request headers up to 64 KiB and 100 headers, the read timeout of the config
  (``timeouts.read_s``) as the route's timeout.
* **Circuit breakers** sized from the EPPs' admission limits (``limits.max_concurrent`` and
  ``max_queued`` per EPP), so that the EPPs refuse excess with an OpenAI-style 429, not
  Envoy with an empty 503 at its defaults (1,024 requests at once per cluster, 3 retries).
* **Streams per connection to an EPP** at most :data:`EPP_STREAMS_PER_CONNECTION`.
"""

from __future__ import annotations

from typing import Any

import yaml

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.edges.epp.config import endpoint_of
from prefixroute.edges.epp.protocol import (ANSWERS_BY_ACCESS_LOG, ANSWERS_HEADER,
                                            DESTINATION, EXCHANGE_KEY, LB_NAMESPACE,
                                            METADATA_NAMESPACE, RESPONSE_ATTRIBUTES,
                                            SUBSET_NAMESPACE, USAGE_KEYS,
                                            answers_by_access_log, request_attributes)
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.proxy import PATHS

# Envoy's default is 200 ms per ext_proc message; a large prompt tokenized on a loaded
# machine takes longer, and a streamed answer's chunks each wait for the EPP.
MESSAGE_TIMEOUT_S = 5.0
# Concurrent ext_proc streams per HTTP/2 connection to an EPP. The EPP's HTTP/2 server allows
# 100 and refuses a stream past that (its request fails); Envoy keeps to the advertised limit,
# but under sustained overload an HTTP/2 server was measured to see it go past (a stream Envoy
# counts as ended the server still counts open until Envoy's reset arrives), so it is capped
# below with room to spare, and Envoy opens more connections.
EPP_STREAMS_PER_CONNECTION = 64
MAX_HEADERS_KB = 64  # Envoy's default is 60 KiB; API keys and tracing headers fit well within
MAX_HEADERS_COUNT = 100  # Envoy's default
RETRY_ON = "connect-failure,reset,refused-stream,gateway-error"
# How long Envoy gathers access log entries before it sends them to the EPP: a handed-off
# request's end (its replica's load, its admission slot) reaches the EPP this much later at
# most, and at 500 requests/s a batch carries about five entries.
ACCESS_LOG_FLUSH_S = 0.01
# Non-streamed answers shorter than this (a power of ten: the bootstrap matches the
# content-length's digits) have their usage read by Envoy, which holds them whole to parse
# them; the listener's buffer limit makes room.
ANSWER_READ_BYTES = 10_000_000

_TYPE = "type.googleapis.com/envoy.extensions."


def split_host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} must be HOST:PORT, got {text!r}")
    return host, int(port)


def _duration(seconds: float) -> str:
    """A protobuf JSON duration: decimal seconds with at most nine fractional digits (``:g``
    would write large values in exponent form, which Envoy refuses)."""
    return f"{seconds:.9f}".rstrip("0").rstrip(".") + "s"


def _address(host: str, port: int) -> dict:
    return {"socket_address": {"address": host, "port_value": port}}


REQUEST_BODY_MODES = {"buffered": "BUFFERED", "streamed": "FULL_DUPLEX_STREAMED"}


def bootstrap(config: GatewayConfig, listen: str, epp: str | list[str], *,
              fail_open: bool = False, original_dst: bool = False, admin: str | None = None,
              request_body: str = "buffered",
              trusted_tenant_header: str | None = None) -> dict[str, Any]:
    """The bootstrap as a mapping (``render`` writes it as YAML). ``epp`` is one EPP's
    ``host:port`` or several (Envoy spreads the requests' streams over them, round robin);
    ``request_body`` is ``buffered`` or ``streamed``."""
    listen_host, listen_port = split_host_port(listen, "--listen")
    epps = [epp] if isinstance(epp, str) else list(epp)
    if not epps:
        raise ConfigError("--epp names no Endpoint Picker")
    epp_addresses = [_epp_address(e) for e in epps]
    if request_body not in REQUEST_BODY_MODES:
        raise ConfigError(f"--request-body must be one of {', '.join(REQUEST_BODY_MODES)}, "
                          f"got {request_body!r}")
    streamed = request_body == "streamed"
    read_timeout = _duration(config.timeouts.read_s)
    connect_timeout = _duration(config.timeouts.connect_s)

    # Envoy logs the answers of the requests the EPP tags to it, so their streams end once
    # routed (one EPP, no shared state).
    by_access_log = answers_by_access_log(config, len(epps))
    ext_proc = {
        "@type": _TYPE + "filters.http.ext_proc.v3.ExternalProcessor",
        "grpc_service": {"envoy_grpc": {"cluster_name": "prefixroute_epp"},
                         "timeout": _duration(MESSAGE_TIMEOUT_S),
                         **({"initial_metadata": [{"key": ANSWERS_HEADER,
                                                   "value": ANSWERS_BY_ACCESS_LOG}]}
                            if by_access_log else {})},
        "failure_mode_allow": fail_open,
        # Failing closed, the caller gets 503 (retry later) rather than Envoy's default 500.
        "status_on_error": {"code": "ServiceUnavailable"},
        "processing_mode": _processing_mode("SEND", REQUEST_BODY_MODES[request_body]),
        # The request's head for the fast route, which sends no headers message.
        "request_attributes": request_attributes(trusted_tenant_header),
        # The status and the replica that served come with the first response body message
        # instead of a headers message: one exchange fewer per request.
        "response_attributes": list(RESPONSE_ATTRIBUTES),
        # A request may wait in the EPP's admission queue before its body message is
        # answered: Envoy waits that long too, plus the message's own time.
        "message_timeout": _duration(config.limits.queue_timeout_s + MESSAGE_TIMEOUT_S),
        # The EPP's endpoint metadata lands in envoy.lb, where override_host reads it.
        "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE] + (
                                 [METADATA_NAMESPACE] if by_access_log else [])},
                             # The endpoint subset a gateway in front allows, to the EPP.
                             "forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
    }
    # The usage of a non-streamed (JSON) answer, into the EPP's metadata namespace, where
    # the access log entry carries it. The filter holds the whole answer to parse it, so it
    # reads only answers of a declared length below ANSWER_READ_BYTES (Envoy answers 500 to
    # one past its buffer limit); a larger one passes unread, and its end comes without
    # usage.
    usage_to_metadata = {
        "@type": "type.googleapis.com/envoy.extensions.common.matching.v3."
                 "ExtensionWithMatcher",
        "extension_config": {"name": "envoy.filters.http.json_to_metadata", "typed_config": {
            "@type": _TYPE + "filters.http.json_to_metadata.v3.JsonToMetadata",
            "response_rules": {"rules": [
                {"selectors": [{"key": key} for key in path],
                 "on_present": {"metadata_namespace": METADATA_NAMESPACE, "key": name,
                                "type": "NUMBER"}}
                for name, path in USAGE_KEYS.items()]}}},
        "xds_matcher": {"matcher_list": {"matchers": [{
            "predicate": {"not_matcher": {"single_predicate": {
                "input": {"name": "content-length", "typed_config": {
                    "@type": "type.googleapis.com/envoy.type.matcher.v3."
                             "HttpResponseHeaderMatchInput",
                    "header_name": "content-length"}},
                "value_match": {"safe_regex": {
                    "google_re2": {},
                    "regex": f"[0-9]{{1,{len(str(ANSWER_READ_BYTES)) - 1}}}"}}}}},
            "on_match": {"action": {"name": "skip", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.common.matcher."
                         "action.v3.SkipFilter"}}}}]}},
    }
    limit = buffer_limit(config, by_access_log)
    # Envoy's gRPC access log to the EPP.
    access_log = {
        "name": "envoy.access_loggers.http_grpc",
        # The requests the EPP tagged; and those the caller left early, in case the EPP's
        # routing answer (and its tag) crossed the caller's leaving: the EPP finds those by
        # their request id.
        "filter": {"or_filter": {"filters": [
            {"metadata_filter": {
                "matcher": {"filter": METADATA_NAMESPACE, "path": [{"key": EXCHANGE_KEY}],
                            "value": {"present_match": True}},
                "match_if_key_not_found": False}},
            {"response_flag_filter": {"flags": ["DC"]}}]}},
        "typed_config": {
            "@type": _TYPE + "access_loggers.grpc.v3.HttpGrpcAccessLogConfig",
            "common_config": {
                "log_name": "prefixroute", "transport_api_version": "V3",
                "grpc_service": {"envoy_grpc": {"cluster_name": "prefixroute_epp"}},
                "buffer_flush_interval": _duration(ACCESS_LOG_FLUSH_S)}},
    }
    strip_destination = {
        "@type": _TYPE + "filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": DESTINATION}]},
    }
    action = {
        "cluster": "prefixroute_replicas",
        "timeout": read_timeout,
        "retry_policy": {"retry_on": RETRY_ON, "num_retries": config.retries},
    }
    # The fast route's answer to the body cannot change headers (Envoy applies none then):
    # the endpoint goes by metadata only, which override_host reads but an ORIGINAL_DST
    # cluster does not, and a replica's own API key could not be set.
    fast = not streamed and not original_dst and not any(b.api_key_env for b in config.backends)
    routes = [_fast_route(path, action) for path in PATHS.values()] if fast else []
    full_route: dict[str, Any] = {"match": {"prefix": "/"}, "route": action}
    if fast:
        full_route["typed_per_filter_config"] = {"envoy.filters.http.buffer": {
            "@type": _TYPE + "filters.http.buffer.v3.BufferPerRoute", "disabled": True}}
    routes.append(full_route)
    # Without a headers message the ext_proc filter lets the request's headers go on before
    # the body has been to the EPP (the router would pick its host before the EPP's
    # metadata is there, and the filters after it would see the headers early): this
    # buffer holds them, with the body, until the EPP has answered. The full route does not
    # need it (the ext_proc filter holds the headers itself there).
    hold_until_picked = {"@type": _TYPE + "filters.http.buffer.v3.Buffer",
                         "max_request_bytes": limit}
    # The caller's API key is the EPP's to read, not the replicas': on the fast route the
    # EPP's answer changes no header, so this filter, after the buffer, removes it.
    strip_api_key = {
        "@type": _TYPE + "filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": "authorization"}]},
    }
    hcm = {
        "@type": _TYPE + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "prefixroute",
        "codec_type": "AUTO",
        "max_request_headers_kb": MAX_HEADERS_KB,
        "common_http_protocol_options": {"max_headers_count": MAX_HEADERS_COUNT},
        "stream_idle_timeout": read_timeout,
        # The EPP's request id (sent to the replica, in /debug/decisions) back to the caller.
        "always_set_request_id_in_response": True,
        **({"access_log": [access_log]} if by_access_log else {}),
        "route_config": {"name": "prefixroute", "virtual_hosts": [
            {"name": "inference", "domains": ["*"], "routes": routes}]},
        "http_filters": [
            {"name": "prefixroute.strip_destination", "typed_config": strip_destination},
            {"name": "envoy.filters.http.ext_proc", "typed_config": ext_proc},
            *([{"name": "envoy.filters.http.buffer", "typed_config": hold_until_picked},
               {"name": "prefixroute.strip_api_key", "typed_config": strip_api_key}]
              if fast else []),
            *([{"name": "prefixroute.usage_to_metadata", "typed_config": usage_to_metadata}]
              if by_access_log else []),
            {"name": "envoy.filters.http.router", "typed_config": {
                "@type": _TYPE + "filters.http.router.v3.Router"}},
        ],
    }
    listener = {
        "name": "prefixroute",
        "address": _address(listen_host, listen_port),
        # Envoy buffers the whole request body for the EPP, and answers whose usage it reads.
        "per_connection_buffer_limit_bytes": limit,
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                        "typed_config": hcm}]}],
    }
    admitted = len(epp_addresses) * config.limits.max_concurrent
    epp_streams = 2 * len(epp_addresses) * (config.limits.max_concurrent
                                            + config.limits.max_queued)
    replicas = _replicas_cluster(config, connect_timeout, original_dst)
    # The same for the replicas: every request the EPPs admit may be running at once, and
    # retrying (Envoy's defaults are 1,024 requests and 3 retries at once per cluster).
    # (HTTP/1 to the replicas: a connection per request at once.)
    replicas["circuit_breakers"] = {"thresholds": [{
        "max_connections": _count(2 * admitted), "max_requests": _count(2 * admitted),
        "max_pending_requests": _count(2 * admitted), "max_retries": _count(admitted)}]}
    clusters = [replicas, {
        "name": "prefixroute_epp",
        "type": "STATIC",
        "connect_timeout": connect_timeout,
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": _TYPE + "upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {
                    "max_concurrent_streams": EPP_STREAMS_PER_CONNECTION}}}},
        # A request holds its ext_proc stream until its answer ends (minutes for a long
        # generation), so Envoy's default of 1,024 requests at once to a cluster would answer
        # 503 past it with the EPPs idle. The EPPs' own admission limits decide instead
        # (past them, an OpenAI-style 429): room for all they admit and queue, and as many
        # again for exchanges refused, answered from headers, or ending.
        "circuit_breakers": {"thresholds": [{
            "max_requests": _count(epp_streams), "max_pending_requests": _count(epp_streams)}]},
        "load_assignment": {"cluster_name": "prefixroute_epp", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": address}} for address in epp_addresses]}]},
    }]
    out: dict[str, Any] = {"static_resources": {"listeners": [listener], "clusters": clusters}}
    if admin is not None:
        admin_host, admin_port = split_host_port(admin, "--admin")
        out["admin"] = {"address": _address(admin_host, admin_port)}
    return out


def buffer_limit(config: GatewayConfig, by_access_log: bool = True) -> int:
    """How much of one request Envoy holds: its body for the EPP (up to the largest
    accepted; the EPP refuses a larger one with its own error, so it must take a message
    this large) and, when it reads the usage for the access log, its answer. One limit
    covers both: the buffer filter sets it for the whole stream."""
    return max(config.limits.max_body_bytes,
               ANSWER_READ_BYTES + (1 << 20) if by_access_log else 0)


def _count(n: int) -> int:
    """A circuit breaker's threshold (Envoy's field is a 32-bit count)."""
    return min(n, 2**32 - 1)


def _epp_address(text: str) -> dict:
    """``HOST:PORT``, or ``unix:PATH`` for an EPP on the same host listening on a Unix
    socket (``prefixroute epp --unix-socket``): each ext_proc message then costs both
    sides less than over loopback TCP."""
    if text.startswith("unix:"):
        if not text[5:].startswith("/"):
            raise ConfigError(f"--epp unix:PATH needs an absolute path, got {text!r}")
        return {"pipe": {"path": text[5:]}}
    return _address(*split_host_port(text, "--epp"))


def _processing_mode(request_headers: str, request_body: str) -> dict[str, str]:
    return {"request_header_mode": request_headers, "request_body_mode": request_body,
            "response_header_mode": "SKIP", "response_body_mode": "STREAMED",
            # Envoy requires trailers sent with a FULL_DUPLEX_STREAMED body.
            "request_trailer_mode": "SEND" if request_body == "FULL_DUPLEX_STREAMED" else "SKIP",
            "response_trailer_mode": "SKIP"}


def _fast_route(path: str, action: dict) -> dict[str, Any]:
    """``POST path`` with a body of declared non-zero length: no headers message (the EPP
    reads the head from the body's attributes). A request without body would never reach
    the EPP on this route, so only one that declares a body takes it."""
    return {
        "match": {"path": path, "headers": [
            {"name": ":method", "string_match": {"exact": "POST"}},
            {"name": "content-length", "string_match": {"safe_regex": {"regex": "[1-9][0-9]*"}}},
        ]},
        "route": action,
        "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
            "@type": _TYPE + "filters.http.ext_proc.v3.ExtProcPerRoute",
            "overrides": {"processing_mode": _processing_mode("SKIP", "BUFFERED")}}},
    }


def _replicas_cluster(config: GatewayConfig, connect_timeout: str,
                      original_dst: bool) -> dict[str, Any]:
    """The replicas' cluster. Envoy's ``override_host`` picks among the cluster's own hosts,
    so the cluster must know the replicas the EPP knows: the static backends, plus, with
    DNS discovery, the same name resolved by Envoy (``STRICT_DNS``: every address of a
    headless Service is a host). A discovery file Envoy cannot follow; ``--original-dst``
    connects to whatever address the EPP names instead."""
    if original_dst:
        return {"name": "prefixroute_replicas", "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": connect_timeout,
                "original_dst_lb_config": {"use_http_header": True,
                                           "http_header_name": DESTINATION}}
    discovery = config.discovery
    dns = discovery.dns if discovery is not None else None
    if discovery is not None and discovery.file is not None:
        raise InputError("Envoy cannot follow a discovery file, so the replicas it adds would "
                         "be outside Envoy's cluster; use discovery.dns (Envoy resolves the "
                         "same name) or --original-dst", config.source, "discovery.file")
    if dns is not None and dns.record != "a":
        raise InputError("Envoy resolves A/AAAA records, not SRV; use record: a with a port, "
                         "or --original-dst", config.source, "discovery.dns.record")
    endpoints = []
    for backend in config.backends:
        endpoint = endpoint_of(backend.url)
        if endpoint is None:
            raise ConfigError(f"backend {backend.name!r}: Envoy routes to ip:port; its url must "
                              f"be http://IP:PORT, got {backend.url!r}")
        host, port = split_host_port(endpoint, "backend url")
        endpoints.append({"endpoint": {"address": _address(host, port)}})
    lb = {"name": "envoy.load_balancing_policies.override_host", "typed_config": {
        "@type": _TYPE + "load_balancing_policies.override_host.v3.OverrideHost",
        "override_host_sources": [
            {"header": DESTINATION},
            {"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
        "fallback_policy": {"policies": [{"typed_extension_config": {
            "name": "envoy.load_balancing_policies.round_robin", "typed_config": {
                "@type": _TYPE + "load_balancing_policies.round_robin.v3.RoundRobin"}}}]},
    }}
    cluster: dict[str, Any] = {
        "name": "prefixroute_replicas", "type": "STATIC", "connect_timeout": connect_timeout,
        "load_balancing_policy": {"policies": [{"typed_extension_config": lb}]}}
    if dns is not None:
        assert dns.port is not None  # the config requires it with A records
        endpoints.append({"endpoint": {"address": _address(dns.name, dns.port)}})
        cluster.update({
            "type": "STRICT_DNS",
            # Asked as often as the EPP asks, so both see a pod join or leave together.
            "dns_refresh_rate": _duration(dns.interval_s), "respect_dns_ttl": False,
            "dns_lookup_family": "V4_PREFERRED"})
        if dns.server is not None:
            host, port = split_host_port(dns.server, "discovery.dns.server")
            cluster["typed_dns_resolver_config"] = {
                "name": "envoy.network.dns_resolver.cares", "typed_config": {
                    "@type": _TYPE + "network.dns_resolver.cares.v3.CaresDnsResolverConfig",
                    "resolvers": [_address(host, port)]}}
    cluster["load_assignment"] = {"cluster_name": "prefixroute_replicas",
                                  "endpoints": [{"lb_endpoints": endpoints}]}
    return cluster


def render(config: GatewayConfig, listen: str, epp: str | list[str], **kwargs: Any) -> str:
    """The bootstrap as YAML text, ready for ``envoy -c``."""
    header = ("# Envoy bootstrap for prefixroute's Endpoint Picker, written by "
              "`prefixroute envoy-config`\n# from " + config.source + " (docs/envoy.md).\n")
    return header + yaml.safe_dump(bootstrap(config, listen, epp, **kwargs), sort_keys=False)
