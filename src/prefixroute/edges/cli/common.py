"""Helpers shared by subcommands: JSON output, atomic file writes, argument types.

One ``--json [FILE]`` convention for every command (:func:`add_json_argument`): ``--json`` or
``--json -`` prints to standard output, ``--json FILE`` writes FILE (whose directory must
exist). Files are written through a temporary file in the same directory and renamed, with
the permissions the process's umask gives a new file (``-rw-r--r--`` under umask 022).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

from prefixroute.core.errors import ConfigError


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


STDOUT = "-"


def add_json_argument(parser: argparse.ArgumentParser, what: str = "the report") -> None:
    """``--json [FILE]``: no value or ``-`` is standard output, else a file to write."""
    parser.add_argument("--json", nargs="?", const=STDOUT, default=None, metavar="FILE",
                        help=f"{what} as JSON: to FILE, or to standard output with no FILE "
                             f"or '-'")


def take_positional_from_json(args: argparse.Namespace, *names: str) -> None:
    """Keep ``cmd --json INPUT...`` meaning what it meant when ``--json`` took no value.

    The positionals ``names`` are declared optional (``nargs="?"``) so that argparse accepts
    the line; when the last of them is missing, the value ``--json`` swallowed is the first
    input and the others shift right. A positional still missing afterwards is a usage error.
    """
    values = [getattr(args, name) for name in names]
    if values[-1] is None and args.json not in (None, STDOUT):
        values = [args.json, *values[:-1]]
        args.json = STDOUT
        for name, value in zip(names, values):
            setattr(args, name, value)
    missing = [name.upper() for name, value in zip(names, values) if value is None]
    if missing:
        raise ConfigError(f"missing argument{'s' if len(missing) > 1 else ''} "
                          f"{' '.join(missing)}")


def check_json_destination(path: str | None, flag: str = "--json") -> None:
    """Refuse, before any work, a JSON destination that cannot be written: a directory, or a
    file whose directory does not exist (it is not created: a typo in a path should not leave
    directories behind)."""
    if path is None or path == STDOUT:
        return
    if os.path.isdir(path):
        raise ConfigError(f"{flag}: {path} is a directory")
    parent = Path(path).parent
    if not parent.is_dir():
        raise ConfigError(f"{flag}: directory {str(parent)!r} does not exist (create it first)")


def emit_json(obj: Any, destination: str | None) -> str | None:
    """Print ``obj`` (destination ``-``) or write it to a file; the written path, if any."""
    if destination is None or destination == STDOUT:
        print_json(obj)
        return None
    try:
        write_atomic(destination, json.dumps(obj, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"cannot write {destination}: {exc.strerror or exc}") from None
    return destination


def write_atomic(path: str | os.PathLike, data: str | bytes, *, make_parents: bool = False) -> None:
    """Write ``data`` to ``path`` through a temporary file, so a failure leaves nothing
    half-written. The file gets mode 0o666 less the umask, as ``open()`` would give it
    (``mkstemp`` would make it private, 0o600, which surprises whoever shares the results).
    The directory must exist unless ``make_parents`` (for output directories such as
    ``--plot DIR``)."""
    path = Path(path)
    if make_parents:
        path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
    tmp = path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(payload)
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
