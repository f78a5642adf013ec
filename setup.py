"""Build: the simulator's hot path compiled to C with mypyc, for wheels and ``pip install .``.

The same typed Python source is compiled (mypyc is mypy's compiler); nothing is written twice
and every result is the same to the last digit (a slow test builds the wheel and compares).
Per request the routing policy scores every replica, so a million requests over 32 replicas
are 32 million evaluations, and the replica engines step through every batch: compiled, the
simulation runs 1.8x as fast (docs/performance.md, Simulator speed).

* ``pip install -e .`` (development) stays pure Python, so an edited module is what runs; a
  compiled module would shadow its source until the next install.
* ``pip install .`` and ``pip wheel .`` compile: they need a C compiler and Python's headers.
  Without them (the build warns), or with ``PREFIXROUTE_COMPILE=0``, the package installs as
  pure Python, which behaves the same, slower. It is all or nothing: a module that fails to
  compile drops every compiled module, since they call each other directly.

A compiled function refuses an argument of the wrong type with a ``TypeError`` before its
body runs, where Python would carry on to the function's own check. So a compiled module
types the parameters it validates as ``object`` and narrows them in its checks (the engine's
and the block pool's sizes and options): a wrong value still gets its ``ConfigError``. The
request records and the trace readers stay interpreted.
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

# The routing policy's per-replica work, the views it reads, the lifecycle runner, the
# replica engines and their block pools, and the simulator's loop.
COMPILED = [
    "src/prefixroute/core/caches/paged_pool.py",
    "src/prefixroute/core/replica/engine.py",
    "src/prefixroute/core/routing/base.py",
    "src/prefixroute/core/routing/lifecycle.py",
    "src/prefixroute/core/routing/scores.py",
    "src/prefixroute/core/routing/views.py",
    "src/prefixroute/core/routing/policies/prefixroute/balance.py",
    "src/prefixroute/core/routing/policies/prefixroute/costs.py",
    "src/prefixroute/core/routing/policies/prefixroute/load.py",
    "src/prefixroute/core/routing/policies/prefixroute/mirror.py",
    "src/prefixroute/core/routing/policies/prefixroute/policy.py",
    "src/prefixroute/core/routing/policies/prefixroute/queue.py",
    "src/prefixroute/core/routing/policies/prefixroute/speed.py",
    "src/prefixroute/core/simulator/keys.py",
    "src/prefixroute/core/simulator/simulation.py",
    "src/prefixroute/core/simulator/streaming.py",
]

# Commands that build a wheel or extensions; an editable install and the metadata steps run
# others, and need no compiler.
_BUILDS = {"bdist_wheel", "build", "build_ext"}


def _warn(why: str) -> None:
    print(f"warning: prefixroute builds as pure Python (slower, same results): {why}",
          file=sys.stderr)


def _ext_modules() -> list:
    if os.environ.get("PREFIXROUTE_COMPILE", "1") == "0" or not _BUILDS & set(sys.argv[1:]):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError:
        _warn("mypyc (from mypy) is not installed")
        return []
    # An in-tree build directory keeps earlier builds' modules; one no longer listed here
    # would still ship in the wheel and shadow its source.
    for stale in glob.glob("build/lib*/**/*.so", recursive=True):
        os.remove(stale)
    # (Modules they import are read for their types, not checked: they stay interpreted.)
    return mypycify(["--follow-imports=silent", *COMPILED], opt_level="3",
                    group_name="prefixroute")


class OptionalBuildExt(build_ext):
    """Compiled modules are an optimisation: if any fails to build, none is installed."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError, OSError) as exc:
            for ext in self.extensions:
                path = self.get_ext_fullpath(ext.name)
                if os.path.exists(path):
                    os.remove(path)
            self.extensions = []
            _warn(f"compiling failed ({exc})")


setup(ext_modules=_ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
