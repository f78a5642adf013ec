"""A step-driven continuous-batching engine over a paged KV block pool: one replica.

The simulator drives it on a manual clock and the engine emulator in real time; it reads no
clock itself. Callers ``submit(...)`` requests at ``now``, ask :meth:`ReplicaEngine.next_event_time`
when something a client can see happens next, and call :meth:`ReplicaEngine.advance` with the
current time to collect events (``first_token``, ``finished`` with the cached tokens vLLM would
report, ``rejected``).

Scheduling follows vLLM v1's ``Scheduler.schedule()`` (``vllm/v1/core/sched/scheduler.py``):

* a step has a token budget (``max_num_batched_tokens``, 8192 here as vLLM's default for the
  API server on large GPUs) and at most ``max_num_seqs`` running requests (vLLM default 256);
* running requests are served first, in order: each gets ``num_tokens - num_computed`` new
  tokens (one while decoding; a chunk of its prompt while prefilling, capped by the budget:
  chunked prefill);
* if a running request needs a block and none is free, the *last* running request is
  preempted (recompute: its blocks are freed, it goes back to the front of the queue, and when
  readmitted recomputes prompt and output so far, hitting whatever is still cached);
* then, if nobody was preempted, waiting requests are admitted first come first served while
  budget and blocks last; the first one that does not fit stops admission (head-of-line, as
  vLLM's FCFS queue);
* with ``scheduling_policy="priority"`` (``vllm serve --scheduling-policy priority``) the
  waiting queue is ordered by ``(priority, arrival)`` instead (vLLM's
  ``PriorityRequestQueue``, a heap; a lower value goes first; a request's ``priority`` comes
  with it, the OpenAI API's ``priority`` field, default 0), a preempted request goes back in
  that order rather than to the front, and the request preempted is the running one with the
  largest ``(priority, arrival)``, taken out of the step being scheduled if it was already in
  it (``Scheduler.schedule()``, ``SchedulingPolicy.PRIORITY``). Every request at priority 0
  is first come first served again;
* full blocks are cached when their tokens are *scheduled* (vLLM caches in
  ``allocate_slots``), so a request admitted later in the same step may hit them; decode
  blocks are cached as they fill when the caller gave keys for the output tokens;
* a request's first token is sampled by the step that computes its last prompt token; the last
  sampled token never gets KV, so a finished request leaves ``prompt + output - 1`` tokens.

One deliberate difference: :meth:`PagedBlockPool.admit` reserves blocks for the whole prompt at
admission, where vLLM allocates per scheduled chunk; it only matters when one long prompt would
fit chunk by chunk but not at once.

A request enters the engine ``service.request_overhead_s`` after it is submitted (the work a
server does outside engine steps: HTTP, tokenization, inter-process hops; 0 by default): until
then it is neither waiting nor running and holds no blocks, and it adds that much to its time
to first token without lengthening any step. A step begins as soon as the engine is free and
has work (vLLM's engine loop does not wait), so requests entering while a step runs join the
next one. Steps in which every running request
just decodes one token and nothing else can change are taken together ("decode runs"): the
engine computes in closed form how many such steps end by a given time, which keeps the cost
per request roughly constant however many tokens it generates. A decode run is cut at the next
step boundary when a request arrives; its results are identical to stepping one by one.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

from mypy_extensions import mypyc_attr

from prefixroute.core.caches.base import CacheEventListener, capacity_in_blocks, fits_kv
from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.model_config import ModelConfig
from prefixroute.core.replica.service_time import ServiceTimeModel

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1 default for `vllm serve` on large GPUs
DEFAULT_MAX_NUM_SEQS = 256  # vLLM default max_num_seqs


@dataclass(slots=True, frozen=True)
class EngineEvent:
    """Something a client sees. ``kind`` is ``first_token``, ``finished`` or ``rejected``;
    ``cached_tokens`` is what vLLM reports in ``usage.prompt_tokens_details.cached_tokens``
    (the prefix hit at first admission)."""

    kind: str
    request_id: Hashable
    time: float
    cached_tokens: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0


class _Seq:
    """A request inside the engine (vLLM's ``Request``): its tokens and its progress."""

    __slots__ = ("request_id", "prompt", "max_output", "keys", "token_ids", "arrival",
                 "computed", "generated", "cached_tokens", "num_blocks", "committed",
                 "prefill_target", "first_token_s", "aborted", "order")

    def __init__(self, request_id: Hashable, prompt: int, max_output: int,
                 keys: Sequence[Hashable], token_ids: Sequence[int] | None, arrival: float,
                 order: tuple[int, float, int] = (0, 0.0, 0)) -> None:
        self.request_id = request_id
        self.order = order         # (priority, arrival, submission number): the priority order
        self.prompt = prompt
        self.max_output = max_output
        self.keys = keys
        self.token_ids = token_ids
        self.arrival = arrival
        self.computed = 0          # tokens with KV (vLLM num_computed_tokens)
        self.generated = 0         # output tokens sampled so far
        self.cached_tokens = -1    # prefix hit at first admission (-1: never admitted)
        self.num_blocks = 0        # blocks held in the pool
        self.committed = 0         # leading blocks registered as cached
        self.prefill_target = prompt  # tokens to (re)compute before decoding resumes
        self.first_token_s: float | None = None
        self.aborted = False


class _PriorityQueue:
    """vLLM's ``PriorityRequestQueue``: a heap on ``(priority, arrival)``, with the deque
    methods the scheduler uses. "Prepending" a preempted request puts it back in its order."""

    __slots__ = ("_heap",)

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, _Seq]] = []

    def append(self, seq: _Seq) -> None:
        heapq.heappush(self._heap, (seq.order, seq))

    def appendleft(self, seq: _Seq) -> None:
        self.append(seq)

    def popleft(self) -> _Seq:
        return heapq.heappop(self._heap)[1]

    def __getitem__(self, index: int) -> _Seq:
        if index != 0:
            raise IndexError("only the head of a priority queue can be read")
        return self._heap[0][1]

    def remove(self, seq: _Seq) -> None:
        for i, (_, entry) in enumerate(self._heap):
            if entry is seq:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return
        raise ValueError("not in the queue")

    def __contains__(self, seq: object) -> bool:
        return any(entry is seq for _, entry in self._heap)

    def __len__(self) -> int:
        return len(self._heap)


