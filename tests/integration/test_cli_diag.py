"""The ``diff`` and ``lint`` commands as a user runs them: real processes, files on disk,
JSON with stable keys, and bad input as one line on stderr with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import prompt_fixtures as fixtures
from tests.helpers.tiny_tokenizer import TOOLS_CHAT_TEMPLATE, copy_with_template


def prefixroute(*args: str | Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", *map(str, args)],
                          capture_output=True, text=True, timeout=120)


def write_json(path: Path, value) -> Path:
    path.write_text(json.dumps(value))
    return path


def write_log(path: Path, bodies: list[dict]) -> Path:
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return path


def assert_bad_input(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


@pytest.fixture(scope="module")
def tools_tokenizer_dir(tiny_tokenizer_dir, tmp_path_factory):
    return copy_with_template(tiny_tokenizer_dir, tmp_path_factory.mktemp("tools"),
                              TOOLS_CHAT_TEMPLATE)


# -- diff ----------------------------------------------------------------------------------


def test_diff_of_token_ids_needs_no_tokenizer(tmp_path):
    a = write_json(tmp_path / "a.json", list(range(1, 41)))
    b = write_json(tmp_path / "b.json", list(range(1, 21)) + [999] + list(range(22, 41)))
    result = prefixroute("diff", a, b, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["first_divergence_token"], out["first_divergence_block"]) == (20, 1)
    assert (out["reusable_blocks"], out["reusable_tokens"], out["total_tokens"]) == (1, 16, 40)


def test_diff_of_identical_text_reports_a_null_divergence(tiny_tokenizer_dir, tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("You are a helpful assistant. " * 20)
    result = prefixroute("diff", a, a, "--tokenizer", tiny_tokenizer_dir, "--json")
    out = json.loads(result.stdout)
    assert out["first_divergence_token"] is None
    assert out["reusable_tokens"] == out["total_tokens"] // 16 * 16


def test_diff_names_the_timestamp_that_breaks_a_chat_prompt(tiny_tokenizer_dir, tmp_path):
    first, second = fixtures.timestamp_on_top(2)
    a = write_json(tmp_path / "a.json", first)  # full chat bodies
    b = write_json(tmp_path / "b.json", second["messages"])  # a bare message list
    result = prefixroute("diff", a, b, "--tokenizer", tiny_tokenizer_dir, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert (out["format_a"], out["format_b"]) == ("chat", "chat")
    assert out["change"] == "timestamp"
    assert out["reusable_tokens"] == out["first_divergence_block"] * 16
    assert out["verdict"].startswith(f"a timestamp at token {out['first_divergence_token']} "
                                     "invalidates")


def test_diff_human_output_gives_the_verdict_and_the_context(tiny_tokenizer_dir, tmp_path):
    first, second = fixtures.timestamp_on_top(2)
    a = write_json(tmp_path / "a.json", first)
    b = write_json(tmp_path / "b.json", second)
    result = prefixroute("diff", a, b, "--tokenizer", tiny_tokenizer_dir, "--block-size", "32")
    assert result.returncode == 0, result.stderr
    assert "a timestamp at token" in result.stdout
    assert "block size" in result.stdout and "32" in result.stdout


def test_diff_of_text_without_a_tokenizer_asks_for_one(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("hello")
    assert_bad_input(prefixroute("diff", a, a), "a.txt", "--tokenizer")


def test_diff_of_a_missing_file_is_bad_input(tmp_path):
    assert_bad_input(prefixroute("diff", tmp_path / "nope.txt", tmp_path / "nope.txt"),
                     "nope.txt", "not found")


def test_diff_with_a_forced_format_that_does_not_fit_is_bad_input(tmp_path):
    a = tmp_path / "a.txt"
    a.write_text("plain words")
    assert_bad_input(prefixroute("diff", a, a, "--format", "ids"), "a.txt")


def test_diff_with_a_missing_tokenizer_directory_is_bad_input(tmp_path):
    a = write_json(tmp_path / "a.json", [1, 2, 3])
    assert_bad_input(prefixroute("diff", a, a, "--tokenizer", tmp_path / "none"),
                     "tokenizer directory not found")


# -- lint ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fixture_log(tmp_path_factory) -> Path:
    bodies = (fixtures.timestamp_on_top() + fixtures.shuffled_tools() + fixtures.rewritten_turns()
              + fixtures.shuffled_examples() + fixtures.clean())
    return write_log(tmp_path_factory.mktemp("log") / "requests.jsonl", bodies)


def test_lint_json_reports_each_tenants_finding_and_both_hit_rates(tools_tokenizer_dir,
                                                                  fixture_log):
    result = prefixroute("lint", fixture_log, "--tokenizer", tools_tokenizer_dir, "--json")
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["requests"] == 60
    found = {t["tenant"]: {f["kind"] for f in t["findings"]} for t in out["tenants"]}
    assert found == {"acme": {"timestamp"}, "globex": {"reordered tool list"},
                     "initech": {"rewritten earlier turn"},
                     "umbrella": {"shuffled few-shot examples"}, "hooli": set()}
    assert out["token_hit_rate_after"] > out["token_hit_rate_now"]
    example = next(t for t in out["tenants"] if t["tenant"] == "acme")["findings"][0]
    assert example["example_where"] == f"{fixture_log}:2"


def test_lint_human_report_lists_tenants_findings_and_fixes(tools_tokenizer_dir, fixture_log):
    result = prefixroute("lint", fixture_log, "--tokenizer", tools_tokenizer_dir)
    assert result.returncode == 0, result.stderr
    for text in ("acme", "globex", "timestamp", "reordered tool list", "fix:", "token hit rate now"):
        assert text in result.stdout


def test_lint_of_an_unreadable_line_names_the_line(tiny_tokenizer_dir, tmp_path):
    log = tmp_path / "log.jsonl"
    log.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": \n')
    assert_bad_input(prefixroute("lint", log, "--tokenizer", tiny_tokenizer_dir),
                     f"{log}:3", "not valid JSON")


def test_lint_of_a_mixed_log_names_the_first_odd_line(tiny_tokenizer_dir, tmp_path):
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "a"}, {"messages": [
        {"role": "user", "content": "b"}]}])
    assert_bad_input(prefixroute("lint", log, "--tokenizer", tiny_tokenizer_dir),
                     f"{log}:2", "mixed formats")


def test_lint_without_a_tokenizer_names_the_first_text_request(tmp_path):
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "a"}])
    assert_bad_input(prefixroute("lint", log), f"{log}:1", "--tokenizer")


def test_lint_with_a_missing_tokenizer_is_bad_input(tmp_path):
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "a"}])
    assert_bad_input(prefixroute("lint", log, "--tokenizer", tmp_path / "none"),
                     "tokenizer directory not found")


def test_lint_of_a_missing_log_is_bad_input(tmp_path):
    assert_bad_input(prefixroute("lint", tmp_path / "none.jsonl"), "none.jsonl", "not found")


def test_lint_of_a_body_with_a_wrong_field_names_line_and_field(tiny_tokenizer_dir, tmp_path):
    log = write_log(tmp_path / "log.jsonl", [{"prompt": "a"}, {"prompt": "b", "tenant": 7}])
    assert_bad_input(prefixroute("lint", log, "--tokenizer", tiny_tokenizer_dir),
                     f"{log}:2", "'tenant'")
