"""``prefixroute envoy-config`` and ``prefixroute epp`` as commands: the bootstrap Envoy
itself accepts (``envoy --mode validate``), and bad input as one line naming the file, line
and field, exit 2."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import yaml

from prefixroute.edges.gateway.config import hash_api_key

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
ENVOY = shutil.which("envoy")
SECRET = "c1" * 32  # 64 hex digits: a 32-byte key


def write_config(tmp_path, **extra) -> str:
    config = {"server_secret": {"env": "PR_EPP_CLI_SECRET"},
              "backends": [{"name": "r0", "url": "http://127.0.0.1:18001"},
                           {"name": "r1", "url": "http://[::1]:18002"}],
              "tenants": [{"name": "a", "api_key_sha256": hash_api_key("sk-a")}],
              **extra}
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def prefixroute(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=120,
                          env={**os.environ, "PR_EPP_CLI_SECRET": SECRET})


def envoy_config(path: str, *extra: str) -> subprocess.CompletedProcess:
    return prefixroute("envoy-config", "--config", path, "--listen", "127.0.0.1:18080",
                       "--epp", "127.0.0.1:18090", *extra)


@pytest.mark.skipif(ENVOY is None, reason="no envoy binary")
@pytest.mark.parametrize("flags", [[], ["--fail-open", "--admin", "127.0.0.1:18099"],
                                   ["--request-body", "streamed",
                                    "--epp", "unix:/tmp/prefixroute-epp.sock"]])
def test_envoy_accepts_the_bootstrap(tmp_path, flags):
    done = envoy_config(write_config(tmp_path), *flags)
    assert done.returncode == 0, done.stderr
    envoy_validates(tmp_path, done.stdout)


def envoy_validates(tmp_path, bootstrap: str) -> None:
    (tmp_path / "envoy.yaml").write_text(bootstrap)
    check = subprocess.run([ENVOY, "--mode", "validate", "-c", str(tmp_path / "envoy.yaml"),
                            "--disable-hot-restart"], capture_output=True, text=True,
                           timeout=120)
    assert check.returncode == 0, check.stdout[-2000:] + check.stderr[-2000:]


def test_the_bootstrap_names_every_replica_and_the_failure_mode(tmp_path):
    path = write_config(tmp_path, retries=1, limits={"max_body_bytes": 2_000_000})
    closed = yaml.safe_load(envoy_config(path).stdout)
    opened = yaml.safe_load(envoy_config(path, "--fail-open").stdout)
    replicas, epp = closed["static_resources"]["clusters"]
    addresses = [(e["endpoint"]["address"]["socket_address"]["address"],
                  e["endpoint"]["address"]["socket_address"]["port_value"])
                 for e in replicas["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses == [("127.0.0.1", 18001), ("::1", 18002)]
    listener = closed["static_resources"]["listeners"][0]
    # Room for the largest request body accepted, and for the answers whose usage Envoy
    # reads (below 10 MB): the buffer filter sets that limit for the whole stream.
    assert listener["per_connection_buffer_limit_bytes"] == 10_000_000 + 2**20
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    buffer = next(f["typed_config"] for f in hcm["http_filters"]
                  if f["name"] == "envoy.filters.http.buffer")
    assert buffer["max_request_bytes"] == 10_000_000 + 2**20
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["retry_policy"]["num_retries"] == 1

    def ext_proc(bootstrap):
        listener = bootstrap["static_resources"]["listeners"][0]
        filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
        return next(f["typed_config"] for f in filters
                    if f["name"] == "envoy.filters.http.ext_proc")

    assert ext_proc(closed)["failure_mode_allow"] is False
    assert ext_proc(opened)["failure_mode_allow"] is True


def test_envoys_circuit_breakers_leave_the_refusing_to_the_epps_admission(tmp_path):
    # Default limits: 512 running and 1,024 queued per EPP; two EPPs. Envoy's defaults
    # (1,024 requests at once per cluster, 3 retries) would answer 503 first.
    bootstrap = yaml.safe_load(envoy_config(write_config(tmp_path), "--epp",
                                            "127.0.0.1:9004").stdout)
    replicas, epp = bootstrap["static_resources"]["clusters"]
    assert epp["circuit_breakers"]["thresholds"] == [
        {"max_requests": 2 * 2 * (512 + 1024), "max_pending_requests": 6144}]
    assert replicas["circuit_breakers"]["thresholds"] == [
        {"max_connections": 2048, "max_requests": 2 * 2 * 512, "max_pending_requests": 2048,
         "max_retries": 1024}]


def test_envoy_opens_streams_to_the_epp_well_below_what_its_server_allows(tmp_path):
    # Past the limit the EPP's HTTP/2 server advertises, it refuses the stream (that
    # exchange fails); Envoy was measured to go past an HTTP/2 server's limit under overload.
    from prefixroute.edges.epp.http2 import MAX_STREAMS

    allowed = MAX_STREAMS
    bootstrap = yaml.safe_load(envoy_config(write_config(tmp_path)).stdout)
    epp = next(c for c in bootstrap["static_resources"]["clusters"]
               if c["name"] == "prefixroute_epp")
    options = epp["typed_extension_protocol_options"][
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"]["explicit_http_config"]
    streams = options["http2_protocol_options"]["max_concurrent_streams"]
    assert allowed == 100 and streams <= 0.7 * allowed


def test_original_dst_needs_a_single_endpoint(tmp_path):
    refused = envoy_config(write_config(tmp_path), "--original-dst")
    assert refused.returncode == 2
    assert "fallback_endpoints: 0" in refused.stderr
    single = envoy_config(write_config(tmp_path, epp={"fallback_endpoints": 0}),
                          "--original-dst")
    assert single.returncode == 0, single.stderr
    cluster = yaml.safe_load(single.stdout)["static_resources"]["clusters"][0]
    assert cluster["type"] == "ORIGINAL_DST"
    assert cluster["original_dst_lb_config"]["http_header_name"] == \
        "x-gateway-destination-endpoint"


DNS = {"dns": {"name": "vllm.inference.svc.cluster.local", "port": 8000, "interval_s": 2,
               "server": "127.0.0.1:5353"}}


def test_dns_discovery_makes_envoy_resolve_the_same_name_as_the_epp(tmp_path):
    done = envoy_config(write_config(tmp_path, discovery=DNS))
    assert done.returncode == 0, done.stderr
    cluster = yaml.safe_load(done.stdout)["static_resources"]["clusters"][0]
    assert cluster["type"] == "STRICT_DNS" and cluster["dns_refresh_rate"] == "2s"
    addresses = [e["endpoint"]["address"]["socket_address"]
                 for e in cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses == [{"address": "127.0.0.1", "port_value": 18001},
                         {"address": "::1", "port_value": 18002},
                         {"address": "vllm.inference.svc.cluster.local.", "port_value": 8000}]
    resolver = cluster["typed_dns_resolver_config"]["typed_config"]["resolvers"]
    assert resolver == [{"socket_address": {"address": "127.0.0.1", "port_value": 5353}}]
    if ENVOY is not None:
        envoy_validates(tmp_path, done.stdout)


def test_membership_envoy_cannot_follow_is_refused_unless_original_dst(tmp_path):
    members = tmp_path / "members.yaml"
    members.write_text("[]\n")
    srv = {"dns": {"name": "_http._tcp.vllm.test", "record": "srv"}}
    for discovery, field in (({"file": str(members)}, "discovery.file"),
                             (srv, "discovery.dns.record")):
        path = write_config(tmp_path, discovery=discovery)
        refused = envoy_config(path)
        assert refused.returncode == 2, refused.stderr
        assert field in refused.stderr and "--original-dst" in refused.stderr
        assert "gateway.yaml" in refused.stderr and "Traceback" not in refused.stderr
        data = yaml.safe_load(open(path))
        data["epp"] = {"fallback_endpoints": 0}
        open(path, "w").write(yaml.safe_dump(data, sort_keys=False))
        assert envoy_config(path, "--original-dst").returncode == 0


def test_a_replica_named_by_host_name_is_refused_naming_the_field(tmp_path):
    path = write_config(tmp_path)
    data = yaml.safe_load(open(path))
    data["backends"][0]["url"] = "http://replica-0.internal:8000"
    open(path, "w").write(yaml.safe_dump(data, sort_keys=False))
    for command in (envoy_config(path), prefixroute("epp", "--config", path, "--port", "0")):
        assert command.returncode == 2
        assert "backends[0].url" in command.stderr and "http://IP:PORT" in command.stderr
        assert "Traceback" not in command.stderr


def test_an_unknown_key_in_the_epp_section_names_its_line(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(open(write_config(tmp_path)).read()
                    + "epp:\n  trusted_tenant_headr: x-tenant\n")
    done = prefixroute("epp", "--config", str(path))
    assert done.returncode == 2
    line = len(path.read_text().splitlines())
    assert f"gateway.yaml:{line}" in done.stderr and "trusted_tenant_headr" in done.stderr


def routes_and_filters(bootstrap: dict) -> tuple[list[dict], list[str]]:
    hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    config = hcm["typed_config"]
    return (config["route_config"]["virtual_hosts"][0]["routes"],
            [f["name"] for f in config["http_filters"]])


def test_completions_with_a_body_skip_the_headers_message_everything_else_sends_it(tmp_path):
    path = write_config(tmp_path)
    routes, filters = routes_and_filters(yaml.safe_load(envoy_config(path).stdout))
    fast, full = routes[:2], routes[2]
    assert [r["match"]["path"] for r in fast] == ["/v1/chat/completions", "/v1/completions"]
    for route in fast:
        condition = {h["name"]: h["string_match"] for h in route["match"]["headers"]}
        assert condition == {":method": {"exact": "POST"},
                             "content-length": {"safe_regex": {"regex": "[1-9][0-9]*"}}}
        mode = route["typed_per_filter_config"]["envoy.filters.http.ext_proc"][
            "overrides"]["processing_mode"]
        assert (mode["request_header_mode"], mode["request_body_mode"]) == ("SKIP", "BUFFERED")
    # Everything else: the filter's own mode, headers first; the buffer is off there.
    assert full["match"] == {"prefix": "/"}
    assert full["typed_per_filter_config"]["envoy.filters.http.buffer"]["disabled"] is True
    # The buffer holds the fast route's headers until the EPP has answered; the key is
    # removed only after it.
    assert filters == ["prefixroute.strip_destination", "envoy.filters.http.ext_proc",
                       "envoy.filters.http.buffer", "prefixroute.strip_api_key",
                       "prefixroute.usage_to_metadata", "envoy.filters.http.router"]


def test_one_epp_gets_the_answers_by_access_log_several_on_each_requests_stream(tmp_path):
    path = write_config(tmp_path, limits={"max_body_bytes": 2_000_000})
    one = yaml.safe_load(envoy_config(path).stdout)
    listener = one["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    ext_proc = next(f["typed_config"] for f in hcm["http_filters"]
                    if f["name"] == "envoy.filters.http.ext_proc")
    # The EPP learns from its stream's metadata that Envoy logs answers to it ...
    assert ext_proc["grpc_service"]["initial_metadata"] == [
        {"key": "x-prefixroute-answers", "value": "access-log"}]
    assert ext_proc["metadata_options"]["receiving_namespaces"]["untyped"] == [
        "envoy.lb", "prefixroute"]
    # ... the requests it tagged (and those whose caller left: the tag may not have reached
    # Envoy), over gRPC to the EPP's cluster, batched for 10 ms.
    [log] = hcm["access_log"]
    tagged, left = log["filter"]["or_filter"]["filters"]
    matcher = tagged["metadata_filter"]["matcher"]
    assert (matcher["filter"], matcher["path"]) == ("prefixroute", [{"key": "exchange"}])
    assert left == {"response_flag_filter": {"flags": ["DC"]}}
    common = log["typed_config"]["common_config"]
    assert common["grpc_service"]["envoy_grpc"]["cluster_name"] == "prefixroute_epp"
    assert common["buffer_flush_interval"] == "0.01s"
    # The usage comes from the answer, for answers of a declared length under 10 MB.
    usage = next(f["typed_config"] for f in hcm["http_filters"]
                 if f["name"] == "prefixroute.usage_to_metadata")
    rules = usage["extension_config"]["typed_config"]["response_rules"]["rules"]
    assert [[s["key"] for s in r["selectors"]] for r in rules] == [
        ["usage", "prompt_tokens"], ["usage", "completion_tokens"],
        ["usage", "prompt_tokens_details", "cached_tokens"]]
    [skip] = usage["xds_matcher"]["matcher_list"]["matchers"]
    length = skip["predicate"]["not_matcher"]["single_predicate"]
    assert length["input"]["typed_config"]["header_name"] == "content-length"
    assert length["value_match"]["safe_regex"]["regex"] == "[0-9]{1,7}"
    # Two EPPs: an access log stream could reach the one that did not route the request.
    several = yaml.safe_load(envoy_config(path, "--epp", "127.0.0.1:9004").stdout)
    listener = several["static_resources"]["listeners"][0]
    assert listener["per_connection_buffer_limit_bytes"] == 2_000_000
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    assert "access_log" not in hcm
    assert "prefixroute.usage_to_metadata" not in [f["name"] for f in hcm["http_filters"]]
    ext_proc = next(f["typed_config"] for f in hcm["http_filters"]
                    if f["name"] == "envoy.filters.http.ext_proc")
    assert "initial_metadata" not in ext_proc["grpc_service"]
    # Instances sharing state are several processes, maybe behind one address: the same.
    shared = write_config(tmp_path, shared_state={"redis": "redis://127.0.0.1:6379"})
    hcm = yaml.safe_load(envoy_config(shared).stdout)["static_resources"]["listeners"][0][
        "filter_chains"][0]["filters"][0]["typed_config"]
    assert "access_log" not in hcm


@pytest.mark.parametrize("flags", [["--request-body", "streamed"],
                                   ["--original-dst"]])
def test_streamed_bodies_and_original_dst_have_no_fast_route(tmp_path, flags):
    path = write_config(tmp_path, epp={"fallback_endpoints": 0})
    bootstrap = yaml.safe_load(envoy_config(path, *flags).stdout)
    routes, filters = routes_and_filters(bootstrap)
    assert [r["match"] for r in routes] == [{"prefix": "/"}]
    assert "envoy.filters.http.buffer" not in filters
    if flags[0] == "--request-body":
        assert "FULL_DUPLEX_STREAMED" in json.dumps(bootstrap)


def test_several_epps_and_a_unix_socket_are_the_epp_clusters_endpoints(tmp_path):
    bootstrap = yaml.safe_load(envoy_config(write_config(tmp_path), "--epp",
                                            "unix:/run/epp.sock").stdout)
    epp = bootstrap["static_resources"]["clusters"][1]
    addresses = [e["endpoint"]["address"]
                 for e in epp["load_assignment"]["endpoints"][0]["lb_endpoints"]]
    assert addresses == [{"socket_address": {"address": "127.0.0.1", "port_value": 18090}},
                         {"pipe": {"path": "/run/epp.sock"}}]
    relative = envoy_config(write_config(tmp_path), "--epp", "unix:epp.sock")
    assert relative.returncode == 2 and "absolute path" in relative.stderr


def test_an_epp_on_a_unix_socket_takes_a_stale_path_refuses_a_live_one_and_cleans_up(
        tmp_path):
    import signal
    import socket
    import time

    path = write_config(tmp_path)
    where = tmp_path / "epp.sock"
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(where))  # a socket file nobody listens on, as an EPP killed leaves it
    stale.close()
    command = [sys.executable, "-m", "prefixroute", "epp", "--config", path,
               "--unix-socket", str(where), "--admin-port", "0", "--log-level", "warning"]
    env = {**os.environ, "PR_EPP_CLI_SECRET": SECRET}
    first = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while True:  # (listening from before the gateway starts: connections wait)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                try:
                    probe.connect(str(where))
                    break
                except OSError:
                    assert first.poll() is None and time.monotonic() < deadline
                    time.sleep(0.1)
        second = prefixroute("epp", "--config", path, "--unix-socket", str(where),
                             "--admin-port", "0")
        assert second.returncode == 2
        assert "another process listens there" in second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        assert first.wait(timeout=60) == 0, first.stderr.read() if first.stderr else ""
    assert not where.exists()
    where.write_text("not a socket")
    refused = prefixroute("epp", "--config", path, "--unix-socket", str(where),
                          "--admin-port", "0")
    assert refused.returncode == 2 and "not a socket" in refused.stderr
