"""`prefixroute simulate` and `prefixroute sweep` as a user runs them."""

import json
import subprocess
import sys

import pytest


def prefixroute(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd)


@pytest.mark.slow
def test_simulate_seed_fleet_writes_the_json_report(tmp_path):
    out = tmp_path / "report.json"
    plots = tmp_path / "plots"
    result = prefixroute("simulate", "--workload", "seed-fleet:requests=100", "--policy",
                         "round_robin", "--policy", "hybrid:max_skew=1", "--json", str(out),
                         "--plot", str(plots))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["workload"]["requests"] == 100
    assert 0.9 < report["ideal_token_hit_rate"] < 1
    policies = report["policies"]
    assert list(policies) == ["round_robin", "hybrid:max_skew=1"]
    for summary in policies.values():
        assert 0 < summary["token_hit_rate"] <= report["ideal_token_hit_rate"]
        assert summary["ttft_p50_s"] <= summary["ttft_p90_s"] <= summary["ttft_p99_s"]
        assert sum(summary["assignments"]) == 100
        assert {"request_hit_rate", "reused_prefix_tokens", "max_assignment_skew",
                "evictions"} <= set(summary)
    assert sorted(p.name for p in plots.iterdir()) == ["hit_rates.png", "load_over_time.png",
                                                       "ttft_cdf.png"]
    assert "round_robin" in result.stdout and "token hit" in result.stdout
    # Piped, the table keeps whole cells rather than rich's 80 columns.
    assert "lost vs ideal" in result.stdout and "…" not in result.stdout


def test_simulate_json_to_stdout():
    result = prefixroute("simulate", "--workload", "universal-prefix", "--policy",
                         "round_robin", "--json", "-")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["policies"]["round_robin"]["assignments"] == [10, 10, 10, 10, 10]


def test_bad_trace_line_exits_2_naming_file_line_and_field_and_writes_nothing(tmp_path):
    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, '
                     '"hash_ids": [1, 2]}\n{"timestamp": 5, "output_length": 1, '
                     '"hash_ids": [1]}\n')
    out = tmp_path / "report.json"
    result = prefixroute("simulate", "--trace", str(trace), "--trace-format", "mooncake",
                         "--json", str(out))
    assert result.returncode == 2
    assert f"{trace}:2" in result.stderr and "input_length" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_unknown_policy_parameter_exits_2():
    result = prefixroute("simulate", "--workload", "seed-fleet:requests=5", "--policy",
                         "hybrid:max_skw=1")
    assert result.returncode == 2
    assert "max_skw" in result.stderr and "Traceback" not in result.stderr


def test_zero_replicas_exits_2_rather_than_taking_the_default():
    result = prefixroute("simulate", "--workload", "seed-fleet:requests=5", "--replicas", "0")
    assert result.returncode == 2
    assert "--replicas: must be at least 1, got 0" in result.stderr


