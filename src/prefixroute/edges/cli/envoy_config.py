"""``prefixroute envoy-config``: print an Envoy bootstrap that routes through ``prefixroute epp``.

``prefixroute envoy-config --config gateway.yaml --listen 127.0.0.1:8080 --epp
127.0.0.1:9002 [--fail-open] > envoy.yaml``, then ``envoy -c envoy.yaml``. What the
bootstrap sets and why: docs/envoy.md.
"""

from __future__ import annotations

import sys

from prefixroute.core.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser("envoy-config", help="print an Envoy bootstrap (YAML) for the "
                              "Endpoint Picker", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", metavar="FILE", required=True, help="the EPP's gateway.yaml")
    p.add_argument("--listen", metavar="HOST:PORT", required=True,
                   help="where Envoy takes callers' requests")
    p.add_argument("--epp", metavar="HOST:PORT", required=True, action="append",
                   help="the EPP's gRPC address (prefixroute epp --port); repeat it for "
                        "several EPP processes (share their state with shared_state)")
    p.add_argument("--request-body", choices=["buffered", "streamed"], default="buffered",
                   help="how Envoy hands the request body to the EPP: buffered whole "
                        "(default; no headers message on the completions routes) or "
                        "streamed in chunks (FULL_DUPLEX_STREAMED, no whole-body buffer)")
    p.add_argument("--fail-open", action="store_true",
                   help="let requests through when the EPP is down: unauthenticated, "
                        "unsalted, round robin (default: fail closed, Envoy answers 503)")
    p.add_argument("--original-dst", action="store_true",
                   help="an ORIGINAL_DST cluster routing on the header instead of "
                        "override_host (no fallback endpoints; needs epp.fallback_endpoints: 0)")
    p.add_argument("--admin", metavar="HOST:PORT", help="Envoy's admin listener (default: none)")
    p.set_defaults(handler=run)


def run(args) -> int:
    from prefixroute.edges.epp.config import load_epp_config
    from prefixroute.edges.epp.envoy import render

    config, settings = load_epp_config(args.config)
    if args.original_dst and settings.fallback_endpoints:
        raise ConfigError("--original-dst routes on one ip:port, but the EPP names "
                          f"{settings.fallback_endpoints} fallback endpoint(s) after it; set "
                          "epp: {fallback_endpoints: 0} in the config, or drop --original-dst")
    text = render(config, args.listen, args.epp, fail_open=args.fail_open,
                  original_dst=args.original_dst, admin=args.admin,
                  request_body=args.request_body,
                  trusted_tenant_header=settings.trusted_tenant_header)
    sys.stdout.write(text)
    return 0
