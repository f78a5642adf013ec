"""Invariants of the lifecycle runner over random event sequences: whatever order routes,
completions, ends without a report, resets and drains come in, each replica's in-flight count
is its open bookings, its assignments are its bookings that did not end unrun, and a booking
that did not run leaves an approximate view as it found it for that request's new blocks."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.lifecycle import LifecycleRunner, NoCandidateError
from prefixroute.core.routing.registry import create_policy
from prefixroute.core.routing.views import ApproximateView

REPLICAS = 3
events = st.lists(st.one_of(
    st.tuples(st.just("route"), st.lists(st.integers(0, 5), min_size=1, max_size=6)),
    st.tuples(st.just("complete"), st.integers(0, 50), st.integers(0, 96)),
    st.tuples(st.just("end"), st.integers(0, 50), st.booleans()),
    st.tuples(st.just("reset"), st.integers(0, REPLICAS - 1)),
    st.tuples(st.just("drain"), st.integers(0, REPLICAS - 1)),
    st.tuples(st.just("up"), st.integers(0, REPLICAS - 1)),
), max_size=40)


@settings(max_examples=60, deadline=None)
@given(script=events, policy=st.sampled_from(["hybrid", "affinity_only", "least_loaded",
                                              "sglang_cache_aware", "prefixroute"]))
def test_counts_follow_the_bookings(script, policy):
    runner = LifecycleRunner(create_policy(policy, num_replicas=REPLICAS, block_size=16))
    views = [runner.add_replica(ReplicaView(index=i, cache=ApproximateView(8)))
             for i in range(REPLICAS)]
    bookings = []
    unrun = set()  # bookings whose first end said the engine did not run them
    for step, event in enumerate(script):
        kind = event[0]
        if kind == "route":
            keys = [("k", key) for key in event[1]]
            request = RequestView(f"r{step}", len(keys) * 16 + 1, 16, block_keys=keys,
                                  now=float(step))
            try:
                bookings.append(runner.route(request))
            except NoCandidateError:
                assert all(runner.states[i] != "up" for i in runner.states)
        elif kind in ("complete", "end") and bookings:
            booking = bookings[event[1] % len(bookings)]
            if kind == "complete":
                runner.completed(booking, event[2])
            else:
                if not booking.ended and not event[2]:
                    unrun.add(id(booking))
                runner.ended(booking, ran=event[2])
        elif kind == "reset":
            runner.reset_replica(event[1])
        elif kind == "drain":
            runner.drain_replica(event[1])
        elif kind == "up":
            runner.add_replica(views[event[1]])
    for view in views:
        mine = [b for b in bookings if b.replica == view.index]
        assert view.in_flight == sum(1 for b in mine if not b.ended) >= 0
        assert view.assignments == sum(1 for b in mine if id(b) not in unrun)
        assert len(view.cache) <= 8
