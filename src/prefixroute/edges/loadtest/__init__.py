"""Driving real HTTP load at a fleet: local processes (emulator replicas and a router in front
of them), the design-scenario workload as request bodies, and a replayer that measures TTFT
and cached tokens per request. Used by ``prefixroute demo`` and ``benchmarks/gateway_bench.py``.
"""
