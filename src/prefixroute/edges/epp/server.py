"""Running the Endpoint Picker: the ext_proc gRPC server and an HTTP admin port, one event loop.

The admin port serves the gateway's own endpoints, from the same :class:`Gateway` object
``serve`` runs (so the same code answers them): ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /debug/decisions`` (authenticated as in ``serve``: a tenant sees its own
decisions, an ``admin`` tenant all of them and the replicas' state). It does not proxy:
requests go through Envoy.

The gRPC server is :mod:`prefixroute.edges.epp.http2`, on the event loop: a message costs a
frame parse and a protobuf parse, with no hand-off between threads and no task per stream
(that module says why no gRPC library). It allows
:data:`~prefixroute.edges.epp.http2.MAX_STREAMS` concurrent streams per HTTP/2 connection
and refuses more: a data plane must open a new connection before that (the bootstrap of
``prefixroute envoy-config`` caps Envoy at :data:`~prefixroute.edges.epp.envoy.
EPP_STREAMS_PER_CONNECTION`).

SIGTERM or SIGINT drains as ``serve`` does: the EPP goes on answering, ``/health`` answers
503 ``draining`` (so a health-checking data plane takes it out), and open exchanges get
``shutdown_grace_s`` to finish. Then every stream still open, and any new one, is answered
``UNAVAILABLE`` (Envoy fails the request open or closed as configured, at once rather than at
its message timeout), and the gateway stops (health checks, KV event subscribers,
connections). A second signal ends the drain at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
from typing import Any, Iterator

import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from prefixroute.core.errors import ConfigError
from prefixroute.edges.epp.config import EppSettings
from prefixroute.edges.epp.envoy import buffer_limit
from prefixroute.edges.epp.http2 import MAX_GRPC_MESSAGE, GrpcServer
from prefixroute.edges.epp.picker import EndpointPicker
from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.logs import setup_json_logging
from prefixroute.edges.gateway.server import tune_gc_once_started
from prefixroute.edges.listen import bind_socket, listen_url

log = logging.getLogger("prefixroute.epp")

LISTEN_BACKLOG = 128  # Envoy holds few connections to an EPP
CLOSE_ANSWER_S = 2.0  # how long the streams ended at shutdown get to take their answer
# A message carries the request body Envoy buffered (up to its buffer limit) and the
# attributes with it.
MESSAGE_OVERHEAD = 1 << 20


def admin_app(gateway: Gateway) -> Starlette:
    """The admin endpoints, answered by the gateway's own handlers."""
    return Starlette(routes=[
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/debug/decisions", gateway.debug_decisions, methods=["GET"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
    ])


class _AdminServer(uvicorn.Server):
    """The admin port's server, which leaves the stop signals to the EPP: uvicorn's own
    handlers would stop it at the first signal, taking ``/health`` away during the drain."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_epp(config: GatewayConfig, settings: EppSettings, grpc_address: str,
                  admin_host: str, admin_port: int, *, tokenizer: Any = None,
                  log_config: dict | None = None, log_level: str = "info") -> int:
    gateway = Gateway(config, tokenizer=tokenizer)
    admin_sock = bind_socket(admin_host, admin_port)
    try:
        grpc_sock, where = grpc_socket(grpc_address)
    except ConfigError:
        admin_sock.close()
        raise
    picker = EndpointPicker(gateway, settings)
    server = GrpcServer(picker.open, max_message=max(
        MAX_GRPC_MESSAGE, buffer_limit(config) + MESSAGE_OVERHEAD))
    admin = _AdminServer(uvicorn.Config(
        admin_app(gateway), lifespan="off", log_config=log_config, log_level=log_level,
        access_log=False, proxy_headers=False))
    stopping, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:  # the first starts the drain, a second ends it
        (stop_now if stopping.is_set() else stopping).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    started = False
    try:
        gateway.pool.open_event_streams()
        await gateway.start()  # (before any exchange: replicas, discovery, shared state)
        await server.start(grpc_sock)
        started = True
        admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]))
        tune_gc_once_started()
        log.info("listening", extra={"fields": {
            "event": "listening", "grpc": where, "admin": listen_url(admin_sock)}})
        await stopping.wait()
        log.info("draining", extra={"fields": {
            "event": "draining", "open_requests": gateway.open_requests,
            "drain_s": config.shutdown_grace_s}})
        await gateway.drain(config.shutdown_grace_s, interrupted=stop_now)
        admin.should_exit = True
        await admin_task
    finally:
        picker.shutdown()  # what is still open ends UNAVAILABLE, and no new stream is taken
        if started:
            server.close()
            await server.wait_closed(CLOSE_ANSWER_S)
        else:
            grpc_sock.close()
        await gateway.stop(grace_s=0.0)  # (the drain above had the grace)
        gateway.pool.close_event_streams()
        admin_sock.close()
        if where.startswith("unix:"):
            with contextlib.suppress(OSError):
                os.unlink(where[len("unix:"):])
    return 0


def grpc_socket(address: str) -> tuple[socket.socket, str]:
    """The gRPC listening socket, bound and listening before anything starts (a taken port
    or path is a start-up error, exit 2; connections wait in the backlog until the server
    takes them), and where it listens. ``unix:PATH``: a socket file nobody listens on (an
    EPP that exited) is replaced; one that answers is in use; anything else there is
    refused."""
    if not address.startswith("unix:"):
        host, port = address.rsplit(":", 1)
        sock = bind_socket(host.strip("[]"), int(port))
        _listen(sock, address)
        return sock, f"{host}:{sock.getsockname()[1]}"
    path = address[len("unix:"):]
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot listen for gRPC on {address}: {exc.strerror}") from None
    else:
        if not stat.S_ISSOCK(mode):
            raise ConfigError(f"cannot listen for gRPC on {address}: the path exists and is "
                              "not a socket")
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(path)
            except ConnectionRefusedError:
                os.unlink(path)  # (nobody listens there)
            except OSError as exc:
                raise ConfigError(f"cannot listen for gRPC on {address}: {exc.strerror}"
                                  ) from None
            else:
                raise ConfigError(f"cannot listen for gRPC on {address}: another process "
                                  "listens there")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    _listen(sock, address, bind_to=path)
    return sock, address


def _listen(sock: socket.socket, address: str, bind_to: str | None = None) -> None:
    try:
        if bind_to is not None:
            sock.bind(bind_to)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen for gRPC on {address}: {exc.strerror or exc}"
                          ) from None


def serve_epp(config: GatewayConfig, settings: EppSettings, grpc_address: str,
              admin_host: str, admin_port: int, *, log_level: str = "info") -> int:
    tokenizer = None
    if config.tokenizer is not None:
        from prefixroute.edges.tokenization import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    log_config = setup_json_logging(log_level)
    # uvloop, as serve: the gRPC server's HTTP/2 runs on the event loop.
    import uvloop

    return uvloop.run(run_epp(config, settings, grpc_address, admin_host, admin_port,
                              tokenizer=tokenizer, log_config=log_config, log_level=log_level))
