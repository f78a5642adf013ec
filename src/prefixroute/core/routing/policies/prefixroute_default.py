"""``prefixroute``: our default policy. Route each request where its first token comes soonest.

Per candidate replica the policy estimates the request's time to first token there, in seconds,
and picks the lowest (ties to the lowest index)::

    cost(r) = wait(r) + prefill(r) + decode(r)

``wait``
    the prefill work already queued on ``r``: a virtual queue per replica. Each request routed
    there adds its predicted prefill work (below); the queue drains at the replica's learned
    speed; an observation of ``pending_prefill_tokens == 0`` empties it.
``prefill``
    the request's own uncached tokens at the replica's speed, with the attention term:
    ``u`` new tokens after ``h`` cached ones cost ``s * (u + u * (h + u / 2) / L)``, where
    ``s`` is seconds per token and ``L`` (``attention_context_tokens``) the context length at
    which attention costs as much as the linear part. A cache hit skips its tokens' linear
    *and* attention cost, so hits on long prompts are worth more than their length.
``decode``
    interference of the requests decoding on ``r``: each prefill step also carries their
    decode, ``decode_interference * kv_usage`` of the step time.

**Expected hits.** The policy keeps its own record of the blocks it sent to each replica (an
LRU mirror, as every approximate router does), and for each block the replica's *insert
count* when it was last touched. A block that ``k`` newer blocks were inserted after survives
the replica's LRU if ``k`` stays below what the cache can hold beside the running requests:
its survival probability falls linearly from 1 at ``k = survival_start * C`` to 0 at
``k = C``, where ``C`` is the replica's effective capacity (its ``capacity_blocks``, lowered
when the replica reports evictions). Expected cached blocks are the sum of the running minimum
of those probabilities along the prefix chain (block ``i`` only hits if ``0..i-1`` do). The
runner's cache view (``ReplicaView.cache``: approximate, event-driven or exact) vetoes what it
says is gone, except blocks of requests still in flight there (they are being computed: a burst
of same-prefix requests follows the first, which is how this policy "holds" a burst without
delaying anything: it routes to the replica already computing the prefix).

**Feedback** (:meth:`on_completed`, called by the simulator and the gateway with the engine's
reported ``cached_tokens``). If the replica reused fewer blocks than predicted, the first
missing block was evicted, and so was every block touched before it (LRU): the replica's
*eviction horizon* moves to that block's stamp and everything older is forgotten (the request's
own blocks were recomputed and stay). The insert count at which the block disappeared also
lowers the replica's effective capacity ``C``; a hit on a block older than ``C`` raises it.

**Learned prefill speed.** Each replica's seconds per token ``s`` starts at
``ReplicaView.prefill_s_per_token`` (the engine profile) or ``prefill_s_per_token`` and is
learned online from the replica's busy periods: a busy period starts when work is routed to an
idle replica and ends when the replica reports no pending prefill; its length over the work
routed in it is one observation (and a busy period that outlasts its prediction raises ``s``
at once). Queue wait, prefill and the replica's speed are thus in the same unit, measured on
the replica itself, whatever its hardware.

**Candidate ideas, as judged by** ``benchmarks/policy_comparison.py`` (the README table):
replicating a hot prefix is what the cost does by itself when the holder's queue outweighs the
prefill saved, sized by demand because every further replica is added only when all current
holders are that busy; cold requests (no expected hit anywhere) spread to the least waiting
replica; bursts follow the replica computing their prefix (above); prefill speed is learned.

Parameters and their defaults (one configuration for every workload):

``prefill_s_per_token`` (4.0e-5)
    prior seconds per prompt token when the runner does not state one: the simulator's
    Llama-3-8B on H100 preset (2 x 8.03e9 FLOPs per token at 40% of 989 TFLOPS).
``attention_context_tokens`` (44000)
    the same preset's linear cost over its attention cost per context token, 4.0e-5 / 9.0e-10.
``step_overhead_tokens`` (150)
    the fixed cost of a forward pass in token-equivalents: 6 ms / 4.0e-5 s (same preset).
``chunk_tokens`` (8192)
    tokens per prefill step, vLLM's ``max_num_batched_tokens`` default.
``decode_interference`` (0.07)
    step-time share of decode at full KV: 409,600 context tokens x 5.2e-8 s over a full prefill
    step, 8192 x 4.0e-5 s (same preset).
``survival_start`` (0.5)
    LRU survival falls from 1 at half the effective capacity of inserts since the last touch to
    0 at the full capacity: blocks pinned by running requests and reverse-order freeing make
    the usable LRU depth of a vLLM pool vary between about half and all of it.
``learning_rate`` (0.2)
    weight of each new observation of speed or capacity (about the last five busy periods).
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from typing import Hashable, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import (BasePolicy, CacheView, Decision, ReplicaView,
                                           RequestView)
from prefixroute.core.routing.registry import register

_UNKNOWN_CAPACITY = 1 << 40


class _TrustMirror:
    """A cache view that vetoes nothing (for requests routed without a view at hand)."""

    def match(self, keys: Sequence[Hashable]) -> int:
        return len(keys)


_TRUST_MIRROR = _TrustMirror()


class ReplicaEstimate:
    """What the router believes about one replica: the blocks it sent there (LRU order, each
    stamped with the touch that last used it), the eviction horizon and effective capacity
    learned from feedback, and a virtual prefill queue drained at a learned speed.

    Stamps are touch numbers (one per request routed here); ``inserts_at[stamp]`` is how many
    blocks had been inserted after that touch, so a block's LRU age is ``inserts -
    inserts_at[stamp]``: only new blocks push old ones out, re-used blocks do not.
    """

    __slots__ = ("blocks", "inserts", "inserts_at", "horizon", "capacity",
                 "configured_capacity", "queue", "queue_units", "queue_work", "pending_work",
                 "observed_at", "progress_at", "busy", "elapsed_s", "done_work", "in_flight")

    def __init__(self, s_per_token: float, prior_work: float) -> None:
        self.blocks: OrderedDict[Hashable, int] = OrderedDict()  # key -> stamp, oldest first
        self.inserts = 0          # blocks predicted newly inserted so far (the LRU clock)
        self.inserts_at: list[int] = []  # stamp -> inserts after that touch
        self.horizon = -1         # blocks stamped at or below this were evicted (feedback)
        self.capacity = 0.0       # effective LRU depth in blocks (0: unknown)
        self.configured_capacity = 0
        # The prefill queue as routed here, oldest first: [units the runner counts, of which
        # uncached, work].
        self.queue: deque[list[float]] = deque()
        self.queue_units = 0.0
        self.queue_work = 0.0
        self.pending_work = 0.0   # work not yet done, as of the last observation
        self.observed_at = 0.0
        self.progress_at = 0.0    # when the replica was last seen to make progress
        self.busy = False         # pending prefill at the last observation
        # Speed: seconds of busy time over work done, with exponential forgetting; the prior
        # counts as ``prior_work`` token-equivalents done at ``s_per_token``.
        self.elapsed_s = s_per_token * prior_work
        self.done_work = prior_work
        self.in_flight: dict[str, int] = {}  # request id -> its stamp, in routing order

    @property
    def s_per_token(self) -> float:
        return self.elapsed_s / self.done_work

    # -- the queue ------------------------------------------------------------------------------
    def wait_s(self) -> float:
        return self.pending_work * self.s_per_token

    def observe(self, pending_prefill_tokens: int, now: float, forget: float) -> None:
        """Reconcile the queue with the replica's pending prefill and learn its speed.

        The runner's pending tokens belong to the most recently routed requests (the engine
        prefills first come, first served), so the oldest entries beyond them are done and
        the oldest one left is done in part. The work done since the last observation, over
        the time, while the replica was busy all along, is one observation of its speed."""
        queue = self.queue
        if pending_prefill_tokens <= 0:
            queue.clear()
            self.queue_units = self.queue_work = 0.0
            pending = 0.0
        else:
            while len(queue) > 1 and self.queue_units - queue[0][0] >= pending_prefill_tokens:
                units, _, work = queue.popleft()
                self.queue_units -= units
                self.queue_work -= work
            pending = self.queue_work
            if queue:
                # Admission drops the cached tokens at once; the uncached ones are computed.
                units, uncached, work = queue[0]
                left = pending_prefill_tokens - (self.queue_units - units)
                remaining = min(1.0, max(0.0, left / uncached)) if uncached > 0 else 0.0
                pending -= work * (1.0 - remaining)
            # Pending tokens we know nothing of (preempted requests, another router).
            pending += max(0.0, pending_prefill_tokens - self.queue_units)
        if self.busy and pending_prefill_tokens > 0 and now > self.observed_at:
            elapsed = now - self.observed_at
            # Work shows up done at step ends. A request that hit more than predicted drops
            # its cached tokens at admission and looks like work done: never credit more than
            # twice the believed speed since the last progress.
            done = max(0.0, self.pending_work - pending)
            if done > 0:
                done = min(done, 2.0 * (now - self.progress_at) / self.s_per_token)
                self.progress_at = now
            self.elapsed_s = self.elapsed_s * forget + elapsed
            self.done_work = self.done_work * forget + done
        self.pending_work = pending
        if not self.busy:
            self.progress_at = now
        self.observed_at = now
        self.busy = pending_prefill_tokens > 0

    def add_work(self, units: float, uncached: float, work: float) -> None:
        """A request was routed here: ``units`` as the runner will count its pending tokens,
        ``uncached`` of them to compute, ``work`` its predicted prefill (token-equivalents)."""
        self.queue.append([units, uncached, work])
        self.queue_units += units
        self.queue_work += work
        self.pending_work += work
        self.busy = True

    # -- the cache ------------------------------------------------------------------------------
    def survival(self, stamp: int, width: float) -> float:
        """Probability that a block last touched at ``stamp`` is still cached: 1 while fewer
        than ``C (1 - width)`` blocks were inserted after it, 0 from ``C (1 + width)`` or the
        configured capacity on (an LRU of N blocks has surely dropped a block N inserts ago),
        linear between; ``C`` is the effective capacity."""
        if stamp <= self.horizon:
            return 0.0
        capacity = self.capacity
        if capacity <= 0:
            return 1.0
        age = self.inserts - self.inserts_at[stamp]
        low = capacity * (1.0 - width)
        if age <= low:
            return 1.0
        high = capacity * (1.0 + width)
        if self.configured_capacity:
            high = min(high, float(self.configured_capacity))
        if age >= high:
            return 0.0
        return (high - age) / (high - low)

    def age(self, stamp: int) -> int:
        return self.inserts - self.inserts_at[stamp]

    def touch(self, keys: Sequence[Hashable], predicted_hits: int) -> int:
        """The request's blocks were sent here: the new ones are inserted and all become most
        recent under a new stamp (returned); the mirror keeps at most the configured
        capacity of blocks."""
        blocks = self.blocks
        self.inserts += max(0, len(keys) - predicted_hits)
        stamp = len(self.inserts_at)
        self.inserts_at.append(self.inserts)
        for key in keys:
            if key in blocks:
                blocks.move_to_end(key)
            blocks[key] = stamp
        limit = self.configured_capacity or _UNKNOWN_CAPACITY
        while len(blocks) > limit:
            blocks.popitem(last=False)
        return stamp


@register("prefixroute")
class PrefixRoute(BasePolicy):
    def __init__(self, prefill_s_per_token: float = 4.0e-5,
                 attention_context_tokens: float = 44_000.0, step_overhead_tokens: float = 150.0,
                 chunk_tokens: int = 8192, decode_tokens_per_seq: float = 1.25,
                 decode_tokens_per_context_token: float = 1.3e-3,
                 survival_width: float = 0.25, learning_rate: float = 0.2,
                 speed_memory: float = 0.99, load_factor: float = 0.0,
                 tie_tolerance: float = 0.1, tie_s: float = 0.005) -> None:
        if prefill_s_per_token <= 0 or attention_context_tokens <= 0:
            raise ConfigError("prefill_s_per_token and attention_context_tokens must be positive")
        if step_overhead_tokens < 0 or decode_tokens_per_seq < 0 \
                or decode_tokens_per_context_token < 0:
            raise ConfigError("step_overhead_tokens and the decode costs must be >= 0")
        if not isinstance(chunk_tokens, int) or chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be a positive integer, got {chunk_tokens!r}")
        if not 0.0 <= survival_width < 1.0:
            raise ConfigError(f"survival_width must be in [0, 1), got {survival_width!r}")
        if not 0.0 < learning_rate <= 1.0:
            raise ConfigError(f"learning_rate must be in (0, 1], got {learning_rate!r}")
        if load_factor != 0 and load_factor < 1:
            raise ConfigError(f"load_factor must be 0 (off) or at least 1, got {load_factor!r}")
        if not 0.0 < speed_memory <= 1.0:
            raise ConfigError(f"speed_memory must be in (0, 1], got {speed_memory!r}")
        self.prefill_s_per_token = prefill_s_per_token
        self.attention_context_tokens = attention_context_tokens
        self.step_overhead_tokens = step_overhead_tokens
        self.chunk_tokens = chunk_tokens
        self.decode_tokens_per_seq = decode_tokens_per_seq
        self.decode_tokens_per_context_token = decode_tokens_per_context_token
        self.survival_width = survival_width
        self.learning_rate = learning_rate
        self.speed_memory = speed_memory
        self.load_factor = load_factor
        self.tie_tolerance = tie_tolerance
        self.tie_s = tie_s
        # Whether the runner's pending_prefill_tokens count a waiting request's whole prompt
        # (the simulator's engine) or only its uncached part (the documented meaning, the
        # gateway): found out as soon as a replica reports more than we sent uncached.
        self._pending_counts_prompt = False
        self._replicas: dict[int, ReplicaEstimate] = {}
        # request id -> (replica, stamps of the blocks predicted cached, inserts when routed)
        self._predictions: dict[str, tuple[int, list[int], int]] = {}
        self._pending: dict[str, tuple[int, list[int], float]] = {}  # route -> on_routed
        self._block_size = 16

    # -- estimates ------------------------------------------------------------------------------
    def _estimate(self, replica: ReplicaView, now: float) -> ReplicaEstimate:
        est = self._replicas.get(replica.index)
        if est is None:
            prior = replica.prefill_s_per_token or self._fleet_speed()
            est = self._replicas[replica.index] = ReplicaEstimate(prior, self.chunk_tokens)
        if replica.capacity_blocks and replica.capacity_blocks != est.configured_capacity:
            est.configured_capacity = replica.capacity_blocks
            est.capacity = float(replica.capacity_blocks)
        pending = replica.pending_prefill_tokens
        if pending > est.queue_units + 0.5 and not self._pending_counts_prompt and est.queue:
            self._pending_counts_prompt = True
        est.observe(pending, now, self.speed_memory)
        return est

    def _fleet_speed(self) -> float:
        if not self._replicas:
            return self.prefill_s_per_token
        speeds = sorted(e.s_per_token for e in self._replicas.values())
        return speeds[len(speeds) // 2]

    def prefill_work(self, uncached: float, cached: float) -> float:
        """Token-equivalents to compute ``uncached`` tokens after ``cached`` ones: linear part,
        attention over the context, and one step overhead per chunk."""
        if uncached <= 0:
            return 0.0
        attention = uncached * (cached + uncached / 2) / self.attention_context_tokens
        steps = -(-uncached // self.chunk_tokens)
        return uncached + attention + steps * self.step_overhead_tokens

    def decode_work(self, replica: ReplicaView, uncached: float) -> float:
        """Token-equivalents the replica's decoding requests add to the steps that compute
        ``uncached`` tokens: every step also decodes one token for each running request and
        reads the KV it holds."""
        steps = max(1, -(-int(uncached) // self.chunk_tokens))
        context = replica.kv_usage * replica.capacity_blocks * self._block_size
        return steps * (self.decode_tokens_per_seq * replica.running
                        + self.decode_tokens_per_context_token * context)

    def _expected_blocks(self, est: ReplicaEstimate, keys: Sequence[Hashable], limit: int,
                         view: CacheView) -> tuple[float, int, list[int]]:
        """(expected cached blocks, blocks the runner's view confirms, stamps of the blocks
        counted) for the first ``limit`` of ``keys`` on the replica of ``est``."""
        blocks = est.blocks
        stamps: list[int] = []
        for key in keys[:limit] if len(keys) > limit else keys:
            stamp = blocks.get(key)
            if stamp is None:
                break
            stamps.append(stamp)
        if not stamps:
            return 0.0, 0, stamps
        view_blocks = view.match(keys)
        width = self.survival_width
        floor = next(iter(est.in_flight.values())) if est.in_flight else None
        expected = 0.0
        running = 1.0
        last_stamp, last_p = -2, 1.0
        for i, stamp in enumerate(stamps):
            if stamp != last_stamp:
                last_stamp, last_p = stamp, est.survival(stamp, width)
            p = last_p
            if i >= view_blocks and (floor is None or stamp < floor):
                p = 0.0  # the runner's view says it is gone and no request is computing it
            if p < running:
                running = p
                if running <= 0.0:
                    del stamps[i:]
                    break
            expected += running
        return expected, view_blocks, stamps

    # -- routing --------------------------------------------------------------------------------
    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        now = request.now
        keys = request.block_keys
        block = request.block_size
        n = request.num_tokens
        limit = max(0, (n - 1) // block) if block > 0 else 0
        limit = min(limit, len(keys))
        self._block_size = block
        scores: dict[int, dict[str, float]] = {}
        costs: dict[int, float] = {}
        details: dict[int, tuple[float, int, list[int]]] = {}
        for replica in replicas:
            est = self._estimate(replica, now)
            expected, view_blocks, stamps = self._expected_blocks(est, keys, limit,
                                                                  replica.cache)
            cached = min(expected * block, float(limit * block))
            uncached = n - cached
            s = est.s_per_token
            wait = est.wait_s()
            prefill = self.prefill_work(uncached, cached) * s
            decode = self.decode_work(replica, uncached) * s
            cost = wait + prefill + decode
            costs[replica.index] = cost
            details[replica.index] = (expected, view_blocks, stamps)
            scores[replica.index] = {
                "expected_cached_tokens": round(cached, 1), "mirror_blocks": float(len(stamps)),
                "view_blocks": float(view_blocks), "wait_s": wait, "prefill_s": prefill,
                "decode_s": decode, "cost_s": cost, "s_per_token": s,
                "load": float(replica.load)}
        cheapest = min(costs, key=lambda i: (costs[i], i))
        allowed = list(costs)
        cap = None
        if self.load_factor and len(replicas) > 1:
            total = sum(r.load for r in replicas)
            cap = math.ceil(self.load_factor * (total + 1) / len(replicas))
            allowed = [r.index for r in replicas if r.load < cap] or allowed
        choice = min(allowed, key=lambda i: (costs[i], i))
        near = costs[choice] * (1 + self.tie_tolerance) + self.tie_s
        loads = {r.index: r.load for r in replicas}
        tied = [i for i in allowed if costs[i] <= near]
        if len(tied) > 1:
            choice = min(tied, key=lambda i: (loads[i], costs[i], i))
        best_hit = max(scores[i]["expected_cached_tokens"] for i in costs)
        chosen = scores[choice]
        if best_hit <= 0:
            branch = "cold_spread"
            reason = (f"no replica is expected to hold a prefix: replica {choice} has the "
                      f"shortest wait {chosen['wait_s']:.3f} s")
        elif chosen["expected_cached_tokens"] >= best_hit:
            est = self._replicas[choice]
            floor = next(iter(est.in_flight.values())) if est.in_flight else None
            inflight = floor is not None and any(s >= floor for s in details[choice][2])
            branch = "follow_inflight" if inflight else "cache_affinity"
            reason = (f"replica {choice} holds the most: {chosen['expected_cached_tokens']:.0f} "
                      f"of {n} tokens expected cached"
                      + (" (a request computing this prefix is still in flight there)"
                         if inflight else ""))
        else:
            holder = min((i for i in costs if scores[i]["expected_cached_tokens"] >= best_hit),
                         key=lambda i: (costs[i], i))
            branch = "spill"
            reason = (f"holder replica {holder} would cost {costs[holder]:.3f} s (wait "
                      f"{scores[holder]['wait_s']:.3f} s); replica {choice} costs "
                      f"{costs[choice]:.3f} s with {chosen['expected_cached_tokens']:.0f} "
                      f"cached tokens")
        if choice != cheapest:
            branch = "load_bound"
            reason = (f"replica {cheapest} would be cheapest ({costs[cheapest]:.3f} s) but has "
                      f"{scores[cheapest]['load']:.0f} requests in flight, at the cap {cap} "
                      f"({self.load_factor:g} x the mean); replica {choice} is the cheapest "
                      f"below it")
        reason += (f"; cost {costs[choice]:.3f} s = wait {chosen['wait_s']:.3f} + prefill "
                   f"{chosen['prefill_s']:.3f} + decode {chosen['decode_s']:.3f}")
        expected, held, stamps = details[choice]
        predicted_blocks = int(expected + 0.5)
        self._pending[request.request_id] = (choice, stamps, chosen["expected_cached_tokens"])
        return Decision(choice, branch, reason, scores, predicted_blocks * block)

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        index = decision.replica
        est = self._replicas.get(index)
        if est is None:
            est = self._replicas[index] = ReplicaEstimate(self._fleet_speed(),
                                                          self.chunk_tokens)
        keys = request.block_keys
        pending = self._pending.pop(request.request_id, None)
        if pending is not None and pending[0] == index:
            stamps, cached = pending[1], pending[2]
        else:  # routed elsewhere than we said (or by someone else): predict afresh
            expected, _, stamps = self._expected_blocks(est, keys, len(keys), _TRUST_MIRROR)
            cached = expected * request.block_size
        uncached = max(0.0, request.num_tokens - cached)
        units = request.num_tokens if self._pending_counts_prompt else uncached
        est.add_work(units, uncached, self.prefill_work(uncached, cached))
        inserts_before = est.inserts
        predicted_blocks = int(round(cached / request.block_size)) if request.block_size else 0
        stamp = est.touch(keys, predicted_blocks)
        est.in_flight[request.request_id] = stamp
        self._predictions[request.request_id] = (index, stamps, inserts_before)

    def on_completed(self, request: RequestView, replica: int, cached_tokens: int) -> None:
        """Correct the replica's estimate with what it reported.

        Fewer reused blocks than predicted: the first missing block was evicted, and with it
        every block touched before it (LRU), so the eviction horizon moves to its stamp; the
        request's own blocks were recomputed and cached again, so they stay. The LRU depth at
        which the block went lowers the replica's effective capacity; a hit deeper than the
        capacity raises it.
        """
        prediction = self._predictions.pop(request.request_id, None)
        est = self._replicas.get(replica)
        if est is None:
            return
        est.in_flight.pop(request.request_id, None)
        if prediction is None or prediction[0] != replica or request.block_size <= 0:
            return
        _, stamps, inserts_then = prediction
        reported = max(0, cached_tokens) // request.block_size
        rate = self.learning_rate
        if reported < len(stamps):
            lost = stamps[reported]
            if lost >= 0:
                est.horizon = max(est.horizon, lost)
                if est.capacity > 0:
                    depth = max(1, inserts_then - est.inserts_at[lost])
                    if depth < est.capacity:
                        est.capacity += rate * (depth - est.capacity)
        elif stamps and est.capacity > 0:
            known = [s for s in stamps if s >= 0]
            if known:
                depth = inserts_then - est.inserts_at[min(known)]
                if depth > est.capacity:
                    ceiling = float(est.configured_capacity or depth)
                    est.capacity = min(ceiling, est.capacity + rate * (depth - est.capacity))
