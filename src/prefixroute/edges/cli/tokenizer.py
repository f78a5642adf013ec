"""``prefixroute tokenizer``: make an offline tokenizer directory, or check one.

``prefixroute tokenizer --tiny DIR`` trains a small byte-level BPE tokenizer (a few seconds,
no network, no torch) and writes ``tokenizer.json`` and ``tokenizer_config.json`` into DIR, for
trying ``diff``, ``lint`` and ``hash --tokenizer`` on a machine without a model. Its token
counts are not a real model's: for real prompts point ``--tokenizer`` at the directory of the
model you serve (the one with ``tokenizer.json``, e.g. a Hugging Face snapshot).

``prefixroute tokenizer DIR`` loads a directory as those commands will, and says what it found.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from prefixroute.core.errors import ConfigError


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tokenizer", help="make a small offline tokenizer (--tiny DIR) or check a directory",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("directory", metavar="DIR", help="tokenizer directory")
    parser.add_argument("--tiny", action="store_true",
                        help="write the small offline tokenizer into DIR (created if missing)")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    directory = Path(args.directory)
    if args.tiny:
        if directory.exists() and not directory.is_dir():
            raise ConfigError(f"{directory} exists and is not a directory")
        if (directory / "tokenizer.json").exists():
            raise ConfigError(f"{directory / 'tokenizer.json'} exists; choose an empty directory")
        from prefixroute.edges.tiny_tokenizer import make_tiny_tokenizer
        try:  # the directory first: an unwritable place fails before the training
            directory.mkdir(parents=True, exist_ok=True)
            make_tiny_tokenizer(directory)
        except OSError as exc:
            raise ConfigError(f"--tiny: cannot write {directory}: {exc.strerror or exc}") from None
    elif not directory.is_dir():
        raise ConfigError(f"{directory}: no such directory (make one with 'prefixroute tokenizer "
                          f"--tiny {directory}')")
    from prefixroute.edges.tokenization import load_tokenizer

    tokenizer = load_tokenizer(directory)
    sample = tokenizer.encode("You are a helpful assistant.")
    chat = "a chat template" if tokenizer.chat_template_source else "no chat template (chat logs " \
        "cannot be rendered)"
    verb = "wrote" if args.tiny else "read"
    print(f"{verb} {directory}: {sorted(os.listdir(directory))}; {chat}; "
          f"'You are a helpful assistant.' is {len(sample)} tokens {sample}")
    if args.tiny:
        print(f"use it with: prefixroute lint --tokenizer {directory} LOG   (a small vocabulary "
              f"for trying things; point --tokenizer at your model's tokenizer for real numbers)")
    return 0
