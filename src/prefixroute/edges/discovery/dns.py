"""Membership from DNS: the A/AAAA or SRV records of a name, re-resolved on an interval.

A Kubernetes headless Service answers with one record per ready pod, so pods that become
ready join and pods that stop (or fail readiness) leave. ``record: a`` asks for A and AAAA
records and puts each address on the configured ``port``; ``record: srv`` asks for SRV
records (``_http._tcp.NAME`` style names) and resolves each target to its addresses, on the
record's port. Each address becomes a backend named ``host:port`` with the
``backend_defaults`` settings.

The answer is the whole list: a name that does not exist (NXDOMAIN) or has no records of the
type is an empty fleet (scaled to zero). A query that fails (timeout, no server answered,
SERVFAIL) says nothing about the fleet: the previous list stays and the failure is logged
once. Queries go through ``dnspython`` to the configured server (``HOST:PORT``), or to the
system's resolvers.
"""

from __future__ import annotations

import ipaddress
from typing import Any

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from prefixroute.core.errors import InputError
from prefixroute.edges.discovery.events import Member, MembershipEvent
from prefixroute.edges.discovery.source import ListedSource
from prefixroute.edges.gateway.config import DnsDiscovery, parse_backend_list



class DnsLookupFailed(Exception):
    """No usable answer: the fleet's size is unknown (not zero)."""


def _resolver(config: DnsDiscovery) -> dns.asyncresolver.Resolver:
    if config.server is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        host, _, port = config.server.rpartition(":")
        resolver.nameservers = [host.strip("[]")]
        resolver.port = int(port)
    resolver.lifetime = config.timeout_s
    resolver.timeout = config.timeout_s
    resolver.cache = None  # every interval asks again: the point is to see changes
    return resolver


def _url(address: str, port: int) -> str:
    host = f"[{address}]" if ipaddress.ip_address(address).version == 6 else address
    return f"http://{host}:{port}"


class DnsSource(ListedSource):
    """Membership from the DNS records of one name (module docstring)."""

    def __init__(self, config: DnsDiscovery, defaults: dict[str, Any]):
        self.config = config
        self.defaults = defaults
        self.interval_s = config.interval_s
        self.name = f"dns:{config.name}"
        super().__init__()
        self._resolver = _resolver(config)

    async def _addresses(self, name: str) -> list[str]:
        """A and AAAA addresses of ``name``; [] if it has none; DnsLookupFailed if unknown."""
        found: list[str] = []
        for rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
            try:
                answer = await self._resolver.resolve(name, rdtype, search=False)
            except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
                continue
            except dns.exception.DNSException as exc:
                raise DnsLookupFailed(f"{dns.rdatatype.to_text(rdtype)} {name}: "
                                      f"{type(exc).__name__}: {exc}") from None
            found.extend(record.address for record in answer)
        return found

    async def _targets(self) -> list[tuple[str, int]]:
        """(address, port) of every record of the configured name."""
        if self.config.record == "a":
            return [(a, self.config.port) for a in await self._addresses(self.config.name)]
        try:
            answer = await self._resolver.resolve(self.config.name, dns.rdatatype.SRV,
                                                  search=False)
        except (dns.resolver.NXDOMAIN, dns.resolver.NoAnswer):
            return []
        except dns.exception.DNSException as exc:
            raise DnsLookupFailed(f"SRV {self.config.name}: {type(exc).__name__}: "
                                  f"{exc}") from None
        out = []
        for record in answer:
            port = self.config.port or record.port
            for address in await self._addresses(record.target.to_text()):
                out.append((address, port))
        return out

    async def resolve(self) -> dict[str, Member]:
        """The members the records list now; DnsLookupFailed if the lookup failed."""
        urls = sorted({_url(address, port) for address, port in await self._targets()})
        try:
            listed = parse_backend_list([{"url": url} for url in urls], self.name,
                                        self.defaults)
        except InputError as exc:  # backend_defaults were checked at load: not expected
            raise DnsLookupFailed(str(exc)) from None
        return {backend.name: Member(backend) for backend, _, _ in listed}

    async def poll(self) -> list[MembershipEvent]:
        """The events since the last poll (none if the lookup failed)."""
        try:
            members = await self.resolve()
        except DnsLookupFailed as exc:
            return self.refuse_listing(str(exc), "DNS lookup failed")
        return self.take_listing(members)
