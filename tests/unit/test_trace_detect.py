"""Trace formats are detected from the first record, a format that contradicts the file is
warned about, and a field no reader knows is named with the closest known one."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from prefixroute.core.errors import InputError
from prefixroute.edges.traces import detect_format, read_jsonl
from prefixroute.edges.traces.common import unknown_field_checker

MOONCAKE = '{"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]}\n'


@pytest.mark.parametrize("name, text, fmt", [
    ("m.jsonl", MOONCAKE, "mooncake"),
    ("n.jsonl", '{"arrival_s": 0, "output_tokens": 1, "token_ids": [1]}\n', "jsonl"),
    ("h.jsonl", '\n{"prefixroute_trace": 1, "block_size": 16}\n', "jsonl"),
    ("a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.68,374,44\n", "azure"),
    ("s.json", '{"block_size": 64,\n "requests": [{"t": 0, "in": 64, "out": 1, '
               '"hash_ids": [1]}]}\n', "kvtester"),
])
def test_the_format_is_read_from_the_first_record(tmp_path, name, text, fmt):
    path = tmp_path / name
    path.write_text(text)
    assert detect_format(path) == fmt


def test_a_directory_is_kvtester_and_an_unknown_record_names_the_flag(tmp_path):
    assert detect_format(tmp_path) == "kvtester"
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"when": 1}\n')
    with pytest.raises(InputError, match="--trace-format"):
        detect_format(odd)


def test_an_unknown_field_is_reported_once_with_the_closest_known_name(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "output_tokens": 1, "token_ids": [1, 2],
                                         "tenat": "acme"}) + "\n" for t in range(3)))
    requests = list(read_jsonl(trace))
    assert len(requests) == 3 and requests[0].tenant == ""
    assert capsys.readouterr().err == (f"prefixroute: warning: {trace}:1: unknown field 'tenat' "
                                       f"ignored; did you mean 'tenant'?\n")


def test_a_name_far_from_every_known_one_gets_no_suggestion():
    messages: list[str] = []
    check = unknown_field_checker({"tenant", "session"}, messages.append)
    check({"colour": 1, "tenant": "a"}, "f:1")
    check({"colour": 2}, "f:2")
    assert messages == ["f:1: unknown field 'colour' ignored"]


def test_economics_reads_a_mooncake_file_without_a_format_flag(tmp_path):
    trace = tmp_path / "m.jsonl"
    trace.write_text(MOONCAKE + MOONCAKE.replace('"timestamp": 0', '"timestamp": 1000'))
    result = subprocess.run([sys.executable, "-m", "prefixroute", "economics", "--trace",
                             str(trace), "--json"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["trace"]["format"] == "mooncake"
    assert "as format mooncake (detected" in result.stderr


def test_a_format_flag_that_contradicts_the_file_is_warned_about(tmp_path):
    trace = tmp_path / "m.jsonl"
    trace.write_text(MOONCAKE)
    result = subprocess.run([sys.executable, "-m", "prefixroute", "economics", "--trace",
                             str(trace), "--trace-format", "jsonl"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert "looks like format mooncake, not jsonl" in result.stderr
    assert "try --trace-format mooncake" in result.stderr
