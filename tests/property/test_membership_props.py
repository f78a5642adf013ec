"""Membership diffs: applying the events :func:`diff_members` gives for two listings takes a
body that holds the first listing to exactly the second, whatever the two are."""

from hypothesis import given
from hypothesis import strategies as st

from prefixroute.edges.discovery.events import (ADDED, DRAINING, REMOVED, RESET, Member,
                                                diff_members)
from prefixroute.edges.gateway.config import BackendConfig

NAMES = st.sampled_from(["a", "b", "c", "d"])
member_st = st.builds(
    lambda name, port, draining, generation: Member(
        BackendConfig(name, f"http://10.0.0.1:{port}", ("m",)), draining, generation),
    NAMES, st.integers(8000, 8002), st.booleans(), st.integers(0, 2))
listing = st.lists(member_st, max_size=4).map(lambda ms: {m.name: m for m in ms})


def apply(state: dict[str, dict], events) -> dict[str, dict]:
    """A body's view of the fleet: name -> (backend, draining, resets seen)."""
    for event in events:
        if event.kind == REMOVED:
            assert event.name in state, "removed a replica the body does not hold"
            del state[event.name]
        elif event.kind == ADDED:
            known = state.get(event.name)
            if known is None:
                state[event.name] = {"backend": event.member.backend, "draining": False}
            else:
                assert known["draining"], "added twice without a removal"
                known["draining"] = False
        elif event.kind == DRAINING:
            state[event.name]["draining"] = True
        elif event.kind == RESET:
            assert event.name in state
    return state


@given(listing, listing)
def test_applying_the_diff_reaches_the_new_listing(old, new):
    state = {name: {"backend": m.backend, "draining": m.draining} for name, m in old.items()}
    state = apply(state, diff_members(old, new))
    assert state == {name: {"backend": m.backend, "draining": m.draining}
                     for name, m in new.items()}


@given(listing)
def test_an_unchanged_listing_gives_no_event(members):
    assert diff_members(members, dict(members)) == []
