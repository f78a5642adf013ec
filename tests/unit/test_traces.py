"""Trace readers: what they yield, and errors that name file:line and the field."""

import json
from pathlib import Path

import pytest

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.simulator.generators import seed_fleet
from prefixroute.core.simulator.keys import BlockKeyer
from prefixroute.edges.traces import read_trace
from prefixroute.edges.traces.jsonl import request_to_record

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


def write_lines(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                            for r in records))
    return path


def mooncake_line(t, n, out, ids):
    return {"timestamp": t, "input_length": n, "output_length": out, "hash_ids": ids}


def test_mooncake_reader_on_a_three_line_file(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [
        mooncake_line(0, 1200, 10, [0, 1, 2]),       # 1200 tokens: blocks 512 + 512 + 176
        mooncake_line(1500, 1024, 5, [0, 1]),        # exactly two full blocks
        mooncake_line(1500, 600, 0, [0, 7]),         # output 0 is replayed as 1
    ])
    requests = list(read_trace(path, "mooncake"))
    assert [r.arrival_s for r in requests] == [0.0, 1.5, 1.5]  # milliseconds -> seconds
    assert [r.input_tokens for r in requests] == [1200, 1024, 600]
    assert [r.output_tokens for r in requests] == [10, 5, 1]
    assert {r.block_size for r in requests} == {512}
    assert requests[0].request_id == "m.jsonl:1"
    keyer = BlockKeyer()
    keys = [keyer.keys(r) for r in requests]
    # Only full blocks get keys; equal leading ids give equal leading keys.
    assert [len(k) for k in keys] == [2, 2, 1]
    assert keys[0] == keys[1]
    assert keys[2][0] == keys[0][0]


@pytest.mark.parametrize("record, field, message", [
    ({"timestamp": 0, "output_length": 1, "hash_ids": [0]}, "input_length", "missing field"),
    (mooncake_line(0, 1200, 10, [0, 1]), "hash_ids", "block-size mismatch"),
    (mooncake_line(-5, 100, 1, [0]), "timestamp", "at least 0"),
    (mooncake_line(0, 100, 1, [0, "x"]), "hash_ids", "integers"),
])
def test_mooncake_bad_line_names_file_line_and_field(tmp_path, record, field, message):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake_line(0, 100, 1, [9]), record])
    with pytest.raises(InputError, match=message) as info:
        list(read_trace(path, "mooncake"))
    assert info.value.where == f"{path}:2"
    assert info.value.field == field
    assert f"{path}:2" in str(info.value)


def test_timestamps_going_backwards_are_an_error(tmp_path):
    path = write_lines(tmp_path / "back.jsonl", [mooncake_line(2000, 100, 1, [0]),
                                                 mooncake_line(1000, 100, 1, [1])])
    with pytest.raises(InputError, match="backwards") as info:
        list(read_trace(path, "mooncake"))
    assert (info.value.where, info.value.field) == (f"{path}:2", "timestamp")


def test_mooncake_with_a_different_block_size_flag_is_a_mismatch(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake_line(0, 1200, 1, [0, 1, 2])])
    with pytest.raises(InputError, match="256-token blocks"):
        list(read_trace(path, "mooncake", block_size=256))


def test_invalid_json_names_the_line(tmp_path):
    path = write_lines(tmp_path / "x.jsonl", [mooncake_line(0, 100, 1, [0]), "{not json"])
    with pytest.raises(InputError, match="not valid JSON") as info:
        list(read_trace(path, "mooncake"))
    assert info.value.where == f"{path}:2"


def test_what_pythons_json_writes_beyond_strict_json_is_read_as_before(tmp_path):
    # NaN in a field the reader ignores, a lone surrogate in a string: the fast parser
    # refuses both, the standard library's takes them, so the file reads as it always did.
    path = write_lines(tmp_path / "m.jsonl", ['{"timestamp": 0, "input_length": 100, '
                                              '"output_length": 1, "hash_ids": [0], '
                                              '"note": NaN, "who": "\\ud800"}'])
    (request,) = read_trace(path, "mooncake")
    assert (request.input_tokens, request.hash_ids) == (100, [0])


