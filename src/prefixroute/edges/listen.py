"""The listening socket of a server this package runs (the gateway, the emulator replica).

Bound before uvicorn starts, so that a port that is taken is a one-line start-up error (exit 2)
rather than a log line from inside the server and an exit code of its own.
"""

from __future__ import annotations

import socket

from prefixroute.core.errors import ConfigError


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.set_inheritable(True)
    return sock


def listen_url(sock: socket.socket) -> str:
    """``http://host:port`` of a bound socket: the port the system chose for port 0, an IPv6
    host in brackets."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
