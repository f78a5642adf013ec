"""``prefixroute``, our default policy, as specifications.

Every scenario is small enough to check by hand. Unless a test says otherwise the policy is
:func:`plain`: the linear cost model (``LINEAR``: no attention term, no step overhead, no
delay charged to others) and no balance rules, so a replica's cost is ``wait + uncached
tokens x seconds per token`` and the cheapest replica wins; replicas state 1 ms per token
(``prefill_s_per_token=1e-3``), so 100 uncached tokens cost 0.1 s. A test of a balance rule
passes that rule. The variants that switch a mechanism off come from the benchmark's
``prefixroute_ablation`` (``benchmarks/prefixroute_ablations.py``).
"""

from __future__ import annotations

import dataclasses
import math
import sys
from pathlib import Path

import pytest

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.prefixroute import (ColdBalance, PrefixRoute,
                                                          PrefixRouteParams, SessionMove)
from prefixroute.core.routing.policies.prefixroute.costs import CostModel
from prefixroute.core.routing.policies.prefixroute.queue import PrefillQueue, QueuedPrefill
from prefixroute.core.routing.policies.prefixroute.speed import SpeedEstimate
from prefixroute.core.routing.registry import create_policy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from prefixroute_ablations import AblationParams, PrefixRouteAblation  # noqa: E402

B = 16
MS = 1e-3  # seconds per token every replica states
# The cost model a reader checks by hand: attention negligible (L = 10^12 tokens), no step
# overhead, no delay charged to others.
LINEAR = dict(attention_context_tokens=1e12, step_overhead_tokens=0, max_externality=0)
# The default balance rules with their default parameters.
COLD = ColdBalance(cap=1.1, free_share=0.1, cold_share=0.5, horizon_s=300.0)
MOVE = SessionMove(cap=1.1, floor=0.7, max_s=10.0, horizon_s=300.0)


def plain(rules=(), **changes) -> PrefixRoute:
    """The linear cost model with ``changes``, and only the balance ``rules`` given."""
    return PrefixRoute(PrefixRouteParams(**(LINEAR | changes)), rules=rules)


def ablated(**switches) -> PrefixRouteAblation:
    """:func:`plain` with one of the benchmark's switches, e.g. ``feedback=False``."""
    return PrefixRouteAblation(AblationParams(**(LINEAR | switches)), rules=())


def blocks(family: str, n: int) -> tuple:
    return tuple((family, i) for i in range(n))


def req(keys, rid, now=0.0, extra_tokens=0):
    return RequestView(rid, len(keys) * B + extra_tokens, B, tuple(keys), now=now)


class Holds:
    """A runner's cache view that confirms whatever the router believes (``n=None``) or
    exactly ``n`` leading blocks."""

    def __init__(self, n: int | None = None):
        self.n = n

    def match(self, keys):
        return len(keys) if self.n is None else min(self.n, len(keys))


def fleet(n=2, pending=None, cache=None):
    pending = pending or [0] * n
    return [ReplicaView(i, capacity_blocks=1000, prefill_s_per_token=MS,
                        pending_prefill_tokens=pending[i], cache=cache or Holds())
            for i in range(n)]


def send(policy, request, replica, replicas, cached_tokens=None):
    """Route ``request`` and send it to ``replica`` whatever the policy said (a runner that
    overrides the choice, as a test fixture); completes it if ``cached_tokens`` is given."""
    policy.route(request, replicas)
    policy.on_routed(request, Decision(replica, "fixture"))
    if cached_tokens is not None:
        policy.on_completed(request, replica, cached_tokens)


def test_default_configuration_is_documented_and_valid():
    policy = create_policy("prefixroute")
    assert policy.name == "prefixroute"
    params = policy.params
    assert params.prefill_s_per_token == 4.0e-5          # Llama-3-8B on H100 preset
    assert params.attention_context_tokens == 44_000.0   # 4.0e-5 / 9.0e-10
    assert params.chunk_tokens == 8192                   # vLLM max_num_batched_tokens
    assert params.max_externality == 20.0                # rho = 0.95
    assert params.priority_slack == 2.0  # deadlines at twice the own prefill
    assert len(dataclasses.fields(params)) <= 20
    assert policy.describe() == dataclasses.asdict(params)
    # The balance rules, in order: session moves, then cold balance.
    assert [rule.branch for rule in policy.rules] == ["session_move", "cold_balance"]
    move, cold = policy.rules
    assert (move.cap, move.max_s, move.floor) == (1.1, 10.0, 0.7)
    assert (cold.cap, cold.cold_share, cold.free_share) == (1.1, 0.5, 0.1)
    # A cap of 0 turns its rule off.
    assert create_policy("prefixroute:move_cap=0,cold_cap=0").rules == []


def test_a_configured_parameter_reaches_the_policy():
    policy = create_policy("prefixroute:priority_slack=4,chunk_tokens=2048,move_cap=0")
    assert (policy.params.priority_slack, policy.params.chunk_tokens) == (4.0, 2048)
    assert [rule.branch for rule in policy.rules] == ["cold_balance"]


@pytest.mark.parametrize("name, why", [
    ("replicate", "lost"), ("balance_cap", "lost"), ("max_copy", "lost"),
    ("replica_share", "lost"), ("tie_tolerance", "lost"), ("tie_s", "lost"),
    ("cold_slack", "lost"), ("feedback", "experiment switch"), ("debias", "experiment switch"),
    ("externality", "max_externality=0")])
def test_a_removed_parameter_is_a_config_error_that_says_why(name, why):
    with pytest.raises(ConfigError, match=f"'{name}': removed: .*{why}"):
        create_policy(f"prefixroute:{name}=1")


