"""``prefixroute``: each request goes where its first token is expected soonest.

Per candidate replica the policy estimates the request's time to first token (:mod:`.costs`)
over three pieces of state kept per replica: the blocks it sent there with their survival
(:mod:`.mirror`), the prefill queue it sent there with the replica's learned speed
(:mod:`.queue`) and the recent load (:mod:`.load`). The cheapest replica wins; equal costs go
to the replica with the fewest recent requests, then the fewest in flight, then the lowest
index. On a quiet fleet the balance rules (:mod:`.balance`) may then move the request.

Branches: ``cache_affinity`` (the winner holds the most), ``follow_inflight`` (it holds the
most because a request computing the prefix is in flight there: a burst follows the first
one), ``spill`` (a holder exists but costs more), ``cold_spread`` (nobody holds a prefix),
and the balance rules' ``session_move`` and ``cold_balance``.

Priority hints. On a replica started with ``--scheduling-policy priority`` every request gets
a deadline: its arrival plus ``priority_slack`` times its own predicted prefill there, sent as
whole milliseconds in :attr:`Decision.priority`. A short prompt may pass a long one queued
before it, but a long prompt is passed only until it has waited that long (earliest deadline
first, with no starvation). The queue record is then ordered by deadline, the wait counts
only the work due before the request, and each queued request it passes is charged its
prefill as delay to others. Elsewhere nothing changes (vLLM ignores a priority there).

Feedback. :meth:`PrefixRoute.on_completed` (the engine's ``cached_tokens``) moves the mirror's
eviction horizon and corrects its insert clock, and times how long requests stay (for the KV
wait). A request that ends leaves the queue and the requests in flight; one that ended with no
report and never ran (:meth:`PrefixRoute.on_unreported`) also takes back its blocks. A prompt
longer than the replica's KV is rejected at once: it enters neither the mirror nor the load.

Learning the speed. A replica whose speed the runner states (an engine profile) keeps it; the
replicas whose speed is unknown (the gateway before calibration) learn one shared estimate,
bounded around the policy's default (:mod:`.speed`).

Subclasses in ``benchmarks/prefixroute_ablations.py`` switch single mechanisms off through the
small hook methods below (``_learns_speed``, ``_prefill_busy``, ``_inflight_floor``,
``_leave_queue``, ``_learn_from_report``), so the benchmark can show what each is worth.
"""

from __future__ import annotations

import dataclasses
from math import inf
from typing import ClassVar, Hashable, NamedTuple, Sequence

from mypy_extensions import mypyc_attr

from prefixroute.core.caches.base import cacheable_blocks, fits_kv
from prefixroute.core.routing.base import CacheView, Decision, ReplicaView, RequestView
from prefixroute.core.routing.registry import register
from prefixroute.core.routing.scores import LazyScores

from .balance import BalanceRule, Candidate, default_rules
from .costs import CostModel, CostTerms, to_ms
from .load import RecentLoad
from .mirror import BlockMirror, HitEstimate, StampRun
from .params import PrefixRouteParams
from .queue import PrefillQueue, QueuedPrefill
from .speed import SpeedEstimate


class _TrustMirror:
    """A cache view that vetoes nothing (for requests routed without a view at hand)."""

    def match(self, keys: Sequence[Hashable]) -> int:
        return len(keys)


_TRUST_MIRROR = _TrustMirror()

# A candidate built from a ready tuple: a NamedTuple's generated ``__new__`` is a Python-level
# call, a measurable share of a 32-replica decision.
_candidate = tuple.__new__


def _recent_requests(candidate: Candidate) -> float:
    """Recent requests as the scores show them and ties are broken on (three decimals)."""
    return round(candidate.recent, 3)


def _scores_of(candidate: Candidate) -> dict[str, float]:
    """A replica's scores: its cost evaluation's figures, then its own."""
    terms = candidate.terms
    assert terms is not None
    scores = {"expected_cached_tokens": candidate.expected_cached_tokens,
              "mirror_blocks": float(terms.mirror_blocks),
              "view_blocks": float(terms.view_blocks), "wait_s": terms.wait_s,
              "kv_wait_s": terms.kv_wait_s, "prefill_s": terms.prefill_s,
              "decode_s": terms.decode_s, "delay_others_s": terms.delay_others_s,
              "copy_s": terms.copy_s, "cost_s": candidate.cost_s,
              "s_per_token": terms.s_per_token, "prefill_busy": candidate.prefill_busy,
              "load": candidate.load, "recent_requests": _recent_requests(candidate),
              "long_load_s": candidate.long_load_s, "occupancy": candidate.occupancy}
    if candidate.deadline_s is not None:
        scores["deadline_s"] = candidate.deadline_s
    return scores


