"""A local DNS server for a local fleet: Debian's ``dnsmasq`` as a plain child process.

It listens on a free 127.0.0.1 port, answers from a hosts file (``address name`` lines) that
:meth:`Dnsmasq.set_records` rewrites and signals it to re-read (``SIGHUP``), and is
authoritative for its ``domain`` (``--local``), so a name without records is an NXDOMAIN
(an empty fleet) rather than a refusal. Started and stopped by its own process id.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Sequence

import dns.message
import dns.query
import dns.rcode

from prefixroute.edges.listen import free_port

STARTUP_TIMEOUT_S = 10.0


def dnsmasq_path() -> str | None:
    """The dnsmasq binary (Debian installs it in /usr/sbin, often not on PATH)."""
    return shutil.which("dnsmasq") or next(
        (p for p in ("/usr/sbin/dnsmasq", "/sbin/dnsmasq") if os.access(p, os.X_OK)), None)


class Dnsmasq:
    """dnsmasq serving ``domain`` from a hosts file in ``directory``.

    ``srv``: static SRV records as (name, target, port), fixed for the process's life
    (dnsmasq re-reads hosts files on SIGHUP, not its SRV options)."""

    def __init__(self, directory: str | os.PathLike, domain: str = "fleet.test",
                 srv: Sequence[tuple[str, str, int]] = ()):
        self.directory = Path(directory)
        self.domain = domain
        self.srv = list(srv)
        self.port = free_port()
        self.hosts = self.directory / "dns-hosts"
        self.log_path = self.directory / "dnsmasq.log"
        self.process: subprocess.Popen | None = None

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> "Dnsmasq":
        binary = dnsmasq_path()
        if binary is None:
            raise RuntimeError("dnsmasq is not installed (apt-get install -y dnsmasq)")
        if not self.hosts.exists():
            self.hosts.write_text("")
        cmd = [binary, "--no-daemon", f"--port={self.port}", "--listen-address=127.0.0.1",
               "--bind-interfaces", "--no-resolv", "--no-hosts", f"--addn-hosts={self.hosts}",
               "--user=root", f"--local=/{self.domain}/", "--log-facility=-"]
        cmd += [f"--srv-host={name},{target},{port}" for name, target, port in self.srv]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_answering()
        return self

    def _wait_answering(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        query = dns.message.make_query(f"probe.{self.domain}.", "A")
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"dnsmasq exited: {self.log_path.read_text()[-2000:]}")
            with contextlib.suppress(Exception):
                answer = dns.query.udp(query, "127.0.0.1", timeout=0.5, port=self.port)
                if answer.rcode() in (dns.rcode.NXDOMAIN, dns.rcode.NOERROR):
                    return
            time.sleep(0.1)
        raise RuntimeError("dnsmasq did not answer within "
                           f"{STARTUP_TIMEOUT_S:.0f} s: {self.log_path.read_text()[-2000:]}")

    def set_records(self, records: Sequence[tuple[str, str]]) -> None:
        """Serve exactly ``records`` ((address, name) pairs) from now on (returns once
        dnsmasq has re-read them)."""
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text("".join(f"{address} {name}\n" for address, name in records))
        tmp.replace(self.hosts)
        if self.process is None or self.process.poll() is not None:
            return
        marker = f"read {self.hosts}"
        seen = self._log().count(marker)
        os.kill(self.process.pid, signal.SIGHUP)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S  # it logs each re-read: wait for it
        while self._log().count(marker) <= seen and time.monotonic() < deadline:
            time.sleep(0.02)

    def _log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)

    def __enter__(self) -> "Dnsmasq":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
