"""The replica engine: continuous batching over a paged pool, with vLLM's scheduling rules."""

import random

import pytest

from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.errors import ConfigError
from prefixroute.core.replica.engine import ReplicaEngine
from prefixroute.core.replica.service_time import LLAMA3_8B_H100, ServiceTimeModel

# 1 ms per prompt token, 10 ms per decoding request, nothing else: easy to add up.
SIMPLE = ServiceTimeModel("simple", step_overhead_s=0.0, prefill_s_per_token=1e-3,
                          attention_s_per_token_context=0.0, decode_s_per_seq=1e-2,
                          decode_s_per_context_token=0.0)


class SteppingEngine(ReplicaEngine):
    """Takes every step alone (no decode runs), as the engine did before it batched them."""

    def _decode_run_length(self, running):
        return 1


def drain(engine):
    events = []
    while (t := engine.next_event_time()) is not None:
        events += engine.advance(t)
    return events


def by_kind(events):
    return {(e.kind, e.request_id): (round(e.time, 9), e.cached_tokens) for e in events}


def test_two_requests_queue_share_a_step_and_the_second_hits_the_first_prompt():
    # Budget 100 tokens per step; both prompts are the same 160 tokens (10 blocks of 16).
    engine = ReplicaEngine(PagedBlockPool(101, 16), SIMPLE, max_num_batched_tokens=100)
    keys = list(range(10))
    engine.submit("a", 160, 3, keys, now=0.0)
    engine.submit("b", 160, 2, keys, now=0.05)  # arrives during a's first step: waits
    events = by_kind(drain(engine))
    # step 1 [0, 0.1): a's first chunk, 100 tokens.
    # step 2 [0.1, 0.176): a's last 60 tokens; b is admitted into the remaining 40-token
    #   budget and hits the 9 blocks a cached when its chunk was scheduled (144 tokens; the
    #   10th block holds b's last token, which is always recomputed): 60 + 16 = 76 tokens.
    assert events[("first_token", "a")] == (0.176, 0)
    assert events[("first_token", "b")] == (0.176, 144)
    # step 3 [0.176, 0.196): two decodes (20 ms); b has its 2 tokens.
    assert events[("finished", "b")] == (0.196, 144)
    # step 4 [0.196, 0.206): a decodes alone.
    assert events[("finished", "a")] == (0.206, 0)
    assert engine.idle and engine.pool.usage == 0.0


def test_readouts_show_waiting_running_and_pending_prefill():
    engine = ReplicaEngine(PagedBlockPool(101, 16), SIMPLE, max_num_batched_tokens=100)
    engine.submit("a", 160, 3, list(range(10)), now=0.0)
    engine.submit("b", 320, 2, list(range(100, 120)), now=0.01)
    assert (engine.running, engine.waiting) == (1, 1)
    # a has 160 - 0 tokens still to compute, b its whole prompt.
    assert engine.pending_prefill_tokens == 160 + 320
    engine.advance(0.1)  # a's first chunk of 100 is done; step 2 admits b
    assert engine.pending_prefill_tokens == 60 + 320
    assert engine.running == 2 and engine.waiting == 0
    engine.advance(0.2)  # step 2 computed a's last 60 and b's first 40 tokens
    assert engine.pending_prefill_tokens == 320 - 40
    assert 0 < engine.kv_usage <= 1


def test_a_request_larger_than_the_kv_cache_is_rejected():
    engine = ReplicaEngine(PagedBlockPool(5, 16), SIMPLE)  # 4 usable blocks = 64 tokens
    engine.submit("big", 64, 2, [], now=0.0)  # 64 + 2 - 1 = 65 slots > 64
    (event,) = engine.advance(0.0)
    assert event.kind == "rejected" and event.request_id == "big"


def test_a_finished_request_leaves_prompt_plus_output_minus_one_tokens_cached():
    pool = PagedBlockPool(101, 16)
    engine = ReplicaEngine(pool, SIMPLE)
    keys = list(range(5))  # 80 tokens: prompt 40 + reply 40, last reply token without KV
    engine.submit("r", 40, 40, keys, now=0.0)
    drain(engine)
    assert pool.match(keys) == 4  # 79 tokens of KV: 4 full blocks, not 5