SCHEDULING_POLICIES = ("fcfs", "priority")  # vllm serve --scheduling-policy


def _decodes(seq: _Seq, new: int, target: int) -> bool:
    """Whether ``new`` tokens scheduled up to ``target`` are one decode step (else prefill,
    or recompute after preemption): the step's cost counts them differently."""
    return new == 1 and seq.generated > 0 and target == seq.prompt + seq.generated


class _Step:
    """A begun step: what it scheduled and when it ends."""

    __slots__ = ("start", "end", "scheduled")

    def __init__(self, start: float, end: float, scheduled: list):
        self.start = start
        self.end = end
        self.scheduled = scheduled  # [(seq, new_tokens)]


class _DecodeRun:
    """``count`` consecutive pure-decode steps over the same running requests.

    Step j (1-based, counted from ``start``) ends at ``start + T(j)`` with
    ``T(j) = alpha * j + beta * j * (j - 1)``: every step decodes ``D`` requests whose contexts
    grow by one token each per step. ``applied`` steps have begun (their blocks allocated and
    cached); ``count`` may shrink when a request arrives.
    """

    __slots__ = ("start", "count", "applied", "alpha", "beta")

    def __init__(self, start: float, count: int, alpha: float, beta: float):
        self.start = start
        self.count = count
        self.applied = 1
        self.alpha = alpha
        self.beta = beta

    def elapsed(self, steps: int) -> float:
        return self.alpha * steps + self.beta * steps * (steps - 1)

    @property
    def end(self) -> float:
        return self.start + self.elapsed(self.count)

    def ended_by(self, now: float) -> int:
        """How many of the steps have ended at or before ``now``."""
        budget = now - self.start
        if budget < 0:
            return 0
        alpha, beta = self.alpha, self.beta
        if beta > 0:
            # beta k^2 + (alpha - beta) k - budget <= 0
            b = alpha - beta
            k = int((-b + math.sqrt(b * b + 4 * beta * budget)) / (2 * beta))
        elif alpha > 0:
            k = int(budget / alpha)
        else:
            return self.count
        k = max(0, min(k, self.count))
        while k < self.count and self.start + self.elapsed(k + 1) <= now:
            k += 1
        while k > 0 and self.start + self.elapsed(k) > now:
            k -= 1
        return k


