"""A watched membership file: a YAML or JSON list of backends, re-read when it changes.

The file holds ``backends[]`` entries as in ``gateway.yaml`` (each may add ``draining: true``
and ``generation: N``); fields an entry omits come from ``backend_defaults``. It is checked
every ``interval_s`` (its size, modification time and inode: cheap, and an editor's
rename-over counts as a change); a change is parsed whole and turned into events against the
previous list. An empty file means no replicas. A file that cannot be read or parsed is
logged once and the old list stays: a typo must not empty the fleet. Write the new file
beside the old one and rename it over, so a half-written file is never read.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prefixroute.core.errors import InputError
from prefixroute.edges.discovery.events import Member, MembershipEvent
from prefixroute.edges.discovery.source import ListedSource
from prefixroute.edges.gateway.config import parse_backend_list
from prefixroute.edges.yaml_reader import load_yaml



def read_members(path: Path, defaults: dict[str, Any]) -> dict[str, Member]:
    """The members a membership file lists; :class:`InputError` (file, line, field) if it
    cannot be read or is not a valid list."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError("membership file not found", where=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the membership file: {exc}", where=str(path)) from None
    if not text.strip():
        return {}
    data = load_yaml(path, "membership")
    return {backend.name: Member(backend, draining, generation)
            for backend, draining, generation in parse_backend_list(data, str(path), defaults)}


class FileSource(ListedSource):
    """Membership from a watched file (module docstring)."""

    def __init__(self, path: Path, defaults: dict[str, Any], interval_s: float = 1.0):
        self.path = Path(path)
        self.defaults = defaults
        self.interval_s = interval_s
        self.name = f"file:{self.path}"
        super().__init__()
        self._signature: tuple[int, int, int] | None = None

    def _stat(self) -> tuple[int, int, int] | None:
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        return (st.st_mtime_ns, st.st_size, st.st_ino)

    async def poll(self) -> list[MembershipEvent]:
        """The events since the last poll (none if the file did not change or is bad)."""
        return self.poll_now()

    def poll_now(self) -> list[MembershipEvent]:
        signature = self._stat()
        if signature is not None and signature == self._signature:
            return []
        self._signature = signature
        try:
            members = read_members(self.path, self.defaults)
        except InputError as exc:
            return self.refuse_listing(str(exc), "membership file invalid")
        return self.take_listing(members)
