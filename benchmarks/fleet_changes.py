"""A fleet that changes under load: replicas join, drain and leave; the config reloads.

Five emulator replicas (``prefixroute replica``), a real DNS server (Debian's ``dnsmasq``) and
one gateway (``prefixroute serve``) with two static replicas, a watched membership file and
DNS discovery. A bounded load (``--workers`` clients in a loop, streaming and not, at most
``--max-requests`` requests and ``--max-seconds``) runs through the gateway while, in order:

1. a replica is added to the membership file: seconds until it gets a request;
2. a replica's address is added to the DNS name: seconds until it gets a request;
3. a static replica is drained through ``POST /admin/backends/{name}/drain``: its requests
   in flight finish, and it is booked no request after the drain;
4. ``POST /admin/reload`` with a config that adds a tenant: its key works at once;
5. a replica is removed from the file, and the DNS one from DNS: each leaves once its last
   request has ended, and only then is its process stopped.

Every request must succeed: ``failed`` counts every answer that is not a 200 (or a stream
that ends in an error event) and every transport error.

Run: ``python benchmarks/fleet_changes.py`` (about 30 s; needs dnsmasq: ``apt-get install
-y dnsmasq``). ``--json`` prints the result as JSON; the exit code is 1 if a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import secrets
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from prefixroute.edges.emulator.process import EmulatorProcess
from prefixroute.edges.gateway.config import hash_api_key
from prefixroute.edges.loadtest.dns import Dnsmasq
from prefixroute.edges.loadtest.fleet import ServiceProcess

MODEL = "fleet-model"
KEYS = {"a": "sk-fleet-a", "ops": "sk-fleet-ops", "late": "sk-fleet-late"}
TRAFFIC_WITHIN_S = 5.0  # a new replica must get a request within this
LEAVE_WITHIN_S = 30.0


@dataclass
class Result:
    requests: int = 0
    failed: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    file_add_to_traffic_s: float | None = None
    dns_add_to_traffic_s: float | None = None
    drain_in_flight: int | None = None
    drained_in_s: float | None = None
    booked_after_drain: int | None = None
    reload_new_key_status: int | None = None
    file_removed_left_in_s: float | None = None
    dns_removed_left_in_s: float | None = None

    def problems(self) -> list[str]:
        out = []
        if self.failed:
            out.append(f"{self.failed} failed requests: {self.failures[:3]}")
        for name in ("file_add_to_traffic_s", "dns_add_to_traffic_s"):
            value = getattr(self, name)
            if value is None or value > TRAFFIC_WITHIN_S:
                out.append(f"{name} = {value} (limit {TRAFFIC_WITHIN_S} s)")
        if self.booked_after_drain != 0:
            out.append(f"drained replica booked {self.booked_after_drain} requests after drain")
        if self.drained_in_s is None:
            out.append("drained replica's requests did not finish")
        if not self.drain_in_flight:
            out.append("nothing was in flight on the drained replica: the drain proved little")
        if self.reload_new_key_status != 200:
            out.append(f"new tenant key after reload answered {self.reload_new_key_status}")
        for name in ("file_removed_left_in_s", "dns_removed_left_in_s"):
            if getattr(self, name) is None:
                out.append(f"{name}: the removed replica did not leave")
        return out

    def line(self) -> str:
        return (f"fleet_changes: {self.requests} requests in {self.seconds:.1f} s, "
                f"{self.failed} failed; traffic after add: file {_s(self.file_add_to_traffic_s)}"
                f", dns {_s(self.dns_add_to_traffic_s)}; drain: {self.drain_in_flight} in "
                f"flight finished in {_s(self.drained_in_s)}, {self.booked_after_drain} booked "
                f"after; reload: new key -> {self.reload_new_key_status}; removed: file left "
                f"in {_s(self.file_removed_left_in_s)}, dns in {_s(self.dns_removed_left_in_s)}")


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


class Load:
    """``workers`` clients sending completions through the gateway until stopped."""

    def __init__(self, url: str, workers: int, max_requests: int):
        self.url = url
        self.workers = workers
        self.max_requests = max_requests
        self.sent = 0
        self.failures: list[str] = []
        self.done = 0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        async with httpx.AsyncClient(timeout=60.0) as client:
            await asyncio.gather(*(self._worker(client, i) for i in range(self.workers)))

    def stop(self) -> None:
        self._stop.set()

    async def _worker(self, client: httpx.AsyncClient, worker: int) -> None:
        n = 0
        while not self._stop.is_set() and self.sent < self.max_requests:
            self.sent += 1
            n += 1
            stream = n % 2 == 0
            # Half share one of three long prefixes (affinity keeps them where they are
            # cached), half are fresh (they go where the load is lowest: a new replica).
            head = f"system prompt {worker % 3} " if n % 4 < 2 else f"fresh {worker}.{n} "
            body = {"model": MODEL, "prompt": head * 20 + f"turn {n}", "max_tokens": 6,
                    "stream": stream}
            error = await send(client, self.url, KEYS["a"], body)
            self.done += 1
            if error is not None:
                self.failures.append(error)


async def send(client: httpx.AsyncClient, url: str, key: str, body: dict) -> str | None:
    """One completion; None if it succeeded, else what went wrong."""
    try:
        if body.get("stream"):
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers={"authorization": f"Bearer {key}"}) as response:
                text = (await response.aread()).decode()
                if response.status_code != 200:
                    return f"{response.status_code}: {text[:200]}"
                if '"error"' in text or "data: [DONE]" not in text:
                    return f"stream: {text[-200:]}"
                return None
        response = await client.post(url + "/v1/completions", json=body,
                                     headers={"authorization": f"Bearer {key}"})
        if response.status_code != 200:
            return f"{response.status_code}: {response.text[:200]}"
        return None
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"


class Scenario:
    def __init__(self, workdir: Path, workers: int, max_requests: int, max_seconds: float):
        self.workdir = workdir
        self.workers = workers
        self.max_requests = max_requests
        self.max_seconds = max_seconds
        args = ["--served-model-name", MODEL, "--max-model-len", "4096"]
        self.replicas = {name: EmulatorProcess([*args, "--seed", str(i)],
                                               log_path=workdir / f"replica-{name}.log")
                         for i, name in enumerate(["s0", "s1", "e", "c", "d"])}
        self.dns = Dnsmasq(workdir)
        self.members = workdir / "members.yaml"
        self.config_path = workdir / "gateway.yaml"
        self.secret = workdir / "secret"
        self.gateway: ServiceProcess | None = None
        self.admin = {"authorization": f"Bearer {KEYS['ops']}"}

    # -- setup ---------------------------------------------------------------------------

    def config(self, tenants: tuple[str, ...] = ("a", "ops")) -> dict[str, Any]:
        return {
            "server_secret": {"file": str(self.secret)},
            "backends": [{"name": name, "url": self.replicas[name].url, "models": [MODEL]}
                         for name in ("s0", "s1")],
            "discovery": {"file": str(self.members), "file_interval_s": 0.5,
                          "dns": {"name": "d.fleet.test", "port": self.replicas["d"].port,
                                  "interval_s": 1.0, "server": self.dns.server}},
            "backend_defaults": {"models": [MODEL]},
            "tenants": [{"name": t, "api_key_sha256": hash_api_key(KEYS[t]),
                         **({"admin": True} if t == "ops" else {})} for t in tenants],
            "health": {"interval_s": 0.5, "metrics_interval_s": 0.5},
            "decisions_kept": 100,
        }

    def write_members(self, names: list[str]) -> None:
        tmp = self.members.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump([{"name": n, "url": self.replicas[n].url}
                                       for n in names]))
        tmp.replace(self.members)

    def write_config(self, config: dict) -> None:
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.replace(self.config_path)

    def start(self) -> None:
        self.secret.write_text(secrets.token_hex(32))
        self.dns.start()
        for replica in self.replicas.values():
            replica.start()
        self.write_members(["e"])
        self.write_config(self.config())
        path = self.config_path

        def command(port: int) -> list[str]:
            return [sys.executable, "-m", "prefixroute", "serve", "--config", str(path),
                    "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"]

        self.gateway = ServiceProcess("gateway", command,
                                      log_path=self.workdir / "gateway.log").start()

    def stop(self) -> None:
        for process in [self.gateway, *self.replicas.values(), self.dns]:
            if process is not None:
                try:
                    process.stop()
                except Exception:  # noqa: BLE001 - stop the others anyway
                    pass

    # -- the gateway's admin API ------------------------------------------------------------

    async def backends(self, client: httpx.AsyncClient) -> dict[str, dict]:
        response = await client.get(self.gateway.url + "/admin/backends", headers=self.admin)
        response.raise_for_status()
        return {b["name"]: b for b in response.json()["data"]}

    async def until(self, client: httpx.AsyncClient, check, timeout: float) -> float | None:
        """Seconds until ``check(backends)`` holds, or None after ``timeout``."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            if check(await self.backends(client)):
                return time.monotonic() - started
            await asyncio.sleep(0.05)
        return None

    # -- the run ---------------------------------------------------------------------------

    async def run(self) -> Result:
        result = Result()
        load = Load(self.gateway.url, self.workers, self.max_requests)
        started = time.monotonic()
        runner = asyncio.create_task(load.run())
        d_name = f"127.0.0.1:{self.replicas['d'].port}"
        try:
            async with httpx.AsyncClient(timeout=60.0) as client:
                await asyncio.sleep(1.0)

                def booked(name: str):
                    return lambda b: name in b and b[name]["assignments"] > 0

                self.write_members(["e", "c"])
                result.file_add_to_traffic_s = await self.until(client, booked("c"), 15.0)
                self.dns.set_records([("127.0.0.1", "d.fleet.test")])
                result.dns_add_to_traffic_s = await self.until(client, booked(d_name), 15.0)

                # Drain while it has requests in flight (they must finish). Requests take
                # milliseconds on an idle machine, so one seen in flight may be done before
                # the drain lands: then undrain and try again (a bounded number of times).
                for _ in range(50):
                    for _ in range(200):
                        if (await self.backends(client))["s1"]["in_flight"] > 0:
                            break
                        await asyncio.sleep(0.01)
                    response = await client.post(self.gateway.url + "/admin/backends/s1/drain",
                                                 headers=self.admin)
                    response.raise_for_status()
                    drained_at = time.monotonic()
                    result.drain_in_flight = response.json()["in_flight"]
                    if result.drain_in_flight:
                        break
                    response = await client.post(
                        self.gateway.url + "/admin/backends/s1/undrain", headers=self.admin)
                    response.raise_for_status()
                booked_at_drain = (await self.backends(client))["s1"]["assignments"]
                response = await client.post(
                    self.gateway.url + "/admin/backends/s1/drain?wait_s=30", headers=self.admin)
                if response.json().get("drained"):
                    result.drained_in_s = time.monotonic() - drained_at

                self.write_config(self.config(("a", "ops", "late")))
                response = await client.post(self.gateway.url + "/admin/reload",
                                             headers=self.admin)
                response.raise_for_status()
                reply = await client.post(
                    self.gateway.url + "/v1/completions",
                    headers={"authorization": f"Bearer {KEYS['late']}"},
                    json={"model": MODEL, "prompt": "a new tenant", "max_tokens": 2})
                result.reload_new_key_status = reply.status_code

                self.write_members(["c"])
                result.file_removed_left_in_s = await self.until(
                    client, lambda b: "e" not in b, LEAVE_WITHIN_S)
                self.replicas["e"].stop()
                self.dns.set_records([])
                result.dns_removed_left_in_s = await self.until(
                    client, lambda b: d_name not in b, LEAVE_WITHIN_S)
                self.replicas["d"].stop()
                await asyncio.sleep(1.0)
                result.booked_after_drain = (
                    (await self.backends(client))["s1"]["assignments"] - booked_at_drain)
        finally:
            load.stop()
            await asyncio.wait_for(runner, self.max_seconds)
        result.seconds = time.monotonic() - started
        result.requests = load.done
        result.failed = len(load.failures)
        result.failures = load.failures[:10]
        return result


def run_scenario(workdir: Path, workers: int = 6, max_requests: int = 20_000,
                 max_seconds: float = 120.0) -> Result:
    """Start everything in ``workdir``, run the scenario, stop everything started."""
    scenario = Scenario(workdir, workers, max_requests, max_seconds)
    try:
        scenario.start()
        return asyncio.run(asyncio.wait_for(scenario.run(), max_seconds))
    finally:
        scenario.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--max-requests", type=int, default=20_000)
    parser.add_argument("--max-seconds", type=float, default=120.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fleet-changes-") as tmp:
        result = run_scenario(Path(tmp), args.workers, args.max_requests, args.max_seconds)
    print(json.dumps(asdict(result)) if args.json else result.line())
    for problem in result.problems():
        print(f"FAILED: {problem}", file=sys.stderr)
    return 1 if result.problems() else 0


if __name__ == "__main__":
    sys.exit(main())