def test_jsonl_round_trips_generated_requests(tmp_path):
    original = list(seed_fleet(requests=3))
    path = write_lines(tmp_path / "t.jsonl", [{"prefixroute_trace": 1, "block_size": 16}]
                       + [request_to_record(r) for r in original])
    again = list(read_trace(path, "jsonl"))
    keyer = BlockKeyer()
    assert [r.request_id for r in again] == [r.request_id for r in original]
    assert [keyer.keys(r) for r in again] == [keyer.keys(r) for r in original]


def test_jsonl_needs_exactly_one_of_token_ids_and_hash_ids(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"arrival_s": 0, "output_tokens": 1}])
    with pytest.raises(InputError, match="exactly one") as info:
        list(read_trace(path, "jsonl"))
    assert info.value.where == f"{path}:1"


def test_jsonl_block_ids_need_a_block_size_and_must_fit_it(tmp_path):
    line = {"arrival_s": 0, "output_tokens": 1, "input_tokens": 40, "hash_ids": [1, 2, 3]}
    path = write_lines(tmp_path / "t.jsonl", [line])
    with pytest.raises(InputError, match="need a block size"):
        list(read_trace(path, "jsonl"))
    assert len(list(read_trace(path, "jsonl", block_size=16))) == 1  # 40/16 -> 2 or 3 ids
    with pytest.raises(InputError, match="mismatch") as info:
        list(read_trace(path, "jsonl", block_size=8))
    assert info.value.field == "hash_ids"


def test_jsonl_salts_separate_identical_prompts(tmp_path):
    base = {"arrival_s": 0, "output_tokens": 1, "token_ids": list(range(1, 40))}
    path = write_lines(tmp_path / "t.jsonl", [dict(base, cache_salt="a"),
                                              dict(base, cache_salt="b"), base])
    a, b, plain = (BlockKeyer().keys(r) for r in read_trace(path, "jsonl"))
    assert a[0] != b[0] and a[0] != plain[0]


def session(block_size, requests):
    return {"id": None, "block_size": block_size, "hash_id_scope": "local",
            "requests": requests}


def kv_request(t, n, out, ids):
    return {"t": t, "type": "n", "in": n, "out": out, "hash_ids": ids}


def test_kvtester_files_are_concurrent_sessions_with_their_own_id_namespaces(tmp_path):
    (tmp_path / "s1.json").write_text(json.dumps(session(64, [
        kv_request(0.0, 130, 5, [1, 2]), kv_request(10.0, 200, 5, [1, 2, 3])])))
    (tmp_path / "s2.json").write_text(json.dumps(session(64, [
        kv_request(4.0, 130, 0, [1, 2])])))
    requests = list(read_trace(tmp_path, "kvtester"))
    assert [(r.session, r.arrival_s) for r in requests] == [("s1", 0.0), ("s2", 4.0),
                                                            ("s1", 10.0)]
    assert requests[1].output_tokens == 1
    keyer = BlockKeyer()
    s1_first, s2_first, s1_second = (keyer.keys(r) for r in requests)
    assert s1_second[:2] == s1_first            # same file, same ids: shared prefix
    assert s2_first[0] != s1_first[0]           # equal local ids in another file: not shared


def test_kvtester_copies_are_further_users_with_their_own_blocks_and_pacing(tmp_path):
    (tmp_path / "s1.json").write_text(json.dumps(session(64, [
        kv_request(0.0, 130, 5, [1, 2]), kv_request(10.0, 200, 5, [1, 2, 3])])))
    (tmp_path / "s2.json").write_text(json.dumps(session(64, [
        kv_request(4.0, 130, 0, [1, 2])])))
    requests = list(read_trace(tmp_path, "kvtester", copies=3, copy_interval_s=5.0))
    # Copy c starts c x 5 s later; equal times keep file order, then copy order.
    assert [(r.request_id, r.arrival_s) for r in requests] == [
        ("s1:0", 0.0), ("s2:0", 4.0), ("s1#1:0", 5.0), ("s2#1:0", 9.0), ("s1:1", 10.0),
        ("s1#2:0", 10.0), ("s2#2:0", 14.0), ("s1#1:1", 15.0), ("s1#2:1", 20.0)]
    assert {r.session for r in requests} == {"s1", "s2", "s1#1", "s2#1", "s1#2", "s2#2"}
    keyer = BlockKeyer()
    keys = {r.request_id: keyer.keys(r) for r in requests}
    assert keys["s1#1:1"][:2] == keys["s1#1:0"]   # a copy's turns share their prefix
    assert keys["s1#1:0"][0] != keys["s1:0"][0]   # but not with the other users' sessions
    # One copy is the file as it is.
    assert [r.request_id for r in read_trace(tmp_path, "kvtester", copies=1)] == [
        "s1:0", "s2:0", "s1:1"]


