"""The request lifecycle runner: the one place a request's life is written down.

Every body that routes requests (the HTTP gateway, the simulator, and later an Envoy
Endpoint Picker) turns what it sees into the same few events and asks the runner:

=====================================  ===================================================
event                                  runner call
=====================================  ===================================================
a replica joins / leaves / drains      :meth:`~LifecycleRunner.add_replica`,
                                       :meth:`~LifecycleRunner.remove_replica`,
                                       :meth:`~LifecycleRunner.drain_replica`
its cache is empty (it restarted)      :meth:`~LifecycleRunner.reset_replica`
a request to route                     :meth:`~LifecycleRunner.route` (returns a
                                       :class:`Booking`)
another router's booking (shared       :meth:`~LifecycleRunner.book_remote`
state)
the replica reported cached tokens     :meth:`~LifecycleRunner.completed`
it ended without a report              :meth:`~LifecycleRunner.ended` (``ran``: whether the
                                       engine ran it)
=====================================  ===================================================

The runner owns the policy's hooks, each replica's in-flight and assignment counts (on the
replica's :class:`ReplicaView`, the object the policy reads) and what the router's own cache
views learn from its traffic. The body owns the engine-side load fields of those views
(``queued``, ``running``, ``kv_usage``, ``pending_prefill_tokens``, ...), which only it can
measure, and fills them in before it routes.

The rules, each written once here:

* **A policy answering a non-candidate** (an index that is not among the candidates, or not
  an index) gets the least-loaded candidate instead, branch ``policy_error_least_loaded``;
  the runner counts it (:attr:`LifecycleRunner.policy_errors`) and tells the body
  (``on_policy_error``). A live router must not lose an accepted request over a policy bug,
  and the simulator is a rehearsal of the live router, so it does the same, and reports the
  count rather than stopping: a run with ``policy_errors`` above zero measured the fallback,
  not the policy.
* **Blocks enter the router's view when the request is booked** (routed and sent: one step
  in every body), so a burst sharing a new prefix finds it at once. An end without a report
  takes back what the booking added if the engine did not run it (an approximate view
  forgets the blocks beyond those it held before the booking; an event view drops the
  request's in-flight keys); if it ran, its blocks stay (an event view holds them for a grace
  period until the engine's events confirm them).
* **A request that did not run** (rejected, refused, failed before the engine took it) is
  told to the policy as :meth:`~prefixroute.core.routing.base.Policy.on_unreported` with
  ``ran`` false, never as a completion with 0 cached tokens: the replica reported nothing
  about its cache, and a 0 would read as "everything predicted was evicted". It no longer
  counts as an assignment of the replica: it used no capacity there, and the balance rules
  must not steer away from a replica for work it never did.
* **A booking keeps its decision's scores only for a body that reads them.** The gateway
  logs each decision with every replica's scores; the simulator logs none, so its runner
  (``keep_scores=False``) books a copy without them. A booking lives until its request ends,
  hundreds of decisions later on a busy fleet: kept there, every decision's per-replica
  figures would outlive the garbage collector's young generation and be traversed, then
  freed, long after they were last read.
* **A reset** (the replica restarted: health checks failed, or the engine's event stream
  says so) empties the router's view of it and tells the policy
  (``on_replica_reset``); in-flight and assignment counts stay, the requests in flight end
  through their own events.

Pure: no I/O, no clock of its own (a request carries ``now``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

from mypy_extensions import mypyc_attr

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import Decision, ReplicaView, RequestView, least_loaded

NON_CANDIDATE_BRANCH = "policy_error_least_loaded"

# Membership states of a replica. Only "up" replicas are candidates; a draining one finishes
# the requests it has and takes no new ones.
UP, DRAINING = "up", "draining"


class NoCandidateError(ConfigError):
    """:meth:`LifecycleRunner.route` was given no replica that may take the request."""


# (Views queue bookings weakly. A plain class even when compiled: a compiled class takes no
# weak references.)
@mypyc_attr(native_class=False)
@dataclass(slots=True, eq=False, weakref_slot=True)
class Booking:
    """One request sent to one replica, from routing to its end.

    ``held_blocks`` is how many of the request's leading blocks the router's view of the
    replica held just before the booking (the router's prediction of the hit, in blocks); an
    approximate view sets it when it applies its queued records, so read it through
    :meth:`LifecycleRunner.held_blocks`. ``remote``: another router instance made it."""

    request: RequestView
    decision: Decision
    replica: int
    # The replica as it was booked: its end applies there even if the replica has left and
    # a new one joined under the same index since.
    view: ReplicaView = field(repr=False)
    remote: bool = False
    held_blocks: int | None = None
    ended: bool = False


class LifecycleRunner:
    """Runs one policy over a set of replicas through the lifecycle events of its requests.

    ``on_policy_error(request, decision, candidates)``: called when the policy answered a
    non-candidate, before the fallback replaces its decision (the gateway logs it).
    ``keep_scores``: whether a booking's decision keeps the replicas' scores (module
    docstring); without them, everything else of the decision is kept.
    """

    def __init__(self, policy: Any, *,
                 on_policy_error: Callable[[RequestView, Decision, list[int]], None]
                 | None = None, keep_scores: bool = True):
        self.policy = policy
        self.keep_scores = keep_scores
        self.policy_name: str = getattr(policy, "name", type(policy).__name__)
        self.replicas: dict[int, ReplicaView] = {}
        self.states: dict[int, str] = {}
        self.policy_errors = 0
        self._on_policy_error = on_policy_error
        # Optional hooks: BasePolicy has them, a bare Policy need not.
        self._on_unreported = getattr(policy, "on_unreported", None)
        self._on_replica_reset = getattr(policy, "on_replica_reset", None)
        self._routable: list[ReplicaView] | None = None  # "up" replicas by index, cached

    def replace_policy(self, policy: Any) -> None:
        """Route with ``policy`` from now on (a configuration reload). The replicas, their
        counts and the router's cache views stay; requests in flight end through the new
        policy's hooks, which ignore requests they did not route."""
        self.policy = policy
        self.policy_name = getattr(policy, "name", type(policy).__name__)
        self._on_unreported = getattr(policy, "on_unreported", None)
        self._on_replica_reset = getattr(policy, "on_replica_reset", None)

    # -- membership ----------------------------------------------------------------------

    def add_replica(self, view: ReplicaView) -> ReplicaView:
        """A replica joins (or comes back from draining) with ``view``: its index, name, cache
        view and KV size. From now on the runner keeps its ``in_flight`` and ``assignments``;
        the body keeps its load fields up to date. A replica that was removed may join again
        with a new view; requests booked on the old one end there."""
        known = self.replicas.get(view.index)
        if known is not None and known is not view and view.index in self.states:
            raise ConfigError(f"replica {view.index} is already in the fleet")
        self.replicas[view.index] = view
        self.states[view.index] = UP
        self._routable = None
        return view

    def drain_replica(self, index: int) -> None:
        """The replica takes no new requests; those in flight end as usual."""
        self._replica(index)
        self.states[index] = DRAINING
        self._routable = None

    def remove_replica(self, index: int) -> None:
        """The replica left the fleet. Requests still booked there can still end (their
        events are applied to the view the runner kept); it is no longer a candidate, and
        the policy forgets its cache (``on_replica_reset``): a replica that comes back under
        the same index starts empty."""
        self._replica(index)
        del self.states[index]
        self._routable = None
        if self._on_replica_reset is not None:
            self._on_replica_reset(index)

    def reset_replica(self, index: int) -> None:
        """The replica's cache is empty now (it restarted): the router's view forgets it,
        and so does the policy."""
        cache = self._replica(index).cache
        clear = getattr(cache, "on_cleared", None)
        if clear is not None:
            clear()
        if self._on_replica_reset is not None:
            self._on_replica_reset(index)

    def routable(self) -> list[ReplicaView]:
        """The replicas that may take new requests, by index."""
        if self._routable is None:
            self._routable = [self.replicas[i] for i in sorted(self.states)
                              if self.states[i] == UP]
        return self._routable

    # -- requests ------------------------------------------------------------------------

    def route(self, request: RequestView, candidates: Iterable[int] | None = None) -> Booking:
        """Choose a replica for ``request`` among ``candidates`` (indices; ``None``: every
        replica that is up) and book it there: ``on_routed``, one more in flight and
        assigned, its blocks into the router's view."""
        if candidates is None:
            views = self.routable()
        else:
            states = self.states
            views = [self.replicas[i] for i in candidates if states.get(i) == UP]
        if not views:
            raise NoCandidateError(f"request {request.request_id!r}: no replica may take it")
        decision = self.policy.route(request, views)
        chosen: object = decision.replica  # (checked: a policy may answer anything)
        if type(chosen) is not int or (self.states.get(chosen) != UP if candidates is None
                                       else all(v.index != chosen for v in views)):
            decision = self._fallback(request, decision, chosen, views)
        self.policy.on_routed(request, decision)
        return self._book(request, decision, remote=False)

    def book_remote(self, request: RequestView, decision: Decision) -> Booking | None:
        """Another router instance sent ``request`` to ``decision.replica`` (shared state):
        applied like a local booking (the policy's ``on_routed``, the counts, the view), and
        marked remote. A replica this runner does not know is ignored (``None``)."""
        if decision.replica not in self.states:
            return None
        self.policy.on_routed(request, decision)
        return self._book(request, decision, remote=True)

    def completed(self, booking: Booking, cached_tokens: int) -> None:
        """The replica answered and reported ``cached_tokens`` (in the units the request was
        routed in): the policy learns from it; the view keeps the request's blocks."""
        if self._end(booking, ran=True):
            self.policy.on_completed(booking.request, booking.replica, cached_tokens)

    def ended(self, booking: Booking, *, ran: bool) -> None:
        """The request ended without a report of cached tokens: rejected or refused by the
        replica, failed, abandoned by the caller, or answered without usage. ``ran``: the
        engine ran it (its blocks are cached there)."""
        if self._end(booking, ran=ran):
            if not ran:
                booking.view.assignments -= 1
            if self._on_unreported is not None:
                self._on_unreported(booking.request, booking.replica, ran)

    def held_blocks(self, booking: Booking) -> int:
        """The leading blocks of the request the view held on its replica before the
        booking (reads the view if it deferred the answer)."""
        if booking.held_blocks is None:
            booking.view.cache.match(booking.request.block_keys)
        return booking.held_blocks or 0

    # -- internals -----------------------------------------------------------------------

    def _replica(self, index: int) -> ReplicaView:
        view = self.replicas.get(index)
        if view is None:
            raise ConfigError(f"no replica {index!r} in the fleet")
        return view

    def _fallback(self, request: RequestView, decision: Decision, answer: object,
                  views: Sequence[ReplicaView]) -> Decision:
        self.policy_errors += 1
        fallback = least_loaded(views)
        if self._on_policy_error is not None:
            self._on_policy_error(request, decision, sorted(v.index for v in views))
        return Decision(fallback.index, NON_CANDIDATE_BRANCH,
                        f"policy chose replica {answer!r}, not a candidate; "
                        f"least-loaded replica {fallback.index} instead", decision.scores)

    def _book(self, request: RequestView, decision: Decision, *, remote: bool) -> Booking:
        view = self.replicas[decision.replica]
        if not self.keep_scores:  # (not asking whether it has any: a lazy mapping would index)
            decision = replace(decision, scores={})
        booking = Booking(request, decision, decision.replica, view, remote)
        view.in_flight += 1
        view.assignments += 1
        cache = view.cache
        book = getattr(cache, "on_booked", None)
        if book is not None:
            book(request.block_keys, booking)
        elif request.block_keys:
            booking.held_blocks = cache.match(request.block_keys)
        else:
            booking.held_blocks = 0
        return booking

    def _end(self, booking: Booking, *, ran: bool) -> bool:
        """Common to every end: once only; one fewer in flight; the view learns whether the
        request ran. False if it had ended already."""
        if booking.ended:
            return False
        booking.ended = True
        view = booking.view
        view.in_flight -= 1
        end = getattr(view.cache, "on_ended", None)
        if end is not None:
            end(booking.request.block_keys, booking, ran)
        return True
