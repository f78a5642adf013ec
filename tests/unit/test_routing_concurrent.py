"""Decisions made at the same time by several router instances (shared state): the greedy
sequence one router would have filled, a random place in it per instance, the measured count
of decisions not seen yet, and the runner's hook."""

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.concurrent import SPREAD_BRANCH, greedy_picks, spread
from prefixroute.core.routing.lifecycle import LifecycleRunner
from prefixroute.core.routing.policies.prefixroute import PrefixRoute
from prefixroute.core.routing.views import ApproximateView
from prefixroute.edges.shared_state.concurrency import ConcurrentDecisions


def decision(choice: int, costs, prefills, cached=None) -> Decision:
    scores = {i: {"cost_s": c, "prefill_s": p,
                  "expected_cached_tokens": (cached or [0.0] * len(costs))[i]}
              for i, (c, p) in enumerate(zip(costs, prefills))}
    return Decision(choice, "cold_spread", "cheapest", scores)


def test_the_greedy_sequence_adds_each_pick_s_prefill_to_its_replica():
    # Costs 1.0 / 1.2 / 3.0 s, each request 0.5 s of prefill: replica 0, then 1 (1.2 < 0.5 +
    # 1.0), then 0 (1.5 < 1.7), then 1 (1.7 < 2.0), then 0 (2.0 < 2.2).
    d = decision(0, [1.0, 1.2, 3.0], [0.5, 0.5, 0.5])
    assert greedy_picks(d, 5) == [0, 1, 0, 1, 0]


def test_no_decision_unseen_leaves_the_policy_s_choice():
    d = decision(0, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert spread(d, 0.0, 0.99) is d


def test_a_draw_picks_its_place_among_one_plus_unseen():
    # Three equally cheap idle replicas, 2 decisions unseen: places 0, 1, 2 for draws in
    # [0, 1/3), [1/3, 2/3), [2/3, 1); the sequence is 0, 1, 2.
    d = decision(0, [1.0, 1.0, 1.0], [1.0, 1.0, 1.0])
    assert spread(d, 2.0, 0.0) is d
    moved = spread(d, 2.0, 0.5)
    assert (moved.replica, moved.branch) == (1, SPREAD_BRANCH)
    assert spread(d, 2.0, 0.9).replica == 2


def test_a_fractional_unseen_gives_the_last_place_its_fraction():
    # 0.25 unseen: place 1 only for draws of at least 0.8 (1 / 1.25).
    d = decision(0, [1.0, 1.0], [1.0, 1.0])
    assert spread(d, 0.25, 0.79) is d
    assert spread(d, 0.25, 0.81).replica == 1


def test_a_cache_hit_stays_where_its_prefix_is():
    # Replica 0 holds the prefix: 0.2 s with 0.05 s of prefill left; the others 1.0 s. Three
    # more of it from one router would all go there too (0.25, 0.30, 0.35 s < 1.0 s).
    d = decision(0, [0.2, 1.0, 1.0], [0.05, 0.9, 0.9], cached=[9000.0, 0.0, 0.0])
    assert spread(d, 3.0, 0.99) is d


def test_a_moved_decision_carries_its_new_replica_s_figures():
    d = decision(0, [1.0, 1.0], [1.0, 1.0], cached=[0.0, 320.0])
    d.scores[1]["deadline_s"] = 12.3456
    moved = spread(d, 1.0, 0.9)
    assert moved.replica == 1
    assert moved.predicted_cached_tokens == 320
    assert moved.priority == 12346
    assert "replica 0 (cold_spread: cheapest)" in moved.reason


def test_a_policy_without_costs_is_left_alone():
    d = Decision(1, "hash", "ring", {0: {"load": 1.0}, 1: {"load": 0.0}})
    assert spread(d, 3.0, 0.99) is d


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_unseen_is_the_remote_rate_times_the_mean_lag():
    # Little's law over the last second: 4 bookings applied, 50 ms each on their way ->
    # 4 a second x 0.05 s = 0.2 bookings on their way at any moment; a second later, none.
    clock = Clock()
    decisions = ConcurrentDecisions("a", wall=clock)
    for _ in range(4):
        decisions.arrived(0.05)
        clock.t += 0.2
    assert abs(decisions.unseen() - 0.2) < 1e-9
    clock.t += 1.0
    assert decisions.unseen() == 0.0


def cold_fleet(hook=None) -> LifecycleRunner:
    runner = LifecycleRunner(PrefixRoute())
    for i in range(3):
        runner.add_replica(ReplicaView(index=i, name=f"r{i}", cache=ApproximateView(None),
                                       capacity_blocks=10_000))
    runner.concurrent = hook
    return runner


def cold_request(i: int) -> RequestView:
    return RequestView(request_id=f"q{i}", num_tokens=10_000, block_size=16,
                       block_keys=[(i, b) for b in range(625)], tenant=f"t{i}", now=1.0)


def test_four_instances_deciding_within_the_lag_no_longer_all_pick_one_replica():
    # Four instances, one idle fleet of three replicas, each routes one new tenant's
    # 10,000-token prompt before any of the others' bookings arrives (the same view). The
    # policy alone: every instance picks replica 0 (four prefills queued on it). With three
    # decisions expected unseen per instance, each takes a place of the sequence 0, 1, 2, 0
    # by its own draw: over 200 such bursts the busiest replica gets about 2.5 of the 4 on
    # average (each instance a uniform place of 4: E[max load] = 636 / 256 = 2.48), against 4.
    alone = {cold_fleet().route(cold_request(i)).replica for i in range(4)}
    assert alone == {0}
    busiest = []
    for burst in range(200):
        picks = []
        for i in range(4):
            hook = ConcurrentDecisions(f"instance-{i}-{burst}")
            hook.unseen = lambda: 3.0
            picks.append(cold_fleet(hook).route(cold_request(i)).replica)
        busiest.append(max(picks.count(r) for r in range(3)))
    assert 2.2 < sum(busiest) / len(busiest) < 2.8


class Fixed(BasePolicy):
    def __init__(self, choice):
        self.choice = choice
        self.routed = []

    def route(self, request, replicas):
        return Decision(self.choice, "fixed")

    def on_routed(self, request, decision):
        self.routed.append(decision.replica)


def test_the_runner_books_what_the_hook_answers_and_spares_a_fallback():
    policy = Fixed(0)
    runner = LifecycleRunner(policy)
    for i in range(2):
        runner.add_replica(ReplicaView(index=i, name=f"r{i}", cache=ApproximateView(None)))
    seen = []
    runner.concurrent = lambda request, d: seen.append(d.replica) or Decision(1, "moved")
    booking = runner.route(RequestView(request_id="a", num_tokens=32, block_size=16,
                                       block_keys=[1, 2], now=0.0))
    assert (booking.replica, booking.decision.branch, policy.routed) == (1, "moved", [1])
    assert runner.replicas[1].in_flight == 1
    policy.choice = 7  # not a candidate: the least-loaded fallback, not for the hook to move
    booking = runner.route(RequestView(request_id="b", num_tokens=32, block_size=16,
                                       block_keys=[3, 4], now=0.0))
    assert booking.decision.branch == "policy_error_least_loaded"
    assert seen == [0]
