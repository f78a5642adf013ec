"""The one interface between a routing policy and whatever runs it (gateway or simulator).

A policy sees a :class:`RequestView` and one :class:`ReplicaView` per candidate replica and
returns a :class:`Decision`: the chosen replica, the branch it took, every candidate's score
and a human-readable reason. It never knows whether it runs live or simulated: the gateway
fills the views from in-flight counts, backend metrics and KV events; the simulator fills them
from its replica models. Both drive the same
:class:`~prefixroute.core.routing.lifecycle.LifecycleRunner`, which calls every hook below
on the policy, in the same order for the same events.

Policies may keep state (a router's approximate radix tree, cumulative assignments); they are
constructed by name from :mod:`prefixroute.core.routing.registry` with ``key=value``
parameters, and each lives in its own module under ``policies/`` with its source and defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Mapping, Protocol, Sequence

from mypy_extensions import mypyc_attr

# (Defined apart, so that it stays interpreted where this module is compiled: setup.py.)
from prefixroute.core.routing.base_policy import BasePolicy  # noqa: F401


class CacheView(Protocol):
    """What a router believes one replica holds (approximate, event-driven or oracle).

    A view may set ``observes_engine = True`` when it reflects the engine itself (KV events,
    the simulated cache) rather than only what this router sent there: such a view can show
    blocks the replica got from elsewhere (another gateway instance, a direct client), and
    policies may count them. Absent, it is taken as False."""

    def match(self, keys: Sequence[Hashable]) -> int:
        """Leading blocks of ``keys`` believed cached on the replica."""
        ...


class _EmptyView:
    def match(self, keys: Sequence[Hashable]) -> int:
        return 0


EMPTY_VIEW: CacheView = _EmptyView()


@dataclass(slots=True)
class RequestView:
    """A request as a policy sees it.

    ``block_keys`` are chained keys of the prompt's full blocks (the router's own hashing,
    :mod:`prefixroute.core.identity.hashing`, already salted per trust group); ``token_ids`` is
    set when the router tokenized the prompt (SGLang-style routers match on tokens or text);
    ``routing_key`` is a session or ``prompt_cache_key``-style hint for hash policies.
    ``arrival`` is when the request reached the router, on the same clock as ``now`` (the
    gateway routes after reading, tokenizing and admitting it, and again on a retry);
    ``None`` means ``now``.
    """

    request_id: str
    num_tokens: int
    block_size: int
    block_keys: Sequence[Hashable] = ()
    token_ids: Sequence[int] | None = None
    tenant: str = ""
    routing_key: str | None = None
    output_tokens_hint: int | None = None
    now: float = 0.0
    arrival: float | None = None

    @property
    def full_blocks(self) -> int:
        return self.num_tokens // self.block_size


@dataclass(slots=True)
class ReplicaView:
    """One candidate replica: its load and the router's view of its cache.

    Load fields follow what real routers read: ``in_flight`` (requests sent and not finished,
    the router's own count), ``queued`` / ``running`` (engine ``num_requests_waiting`` /
    ``num_requests_running``), ``pending_prefill_tokens`` (uncached prompt tokens not yet
    computed), ``kv_usage`` (0..1, ``vllm:kv_cache_usage_perc``) and ``assignments`` (requests
    routed here so far, less those that ended without running). The lifecycle runner keeps
    ``in_flight`` and ``assignments``; the body fills in the rest. ``cache`` answers prefix lookups; ``capacity_blocks`` is its KV size.
    ``scheduling_policy`` is the engine's (``vllm serve --scheduling-policy``): under
    ``priority`` its waiting queue goes by the priority a request carries
    (:attr:`Decision.priority`), lower first.
    """

    index: int
    name: str = ""
    healthy: bool = True
    in_flight: int = 0
    queued: int = 0
    running: int = 0
    pending_prefill_tokens: int = 0
    kv_usage: float = 0.0
    assignments: int = 0
    capacity_blocks: int = 0
    cache: CacheView = EMPTY_VIEW
    # Seconds per uncached prompt token, when known (learned online or from a profile).
    prefill_s_per_token: float | None = None
    scheduling_policy: str = "fcfs"

    @property
    def load(self) -> int:
        """The default load signal: requests in flight (queued plus running when known)."""
        return max(self.in_flight, self.queued + self.running)


# A plain class even when compiled: a policy's answer is checked by the lifecycle (a
# non-candidate or a non-index goes to the least-loaded candidate), so building one with a
# wrong replica must not fail first, as a compiled class's typed field would.
@mypyc_attr(native_class=False)
@dataclass(slots=True)
class Decision:
    """A policy's answer: which replica, through which branch, and why.

    ``scores`` maps a replica index to the numbers the policy compared (the gateway's
    ``/debug/decisions`` and the simulator's traces show them as they are): a dict, or a
    read-only mapping that builds each replica's entry when read
    (:class:`~prefixroute.core.routing.scores.LazyScores`).
    """

    replica: int
    branch: str
    reason: str = ""
    scores: Mapping[int, dict[str, float]] = field(default_factory=dict)
    predicted_cached_tokens: int = 0
    # For a replica whose scheduling policy is ``priority``: the request's place in its
    # queue, as whole milliseconds on the runner's clock (lower first; ``prefixroute``: a
    # deadline). The simulator sends it as vLLM's ``priority``; the gateway moves it to wall
    # time. None: the policy sets no order (the gateway sends the arrival time).
    priority: int | None = None


class Policy(Protocol):
    name: str

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """Choose among ``replicas`` (all healthy candidates; never empty)."""
        ...

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        """The request was sent to ``decision.replica`` (update router-side state)."""
        ...

    def on_completed(self, request: RequestView, replica: int, cached_tokens: int) -> None:
        """The replica reported ``cached_tokens`` for the request (live feedback)."""
        ...

    def on_unreported(self, request: RequestView, replica: int, ran: bool) -> None:
        """The request ended with no report (refused, failed, abandoned, no usage); ``ran``:
        the engine ran it, so its blocks are cached there."""
        ...

    def on_replica_reset(self, replica: int) -> None:
        """The replica's cache is empty now (it most likely restarted)."""
        ...


def least_loaded(replicas: Sequence[ReplicaView]) -> ReplicaView:
    """Lowest load, ties to the lowest index: a run is then reproducible whatever order
    the candidates arrive in."""
    return min(replicas, key=lambda r: (r.load, r.index))
