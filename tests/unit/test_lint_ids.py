"""Bare hexadecimal request ids (a 12-digit trace id at the top of a system prompt) are volatile
values like UUIDs, and the lint finds them; words and plain numbers are not read as ids."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest

from prefixroute.core.diagnostics.lint import lint_requests
from prefixroute.core.diagnostics.prompts import parse_body
from prefixroute.core.diagnostics.volatile import COUNTER, REQUEST_ID, TIMESTAMP, find_volatile_spans
from tests.unit.test_lint import CharEncoder

SYSTEM = "You are a support assistant for Acme.\nAnswer briefly and cite the manual.\n"


def hex_ids(count: int) -> list[str]:
    rng = random.Random(1)
    return ["%012x" % rng.getrandbits(48) for _ in range(count)]


def chat_requests(first_lines: list[str]):
    return [parse_body({"tenant": "acme", "messages": [
        {"role": "system", "content": f"{line}\n{SYSTEM}"},
        {"role": "user", "content": f"question {n}"}]}, f"log:{n}")
        for n, line in enumerate(first_lines, 1)]


@pytest.mark.parametrize("text", ["91b72265b1f5", "a3f9c2e1", "0f1e2d3c4b5a6f7"])
def test_a_bare_hex_id_of_8_to_15_digits_is_a_request_id(text):
    assert [(s.kind, s.text) for s in find_volatile_spans(f"id {text} here")] == \
        [(REQUEST_ID, text)]


@pytest.mark.parametrize("text, kinds", [("deadbeefcafe", []), ("123456789012", [COUNTER]),
                                         ("abc123", []), ("1a2b3c4", [])])
def test_hex_words_need_a_digit_a_letter_and_eight_digits(text, kinds):
    # A word of hex letters, a plain number (a counter) and ids shorter than 8 are not ids.
    assert [s.kind for s in find_volatile_spans(text)] == kinds


def test_a_hex_request_id_at_the_top_of_the_system_prompt_is_a_finding():
    report = lint_requests(chat_requests(hex_ids(6)), CharEncoder())
    tenant = report.tenants[0]
    assert [f.kind for f in tenant.findings] == [REQUEST_ID]
    assert tenant.static_region_units >= 2
    assert report.token_hit_rate_after > report.token_hit_rate_now == 0.0


def test_a_timestamp_and_a_hex_id_on_one_line_are_both_found():
    lines = [f"Now: 2026-11-{10 + n}T10:0{n}:00Z request {rid}"
             for n, rid in enumerate(hex_ids(6))]
    report = lint_requests(chat_requests(lines), CharEncoder())
    assert {f.kind for f in report.tenants[0].findings} == {TIMESTAMP, REQUEST_ID}


def test_the_cli_does_not_say_nothing_was_found_when_no_static_region_was(tmp_path):
    # Prompts that differ from the first character by something unrecognised (a word).
    log = tmp_path / "log.jsonl"
    words = ["apple", "pear", "plum", "fig"]
    log.write_text("".join(
        '{"tenant": "acme", "prompt": [%s]}\n' % ", ".join(
            str(ord(c)) for c in f"{w} {SYSTEM}") for w in words))
    result = subprocess.run([sys.executable, "-m", "prefixroute", "lint", str(log)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "no volatile content found" not in result.stdout
    assert "no static region was found" in result.stdout