def write_session(path, turns):
    path.write_text(json.dumps({"block_size": 64, "hash_id_scope": "local", "requests": [
        {"t": t, "in": n, "out": 5, "hash_ids": list(range(1, n // 64 + 1))}
        for t, n in turns]}))


def test_simulate_replays_kvtester_sessions_as_more_users(tmp_path):
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    write_session(sessions / "a.json", [(0.0, 640), (30.0, 1280)])
    write_session(sessions / "b.json", [(10.0, 640)])
    reports = {}
    for copies in ("1", "3"):
        out = tmp_path / f"copies{copies}.json"
        spacing = ["--copy-interval", "100"] if copies != "1" else []
        result = prefixroute("simulate", "--trace", str(sessions), "--trace-format",
                             "kvtester", "--session-copies", copies, *spacing,
                             "--replicas", "2", "--policy", "prefixroute", "--json", str(out))
        assert result.returncode == 0, result.stderr
        reports[copies] = json.loads(out.read_text())
    one, three = reports["1"], reports["3"]
    assert (one["workload"]["requests"], three["workload"]["requests"]) == (3, 9)
    # Each user's session is its own: the ideal hit rate is the one session's (a's second
    # turn reuses its first 640 tokens: 640 / (640 + 1280 + 640)), not more.
    assert one["ideal_token_hit_rate"] == three["ideal_token_hit_rate"] == 0.25


@pytest.mark.parametrize("args, message", [
    (["--session-copies", "0"], "--session-copies: must be an integer of at least 1, got 0"),
    (["--session-copies", "2", "--copy-interval", "-5"],
     "--copy-interval: must be a non-negative number"),
    (["--copy-interval", "600"], "--copy-interval needs --session-copies of 2 or more"),
    (["--trace-format", "mooncake", "--session-copies", "2"], "kvtester traces only"),
])
def test_bad_session_copies_exit_2(tmp_path, args, message):
    write_session(tmp_path / "a.json", [(0.0, 640)])
    if "mooncake" in args:
        trace = tmp_path / "m.jsonl"
        trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, '
                         '"hash_ids": [1, 2]}\n')
        args = ["--trace", str(trace), *args]
    else:
        args = ["--trace", str(tmp_path), "--trace-format", "kvtester", *args]
    result = prefixroute("simulate", *args, "--policy", "round_robin")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_closed_loop_sends_each_turn_after_the_previous_reply(tmp_path):
    # Recorded at the same instant, both turns arrive at 0 and are done within a second;
    # closed loop, the second is sent 2 s (its think time) after the first one's reply.
    sessions = tmp_path / "sessions"
    sessions.mkdir()
    (sessions / "a.json").write_text(json.dumps({"block_size": 64, "requests": [
        {"t": 0.0, "in": 640, "out": 5, "hash_ids": list(range(1, 11))},
        {"t": 0.0, "in": 1280, "out": 5, "hash_ids": list(range(1, 21)), "think_time": 2.0}]}))
    makespans = {}
    for flags in ([], ["--closed-loop"]):
        out = tmp_path / f"run{len(flags)}.json"
        result = prefixroute("simulate", "--trace", str(sessions), "--trace-format",
                             "kvtester", *flags, "--replicas", "1", "--policy", "prefixroute",
                             "--json", str(out))
        assert result.returncode == 0, result.stderr
        report = json.loads(out.read_text())
        makespans[bool(flags)] = report["policies"]["prefixroute"]["makespan_s"]
    assert report["workload"]["closed_loop"] is True
    assert report["workload"]["max_think_s"] == 60.0
    assert makespans[False] < 1.0 < 2.0 < makespans[True] < 3.0


@pytest.mark.parametrize("args, message", [
    (["--max-think", "30"], "--max-think needs --closed-loop"),
    (["--max-think", "60"], "--max-think needs --closed-loop"),
    (["--closed-loop", "--max-think", "-1"], "--max-think: must be a non-negative number"),
])
def test_bad_closed_loop_flags_exit_2(tmp_path, args, message):
    write_session(tmp_path / "a.json", [(0.0, 640), (5.0, 1280)])
    result = prefixroute("simulate", "--trace", str(tmp_path), "--trace-format", "kvtester",
                         *args, "--policy", "round_robin")
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_closed_loop_needs_sessions(tmp_path):
    trace = tmp_path / "m.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 600, "output_length": 1, '
                     '"hash_ids": [1, 2]}\n')
    result = prefixroute("simulate", "--trace", str(trace), "--trace-format", "mooncake",
                         "--closed-loop", "--policy", "round_robin")
    assert result.returncode == 2
    assert "--closed-loop: the workload has no session with two turns" in result.stderr


def test_session_copies_need_a_trace():
    result = prefixroute("simulate", "--workload", "seed-fleet:requests=5", "--session-copies",
                         "2")
    assert result.returncode == 2
    assert "--session-copies needs --trace" in result.stderr


def test_sweep_runs_a_grid_across_processes(tmp_path):
    out = tmp_path / "sweep.json"
    result = prefixroute("sweep", "--workload", "seed-fleet:requests=40", "--replicas", "2,4",
                         "--cache-blocks", "200,400", "--policy", "hybrid:max_skew=0|2",
                         "--jobs", "2", "--json", str(out), "--plot", str(tmp_path))
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert len(report["results"]) == 2 * 2 * 2
    assert report["grid"]["policies"] == ["hybrid:max_skew=0", "hybrid:max_skew=2"]
    assert (tmp_path / "sweep.png").stat().st_size > 0


def test_kv_memory_and_model_config_size_the_cache():
    # Llama-3-8B: 128 KiB of KV per token; 1 GiB = 8,192 tokens = 512 blocks of 16.
    result = prefixroute("simulate", "--workload", "seed-fleet:requests=10", "--policy",
                         "round_robin", "--kv-memory-gib", "1", "--model-config", "llama-3-8b",
                         "--json", "-")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["fleet"]["cache_blocks"] == 512
