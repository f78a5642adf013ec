"""Membership events, and the one rule that turns two snapshots of a source into them.

A source reads its whole list each time (a file, a DNS answer); :func:`diff_members` compares
it with the previous one, by backend name:

* a name that appears: ``added`` (then ``draining`` if it arrives draining);
* a name that disappears: ``removed`` (its in-flight requests finish; then its state goes);
* same name, other settings (address, models, KV events endpoint...): ``removed`` then
  ``added``: the old replica's learned state describes another engine;
* same settings, ``draining`` turned on: ``draining``; turned off: ``added`` (it is back);
* same settings, a higher ``generation`` (the operator restarted the engine at the same
  address): ``reset``: the router forgets what it learned of its cache.

Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixroute.edges.gateway.config import BackendConfig

ADDED, REMOVED, DRAINING, RESET = "added", "removed", "draining", "reset"


@dataclass(frozen=True, slots=True)
class Member:
    """One replica as a source lists it."""

    backend: BackendConfig
    draining: bool = False
    generation: int = 0

    @property
    def name(self) -> str:
        return self.backend.name


@dataclass(frozen=True, slots=True)
class MembershipEvent:
    """``kind`` (ADDED, REMOVED, DRAINING, RESET) of the replica ``name``; ``member``: its
    listing (``None`` for REMOVED). ``source``: which source said so (for logs)."""

    kind: str
    name: str
    member: Member | None = None
    source: str = ""


def diff_members(old: dict[str, Member], new: dict[str, Member],
                 source: str = "") -> list[MembershipEvent]:
    """The events that take a body from ``old`` to ``new`` (module docstring), removals
    first, so a name that moved to another address is free again when it is added."""
    events: list[MembershipEvent] = []
    adds: list[MembershipEvent] = []
    for name, before in old.items():
        after = new.get(name)
        if after is None:
            events.append(MembershipEvent(REMOVED, name, None, source))
        elif after.backend != before.backend:
            events.append(MembershipEvent(REMOVED, name, None, source))
            adds.append(MembershipEvent(ADDED, name, after, source))
            if after.draining:
                adds.append(MembershipEvent(DRAINING, name, after, source))
        else:
            if after.generation > before.generation:
                events.append(MembershipEvent(RESET, name, after, source))
            if after.draining and not before.draining:
                events.append(MembershipEvent(DRAINING, name, after, source))
            elif before.draining and not after.draining:
                events.append(MembershipEvent(ADDED, name, after, source))
    for name, after in new.items():
        if name not in old:
            adds.append(MembershipEvent(ADDED, name, after, source))
            if after.draining:
                adds.append(MembershipEvent(DRAINING, name, after, source))
    return events + adds
