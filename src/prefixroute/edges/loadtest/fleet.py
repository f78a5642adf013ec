"""A local fleet: emulator replicas and one router in front of them, as child processes.

Every process runs on a free 127.0.0.1 port in its own session and is stopped by the id
``Popen`` returned (SIGTERM, then SIGKILL), on success, errors and Ctrl-C alike: the lifecycle
is the emulator's :class:`~prefixroute.edges.emulator.process.EmulatorProcess`, reused for the
gateway (``prefixroute serve``) and for peer routers.

The gateway gets a configuration written into the fleet's temporary directory: the replicas,
the policy under test, one tenant (API key and trust group) per workload tenant, and a random
server secret in a file readable only by its owner.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
from pathlib import Path
from typing import Callable, Iterable, Sequence

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.gateway.config import hash_api_key

# Engine counters read before and after a run, per replica (vLLM's names, which the emulator
# serves): finished requests, prompt tokens, and prompt tokens found in the prefix cache.
REPLICA_COUNTERS = {"vllm:request_success": "requests", "vllm:prompt_tokens": "prompt_tokens",
                    "vllm:prefix_cache_hits": "cached_tokens"}


class ServiceProcess(EmulatorProcess):
    """Any local HTTP service with ``GET /health``, run with the emulator's lifecycle.

    ``command_for_port(port)`` gives the command line; ``name`` is what error messages call
    it."""

    def __init__(self, name: str, command_for_port: Callable[[int], list[str]], **kwargs):
        super().__init__(**kwargs)
        self.name = name
        self._command_for_port = command_for_port

    def command(self) -> list[str]:
        cmd = self._command_for_port(self.port)
        if self.cpu is not None:
            cmd = ["taskset", "-c", str(self.cpu), *cmd]
        return cmd

    def start(self) -> "ServiceProcess":
        try:
            super().start()
        except RuntimeError as exc:
            raise RuntimeError(str(exc).replace("emulator", self.name, 1)) from None
        return self


def replica_counters(url: str, timeout: float = 5.0) -> dict[str, float]:
    """The replica's :data:`REPLICA_COUNTERS`, summed over label sets."""
    text = httpx.get(url + "/metrics", timeout=timeout).text
    out = {name: 0.0 for name in REPLICA_COUNTERS.values()}
    for family in text_string_to_metric_families(text):
        key = REPLICA_COUNTERS.get(family.name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                out[key] += sample.value
    return out


class LocalFleet:
    """``replicas`` emulator processes and, one at a time, a gateway in front of them."""

    def __init__(self, workdir: str | os.PathLike, replicas: int,
                 replica_args: Sequence[str] = (), *, tenants: Iterable[str] = (),
                 model: str = "emulated", cpus: Sequence[int | None] | None = None):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.replicas = [
            EmulatorProcess([*replica_args, "--served-model-name", model,
                             "--seed", str(i)],
                            cpu=None if not cpus else cpus[i % len(cpus)],
                            log_path=self.workdir / f"replica-{i}.log")
            for i in range(replicas)]
        # One key per tenant; each tenant its own trust group (its own cache salt).
        self.api_keys = {tenant: f"sk-{tenant}-{secrets.token_hex(8)}" for tenant in tenants}
        self.gateway: ServiceProcess | None = None
        self.more_gateways: list[ServiceProcess] = []  # start_gateway(instances=N > 1)
        self._secret_path = self.workdir / "server-secret"

    @property
    def replica_urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def start_replicas(self) -> None:
        for replica in self.replicas:
            replica.start()

    def reset_replicas(self) -> None:
        """Empty every replica's prefix cache, so the next run starts cold."""
        for url in self.replica_urls:
            response = httpx.post(url + "/reset_prefix_cache", timeout=10.0)
            response.raise_for_status()
            if response.json().get("success") is False:  # vLLM refuses while requests run
                raise RuntimeError(f"{url} did not reset its prefix cache (requests running?)")

    def counters(self) -> list[dict[str, float]]:
        return [replica_counters(url) for url in self.replica_urls]

    def gateway_config(self, policy: str, backend_fields: dict | None = None,
                       **extra) -> dict:
        """``backend_fields`` go into every backend entry, ``extra`` at the top level."""
        if not self._secret_path.exists():
            self._secret_path.touch(mode=0o600)
            self._secret_path.write_text(secrets.token_hex(32))
        config = {
            "server_secret": {"file": str(self._secret_path)},
            "policy": policy,
            "backends": [{"name": f"r{i}", "url": url, "models": [self.model],
                          **(backend_fields or {})}
                         for i, url in enumerate(self.replica_urls)],
            "tenants": [{"name": tenant, "api_key_sha256": hash_api_key(key)}
                        for tenant, key in self.api_keys.items()],
        }
        config.update(extra)
        return config

    def start_gateway(self, policy: str, *, cpu: int | None = None,
                      backend_fields: dict | None = None, instances: int = 1,
                      env: dict[str, str] | None = None, **extra) -> ServiceProcess:
        """Start ``prefixroute serve`` with ``policy`` (stopping a previous gateway first);
        ``instances`` > 1 starts that many with the same configuration (the first is
        returned, the others are in :attr:`more_gateways`). ``env``: the processes'
        environment (for example another version's ``PYTHONPATH``; default: ours)."""
        self.stop_gateway()
        slug = policy.split(":", 1)[0]
        path = self.workdir / f"gateway-{slug}.yaml"
        config = self.gateway_config(policy, backend_fields, **extra)
        path.write_text(yaml.safe_dump(config, sort_keys=False))

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "prefixroute", "serve", "--config", str(path),
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]

        self.gateway = ServiceProcess("gateway", command, cpu=cpu, env=env,
                                      log_path=self.workdir / f"gateway-{slug}.log")
        self.gateway.start()
        for i in range(1, instances):
            self.more_gateways.append(ServiceProcess(
                f"gateway{i + 1}", command, cpu=cpu, env=env,
                log_path=self.workdir / f"gateway-{slug}-{i + 1}.log"))
            self.more_gateways[-1].start()
        return self.gateway

    @property
    def gateway_urls(self) -> list[str]:
        return [g.url for g in [self.gateway, *self.more_gateways] if g is not None]

    def stop_gateway(self) -> None:
        """Stop the gateway (every instance of it)."""
        gateways, self.more_gateways = self.more_gateways, []
        gateway, self.gateway = self.gateway, None
        for process in [*gateways, gateway]:
            if process is not None:
                process.stop()

    def stop(self) -> None:
        """Stop every process this fleet started (each by its own id), the gateway first."""
        with contextlib.suppress(Exception):
            self.stop_gateway()
        for replica in self.replicas:
            with contextlib.suppress(Exception):
                replica.stop()

    def __enter__(self) -> "LocalFleet":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