def test_out_of_blocks_preempts_the_last_running_request_and_readmits_it():
    pool = PagedBlockPool(9, 16)  # 8 usable blocks
    engine = ReplicaEngine(pool, SIMPLE)
    engine.submit("a", 48, 40, [], now=0.0)  # 3 blocks, grows to 6
    engine.submit("b", 48, 40, [], now=0.0)
    events = drain(engine)
    assert engine.preemptions >= 1
    assert sorted(e.request_id for e in events if e.kind == "finished") == ["a", "b"]


def test_duplicate_and_invalid_requests_are_config_errors():
    engine = ReplicaEngine(PagedBlockPool(10, 16), SIMPLE)
    engine.submit("a", 16, 1, [], now=0.0)
    with pytest.raises(ConfigError, match="already"):
        engine.submit("a", 16, 1, [], now=0.0)
    with pytest.raises(ConfigError, match="output_tokens"):
        engine.submit("b", 16, 0, [], now=0.0)


def test_abort_frees_a_waiting_request_without_an_event():
    engine = ReplicaEngine(PagedBlockPool(101, 16), SIMPLE, max_num_seqs=1)
    engine.submit("a", 16, 5, [], now=0.0)
    engine.submit("b", 16, 5, [], now=0.0)
    assert engine.abort("b", now=0.001)
    events = drain(engine)
    assert [e.request_id for e in events if e.kind == "finished"] == ["a"]


def _replay(seed: int, decode_runs: bool, num_blocks: int, scheduling_policy: str = "fcfs",
            priorities: bool = False):
    """A random stream through one engine; with decode runs off every step is taken alone.
    With ``priorities`` each request gets a random priority from 0 to 3."""
    rng = random.Random(seed)
    log = []

    class Recorder:
        def on_stored(self, keys, parent, token_ids):
            log.append(("stored", tuple(keys)))

        def on_removed(self, keys):
            log.append(("removed", tuple(keys)))

        def on_cleared(self):
            log.append(("cleared",))

    engine = (ReplicaEngine if decode_runs else SteppingEngine)(
        PagedBlockPool(num_blocks, 16, listener=Recorder()), LLAMA3_8B_H100,
        max_num_batched_tokens=256, max_num_seqs=6, scheduling_policy=scheduling_policy)
    events, t = [], 0.0
    for i in range(30):
        t += rng.expovariate(2.0)
        prompt, output = rng.randint(1, 300), rng.randint(1, 100)
        family = rng.randrange(3)
        n_keys = (prompt + output - 1) // 16 if rng.random() < 0.5 else prompt // 16
        keys = [(family, j) if j < 5 else (i, j) for j in range(n_keys)]
        while (due := engine.next_event_time()) is not None and due <= t:
            events += engine.advance(due)
        engine.submit(i, prompt, output, keys, t,
                      priority=rng.randrange(4) if priorities else 0)
    events += drain(engine)
    return [(e.kind, e.request_id, round(e.time, 9), e.cached_tokens) for e in events], log


@pytest.mark.parametrize("num_blocks", [25, 400])
def test_decode_runs_give_exactly_the_events_of_stepping_one_step_at_a_time(num_blocks):
    for seed in range(5):
        assert _replay(seed, True, num_blocks) == _replay(seed, False, num_blocks)
        assert (_replay(seed, True, num_blocks, "priority", True)
                == _replay(seed, False, num_blocks, "priority", True))


@pytest.mark.parametrize("num_blocks", [25, 30, 400])
def test_priority_scheduling_with_every_priority_0_is_first_come_first_served(num_blocks):
    # The running requests are in arrival order, so the lowest priority is the last one, as
    # first come, first served preempts; with KV to spare (400) nothing is preempted at all.
    for seed in range(5):
        assert _replay(seed, True, num_blocks, "priority") == _replay(seed, True, num_blocks)


def test_priority_scheduling_admits_the_lowest_priority_first_then_by_arrival():
    # One request runs at a time (max_num_seqs=1): the others wait, and leave in the order
    # the scheduler admits them. 16-token prompts, 1 token out: each request is one step.
    order = {}
    for policy in ("fcfs", "priority"):
        engine = ReplicaEngine(PagedBlockPool(101, 16), SIMPLE, max_num_seqs=1,
                               scheduling_policy=policy)
        engine.submit("a", 16, 1, [], now=0.0, priority=9)  # admitted at once
        engine.submit("b", 16, 1, [], now=0.001, priority=5)
        engine.submit("c", 16, 1, [], now=0.002, priority=1)
        engine.submit("d", 16, 1, [], now=0.003, priority=1)
        assert engine.waiting == 3
        order[policy] = [e.request_id for e in drain(engine) if e.kind == "finished"]
    assert order["fcfs"] == ["a", "b", "c", "d"]  # vLLM ignores a priority under fcfs
    assert order["priority"] == ["a", "c", "d", "b"]