@pytest.mark.parametrize("spec", ["prefixroute:survival_width=1", "prefixroute:max_externality=-1",
                                  "prefixroute:speed_memory=0", "prefixroute:chunk_tokens=0",
                                  "prefixroute:learning_rate=2"])
def test_bad_parameters_are_config_errors(spec):
    with pytest.raises(ConfigError):
        create_policy(spec)


def test_prefers_the_cached_replica_when_the_queue_is_short():
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("A", 10), "warm"), 1, replicas, cached_tokens=0)
    # 12 blocks = 192 tokens; replica 1 holds the first 10 (160 tokens): 32 uncached = 0.032 s
    # there against 192 uncached = 0.192 s on replica 0.
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"), replicas)
    assert decision.replica == 1
    assert decision.branch == "cache_affinity"
    assert decision.predicted_cached_tokens == 160
    assert decision.scores[1]["prefill_s"] == pytest.approx(0.032)
    assert decision.scores[0]["prefill_s"] == pytest.approx(0.192)
    assert "160 of 192 tokens" in decision.reason


class Engine(Holds):
    """A view of the engine itself (KV events): it shows blocks whoever sent them."""

    observes_engine = True


def test_blocks_an_engine_view_shows_count_though_we_never_sent_them():
    # Another gateway instance put 10 blocks of "A" on replica 1: our mirror has nothing,
    # the events show them. 160 of 192 tokens cached there, as if we had sent them.
    policy = plain()
    replicas = [ReplicaView(i, capacity_blocks=1000, prefill_s_per_token=MS,
                            cache=Engine(10 * i)) for i in (0, 1)]
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"), replicas)
    assert (decision.replica, decision.branch) == (1, "cache_affinity")
    assert decision.predicted_cached_tokens == 160
    # A view that knows only what this router sent (approximate) cannot show them.
    blind = [ReplicaView(i, capacity_blocks=1000, prefill_s_per_token=MS,
                         cache=Holds(10 * i)) for i in (0, 1)]
    decision = plain().route(req(blocks("A", 10) + blocks("B", 2), "r"), blind)
    assert decision.scores[1]["expected_cached_tokens"] == 0


def test_a_view_that_knows_only_what_we_sent_does_not_veto_the_mirror():
    # An approximate view holds nothing the mirror lacks, and its plain LRU drops a prompt's
    # head first where vLLM drops the tail first: its "gone" is not evidence. Here it says
    # replica 1 holds nothing; the mirror's 10 blocks of A still count.
    policy = plain()
    blind = fleet(cache=Holds(0))
    send(policy, req(blocks("A", 10), "warm"), 1, blind, cached_tokens=0)
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"), blind)
    assert (decision.replica, decision.predicted_cached_tokens) == (1, 160)


def test_the_mirror_drops_a_prompts_tail_before_its_head():
    # A replica of 10 blocks: A's 8 blocks, then B's 4 new ones. The mirror keeps 10 and,
    # as vLLM frees a request's blocks tail first, the two that go are A's last two: A's
    # first 6 blocks still count (4 inserts since A, well inside the 10-block LRU).
    policy = plain()
    small = [ReplicaView(i, capacity_blocks=10, prefill_s_per_token=MS, cache=Holds())
             for i in (0, 1)]
    send(policy, req(blocks("A", 8), "a"), 1, small, cached_tokens=0)
    send(policy, req(blocks("B", 4), "b"), 1, small, cached_tokens=0)
    decision = policy.route(req(blocks("A", 8) + blocks("C", 1), "r"), small)
    assert decision.scores[1]["expected_cached_tokens"] == 6 * B
    assert decision.scores[1]["mirror_blocks"] == 6


def _after_unreported(policy, replicas, tail, ran):
    """Send A + two blocks of ``tail`` to replica 1, report it ended unreported, and return
    replica 1's scores for A + ``tail`` + one new block."""
    request = req(blocks("A", 10) + blocks(tail, 2), tail)
    send(policy, request, 1, replicas)
    policy.on_unreported(request, 1, ran=ran)
    probe = req(blocks("A", 10) + blocks(tail, 2) + blocks("C", 1), "probe-" + tail)
    return policy.route(probe, replicas).scores[1]


def test_a_request_the_engine_never_ran_leaves_nothing_in_the_mirror():
    # A's 10 blocks ran on replica 1; then A + B (12 blocks) was refused there: B's 2 blocks
    # were never cached, A's 10 still are.
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("A", 10), "a"), 1, replicas, cached_tokens=0)
    refused = _after_unreported(policy, replicas, "B", ran=False)
    assert (refused["expected_cached_tokens"], refused["mirror_blocks"]) == (10 * B, 10)
    # One the engine ran (an answer without usage) keeps its blocks.
    ran = _after_unreported(policy, replicas, "D", ran=True)
    assert ran["expected_cached_tokens"] == 12 * B


def test_a_replica_reset_forgets_what_was_sent_there():
    # The gateway reports that replica 1 stopped answering health checks (a restart): its
    # cache is empty, whatever the mirror remembers.
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("A", 10), "a"), 1, replicas, cached_tokens=0)
    policy.on_replica_reset(1)
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"), replicas)
    assert decision.scores[1]["expected_cached_tokens"] == 0
    # What is sent after the reset counts again.
    send(policy, req(blocks("A", 10), "again"), 1, replicas, cached_tokens=0)
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r2"), replicas)
    assert decision.scores[1]["expected_cached_tokens"] == 10 * B


