"""What every membership source does with a fresh listing: one rule for both kinds.

A source (a watched file, a DNS name) reads its whole list each time. A listing that could
not be read keeps the previous list: a typo or a DNS outage must not empty the fleet. The
failure is logged once per distinct error (not once per poll), and a good listing clears
it; the events are :func:`~prefixroute.edges.discovery.events.diff_members` of the two
lists.
"""

from __future__ import annotations

import logging

from prefixroute.edges.discovery.events import Member, MembershipEvent, diff_members

log = logging.getLogger("prefixroute.gateway")


class ListedSource:
    """Holds a source's last good list (``members``) and its last logged error."""

    name: str

    def __init__(self) -> None:
        self.members: dict[str, Member] = {}
        self.last_error: str | None = None

    def take_listing(self, members: dict[str, Member]) -> list[MembershipEvent]:
        """A listing read whole: the events from the previous list to it."""
        self.last_error = None
        events = diff_members(self.members, members, self.name)
        self.members = members
        return events

    def refuse_listing(self, error: str, what: str) -> list[MembershipEvent]:
        """A listing that could not be read (``what`` says why in the log): no events."""
        if error != self.last_error:
            self.last_error = error
            log.warning(f"{what}; keeping the previous list",
                        extra={"fields": {"event": "membership_invalid", "source": self.name,
                                          "error": error,
                                          "replicas_kept": sorted(self.members)}})
        return []