def test_priority_scheduling_preempts_the_lowest_priority_running_request():
    # 8 usable blocks; both prompts are 3 blocks and grow to 6 by decoding: one must go.
    # First come, first served preempts the last running request (b), and a finishes first;
    # priority scheduling preempts a (priority 9 against b's 1), though a was admitted
    # first, and b finishes first. Here a needs the block itself, so it preempts itself and
    # the engine schedules again at once (vLLM's loop calls schedule() again).
    finished = {}
    for policy in ("fcfs", "priority"):
        engine = ReplicaEngine(PagedBlockPool(9, 16), SIMPLE, scheduling_policy=policy)
        engine.submit("a", 48, 40, [], now=0.0, priority=9)
        engine.submit("b", 48, 40, [], now=0.0, priority=1)
        events = drain(engine)
        assert engine.preemptions >= 1
        finished[policy] = [e.request_id for e in events if e.kind == "finished"]
        assert engine.pool.usage == 0.0
    assert finished == {"fcfs": ["a", "b"], "priority": ["b", "a"]}


def test_a_victim_already_in_the_step_is_taken_out_of_it():
    # 6 usable blocks. a (40 tokens, priority 9) and b (48 tokens, priority 1) hold 3 blocks
    # each after their prompts. In the first step after b's prefill, a decodes first
    # (running order) and is scheduled; then b needs a fourth block, none is free, and the
    # lowest priority is a, already in the step: a is preempted and leaves the step, which
    # then decodes b alone, 10 ms (a's token taken back: 20 ms with it).
    steps = []

    class Watched(SteppingEngine):  # every step on its own, to be seen
        def _begin(self, start):
            before = self.preemptions
            super()._begin(start)
            if self._step is not None:
                steps.append(([(s.request_id, n) for s, n in self._step.scheduled],
                              round(self._step.end - self._step.start, 9),
                              self.preemptions - before))

    engine = Watched(PagedBlockPool(7, 16), SIMPLE, scheduling_policy="priority")
    engine.submit("a", 40, 20, [], now=0.0, priority=9)
    engine.submit("b", 48, 20, [], now=0.0, priority=1)
    events = drain(engine)
    assert steps[:3] == [([("a", 40)], 0.04, 0),              # a's prompt
                         ([("a", 1), ("b", 48)], 0.058, 0),   # a decodes, b's prompt
                         ([("b", 1)], 0.01, 1)]               # a preempted out of the step
    assert [e.request_id for e in events if e.kind == "finished"] == ["b", "a"]
    assert engine.pool.usage == 0.0


def test_bad_scheduling_policy_or_priority_is_a_config_error():
    with pytest.raises(ConfigError, match="scheduling_policy must be one of fcfs, priority"):
        ReplicaEngine(PagedBlockPool(10, 16), SIMPLE, scheduling_policy="lifo")
    engine = ReplicaEngine(PagedBlockPool(10, 16), SIMPLE, scheduling_policy="priority")
    with pytest.raises(ConfigError, match="priority must be an integer"):
        engine.submit("a", 16, 1, [], now=0.0, priority=1.5)


