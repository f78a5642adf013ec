"""``prefixroute generate``: write a generated workload as a trace file.

``prefixroute generate mooncake-sessions --requests 1000000 --seed 7 -o trace.jsonl`` writes
Mooncake-format JSON Lines (``timestamp`` ms, ``input_length``, ``output_length``,
``hash_ids`` of 512-token blocks) that ``prefixroute simulate --trace trace.jsonl
--trace-format mooncake`` replays. Requests are generated and written one at a time (memory
holds the live sessions, not the trace); the file appears only when complete.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from prefixroute.core.errors import ConfigError
from prefixroute.core.simulator.generators import make_workload, workload_parameters
from prefixroute.edges.cli.common import positive_int
from prefixroute.edges.traces.mooncake import request_to_mooncake

# Generators whose requests carry Mooncake-style block ids.
FORMATS = {"mooncake-sessions": "mooncake"}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="write a generated workload as a trace",
                                   description=__doc__.splitlines()[0])
    parser.add_argument("workload", metavar="NAME[:k=v,...]",
                        help=f"generator: {', '.join(FORMATS)}; parameters as in "
                             "simulate --workload (e.g. mooncake-sessions:rate=20)")
    parser.add_argument("--requests", type=positive_int, default=None,
                        help="requests to write (the generator's default otherwise)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("-o", "--output", required=True, help="trace file to write (jsonl)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(handler=handle)


def handle(args: argparse.Namespace) -> int:
    name, _, rest = args.workload.partition(":")
    if name not in FORMATS:
        raise ConfigError(f"cannot write {name!r} as a trace; generators: {', '.join(FORMATS)}")
    params = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise ConfigError(f"{name}: parameter {item!r} is not key=value")
        params[key] = value
    if args.requests is not None:
        params["requests"] = str(args.requests)
    total = int(params.get("requests", workload_parameters(name)["requests"]))
    requests = make_workload(name, params, seed=args.seed)
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp")
    progress = None
    if not args.no_progress and sys.stderr.isatty():
        from rich.progress import Progress
        progress = Progress(transient=True)
        task = progress.add_task(f"generate {name}", total=total)
        progress.start()
    try:
        with os.fdopen(fd, "w") as fh:
            write = fh.write
            dumps = json.JSONEncoder(separators=(",", ":")).encode
            for i, request in enumerate(requests, 1):
                write(dumps(request_to_mooncake(request)))
                write("\n")
                if progress is not None and i % 5000 == 0:
                    progress.update(task, completed=i)
        os.replace(tmp, out)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    finally:
        if progress is not None:
            progress.stop()
    print(f"wrote {total} requests to {out} ({FORMATS[name]} format)")
    return 0
