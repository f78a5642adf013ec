"""``prefixroute economics`` end to end, as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", "economics", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def default_output() -> str:
    result = run()
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def default_json() -> dict:
    result = run("--json")
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_prints_the_three_break_even_lines(default_output):
    assert "5m_1.25x (5m TTL, write 1.25x, read 0.1x): 21.7%" in default_output
    assert "1h_2x (1h TTL, write 2.0x, read 0.1x): 52.6%" in default_output
    assert "5m_1.0x (5m TTL, write 1.0x, read 0.1x, no write premium): 0.0%" in default_output


@pytest.mark.parametrize("rate, cells", [
    ("1", ["8% x1.16", "63% x0.80", "8% x0.93"]),
    ("6", ["39% x0.80", "100% x0.10", "39% x0.65"]),
    ("12", ["63% x0.52", "100% x0.10", "63% x0.43"]),
    ("60", ["99% x0.11", "100% x0.10", "99% x0.11"]),
    ("600", ["100% x0.10", "100% x0.10", "100% x0.10"]),
])
def test_prints_the_requests_per_hour_table(default_output, rate, cells):
    rows = [line.strip("│┃ ").split("│") for line in default_output.splitlines() if "│" in line]
    row = next([cell.strip() for cell in r] for r in rows if r[0].strip() == rate)
    assert row[1:] == cells


def test_prints_the_worked_example(default_output):
    assert "200 prefixes x 10,000 tokens, 50,000 requests/day (10.4 per hour per prefix)" in default_output
    assert "no caching: $1,500/day" in default_output
    assert "5m_1.25x: 58% hit, $874/day" in default_output
    assert "1h_2x: 100% hit, $150/day" in default_output
    assert "5m_1.0x: 58% hit, $717/day" in default_output


def test_json_break_even_is_a_fraction_per_policy(default_json):
    assert {k: round(v, 3) for k, v in default_json["break_even"].items()} == {
        "5m_1.25x": 0.217, "1h_2x": 0.526, "5m_1.0x": 0.0}


def test_json_rates_rows_hold_p_hit_and_multiplier_per_policy(default_json):
    assert [row["requests_per_hour"] for row in default_json["rates"]] == [1, 6, 12, 60, 600]
    first = default_json["rates"][0]
    assert round(first["1h_2x"]["p_hit"], 2) == 0.63
    assert round(first["5m_1.25x"]["multiplier"], 2) == 1.16


def test_json_worked_example(default_json):
    worked = default_json["worked_example"]
    assert round(worked["no_caching_usd_per_day"]) == 1500
    assert round(worked["5m_1.25x"]["usd_per_day"]) == 874
    assert round(worked["1h_2x"]["usd_per_day"]) == 150
    assert round(worked["5m_1.0x"]["usd_per_day"]) == 717
    assert round(worked["5m_1.0x"]["p_hit"], 2) == 0.58


def test_json_on_defaults_is_what_repro_returns(default_json):
    from prefixroute.core.economics.repro import repro_economics

    assert default_json == json.loads(json.dumps(repro_economics()))


def test_custom_policy_is_added_as_a_column():
    result = run("--json", "--ttl", "10m", "--write", "1.5", "--rates", "12")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    # 12/hour with a 10-minute TTL: lambda*T = 2, P(hit) = 1 - e^-2 = 0.865
    assert round(report["rates"][0]["10m_1.5x"]["p_hit"], 3) == 0.865
    assert round(report["break_even"]["10m_1.5x"], 3) == round(0.5 / 1.4, 3)


def test_price_changes_the_worked_example():
    result = run("--json", "--price-per-mtok", "6")
    assert round(json.loads(result.stdout)["worked_example"]["no_caching_usd_per_day"]) == 3000


def test_advise_prints_the_cheapest_option_per_rate():
    result = run("--advise", "--rates", "1")
    assert result.returncode == 0, result.stderr
    assert "1 requests/hour: 1h_2x+prewarm" in result.stdout


@pytest.mark.parametrize("args, message", [
    (["--rates=-1"], "--rates: request rate (per hour) must be non-negative"),
    (["--price-per-mtok", "-3"], "--price-per-mtok: price per million input tokens must be non-negative"),
    (["--write", "1.25", "--read", "2"], "read multiplier 2 is above write multiplier 1.25"),
    (["--ttl", "5x"], "--ttl: unknown TTL unit 'x'"),
], ids=["negative rate", "negative price", "read above write", "unknown TTL unit"])
def test_bad_input_gives_one_clear_line_and_exit_code_2(args, message):
    result = run(*args)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("prefixroute economics: error: ")
    assert message in lines[0]
    assert "Traceback" not in result.stderr
