"""setuptools' build backend, asking for mypy (whose mypyc compiles the simulator's hot path,
setup.py) only when a wheel is built: an editable install needs nothing beyond setuptools."""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (every other hook as setuptools has it)

MYPY = "mypy==2.4.1"


def get_requires_for_build_wheel(config_settings=None):
    compile_ = os.environ.get("PREFIXROUTE_COMPILE", "1") != "0"
    return _setuptools.get_requires_for_build_wheel(config_settings) + ([MYPY] if compile_ else [])
