"""Reading a gateway's recording back: arrival order, trust groups as separate block
namespaces, the live figures, and bad files refused with file:line and the field."""

import json

import pytest

from prefixroute.core.errors import InputError
from prefixroute.core.simulator.keys import BlockKeyer
from prefixroute.edges.traces import detect_format, read_trace
from prefixroute.edges.traces.recording import Recording

HEADER = {"prefixroute_recording": 1, "block_size": 4, "policy": "prefixroute",
          "replicas": 2, "cache_blocks": 100}


def line(timestamp, ids=(1, 2), group="tg-a", cached=4, ttft=10.0, **extra):
    record = {"timestamp": timestamp, "input_length": 4 * len(ids) + 1, "output_length": 3,
              "hash_ids": list(ids), "trust_group": group, "model": "m",
              "live_replica": "r0", "live_prompt_tokens": 4 * len(ids) + 1,
              "live_cached_tokens": cached, "live_ttft_ms": ttft, "live_latency_ms": 50.0,
              "status": "200", "attempts": 1}
    record.update(extra)
    return record


def write(path, *records, header=HEADER):
    rows = ([header] if header is not None else []) + list(records)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_recording_is_detected_as_a_file_and_as_a_directory(tmp_path):
    write(tmp_path / "a.jsonl", line(1000.0))
    assert detect_format(tmp_path / "a.jsonl") == "recording"
    assert detect_format(tmp_path) == "recording"


def test_requests_replay_in_arrival_order_from_the_first_arrival(tmp_path):
    # Lines are written as requests end: the second line arrived first. Two files (two
    # gateways) merge by arrival.
    write(tmp_path / "a.jsonl", line(1_000_500.0), line(1_000_000.0, ttft=30.0))
    write(tmp_path / "b.jsonl", line(1_000_250.0, ttft=20.0))
    recording = Recording(tmp_path)
    assert [r.arrival_s for r in recording] == [0.0, 0.25, 0.5]
    assert [o.ttft_s for o in recording.live] == [0.03, 0.02, 0.01]
    assert (recording.policy, recording.replicas, recording.cache_blocks) == (
        "prefixroute", 2, 100)


def test_each_trust_group_is_its_own_block_namespace(tmp_path):
    write(tmp_path / "a.jsonl", line(0.0, group="tg-a"), line(1.0, group="tg-b"),
          line(2.0, group="tg-a"))
    a1, b, a2 = list(read_trace(tmp_path / "a.jsonl", "recording"))
    keyer = BlockKeyer()
    for request in (a1, b, a2):
        keyer.fill(request)
    assert a1.block_keys == a2.block_keys
    assert not set(a1.block_keys) & set(b.block_keys)


def test_the_live_summary_counts_reported_requests_and_scales_times(tmp_path):
    # Hit rate over the requests with a report: (4 + 8) / (9 + 9) cached of prompt tokens;
    # the one without a report (cached null, a 502) is counted but not in the rate.
    write(tmp_path / "a.jsonl", line(0.0, cached=4, ttft=10.0), line(1.0, cached=8, ttft=30.0),
          line(2.0, cached=None, ttft=None, status="502"))
    recording = Recording(tmp_path / "a.jsonl")
    list(recording)
    live = recording.live_summary(time_scale=2.0)
    assert live["token_hit_rate"] == pytest.approx(12 / 18)
    assert (live["requests"], live["requests_reported"]) == (3, 2)
    assert live["statuses"] == {"200": 2, "502": 1}
    assert live["ttft_p50_s"] == pytest.approx(0.04)  # (10 + 30) / 2 ms, times 2
    assert recording.live_summary(count=1)["token_hit_rate"] == pytest.approx(4 / 9)


def test_an_unfinished_last_line_is_left_out_with_a_warning(tmp_path, capsys):
    path = write(tmp_path / "a.jsonl", line(0.0), line(1.0))
    path.write_text(path.read_text() + '{"timestamp": 2.0, "input_len')
    assert len(list(Recording(path))) == 2
    assert "a.jsonl:4: an unfinished last line left out" in capsys.readouterr().err


@pytest.mark.parametrize("record, where, field", [
    (line(0.0, ids=(1, 2, 3, 4)) | {"input_length": 5}, 2, "hash_ids"),
    ({k: v for k, v in line(0.0).items() if k != "trust_group"}, 2, "trust_group"),
    (line(0.0, cached="lots"), 2, "live_cached_tokens"),
    (line(0.0, ids=(1, -2)), 2, "hash_ids"),
    (line(-5.0), 2, "timestamp"),
])
def test_a_bad_line_names_the_file_line_and_field(tmp_path, record, where, field):
    path = write(tmp_path / "a.jsonl", record)
    with pytest.raises(InputError) as info:
        list(Recording(path))
    assert info.value.where == f"{path}:{where}"
    assert info.value.field == field


def test_a_file_without_its_header_or_with_another_block_size_is_refused(tmp_path):
    path = write(tmp_path / "a.jsonl", line(0.0), header=None)
    with pytest.raises(InputError) as info:
        Recording(path)
    assert (info.value.where, info.value.field) == (f"{path}:1", "prefixroute_recording")
    write(tmp_path / "a.jsonl", line(0.0))
    write(tmp_path / "b.jsonl", line(0.0), header=HEADER | {"block_size": 16})
    with pytest.raises(InputError) as info:
        Recording(tmp_path)
    assert (info.value.where, info.value.field) == (f"{tmp_path / 'b.jsonl'}:1", "block_size")
    with pytest.raises(InputError) as info:
        Recording(tmp_path / "a.jsonl", block_size=16)
    assert info.value.field == "block_size"
