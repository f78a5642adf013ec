"""``prefixroute serve``: the OpenAI-compatible, cache-aware gateway in front of replicas.

``prefixroute serve --config gateway.yaml [--host 127.0.0.1] [--port 8000]`` runs it until
SIGTERM/SIGINT (graceful: open streams finish). ``--check`` validates the config and prints
a summary without serving. ``--hash-key`` reads an API key from stdin and prints the SHA-256
hex to store in the config. The config reference is ``docs/gateway.md``.
"""

from __future__ import annotations

import sys

from prefixroute.core.errors import ConfigError
from prefixroute.edges.cli.common import print_json


def register(subparsers) -> None:
    p = subparsers.add_parser("serve", help="run the cache-aware OpenAI-compatible gateway",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE", help="gateway.yaml (see docs/gateway.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="default info")
    p.add_argument("--check", action="store_true",
                   help="validate the config, print a summary (JSON) and exit")
    p.add_argument("--hash-key", action="store_true",
                   help="read an API key from stdin and print the SHA-256 hex the config stores")
    p.set_defaults(handler=run)


def run(args) -> int:
    from prefixroute.edges.gateway.config import hash_api_key, load_config

    if args.hash_key:
        key = sys.stdin.readline().rstrip("\r\n")
        if not key:
            raise ConfigError("--hash-key: no key on stdin")
        print(hash_api_key(key))
        return 0
    if not args.config:
        raise ConfigError("--config FILE is required (see docs/gateway.md)")
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port must be 0-65535, got {args.port}")
    config = load_config(args.config)
    if args.check:
        print_json({
            "config": config.source, "policy": config.policy,
            "tokenizer": str(config.tokenizer) if config.tokenizer else None,
            "tokenization": config.tokenization,
            "block_size": config.hashing.block_size, "hash_algo": config.hashing.algo,
            "backends": [{"name": b.name, "url": b.url, "models": list(b.models),
                          "kv_events": b.kv_events.endpoint if b.kv_events else None}
                         for b in config.backends],
            "discovery": None if config.discovery is None else {
                "file": str(config.discovery.file) if config.discovery.file else None,
                "dns": None if config.discovery.dns is None else {
                    "name": config.discovery.dns.name, "record": config.discovery.dns.record,
                    "port": config.discovery.dns.port, "server": config.discovery.dns.server}},
            "tenants": [{"name": t.name, "trust_group": t.trust_group, "admin": t.admin,
                         "keys": len(t.api_key_hashes)} for t in config.tenants],
            "record": None if config.record is None else {
                "path": str(config.record.path), "rotate_mb": config.record.rotate_mb,
                "keep": config.record.keep, "queue": config.record.queue}})
        return 0
    from prefixroute.edges.gateway.server import serve

    return serve(config, args.host, args.port, log_level=args.log_level)