def test_spills_when_the_holders_queue_costs_more_than_the_prefill_saved():
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("A", 10), "warm"), 1, replicas, cached_tokens=0)
    # Replica 1 then gets a 2,000-token prompt it has not started: 2 s of queue.
    send(policy, req(blocks("C", 125), "big"), 1, replicas)
    busy = fleet(pending=[0, 2000])
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"), busy)
    # Holder: 2 s wait + 0.032 s; elsewhere: 0.192 s. The 0.16 s saved cannot pay 2 s.
    assert decision.scores[1]["wait_s"] == pytest.approx(2.0)
    assert decision.scores[1]["cost_s"] == pytest.approx(2.032)
    assert decision.replica == 0
    assert decision.branch == "spill"
    assert "holder replica 1" in decision.reason


def test_the_spill_pays_for_the_copy_of_the_prefix_it_gives_away():
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("A", 10), "warm"), 1, replicas, cached_tokens=0)
    # Replica 1 has 200 tokens queued: 0.2 s. Holder: 0.2 + 0.032 = 0.232 s. Elsewhere the
    # 192-token prefill, 0.192 s, and the copy of the 160 tokens it lacks, 0.160 s: 0.352 s.
    send(policy, req(blocks("C", 12), "short", extra_tokens=8), 1, replicas)
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"),
                            fleet(pending=[0, 200]))
    assert decision.scores[1]["wait_s"] == pytest.approx(0.2)
    assert decision.scores[1]["copy_s"] == 0.0
    assert decision.scores[0]["copy_s"] == pytest.approx(0.160)
    assert decision.scores[0]["cost_s"] == pytest.approx(0.352)
    # Without the copy's price 0.192 s < 0.232 s would have sent it away (a spill).
    assert (decision.replica, decision.branch) == (1, "cache_affinity")


def test_a_request_nobody_holds_pays_no_copy():
    decision = plain().route(req(blocks("N", 4), "new"), fleet())
    assert [decision.scores[i]["copy_s"] for i in (0, 1)] == [0.0, 0.0]


def test_the_copy_is_the_recompute_beyond_the_holders_prefill():
    costs = CostModel(PrefixRouteParams())  # attention over 44,000 tokens, 150 per step
    # A 620-token prompt whose 576-token prefix another replica holds: on a replica holding
    # nothing, 620 + 620 x 310 / 44,000 + 150 = 774.37 token-equivalents against the
    # holder's 44 + 44 x 598 / 44,000 + 150 = 194.60: the copy is 579.77.
    assert costs.copy_work(620, 0, 576) == pytest.approx(579.77, abs=0.01)
    assert costs.copy_work(620, 576, 576) == 0.0
    assert costs.copy_work(620, 576, 320) == 0.0  # it holds more than the rest: no copy


def test_a_half_done_queue_waits_half_as_long():
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("C", 125), "big"), 1, replicas)  # 2,000 tokens queued
    decision = policy.route(req(blocks("D", 1), "r"), fleet(pending=[0, 1000]))
    assert decision.scores[1]["wait_s"] == pytest.approx(1.0)


def _rejected_scenario(policy):
    """Replica 1 has "a" (1,000 tokens) queued; then "huge" (5,000 tokens, longer than its
    KV) is sent there and rejected at once: the runner reports it done with nothing cached
    and still 1,000 pending tokens, those of "a"."""
    send(policy, req(blocks("a", 62), "a", extra_tokens=8), 1, fleet())  # 1,000 tokens
    a_queued = fleet(pending=[0, 1000])
    send(policy, req(blocks("h", 312), "huge", extra_tokens=8), 1, a_queued,
         cached_tokens=0)  # 5,000 tokens
    return policy.route(req(blocks("r", 1), "r"), a_queued)


def test_a_rejected_request_leaves_no_phantom_queue():
    # With the attention term at L = 1,000 tokens, work is u + u^2 / 2L: "a" is 1,000 + 500
    # = 1,500 token-equivalents (1.5 s), "huge" 5,000 + 12,500 = 17,500.
    # "huge" ended while "a", routed before it, is still queued: prefill is first come, first
    # served, so it never ran and is dropped; the wait is "a"'s 1.5 s.
    policy = plain(attention_context_tokens=1000)
    assert _rejected_scenario(policy).scores[1]["wait_s"] == pytest.approx(1.5)
    # Kept (the benchmark's drop_ended=false), it is the newest entry, the 1,000 pending
    # tokens are taken for its last fifth, 0.2 x 17,500 = 3,500 token-equivalents: 3.5 s of a
    # queue that is not there. In the agentic-sessions benchmark a rejected 807,523-token prompt left 330 s.
    kept = _rejected_scenario(ablated(attention_context_tokens=1000, drop_ended=False))
    assert kept.scores[1]["wait_s"] == pytest.approx(3.5)


def test_a_prompt_longer_than_the_kv_leaves_the_mirror_as_it_was():
    policy = plain()
    replicas = fleet()  # 1,000 blocks each
    send(policy, req(blocks("A", 10), "warm"), 1, replicas, cached_tokens=0)
    # 1,001 blocks (16,016 tokens), the first 10 of them "A", cannot fit replica 1's 1,000:
    # it is rejected at once and reports 0 cached tokens. Neither the blocks it would have
    # inserted (enough to push out all of "A") nor its 0 (read as feedback: "A" evicted)
    # change what replica 1 holds.
    send(policy, req(blocks("A", 10) + blocks("H", 991), "huge"), 1, replicas,
         cached_tokens=0)
    decision = policy.route(req(blocks("A", 10) + blocks("B", 2), "r"), replicas)
    assert decision.scores[1]["expected_cached_tokens"] == 160
    assert decision.replica == 1