@pytest.mark.parametrize("options, message", [
    ({"copies": 0}, "--session-copies: must be an integer of at least 1"),
    ({"copies": 2, "copy_interval_s": -1.0}, "--copy-interval: must be a non-negative"),
    ({"copies": 2, "copy_interval_s": float("nan")}, "--copy-interval: must be a non-negative"),
    ({"copy_interval_s": 600.0}, "--copy-interval needs --session-copies of 2 or more"),
])
def test_kvtester_copies_refuse_bad_values_at_once(tmp_path, options, message):
    (tmp_path / "s1.json").write_text(json.dumps(session(64, [kv_request(0.0, 130, 5, [1])])))
    with pytest.raises(ConfigError, match=message):
        read_trace(tmp_path, "kvtester", **options)  # not only once iterated


def test_only_kvtester_traces_have_sessions_to_copy(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake_line(0, 1200, 10, [0, 1, 2])])
    with pytest.raises(ConfigError, match="kvtester traces only"):
        read_trace(path, "mooncake", copies=2)


def test_a_session_named_like_a_copy_is_refused_when_copying(tmp_path):
    (tmp_path / "s1#1.json").write_text(json.dumps(session(64, [
        kv_request(0.0, 130, 5, [1, 2])])))
    assert len(list(read_trace(tmp_path, "kvtester"))) == 1
    with pytest.raises(InputError, match="has a '#'"):
        list(read_trace(tmp_path, "kvtester", copies=2))


def test_kvtester_errors_name_the_request(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps(session(64, [kv_request(5.0, 130, 1, [1, 2]),
                                            kv_request(1.0, 130, 1, [1, 2])])))
    with pytest.raises(InputError, match="backwards") as info:
        list(read_trace(path, "kvtester"))
    assert (info.value.where, info.value.field) == (f"{path}:requests[1]", "t")
    with pytest.raises(InputError, match="block-size mismatch"):
        list(read_trace(path, "kvtester", block_size=32))


def test_azure_rows_get_prefixes_and_relative_arrivals(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.5000000,400,10\n"
                    "2023-11-16 18:17:04.2500000,300,0\n")
    requests = list(read_trace(path, "azure", prefixes={"prefixes": 1, "prefix_tokens": 200}))
    assert [r.arrival_s for r in requests] == pytest.approx([0.0, 0.75])
    assert [r.input_tokens for r in requests] == [400, 300]
    assert requests[1].output_tokens == 1
    keyer = BlockKeyer()
    first, second = (keyer.keys(r) for r in requests)
    assert first[:12] == second[:12]  # one family: 200 shared tokens = 12 full blocks


def test_azure_bad_row_names_line_and_column(tmp_path):
    path = tmp_path / "a.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                    "2023-11-16 18:17:03.5,400,10\n"
                    "2023-11-16 18:17:04.5,,10\n")
    with pytest.raises(InputError, match="missing field") as info:
        list(read_trace(path, "azure"))
    assert (info.value.where, info.value.field) == (f"{path}:3", "ContextTokens")


@pytest.mark.skipif(not (DATA / "mooncake").exists(), reason="shared traces not present")
def test_the_real_mooncake_and_kvtester_traces_read_cleanly():
    from itertools import islice
    assert len(list(islice(read_trace(DATA / "mooncake" / "conversation_trace.jsonl",
                                      "mooncake"), 500))) == 500
    sessions = list(read_trace(DATA / "kv_cache_tester", "kvtester"))
    assert len(sessions) == 1277
    assert len({r.session for r in sessions}) == 28
