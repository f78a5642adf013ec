"""Record and replay as a user runs them: ``prefixroute demo --record`` routes the design
scenario through a real gateway to emulator replicas and records it; ``prefixroute simulate
--trace`` replays the recording through the live policy at the live fleet size, and its token
hit rate matches the live one. Bad recordings and bad ``record`` settings are one clear line
naming file, line and field, exit code 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.integration.test_gateway_cli import SECRET_ENV, cli, config_file

POLICY = "prefixroute"
OTHER = "round_robin"  # load only: on this traffic it reuses less
REPLICAS = 2
REQUESTS = 200
DEMO_TIME_SCALE = 0.5  # the demo's default: engines run twice as fast as real time
# The bar: the replay of the live policy within 2 points of the live token hit rate.
MAX_GAP_POINTS = 2.0


def prefixroute(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.mark.slow
def test_the_replay_of_the_live_policy_matches_the_live_hit_rate(tmp_path):
    # Two live runs, one per policy; each recording is replayed through both policies. The
    # replay of the policy that ran live must land within 2 points of the live hit rate,
    # and the other policy's counterfactual must differ by more (or the comparison would
    # not tell policies apart on this traffic).
    record = tmp_path / "recordings"
    demo = prefixroute("demo", "--requests", str(REQUESTS), "--replicas", str(REPLICAS),
                       "--policy", POLICY, "--policy", OTHER, "--record", str(record),
                       "--json", timeout=480)
    assert demo.returncode == 0, demo.stderr
    figures = []
    for live_policy, other in ((POLICY, OTHER), (OTHER, POLICY)):
        shown = json.loads(demo.stdout)["policies"][live_policy]
        assert shown["requests_ok"] == REQUESTS, shown["errors"]
        recording = shown["recording"]
        assert os.path.isdir(recording)
        replay = prefixroute("simulate", "--trace", recording, "--policy", live_policy,
                             "--policy", other, "--time-scale", f"{1 / DEMO_TIME_SCALE:g}",
                             "--json", "-", "--no-progress", timeout=300)
        assert replay.returncode == 0, replay.stderr
        report = json.loads(replay.stdout)
        live = report["live"]
        replayed = report["policies"][live_policy]
        counterfactual = report["policies"][other]
        figures.append(f"live {live_policy}: hit rate {live['token_hit_rate']:.4f} (clients "
                       f"saw {shown['token_hit_rate']:.4f}), replay "
                       f"{replayed['token_hit_rate']:.4f}, {other} "
                       f"{counterfactual['token_hit_rate']:.4f}; TTFT p50 live "
                       f"{live['ttft_p50_s']:.3f} s, replay {replayed['ttft_p50_s']:.3f} s")
        # The recording is the whole run, as the live fleet saw it.
        assert live["requests"] == live["requests_reported"] == REQUESTS
        assert (live["policy"], live["replicas"]) == (live_policy, REPLICAS)
        assert report["fleet"]["replicas"] == REPLICAS  # the live fleet size by default
        assert report["workload"]["requests"] == REQUESTS
        # The gateway's record of cached tokens is what the clients were told (the demo
        # rounds to 4 places).
        assert live["token_hit_rate"] == pytest.approx(shown["token_hit_rate"], abs=5e-5)
        gap = abs(replayed["token_hit_rate"] - live["token_hit_rate"]) * 100.0
        assert gap <= MAX_GAP_POINTS, figures[-1]
        assert replayed["vs_live"]["token_hit_rate_points"] == pytest.approx(
            (replayed["token_hit_rate"] - live["token_hit_rate"]) * 100.0, abs=0.01)
        assert abs(counterfactual["vs_live"]["token_hit_rate_points"]) > MAX_GAP_POINTS, \
            figures[-1]
    print("\n".join(figures))


def test_a_malformed_recording_is_exit_2_naming_file_line_and_field(tmp_path):
    path = tmp_path / "rec.jsonl"
    path.write_text(
        json.dumps({"prefixroute_recording": 1, "block_size": 16, "policy": "prefixroute",
                    "replicas": 2, "cache_blocks": None}) + "\n"
        + json.dumps({"timestamp": 1000.0, "input_length": 40, "output_length": 5,
                      "hash_ids": [1, 2], "trust_group": "tg-1"}) + "\n"
        + json.dumps({"timestamp": 1001.0, "input_length": 40, "output_length": 5,
                      "hash_ids": [1, 2, 3, 4, 5], "trust_group": "tg-1"}) + "\n")
    result = prefixroute("simulate", "--trace", str(path), "--policy", POLICY, timeout=60)
    assert result.returncode == 2
    assert f"{path}:3: block-size mismatch" in result.stderr
    assert "(field 'hash_ids')" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_bad_record_setting_is_exit_2_naming_file_line_and_field(tmp_path):
    path = config_file(tmp_path, "record:\n  path: rec\n  keep: 0\n")
    result = cli("serve", "--config", str(path), "--check", env=SECRET_ENV)
    assert result.returncode == 2
    assert f"{path}:10: must be at least 1" in result.stderr
    assert "'record.keep'" in result.stderr
    assert "Traceback" not in result.stderr


def test_check_shows_the_record_settings(tmp_path):
    path = config_file(tmp_path, "record:\n  path: rec\n  rotate_mb: 50\n")
    result = cli("serve", "--config", str(path), "--check", env=SECRET_ENV)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["record"] == {
        "path": str(tmp_path / "rec"), "rotate_mb": 50.0, "keep": 10, "queue": 10000}


def test_an_unwritable_record_directory_stops_serve_with_exit_2(tmp_path):
    (tmp_path / "a-file").write_text("")
    path = config_file(tmp_path, f"record:\n  path: {tmp_path / 'a-file' / 'rec'}\n")
    result = cli("serve", "--config", str(path), "--port", "0", env=SECRET_ENV)
    assert result.returncode == 2
    assert f"{path}: record.path: cannot write to" in result.stderr
    assert "Traceback" not in result.stderr
