"""``prefixroute demo`` as a user runs it: replicas and a gateway start, the design scenario
goes through over HTTP once per policy, the JSON has the documented keys and the counts add
up, and every child process is gone afterwards, also after Ctrl-C or SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEMO_POLICIES = ("prefixroute", "round_robin", "sglang_cache_aware")


def demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixroute", "demo", *args],
                          capture_output=True, text=True, timeout=timeout)


def children_of(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (read from /proc)."""
    found = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # pid (comm) state ppid ...: comm may hold spaces, so split after its closing paren
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
def test_demo_json_has_every_policy_and_the_counts_add_up():
    result = demo("--requests", "40", "--replicas", "2", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["scenario"]["requests"] == 40
    assert report["scenario"]["replicas"] == 2
    assert list(report["policies"]) == list(DEMO_POLICIES)
    for name, row in report["policies"].items():
        for key in ("token_hit_rate", "ttft_p50_s", "ttft_p99_s", "requests_ok",
                    "requests_failed", "replica_load"):
            assert key in row, (name, key)
        assert row["requests_ok"] + row["requests_failed"] == 40, name
        assert row["requests_ok"] == 40, (name, row["errors"])
        assert len(row["replica_load"]) == 2
        # Every answered request was served by exactly one replica.
        assert sum(r["requests"] for r in row["replica_load"]) == row["requests_ok"], name
        assert 0 < row["token_hit_rate"] < 1
        assert 0 < row["ttft_p50_s"] <= row["ttft_p99_s"]


def test_an_unknown_policy_is_one_clear_line_and_exit_2():
    result = demo("--policy", "no_such_policy", timeout=30)
    assert result.returncode == 2
    assert "no_such_policy" in result.stderr
    assert "Traceback" not in result.stderr


# Bounds for a loaded two-core machine: three Python servers start (about 5 s when idle)
# and shut down after a signal (about 2 s); the margins only catch a hang.
START_BOUND_S = 120.0
STOP_BOUND_S = 120.0


def start_demo_with_children() -> tuple[subprocess.Popen, set[int]]:
    # A shell starts background jobs with Ctrl-C ignored, and the demo would inherit that from
    # a test run started so: give it the terminal's default, as a user's demo has.
    process = subprocess.Popen([sys.executable, "-m", "prefixroute", "demo", "--requests",
                                "400", "--replicas", "2", "--policy", "round_robin"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    children: set[int] = set()
    deadline = time.monotonic() + START_BOUND_S
    while len(children) < 3 and time.monotonic() < deadline:  # 2 replicas + gateway
        if process.poll() is not None:
            break
        children |= children_of(process.pid)
        time.sleep(0.2)
    return process, children


def wait_all_gone(pids: set[int], bound: float) -> list[int]:
    deadline = time.monotonic() + bound
    while True:
        left = [pid for pid in pids if alive(pid)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@pytest.mark.slow
@pytest.mark.parametrize("signum, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)],
                         ids=["ctrl-c", "sigterm"])
def test_an_interrupt_stops_every_child_process(signum, code):
    process, children = start_demo_with_children()
    try:
        assert len(children) >= 3, "replicas and gateway did not start"
        time.sleep(1.0)  # some requests in flight
        process.send_signal(signum)
        assert process.wait(timeout=STOP_BOUND_S) == code
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert not wait_all_gone(children, 5.0), "child processes left running"


@pytest.mark.slow
def test_children_die_with_a_demo_killed_by_sigkill():
    # SIGKILL runs no cleanup in the demo: its children end because they asked the kernel
    # for a signal on their parent's death (prefixroute.edges.children).
    process, children = start_demo_with_children()
    try:
        assert len(children) >= 3, "replicas and gateway did not start"
        time.sleep(1.0)
        process.kill()
        process.wait()
        left = wait_all_gone(children, 30.0)
    finally:
        for pid in children:  # our own grandchildren: leave nothing behind if the test fails
            if alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
    assert not left, f"children outlived the killed demo: {left}"
