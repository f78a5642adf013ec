"""Running the Endpoint Picker: the ext_proc gRPC server and an HTTP admin port, one event loop.

The admin port serves the gateway's own endpoints, from the same :class:`Gateway` object
``serve`` runs (so the same code answers them): ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /debug/decisions`` (authenticated as in ``serve``: a tenant sees its own
decisions, an ``admin`` tenant all of them and the replicas' state). It does not proxy:
requests go through Envoy.

SIGTERM or SIGINT: the gRPC server stops taking new exchanges and gives open ones
``shutdown_grace_s`` to finish (streams included), then the gateway stops (health checks, KV
event subscribers, connections).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
from typing import Any

import grpc
import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from starlette.applications import Starlette
from starlette.routing import Route

from prefixroute.core.errors import ConfigError
from prefixroute.edges.epp.config import EppSettings
from prefixroute.edges.epp.picker import EndpointPicker
from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.logs import setup_json_logging
from prefixroute.edges.gateway.server import GC_THRESHOLDS
from prefixroute.edges.listen import bind_socket, listen_url

log = logging.getLogger("prefixroute.epp")

# Envoy opens one gRPC stream per HTTP request on a handful of HTTP/2 connections: the
# stream limit per connection is what bounds concurrent requests per Envoy worker, so it is
# set well above the gateway's admission limit (which answers 429 past its queue).
MAX_CONCURRENT_STREAMS = 4096


def admin_app(gateway: Gateway) -> Starlette:
    """The admin endpoints, answered by the gateway's own handlers."""
    return Starlette(routes=[
        Route("/health", gateway.health, methods=["GET"]),
        Route("/metrics", gateway.prometheus, methods=["GET"]),
        Route("/debug/decisions", gateway.debug_decisions, methods=["GET"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
    ])


async def run_epp(config: GatewayConfig, settings: EppSettings, grpc_address: str,
                  admin_host: str, admin_port: int, *, tokenizer: Any = None,
                  log_config: dict | None = None, log_level: str = "info") -> int:
    gateway = Gateway(config, tokenizer=tokenizer)
    admin_sock = bind_socket(admin_host, admin_port)
    server = grpc.aio.server(options=[
        ("grpc.max_concurrent_streams", MAX_CONCURRENT_STREAMS),
        ("grpc.max_receive_message_length", config.limits.max_body_bytes + 65536),
        ("grpc.max_send_message_length", config.limits.max_body_bytes + 65536),
    ])
    ext_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(gateway, settings), server)
    try:
        port = server.add_insecure_port(grpc_address)
    except RuntimeError as exc:
        admin_sock.close()
        raise ConfigError(f"cannot listen for gRPC on {grpc_address}: {exc}") from None
    if port == 0:
        admin_sock.close()
        raise ConfigError(f"cannot listen for gRPC on {grpc_address} (address in use?)")
    admin = uvicorn.Server(uvicorn.Config(
        admin_app(gateway), lifespan="off", log_config=log_config, log_level=log_level,
        access_log=False, proxy_headers=False))
    admin.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    try:
        gateway.pool.open_event_streams()
        await gateway.start()
        await server.start()
        admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]))
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        where = grpc_address if grpc_address.startswith("unix:") else \
            f"{grpc_address.rsplit(':', 1)[0]}:{port}"
        log.info("listening", extra={"fields": {
            "event": "listening", "grpc": where, "admin": listen_url(admin_sock)}})
        await stopping.wait()
        gateway.draining = True
        await server.stop(config.shutdown_grace_s)
        admin.should_exit = True
        await admin_task
    finally:
        await server.stop(0)
        await gateway.stop()
        gateway.pool.close_event_streams()
        admin_sock.close()
    return 0


def serve_epp(config: GatewayConfig, settings: EppSettings, grpc_address: str,
              admin_host: str, admin_port: int, *, log_level: str = "info") -> int:
    tokenizer = None
    if config.tokenizer is not None:
        from prefixroute.edges.tokenization import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    log_config = setup_json_logging(log_level)
    # uvloop, as serve: grpcio's asyncio server runs on it, and its per-message cost (the
    # EPP's main cost) is lower there (benchmarks/results/epp.md).
    import uvloop

    return uvloop.run(run_epp(config, settings, grpc_address, admin_host, admin_port,
                              tokenizer=tokenizer, log_config=log_config, log_level=log_level))
