"""prefixroute as an Endpoint Picker behind Envoy (the Gateway API Inference Extension's
Endpoint Picker Protocol over Envoy's ext_proc v3): ``prefixroute epp`` runs it,
``prefixroute envoy-config`` writes the Envoy bootstrap that calls it (docs/envoy.md)."""
