"""`prefixroute generate` then `prefixroute simulate --stream`, as a user runs them."""

import json
import subprocess
import sys


def prefixroute(*args):
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=600)


def test_generated_trace_replays_streamed_and_held_alike(tmp_path):
    trace = tmp_path / "trace.jsonl"
    result = prefixroute("generate", "mooncake-sessions:rate=20", "--requests", "300",
                         "--seed", "5", "-o", str(trace))
    assert result.returncode == 0, result.stderr
    lines = trace.read_text().splitlines()
    assert len(lines) == 300
    assert set(json.loads(lines[0])) == {"timestamp", "input_length", "output_length",
                                         "hash_ids"}
    again = tmp_path / "again.jsonl"
    prefixroute("generate", "mooncake-sessions:rate=20", "--requests", "300", "--seed", "5",
                "-o", str(again))
    assert again.read_bytes() == trace.read_bytes()

    common = ["--trace", str(trace), "--trace-format", "mooncake", "--policy", "round_robin",
              "--replicas", "4", "--no-progress", "--json", "-"]
    streamed = prefixroute("simulate", *common, "--stream")
    held = prefixroute("simulate", *common)
    assert streamed.returncode == 0 and held.returncode == 0, streamed.stderr + held.stderr
    s = json.loads(streamed.stdout)["policies"]["round_robin"]
    h = json.loads(held.stdout)["policies"]["round_robin"]
    assert s["requests"] == 300
    assert {k: h[k] for k in s} == s


def test_generate_bad_parameter_writes_nothing(tmp_path):
    out = tmp_path / "t.jsonl"
    result = prefixroute("generate", "mooncake-sessions:rate=-1", "--requests", "10",
                         "-o", str(out))
    assert result.returncode == 2
    assert "rate must be positive" in result.stderr
    assert not out.exists() and list(tmp_path.iterdir()) == []
