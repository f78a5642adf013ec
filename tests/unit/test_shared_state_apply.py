"""Other instances' bookings applied to this instance's lifecycle runner.

Two runners stand for two gateway instances over the same two replicas. What instance A
books and ends is told to B as messages; B's replica counts and policy hooks must then be
what they would be had B routed the requests itself, marked remote."""

from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView
from prefixroute.core.routing.lifecycle import LifecycleRunner
from prefixroute.core.routing.views import ApproximateView
from prefixroute.edges.shared_state.apply import RemoteBookings
from prefixroute.edges.shared_state.codec import Completed, Ended, Routed, decode, encode

BLOCK = 16
WALL_OFFSET = 1000.0  # B's clock reads wall time minus 1000 s


class Recording(BasePolicy):
    name = "recording"

    def __init__(self):
        self.calls = []

    def route(self, request, replicas):
        return Decision(0, "first")

    def on_routed(self, request, decision):
        self.calls.append(("routed", request.request_id, decision.replica, request.now))

    def on_completed(self, request, replica, cached_tokens):
        self.calls.append(("completed", request.request_id, replica, cached_tokens))

    def on_unreported(self, request, replica, ran):
        self.calls.append(("unreported", request.request_id, replica, ran))


def instance_b(order=("r0", "r1")):
    policy = Recording()
    runner = LifecycleRunner(policy)
    for index, name in enumerate(order):
        runner.add_replica(ReplicaView(index=index, name=name, cache=ApproximateView(None)))
    by_name = {name: index for index, name in enumerate(order)}
    remote = RemoteBookings(runner, "B", by_name.get, lambda wall: wall - WALL_OFFSET,
                            stale_after_s=60.0)
    return remote, runner, policy


def routed(rid, replica="r1", keys=(11, 12, 13), wall=2000.0, instance="A"):
    return Routed(instance, rid, replica, "tenant-a", len(keys) * BLOCK + 1, BLOCK, keys, wall,
                  "hit", 32)


def apply_wire(remote, event):
    return remote.apply(decode(encode(event)))  # as it comes off the stream


def test_a_remote_booking_counts_on_the_named_replica_and_enters_the_view():
    remote, runner, policy = instance_b()
    assert apply_wire(remote, routed("q1", "r1"))
    replica = runner.replicas[1]
    assert (replica.in_flight, replica.assignments) == (1, 1)
    assert replica.cache.match([11, 12, 13]) == 3
    # Its time is on B's clock: wall 2000 s is 1000 s here.
    assert policy.calls == [("routed", "A/q1", 1, 1000.0)]
    booking, _ = remote.open[("A", "q1")]
    assert booking.remote


def test_replicas_are_matched_by_name_not_by_position():
    remote, runner, _ = instance_b(order=("r1", "r0"))
    apply_wire(remote, routed("q1", "r1"))
    assert runner.replicas[0].in_flight == 1  # r1 is B's replica 0
    assert runner.replicas[1].in_flight == 0


def test_a_remote_completion_feeds_the_policy_like_a_local_one():
    remote, runner, policy = instance_b()
    apply_wire(remote, routed("q1"))
    assert apply_wire(remote, Completed("A", "q1", 32))
    replica = runner.replicas[1]
    assert (replica.in_flight, replica.assignments) == (0, 1)
    assert policy.calls[-1] == ("completed", "A/q1", 1, 32)
    assert remote.open == {}


def test_a_remote_request_that_did_not_run_gives_back_its_assignment_and_blocks():
    remote, runner, policy = instance_b()
    apply_wire(remote, routed("q1"))
    apply_wire(remote, Ended("A", "q1", False))
    replica = runner.replicas[1]
    assert (replica.in_flight, replica.assignments) == (0, 0)
    assert replica.cache.match([11, 12, 13]) == 0
    assert policy.calls[-1] == ("unreported", "A/q1", 1, False)


def test_three_instances_traffic_adds_up_on_each_replica():
    remote, runner, _ = instance_b()
    for i in range(3):
        apply_wire(remote, routed(f"a{i}", "r0", instance="A"))
    for i in range(2):
        apply_wire(remote, routed(f"c{i}", "r1", instance="C"))
    apply_wire(remote, Completed("A", "a0", 0))
    apply_wire(remote, Ended("C", "c1", True))
    # r0: 3 booked, 1 completed -> 2 in flight, 3 assigned; r1: 2 booked, 1 ended -> 1, 2.
    assert (runner.replicas[0].in_flight, runner.replicas[0].assignments) == (2, 3)
    assert (runner.replicas[1].in_flight, runner.replicas[1].assignments) == (1, 2)


def test_own_duplicate_unknown_and_orphan_messages_change_nothing():
    remote, runner, policy = instance_b()
    assert not remote.apply(routed("q1", instance="B"))  # our own, echoed by the stream
    assert not remote.apply(routed("q2", replica="r9"))  # a replica B does not route to
    assert remote.apply(routed("q3"))
    assert not remote.apply(routed("q3"))  # bootstrap overlapping the live stream
    assert not remote.apply(Completed("A", "q0", 16))  # its booking is older than B's view
    assert runner.replicas[1].in_flight == 1
    assert len(policy.calls) == 1
    assert remote.applied["ignored"] == 3  # (its own echoes are not counted)


def test_a_remote_booking_without_an_end_expires_as_run():
    remote, runner, policy = instance_b()
    apply_wire(remote, routed("old", wall=2000.0))  # 1000 s on B's clock
    apply_wire(remote, routed("new", wall=2050.0))  # 1050 s
    assert remote.expire(now=1059.0) == 0
    assert remote.expire(now=1060.0) == 1  # 60 s after the first: it ended unseen
    assert runner.replicas[1].in_flight == 1
    assert policy.calls[-1] == ("unreported", "A/old", 1, True)


def test_a_gone_instance_s_open_bookings_end_as_run_and_others_stay():
    remote, runner, policy = instance_b()
    apply_wire(remote, routed("a1", "r0", instance="A"))
    apply_wire(remote, routed("a2", "r1", instance="A"))
    apply_wire(remote, routed("c1", "r1", instance="C"))
    assert remote.instances() == {"A", "C"}
    assert remote.forget_instance("A") == 2
    assert (runner.replicas[0].in_flight, runner.replicas[1].in_flight) == (0, 1)
    assert remote.instances() == {"C"}
    assert ("unreported", "A/a2", 1, True) in policy.calls
