"""The booking messages router instances exchange: each event survives the wire unchanged,
and anything else is refused with a clear error rather than misapplied."""

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.edges.shared_state.codec import (CodecError, Completed, Ended, Prefilled,
                                                  Routed, UnknownKind, decode, encode)

KEY64 = st.integers(min_value=0, max_value=2**64 - 1)
TEXT = st.text(max_size=40)

routed = st.builds(Routed, TEXT, TEXT, TEXT, TEXT, st.integers(0, 10**7), st.integers(1, 512),
                   st.lists(KEY64, max_size=50).map(tuple),
                   st.floats(0, 2e9, allow_nan=False), TEXT, st.integers(0, 10**7),
                   st.one_of(st.none(), st.integers(0, 2**53)))
prefilled = st.builds(Prefilled, TEXT, TEXT)
completed = st.builds(Completed, TEXT, TEXT, st.integers(0, 10**7))
ended = st.builds(Ended, TEXT, TEXT, st.booleans())


@given(st.one_of(routed, prefilled, completed, ended))
def test_every_event_decodes_to_itself(event):
    assert decode(encode(event)) == event


def test_a_routed_booking_of_three_blocks_is_small_on_the_wire():
    event = Routed("i1", "pr-1", "r0", "a", 49, 16, (1, 2**64 - 1, 3), 1.7e9, "hit", 32)
    data = encode(event)
    # 3 keys: 1 + 9 + 1 bytes of msgpack; the whole message stays under 100 bytes.
    assert len(data) < 100
    assert decode(data).block_keys == (1, 2**64 - 1, 3)


@pytest.mark.parametrize("data, message", [
    (b"\xc1", "not a msgpack booking message"),
    (msgpack.packb({"v": 1}), "array"),
    (msgpack.packb([2, "e", "i", "r", True]), "version 2"),
    (msgpack.packb([1, "x", "i", "r"]), "unknown booking message kind 'x'"),
    (msgpack.packb([1, "c", "i", "r", "many"]), "malformed 'c'"),
    (msgpack.packb([1, "e", 7, "r", True]), "strings"),
    # A tenant that is not text would fail later, where the booking is applied.
    (msgpack.packb([1, "r", "i", "pr-1", "r0", 5, 49, 16, [1], 1.7e9, "hit", 32, None]),
     "replica, tenant and branch must be strings"),
    (msgpack.packb([1, "p", "i", "r", 3]), "booking message kind 'p' with 3 fields"),
])
def test_anything_else_is_refused_with_a_reason(data, message):
    with pytest.raises(CodecError, match=message):
        decode(data)


def test_a_kind_of_a_newer_version_is_told_apart_from_a_broken_message():
    with pytest.raises(UnknownKind) as newer:
        decode(msgpack.packb([1, "x", "i", "r"]))
    assert newer.value.kind == "x"
    for broken_message in ([1, "p", "i", "r", 3], [1, [1], "i", "r"], [1, {"k": 1}, "i"]):
        with pytest.raises(CodecError) as broken:
            decode(msgpack.packb(broken_message))
        assert not isinstance(broken.value, UnknownKind)  # (a kind that is not a name)
