"""Child processes started through ``prefixroute.edges.children`` end with their parent, even a
parent killed with SIGKILL, and only when it ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from prefixroute.edges import children

BOUND_S = 30.0  # the kernel signals at once; the margin is for a loaded machine


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_dead(pid: int, bound: float = BOUND_S) -> bool:
    deadline = time.monotonic() + bound
    while alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_child_dies_with_a_parent_killed_by_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import sys, time
        from prefixroute.edges import children
        child = children.spawn(["sleep", "600"])
        print(child.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.kill()
        parent.wait()
        assert wait_dead(child), "the child outlived its SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_a_child_started_from_a_short_lived_thread_outlives_the_thread():
    # The kernel's parent-death signal follows the forking thread: spawn forks from one
    # long-lived thread, so a helper thread that ends does not take the child with it.
    started: list[subprocess.Popen] = []
    thread = threading.Thread(target=lambda: started.append(children.spawn(["sleep", "600"])))
    thread.start()
    thread.join()
    try:
        time.sleep(0.5)
        assert started[0].poll() is None
    finally:
        children.stop(started[0], timeout=BOUND_S)
    assert started[0].returncode == -signal.SIGTERM


def test_stop_ends_the_whole_group_the_child_started():
    leader = children.spawn([sys.executable, "-c", textwrap.dedent("""
        import signal, subprocess, time
        signal.signal(signal.SIGTERM, lambda *a: None)  # a leader that ignores SIGTERM
        grandchild = subprocess.Popen(["sleep", "600"])
        print(grandchild.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True)
    grandchild = int(leader.stdout.readline())
    leader.stdout.close()
    assert children.stop(leader, timeout=1.0) == -signal.SIGKILL
    assert wait_dead(grandchild)
    assert os.getpgid(os.getpid()) != leader.pid  # the group was the child's, never ours