def test_an_ended_head_of_the_queue_is_left_to_the_reconciliation():
    # The oldest entry ran; when it ends the pending tokens decide what is left, as before.
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("a", 125), "a"), 1, replicas, cached_tokens=0)  # 2,000 tokens
    decision = policy.route(req(blocks("r", 1), "r"), fleet(pending=[0, 1000]))
    assert decision.scores[1]["wait_s"] == pytest.approx(1.0)


def test_a_burst_follows_the_replica_computing_its_prefix():
    # The engine's view (KV events) shows nothing yet (blocks are still being computed), but
    # the first request of the burst is in flight on replica 1, so the second waits there.
    policy = plain()
    empty = fleet(cache=Engine(0))
    send(policy, req(blocks("H", 50), "first"), 1, empty)
    decision = policy.route(req(blocks("H", 50) + blocks("u", 1), "second"), empty)
    assert decision.replica == 1
    assert decision.branch == "follow_inflight"
    # Once it completes, the engine's word counts again: nothing cached, so no hit expected.
    policy.on_completed(req(blocks("H", 50), "first"), 1, 0)
    after = policy.route(req(blocks("H", 50) + blocks("u", 1), "third"), empty)
    assert after.scores[1]["expected_cached_tokens"] == 0


def test_feedback_shrinks_the_predicted_hit():
    policy = plain()
    replicas = fleet()
    send(policy, req(blocks("P", 10), "p"), 0, replicas, cached_tokens=0)
    send(policy, req(blocks("Q", 10), "q"), 0, replicas, cached_tokens=0)
    probe = req(blocks("P", 10) + blocks("x", 1), "probe")
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 160
    # A request on Q was predicted 10 cached blocks; the engine reported 4. Q's fifth block
    # was evicted, so everything touched before it (all of P) is gone too; Q itself was just
    # recomputed by that request and stays.
    again = req(blocks("Q", 10) + blocks("y", 1), "again")
    decision = policy.route(again, replicas)
    assert decision.predicted_cached_tokens == 160
    policy.on_routed(again, decision)
    policy.on_completed(again, decision.replica, 4 * B)
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 0
    assert policy.route(req(blocks("Q", 10) + blocks("z", 1), "q2"),
                        replicas).scores[0]["expected_cached_tokens"] == 160


def test_a_hit_deeper_than_predicted_brings_the_horizon_back():
    policy = plain()
    replicas = fleet()
    for family, n in (("W", 10), ("P", 5), ("S", 5), ("Q", 10)):  # stamps 0, 1, 2, 3
        send(policy, req(blocks(family, n), family), 0, replicas, cached_tokens=0)
    # Q's fifth block went (4 of 10 reused): Q's old touch and everything before it count as
    # gone, W, P and S included.
    send(policy, req(blocks("Q", 10) + blocks("y", 1), "again"), 0, replicas,
         cached_tokens=4 * B)
    probe_s = req(blocks("S", 5) + blocks("x", 1), "probe-s")
    assert policy.route(probe_s, replicas).scores[0]["expected_cached_tokens"] == 0
    # Then all five of P's blocks are reused, though none was predicted: P survived, and so
    # did S, touched after it. W, touched before P, may have gone and still counts as gone.
    send(policy, req(blocks("P", 5) + blocks("x", 1), "p2"), 0, replicas, cached_tokens=5 * B)
    assert policy.route(probe_s, replicas).scores[0]["expected_cached_tokens"] == 5 * B
    probe_w = req(blocks("W", 10) + blocks("x", 1), "probe-w")
    assert policy.route(probe_w, replicas).scores[0]["expected_cached_tokens"] == 0


def small_replica_holding_p():
    """(policy, replicas, probe): one replica of 100 blocks (width 0.25: a block is certain up
    to 75 inserts after its touch, gone at 100) that was sent P's 4 blocks; the probe asks for
    them again."""
    policy = plain()
    replicas = [ReplicaView(0, capacity_blocks=100, prefill_s_per_token=MS, cache=Holds())]
    send(policy, req(blocks("P", 4), "p"), 0, replicas, cached_tokens=0)
    return policy, replicas, req(blocks("P", 4) + blocks("x", 1), "probe")


def test_the_insert_clock_counts_what_the_replica_inserted():
    policy, replicas, probe = small_replica_holding_p()
    # 90 blocks we never sent there, so predicted uncached: 90 inserts, P at (100 - 90) / 25.
    send(policy, req(blocks("F", 90), "f"), 0, replicas)
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == \
        pytest.approx(4 * 0.4 * B, abs=0.1)
    # The replica had them all (another router sent them): nothing was inserted, P is certain.
    policy.on_completed(req(blocks("F", 90), "f"), 0, 90 * B)
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 4 * B


def test_a_request_routed_without_asking_is_predicted_as_route_would():
    policy = plain()
    replicas = fleet()
    for family, n in (("W", 5), ("P", 10)):
        send(policy, req(blocks(family, n), family), 0, replicas, cached_tokens=0)
    # Another router sends exactly P's 160 tokens there. The engine reuses at most 159 of
    # them, 9 full blocks: that is what was predicted, so it evicts nothing, W included.
    exact = req(blocks("P", 10), "exact")
    policy.on_routed(exact, Decision(0, "another router"))
    policy.on_completed(exact, 0, 9 * B)
    probe = req(blocks("W", 5) + blocks("x", 1), "probe")
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 5 * B


def test_without_feedback_the_miss_teaches_nothing():
    policy = ablated(feedback=False)
    replicas = fleet()
    send(policy, req(blocks("P", 10), "p"), 0, replicas, cached_tokens=0)
    send(policy, req(blocks("Q", 10) + blocks("y", 1), "q"), 0, replicas, cached_tokens=4 * B)
    probe = req(blocks("P", 10) + blocks("x", 1), "probe")
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 160


