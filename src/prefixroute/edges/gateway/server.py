"""Running the gateway: uvicorn with uvloop and httptools on a socket bound up front.

The listening socket is bound before uvicorn starts, so a port that is taken is a clear
start-up error (exit 2), not a log line from inside the server. SIGTERM or SIGINT starts a
graceful shutdown: uvicorn stops accepting connections and gives open requests (streams
included) ``shutdown_grace_s`` to finish; then the gateway closes its backend connections and
KV event subscribers.
"""

from __future__ import annotations

import gc
import logging

import uvicorn

from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.logs import setup_json_logging
from prefixroute.edges.listen import bind_socket, listen_url

log = logging.getLogger("prefixroute.gateway")

KEEP_ALIVE_S = 75  # longer than common client idle pools, so clients close first (nginx: 75 s)
# Young-generation collections after this many net allocations instead of CPython's 700: a
# proxied request allocates thousands of short-lived objects, and at 700 the collector ran
# ~14 times a second under load for about 3% of the gateway's CPU, its pauses showing in p99
# latency (benchmarks/gateway_bench.py, measured with gc.callbacks). Objects that live through
# start-up are frozen out of every collection (gc.freeze, as the gc docs advise for servers).
GC_THRESHOLDS = (20_000, 20, 50)


class _Server(uvicorn.Server):
    """Marks the gateway as draining the moment a stop signal arrives, so ``/health`` answers
    503 while open requests finish and load balancers stop sending new ones."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway):
        super().__init__(config)
        self.gateway = gateway

    def handle_exit(self, sig, frame) -> None:  # type: ignore[override]
        self.gateway.draining = True
        super().handle_exit(sig, frame)


def serve(config: GatewayConfig, host: str, port: int, *, log_level: str = "info") -> int:
    tokenizer = None
    if config.tokenizer is not None:
        from prefixroute.edges.tokenization import load_tokenizer

        tokenizer = load_tokenizer(config.tokenizer)
    log_config = setup_json_logging(log_level)
    gateway = Gateway(config, tokenizer=tokenizer)
    sock = bind_socket(host, port)
    try:
        gateway.pool.open_event_streams()
        server = _Server(uvicorn.Config(
            gateway.app, loop="uvloop", http="httptools", lifespan="on",
            log_config=log_config, log_level=log_level, access_log=False,
            # The gateway reads neither the client's address nor the scheme (tenants are
            # API keys): no X-Forwarded-* middleware frame on every request.
            proxy_headers=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=int(config.shutdown_grace_s + 0.999)), gateway)
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        # uvicorn names no address when it is handed a socket: say where callers connect.
        log.info("listening", extra={"fields": {"event": "listening",
                                                "url": listen_url(sock)}})
        server.run(sockets=[sock])
    finally:
        gateway.pool.close_event_streams()
        sock.close()
    return 0 if server.started else 1
