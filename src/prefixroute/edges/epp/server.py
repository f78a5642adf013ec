"""Running the Endpoint Picker: the ext_proc gRPC server and an HTTP admin port, one event loop.

The admin port serves the gateway's own endpoints, from the same :class:`Gateway` object
``serve`` runs (so the same code answers them): ``GET /health``, ``GET /metrics``
(Prometheus), ``GET /debug/decisions`` (authenticated as in ``serve``: a tenant sees its own
decisions, an ``admin`` tenant all of them and the replicas' state). It does not proxy:
requests go through Envoy.

The gRPC server is grpclib's: it speaks HTTP/2 on the event loop itself (h2), so a message
costs no thread hand-off. grpcio's asyncio server, which the EPP ran on before, completes
each message on its own poller thread that must take the GIL and wake the loop, about 20
context switches per request; behind the same Envoy, the EPP on grpclib carried 1.2 to 1.6
times the requests per second at about three quarters of the CPU per request, its Envoy's
included (``benchmarks/results/epp.md``).

SIGTERM or SIGINT drains as ``serve`` does: the EPP goes on answering, ``/health`` answers
503 ``draining`` (so the data plane takes it out), and open exchanges (streams included) get
``shutdown_grace_s`` to finish; then the gRPC server closes what is left and the gateway
stops (health checks, KV event subscribers, connections). A second signal stops at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
from typing import Any, Iterator

import uvicorn
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext
from grpclib.const import Cardinality, Handler
from grpclib.server import Server, Stream
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

PROCESS_METHOD = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


class ExternalProcessor:
    """The ext_proc service on grpclib: each stream is one :meth:`EndpointPicker.Process`.
    (Envoy opens one stream per HTTP request; past the server's limit of streams on a
    connection it opens another connection, so the limit bounds nothing but a connection.)"""

    def __init__(self, picker: EndpointPicker):
        self.picker = picker

    def __mapping__(self) -> dict[str, Handler]:
        return {PROCESS_METHOD: Handler(self.process, Cardinality.STREAM_STREAM,
                                        ext.ProcessingRequest, ext.ProcessingResponse)}

    async def process(self, stream: Stream) -> None:
        async for response in self.picker.Process(stream, None):
            await stream.send_message(response)


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
    server = Server([ExternalProcessor(EndpointPicker(gateway, settings))])
    try:
        if grpc_address.startswith("unix:"):
            await server.start(path=grpc_address[len("unix:"):])
            where = grpc_address
        else:
            host, port = grpc_address.rsplit(":", 1)
            sock = bind_socket(host.strip("[]"), int(port))
            await server.start(sock=sock)
            where = f"{host}:{sock.getsockname()[1]}"
    except OSError as exc:
        admin_sock.close()
        raise ConfigError(f"cannot listen for gRPC on {grpc_address}: {exc.strerror or exc}"
                          ) from None
    except ConfigError:
        admin_sock.close()
        raise
    admin = _AdminServer(uvicorn.Config(
        admin_app(gateway), lifespan="off", log_config=log_config, log_level=log_level,
        access_log=False, proxy_headers=False))
    signals = 0
    stopping, stop_now = asyncio.Event(), asyncio.Event()

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        (stopping if signals == 1 else stop_now).set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    try:
        gateway.pool.open_event_streams()
        await gateway.start()
        admin_task = asyncio.create_task(admin.serve(sockets=[admin_sock]))
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        log.info("listening", extra={"fields": {
            "event": "listening", "grpc": where, "admin": listen_url(admin_sock)}})
        await stopping.wait()
        gateway.draining = True
        log.info("draining", extra={"fields": {
            "event": "draining", "open_requests": gateway.open_requests,
            "drain_s": config.shutdown_grace_s}})
        deadline = loop.time() + config.shutdown_grace_s
        while gateway.open_requests and loop.time() < deadline and not stop_now.is_set():
            await asyncio.sleep(0.05)
        admin.should_exit = True
        await admin_task
    finally:
        server.close()  # (cancels the exchanges still open: their attempts end abandoned)
        await server.wait_closed()
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
    # uvloop, as serve: the gRPC server's HTTP/2 runs on the event loop.
    import uvloop

    return uvloop.run(run_epp(config, settings, grpc_address, admin_host, admin_port,
                              tokenizer=tokenizer, log_config=log_config, log_level=log_level))
