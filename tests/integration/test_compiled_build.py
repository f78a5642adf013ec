"""The compiled build (a wheel: the simulator's hot path compiled by mypyc, setup.py) decides
exactly as the Python source does."""

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args, env=None, cwd=None):
    result = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                            timeout=600, env=env, cwd=cwd)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
@pytest.mark.timeout(900)  # (a C build, then twelve simulations)
def test_the_compiled_wheel_simulates_exactly_as_the_source(tmp_path):
    # Built as a user's `pip install .` builds it: mypy and setuptools in an isolated env.
    run("-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "dist"),
        str(ROOT))
    (wheel,) = (tmp_path / "dist").glob("prefixroute-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    compiled = {**os.environ, "PYTHONPATH": str(site)}
    where = run("-c", "import prefixroute.core.routing.policies.prefixroute.policy as m, "
                "prefixroute.core.simulator.streaming as s; print(m.__file__, s.__file__)",
                env=compiled, cwd=tmp_path).stdout.split()
    assert all(path.startswith(str(site)) and path.endswith(".so") for path in where), where

    trace = tmp_path / "trace.jsonl"
    run("-m", "prefixroute", "generate", "mooncake-sessions:rate=40", "--requests", "3000",
        "--seed", "3", "-o", str(trace))
    reports = {}
    for build, env in (("source", None), ("compiled", compiled)):
        for mode in ("stream", "whole"):
            out = tmp_path / f"{build}-{mode}.json"
            run("-m", "prefixroute", "simulate", "--trace", str(trace), "--trace-format",
                "mooncake", *(["--stream"] if mode == "stream" else []), "--replicas", "8",
                "--policy", "prefixroute", "--policy", "prefixroute:view=events",
                "--policy", "prefixroute:priority_slack=0", "--scheduling-policy", "priority",
                "--no-progress", "--json", str(out), env=env, cwd=tmp_path)
            reports[build, mode] = json.loads(out.read_text())
    for mode in ("stream", "whole"):
        assert reports["compiled", mode] == reports["source", mode]
    summary = reports["source", "stream"]["policies"]["prefixroute"]
    assert summary["completed"] == 3000 and summary["token_hit_rate"] > 0.5