def test_survival_falls_with_the_blocks_inserted_since():
    policy, replicas, probe = small_replica_holding_p()
    send(policy, req(blocks("F", 75), "f1"), 0, replicas, cached_tokens=0)
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 64
    send(policy, req(blocks("G", 12), "f2"), 0, replicas, cached_tokens=0)  # 87 inserts
    # (100 - 87) / (100 - 75) = 0.52 per block, 4 blocks: 2.08 blocks = 33.3 tokens.
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == \
        pytest.approx(4 * 0.52 * B, abs=0.1)
    send(policy, req(blocks("K", 13), "f3"), 0, replicas, cached_tokens=0)  # 100 inserts
    assert policy.route(probe, replicas).scores[0]["expected_cached_tokens"] == 0


def _speed_scenario(policy, stated=MS):
    """Replica 1 computes 5,000 of a 10,000-token prompt in 2.5 s (0.5 ms per token), then a
    1,016-token cold request arrives with both replicas idle."""
    def replicas(pending=(0, 0)):
        return [ReplicaView(i, capacity_blocks=1000, prefill_s_per_token=stated,
                            pending_prefill_tokens=pending[i], cache=Holds()) for i in (0, 1)]

    send(policy, req(blocks("W", 625), "work", now=0.0), 1, replicas())
    policy.route(req(blocks("n1", 1), "look", now=2.5), replicas((0, 5000)))
    policy.route(req(blocks("n2", 1), "done", now=3.0), replicas())
    return policy.route(req(blocks("R", 62) + blocks("r", 1), "r", now=3.0, extra_tokens=8),
                        replicas())


def test_a_learned_prefill_speed_is_one_for_the_replicas_of_a_kind():
    # With the prior (8,192 tokens at the stated 1 ms = 8.192 s), forgotten by 0.99 per
    # observation: (0.99 x 8.192 + 2.5) s / (0.99 x 8,192 + 5,000) tokens = 0.81 ms per token,
    # learned on replica 1 and priced on both: same engine, same speed.
    learned = _speed_scenario(ablated(learn_speed="true"))
    speed = (0.99 * 8.192 + 2.5) / (0.99 * 8192 + 5000)
    assert learned.scores[1]["s_per_token"] == pytest.approx(speed)
    assert learned.scores[0]["s_per_token"] == pytest.approx(speed)
    # Equal costs: the tie goes to the replica with fewer recent requests.
    assert learned.replica == 0
    fixed = _speed_scenario(ablated(learn_speed="false"))
    assert fixed.scores[1]["s_per_token"] == pytest.approx(MS)
    assert fixed.replica == 0


def test_speed_is_learned_only_where_the_runner_states_none_by_default():
    stated = _speed_scenario(plain())  # 1 ms stated: kept
    assert stated.scores[1]["s_per_token"] == pytest.approx(MS)
    # The policy's 4e-5 prior, then (0.99 x 0.328 + 2.5) s / 13,110 tokens = 2.2e-4 learned,
    # held at twice the prior, on both replicas.
    unknown = _speed_scenario(plain(), stated=None)
    assert unknown.scores[0]["s_per_token"] == pytest.approx(8.0e-5)
    assert unknown.scores[1]["s_per_token"] == pytest.approx(8.0e-5)
    assert unknown.replica == 0


def test_a_replica_first_met_in_another_router_s_booking_keeps_its_stated_speed():
    # Another router's booking on replica 1 reaches this policy before it has routed anything
    # (a gateway instance applying its peers' bookings at start). Its first view states 1 ms
    # a token, as for replica 0: the booking must not make replica 1 a replica of unknown
    # speed, priced at the policy's default 4e-5 and learning (busy seconds over work done:
    # on a live gateway up to twice that, while its peers' prefill showed as 1 ms).
    policy = plain()
    other = req(blocks("O", 10), "another router's")
    policy.on_routed(other, Decision(1, "another router", predicted_cached_tokens=0))
    decision = policy.route(req(blocks("n", 4), "first", now=1.0), fleet(pending=[0, 160]))
    assert [decision.scores[i]["s_per_token"] for i in (0, 1)] == [MS, MS]
    # The booking's 160 tokens are still pending there: 0.16 s of wait at that speed.
    assert decision.scores[1]["wait_s"] == pytest.approx(0.16)


def test_a_request_sent_elsewhere_than_chosen_queues_at_what_that_replica_holds():
    # Replica 1 holds 10 blocks of A, replica 0 those and 2 of B. A request of all 12 is
    # chosen for replica 0, then sent to replica 1 anyway (a runner overriding the choice,
    # with no prediction of its own): it queues there at its 2 uncached blocks, as
    # estimated afresh, not at its whole prompt. Only another router's booking queues at
    # the tokens that router predicted.
    policy = plain()
    send(policy, req(blocks("A", 10), "a"), 1, fleet(), cached_tokens=0)
    send(policy, req(blocks("A", 10) + blocks("B", 2), "b"), 0, fleet(), cached_tokens=0)
    request = req(blocks("A", 10) + blocks("B", 2), "r", now=1.0)
    assert policy.route(request, fleet()).replica == 0
    policy.on_routed(request, Decision(1, "fixture"))
    [entry] = [e for e in policy._replicas[1].queue.entries if e.request_id == "r"]
    assert entry.units == 2 * B
    other = req(blocks("C", 3), "another router's", now=1.0)
    policy.on_routed(other, Decision(1, "another router", predicted_cached_tokens=B))
    [entry] = [e for e in policy._replicas[1].queue.entries if e.request_id == other.request_id]
    assert entry.units == 2 * B


