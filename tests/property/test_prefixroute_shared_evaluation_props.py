"""``prefixroute`` evaluates replicas alike in everything its cost reads once and copies the
result (most of a quiet fleet is idle and holds nothing of a prompt). These properties check
that this changes nothing: on random fleets every replica's scores are exactly what the
cost model gives for that replica alone, and the decision is the one those scores make."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.base import Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.prefixroute import PrefixRoute
from prefixroute.core.routing.policies.prefixroute.balance import Candidate
from prefixroute.core.routing.policies.prefixroute.costs import CostTerms, to_ms
from prefixroute.core.routing.policies.prefixroute.mirror import HitEstimate
from prefixroute.core.routing.policies.prefixroute.policy import hit_limit

B = 16
# Few values per field, so that many replicas are alike and share an evaluation.
replica_states = st.tuples(st.sampled_from([0, 1, 3]),                 # running
                           st.sampled_from([0.0, 0.25, 0.9]),          # kv_usage
                           st.sampled_from([0, 0, 700]),               # pending prefill
                           st.sampled_from([200, 1000]),               # capacity blocks
                           st.sampled_from(["fcfs", "fcfs", "priority"]))
history = st.lists(st.tuples(st.integers(0, 2),                        # prompt family
                             st.integers(1, 40),                       # blocks
                             st.integers(0, 7)),                       # replica sent to
                   max_size=12)


def prompt(family: int, n: int, rid: str, now: float) -> RequestView:
    return RequestView(rid, n * B + 3, B, tuple((family, i) for i in range(n)), now=now)


def alone(policy: PrefixRoute, request: RequestView, replicas: list[ReplicaView]
          ) -> dict[int, dict[str, float]]:
    """Every replica's scores evaluated on its own, term by term as the cost model defines
    them (the evaluation before replicas shared one), read after ``route`` at the same
    time (reading the state again changes nothing)."""
    p, costs = policy.params, policy.costs
    now, n, keys = request.now, request.num_tokens, request.block_keys
    limit = hit_limit(request)
    states = [policy._replicas[r.index] for r in replicas]
    hits = [policy._expected(s, keys, limit, r.cache) for r, s in zip(replicas, states)]
    most = min(max(h.expected_blocks for h in hits) * B, float(limit * B))
    gamma = costs.delay_factor(policy._rho)
    scores = {}
    for replica, state, hit in zip(replicas, states, hits):
        cached = min(hit.expected_blocks * B, float(limit * B))
        uncached = n - cached
        s = state.queue.s_per_token
        prefill = costs.prefill_work(uncached, cached) * s
        copy = costs.copy_work(n, cached, most) * s
        deadline = (to_ms(now + p.priority_slack * prefill) / 1000.0
                    if p.priority_slack and replica.scheduling_policy == "priority" else None)
        wait, behind = state.queue.wait_s(deadline)
        decode = costs.decode_work(replica, uncached, B) * s
        kv_wait = costs.kv_wait(replica, uncached, B, policy._residence_s)
        delay = (gamma + behind) * prefill
        score = {
            "expected_cached_tokens": round(cached, 1), "mirror_blocks": float(len(hit.stamps)),
            "view_blocks": float(hit.view_blocks), "wait_s": wait, "kv_wait_s": kv_wait,
            "prefill_s": prefill, "decode_s": decode, "delay_others_s": delay, "copy_s": copy,
            "cost_s": wait + kv_wait + prefill + decode + delay + copy, "s_per_token": s,
            "prefill_busy": state.queue.prefill_busy(p.load_horizon_s),
            "load": float(replica.load),
            "recent_requests": round(state.load.routed.read(now, p.load_horizon_s), 3),
            "long_load_s": state.load.routed_s.read(now, p.balance_horizon_s),
            "occupancy": state.load.occupancy.share}
        if deadline is not None:
            score["deadline_s"] = deadline
        scores[replica.index] = score
    return scores


@settings(max_examples=150, deadline=None)
@given(st.lists(replica_states, min_size=2, max_size=8), history,
       st.integers(0, 2), st.integers(1, 40))
def test_shared_evaluation_gives_every_replica_its_own_scores(fleet, sent, family, n):
    policy = PrefixRoute()
    replicas = [ReplicaView(i, running=running, kv_usage=kv, pending_prefill_tokens=pending,
                            capacity_blocks=capacity, scheduling_policy=scheduling)
                for i, (running, kv, pending, capacity, scheduling) in enumerate(fleet)]
    now = 0.0
    for k, (past_family, past_n, target) in enumerate(sent):
        now += 0.25
        past = prompt(past_family, past_n, f"past-{k}", now)
        policy.route(past, replicas)
        policy.on_routed(past, Decision(target % len(replicas), "fixture"))
    request = prompt(family, n, "now", now + 0.25)
    decision = policy.route(request, replicas)
    expected = alone(policy, request, replicas)
    assert decision.scores == expected
    assert [list(s) for s in decision.scores.values()] == [list(s) for s in expected.values()]
    # The decision is the one the replicas' own scores make.
    hits = {r.index: policy._expected(policy._replicas[r.index], request.block_keys,
                                      hit_limit(request), r.cache) for r in replicas}
    fits = all(r.capacity_blocks * B >= request.num_tokens for r in replicas)
    assert (decision.replica, decision.branch) == reference_choice(policy, expected, hits,
                                                                   request.num_tokens, fits)


def reference_choice(policy: PrefixRoute, scores: dict[int, dict[str, float]],
                     hits: dict, n: int, fits: bool) -> tuple[int, str]:
    """The choice written as plainly as it is specified, a pass per rule: the cheapest
    (lowest cost, then lowest index), among equal costs the fewest recent requests, then
    the fewest in flight; then the balance rules on a quiet fleet; then the branch."""
    candidates = [Candidate(i, s["cost_s"], s["expected_cached_tokens"], s["load"],
                            s["occupancy"], s["long_load_s"]) for i, s in scores.items()]
    best_hit = max(c.expected_cached_tokens for c in candidates)
    cheapest = min(candidates, key=lambda c: (c.cost_s, c.index))
    tied = [c for c in candidates if c.cost_s <= cheapest.cost_s]
    chosen = min(tied, key=lambda c: (scores[c.index]["recent_requests"], c.load, c.cost_s,
                                      c.index))
    if len(candidates) > 1 and policy._rho < policy.params.cold_rho_max and fits:
        for rule in policy.rules:
            move = rule.move(chosen, candidates, n, best_hit)
            if move is not None:
                return move.replica, rule.branch
    if best_hit <= 0:
        return chosen.index, "cold_spread"
    if chosen.expected_cached_tokens >= best_hit:
        hit = hits[chosen.index]
        return chosen.index, ("follow_inflight" if len(hit.stamps) > hit.view_blocks
                              else "cache_affinity")
    return chosen.index, "spill"


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.5, 0.5, 1.0]),       # cost
                          st.sampled_from([0.0, 0.0, 32.0]),      # expected cached tokens
                          st.sampled_from([0.0, 1.0]),            # recent requests
                          st.sampled_from([0.0, 1.0])),           # load
                min_size=1, max_size=10),
       st.permutations(range(10)), st.booleans())
def test_the_choice_breaks_ties_as_specified(rows, order, quiet):
    """Equal costs, hits, recent requests and loads in every combination, candidates in any
    order of index: the one-pass choice picks what the rule-per-pass reference picks."""
    policy = PrefixRoute()
    policy._rho = 0.0 if quiet else 0.5
    indices = [i for i in order if i < len(rows)]
    scores = {i: {"cost_s": cost, "expected_cached_tokens": cached,
                  "recent_requests": recent, "load": load, "occupancy": 0.0,
                  "long_load_s": 0.0, "wait_s": 0.0}
              for i, (cost, cached, recent, load) in zip(indices, rows)}
    candidates = [Candidate(i, s["cost_s"], s["expected_cached_tokens"], s["load"],
                            s["occupancy"], s["long_load_s"], s["recent_requests"],
                            terms=CostTerms(0, 0, s["wait_s"], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
                  for i, s in scores.items()]
    hits = {i: HitEstimate(s["expected_cached_tokens"] / B, 2, [0, 0]) for i, s in
            scores.items()}
    best_hit = max(s["expected_cached_tokens"] for s in scores.values())
    at, branch, reason = policy._choose(candidates, [hits[c.index] for c in candidates], 64,
                                        True, best_hit)
    assert (candidates[at].index, branch) == reference_choice(policy, scores, hits, 64, True)
    # The reason names the cheapest replica (lowest cost, then index) when a tie moved it.
    cheapest = min(scores, key=lambda i: (scores[i]["cost_s"], i))
    named = f"as cheap as replica {cheapest}:" in reason
    assert named == (branch not in ("session_move", "cold_balance")
                     and candidates[at].index != cheapest)
