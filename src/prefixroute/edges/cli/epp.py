"""``prefixroute epp``: the cache-aware router as an Envoy Endpoint Picker (ext_proc, gRPC).

``prefixroute epp --config gateway.yaml --port 9002 [--admin-port 9003]`` serves Envoy's
external processing protocol on 127.0.0.1:9002 (``--host`` to change) and the admin
endpoints (``/health``, ``/metrics``, ``/debug/decisions``) on the admin port. The config is
``serve``'s, plus an optional ``epp:`` section; ``prefixroute envoy-config`` writes the Envoy
side. Reference: docs/envoy.md.
"""

from __future__ import annotations

from prefixroute.core.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser("epp", help="run the router as an Envoy Endpoint Picker "
                              "(ext_proc)", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE", required=True,
                   help="gateway.yaml, with an optional epp: section (docs/envoy.md)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address for gRPC and admin (default 127.0.0.1: local only)")
    p.add_argument("--port", type=int, default=9002,
                   help="gRPC port Envoy calls (default 9002, the Inference Extension's)")
    p.add_argument("--unix-socket", metavar="PATH",
                   help="serve gRPC on this Unix socket instead of --port (Envoy on the same "
                        "host: envoy-config --epp unix:PATH; cheaper per message than TCP)")
    p.add_argument("--admin-port", type=int, default=9003,
                   help="HTTP port of /health, /metrics, /debug/decisions (default 9003)")
    p.add_argument("--log-level", default="info",
                   choices=["debug", "info", "warning", "error"], help="default info")
    p.set_defaults(handler=run)


def run(args) -> int:
    for name in ("port", "admin_port"):
        value = getattr(args, name)
        if not 0 <= value <= 65535:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0-65535, got {value}")
    from prefixroute.edges.epp.config import load_epp_config

    config, settings = load_epp_config(args.config)
    try:
        from prefixroute.edges.epp.server import serve_epp
    except ImportError as exc:  # hpack / xds-protos are the [envoy] extra
        raise ConfigError(f"prefixroute epp needs {exc.name or 'xds-protos'}: "
                          "pip install 'prefixroute[envoy]'") from None

    host = f"[{args.host}]" if ":" in args.host else args.host
    address = f"unix:{args.unix_socket}" if args.unix_socket else f"{host}:{args.port}"
    return serve_epp(config, settings, address, args.host, args.admin_port,
                     log_level=args.log_level)
