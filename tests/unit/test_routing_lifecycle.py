"""The lifecycle runner's rules, one per test, with numbers to check by hand.

Keys are letters; a request's blocks are its keys. A recording policy notes every hook the
runner calls, so each test states what the policy is told."""

import pytest

from prefixroute.core.clock import ManualClock
from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.lifecycle import (NON_CANDIDATE_BRANCH, LifecycleRunner,
                                                NoCandidateError)
from prefixroute.core.routing.views import ApproximateView, EventView, LiveEventView

BLOCK = 16


class Scripted(BasePolicy):
    """Answers the replica it is told to (``answer``), records every hook."""

    name = "scripted"

    def __init__(self):
        self.answer = 0
        self.calls = []

    def route(self, request, replicas):
        self.calls.append(("route", request.request_id, [r.index for r in replicas]))
        return Decision(self.answer, "scripted")

    def on_routed(self, request, decision):
        self.calls.append(("routed", request.request_id, decision.replica, decision.branch))

    def on_completed(self, request, replica, cached_tokens):
        self.calls.append(("completed", request.request_id, replica, cached_tokens))

    def on_unreported(self, request, replica, ran):
        self.calls.append(("unreported", request.request_id, replica, ran))

    def on_replica_reset(self, replica):
        self.calls.append(("reset", replica))


def request(rid, keys):
    # One token past the last full block, so every block is cacheable.
    return RequestView(rid, len(keys) * BLOCK + 1, BLOCK, block_keys=list(keys))


def fleet(n=2, capacity=None, view=None):
    policy = Scripted()
    runner = LifecycleRunner(policy)
    for i in range(n):
        cache = view(i) if view else ApproximateView(capacity)
        runner.add_replica(ReplicaView(index=i, cache=cache))
    return runner, policy


def test_a_booking_counts_one_in_flight_and_one_assignment_and_enters_the_view():
    runner, policy = fleet()
    booking = runner.route(request("a", "wxyz"))
    replica = runner.replicas[0]
    assert (replica.in_flight, replica.assignments) == (1, 1)
    assert replica.cache.match(list("wxyz")) == 4  # a burst finds the prefix at once
    assert runner.held_blocks(booking) == 0  # nothing was held before it
    second = runner.route(request("b", "wxyv"))
    assert runner.held_blocks(second) == 3  # w, x, y from the first booking
    assert policy.calls[:2] == [("route", "a", [0, 1]), ("routed", "a", 0, "scripted")]


def test_a_completion_ends_the_flight_keeps_the_assignment_and_passes_the_cached_tokens():
    runner, policy = fleet()
    booking = runner.route(request("a", "wxyz"))
    runner.completed(booking, 48)
    replica = runner.replicas[0]
    assert (replica.in_flight, replica.assignments) == (0, 1)
    assert replica.cache.match(list("wxyz")) == 4
    assert policy.calls[-1] == ("completed", "a", 0, 48)


def test_a_rejected_request_is_unreported_not_a_zero_hit_and_takes_back_what_it_added():
    # The replica held w, x; a request w x y z is rejected (it never ran): the view forgets
    # y and z again, the assignment is taken back, and the policy hears "ended, did not
    # run", not "0 cached tokens" (which would read as w and x evicted).
    runner, policy = fleet()
    runner.completed(runner.route(request("a", "wx")), 0)
    booking = runner.route(request("b", "wxyz"))
    runner.ended(booking, ran=False)
    replica = runner.replicas[0]
    assert (replica.in_flight, replica.assignments) == (0, 1)
    assert replica.cache.match(list("wxyz")) == 2
    assert policy.calls[-1] == ("unreported", "b", 0, False)
    assert not [c for c in policy.calls if c[:2] == ("completed", "b")]


def test_an_answer_without_usage_ran_so_its_blocks_and_assignment_stay():
    runner, policy = fleet()
    booking = runner.route(request("a", "wxyz"))
    runner.ended(booking, ran=True)
    replica = runner.replicas[0]
    assert (replica.in_flight, replica.assignments) == (0, 1)
    assert replica.cache.match(list("wxyz")) == 4
    assert policy.calls[-1] == ("unreported", "a", 0, True)


