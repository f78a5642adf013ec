"""Running the gateway: uvicorn with uvloop and httptools on a socket bound up front.

The listening socket is bound before uvicorn starts, so a port that is taken is a clear
start-up error (exit 2), not a log line from inside the server.

SIGTERM or SIGINT starts a graceful shutdown that ends within ``shutdown_grace_s``: first the
gateway *drains*: it still accepts connections, ``/health`` answers 503 ``draining`` (so load
balancers take it out) and open requests finish. When none is left, or
:data:`CUT_FLUSH_S` before the grace ends, every stream still open ends with an OpenAI-style
error event (``server_shutdown``) and ``data: [DONE]``; then uvicorn stops accepting and
gives the ends of those streams :data:`CUT_FLUSH_S` to leave; then the gateway closes its
backend connections and KV event subscribers. A second signal stops draining at once.
"""

from __future__ import annotations

import gc
import logging
import signal
import time

import uvicorn

from prefixroute.edges.gateway.app import Gateway
from prefixroute.edges.gateway.config import GatewayConfig
from prefixroute.edges.gateway.guard import guarded_protocol
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


def tune_gc_once_started() -> None:
    """Once a server has started: what start-up left is collected and frozen out of every
    later collection, and young collections wait for :data:`GC_THRESHOLDS`."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


# What the shutdown keeps, inside the grace, for the streams it cuts to send their error
# event and close: their last writes are small and leave at once unless a caller stopped
# reading.
CUT_FLUSH_S = 1


class _Server(uvicorn.Server):
    """Drains before uvicorn's own shutdown (module docstring): the first stop signal marks
    the gateway as draining and starts the drain's clock; the server's tick (every 0.1 s)
    ends the drain, cutting what is still open, and only then lets uvicorn stop."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, grace_s: float):
        super().__init__(config)
        self.gateway = gateway
        self.drain_s = max(0.0, grace_s - CUT_FLUSH_S)
        self.drain_until: float | None = None
        self.drain_logged = False

    def handle_exit(self, sig, frame) -> None:  # type: ignore[override]
        self.gateway.draining = True
        if self.drain_until is None and sig in (signal.SIGTERM, signal.SIGINT):
            self.drain_until = time.monotonic() + self.drain_s  # logged by the next tick
            return
        super().handle_exit(sig, frame)  # a second signal: stop now

    async def on_tick(self, counter: int) -> bool:
        if self.drain_until is not None and not self.should_exit:
            if not self.drain_logged:
                self.drain_logged = True
                log.info("draining", extra={"fields": {
                    "event": "draining", "open_requests": self.gateway.open_requests,
                    "drain_s": self.drain_s}})
            if not self.gateway.open_requests or time.monotonic() >= self.drain_until:
                cut = self.gateway.cut_streams()
                if cut:
                    log.warning("streams cut by the shutdown", extra={"fields": {
                        "event": "streams_cut", "streams": cut}})
                self.should_exit = True
        return await super().on_tick(counter)


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
            gateway.app, loop="uvloop", lifespan="on",
            # uvicorn's httptools protocol behind limits on each request's head (guard.py)
            http=guarded_protocol(config.limits.max_header_bytes,
                                  config.limits.header_timeout_s),
            log_config=log_config, log_level=log_level, access_log=False,
            # The gateway reads neither the client's address nor the scheme (tenants are
            # API keys): no X-Forwarded-* middleware frame on every request.
            proxy_headers=False,
            timeout_keep_alive=KEEP_ALIVE_S,
            timeout_graceful_shutdown=CUT_FLUSH_S), gateway, config.shutdown_grace_s)
        tune_gc_once_started()
        # uvicorn names no address when it is handed a socket: say where callers connect.
        log.info("listening", extra={"fields": {"event": "listening",
                                                "url": listen_url(sock)}})
        server.run(sockets=[sock])
    finally:
        gateway.pool.close_event_streams()
        sock.close()
    return 0 if server.started else 1
