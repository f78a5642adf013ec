"""The examples a newcomer copies run from a fresh clone: every command of docs/trace-format.md's
"Try it from a fresh clone" block, on the bundled sample traces, which are what
examples/traces/make_samples.py writes."""

from __future__ import annotations

import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fresh_clone_commands() -> list[list[str]]:
    text = (ROOT / "docs" / "trace-format.md").read_text()
    block = text.split("## Try it from a fresh clone", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.splitlines() if line.startswith("prefixroute ")]


@pytest.mark.slow
def test_the_fresh_clone_examples_run(tmp_path):
    commands = fresh_clone_commands()
    assert len(commands) >= 3
    for command in commands:
        args = [str(tmp_path / "plots") if a == "plots/" else a for a in command[1:]]
        if args[0] == "sweep":
            args += ["--jobs", "1"]
        result = subprocess.run([sys.executable, "-m", "prefixroute", *args], cwd=ROOT,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, (command, result.stderr)
        assert "warning" not in result.stderr, (command, result.stderr)


def test_the_sample_traces_are_what_the_script_writes(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "make_samples", ROOT / "examples" / "traces" / "make_samples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.write_native(tmp_path / "s.jsonl") == 240
    assert module.write_mooncake(tmp_path / "m.jsonl") == 430
    assert (tmp_path / "s.jsonl").read_text() == \
        (ROOT / "examples" / "traces" / "sample.jsonl").read_text()
    assert (tmp_path / "m.jsonl").read_text() == \
        (ROOT / "examples" / "traces" / "mooncake_sample.jsonl").read_text()
