"""KV event codecs: vLLM 0.32 tagged maps and legacy positional arrays, read and written.

Byte-level truth comes from tests/fixtures/vllm_0.32 (scripts/record_vllm_fixtures.py): frames
a real vLLM 0.32 CPU server published, and synthetic batches encoded by vLLM's own msgspec
structs.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from prefixroute.core.errors import InputError
from prefixroute.core.kvevents import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_event_batch,
    encode_event_batch,
    event_to_obj,
)

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "vllm_0.32"
FRAMES = json.loads((FIXTURES / "frames.json").read_text())["frames"]
REQUESTS = json.loads((FIXTURES / "requests.json").read_text())["requests"]
REFERENCE = {c["name"]: base64.b64decode(c["payload_b64"]) for c in json.loads(
    (FIXTURES / "msgspec_reference.json").read_text())["cases"]}

STORED = BlockStored(
    block_hashes=(1, 2**64 - 1), parent_block_hash=2**63, token_ids=(6, 4095, 300),
    block_size=32, lora_id=3, medium="GPU", lora_name="adapter-a",
    extra_keys=(("adapter-a", ("img-1", 4), "salt"), None), group_idx=1,
    kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128, locality="LOCAL",
    ownership="tier-2", session_id="session-9")
PLAIN_STORED = BlockStored(block_hashes=(7,), parent_block_hash=None, token_ids=(1, 2),
                           block_size=2, medium="GPU")


def frame_payload(seq: int) -> bytes:
    return next(base64.b64decode(f["payload_b64"]) for f in FRAMES if f["seq"] == seq)


# -- round trips ---------------------------------------------------------------------------
@pytest.mark.parametrize("wire_format", ["tagged", "positional"])
def test_round_trip_keeps_every_field(wire_format):
    batch = EventBatch(12.5, (STORED, PLAIN_STORED, BlockRemoved((9, 10), "GPU", 0),
                              AllBlocksCleared()), 1)
    assert decode_event_batch(encode_event_batch(batch, wire_format)) == batch


@pytest.mark.parametrize("wire_format", ["tagged", "positional"])
def test_round_trip_of_bytes_block_hashes(wire_format):
    event = BlockStored((bytes(range(32)),), b"\xff" * 32, (5,) * 32, 32, medium="GPU")
    batch = EventBatch(1.0, (event,), 0)
    assert decode_event_batch(encode_event_batch(batch, wire_format)) == batch


def test_tagged_event_is_a_map_with_type_first_and_unset_defaults_left_out():
    obj = event_to_obj(PLAIN_STORED, "tagged")
    # lora_id, medium and lora_name have no default in vLLM's struct: always written.
    assert list(obj) == ["type", "block_hashes", "parent_block_hash", "token_ids",
                         "block_size", "lora_id", "medium", "lora_name"]
    assert obj["type"] == "BlockStored"


def test_positional_event_is_an_array_through_lora_name_when_nothing_else_is_set():
    assert event_to_obj(PLAIN_STORED, "positional") == [
        "BlockStored", (7,), None, (1, 2), 2, None, "GPU", None]
    assert event_to_obj(BlockRemoved((3,), "GPU"), "positional") == ["BlockRemoved", (3,),
                                                                       "GPU"]
    assert event_to_obj(AllBlocksCleared(), "positional") == ["AllBlocksCleared"]


def test_positional_event_keeps_fields_up_to_the_last_one_set():
    event = BlockStored((7,), None, (1, 2), 2, group_idx=0)
    assert event_to_obj(event, "positional") == [
        "BlockStored", (7,), None, (1, 2), 2, None, None, None, None, 0]


def test_batch_always_carries_the_rank_slot():
    raw = msgpack.unpackb(encode_event_batch(EventBatch(1.0, ())))
    assert raw == [1.0, [], None]


# -- byte-for-byte against vLLM --------------------------------------------------------------
@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: f"seq{f['seq']}")
def test_real_vllm_frame_reencodes_byte_for_byte(frame):
    payload = base64.b64decode(frame["payload_b64"])
    assert encode_event_batch(decode_event_batch(payload), "tagged") == payload


@pytest.mark.parametrize("name", [n for n in REFERENCE if n.startswith("tagged_")])
def test_msgspec_encoded_batch_reencodes_byte_for_byte(name):
    payload = REFERENCE[name]
    assert encode_event_batch(decode_event_batch(payload), "tagged") == payload


def test_msgspec_all_fields_case_decodes_to_every_field():
    assert decode_event_batch(REFERENCE["tagged_all_fields"]) == EventBatch(
        1732912345.125, (STORED,), 2)


def test_msgspec_bytes_hash_case_decodes_bytes_and_prompt_embeds_digest():
    batch = decode_event_batch(REFERENCE["tagged_bytes_hashes"])
    stored, removed = batch.events
    assert stored.block_hashes == (bytes(range(32)),)
    assert stored.parent_block_hash == b"\xff" * 32
    assert stored.extra_keys == (("p" * 40, b"\x00\x01"),)
    assert removed == BlockRemoved((bytes(range(32)),), "CPU", 0, "REMOTE", "tier-1")


def test_msgspec_nil_rank_case():
    batch = decode_event_batch(REFERENCE["tagged_nil_rank_and_clear"])
    assert batch == EventBatch(0.5, (AllBlocksCleared(), BlockRemoved((5, 6), None)), None)


def test_legacy_positional_batch_without_rank_and_with_signed_hashes():
    batch = decode_event_batch(REFERENCE["positional_v08"])
    assert batch == EventBatch(4.0, (
        BlockStored((-5, 9), None, (1, 2), 1, None, None),
        BlockRemoved((-5,), None), AllBlocksCleared()), None)


def test_legacy_positional_batch_with_lora_name():
    batch = decode_event_batch(REFERENCE["positional_lora_name"])
    assert batch == EventBatch(5.0, (
        BlockStored((11,), 10, (3, 4), 2, 7, "GPU", "adapter-b"),
        BlockRemoved((11,), "GPU")), 1)


# -- real frames decode to the recorded events ---------------------------------------------
def test_real_frames_decode_to_the_events_recorded_per_request():
    for request in REQUESTS:
        for expected in request["events"]:
            batch = decode_event_batch(frame_payload(expected["seq"]))
            assert batch.data_parallel_rank == 0
            kinds = [type(e).__name__ for e in batch.events]
            assert expected["type"] in kinds, request["name"]
    salted = next(r for r in REQUESTS if r["name"] == "salted_a_100")["events"][0]
    event = decode_event_batch(frame_payload(salted["seq"])).events[0]
    assert event.extra_keys == (("tenant-a-salt",), None, None)
    assert event.block_size == 32 and len(event.token_ids) == 96
    assert (event.medium, event.group_idx, event.kv_cache_spec_kind) == ("GPU", 0,
                                                                         "full_attention")


# -- tolerance -----------------------------------------------------------------------------
def test_positional_event_missing_trailing_fields_reads_them_as_none():
    payload = msgpack.packb([1.0, [["BlockStored", [1], None, [1, 2], 2]]])
    (event,) = decode_event_batch(payload).events
    assert event == BlockStored((1,), None, (1, 2), 2)


def test_unknown_trailing_positional_fields_and_unknown_map_keys_are_ignored():
    payload = msgpack.packb([1.0, [
        ["BlockRemoved", [1], "GPU", 0, None, None, "future-field"],
        {"type": "BlockRemoved", "block_hashes": [2], "medium": "GPU", "future": 1}], 0])
    assert decode_event_batch(payload).events == (BlockRemoved((1,), "GPU", 0),
                                                  BlockRemoved((2,), "GPU"))


def test_unknown_event_type_is_skipped_only_when_asked():
    payload = msgpack.packb([1.0, [{"type": "BlockTransferred"}, ["AllBlocksCleared"]], 0])
    with pytest.raises(InputError, match="unknown KV event type 'BlockTransferred'"):
        decode_event_batch(payload)
    assert decode_event_batch(payload, skip_unknown=True).events == (AllBlocksCleared(),)


# -- malformed input -----------------------------------------------------------------------
@pytest.mark.parametrize("payload, field", [
    (msgpack.packb({"ts": 1}), "batch"),
    (msgpack.packb([1.0]), "batch"),
    (msgpack.packb(["now", []]), "ts"),
    (msgpack.packb([1.0, {"a": 1}]), "events"),
    (msgpack.packb([1.0, [], "zero"]), "data_parallel_rank"),
    (msgpack.packb([1.0, [42]]), "events[0]"),
    (msgpack.packb([1.0, [{"block_hashes": [1]}]]), "events[0].type"),
    (msgpack.packb([1.0, [["BlockStored", [1], None]]]), "events[0]"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "token_ids": [1],
                           "block_size": "32"}]]), "events[0].block_size"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1],
                           "block_size": 32}]]), "events[0].token_ids"),
    (msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 1]]]),
     "events[0].block_hashes[0]"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1, "x"], 1]]]),
     "events[0].token_ids[1]"),
    (msgpack.packb([1.0, [["BlockRemoved", [1], 5]]]), "events[0].medium"),
    (msgpack.packb([1.0, [["BlockStored", [1], None, [1], 1, None, None, None, [7]]]]),
     "events[0].extra_keys[0]"),
])
def test_malformed_batch_raises_input_error_naming_the_field(payload, field):
    with pytest.raises(InputError) as info:
        decode_event_batch(payload, where="frame 3")
    assert info.value.field == field
    assert str(info.value).startswith("frame 3: ")


@pytest.mark.parametrize("payload", [b"", b"\xc1", b"\x93\xcb", msgpack.packb([1.0, []]) + b"x"])
def test_bytes_that_are_not_one_msgpack_value_raise_input_error(payload):
    with pytest.raises(InputError, match="not a msgpack KV event batch"):
        decode_event_batch(payload)


def test_non_bytes_payload_raises_input_error():
    with pytest.raises(InputError):
        decode_event_batch("[1.0, []]")  # type: ignore[arg-type]


def test_unknown_wire_format_raises_input_error():
    with pytest.raises(InputError, match="unknown wire format"):
        encode_event_batch(EventBatch(1.0, (PLAIN_STORED,)), "json")  # type: ignore[arg-type]


# -- property ------------------------------------------------------------------------------
hashes = st.one_of(st.integers(-(2**63), 2**64 - 1), st.binary(min_size=32, max_size=32))
maybe_str = st.none() | st.text(max_size=8)
maybe_int = st.none() | st.integers(0, 1000)
extra = st.none() | st.lists(st.none() | st.tuples(st.text(max_size=6), st.integers(0, 99)),
                             max_size=3).map(tuple)
stored_events = st.builds(
    BlockStored, st.lists(hashes, max_size=4).map(tuple), st.none() | hashes,
    st.lists(st.integers(0, 2**32), max_size=8).map(tuple), st.integers(1, 256), maybe_int,
    maybe_str, maybe_str, extra, maybe_int, maybe_str, maybe_int, maybe_str, maybe_str,
    maybe_str)
removed_events = st.builds(BlockRemoved, st.lists(hashes, max_size=4).map(tuple), maybe_str,
                           maybe_int, maybe_str, maybe_str)
events = st.one_of(stored_events, removed_events, st.just(AllBlocksCleared()))


@given(st.floats(0, 2e9, allow_nan=False), st.lists(events, max_size=5), maybe_int,
       st.sampled_from(["tagged", "positional"]))
def test_any_batch_round_trips_in_either_format(ts, event_list, rank, wire_format):
    batch = EventBatch(ts, tuple(event_list), rank)
    assert decode_event_batch(encode_event_batch(batch, wire_format)) == batch