def test_a_full_kv_makes_the_request_wait_for_running_ones():
    policy = plain()
    replicas = fleet()
    # One request routed at t=0 completes when the next one shows at t=10: requests stay 10 s.
    send(policy, req(blocks("a", 1), "a", now=0.0), 0, replicas)
    policy.route(req(blocks("b", 1), "b", now=10.0), replicas)
    policy.on_completed(req(blocks("a", 1), "a"), 0, 0)
    full = [ReplicaView(0, capacity_blocks=1000, prefill_s_per_token=MS, kv_usage=0.95,
                        cache=Holds()),
            ReplicaView(1, capacity_blocks=1000, prefill_s_per_token=MS, kv_usage=0.0,
                        cache=Holds())]
    decision = policy.route(req(blocks("c", 100), "c", now=10.0), full)
    # 100 new blocks, 50 free: 50 / 1,000 of the capacity x 10 s = 0.5 s.
    assert decision.scores[0]["kv_wait_s"] == pytest.approx(0.5)
    assert decision.scores[1]["kv_wait_s"] == 0
    assert decision.replica == 1


def test_cold_requests_spread_to_the_least_used_replica():
    policy = create_policy("prefixroute")
    replicas = [ReplicaView(i, capacity_blocks=1000, prefill_s_per_token=MS, cache=Holds())
                for i in range(3)]
    chosen = []
    for i in range(6):
        request = req(blocks(f"cold{i}", 2), f"c{i}", now=0.0)
        decision = policy.route(request, replicas)
        policy.on_routed(request, decision)
        chosen.append(decision.replica)
        assert decision.branch == "cold_spread"
    assert sorted(chosen) == [0, 0, 1, 1, 2, 2]


def test_every_decision_carries_scores_and_a_reason():
    policy = create_policy("prefixroute")
    replicas = fleet(3)
    decision = policy.route(req(blocks("A", 3), "a"), replicas)
    assert set(decision.scores) == {0, 1, 2}
    for score in decision.scores.values():
        assert {"expected_cached_tokens", "wait_s", "prefill_s", "decode_s", "delay_others_s",
                "cost_s", "s_per_token"} <= set(score)
    assert "cost" in decision.reason


def test_decode_interference_makes_a_busy_decoder_dearer():
    policy = plain()
    replicas = [ReplicaView(0, capacity_blocks=1000, prefill_s_per_token=MS, running=40,
                            kv_usage=0.5, cache=Holds()),
                ReplicaView(1, capacity_blocks=1000, prefill_s_per_token=MS, cache=Holds())]
    decision = policy.route(req(blocks("A", 3), "a"), replicas)
    # One step: 40 x 1.25 + 0.0013 x (0.5 x 1000 x 16) = 60.4 token-equivalents = 60.4 ms.
    assert decision.scores[0]["decode_s"] == pytest.approx(0.0604)
    assert decision.replica == 1


def test_candidates_with_gaps_and_unknown_replicas():
    policy = create_policy("prefixroute")
    replicas = [ReplicaView(i, prefill_s_per_token=None) for i in (3, 7, 11)]
    request = req(blocks("A", 2), "a")
    decision = policy.route(request, replicas)
    assert decision.replica in (3, 7, 11)
    policy.on_routed(request, decision)
    policy.on_completed(request, decision.replica, 16)
    policy.on_completed(req(blocks("Z", 1), "never-routed"), 5, 0)  # tolerated


def _cold_balance_scenario(rules=(), **changes):
    """Replica 0 computed a 1,000-token prompt (1.0 s of prefill routed there, done); replica
    1 has a 50-token prompt queued (0.05 s). Both are idle or nearly: a cold 100-token request
    costs 0.1 s on replica 0 and 0.05 + 0.1 s on replica 1."""
    policy = plain(rules, **changes)
    send(policy, req(blocks("a", 62), "a", extra_tokens=8), 0, fleet(), cached_tokens=0)
    send(policy, req(blocks("b", 3), "b", extra_tokens=2), 1, fleet())
    return policy, fleet(pending=[0, 50])


def test_without_cold_balance_the_momentary_cost_decides():
    policy, replicas = _cold_balance_scenario()
    decision = policy.route(req(blocks("r", 6), "r", extra_tokens=4), replicas)
    assert decision.replica == 0
    assert decision.scores[0]["cost_s"] == pytest.approx(0.1)
    assert decision.scores[1]["cost_s"] == pytest.approx(0.15)
    # The longer-horizon load is kept anyway: prefill seconds routed, decayed over 300 s.
    assert decision.scores[0]["long_load_s"] == pytest.approx(1.0)
    assert decision.scores[1]["long_load_s"] == pytest.approx(0.05)


def test_cold_balance_places_a_cold_request_below_the_cap():
    policy, replicas = _cold_balance_scenario([COLD])
    decision = policy.route(req(blocks("r", 6), "r", extra_tokens=4), replicas)
    # Mean long-horizon load (1.0 + 0.05) / 2 = 0.525 s, cap 1.1 x 0.525 = 0.5775 s: replica
    # 0 (1.0 s) is over it, replica 1 (0.05 s) holds as little of the request (nothing).
    assert decision.replica == 1
    assert decision.branch == "cold_balance"
    assert "0.050 s more cost" in decision.reason


def test_cold_balance_leaves_a_request_with_its_cache():
    policy, replicas = _cold_balance_scenario([COLD])
    # 62 blocks of "a" are expected cached on replica 0 only: 992 of 1,032 tokens, far more
    # than free_share (10%) of the prompt above replica 1's 0. It stays with its cache.
    decision = policy.route(req(blocks("a", 62) + blocks("x", 2), "r2", extra_tokens=8),
                            replicas)
    assert decision.replica == 0
    assert decision.branch == "cache_affinity"


