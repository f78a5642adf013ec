"""Two readers of one booking stream, one instance: the background reader and the catch-up
before each routing decision each read from the last entry applied when they ask, and their
answers arrive in any order. Whatever the interleaving, every entry is applied once, in the
stream's order: the remote state is the one a single in-order reading gives."""

from hypothesis import given, settings
from hypothesis import strategies as st

from prefixroute.edges.shared_state.codec import Completed, encode
from tests.unit.test_shared_state_apply import routed
from tests.unit.test_shared_state_stream import bookings_b

REQUESTS = 4


def stream() -> list[tuple[bytes, dict]]:
    """A's bookings and ends, each request's end after its booking, ids in stream order."""
    events = []
    for i in range(REQUESTS):
        events.append(routed(f"q{i}", replica=f"r{i % 2}"))
        if i:
            events.append(Completed("A", f"q{i - 1}", 16))
    events.append(Completed("A", f"q{REQUESTS - 1}", 16))
    return [(f"1700000000{n:03d}-{n % 3}".encode(), {b"m": encode(e), b"i": b"A"})
            for n, e in enumerate(events, 1)]


ENTRIES = stream()
# ("ask", reader, how many entries the answer holds) or ("answer", reader).
STEP = st.one_of(st.tuples(st.just("ask"), st.sampled_from(["reader", "catch_up"]),
                           st.integers(1, len(ENTRIES))),
                 st.tuples(st.just("answer"), st.sampled_from(["reader", "catch_up"])))


def state(shared) -> tuple:
    runner = shared.remote.runner
    return (dict(shared.remote.applied), sorted(shared.remote.open),
            [(r.in_flight, r.assignments) for r in runner.replicas.values()])


def asked_from(shared) -> int:
    """Where a read asked now starts: after the last entry applied."""
    last = shared.last_id
    return 0 if last is None else [e[0] for e in ENTRIES].index(last) + 1


@settings(max_examples=300, deadline=None)
@given(st.lists(STEP, max_size=20))
def test_each_entry_is_applied_once_whichever_reader_sees_it_first(steps):
    shared, _ = bookings_b()
    pending: dict[str, list] = {}
    for step in steps:
        if step[0] == "ask" and step[1] not in pending:
            start = asked_from(shared)
            pending[step[1]] = ENTRIES[start:start + step[2]]
        elif step[0] == "answer" and step[1] in pending:
            shared._apply(pending.pop(step[1]))
    for answer in pending.values():  # late answers
        shared._apply(answer)
    shared._apply(ENTRIES[asked_from(shared):])  # the next read: the rest
    once, _ = bookings_b()
    once._apply(ENTRIES)
    assert state(shared) == state(once)
    assert shared.last_id == ENTRIES[-1][0]
    assert once.remote.applied["routed"] == REQUESTS  # the reference itself is complete