def _position(candidates: Sequence[Candidate], index: int) -> int:
    """Where the replica ``index`` stands among ``candidates``."""
    return next(i for i, c in enumerate(candidates) if c.index == index)


class ReplicaState:
    """What the router believes about one replica. ``provisional_speed``: its speed is a
    stand-in until the first view of it (a replica first met in a booking this router did
    not decide); otherwise it is the one of its kind. ``cache`` is the last cache view the
    runner gave for it and ``observes_engine`` that view's flag (:class:`CacheView`), read
    once per view rather than at every decision."""

    __slots__ = ("mirror", "queue", "load", "provisional_speed", "cache", "observes_engine")

    def __init__(self, speed: SpeedEstimate, provisional_speed: bool = False) -> None:
        self.mirror = BlockMirror()
        self.queue = PrefillQueue(speed)
        self.load = RecentLoad()
        self.provisional_speed = provisional_speed
        self.cache: CacheView | None = None
        self.observes_engine = False


class PendingRoute(NamedTuple):
    """What :meth:`PrefixRoute.route` predicted for the replica it chose."""

    replica: int
    stamps: list[int]
    cached_tokens: float


class Prediction(NamedTuple):
    """A routed request until it ends: what was predicted, for the feedback."""

    replica: int
    stamps: list[int]          # stamps of the blocks predicted cached
    chain: list[StampRun]      # the mirror's stamps along the prompt before its touch
    predicted_blocks: int
    routed_at: float


def hit_limit(request: RequestView) -> int:
    """Blocks of the prompt the engine can reuse at most (all but the last token)."""
    block = request.block_size
    return min(len(request.block_keys), cacheable_blocks(request.num_tokens, block)) \
        if block > 0 else 0