def test_balance_rules_act_on_a_quiet_fleet_only():
    assert create_policy("prefixroute").params.cold_rho_max == 0.1
    # cold_rho_max = 0: the fleet's prefill utilisation (here 0) is never below it.
    policy, replicas = _cold_balance_scenario([COLD], cold_rho_max=0)
    assert policy.route(req(blocks("r", 6), "r", extra_tokens=4), replicas).replica == 0


@pytest.mark.parametrize("spec", ["prefixroute:cold_cap=0.5", "prefixroute:free_share=2",
                                  "prefixroute:balance_horizon_s=0",
                                  "prefixroute:balance_signal=vibes"])
def test_bad_cold_balance_parameters_are_config_errors(spec):
    with pytest.raises(ConfigError):
        create_policy(spec)


def test_the_utilisation_has_no_start_up_bias():
    est = PrefillQueue(SpeedEstimate(MS, 8192, learns=True))
    est.observe(0, now=100.0, forget=1.0, horizon_s=30.0)  # first sight: the clock starts
    est.add(QueuedPrefill(1000, 1000, 1000, "a", 100.0))  # 1,000 tokens at 1 ms: 1 s of work
    est.observe(0, now=101.0, forget=1.0, horizon_s=30.0)
    # The raw 30 s average shows 1 s of work as 1/30 busy; one second is all there was.
    assert est.utilisation == pytest.approx(1 / 30)
    assert est.prefill_busy(30.0) == 1.0  # (1/30) / (1 - exp(-1/30)) = 1.017, capped
    est.observe(0, now=131.0, forget=1.0, horizon_s=30.0)  # then 30 s idle
    decay = math.exp(-1.0)
    assert est.prefill_busy(30.0) == pytest.approx(
        (1 / 30) * decay / ((1 - math.exp(-1 / 30)) * decay + 1 - decay))


def test_the_start_up_bias_correction_against_the_raw_average():
    policy = ablated(debias=False)
    replicas = fleet()
    send(policy, req(blocks("a", 4), "r1", now=0.0), 0, replicas)
    replicas = fleet(pending=[0, 0])
    decision = policy.route(req(blocks("b", 4), "r2", now=1.0), replicas)
    assert decision.scores[0]["prefill_busy"] == pytest.approx(64 * MS / 30)
    on = plain()
    send(on, req(blocks("a", 4), "r1", now=0.0), 0, fleet())
    decision = on.route(req(blocks("b", 4), "r2", now=1.0), fleet(pending=[0, 0]))
    assert decision.scores[0]["prefill_busy"] == pytest.approx(
        64 * MS / 30 / (1 - math.exp(-1 / 30)))


def _busy_holder_scenario(rules=(), **changes):
    """Replica 0 has had a request in flight for the last 600 s (two balance horizons),
    replica 1 none: their occupancies are 1 - e^-2 = 0.865 and 0 (mean 0.432). A session's
    next turn holds 10 of its 12 blocks on replica 0: 0.032 s there, 0.192 s on idle
    replica 1 plus 0.160 s for the copy of the 10 blocks it lacks."""
    policy = plain(rules, **changes)
    replicas = fleet()
    replicas[0].in_flight = 1
    send(policy, req(blocks("s", 10), "s0", now=0.0), 0, replicas)
    turn = req(blocks("s", 10) + blocks("t", 2), "s1", now=600.0)
    return policy, replicas, turn


def test_a_replica_with_work_most_of_the_time_hands_a_session_to_an_idle_one():
    policy, replicas, turn = _busy_holder_scenario([MOVE])
    decision = policy.route(turn, replicas)
    assert decision.scores[0]["occupancy"] == pytest.approx(1 - math.exp(-2))
    assert decision.scores[1]["occupancy"] == 0.0
    # 0.865 > 1.1 x 0.432 and > the floor 0.7: replica 1, idle and below the mean, takes it
    # for 0.32 s more: 0.16 s more prefill and 0.16 s for the copy of the 10 blocks it lacks.
    assert (decision.replica, decision.branch) == (1, "session_move")
    assert "0.320 s more cost" in decision.reason


def test_without_session_moves_the_session_stays_with_its_cache():
    policy, replicas, turn = _busy_holder_scenario()
    decision = policy.route(turn, replicas)
    assert (decision.replica, decision.branch) == (0, "cache_affinity")


@pytest.mark.parametrize("rule, changes", [
    (SessionMove(cap=1.1, floor=0.7, max_s=0.1, horizon_s=300),  # 0.16 s more, over 0.1 s
     {}),
    (SessionMove(cap=2.5, floor=0.7, max_s=10, horizon_s=300),   # 0.865 <= 2.5 x 0.432
     {}),
    (SessionMove(cap=1.1, floor=0.9, max_s=10, horizon_s=300),   # nor over the floor 0.9
     {}),
    (MOVE, {"cold_rho_max": 0}),  # moves only on a fleet whose prefill is quiet
])
def test_session_moves_are_bounded(rule, changes):
    policy, replicas, turn = _busy_holder_scenario([rule], **changes)
    assert policy.route(turn, replicas).replica == 0


def test_a_move_needs_a_replica_with_nothing_in_flight():
    policy, replicas, turn = _busy_holder_scenario([MOVE])
    replicas[1].in_flight = 1  # busy now, though idle over the horizon
    assert policy.route(turn, replicas).replica == 0