def _replay_entering(seed: int, num_blocks: int, overhead: float, shift: float):
    """A random stream (arrivals ``t``) through an engine whose requests enter ``overhead``
    after submission, submitted at ``t + shift``."""
    from dataclasses import replace

    rng = random.Random(seed)
    service = replace(LLAMA3_8B_H100, request_overhead_s=overhead)
    engine = ReplicaEngine(PagedBlockPool(num_blocks, 16), service,
                           max_num_batched_tokens=256, max_num_seqs=6)
    events, t = [], 0.0
    for i in range(40):
        t += rng.expovariate(20.0)
        prompt, output = rng.randint(1, 300), rng.randint(1, 60)
        family = rng.randrange(3)
        keys = [(family, j) if j < 5 else (i, j) for j in range((prompt + output - 1) // 16)]
        at = t + shift
        while (due := engine.next_event_time()) is not None and due <= at:
            events += engine.advance(due)
        engine.submit(i, prompt, output, keys, at)
    events += drain(engine)
    return [(e.kind, e.request_id, round(e.time, 9), e.cached_tokens) for e in events], engine


@pytest.mark.parametrize("num_blocks", [30, 400])
def test_a_request_overhead_is_the_same_as_submitting_that_much_later(num_blocks):
    overhead = 0.0123
    for seed in range(5):
        delayed, engine = _replay_entering(seed, num_blocks, overhead, 0.0)
        later, reference = _replay_entering(seed, num_blocks, 0.0, overhead)
        assert delayed == later
        assert engine.busy_s == pytest.approx(reference.busy_s)  # steps are no longer
        assert engine.steps == reference.steps


def test_a_request_overhead_adds_to_the_first_token_not_to_steps():
    from dataclasses import replace

    slow_entry = replace(SIMPLE, request_overhead_s=0.05)
    engine = ReplicaEngine(PagedBlockPool(101, 16), slow_entry)
    engine.submit("a", 100, 3, [], now=0.0)
    # Not in the engine yet: neither waiting nor running, no blocks; it wakes the caller
    # when it enters.
    assert (engine.waiting, engine.running, engine.entering) == (0, 0, 1)
    assert engine.pool.usage == 0.0 and not engine.idle
    assert engine.next_event_time() == 0.05
    assert engine.advance(0.05) == [] and engine.running == 1
    events = by_kind(drain(engine))
    # 0.05 s entry + 100 ms prefill; then two 10 ms decode steps.
    assert events[("first_token", "a")] == (0.15, 0)
    assert events[("finished", "a")] == (0.17, 0)
    assert engine.busy_s == pytest.approx(0.12)
    # A request entering during a run of decode steps wakes the caller when it enters (the
    # run is cut at the next step boundary), not at the end of the run.
    engine.submit("long", 10, 100, [], now=1.0)
    engine.advance(1.2)  # entered at 1.05, prefilled by 1.06, decoding 10 ms steps to 2.05
    assert engine.next_event_time() == pytest.approx(2.05)
    engine.submit("b", 10, 2, [], now=1.2)
    assert engine.next_event_time() == pytest.approx(1.25)
    # Zero overhead: the same request is served at once.
    plain = ReplicaEngine(PagedBlockPool(101, 16), SIMPLE)
    plain.submit("a", 100, 3, [], now=0.0)
    assert by_kind(drain(plain))[("first_token", "a")] == (0.1, 0)


def test_a_request_aborted_while_entering_never_runs():
    from dataclasses import replace

    engine = ReplicaEngine(PagedBlockPool(101, 16), replace(SIMPLE, request_overhead_s=0.05))
    engine.submit("a", 100, 3, [], now=0.0)
    engine.submit("b", 100, 3, [], now=0.01)
    assert engine.abort("a", now=0.02) and engine.entering == 1
    assert not engine.abort("a", now=0.02)
    events = drain(engine)
    assert [(e.kind, e.request_id) for e in events] == [("first_token", "b"), ("finished", "b")]
    assert events[0].time == pytest.approx(0.16)


def test_make_replica_sizes_kv_from_blocks_or_from_memory_and_model():
    from prefixroute.core.identity.model_config import MODEL_PRESETS
    from prefixroute.core.replica.engine import make_replica
    by_blocks = make_replica(SIMPLE, 16, num_blocks=100)
    assert by_blocks.pool.capacity_blocks == 99  # vLLM: block 0 is the null block
    # Llama-3-8B: 128 KiB per token; 1 GiB holds 8,192 tokens = 512 blocks of 16.
    by_memory = make_replica(SIMPLE, 16, memory_bytes=1 << 30, model=MODEL_PRESETS["llama-3-8b"])
    assert by_memory.pool.capacity_blocks == 512
    with pytest.raises(ConfigError, match="one way"):
        make_replica(SIMPLE, 16)


def test_a_request_in_its_overhead_counts_as_pending_prefill():
    # A router counts a prefill pending from dispatch to the first token; the overhead before
    # the engine admits the request is part of that time, so the readout counts it too.
    from dataclasses import replace

    engine = ReplicaEngine(PagedBlockPool(101, 16), replace(SIMPLE, request_overhead_s=0.05))
    engine.submit("a", 100, 3, [], now=0.0)
    engine.submit("b", 60, 3, [], now=0.01)
    assert engine.entering == 2 and engine.pending_prefill_tokens == 160
    assert engine.abort("b", now=0.02)
    assert engine.pending_prefill_tokens == 100
    engine.advance(0.05)  # a entered: waiting or in its step, still uncomputed
    assert engine.entering == 0 and engine.pending_prefill_tokens == 100
    drain(engine)
    assert engine.pending_prefill_tokens == 0
