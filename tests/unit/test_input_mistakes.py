"""Likely mistakes that do not stop a command are named: a chat message without ``content``,
and cache breakpoints beyond every prompt of a trace."""

from __future__ import annotations

import json
import subprocess
import sys

from prefixroute.core.diagnostics.prompts import parse_body


def test_a_system_message_without_content_is_noted_with_the_misspelt_key():
    request = parse_body({"messages": [{"role": "system", "contnet": "Be brief."},
                                       {"role": "user", "content": "hi"}]}, "log:3")
    assert request.messages[0]["content"] == ""
    assert request.notes == ("log:3: messages[0] (system) has no content; rendered as an empty "
                             "message (is 'contnet' a misspelt 'content'?)",)


def test_an_assistant_turn_that_only_calls_tools_needs_no_content():
    request = parse_body({"messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                              "function": {"name": "w", "arguments": "{}"}}]},
    ]}, "log:1")
    assert request.notes == ()


def test_economics_warns_when_a_breakpoint_lies_beyond_every_prompt(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"arrival_s": t, "output_tokens": 1,
                                         "token_ids": list(range(100))}) + "\n"
                             for t in range(3)))
    result = subprocess.run([sys.executable, "-m", "prefixroute", "economics", "--trace",
                             str(trace), "--breakpoints", "2048,end", "--json"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("--breakpoints 2048: every prompt of the trace is shorter (the longest has 100 "
            "tokens)") in result.stderr
    quiet = subprocess.run([sys.executable, "-m", "prefixroute", "economics", "--trace",
                            str(trace), "--breakpoints", "64,end", "--json"],
                           capture_output=True, text=True, timeout=120)
    assert "warning" not in quiet.stderr
