"""The ``prefixroute`` command: one subcommand per module in this package.

Each subcommand module exposes ``register(subparsers)``, which adds its parser and sets
``handler=function(args) -> int``. Errors the core raises on purpose (:class:`PrefixRouteError`)
and bad usage become one clear line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from prefixroute import __version__
from prefixroute.core.errors import PrefixRouteError

# Module names under prefixroute.edges.cli, in the order ``--help`` lists them.
SUBCOMMAND_MODULES = [
    "repro",
    "hash_cmd",
    "simulate",
    "sweep",
    "generate",
    "economics",
    "plan",
    "diff",
    "lint",
    "tokenizer",
    "replica",
    "calibrate",
    "serve",
    "epp",
    "envoy_config",
    "doctor",
    "demo",
]

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own exit code is already 2
        self.print_usage(sys.stderr)
        self.exit(EXIT_BAD_INPUT, f"prefixroute: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="prefixroute", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"prefixroute {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(f"prefixroute.edges.cli.{name}")
        except ModuleNotFoundError as exc:
            if exc.name == f"prefixroute.edges.cli.{name}":
                continue  # subcommand not built yet
            raise
        module.register(subparsers)
    for subparser in subparsers.choices.values():
        # Errors found after the subcommand was chosen show the subcommand's usage.
        subparser.set_defaults(command_parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        owner = getattr(args, "command_parser", None) or parser
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        return int(args.handler(args) or 0)
    except PrefixRouteError as exc:
        print(f"prefixroute {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (``| head``); not an error of ours, and nothing left to say.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
