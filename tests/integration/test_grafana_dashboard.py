"""The Grafana dashboard (examples/grafana/prefixroute-gateway.json) against real data: a
real Prometheus (Debian's ``prometheus``) scrapes a gateway in front of emulator replicas
under a short demo load, and every panel's query returns data."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from prefixroute.edges.listen import free_port
from tests.integration.test_gateway_fleet import Fleet, needs_emulator, stop_process

DASHBOARD = Path(__file__).resolve().parents[2] / "examples/grafana/prefixroute-gateway.json"
PROMETHEUS = shutil.which("prometheus")


def panel_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [(panel["title"], target["expr"]) for panel in dashboard["panels"]
            for target in panel["targets"]]


def test_every_panel_names_metrics_the_gateway_exports():
    from prefixroute.edges.gateway.metrics import GatewayMetrics

    text = GatewayMetrics().render().decode()
    families = {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
    for title, expr in panel_queries():
        used = {word.removesuffix("_bucket") for word in
                expr.replace("(", " ").replace(")", " ").replace("[", " ").split()
                if word.startswith("prefixroute_gateway_")}
        assert used, title
        for name in used:
            base = name.removesuffix("_total")
            assert name in families or base in families, (title, name)


@needs_emulator
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus is not installed (apt-get install "
                    "prometheus; scripts/setup_test_services.sh)")
@pytest.mark.slow
def test_every_panel_returns_data_from_a_real_prometheus(tmp_path):
    with Fleet(tmp_path, replicas=2) as fleet:
        port = free_port()
        config = tmp_path / "prometheus.yml"
        config.write_text(
            "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
            "scrape_configs:\n"
            "  - job_name: prefixroute\n"
            f"    static_configs: [{{targets: ['127.0.0.1:{fleet.gateway_port}']}}]\n")
        with open(tmp_path / "prometheus.log", "ab") as log:
            prometheus = subprocess.Popen(
                [PROMETHEUS, f"--config.file={config}",
                 f"--web.listen-address=127.0.0.1:{port}",
                 f"--storage.tsdb.path={tmp_path / 'tsdb'}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
            clients = {"a": fleet.client("a"), "b": fleet.client("b")}
            started = time.monotonic()
            sent = 0
            while time.monotonic() - started < 8 and sent < 200:  # bounded demo load
                for tenant, client in clients.items():
                    stream = client.completions.create(
                        model=fleet.model, prompt=f"{tenant} shared system prompt " * 12
                        + str(sent % 3), max_tokens=3, stream=True)
                    for _ in stream:
                        pass
                    sent += 1
            missing = []
            deadline = time.monotonic() + 30
            for title, expr in panel_queries():
                while True:
                    answer = httpx.get(url + "/api/v1/query", params={"query": expr},
                                       timeout=10).json()
                    assert answer["status"] == "success", (title, answer)
                    if answer["data"]["result"] or time.monotonic() > deadline:
                        break
                    time.sleep(0.5)
                if not answer["data"]["result"]:
                    missing.append(title)
            assert missing == [], f"panels without data: {missing}"
        finally:
            stop_process(prometheus)