def test_a_request_ends_once():
    runner, policy = fleet()
    booking = runner.route(request("a", "wx"))
    runner.completed(booking, 16)
    runner.ended(booking, ran=False)  # a late failure after the answer changes nothing
    runner.completed(booking, 16)
    replica = runner.replicas[0]
    assert (replica.in_flight, replica.assignments) == (0, 1)
    assert [c[0] for c in policy.calls] == ["route", "routed", "completed"]


@pytest.mark.parametrize("keep_scores", [True, False])
def test_a_booking_keeps_the_scores_only_for_a_body_that_reads_them(keep_scores):
    class Scoring(Scripted):
        def route(self, request, replicas):
            return Decision(1, "scored", "why", {0: {"cost_s": 2.0}, 1: {"cost_s": 1.0}}, 16,
                            priority=5)

    runner = LifecycleRunner(Scoring(), keep_scores=keep_scores)
    for i in range(2):
        runner.add_replica(ReplicaView(index=i, cache=ApproximateView()))
    decision = runner.route(request("a", "wx")).decision
    # Everything else of the decision stays either way.
    assert (decision.replica, decision.branch, decision.reason, decision.predicted_cached_tokens,
            decision.priority) == (1, "scored", "why", 16, 5)
    assert dict(decision.scores) == ({0: {"cost_s": 2.0}, 1: {"cost_s": 1.0}} if keep_scores
                                     else {})


@pytest.mark.parametrize("answer", [7, "1", None, True])
def test_a_non_candidate_answer_goes_to_the_least_loaded_candidate(answer):
    # Replica 0 has 2 requests in flight, replica 1 one, replica 2 is not a candidate: the
    # fallback is replica 1, the policy's on_routed hears the fallback, and it is counted.
    errors = []
    policy = Scripted()
    runner = LifecycleRunner(policy, on_policy_error=lambda r, d, c: errors.append((d.replica,
                                                                                     c)))
    for i in range(3):
        runner.add_replica(ReplicaView(index=i, cache=ApproximateView()))
    runner.route(request("a", "p"))
    runner.route(request("b", "q"))
    policy.answer = 1
    runner.route(request("c", "r"))
    policy.answer = 2 if answer is None else answer
    booking = runner.route(request("d", "s"), candidates=[0, 1])
    assert booking.replica == 1 and booking.decision.branch == NON_CANDIDATE_BRANCH
    assert policy.calls[-1] == ("routed", "d", 1, NON_CANDIDATE_BRANCH)
    assert runner.policy_errors == 1
    assert errors == [(policy.answer, [0, 1])]
    assert [r.in_flight for r in runner.replicas.values()] == [2, 2, 0]


def test_a_reset_empties_the_view_and_tells_the_policy_but_keeps_the_counts():
    runner, policy = fleet()
    booking = runner.route(request("a", "wxyz"))
    runner.reset_replica(0)
    replica = runner.replicas[0]
    assert replica.cache.match(list("wxyz")) == 0
    assert (replica.in_flight, replica.assignments) == (1, 1)
    assert policy.calls[-1] == ("reset", 0)
    runner.completed(booking, 0)  # the request in flight still ends
    assert replica.in_flight == 0


def test_a_draining_replica_takes_nothing_new_and_finishes_what_it_has():
    runner, policy = fleet()
    booking = runner.route(request("a", "wx"))
    runner.drain_replica(0)
    policy.answer = 1
    assert runner.route(request("b", "wx")).replica == 1
    assert policy.calls[-2] == ("route", "b", [1])
    runner.completed(booking, 0)
    assert runner.replicas[0].in_flight == 0
    runner.drain_replica(1)
    with pytest.raises(NoCandidateError):
        runner.route(request("c", "wx"))
    runner.add_replica(runner.replicas[0])  # back up
    policy.answer = 0
    assert runner.route(request("d", "wx")).replica == 0


