"""A fleet that changes, over real sockets: emulator replicas, a real dnsmasq, the gateway
as ``prefixroute serve``. dnsmasq comes from Debian (scripts/setup_test_services.sh, run by
scripts/test.sh); without it these tests skip and say why."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from prefixroute.edges.discovery.dns import DnsSource
from prefixroute.edges.discovery.events import ADDED, REMOVED
from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.gateway.config import DnsDiscovery, hash_api_key
from prefixroute.edges.loadtest.dns import Dnsmasq, dnsmasq_path
from prefixroute.edges.loadtest.fleet import ServiceProcess

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import fleet_changes  # noqa: E402

needs_dnsmasq = pytest.mark.skipif(
    dnsmasq_path() is None, reason="dnsmasq is not installed: scripts/setup_test_services.sh "
    "(apt-get install -y dnsmasq) could not install it here")


def kinds(events):
    return [(e.kind, e.name) for e in events]


@needs_dnsmasq
def test_dns_source_follows_a_real_dnsmasq(tmp_path):
    with Dnsmasq(tmp_path, srv=[("_http._tcp.svc.fleet.test", "pod-a.fleet.test", 8123)]) \
            as server:
        server.set_records([("127.0.0.1", "svc.fleet.test"), ("127.0.0.2", "svc.fleet.test"),
                            ("127.0.0.3", "pod-a.fleet.test")])

        async def scenario():
            a = DnsSource(DnsDiscovery("svc.fleet.test.", 8000, 1.0, server.server), {})
            assert kinds(await a.poll()) == [(ADDED, "127.0.0.1:8000"),
                                             (ADDED, "127.0.0.2:8000")]
            assert a.members["127.0.0.1:8000"].backend.url == "http://127.0.0.1:8000"
            server.set_records([("127.0.0.2", "svc.fleet.test")])  # SIGHUP: re-read
            assert kinds(await a.poll()) == [(REMOVED, "127.0.0.1:8000")]
            server.set_records([])  # the name is gone: NXDOMAIN, an empty fleet
            assert kinds(await a.poll()) == [(REMOVED, "127.0.0.2:8000")]

            srv = DnsSource(DnsDiscovery("_http._tcp.svc.fleet.test.", None, 1.0,
                                         server.server, "srv"), {"models": ["tiny"]})
            server.set_records([("127.0.0.3", "pod-a.fleet.test")])
            events = await srv.poll()
            assert kinds(events) == [(ADDED, "127.0.0.3:8123")]  # the record's port
            assert events[0].member.backend.models == ("tiny",)

            # A server that does not answer says nothing about the fleet: the list stays.
            srv._resolver.nameservers = ["127.0.0.1"]
            srv._resolver.port = 9  # discard: nothing answers
            srv._resolver.lifetime = srv._resolver.timeout = 0.3
            assert await srv.poll() == []
            assert set(srv.members) == {"127.0.0.3:8123"} and "Timeout" in srv.last_error

        asyncio.run(scenario())


@needs_dnsmasq
@pytest.mark.slow
def test_a_changing_fleet_under_load_loses_no_request(tmp_path):
    """Joins through the file and DNS get traffic within 5 s; a drained replica finishes its
    requests and gets no new one; a reload's new key works at once; removed replicas leave
    after their last request; 0 failed requests throughout."""
    result = fleet_changes.run_scenario(tmp_path, workers=6, max_seconds=150.0)
    assert result.problems() == [], result.line()
    assert result.failed == 0 and result.requests > 30


def _gateway(tmp_path: Path, config: dict) -> ServiceProcess:
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(config))

    def command(port: int) -> list[str]:
        return [sys.executable, "-m", "prefixroute", "serve", "--config", str(path),
                "--host", "127.0.0.1", "--port", str(port)]

    return ServiceProcess("gateway", command, log_path=tmp_path / "gateway.log")


def test_sighup_reloads_and_an_invalid_file_is_logged_and_refused(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("s" * 64)
    replica = EmulatorProcess(["--served-model-name", "tiny"],
                              log_path=tmp_path / "replica.log")
    config = {"server_secret": {"file": str(secret)},
              "backends": [{"name": "r0", "url": "", "models": ["tiny"]}],
              "tenants": [{"name": "a", "api_key_sha256": hash_api_key("key-a")}]}
    with replica:
        config["backends"][0]["url"] = replica.url
        gateway = _gateway(tmp_path, config)
        with gateway:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
            late = {"authorization": "Bearer key-late"}
            assert httpx.post(gateway.url + "/v1/completions", json=body, headers=late,
                              timeout=30).status_code == 401
            bad = dict(config, tenants=[{"name": "a"}])
            (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(bad))
            os.kill(gateway.process.pid, signal.SIGHUP)
            deadline = time.monotonic() + 20
            log = tmp_path / "gateway.log"
            while '"reload_refused"' not in log.read_text() and time.monotonic() < deadline:
                time.sleep(0.1)
            refused = [json.loads(line) for line in log.read_text().splitlines()
                       if '"reload_refused"' in line]
            assert refused and "tenants[0]" in refused[0]["error"]
            good = dict(config, tenants=[*config["tenants"], {
                "name": "late", "api_key_sha256": hash_api_key("key-late")}])
            (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(good))
            os.kill(gateway.process.pid, signal.SIGHUP)
            status = None
            while time.monotonic() < deadline:
                status = httpx.post(gateway.url + "/v1/completions", json=body,
                                    headers=late, timeout=30).status_code
                if status == 200:
                    break
                time.sleep(0.1)
            assert status == 200
