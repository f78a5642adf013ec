"""Names the Endpoint Picker Protocol (Gateway API Inference Extension) and Envoy's ext_proc
filter fix, shared by the EPP and the Envoy bootstrap it comes with."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prefixroute.edges.gateway.config import GatewayConfig

# The picked endpoint(s), ``ip:port[,ip:port...]``: a request header and, under the same key,
# an entry of the ``envoy.lb`` dynamic metadata namespace.
DESTINATION = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
# The endpoint that served, as a data plane reports it to the EPP (header or metadata).
SERVED = "x-gateway-destination-endpoint-served"
# Where Envoy's ext_proc filter puts the attributes it sends, and the ones the bootstrap asks
# for with each answer: its status and the replica's address.
ATTRIBUTES_KEY = "envoy.filters.http.ext_proc"
# The one gRPC method an ext_proc server serves: a stream per HTTP request.
PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
RESPONSE_ATTRIBUTES = ("response.code", "upstream.address")

# Answers by access log: a data plane whose ext_proc stream carries this initial metadata
# sends the EPP its access log entries (Envoy's gRPC access log service) for the requests the
# EPP tags (and those whose caller left), with the answer's usage read into the same
# metadata namespace. The EPP then closes a non-streamed request's stream as soon as it has
# routed it, and learns how the request ended from the log entry instead: Envoy sends the
# answer on without a round trip to the EPP, and the entries come batched.
ANSWERS_HEADER = "x-prefixroute-answers"
ANSWERS_BY_ACCESS_LOG = "access-log"
ACCESS_LOG_METHOD = "/envoy.service.accesslog.v3.AccessLogService/StreamAccessLogs"
# The EPP's own dynamic metadata namespace: the tag (``exchange``, set by the EPP's routing
# answer) and the usage of a non-streamed answer (set by Envoy's json_to_metadata filter).
METADATA_NAMESPACE = "prefixroute"
EXCHANGE_KEY = "exchange"
USAGE_KEYS = {"prompt_tokens": ("usage", "prompt_tokens"),
              "completion_tokens": ("usage", "completion_tokens"),
              "cached_tokens": ("usage", "prompt_tokens_details", "cached_tokens")}

# The protocol's endpoint subset: the data plane may name the endpoints a request may go to,
# a list of ``ip:port`` under this key of this metadata namespace.
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"

# With no headers message (the bootstrap's fast route), the request's head comes as these
# ext_proc attributes (CEL expressions; Envoy sends a header's only when the request has it).
_HEADER_ATTRIBUTE = "request.headers['{}']"
_HEAD_ATTRIBUTES = {"request.path": ":path", "request.method": ":method"}


def request_attributes(trusted_tenant_header: str | None) -> list[str]:
    """The attributes the EPP reads the request's head from: path, method, the API key,
    Envoy's request id (the EPP's header changes do not apply on that route, so the EPP
    takes Envoy's id as its own), and the trusted tenant header when the config names
    one."""
    names = ["authorization", "x-request-id"]
    names += [trusted_tenant_header] if trusted_tenant_header else []
    return list(_HEAD_ATTRIBUTES) + [_HEADER_ATTRIBUTE.format(name) for name in names]


def attribute_header(attribute: str) -> str | None:
    """The header (or ``:path``/``:method``) an attribute of :func:`request_attributes`
    carries, or ``None``."""
    if attribute.startswith("request.headers['") and attribute.endswith("']"):
        return attribute[17:-2]
    return _HEAD_ATTRIBUTES.get(attribute)


def answers_by_access_log(config: GatewayConfig, epps: int = 1) -> bool:
    """Whether answers come by access log for a data plane in front of ``epps`` EPP
    addresses: only for one, and only without shared state. With several addresses, or
    instances sharing state (several processes, maybe behind one address), an entry could
    reach another EPP than the one that routed its request."""
    return epps == 1 and config.shared_state is None
