"""``prefixroute plan`` and ``prefixroute economics --trace`` end to end, as a user runs them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "plan.yaml"

SMALL = ["--tenants", "12", "--prefix-tokens", "1024", "--replicas", "4", "--kv-memory-gib",
         "0.5", "--sim-requests", "200", "--accounting-requests", "100",
         "--policy", "round_robin", "--policy", "hybrid:max_skew=8", "--no-progress"]


def prefixroute(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def plan_json() -> dict:
    result = prefixroute("plan", "--json", *SMALL)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_json_has_the_stable_top_level_keys(plan_json):
    assert list(plan_json) == ["inputs", "summary", "layout", "keys_and_salts", "metrics",
                               "routing", "ttl", "kv_memory", "provider_accounting",
                               "cost_per_day"]


def test_plan_json_sections_carry_their_key_figures(plan_json):
    assert plan_json["inputs"]["replicas"] == 4
    assert plan_json["routing"]["chosen"] in {"round_robin", "hybrid:max_skew=8"}
    assert {"token_hit_rate", "ttft_p99_s", "max_mean_load"} <= set(
        plan_json["routing"]["policies"][0])
    assert {"timestamp_at_top_token_hit_rate", "fixed_token_hit_rate"} <= set(
        plan_json["layout"]["timestamp_measured"])
    assert {"bf16", "fp8"} == set(plan_json["kv_memory"]["by_dtype"])
    assert {"hot"} <= set(plan_json["ttl"]["classes"])
    assert {"self_hosted", "provider", "total_usd_per_day"} <= set(plan_json["cost_per_day"])
    assert "vllm:prefix_cache_hits_total" in plan_json["metrics"]["token_hit_rate"]["engine"]


@pytest.mark.slow
def test_plan_out_writes_the_report_and_plots(tmp_path):
    out = tmp_path / "plan"
    result = prefixroute("plan", "--out", str(out), *SMALL)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == ["costs.png", "kv_memory.png", "plan.json", "plan.md", "prefix_rates.png",
                     "routing.png"]
    assert (out / "routing.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = (out / "plan.md").read_text()
    assert report.startswith("# Fleet plan")
    for heading in ("## 1. Prompt layout", "## 2. Keys and salts", "## 3. Metrics",
                    "## 4. Routing policy", "## 5. TTL per prefix class", "## 6. KV memory",
                    "## 7. Provider traffic", "## 8. Cost per day"):
        assert heading in report
    assert "![routing](routing.png)" in report
    # The summary on stdout reads as the report's does: no Python dicts.
    ttl_line, = [line for line in result.stdout.splitlines() if line.startswith("ttl: ")]
    assert "{" not in ttl_line and "hot: " in ttl_line


def test_a_malformed_plan_file_names_the_file_line_and_field_and_writes_nothing(tmp_path):
    config = tmp_path / "plan.yaml"
    config.write_text("scenario:\n  tenants: 200\nfleet:\n  replicas: many\n")
    out = tmp_path / "out"
    result = prefixroute("plan", "--config", str(config), "--out", str(out))
    assert result.returncode == 2
    assert f"{config}:4" in result.stderr
    assert "fleet.replicas" in result.stderr
    assert "Traceback" not in result.stderr
    assert not out.exists()


def test_invalid_yaml_syntax_names_the_line(tmp_path):
    config = tmp_path / "plan.yaml"
    config.write_text("scenario:\n  tenants: 200\n  prefix_tokens: [10000\n")
    result = prefixroute("plan", "--config", str(config))
    assert result.returncode == 2
    assert f"{config}:" in result.stderr and "not valid YAML" in result.stderr


def test_an_unknown_key_in_the_plan_file_is_refused(tmp_path):
    config = tmp_path / "plan.yaml"
    config.write_text("provider:\n  shares: 0.5\n")
    result = prefixroute("plan", "--config", str(config))
    assert result.returncode == 2
    assert f"{config}:2" in result.stderr and "provider.shares" in result.stderr


def test_the_example_plan_file_is_valid():
    from prefixroute.core.economics.planner import PlanInputs
    from prefixroute.edges.cli.plan import load_config, make_inputs

    values, where = load_config(str(EXAMPLE))
    assert make_inputs(values, where) == PlanInputs()


# --- economics --trace ----------------------------------------------------------------------------


@pytest.fixture
def small_trace(tmp_path):
    """The hand-checked example: one 2,048-token prompt at 0, 200 and 600 s."""
    path = tmp_path / "trace.jsonl"
    tokens = list(range(1, 2049))
    lines = [json.dumps({"prefixroute_trace": 1, "block_size": 16})]
    for t in (0, 200, 600):
        lines.append(json.dumps({"request_id": f"r{t}", "arrival_s": t, "output_tokens": 8,
                                 "token_ids": tokens, "prefix_group": "doc"}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_economics_trace_bills_write_read_write(small_trace):
    result = prefixroute("economics", "--trace", str(small_trace), "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"break_even", "rates", "worked_example", "trace"} <= set(report)
    five = report["trace"]["policies"]["5m_1.25x"]
    group = five["groups"]["doc"]
    assert (group["written_tokens"], group["read_tokens"], group["uncached_tokens"]) == (
        4096, 2048, 0)
    assert group["poisson"]["p_hit"] == pytest.approx(0.77687, abs=1e-5)
    one_hour = report["trace"]["policies"]["1h_2x"]["groups"]["doc"]
    assert (one_hour["written_tokens"], one_hour["read_tokens"]) == (2048, 4096)


def test_economics_trace_prints_the_accounting_beside_the_usual_report(small_trace):
    result = prefixroute("economics", "--trace", str(small_trace))
    assert result.returncode == 0, result.stderr
    assert "Worked example" in result.stdout  # the existing report is still there
    assert "Trace accounting" in result.stdout and "doc" in result.stdout


def test_economics_trace_with_breakpoints(small_trace):
    result = prefixroute("economics", "--trace", str(small_trace), "--breakpoints", "1024",
                         "--json")
    assert result.returncode == 0, result.stderr
    group = json.loads(result.stdout)["trace"]["policies"]["5m_1.25x"]["groups"]["doc"]
    # The only breakpoint at token 1,024: the rest of each prompt is uncached.
    assert (group["written_tokens"], group["read_tokens"], group["uncached_tokens"]) == (
        2048, 1024, 3072)


@pytest.mark.parametrize("args, message", [
    (["--breakpoints", "end"], "--breakpoints needs --trace"),
    (["--breakpoints", "1,2,3,4,5"], "at most 4"),
    (["--min-cacheable-tokens", "lots"], "--min-cacheable-tokens"),
    # A trace does not say where its static region ends: 'static' would place nothing.
    (["--breakpoints", "static,end"], "give the token position instead"),
])
def test_economics_trace_bad_flags_exit_2(small_trace, args, message):
    extra = [] if args[0] == "--breakpoints" and args[1] == "end" else ["--trace",
                                                                       str(small_trace)]
    result = prefixroute("economics", *extra, *args)
    assert result.returncode == 2
    assert message in result.stderr


def test_economics_trace_bad_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"arrival_s": 0, "output_tokens": 1, "token_ids": [1, 2]}\n'
                    '{"arrival_s": 1, "token_ids": [1, 2]}\n')
    result = prefixroute("economics", "--trace", str(path))
    assert result.returncode == 2
    assert f"{path}:2" in result.stderr and "output_tokens" in result.stderr