# (The tests subclass it to take every step alone and to watch them.)
@mypyc_attr(allow_interpreted_subclasses=True)
class ReplicaEngine:
    """One replica: a waiting queue, a running batch, a :class:`PagedBlockPool`, and a
    :class:`ServiceTimeModel` that says how long each step takes."""

    # The options a caller sets are typed ``object`` and checked here, so that a wrong one
    # gets its ConfigError compiled too (a compiled ``int`` parameter refuses a float first).
    def __init__(self, pool: PagedBlockPool, service: ServiceTimeModel, *,
                 max_num_batched_tokens: object = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_num_seqs: object = DEFAULT_MAX_NUM_SEQS, name: str = "",
                 scheduling_policy: object = "fcfs"):
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ConfigError(f"max_num_batched_tokens must be a positive integer, got "
                              f"{max_num_batched_tokens!r}")
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        if not isinstance(scheduling_policy, str) or scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}"
                              f", got {scheduling_policy!r}")
        self.scheduling_policy = scheduling_policy
        self.pool = pool
        self.service = service
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.name = name
        self._priority = scheduling_policy == "priority"
        self._waiting: deque[_Seq] | _PriorityQueue = (_PriorityQueue() if self._priority
                                                       else deque())
        self._submissions = itertools.count()
        self._running: list[_Seq] = []
        # Submitted, entering at (time, order, seq) once the request overhead has passed.
        self._arriving: list[tuple[float, int, _Seq]] = []
        self._arrival_order = itertools.count()
        self._entering_prompt = 0  # prompt tokens of the requests in ``_arriving``
        self._seqs: dict[Hashable, _Seq] = {}
        self._step: _Step | None = None
        self._run: _DecodeRun | None = None
        self._time = 0.0      # the last step boundary processed
        self._outbox: list[EngineEvent] = []
        self._pending_prefill = 0
        self._readout: tuple[int, int, int, float] | None = None  # see readout()
        # Counters.
        self.busy_s = 0.0     # time spent in steps
        self.steps = 0
        self.preemptions = 0
        self.finished = 0

    # -- load readouts (what a router may read from /metrics) --------------------------------
    @property
    def waiting(self) -> int:
        """``vllm:num_requests_waiting``."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """``vllm:num_requests_running``."""
        return len(self._running)

    @property
    def kv_usage(self) -> float:
        """``vllm:kv_cache_usage_perc`` (0..1): blocks held by running requests."""
        return self.pool.usage

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens (and tokens to recompute after preemption) not computed yet; a
        waiting request counts its whole prompt, since its hit is known only at admission,
        and so does one still in its request overhead: a router counts a prefill pending
        from dispatch to the first token, and the overhead (HTTP, tokenizing) is part of that
        time, as it is of a real engine's (a gateway's pending prefill is its dispatched
        requests without a first token)."""
        return self._pending_prefill + self._entering_prompt

    def readout(self) -> tuple[int, int, int, float]:
        """``(waiting, running, pending_prefill_tokens, kv_usage)`` at once. The same tuple
        until the engine next moves (every change goes through :meth:`submit`,
        :meth:`advance` or :meth:`abort`), so a simulator that fills 32 replicas' load before
        every decision reads again only the engines that moved."""
        readout = self._readout
        if readout is None:
            readout = self._readout = (self.waiting, self.running,
                                       self.pending_prefill_tokens, self.kv_usage)
        return readout

    def busy_seconds_until(self, t: float) -> float:
        """Seconds spent in steps up to time ``t``, given that every event at or before ``t``
        has been processed (so the step or decode run in progress, if any, began at or before
        ``t``): the finished steps' time plus the part of the current step or run before
        ``t``. A decode run is back-to-back steps, so it is busy from its start (the first
        unfinished step) to its end."""
        busy = self.busy_s
        current = self._run if self._run is not None else self._step
        if current is not None and t > current.start:
            busy += min(t, current.end) - current.start
        return busy

    @property
    def idle(self) -> bool:
        return self._step is None and self._run is None and not self._arriving

    @property
    def entering(self) -> int:
        """Requests submitted but still in their request overhead (not yet in the engine)."""
        return len(self._arriving)

    # -- requests -------------------------------------------------------------------------------
    def submit(self, request_id: Hashable, prompt_tokens: object, output_tokens: object,
               block_keys: Sequence[Hashable], now: float,
               token_ids: Sequence[int] | None = None, priority: object = 0) -> None:
        """Queue a request arriving at ``now``; it enters the engine at ``now +
        service.request_overhead_s``. ``priority`` orders the waiting queue under the
        ``priority`` scheduling policy (lower first) and is ignored under ``fcfs``, as vLLM
        does.

        ``block_keys`` are the chained keys of its full blocks: the prompt's, and optionally
        further ones for prompt + output tokens (then decode blocks are cached as they fill, as
        vLLM does). ``token_ids`` (optional) ride along in the pool's ``BlockStored`` events.
        Events due before ``now`` are kept for the next :meth:`advance`. The counts and the
        priority are checked here (typed ``object`` for that: see ``__init__``).
        """
        if request_id in self._seqs:
            raise ConfigError(f"request {request_id!r} is already in the engine")
        if not isinstance(prompt_tokens, int) or prompt_tokens < 1:
            raise ConfigError(f"request {request_id!r}: prompt_tokens must be >= 1, "
                              f"got {prompt_tokens!r}")
        if not isinstance(output_tokens, int) or output_tokens < 1:
            raise ConfigError(f"request {request_id!r}: output_tokens must be >= 1, "
                              f"got {output_tokens!r}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ConfigError(f"request {request_id!r}: priority must be an integer, "
                              f"got {priority!r}")
        self._run_until(now)
        if not fits_kv(prompt_tokens, output_tokens, self.pool.capacity_blocks,
                       self.block_size):
            self._outbox.append(EngineEvent("rejected", request_id, now, 0, prompt_tokens, 0))
            return
        seq = _Seq(request_id, prompt_tokens, output_tokens, block_keys, token_ids, now,
                   (priority, now, next(self._submissions)))
        self._seqs[request_id] = seq
        overhead = self.service.request_overhead_s
        if overhead > 0:
            heapq.heappush(self._arriving, (now + overhead, next(self._arrival_order), seq))
            self._entering_prompt += seq.prompt
        else:
            self._enter(seq, now)

    def _enter(self, seq: _Seq, now: float) -> None:
        """The request reaches the scheduler's waiting queue at ``now``."""
        self._waiting.append(seq)
        self._pending_prefill += seq.prompt
        if self._step is None and self._run is None:
            self._begin(max(now, self._time))
        elif self._run is not None:
            # Only the step in progress keeps running; the newcomer joins at its end.
            self._run.count = self._run.applied

    def abort(self, request_id: Hashable, now: float) -> bool:
        """Drop a request (client went away). A request still entering (in its request
        overhead) or waiting leaves at once; a running one at the end of the step in progress,
        freeing its blocks. No event is emitted."""
        self._run_until(now)
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        for index, entry in enumerate(self._arriving):
            if entry[2] is seq:  # still in its request overhead
                self._arriving[index] = self._arriving[-1]
                self._arriving.pop()
                heapq.heapify(self._arriving)
                self._entering_prompt -= seq.prompt
                del self._seqs[request_id]
                return True
        if seq in self._waiting:
            self._waiting.remove(seq)
            self._pending_prefill -= max(0, seq.prefill_target - seq.computed)
            del self._seqs[request_id]
            return True
        seq.aborted = True
        if self._run is not None:
            self._run.count = self._run.applied
        return True

    def next_event_time(self) -> float | None:
        """When the next client-visible event can happen (the end of the step or decode run in
        progress); ``None`` when idle. Cache changes in between are applied by
        :meth:`advance` as time passes."""
        if self._outbox:
            return self._time
        end = None
        if self._run is not None:
            end = self._run.end
        elif self._step is not None:
            end = self._step.end
        if self._arriving:
            # A request entering may begin a step (idle engine) or cut a decode run.
            enters = self._arriving[0][0]
            if end is None or enters < end:
                return enters
        return end

    def advance(self, now: float) -> list[EngineEvent]:
        """Run every step that ends by ``now``; return the events, in time order."""
        self._run_until(now)
        events, self._outbox = self._outbox, []
        return events

    # -- the step loop ----------------------------------------------------------------------------
    def _run_until(self, now: float) -> None:
        self._readout = None  # (every public entry that changes the engine passes here first)
        arriving = self._arriving
        while arriving and arriving[0][0] <= now:
            enters, _, seq = heapq.heappop(arriving)
            self._entering_prompt -= seq.prompt
            self._steps_until(enters)
            self._enter(seq, enters)
        self._steps_until(now)

    def _steps_until(self, now: float) -> None:
        while True:
            run = self._run
            if run is not None:
                done = run.ended_by(now)
                if done == 0:
                    return
                full = done >= run.count
                self._finish_run_steps(run, done)
                if not full:
                    return
                end = self._time
                self._run = None
                self._begin(end)
                continue
            step = self._step
            if step is None or step.end > now:
                return
            self._end_step(step)
            self._step = None
            self._begin(step.end)

    def _begin(self, start: float) -> None:
        """Schedule one step at ``start`` (vLLM ``schedule()``), or go idle."""
        self._time = start
        if not self._running and not self._waiting:
            return
        pool = self.pool
        block_size = self.block_size
        budget = self.max_num_batched_tokens
        running = self._running
        scheduled: list[tuple[_Seq, int]] = []
        # What the step computes, for its duration: prompt tokens and their attention span,
        # decoding requests and their context.
        prefill_tokens = prefill_context = decode_batch = decode_context = 0
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.computed
            new = seq.prompt + seq.generated - computed
            if new > budget:
                new = budget
            if new <= 0:
                i += 1
                continue
            target = computed + new
            if target > seq.num_blocks * block_size:
                can_schedule = True
                while True:
                    if pool.grow(seq.request_id, target):
                        seq.num_blocks = -(-target // block_size)
                        break
                    if self._priority:
                        # The lowest priority goes, even one already in this step.
                        at = max(range(len(running)), key=lambda j: running[j].order)
                        victim = running.pop(at)
                        if at < i:
                            i -= 1
                            for k, (done, tokens) in enumerate(scheduled):
                                if done is victim:
                                    del scheduled[k]
                                    budget += tokens
                                    end = done.computed + tokens
                                    if _decodes(done, tokens, end):
                                        decode_batch -= 1
                                        decode_context -= end
                                    else:
                                        prefill_tokens -= tokens
                                        prefill_context -= tokens * end
                                    break
                    else:
                        victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        can_schedule = False
                        break
                if not can_schedule:
                    break
            if seq.committed < len(seq.keys) and target // block_size > seq.committed:
                self._cache_blocks(seq, target)
            scheduled.append((seq, new))
            budget -= new
            if _decodes(seq, new, target):
                decode_batch += 1
                decode_context += target
            else:
                prefill_tokens += new
                prefill_context += new * target
            i += 1
        admitted = False
        if not preempted:
            waiting = self._waiting
            while waiting and budget > 0 and len(running) < self.max_num_seqs:
                seq = waiting[0]
                num_tokens = seq.prompt + seq.generated
                cached = pool.admit(seq.request_id, seq.keys, num_tokens)
                if cached is None:
                    break
                waiting.popleft()
                running.append(seq)
                admitted = True
                if seq.cached_tokens < 0:
                    seq.cached_tokens = cached
                seq.computed = cached
                seq.num_blocks = -(-num_tokens // block_size)
                seq.committed = cached // block_size
                self._pending_prefill -= cached
                new = min(num_tokens - cached, budget)
                target = cached + new
                self._cache_blocks(seq, target)
                scheduled.append((seq, new))
                budget -= new
                if _decodes(seq, new, target):
                    decode_batch += 1
                    decode_context += target
                else:
                    prefill_tokens += new
                    prefill_context += new * target
        if not scheduled:
            if preempted and (self._running or self._waiting):
                # Under priority scheduling the request being scheduled can be the one
                # preempted before anyone was scheduled; vLLM's engine loop schedules again at
                # once, and the running requests go ahead.
                self._begin(start)
            return
        service = self.service
        duration = service.step_time(prefill_tokens, prefill_context, decode_batch, decode_context)
        if (prefill_tokens == 0 and not preempted and not admitted
                and decode_batch == len(running)):
            count = self._decode_run_length(running)
            if count >= 2:
                alpha = duration
                beta = service.decode_s_per_context_token * decode_batch / 2
                self._run = _DecodeRun(start, count, alpha, beta)
                return
        self._step = _Step(start, start + duration, scheduled)

    def _decode_run_length(self, running: list[_Seq]) -> int:
        """How many pure-decode steps (including the one just scheduled) can run before
        anything but time changes: up to the first finish, while free blocks last, and not at
        all while a queued request might be unblocked by blocks this run would cache."""
        count = min(seq.max_output - seq.generated for seq in running)
        if count < 2 or any(seq.aborted for seq in running):
            return 1
        block_size = self.block_size
        if self._waiting and any(len(seq.keys) > seq.committed for seq in running):
            return 1
        free = self.pool.free_blocks

        def blocks_needed(steps: int) -> int:
            # Step j needs slots for computed + j tokens (computed as of the first step).
            total = 0
            for seq in running:
                extra = -(-(seq.computed + steps) // block_size) - seq.num_blocks
                if extra > 0:
                    total += extra
            return total

        if blocks_needed(count) <= free:
            return count
        low, high = 1, count  # blocks_needed(low) == 0 <= free: step 1 is already allocated
        while low < high:
            mid = (low + high + 1) // 2
            if blocks_needed(mid) <= free:
                low = mid
            else:
                high = mid - 1
        return low

    def _cache_blocks(self, seq: _Seq, tokens: int) -> None:
        full = min(tokens // self.block_size, len(seq.keys))
        if full > seq.committed:
            self.pool.commit(seq.request_id, seq.keys, tokens, seq.token_ids)
            seq.committed = full

    def _preempt(self, seq: _Seq) -> None:
        """vLLM recompute preemption: free the blocks (cached ones stay cached), requeue first
        (under the priority policy: in its order)."""
        self.pool.release(seq.request_id)
        self._pending_prefill -= max(0, seq.prefill_target - seq.computed)
        seq.computed = 0
        seq.num_blocks = 0
        seq.committed = 0
        seq.prefill_target = seq.prompt + seq.generated
        self._pending_prefill += seq.prefill_target
        self._waiting.appendleft(seq)
        self.preemptions += 1

    def _end_step(self, step: _Step) -> None:
        end = step.end
        self.busy_s += end - step.start
        self.steps += 1
        self._time = end
        done = False
        for seq, new in step.scheduled:
            before = seq.computed
            if before < seq.prefill_target:
                self._pending_prefill -= min(new, seq.prefill_target - before)
            seq.computed = before + new
            if seq.computed == seq.prompt + seq.generated:
                seq.generated += 1
                if seq.first_token_s is None:
                    seq.first_token_s = end
                    self._outbox.append(EngineEvent("first_token", seq.request_id, end,
                                                    seq.cached_tokens, seq.prompt, 1))
                if seq.generated >= seq.max_output:
                    done = True
            if seq.aborted:
                done = True
        if done:
            self._retire(end)

    def _finish_run_steps(self, run: _DecodeRun, steps: int) -> None:
        """End the first ``steps`` steps of a decode run (and begin the next one if the run
        goes on): every running request gains ``steps`` tokens."""
        target_applied = min(steps + 1, run.count)
        if target_applied > run.applied:
            self._apply_run_blocks(run, target_applied)
        elapsed = run.elapsed(steps)
        end = run.start + elapsed
        self.busy_s += elapsed
        self.steps += steps
        for seq in self._running:
            seq.computed += steps
            seq.generated += steps
        # Re-base the run on its first unfinished step.
        run.start = end
        run.alpha += 2 * run.beta * steps
        run.count -= steps
        run.applied -= steps
        self._time = end
        if run.count == 0:
            self._retire(end)

    def _apply_run_blocks(self, run: _DecodeRun, upto: int) -> None:
        """Begin steps ``applied + 1 .. upto`` of a run: allocate blocks as sequences cross a
        block boundary and cache decode blocks as they fill, in vLLM's order (step by step,
        running requests in order, allocation before caching)."""
        block_size = self.block_size
        first = run.applied + 1
        actions: list[tuple[int, int, int, _Seq]] = []
        for index, seq in enumerate(self._running):
            base = seq.computed  # tokens as of the run's first unfinished step
            # grow when base + j exceeds the slots held
            j = seq.num_blocks * block_size - base + 1
            j = max(j, first)
            while j <= upto:
                if base + j > seq.num_blocks * block_size:
                    actions.append((j, index, 0, seq))
                    j += block_size
                else:
                    j += 1
            if len(seq.keys) > seq.committed:
                j = (seq.committed + 1) * block_size - base
                while j <= upto:
                    if j >= first and (base + j) // block_size <= len(seq.keys):
                        actions.append((j, index, 1, seq))
                    j += block_size
        actions.sort(key=lambda a: (a[0], a[1], a[2]))
        pool = self.pool
        for j, _, kind, seq in actions:
            tokens = seq.computed + j
            if kind == 0:
                if not pool.grow(seq.request_id, tokens):  # pragma: no cover - pre-checked
                    raise AssertionError("decode run ran out of blocks")
                seq.num_blocks = -(-tokens // block_size)
            else:
                self._cache_blocks(seq, tokens)
        run.applied = upto

    def _retire(self, now: float) -> None:
        """Release requests that finished (or were aborted) at ``now``."""
        keep = []
        for seq in self._running:
            if seq.generated >= seq.max_output or seq.aborted:
                self.pool.release(seq.request_id)
                del self._seqs[seq.request_id]
                if not seq.aborted:
                    self.finished += 1
                    self._outbox.append(EngineEvent("finished", seq.request_id, now,
                                                    seq.cached_tokens, seq.prompt,
                                                    seq.generated))
            else:
                keep.append(seq)
        self._running[:] = keep


def make_replica(service: ServiceTimeModel, block_size: int, *, num_blocks: int | None = None,
                 memory_bytes: float | None = None, model: ModelConfig | None = None,
                 listener: CacheEventListener | None = None, name: str = "",
                 **engine_options) -> ReplicaEngine:
    """A replica with its pool, sized as vLLM sizes it: ``num_blocks`` physical blocks (vLLM's
    ``--num-gpu-blocks-override``, block 0 reserved, so ``num_blocks - 1`` usable), or the
    blocks of KV that ``memory_bytes`` hold for ``model`` (all usable, plus the null block).
    ``listener`` receives the pool's KV events."""
    if (num_blocks is None) == (memory_bytes is None):
        raise ConfigError("size the replica one way: num_blocks, or memory_bytes with a model")
    if num_blocks is None:
        num_blocks = capacity_in_blocks(block_size, memory_bytes=memory_bytes, model=model) + 1
    pool = PagedBlockPool(num_blocks, block_size, listener=listener)
    return ReplicaEngine(pool, service, name=name, **engine_options)