# Compiled (setup.py), it is a native class: registered below it, not by decorator (a class
# under an arbitrary decorator loses the native layout), on no base class (a native class
# can only extend native ones), defining every hook of the Policy protocol itself; the
# benchmark's ablations subclass it. It cannot then be pickled or copied.
@mypyc_attr(allow_interpreted_subclasses=True)
class PrefixRoute:
    name: ClassVar[str] = "prefixroute"
    params_type: ClassVar[type[PrefixRouteParams]] = PrefixRouteParams

    def __init__(self, params: PrefixRouteParams | None = None,
                 rules: Sequence[BalanceRule] | None = None) -> None:
        self.params = params = self.params_type() if params is None else params
        self.rules = list(default_rules(params) if rules is None else rules)
        self.costs = CostModel(params)
        self._replicas: dict[int, ReplicaState] = {}
        self._speeds: dict[tuple[float, bool], SpeedEstimate] = {}  # per kind of replica
        self._pending: dict[str, PendingRoute] = {}  # from route to on_routed
        self._predictions: dict[str, Prediction] = {}
        self._rho = 0.0          # fleet prefill utilisation at the last decision
        self._clock = 0.0        # the latest time a request showed
        self._residence_s = 0.0  # how long a request stays on a replica (0: not known yet)
        # Whether the runner's pending_prefill_tokens count a waiting request's whole prompt
        # (the simulator's engine) or only its uncached part (the documented meaning, the
        # gateway): found out as soon as a replica reports more than we sent uncached.
        self._pending_counts_prompt = False

    def describe(self) -> dict:
        return dataclasses.asdict(self.params)

    # -- hooks (the benchmark's ablations override them) --------------------------------------
    def _learns_speed(self, replica: ReplicaView) -> bool:
        """Learn the replica's speed only where the runner states none."""
        return replica.prefill_s_per_token is None

    def _prefill_busy(self, state: ReplicaState) -> float:
        return state.queue.prefill_busy(self.params.load_horizon_s)

    def _inflight_floor(self, state: ReplicaState) -> int | None:
        """The stamp of the oldest request in flight there: its blocks are being computed."""
        in_flight = state.mirror.in_flight
        return next(iter(in_flight.values())) if in_flight else None

    def _leave_queue(self, state: ReplicaState, request_id: str) -> None:
        state.queue.drop(request_id)

    def _learn_from_report(self, state: ReplicaState, prediction: Prediction,
                           reported: int) -> None:
        state.mirror.learn(reported, prediction.stamps, prediction.chain,
                           prediction.predicted_blocks)

    # -- state ----------------------------------------------------------------------------------
    def _new_state(self, replica: ReplicaView | None) -> ReplicaState:
        """A replica's state, its speed estimate the one of its kind (:mod:`.speed`): the
        stated speed, or the policy's default, as the anchor. A replica routed to without a
        view first (another router's booking, applied before this router decided anything)
        is provisionally taken to be of the fleet's first kind, or at the policy's default
        speed, which is not registered as a kind: the first view of it sets its kind
        (:meth:`_viewed`). Registered, a default that learns would stay every such replica's
        kind, whatever speed the runner states for it later."""
        if replica is None:
            speed = next(iter(self._speeds.values()), None) or SpeedEstimate(
                self.params.prefill_s_per_token, self.params.chunk_tokens, False)
            return ReplicaState(speed, provisional_speed=True)
        return ReplicaState(self._kind(replica))

    def _kind(self, replica: ReplicaView) -> SpeedEstimate:
        anchor = replica.prefill_s_per_token or self.params.prefill_s_per_token
        return self._speed_for(anchor, self._learns_speed(replica))

    def _viewed(self, state: ReplicaState, replica: ReplicaView) -> None:
        """The first view of a replica met in a booking: its speed becomes its kind's."""
        state.queue.speed = self._kind(replica)
        state.provisional_speed = False

    def _speed_for(self, anchor: float, learns: bool) -> SpeedEstimate:
        speed = self._speeds.get((anchor, learns))
        if speed is None:
            speed = self._speeds[(anchor, learns)] = SpeedEstimate(anchor, self.params.chunk_tokens,
                                                                   learns)
        return speed

    def _expected(self, state: ReplicaState, keys: Sequence[Hashable], limit: int,
                  view: CacheView) -> HitEstimate:
        return state.mirror.expected(keys, limit, view, self.params.survival_width,
                                     self._inflight_floor(state))

    # -- routing --------------------------------------------------------------------------------
    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        """Every replica's cost for ``request`` (its scores), then the cheapest (:meth:`_choose`).

        The hot path of a simulation (a million requests over 32 replicas), so the work per
        replica is kept small while every figure stays the one the cost model gives for that
        replica on its own (a property test checks it): one pass brings each replica's state
        up to now and estimates its hit, a second prices it; idle replicas alike in
        everything the cost reads share one evaluation; the speed is read once per run of
        replicas of one kind."""
        p = self.params
        now = request.now
        arrived = now if request.arrival is None else min(request.arrival, now)
        self._clock = max(self._clock, now)
        keys = request.block_keys
        block = request.block_size
        n = request.num_tokens
        limit = hit_limit(request)
        known = self._replicas
        speed_memory, load_horizon, balance_horizon = (p.speed_memory, p.load_horizon_s,
                                                       p.balance_horizon_s)
        # First pass: each replica's queue reconciled with the pending prefill it reports,
        # its occupancy seen, its utilisation and its expected hit.
        states: list[ReplicaState] = []
        loads: list[int] = []
        busy: list[float] = []
        estimates: list[HitEstimate] = []
        no_hit = HitEstimate(0.0, 0, [])
        first = keys[0] if limit > 0 else None  # (the block a hit starts with)
        for replica in replicas:
            state = known.get(replica.index)
            if state is None:
                state = known[replica.index] = self._new_state(replica)
            elif state.provisional_speed:
                self._viewed(state, replica)
            if replica.capacity_blocks:
                state.mirror.capacity = replica.capacity_blocks
            queue = state.queue
            pending = replica.pending_prefill_tokens
            if pending > queue.units + 0.5 and queue.entries and not self._pending_counts_prompt:
                self._pending_counts_prompt = True
            queue.observe(pending, now, speed_memory, load_horizon)
            in_flight = replica.load
            state.load.occupancy.observe(in_flight > 0, now, balance_horizon)
            states.append(state)
            loads.append(in_flight)
            busy.append(self._prefill_busy(state))
            cache = replica.cache
            if cache is not state.cache:
                state.cache = cache
                state.observes_engine = bool(getattr(cache, "observes_engine", False))
            estimates.append(self._expected(state, keys, limit, cache)
                             if state.mirror.may_hit_first(first, state.observes_engine)
                             else no_hit)
        rho = self._rho = min(sum(busy) / len(states), 0.999)
        costs = self.costs
        gamma = costs.delay_factor(rho)
        ceiling = float(limit * block)
        most = min(max(h.expected_blocks for h in estimates) * block, ceiling)
        slack = p.priority_slack
        residence = self._residence_s
        candidates: list[Candidate] = []
        # Idle replicas alike in everything the cost reads share one evaluation (on a quiet
        # fleet, most of them: nothing queued or running, holding nothing of the prompt);
        # each gets its own scores. Busy replicas almost never match (their queues differ),
        # and on a busy fleet they are nearly all of them: each is priced on its own.
        evaluated: dict[tuple, tuple[CostTerms, float, float]] = {}
        # What depends on the hit and the speed only, by (cached tokens, speed); the last one
        # is at hand (on a busy fleet most replicas hold nothing of the prompt).
        work_terms: dict[tuple[float, float], tuple[float, float, float]] = {}
        last_cached = last_s = -1.0
        last_work = (0.0, 0.0, 0.0)
        # The speed is read once per kind of replica in a row (nothing learns here).
        last_speed: SpeedEstimate | None = None
        s = 0.0
        best_hit = -inf
        for replica, state, prefill_busy_share, hit, in_flight in zip(
                replicas, states, busy, estimates, loads):
            queue = state.queue
            speed = queue.speed
            if speed is not last_speed:
                last_speed, s = speed, speed.value
            by_deadline = slack and replica.scheduling_policy == "priority"
            expected_blocks = hit.expected_blocks
            alike: tuple | None = None if by_deadline or queue.pending_work or \
                replica.running else (expected_blocks, len(hit.stamps), hit.view_blocks, s,
                                      replica.kv_usage, replica.capacity_blocks)
            shared = evaluated.get(alike) if alike is not None else None
            load = state.load
            # This replica's own figures, whether or not its cost is shared.
            recent = load.routed.read(now, load_horizon)
            long_load = load.routed_s.read(now, balance_horizon)
            occupancy = load.occupancy.share
            if shared is not None:
                terms, cost, cached_tokens = shared
                deadline = None
            else:
                cached = min(expected_blocks * block, ceiling)
                if cached != last_cached or s != last_s:
                    work = work_terms.get((cached, s))
                    if work is None:
                        uncached = n - cached
                        work = work_terms[(cached, s)] = (
                            uncached, costs.prefill_work(uncached, cached) * s,
                            costs.copy_work(n, cached, most) * s)
                    last_cached, last_s, last_work = cached, s, work
                uncached, prefill, copy = last_work
                # In whole milliseconds as sent, so the queue's order and the engine's agree.
                deadline = (to_ms(arrived + slack * prefill) / 1000.0 if by_deadline
                            else None)
                wait, behind = queue.wait_s(deadline)
                decode = costs.decode_work(replica, uncached, block) * s
                kv_wait = costs.kv_wait(replica, uncached, block, residence)
                delay = (gamma + behind) * prefill
                cost = wait + kv_wait + prefill + decode + delay + copy
                cached_tokens = round(cached, 1)
                terms = _candidate(CostTerms, (len(hit.stamps), hit.view_blocks, wait, kv_wait,
                                               prefill, decode, delay, copy, s))
                if deadline is None and alike is not None:
                    evaluated[alike] = (terms, cost, cached_tokens)
            if cached_tokens > best_hit:
                best_hit = cached_tokens
            candidates.append(_candidate(Candidate, (
                replica.index, cost, cached_tokens, float(in_flight), occupancy, long_load,
                recent, prefill_busy_share, deadline, terms)))
        hint = request.output_tokens_hint or 1
        # (Replicas of one KV size answer alike.)
        fits = all(fits_kv(n, hint, capacity, block)
                   for capacity in {r.capacity_blocks for r in replicas})
        scores = LazyScores(candidates, _scores_of)
        at, branch, reason = self._choose(candidates, estimates, n, fits, best_hit)
        chosen = candidates[at]
        choice = chosen.index
        parts = chosen.terms
        assert parts is not None
        reason += (f"; cost {chosen.cost_s:.3f} s = wait {parts.wait_s:.3f} + prefill "
                   f"{parts.prefill_s:.3f} + decode {parts.decode_s:.3f} + delay to others "
                   f"{parts.delay_others_s:.3f} + copy {parts.copy_s:.3f}")
        hit = estimates[at]
        self._pending[request.request_id] = PendingRoute(choice, hit.stamps,
                                                         chosen.expected_cached_tokens)
        deadline = chosen.deadline_s
        priority = None if deadline is None else to_ms(deadline)
        if priority is not None:
            reason += f"; priority {priority} (deadline {deadline:.3f} s)"
        return Decision(choice, branch, reason, scores,
                        int(hit.expected_blocks + 0.5) * block, priority=priority)

    def _choose(self, candidates: list[Candidate], hits: list[HitEstimate], n: int, fits: bool,
                best_hit: float) -> tuple[int, str, str]:
        """The cheapest replica (equal costs: the fewest recent requests), then the balance
        rules on a quiet fleet; the branch says why. ``hits`` are the candidates' estimates
        in their order, ``best_hit`` the most tokens any is expected to hold. Returns the
        chosen candidate's position among ``candidates``."""
        # The cheapest, the lowest index among equal costs (one pass, no key tuples).
        at = 0
        cheapest = candidates[0]
        for i, c in enumerate(candidates):
            if c.cost_s < cheapest.cost_s or (c.cost_s == cheapest.cost_s
                                              and c.index < cheapest.index):
                at, cheapest = i, c
        chosen = cheapest
        spread = ""
        lowest = cheapest.cost_s
        tied = [i for i, c in enumerate(candidates) if c.cost_s <= lowest]
        if len(tied) > 1:
            at = min(tied, key=lambda i: (_recent_requests(candidates[i]), candidates[i].load,
                                          candidates[i].cost_s, candidates[i].index))
            chosen = candidates[at]
            if chosen is not cheapest:
                spread = (f" (as cheap as replica {cheapest.index}: the fewest recent "
                          f"requests)")
        choice = chosen.index
        quiet = len(candidates) > 1 and self._rho < self.params.cold_rho_max and fits
        if quiet:
            for rule in self.rules:
                move = rule.move(chosen, candidates, n, best_hit)
                if move is not None:
                    return _position(candidates, move.replica), rule.branch, move.reason
        if best_hit <= 0:
            return at, "cold_spread", (f"no replica is expected to hold a prefix: replica "
                                       f"{choice}{spread}")
        if chosen.expected_cached_tokens >= best_hit:
            hit = hits[at]
            inflight = len(hit.stamps) > hit.view_blocks
            return at, "follow_inflight" if inflight else "cache_affinity", (
                f"replica {choice} holds the most: {chosen.expected_cached_tokens:.0f} of "
                f"{n} tokens expected cached"
                + (" (a request computing this prefix is still in flight there)"
                   if inflight else "") + spread)
        holder = min((c for c in candidates if c.expected_cached_tokens >= best_hit),
                     key=lambda c: (c.cost_s, c.index))
        return at, "spill", (
            f"holder replica {holder.index} would cost {holder.cost_s:.3f} s (wait "
            f"{holder.terms.wait_s if holder.terms else 0.0:.3f} s); replica {choice} costs "
            f"{chosen.cost_s:.3f} s with {chosen.expected_cached_tokens:.0f} tokens expected "
            f"cached{spread}")

    # -- what happens to a routed request -----------------------------------------------------
    def on_routed(self, request: RequestView, decision: Decision) -> None:
        p = self.params
        index = decision.replica
        state = self._replicas.get(index)
        if state is None:
            state = self._replicas[index] = self._new_state(None)
        keys = request.block_keys
        pending = self._pending.pop(request.request_id, None)
        if pending is not None and pending.replica == index:
            stamps, cached = pending.stamps, pending.cached_tokens
            counted = max(0.0, request.num_tokens - cached)
        else:  # routed elsewhere than we said (or by someone else): predict afresh
            hit = self._expected(state, keys, hit_limit(request), _TRUST_MIRROR)
            stamps, cached = hit.stamps, hit.expected_blocks * request.block_size
            # Another instance's booking (nothing pending here): the replica's pending
            # prefill counts it as that router predicted, and the queue's units must add up
            # to that figure, or the reconciliation misplaces it (and reads a surplus as
            # whole prompts counted). Our own decision replaced by the runner: afresh.
            counted = max(0.0, request.num_tokens - (
                decision.predicted_cached_tokens if pending is None else cached))
        uncached = max(0.0, request.num_tokens - cached)
        units = request.num_tokens if self._pending_counts_prompt else counted
        work = self.costs.prefill_work(uncached, cached)
        # Its place in the replica's order: the deadline sent as priority, else its arrival.
        order = request.now if decision.priority is None else decision.priority / 1000.0
        state.queue.add(QueuedPrefill(units, uncached, work, request.request_id, order))
        predicted_blocks = int(round(cached / request.block_size)) if request.block_size else 0
        # A prompt longer than the replica's KV is rejected at once: touching the mirror with
        # it would push every block out (an 800k-token prompt is 12,500 blocks against
        # 6,400), and the sessions held there would look cold everywhere and move.
        mirror = state.mirror
        fits = mirror.fits(request)
        stamp, chain = mirror.touch(keys if fits else (), predicted_blocks)
        mirror.in_flight[request.request_id] = stamp
        load = state.load
        # The replica has work from now on (the view route() saw was before this request).
        load.occupancy.observe(True, request.now, p.balance_horizon_s)
        load.routed.add(1.0, request.now, p.load_horizon_s)
        load.routed_s.read(request.now, p.balance_horizon_s)
        if fits:
            load.routed_s.value += work * state.queue.s_per_token
        self._clock = max(self._clock, request.now)
        self._predictions[request.request_id] = Prediction(
            index, stamps, chain, predicted_blocks if fits else 0, request.now)

    def _end(self, request_id: str, replica: int
             ) -> tuple[Prediction | None, ReplicaState | None, int | None]:
        """The request left: it leaves the replica's requests in flight and its queue.
        Returns its prediction, the replica's state and its stamp there (None if unknown)."""
        prediction = self._predictions.pop(request_id, None)
        state = self._replicas.get(replica)
        if state is None:
            return prediction, None, None
        stamp = state.mirror.in_flight.pop(request_id, None)
        self._leave_queue(state, request_id)
        return prediction, state, stamp

    def on_unreported(self, request: RequestView, replica: int, ran: bool) -> None:
        """Ended with no ``cached_tokens`` (refused, failed, abandoned, no usage). If the
        engine did not run it, the blocks it added to the mirror go again."""
        prediction, state, stamp = self._end(request.request_id, replica)
        if ran or state is None or prediction is None or prediction.replica != replica \
                or stamp is None:
            return
        chain = prediction.chain
        held = chain[-1][1] if chain else 0  # blocks the mirror had before this request
        mirror = state.mirror
        inserted = max(0, len(request.block_keys) - prediction.predicted_blocks) \
            if mirror.fits(request) else 0
        mirror.untouch(request.block_keys, stamp, held, inserted)

    def on_replica_reset(self, replica: int) -> None:
        """The replica's cache is empty (it most likely restarted): forget what was sent
        there. Its speed and recent load stay."""
        state = self._replicas.get(replica)
        if state is not None:
            state.mirror.reset()

    def on_completed(self, request: RequestView, replica: int, cached_tokens: int) -> None:
        """Learn from the replica's reported hit (:meth:`BlockMirror.learn`) and time the
        request's stay."""
        prediction, state, _ = self._end(request.request_id, replica)
        if prediction is not None:
            # Completions carry no time: the latest request seen is the clock.
            stay = max(0.0, self._clock - prediction.routed_at)
            self._residence_s = stay if self._residence_s <= 0 else \
                self._residence_s + self.params.learning_rate * (stay - self._residence_s)
        if state is None or prediction is None or prediction.replica != replica \
                or request.block_size <= 0 or not state.mirror.fits(request):
            return  # (a prompt that cannot fit was rejected: its 0 says nothing of the cache)
        # (A runner that counts tokens otherwise than the engine cannot report more blocks
        # than the prompt has.)
        reported = min(max(0, cached_tokens) // request.block_size, len(request.block_keys))
        self._learn_from_report(state, prediction, reported)


register("prefixroute")(PrefixRoute)
