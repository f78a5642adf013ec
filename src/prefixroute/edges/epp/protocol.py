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
RESPONSE_ATTRIBUTES = ("response.code", "upstream.address")
