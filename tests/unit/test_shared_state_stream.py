"""Which of this instance's decisions were made blind to another instance's booking.

Bookings travel between instances with a lag (publish, Redis, the others' reads): a decision
made after another instance booked a request on the same replica, but before that booking
arrived here, did not count it. Instance B notes its decisions; when A's booking is applied,
B's later decisions on the same replica are counted, by branch. No Redis is asked here."""

from prometheus_client import CollectorRegistry

from tests.unit.test_shared_state_apply import instance_b, routed
from prefixroute.edges.shared_state.codec import encode
from prefixroute.edges.shared_state.link import RedisLink, SharedStateMetrics
from prefixroute.edges.shared_state.stream import BLIND_WINDOW_S, SharedBookings


def bookings_b() -> tuple[SharedBookings, CollectorRegistry]:
    registry = CollectorRegistry()
    link = RedisLink("redis://127.0.0.1:1/0", SharedStateMetrics(registry))
    remote, _, _ = instance_b()
    shared = SharedBookings(link, remote, namespace="t", now=lambda: 0.0)
    shared.bootstrapped = True
    return shared, registry


def blind(registry: CollectorRegistry, branch: str) -> float:
    return registry.get_sample_value("prefixroute_shared_state_blind_decisions_total",
                                     {"branch": branch}) or 0.0


def arrive(shared: SharedBookings, *events) -> None:
    shared._apply([(f"{i}-0".encode(), {b"m": encode(e)}) for i, e in enumerate(events, 1)])


def test_a_later_decision_on_the_same_replica_is_counted_blind_by_its_branch():
    shared, registry = bookings_b()
    shared.decided(2000.10, "r1", "cache_affinity")  # before A's booking: it could not know
    shared.decided(2000.20, "r0", "cold_spread")  # after, but another replica
    shared.decided(2000.30, "r1", "spill")  # after, same replica: blind
    arrive(shared, routed("a1", replica="r1", wall=2000.15))
    assert blind(registry, "spill") == 1
    assert blind(registry, "cache_affinity") == 0
    assert blind(registry, "cold_spread") == 0


def test_a_booking_that_arrives_before_any_later_decision_counts_nothing():
    shared, registry = bookings_b()
    shared.decided(2000.10, "r1", "cold_spread")
    arrive(shared, routed("a1", replica="r1", wall=2000.35))
    assert blind(registry, "cold_spread") == 0


def test_decisions_older_than_the_window_are_forgotten():
    shared, _ = bookings_b()
    shared.decided(2000.0, "r1", "spill")
    shared.decided(2000.0 + BLIND_WINDOW_S + 0.5, "r1", "spill")
    assert [wall for wall, _, _ in shared.recent] == [2000.0 + BLIND_WINDOW_S + 0.5]


def test_own_entries_are_skipped_without_decoding_and_others_applied(caplog):
    shared, registry = bookings_b()
    shared._apply([
        (b"1-0", {b"m": b"not msgpack", b"i": b"B"}),  # B's own: never decoded
        (b"2-0", {b"m": encode(routed("a1", replica="r1", wall=2000.15)), b"i": b"A"}),
    ])
    assert "unreadable" not in caplog.text  # B's own entry was not decoded
    assert shared.last_id == b"2-0"
    assert shared.remote.applied["routed"] == 1
    assert registry.get_sample_value("prefixroute_shared_state_remote_events_total",
                                     {"kind": "routed"}) == 1
