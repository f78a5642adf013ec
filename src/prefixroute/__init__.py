"""prefixroute: prefix-cache identity, caches, routing, gateway, emulator, simulator,
economics and diagnostics for LLM serving fleets.

Layout: ``core/`` is the pure core (no I/O, time injected); ``edges/`` holds
the adapters around it (CLI, HTTP gateway and emulator server, ZMQ KV events, trace files).
"""

__version__ = "0.1.0"
