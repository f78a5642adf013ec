"""Run ``prefixroute replica`` as a child process: for tests, demos and load generators.

:class:`EmulatorProcess` starts the emulator on a free local port (unless one is given), waits
until ``GET /health`` answers, and on ``stop()`` signals only the process it started (its own
session, by the id ``Popen`` returned: SIGTERM, then SIGKILL). The child dies with this process
too, even when it is killed with SIGKILL (:mod:`prefixroute.edges.children`).

    with EmulatorProcess(["--num-blocks", "64", "--time-scale", "0"]) as replica:
        httpx.post(replica.url + "/v1/completions", json={...})
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

import httpx

from prefixroute.edges import children
from prefixroute.edges.listen import free_port

STARTUP_TIMEOUT_S = 60.0


class EmulatorProcess:
    """One ``prefixroute replica`` child process on 127.0.0.1."""

    def __init__(self, args: Sequence[str] = (), *, port: int | None = None,
                 cpu: int | None = None, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None,
                 startup_timeout: float = STARTUP_TIMEOUT_S):
        self.port = port or free_port()
        self.args = list(args)
        self.cpu = cpu
        self.env = env
        self.startup_timeout = startup_timeout
        self.log_path = Path(log_path) if log_path else Path(
            tempfile.mkstemp(prefix="prefixroute-replica-", suffix=".log")[1])
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "prefixroute", "replica", "--host", "127.0.0.1",
               "--port", str(self.port), *self.args]
        if self.cpu is not None:
            cmd = ["taskset", "-c", str(self.cpu), *cmd]
        return cmd

    def start(self) -> "EmulatorProcess":
        env = dict(os.environ if self.env is None else self.env)
        with open(self.log_path, "ab") as log:
            self.process = children.spawn(self.command(), env=env, stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        with httpx.Client(timeout=1.0) as client:
            while time.monotonic() < deadline:
                if self.process is None or self.process.poll() is not None:
                    raise RuntimeError(f"emulator exited during startup; log:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/health").status_code == 200:
                        return
                time.sleep(0.1)
        raise RuntimeError(f"emulator not healthy after {self.startup_timeout:.0f} s; log:\n"
                           f"{self.log_tail()}")

    def stop(self) -> None:
        proc, self.process = self.process, None
        children.stop(proc)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> "EmulatorProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