def test_a_replica_counts_as_having_work_from_the_request_routed_there():
    # Routed at t=0 to replica 1, whose view said idle (the request is not in it yet); at
    # t=300 the view says idle again (it has finished): 0 .. 300 counted as work.
    policy = plain()
    send(policy, req(blocks("a", 4), "a", now=0.0), 1, fleet())
    decision = policy.route(req(blocks("b", 4), "b", now=300.0), fleet())
    assert decision.scores[1]["occupancy"] == pytest.approx(1 - math.exp(-1))
    assert decision.scores[0]["occupancy"] == 0.0


@pytest.mark.parametrize("spec", ["prefixroute:move_cap=0.5", "prefixroute:move_max_s=-1",
                                  "prefixroute:move_cap=nan", "prefixroute:move_floor=2"])
def test_bad_session_move_parameters_are_config_errors(spec):
    with pytest.raises(ConfigError):
        create_policy(spec)


# -- priority hints ---------------------------------------------------------------------------
def _priority_queue_scenario(scheduling_policy):
    """One replica. "h" (1,000 tokens) and "x" (2,000) are routed at t=0 and not started;
    then "r" (100 tokens) comes, also at t=0."""
    policy = plain()

    def replicas(pending):
        return [ReplicaView(0, capacity_blocks=1000, prefill_s_per_token=MS,
                            pending_prefill_tokens=pending, cache=Holds(),
                            scheduling_policy=scheduling_policy)]

    decisions = {}
    for rid, family, n, pending in (("h", "H", 1000, 0), ("x", "X", 2000, 1000),
                                    ("r", "R", 100, 3000)):
        request = RequestView(rid, n, B, blocks(family, n // B), now=0.0)
        decisions[rid] = policy.route(request, replicas(pending))
        policy.on_routed(request, decisions[rid])
    order = [entry.request_id for entry in policy._replicas[0].queue.entries]
    return decisions, order


def test_a_priority_replica_gets_deadlines_and_serves_short_prompts_first():
    decisions, order = _priority_queue_scenario("priority")
    # Deadline = arrival + priority_slack (2) x the request's own prefill, in milliseconds:
    # h 0 + 2 x 1.0 s, x 0 + 2 x 2.0 s, r 0 + 2 x 0.1 s.
    assert [decisions[k].priority for k in "hxr"] == [2000, 4000, 200]
    r = decisions["r"].scores[0]
    assert r["deadline_s"] == pytest.approx(0.2)
    # r waits for h (the head: vLLM finishes a running prefill first) but not for x, due at
    # 4 s; passing x delays it by r's own 0.1 s, charged to r.
    assert r["wait_s"] == pytest.approx(1.0)
    assert r["delay_others_s"] == pytest.approx(0.1)
    assert r["cost_s"] == pytest.approx(1.0 + 0.1 + 0.1)
    assert "priority 200 (deadline 0.200 s)" in decisions["r"].reason
    # The queue the policy keeps for that replica is in the order it will be served.
    assert order == ["h", "r", "x"]


def test_a_first_come_first_served_replica_gets_no_priority_and_the_whole_queue():
    decisions, order = _priority_queue_scenario("fcfs")
    assert [decisions[k].priority for k in "hxr"] == [None, None, None]
    r = decisions["r"].scores[0]
    assert "deadline_s" not in r
    assert r["wait_s"] == pytest.approx(3.0)
    assert r["cost_s"] == pytest.approx(3.0 + 0.1)
    assert order == ["h", "x", "r"]


def test_priority_hints_can_be_switched_off():
    policy = plain(priority_slack=0)
    replica = ReplicaView(0, capacity_blocks=1000, prefill_s_per_token=MS, cache=Holds(),
                          scheduling_policy="priority")
    decision = policy.route(RequestView("r", 100, B, blocks("R", 6), now=5.0), [replica])
    assert decision.priority is None and "deadline_s" not in decision.scores[0]


@pytest.mark.parametrize("slack", ["-1", "inf", "nan"])
def test_bad_priority_slack_is_a_config_error(slack):
    with pytest.raises(ConfigError, match="priority_slack"):
        create_policy(f"prefixroute:priority_slack={slack}")


def test_a_short_request_never_passes_the_head_of_the_queue():
    # "h" (1,000 tokens, due at 2 s) alone on the replica is the head: vLLM is prefilling it.
    # "r" (100 tokens, due at 0.2 s) waits for it and goes behind it, passing nobody.
    policy = plain()
    decisions = {}
    for rid, n, pending in (("h", 1000, 0), ("r", 100, 1000)):
        request = RequestView(rid, n, B, blocks(rid.upper(), n // B), now=0.0)
        replica = ReplicaView(0, capacity_blocks=1000, prefill_s_per_token=MS,
                              pending_prefill_tokens=pending, cache=Holds(),
                              scheduling_policy="priority")
        decisions[rid] = policy.route(request, [replica])
        policy.on_routed(request, decisions[rid])
    r = decisions["r"].scores[0]
    assert (r["wait_s"], r["delay_others_s"]) == (pytest.approx(1.0), 0.0)
    assert [entry.request_id for entry in policy._replicas[0].queue.entries] == ["h", "r"]


def test_the_deadline_counts_from_the_requests_arrival():
    # Routed at 10 s (after a wait at the gateway, or again after a failed attempt), it
    # arrived at 4 s: its deadline is 4 + 2 x 0.1 s.
    policy = plain()
    replica = ReplicaView(0, capacity_blocks=1000, prefill_s_per_token=MS, cache=Holds(),
                          scheduling_policy="priority")
    request = RequestView("r", 100, B, blocks("R", 6), now=10.0, arrival=4.0)
    assert policy.route(request, [replica]).priority == 4200
