"""Helpers shared by subcommands: JSON output, atomic file writes, argument types."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from prefixroute.core.errors import ConfigError


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def write_atomic(path: str | os.PathLike, data: str | bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, so a failure leaves nothing half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, mode) as fh:
            fh.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0 or value != value:
        raise argparse.ArgumentTypeError(f"must be a non-negative number, got {text}")
    return value


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


# Where stdout is a pipe or a file, rich would wrap tables at 80 columns and cut cells short
# ("reques…"); a wide fixed width keeps whole rows for whoever reads the file.
PIPE_WIDTH = 220


def stdout_console(**kwargs: Any):
    """A rich console on stdout: the terminal's width, or :data:`PIPE_WIDTH` columns when
    stdout is not a terminal."""
    from rich.console import Console

    kwargs.setdefault("highlight", False)
    return Console(width=None if sys.stdout.isatty() else PIPE_WIDTH, **kwargs)
