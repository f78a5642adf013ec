"""Membership sources: where the replicas of a fleet come from while it runs.

A source watches one place (the static ``backends`` list of the config, a watched file, the
DNS records of a name) and says what changed as :class:`~.events.MembershipEvent` s:
a replica was **added**, **removed**, is **draining** (takes no new requests), or was
**reset** (same address, restarted engine: its cache is empty). Sources know nothing about
routing policies or HTTP; a body (the gateway's :class:`~prefixroute.edges.gateway.fleet.Fleet`,
an Endpoint Picker) applies the events to its backend set and the lifecycle runner.
"""

from prefixroute.edges.discovery.events import (ADDED, DRAINING, REMOVED, RESET, Member,
                                                MembershipEvent, diff_members)

__all__ = ["ADDED", "DRAINING", "REMOVED", "RESET", "Member", "MembershipEvent",
           "diff_members"]
