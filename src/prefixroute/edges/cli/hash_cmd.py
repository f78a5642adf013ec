"""``prefixroute hash``: the block hashes an engine will compute and publish for a prompt.

Example: ``prefixroute hash --profile vllm --algo sha256 --block-size 32 --cache-salt S
tokens.json --json`` prints ``{"block_digests": [hex, ...], "event_block_hashes": [int, ...],
"event_block_hash_strings": [str, ...]}``. The event ids are what vLLM's KV events carry: 64-bit
integers, most of them above 2^53, where a JavaScript ``JSON.parse`` (or any reader that turns
numbers into doubles) silently rounds them; the same ids as decimal strings survive every reader.

TOKENS is a JSON list of token ids (or an object with ``prompt_token_ids``); with ``--tokenizer``
a text file is tokenized first, but a file that already holds ids is read as ids (with a note on
stderr), never tokenized as JSON text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.identity.hashing import (PROFILES, VLLM_ALGOS, BlockHasher,
                                              resolve_vllm_none_hash_seed)
from prefixroute.core.identity.identity import Adapter, CacheIdentity, MediaItem
from prefixroute.edges.cli.common import (add_json_argument, check_json_destination, emit_json,
                                          take_positional_from_json)


def register(subparsers) -> None:
    p = subparsers.add_parser("hash", help="block hashes of a prompt, as an engine computes them",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("tokens", metavar="TOKENS", nargs="?",
                   help="a JSON file holding a list of token ids, or a text file with --tokenizer")
    p.add_argument("--profile", default="vllm", help=f"one of {', '.join(PROFILES)} (default vllm)")
    p.add_argument("--algo", default=None,
                   help=f"vllm: one of {', '.join(VLLM_ALGOS)} (default sha256); native: xxh3_64")
    p.add_argument("--block-size", type=int, default=16, help="tokens per block (default 16, "
                   "vLLM's default on GPUs; the CPU backend needs multiples of 32)")
    p.add_argument("--cache-salt", default=None, help="the request's cache_salt")
    p.add_argument("--lora", nargs=2, metavar=("NAME", "PATH"), help="LoRA adapter name and path")
    p.add_argument("--mm", action="extend", nargs="+", default=[], metavar="ID:OFFSET:LENGTH",
                   help="multimodal items: identifier, first placeholder position, length; "
                        "several after one --mm or one per --mm")
    p.add_argument("--tokenizer", metavar="DIR",
                   help="Hugging Face tokenizer directory (your model's; offline: "
                        "'prefixroute tokenizer --tiny DIR' makes a small one): TOKENS is then "
                        "text, tokenized as a completions prompt (special tokens added)")
    p.add_argument("--none-hash-seed", default=None,
                   help="seed of the first parent hash (default: PYTHONHASHSEED if set, else "
                        "vLLM's 'vllm-none-hash')")
    add_json_argument(p, "the hashes")
    p.set_defaults(handler=run)


def parse_media(items: list[str]) -> list[MediaItem]:
    media = []
    for text in items:
        parts = text.rsplit(":", 2)
        if len(parts) != 3:
            raise ConfigError(f"--mm {text!r}: expected ID:OFFSET:LENGTH")
        try:
            media.append(MediaItem(parts[0], int(parts[1]), int(parts[2])))
        except ValueError:
            raise ConfigError(f"--mm {text!r}: OFFSET and LENGTH must be integers") from None
    return sorted(media, key=lambda m: m.offset)


def _media_or_tokens(args: argparse.Namespace) -> None:
    """``--mm a:1:2 b:3:4 tokens.json`` lets ``--mm`` take the file too: the last value, when
    it is not ``ID:OFFSET:LENGTH``, is TOKENS."""
    if args.tokens is None and args.mm and not _looks_like_media(args.mm[-1]):
        args.tokens = args.mm.pop()


def _looks_like_media(text: str) -> bool:
    parts = text.rsplit(":", 2)
    return len(parts) == 3 and all(part.lstrip("-").isdigit() for part in parts[1:])


def check_media_in_prompt(media: list[MediaItem], prompt_tokens: int) -> None:
    """An item's placeholders must lie inside the prompt: an engine puts them there, so one
    beyond the end is a mistyped offset or the wrong prompt, and would silently hash nothing."""
    for item in media:
        end = item.offset + item.length
        if end > prompt_tokens:
            raise ConfigError(f"--mm {item.identifier}:{item.offset}:{item.length}: the item "
                              f"spans tokens {item.offset}-{end - 1}, but the prompt has "
                              f"{prompt_tokens} tokens (0-{prompt_tokens - 1})")


def parse_token_ids(text: str) -> list[int] | None:
    """The token ids a file's text holds (a JSON list, or an object with
    ``prompt_token_ids``/``token_ids``), or ``None`` when it is not such JSON."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        return None
    if isinstance(data, dict):
        data = data.get("prompt_token_ids", data.get("token_ids"))
    if isinstance(data, list) and data and all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in data):
        return data
    return None


