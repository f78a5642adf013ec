"""Child processes (replicas, gateways, real engines) that never outlive the process that
started them.

Every server the project starts for a demo, a test or a benchmark goes through :func:`spawn`:

* its own session (``setsid``), so :func:`stop` can signal the child and everything it started
  (vLLM's engine-core process, for one) as one process group, by the id ``Popen`` returned;
* a parent-death signal (Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)``, set in the child between
  fork and exec and kept across exec): when the parent dies in any way, SIGKILL included, the
  kernel sends the child SIGTERM, and the child shuts down as on Ctrl-C, taking its own
  children with it. A parent killed with SIGKILL runs no cleanup code of its own, so without
  this its servers keep their ports and memory until someone finds them.

SIGTERM rather than SIGKILL, because the child's own cleanup is what reaches *its* children
(a process group is not signalled when its leader dies). The cost: a child acts on it only
when its main thread next runs Python; a vLLM server still starting (its main thread waiting
on the engine's compilation) shuts down, with its engine, once startup ends, minutes later on
a loaded machine. :func:`stop` signals the whole group and has no such delay. The kernel sends the signal when the
*thread* that forked dies, not the process, so a child started from a short-lived thread (a
test starting two engines at once) would be killed when that thread ended: every child is
therefore forked by one long-lived thread of this process, whichever thread asks. A
set-user-ID program drops the setting on exec; on systems without ``prctl`` the children only
get their own session.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Callable, Sequence

STOP_TIMEOUT_S = 10.0
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
DEATH_SIGNAL = signal.SIGTERM

# Loaded here, not in the child: between fork and exec only async-signal-safe work is sound,
# and loading a library is not.
_prctl = None
if sys.platform.startswith("linux"):
    with contextlib.suppress(OSError, AttributeError):
        _prctl = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True).prctl


class _DieWithParent:
    """The ``preexec_fn``: ask for :data:`DEATH_SIGNAL` when the parent dies, and leave at once
    if it already did (it may die between fork and the ``prctl`` call: then the child has been
    re-parented and ``getppid`` no longer names it)."""

    def __init__(self) -> None:
        self.parent = os.getpid()

    def __call__(self) -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(DEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != self.parent:
            os._exit(1)


class _Forker:
    """One daemon thread that runs every ``Popen`` of this process (see the module docstring);
    a forked copy of the process gets its own thread on first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()

    def call(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        with self._lock:
            if self._owner != os.getpid():
                self._owner = os.getpid()
                self._jobs = queue.SimpleQueue()
                threading.Thread(target=self._run, args=(self._jobs,), name="child-forker",
                                 daemon=True).start()
            jobs = self._jobs
        done: Future = Future()
        jobs.put((fn, done))
        return done.result()

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            fn, done = jobs.get()
            try:
                done.set_result(fn())
            except BaseException as exc:  # handed to the caller's thread
                done.set_exception(exc)


_FORKER = _Forker()


def spawn(command: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(command, **popen_kwargs)`` in a new session, dying with its parent."""
    if "preexec_fn" in popen_kwargs or "start_new_session" in popen_kwargs:
        raise ValueError("spawn sets preexec_fn and start_new_session itself")
    argv = list(command)
    return _FORKER.call(lambda: subprocess.Popen(argv, start_new_session=True,
                                                 preexec_fn=_DieWithParent(), **popen_kwargs))


def stop(process: subprocess.Popen | None, sig: int = signal.SIGTERM,
         timeout: float = STOP_TIMEOUT_S) -> int | None:
    """Signal a child started by :func:`spawn` and its process group with ``sig``, wait up to
    ``timeout`` seconds for the child to exit, then SIGKILL whatever is left of the group;
    returns the exit code (None: never started). Idempotent.

    Only the group whose id is the child's pid is signalled, and only while the child is not
    yet reaped: until then the kernel cannot give that id to anyone else, so nothing this
    process did not start is ever signalled. The final SIGKILL sweeps members that outlive
    the leader (a group is not signalled when its leader dies)."""
    if process is None:
        return None
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)
        if _wait_unreaped(process, timeout):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
    return process.wait(timeout=timeout)


def _wait_unreaped(process: subprocess.Popen, timeout: float) -> bool:
    """Wait up to ``timeout`` s for the child to exit without reaping it (``WNOWAIT``); False
    when it was reaped elsewhere (its id may then name someone else's group)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
                return True
        except ChildProcessError:
            return False
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
