"""Names the Endpoint Picker Protocol (Gateway API Inference Extension) and Envoy's ext_proc
filter fix, shared by the EPP and the Envoy bootstrap it comes with."""

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
