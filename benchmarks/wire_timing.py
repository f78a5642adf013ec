"""Time a request spends inside a router, read from its packets on the loopback interface.

The hop measure of ``gateway_bench.py`` (client TTFT minus the replica's own interval) also
holds the client's and the replica's socket and event-loop waits, and on this 2-core machine
those share one core with the load generator: the no-router hop alone is 4 to 10 ms at p50
and moves by milliseconds from run to run, which buries a router's millisecond. The packets
say what the router itself adds, request by request, on one clock (the kernel's capture
timestamps):

    inside = (request leaves for the replica - request arrives from the client)
           + (first event leaves for the client - first event arrives from the replica)

that is, everything between the router's two sockets, its wake-ups, parsing, routing and
event loop included; the time the bytes take through the loopback device itself (microseconds)
is not in it, and is the same with or without a router. It needs ``tcpdump`` and the right to
capture (root or CAP_NET_RAW); the capture runs on the load generator's core, so it takes no
CPU from the router's.

How packets are told apart, HTTP/1.1 without pipelining: on each connection, the segments the
caller sends up to the first segment of the answer are the request, so its last segment is
when the request was complete; the first answer segment holding ``data:`` carries the first
server-sent event. Every benchmark request carries a unique tag (the body's ``user``), which
all routers forward: it joins the client's connection to the router's upstream one. Direct
requests (client to replica) carry tags too, but never pass the router's port, so they never
join.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Callable

from prefixroute.core.simulator.metrics import percentile
from prefixroute.edges import children

try:
    import dpkt
except ImportError:  # the benchmark's extra (pip install -e '.[bench]')
    dpkt = None

TAG = re.compile(rb"hop-[0-9a-f]{6}-[0-9]+")
EVENT = b"data:"
SNAPLEN = 2048  # a benchmark request (about 600 bytes) whole, and the head of an answer
# Only segments that carry bytes: pure ACKs are half the packets and say nothing here.
PAYLOAD_FILTER = "(ip[2:2] - ((ip[0] & 0xf) << 2) - ((tcp[12] & 0xf0) >> 2)) != 0"


def unavailable(workdir: Path) -> str | None:
    """Why packets cannot be captured here (None when they can): a short trial capture."""
    if dpkt is None:
        return "dpkt is not installed (pip install -e '.[bench]')"
    if shutil.which("tcpdump") is None:
        return "tcpdump is not installed (e.g. apt-get install tcpdump)"
    trial = workdir / "trial.pcap"
    try:
        Capture(trial, [9]).start().stop()
    except (RuntimeError, OSError) as exc:
        return f"tcpdump cannot capture on lo here (root or CAP_NET_RAW needed): {exc}"
    finally:
        trial.unlink(missing_ok=True)
    return None


class Capture:
    """``tcpdump`` on ``lo`` for the given TCP ports, segments with payload only, pinned to
    ``cpu``; :meth:`stop` ends it and returns how many packets the kernel dropped."""

    def __init__(self, path: Path, ports: list[int], cpu: int | None = None,
                 snaplen: int = SNAPLEN) -> None:
        self.path = path
        ports_filter = " or ".join(f"port {p}" for p in ports)
        self.command = ["tcpdump", "-i", "lo", "-n", "-s", str(snaplen), "-B", "65536",
                        "--time-stamp-precision=nano", "-w", str(path),
                        f"tcp and ({ports_filter}) and {PAYLOAD_FILTER}"]
        if cpu is not None:
            self.command = ["taskset", "-c", str(cpu), *self.command]
        self.process: subprocess.Popen | None = None

    def start(self) -> "Capture":
        self.process = children.spawn(self.command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
        # tcpdump says "listening on lo" once the filter is attached; until then packets
        # would be missed.
        assert self.process.stderr is not None
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            line = self.process.stderr.readline()
            if "listening on" in line:
                return self
            if not line and self.process.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"tcpdump did not start: {' '.join(self.command)}")

    def stop(self) -> int:
        """End the capture (SIGINT: tcpdump flushes its file) and return the kernel's drop
        count from its summary (-1 if it gave none)."""
        if self.process is None:
            return -1
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
        try:
            _, err = self.process.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            _, err = self.process.communicate()
        self.process = None
        match = re.search(r"(\d+) packets? dropped by kernel", err or "")
        return int(match.group(1)) if match else -1


class _Conn:
    """One TCP connection's alternation of requests and answers."""

    __slots__ = ("sending", "last_sent", "payload", "tag", "awaiting_event")

    def __init__(self) -> None:
        self.sending = False       # inside a request (the caller's turn)
        self.last_sent = 0.0       # timestamp of the request's latest segment
        self.payload = bytearray()  # the request so far (to find its tag)
        self.tag: bytes | None = None
        self.awaiting_event = False


