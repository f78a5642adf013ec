"""The base of the interpreted policies: defaults for the optional hooks of the Policy protocol
(:mod:`prefixroute.core.routing.base`, which also exports it).

Its own module, never compiled: where the core is compiled (setup.py), the policies on this
base stay interpreted, and pickle and copy with their state as any Python object does."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from prefixroute.core.routing.base import Decision, RequestView


class BasePolicy:
    """Defaults for the optional hooks; policies override what they use."""

    name: ClassVar[str] = "base"

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        pass

    def on_completed(self, request: RequestView, replica: int, cached_tokens: int) -> None:
        pass

    def on_unreported(self, request: RequestView, replica: int, ran: bool) -> None:
        pass

    def on_replica_reset(self, replica: int) -> None:
        pass

    def describe(self) -> dict:
        """Parameters as configured (shown by the CLI and the gateway)."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}
