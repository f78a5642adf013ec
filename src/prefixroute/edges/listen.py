"""The listening socket of a server this package runs (the gateway, the emulator replica), and
the ports handed to servers that bind later.

Bound before uvicorn starts, so that a port that is taken is a one-line start-up error (exit 2)
rather than a log line from inside the server and an exit code of its own.

Ports a child process binds *later* (a replica's HTTP port, the KV-event endpoint a gateway
binds after vLLM has started connecting to it) come from outside the kernel's ephemeral range.
A port the kernel chose for ``bind(("127.0.0.1", 0))`` lies inside that range, and between
picking it and the child binding it any other process's ``bind(0)`` or outgoing connection may
be given the same port: one real vLLM CPU start listens on about 14 kernel-chosen ports (seen
with ``ss -ltnp``), and in CI one of them was the port a test had drawn for the gateway's KV
events. The kernel never hands out a port outside the range on its own (Linux
``ip_local_port_range``, see ``ip(7)``).
"""

from __future__ import annotations

import errno
import random
import socket
from pathlib import Path

from prefixroute.core.errors import ConfigError

_PORT_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_CHOSEN_PORT = 10_000  # above the well-known and most registered service ports
_CHOICE_TRIES = 200
_MIN_OUTSIDE_PORTS = 1_000
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int] | None:
    """The kernel's ephemeral port range (inclusive), or None where it cannot be read."""
    try:
        low, high = (int(x) for x in _PORT_RANGE_FILE.read_text().split())
    except (OSError, ValueError):
        return None
    return low, high


def _ports_outside_ephemeral_range() -> list[range]:
    span = ephemeral_port_range()
    if span is None:
        return []
    ranges = [range(_LOWEST_CHOSEN_PORT, span[0]), range(span[1] + 1, 65536)]
    return [ports for ports in ranges if len(ports) > 0]


def _enough(outside: list[range]) -> bool:
    return sum(len(ports) for ports in outside) >= _MIN_OUTSIDE_PORTS


def can_avoid_ephemeral_ports() -> bool:
    """Whether :func:`free_port` draws outside the ephemeral range here (at least 1,000 ports
    from 10000 up lie outside it) rather than falling back to a kernel-chosen port."""
    return _enough(_ports_outside_ephemeral_range())


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now that the kernel does not hand to other programs meanwhile.

    Random among the ports from ``10000`` to 65535 outside the ephemeral range, checked by
    binding it without ``SO_REUSEADDR`` (so a port in TIME_WAIT counts as taken), and never the
    same port twice in one process. Where the range is unknown or leaves fewer than 1,000 such
    ports, or none of 200 random draws is free, it falls back to a kernel-chosen port: one in
    the range, with the race above, and not checked against the ports handed out before.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    outside = _ports_outside_ephemeral_range()
    if _enough(outside):
        rng = random.SystemRandom()
        for _ in range(_CHOICE_TRIES):
            ports = rng.choices(outside, weights=[len(p) for p in outside])[0]
            port = rng.choice(ports)
            if port in _handed_out:
                continue
            with socket.socket(family, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def port_in_use_hint(port: int, error_number: int | None) -> str:
    """What to add to an "address in use" error when the port is one the kernel hands out."""
    span = ephemeral_port_range()
    if error_number != errno.EADDRINUSE or span is None or not span[0] <= port <= span[1]:
        return ""
    return (f" (port {port} is in this machine's ephemeral range {span[0]}-{span[1]}, which the "
            f"kernel gives to other programs' connections; choose a port outside it)")


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}"
                          f"{port_in_use_hint(port, exc.errno)}") from None
    sock.set_inheritable(True)
    return sock


def listen_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket: the port the system chose for port 0, an IPv6
    host in brackets."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