def router_times(path: Path, router_port: int, replica_ports: set[int],
                 ) -> dict[str, tuple[float, float, float, float]]:
    """tag -> (request in, request out, first event in, first event out), seconds, for every
    request that passed the router on ``router_port`` to a replica on ``replica_ports``."""
    assert dpkt is not None
    # Per side, tag -> (request complete, first event) on that side's connection.
    front: dict[bytes, list[float]] = {}
    back: dict[bytes, list[float]] = {}
    conns: dict[tuple, _Conn] = {}
    with open(path, "rb") as fh:
        for ts, frame in dpkt.pcap.Reader(fh):
            ip = dpkt.ethernet.Ethernet(frame).data
            tcp = ip.data
            data = tcp.data
            if not data:
                continue
            if tcp.dport == router_port or tcp.dport in replica_ports:
                key, to_server = (tcp.sport, tcp.dport), True
            elif tcp.sport == router_port or tcp.sport in replica_ports:
                key, to_server = (tcp.dport, tcp.sport), False
            else:
                continue
            conn = conns.get(key)
            if conn is None:
                conn = conns[key] = _Conn()
            side = front if key[1] == router_port else back
            if to_server:
                if not conn.sending:  # a new request on this connection
                    conn.sending, conn.payload, conn.tag = True, bytearray(), None
                    conn.awaiting_event = False
                conn.last_sent = float(ts)
                if conn.tag is None:
                    conn.payload += data
                    found = TAG.search(conn.payload)
                    if found:
                        conn.tag = found.group()
                continue
            if conn.sending:  # the answer begins: the request was complete
                conn.sending = False
                if conn.tag is not None:
                    side[conn.tag] = [conn.last_sent, -1.0]
                    conn.awaiting_event = True
            if conn.awaiting_event and EVENT in data:
                conn.awaiting_event = False
                side[conn.tag][1] = float(ts)
    out = {}
    for tag, (req_in, event_out) in front.items():
        other = back.get(tag)
        if other is None or event_out < 0 or other[1] < 0:
            continue
        out[tag.decode()] = (req_in, other[0], other[1], event_out)
    return out


def summarize(times: dict[str, tuple[float, float, float, float]], tags: list[list[str]],
              dropped: int) -> dict:
    """Percentiles of the time inside the router over the counted requests ``tags`` (one
    list per half of the run), in seconds; both legs separately too."""

    def stats(names: list[str]) -> dict:
        inside, request, event = [], [], []
        for name in names:
            t = times.get(name)
            if t is None:
                continue
            request.append(t[1] - t[0])
            event.append(t[3] - t[2])
            inside.append(request[-1] + event[-1])
        # percentile() is None for no values, as is every figure here then.
        return {"p50_s": percentile(inside, 50), "p90_s": percentile(inside, 90),
                "p99_s": percentile(inside, 99), "max_s": max(inside) if inside else None,
                "mean_s": sum(inside) / len(inside) if inside else None,
                "request_p50_s": percentile(request, 50),
                "request_p99_s": percentile(request, 99),
                "event_p50_s": percentile(event, 50), "event_p99_s": percentile(event, 99),
                "joined": len(inside), "unjoined": len(names) - len(inside)}

    out = stats([name for half in tags for name in half])
    out["halves"] = [stats(half) for half in tags]
    out["dropped_packets"] = dropped
    return out


def measure(path: Path, router_port: int, replica_ports: set[int], cpu: int | None,
            run: Callable[[], Any], tags_of: Callable[[Any], list[list[str]]]
            ) -> tuple[Any, dict]:
    """``run()`` under a capture; returns (its result, the router-time summary over the
    requests ``tags_of(result)`` names). The capture file is removed afterwards."""
    capture = Capture(path, [router_port, *sorted(replica_ports)], cpu).start()
    try:
        result = run()
    finally:
        dropped = capture.stop()
    try:
        times = router_times(path, router_port, replica_ports)
    finally:
        os.unlink(path)
    return result, summarize(times, tags_of(result), dropped)
