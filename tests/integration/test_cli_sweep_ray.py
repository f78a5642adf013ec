"""`prefixroute sweep --ray` on a local Ray, and `--resume`, as a user runs them."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("ray")

# Starting Ray's node takes minutes on a loaded 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

GRID = ["--workload", "seed-fleet:requests=40", "--replicas", "2,4", "--cache-blocks", "200,400",
        "--policy", "round_robin", "--no-progress"]


def prefixroute(*args):
    # A loaded test machine can take minutes to start Ray's node (its default wait is 60 s).
    env = {**os.environ, "RAY_raylet_start_wait_time_s": "300"}
    return subprocess.run([sys.executable, "-m", "prefixroute", *args], capture_output=True,
                          text=True, timeout=900, env=env)


def test_ray_sweep_gives_the_same_json_as_worker_processes(tmp_path):
    with_ray, with_jobs = tmp_path / "ray.json", tmp_path / "jobs.json"
    result = prefixroute("sweep", *GRID, "--ray", "--json", str(with_ray))
    assert result.returncode == 0, result.stderr
    result = prefixroute("sweep", *GRID, "--jobs", "2", "--json", str(with_jobs))
    assert result.returncode == 0, result.stderr
    assert with_ray.read_text() == with_jobs.read_text()
    assert len(json.loads(with_ray.read_text())["results"]) == 4


def test_resume_skips_points_already_done(tmp_path):
    done = tmp_path / "done"
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert prefixroute("sweep", *GRID, "--jobs", "1", "--resume", str(done), "--json",
                       str(first)).returncode == 0
    files = sorted(done.iterdir())
    assert len(files) == 4
    # A point on disk is taken as it is: change one and the resumed sweep reports the change.
    kept = json.loads(files[0].read_text())
    kept["summary"]["evictions"] = -1
    files[0].write_text(json.dumps(kept))
    assert prefixroute("sweep", *GRID, "--ray", "--resume", str(done), "--json",
                       str(second)).returncode == 0
    rows = json.loads(second.read_text())["results"]
    assert [r["evictions"] for r in rows].count(-1) == 1
    assert len(rows) == 4