def read_token_ids(path: str) -> list[int]:
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise InputError(f"cannot read token file: {exc.strerror}", where=path) from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(f"not JSON (line {exc.lineno}, column {exc.colno}): {exc.msg}; "
                         "give a JSON list of token ids, or text with --tokenizer DIR",
                         where=f"{path}:{exc.lineno}") from None
    if isinstance(data, dict):
        data = data.get("prompt_token_ids", data.get("token_ids", data.get("prompt")))
    if not isinstance(data, list):
        raise InputError("expected a JSON list of token ids", where=path)
    for i, value in enumerate(data):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InputError(f"token {i} is {value!r}, not a non-negative integer", where=path)
    return data


def run(args: argparse.Namespace) -> int:
    _media_or_tokens(args)
    take_positional_from_json(args, "tokens")
    check_json_destination(args.json)
    if args.block_size < 1:
        raise ConfigError(f"--block-size must be at least 1, got {args.block_size}")
    if args.profile not in PROFILES:
        raise ConfigError(f"unknown --profile {args.profile!r}; choose one of {', '.join(PROFILES)}")
    if args.tokenizer:
        from prefixroute.edges.tokenization import load_tokenizer
        try:
            text = Path(args.tokens).read_text()
        except OSError as exc:
            raise InputError(f"cannot read prompt text: {exc.strerror}", where=args.tokens) from None
        token_ids = parse_token_ids(text)
        if token_ids is not None:
            print(f"prefixroute hash: note: {args.tokens} holds {len(token_ids)} token ids; "
                  f"hashing them as they are (--tokenizer is for text prompts)", file=sys.stderr)
        else:
            token_ids = load_tokenizer(args.tokenizer).encode(text)
    else:
        token_ids = read_token_ids(args.tokens)
    seed = args.none_hash_seed
    if args.profile == "vllm" and seed is None:
        seed = resolve_vllm_none_hash_seed(args.algo or "sha256", os.environ)
    hasher = BlockHasher(args.profile, args.algo, args.block_size, none_hash_seed=seed)
    identity = CacheIdentity(cache_salt=args.cache_salt,
                             adapter=Adapter(*args.lora) if args.lora else None)
    media = parse_media(args.mm)
    check_media_in_prompt(media, len(token_ids))
    keys = hasher.block_hashes(token_ids, identity, media)
    digests = [k.hex() if isinstance(k, bytes) else f"{k:016x}" for k in keys]
    events = [hasher.event_block_hash(k) for k in keys]
    if args.json:
        emit_json({"block_digests": digests, "event_block_hashes": events,
                   "event_block_hash_strings": [str(e) for e in events]}, args.json)
        return 0
    print(f"{len(token_ids)} tokens, {len(keys)} full blocks of {args.block_size} "
          f"({args.profile}/{hasher.algo}); {len(token_ids) % args.block_size} tokens in the "
          f"partial last block get no hash")
    for i, (digest, event) in enumerate(zip(digests, events)):
        print(f"block {i:4d}  tokens {i * args.block_size}-{(i + 1) * args.block_size - 1}  "
              f"{digest}  event id {event}")
    sys.stdout.flush()
    return 0
