"""The Endpoint Picker's configuration: the gateway's ``gateway.yaml`` plus an optional
``epp:`` section.

The EPP reads the very file ``prefixroute serve`` reads (backends, tenants, server secret,
hashing, policy, limits...), so one file describes the fleet whichever body routes it. The
``epp:`` section holds what only the Endpoint Picker needs:

``trusted_tenant_header`` (default: none)
    When set, the tenant is *named* in this request header by a gateway in front of Envoy
    that has already authenticated the caller, and the EPP does not check an API key. Only
    safe when every request reaches Envoy through that gateway and the gateway overwrites
    the header on every request (docs/envoy.md, "Trust"). Unset: every request must carry
    ``Authorization: Bearer KEY`` of a configured tenant, exactly as with ``serve``.
``fallback_endpoints`` (default: the config's ``retries``)
    How many endpoints after the picked one the EPP names, in order, for Envoy to go down
    when an attempt fails (the Endpoint Picker Protocol's comma-separated list; Envoy's
    ``override_host`` load balancer walks it on retries).

Every replica URL must name its host by IP address: Envoy routes to the ``ip:port`` the EPP
names, and a name would need a resolver on both sides agreeing.
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from prefixroute.core.errors import InputError
from prefixroute.edges.gateway.config import GatewayConfig, parse_config
from prefixroute.edges.yaml_reader import ConfigReader, load_yaml

SECTION = "epp"


@dataclass(frozen=True, slots=True)
class EppSettings:
    trusted_tenant_header: str | None = None
    fallback_endpoints: int = 2


def endpoint_of(url: str) -> str | None:
    """``ip:port`` of an ``http://IP:PORT`` URL (IPv6 in brackets), or ``None`` when the host
    is a name or the URL has a path Envoy would not add."""
    parts = urlsplit(url)
    host = parts.hostname
    if parts.scheme != "http" or not host or parts.path not in ("", "/"):
        return None
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return None
    return address_of(str(address), parts.port or 80)


def address_of(host: str, port: int) -> str:
    """``ip:port`` as the EPP names endpoints to Envoy (an IPv6 address in brackets)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def load_epp_config(path: str | os.PathLike) -> tuple[GatewayConfig, EppSettings]:
    """Read ``path``: the gateway config (validated as ``serve`` validates it) and the
    ``epp:`` section. :class:`InputError` names file, line and field."""
    path = Path(path)
    data = load_yaml(path, "config")
    section = None
    if isinstance(data, dict) and SECTION in data:
        section = data.pop(SECTION)
        line = getattr(data, "lines", {}).get(SECTION, 1)
    config = parse_config(data, str(path), path.parent)
    settings = EppSettings(fallback_endpoints=config.retries)
    if section is not None:
        reader = ConfigReader(str(path), section if section is not None else {}, SECTION, line)
        header = reader.string("trusted_tenant_header")
        if header is not None:
            header = header.lower()
            if header in ("authorization", "host", "content-length") or header.startswith(":"):
                reader.fail(f"{header!r} cannot carry the tenant's name",
                            "trusted_tenant_header")
        fallbacks = reader.integer("fallback_endpoints", config.retries, minimum=0)
        reader.finish()
        settings = EppSettings(header, fallbacks)
    for i, backend in enumerate(config.backends):
        if endpoint_of(backend.url) is None:
            raise InputError(f"backend {backend.name!r}: the Endpoint Picker names replicas to "
                             f"Envoy as ip:port, so its url must be http://IP:PORT with no "
                             f"path, got {backend.url!r}", where=str(path),
                             field=f"backends[{i}].url")
    return config, settings