def test_a_removed_replica_is_no_candidate_and_the_policy_forgets_it():
    runner, policy = fleet()
    policy.answer = 1
    old = runner.route(request("a", "wx"))
    runner.remove_replica(1)
    assert policy.calls[-1] == ("reset", 1)
    booking = runner.route(request("b", "wx"))
    assert (booking.replica, booking.decision.branch) == (0, NON_CANDIDATE_BRANCH)
    # It comes back under the same index with a new view; the old request's end applies to
    # the replica it was booked on, not to the newcomer's counts.
    newcomer = runner.add_replica(ReplicaView(index=1, cache=ApproximateView()))
    runner.completed(old, 0)
    assert (newcomer.in_flight, newcomer.assignments, old.view.in_flight) == (0, 0, 0)
    with pytest.raises(ConfigError):
        runner.add_replica(ReplicaView(index=1))  # already in the fleet


def test_a_remote_booking_counts_like_a_local_one_and_is_marked():
    runner, policy = fleet()
    remote = runner.book_remote(request("r", "wxyz"), Decision(1, "remote"))
    assert remote.remote and remote.replica == 1
    assert (runner.replicas[1].in_flight, runner.replicas[1].assignments) == (1, 1)
    assert runner.replicas[1].cache.match(list("wxyz")) == 4
    assert policy.calls == [("routed", "r", 1, "remote")]
    runner.ended(remote, ran=False)
    assert runner.replicas[1].cache.match(list("wxyz")) == 0
    assert runner.book_remote(request("s", "w"), Decision(9, "remote")) is None


def test_an_event_view_counts_in_flight_keys_and_holds_ran_ones_for_the_grace():
    clock = ManualClock()
    runner, _ = fleet(view=lambda i: LiveEventView(EventView(), clock, grace_s=5.0))
    view = runner.replicas[0].cache
    refused = runner.route(request("a", "wxyz"))
    assert view.match(list("wxyz")) == 4  # in flight: its BlockStored is still to come
    runner.ended(refused, ran=False)
    assert view.match(list("wxyz")) == 0  # never ran: nothing held
    ran = runner.route(request("b", "wxyz"))
    runner.completed(ran, 0)
    clock.advance(5.0)
    assert view.match(list("wxyz")) == 4  # answered, events not yet here: held 5 s
    clock.advance(0.001)
    assert view.match(list("wxyz")) == 0


def test_an_approximate_view_applies_its_records_in_order_when_read():
    # Capacity 3: w x y (recorded tail first, so y is the least recent), then z pushes y
    # out; the prompt of 4 blocks is longer than the replica and is not recorded at all.
    view = ApproximateView(3)
    view.record(list("wxy"))
    view.record(list("z"))
    view.record(list("abcd"))
    assert (view.match(list("wxy")), view.match(list("z")), view.match(list("a"))) == (2, 1, 0)
    assert len(view) == 3


def test_an_approximate_view_nobody_reads_does_not_keep_every_booking():
    # A policy with its own cache model never reads the view; its queue of bookings must
    # still be applied (same answers as applying at read time), not grow with the run.
    class Held:
        held_blocks = None

    def run(view):
        bookings = []
        for i in range(2500):
            keys = [i % 7, 100 + i % 5, 1000 + i]
            booking = Held()
            view.on_booked(keys, booking)
            bookings.append(booking)
        view.match([0])  # a read applies whatever is still queued
        return [b.held_blocks for b in bookings]

    bounded = ApproximateView(capacity_blocks=16)
    unbounded = ApproximateView(capacity_blocks=16)
    unbounded.MAX_QUEUED = 10 ** 9
    assert run(bounded) == run(unbounded)
    first = Held()
    fresh = ApproximateView(capacity_blocks=16)
    fresh.on_booked([1, 2], first)
    for i in range(fresh.MAX_QUEUED):
        fresh.on_booked([i + 10], Held())
    assert first.held_blocks == 0  # applied without a read
