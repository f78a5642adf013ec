"""Adapters around the pure core: CLI, HTTP (gateway, emulator server), ZMQ, trace files."""
