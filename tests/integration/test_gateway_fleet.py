"""A real fleet for gateway tests: emulator replicas (``prefixroute replica``) and a gateway
(``prefixroute serve``) as subprocesses on 127.0.0.1, on free ports, stopped by PID.

``Fleet`` is imported by the other ``test_gateway_*`` integration modules; the test here only
checks that a fleet starts, answers and stops cleanly. Everything skips until the emulator's
``replica`` subcommand exists.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from prefixroute.edges import children
from prefixroute.edges.gateway.config import hash_api_key
from prefixroute.edges.listen import free_port

SECRET = "integration-test-server-secret-0123456789-0123456789"
KEYS = {"a": "sk-int-a", "b": "sk-int-b", "ops": "sk-int-ops"}
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


def _replica_help() -> str | None:
    result = subprocess.run([sys.executable, "-m", "prefixroute", "replica", "--help"],
                            capture_output=True, text=True, timeout=60)
    return result.stdout if result.returncode == 0 else None


REPLICA_HELP = _replica_help()
needs_emulator = pytest.mark.skipif(REPLICA_HELP is None,
                                    reason="the emulator ('prefixroute replica') is "
                                           "not built yet")


def wait_healthy(url: str, process: subprocess.Popen, log: Path,
                 timeout: float = START_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} not healthy after {timeout:.0f} s:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        time.sleep(0.1)


def stop_process(process: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    """Stop one process this fleet started, by its PID (its own session: its group)."""
    children.stop(process, sig, STOP_TIMEOUT_S)


class Fleet:
    """N emulator replicas and one gateway in front of them."""

    def __init__(self, directory: Path, replicas: int = 2, *, block_size: int = 16,
                 replica_args: list[str] | None = None,
                 per_replica_args: dict[int, list[str]] | None = None,
                 gateway: dict[str, Any] | None = None, kv_events: bool = False,
                 replicas_bind_events: bool = False):
        self.directory = directory
        self.block_size = block_size
        self.replica_args = replica_args or []
        self.per_replica_args = per_replica_args or {}
        self.gateway_extra = gateway or {}
        self.kv_events = kv_events
        # vLLM binds its event socket at ``tcp://*:PORT`` and every gateway connects: the way
        # to feed several gateway instances (the default has the gateway bind, vLLM connect).
        self.replicas_bind_events = replicas_bind_events
        self.more_gateways: list[subprocess.Popen] = []
        self.ports = [free_port() for _ in range(replicas)]
        self.kv_ports = [free_port() for _ in range(replicas)]
        self.replicas: list[subprocess.Popen | None] = [None] * replicas
        self.gateway: subprocess.Popen | None = None
        self.gateway_port = free_port()
        self.model = "tiny"

    # -- addresses ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gateway_port}"

    def replica_host(self, i: int) -> str:
        return "127.0.0.1"

    def replica_url(self, i: int) -> str:
        return f"http://{self.replica_host(i)}:{self.ports[i]}"

    def log(self, name: str) -> Path:
        return self.directory / f"{name}.log"

    # -- lifecycle ----------------------------------------------------------------------
    def start_replica(self, i: int, wait: bool = True) -> None:
        cmd = [sys.executable, "-m", "prefixroute", "replica", "--host", self.replica_host(i),
               "--port", str(self.ports[i]), "--block-size", str(self.block_size),
               "--seed", str(i)]
        if self.kv_events:
            host = "*" if self.replicas_bind_events else "127.0.0.1"
            cmd += ["--kv-events", f"tcp://{host}:{self.kv_ports[i]}"]
        cmd += self.replica_args + self.per_replica_args.get(i, [])
        log = self.log(f"replica{i}")
        with open(log, "ab") as out:
            self.replicas[i] = children.spawn(cmd, stdout=out, stderr=subprocess.STDOUT,
                                              stdin=subprocess.DEVNULL)
        if wait:
            wait_healthy(self.replica_url(i), self.replicas[i], log)

    def kill_replica(self, i: int, sig: int = signal.SIGKILL) -> None:
        stop_process(self.replicas[i], sig)

    def config(self) -> dict[str, Any]:
        backends = []
        for i in range(len(self.ports)):
            backend: dict[str, Any] = {"name": f"r{i}", "url": self.replica_url(i),
                                       "models": [self.model]}
            if self.kv_events:
                host = "*" if self.replicas_bind_events else "127.0.0.1"
                backend["kv_events"] = {"endpoint": f"tcp://{host}:{self.kv_ports[i]}"}
            backends.append(backend)
        config: dict[str, Any] = {
            "server_secret": {"env": "PR_INTEGRATION_SECRET"},
            "hashing": {"block_size": self.block_size},
            "backends": backends,
            "tenants": [
                {"name": "a", "api_key_sha256": hash_api_key(KEYS["a"]), "trust_group": "a"},
                {"name": "b", "api_key_sha256": hash_api_key(KEYS["b"]), "trust_group": "b"},
                {"name": "ops", "api_key_sha256": hash_api_key(KEYS["ops"]), "admin": True},
            ],
            "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
        }
        config.update(self.gateway_extra)
        return config

    def start_gateway(self) -> None:
        self.gateway = self._serve(self.gateway_port, "gateway")

    def start_another_gateway(self) -> str:
        """One more gateway instance with the same configuration; returns its URL."""
        port = free_port()
        self.more_gateways.append(self._serve(port, f"gateway{len(self.more_gateways) + 2}"))
        return f"http://127.0.0.1:{port}"

    def _serve(self, port: int, name: str) -> subprocess.Popen:
        path = self.directory / f"{name}.yaml"
        path.write_text(json.dumps(self.config(), indent=2))
        log = self.log(name)
        with open(log, "ab") as out:
            process = children.spawn(
                [sys.executable, "-m", "prefixroute", "serve", "--config", str(path),
                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, env={**os.environ, "PR_INTEGRATION_SECRET": SECRET})
        wait_healthy(f"http://127.0.0.1:{port}", process, log)
        return process

    def start(self) -> "Fleet":
        try:
            for i in range(len(self.ports)):
                self.start_replica(i, wait=False)
            for i in range(len(self.ports)):
                wait_healthy(self.replica_url(i), self.replicas[i], self.log(f"replica{i}"))
            if self.ports:  # (else the model named at construction)
                models = httpx.get(self.replica_url(0) + "/v1/models",
                                   timeout=5).json()["data"]
                self.model = models[0]["id"]
            self.start_gateway()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for process in self.more_gateways:
            stop_process(process)
        stop_process(self.gateway)
        for process in self.replicas:
            stop_process(process)

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # -- clients ------------------------------------------------------------------------
    def client(self, tenant: str = "a", **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant], max_retries=0,
                             timeout=kwargs.pop("timeout", 60), **kwargs)

    def async_client(self, tenant: str = "a", **kwargs: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEYS[tenant],
                                  max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs)

    def decisions(self, n: int = 20, url: str | None = None) -> list[dict]:
        return self.debug(n, url)["decisions"]

    def debug(self, n: int = 20, url: str | None = None) -> dict:
        """A gateway's ``/debug/decisions`` (the first gateway's unless ``url``)."""
        response = httpx.get(f"{url or self.url}/debug/decisions?n={n}",
                             headers={"authorization": f"Bearer {KEYS['ops']}"}, timeout=10)
        response.raise_for_status()
        return response.json()

    def metric(self, name: str, **labels: str) -> float:
        """Sum of a gateway metric's samples whose labels include ``labels``."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            head, _, value = line.rpartition(" ")
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                total += float(value)
        return total


@needs_emulator
def test_a_fleet_starts_answers_and_stops(tmp_path):
    with Fleet(tmp_path, replicas=2) as fleet:
        result = fleet.client().completions.create(model=fleet.model, prompt="hello",
                                                   max_tokens=2)
        assert result.choices
        # Each says where it listens: the replica on stderr, the gateway in its JSON log.
        assert f"on {fleet.replica_url(0)}:" in fleet.log("replica0").read_text()
        listening = [json.loads(line) for line in fleet.log("gateway").read_text().splitlines()
                     if '"listening"' in line]
        assert [e["url"] for e in listening] == [f"http://127.0.0.1:{fleet.gateway_port}"]
        pids = [p.pid for p in fleet.replicas] + [fleet.gateway.pid]
    for pid in pids:  # every process we started is gone
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
