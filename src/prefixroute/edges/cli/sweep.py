"""``prefixroute sweep``: a grid of fleet sizes, cache capacities and policy parameters.

The workload flags are those of ``prefixroute simulate``. The grid is ``--replicas 2,4,8``,
``--cache-blocks 200,400,800`` and policies whose parameters may list alternatives with ``|``
(``--policy hybrid:max_skew=0|1|2`` is three policies). Every grid point runs in a worker
process (``--jobs``, default 2) over the same prepared workload (read or generated once, before
the workers fork); the result is a table, ``--json`` and a plot (``--plot DIR``: token hit rate
and TTFT p99 against cache capacity, one panel per fleet size, one line per policy).

``--ray`` runs the grid points as Ray tasks instead (a local Ray started by ``ray.init()``,
``--ray auto`` an existing local cluster, ``--ray ADDRESS`` a cluster by address; the optional
``prefixroute[ray]`` extra); the prepared workload goes to Ray's object store once. Results
are the same as with ``--jobs``: every point is a pure function of the workload, fleet, policy
and seed. ``--resume DIR`` writes each finished point to DIR as it completes and skips points
already there (same workload, fleet, policy, view and seed), so an interrupted sweep picks up
where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import multiprocessing
import os
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.registry import create_policy, expand_specs, parse_spec
from prefixroute.core.simulator.simulation import simulate_policy, split_view
from prefixroute.edges.cli.columns import (POLICY_COLUMNS, SWEEP_DEFAULT, add_table_arguments,
                                           choose_columns, metrics_epilog, print_rows)
from prefixroute.edges.cli.common import add_json_argument, print_json, stdout_console
from prefixroute.edges.cli.simulate import (_pct, _png, add_workload_arguments,
                                            check_output_paths, describe, load_workload,
                                            resolve_fleet, workloads_epilog, write_outputs)

DEFAULT_JOBS = 2  # this machine's cores; override with --jobs

# Set in the parent before the workers fork, so each inherits the prepared workload.
_SHARED: dict[str, Any] = {}


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "sweep", help="run a grid of replicas, cache sizes and policy parameters in parallel",
        description=describe(__doc__),
        epilog=workloads_epilog() + "\n\n" + metrics_epilog(POLICY_COLUMNS),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_arguments(parser, grid=True)
    parser.add_argument("--replicas", metavar="N,N,...",
                        help="fleet sizes, comma-separated (default: the workload's)")
    parser.add_argument("--policy", action="append", metavar="NAME[:k=a|b,...]",
                        help="a policy, repeatable; '|' separates alternative parameter values; "
                             "'all' is every registered policy (default hybrid and round_robin)")
    parser.add_argument("--jobs", type=int, default=DEFAULT_JOBS, metavar="N",
                        help="worker processes (default %(default)s)")
    add_json_argument(parser, "the results")
    add_table_arguments(parser, POLICY_COLUMNS, SWEEP_DEFAULT)
    parser.add_argument("--plot", metavar="DIR", help="write sweep.png to DIR")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--ray", nargs="?", const="local", default=None, metavar="auto|ADDRESS",
                        help="run grid points as Ray tasks: a local Ray (no value), an existing "
                             "local cluster (auto) or a cluster by address")
    parser.add_argument("--resume", metavar="DIR",
                        help="keep each finished point in DIR and skip points already there")
    parser.set_defaults(handler=run)


def expand_alternatives(spec: str) -> list[str]:
    """``hybrid:max_skew=0|1`` -> [``hybrid:max_skew=0``, ``hybrid:max_skew=1``]."""
    name, params = parse_spec(spec)
    if not params:
        return [name]
    keys = list(params)
    choices = [params[k].split("|") for k in keys]
    return [name + ":" + ",".join(f"{k}={v}" for k, v in zip(keys, combo))
            for combo in itertools.product(*choices)]


def _int_list(text: str | None, flag: str) -> list[int | None]:
    if not text:
        return [None]
    out = []
    for item in text.split(","):
        item = item.strip()
        try:
            value = int(item)
        except ValueError:
            raise ConfigError(f"{flag}: expected comma-separated integers, got {item!r}") from None
        if value < 1:
            raise ConfigError(f"{flag}: values must be at least 1, got {value}")
        out.append(value)
    return out


def simulate_point(args: argparse.Namespace, workload, defaults: dict,
                   point: tuple[int, int | None, int | None, str]) -> tuple[int, dict]:
    """One grid point's summary (the same function in a worker process and a Ray task)."""
    index, replicas, cache_blocks, spec = point
    fleet = resolve_fleet(args, workload, defaults, replicas=replicas, cache_blocks=cache_blocks)
    run = simulate_policy(workload, fleet, spec, view=args.view, seed=args.seed or 0)
    summary = dict(run.summary)
    summary.update(replicas=fleet.replicas, cache_blocks=fleet.cache_blocks)
    return index, summary


def _run_point(point: tuple[int, int | None, int | None, str]) -> tuple[int, dict]:
    return simulate_point(_SHARED["args"], _SHARED["workload"], _SHARED["defaults"], point)


def _point_file(resume: str, workload_id: str, point: tuple, args: argparse.Namespace) -> str:
    """Where ``--resume`` keeps a point: named by a digest of everything its result depends
    on (workload, fleet size and capacity, policy, view, seed, engine flags)."""
    _, replicas, cache_blocks, spec = point
    material = json.dumps([workload_id, replicas, cache_blocks, spec, args.view, args.seed or 0,
                           args.engine_profile, args.max_num_batched_tokens, args.max_num_seqs,
                           args.scheduling_policy, args.model_config, args.kv_memory_gib])
    return os.path.join(resume, f"point-{hashlib.sha256(material.encode()).hexdigest()[:20]}.json")


def _ray_results(address: str, args: argparse.Namespace, workload, defaults: dict,
                 points: list, done) -> None:
    """Run ``points`` as Ray tasks; ``done(index, summary)`` as each one finishes."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray: pip install 'prefixroute[ray]'") from None
    started = not ray.is_initialized()
    if started:
        try:
            if address == "local":
                ray.init(include_dashboard=False, log_to_driver=False)
            else:
                ray.init(address=address, log_to_driver=False)
        except Exception as exc:  # noqa: BLE001
            # Ray raises bare Exception for a node that did not start in time (on a busy
            # machine, raise RAY_raylet_start_wait_time_s) or a cluster it cannot reach.
            ray.shutdown()
            where = "a local Ray" if address == "local" else f"Ray at {address}"
            raise ConfigError(f"--ray: could not start or reach {where}: "
                              f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                              ) from None
    try:
        task = ray.remote(simulate_point)
        shared = ray.put(workload)
        pending = [task.remote(args, shared, defaults, point) for point in points]
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            for ref in ready:
                done(*ray.get(ref))
    finally:
        if started:
            ray.shutdown()


def run(args: argparse.Namespace) -> int:
    if args.jobs < 1:
        raise ConfigError(f"--jobs: must be at least 1, got {args.jobs}")
    replicas_grid = _int_list(args.replicas, "--replicas")
    blocks_grid = _int_list(args.cache_blocks, "--cache-blocks")
    if args.kv_memory_gib is not None and blocks_grid != [None]:
        raise ConfigError("give --cache-blocks or --kv-memory-gib, not both")
    choose_columns(args.columns, POLICY_COLUMNS, SWEEP_DEFAULT)  # a typo fails first
    specs = [s for spec in expand_specs(args.policy or ["hybrid", "round_robin"])
             for s in expand_alternatives(spec)]
    check_output_paths(args.json, args.plot)
    workload, defaults = load_workload(args)
    # Resolve every grid point's fleet and policy now: bad input fails before any work.
    points = []
    for replicas, blocks in itertools.product(replicas_grid, blocks_grid):
        fleet = resolve_fleet(args, workload, defaults, replicas=replicas, cache_blocks=blocks)
        for spec in specs:
            name, _ = split_view(spec, args.view)
            create_policy(name, seed=args.seed or 0, num_replicas=fleet.replicas,
                          block_size=fleet.block_size)
            points.append((len(points), fleet.replicas, fleet.cache_blocks, spec))

    _SHARED.update(args=args, workload=workload, defaults=defaults)
    results: list[dict | None] = [None] * len(points)
    workload_id = json.dumps(workload.describe(), sort_keys=True)
    todo = points
    if args.resume:
        os.makedirs(args.resume, exist_ok=True)
        todo = []
        for point in points:
            path = _point_file(args.resume, workload_id, point, args)
            try:
                with open(path) as fh:
                    results[point[0]] = json.load(fh)["summary"]
            except (FileNotFoundError, ValueError, KeyError):
                todo.append(point)

    def done(index: int, summary: dict) -> None:
        results[index] = summary
        if args.resume:
            write_outputs([(_point_file(args.resume, workload_id, points[index], args),
                            json.dumps({"point": list(points[index]), "summary": summary}))])
        progress.advance(task)

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    show = not args.no_progress and sys.stderr.isatty()
    progress = Progress(TextColumn("sweep"), BarColumn(), TextColumn("{task.completed}/"
                        "{task.total}"), TimeElapsedColumn(), console=Console(stderr=True),
                        transient=True, disable=not show)
    with progress:
        task = progress.add_task("sweep", total=len(points), completed=len(points) - len(todo))
        if not todo:
            pass
        elif args.ray is not None:
            _ray_results(args.ray, args, workload, defaults, todo, done)
        elif args.jobs == 1 or len(todo) == 1:
            for point in todo:
                done(*_run_point(point))
        else:
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=min(args.jobs, len(todo)),
                                     mp_context=context) as pool:
                futures = [pool.submit(_run_point, point) for point in todo]
                for future in as_completed(futures):
                    done(*future.result())

    result = {
        "workload": workload.describe(),
        "ideal_token_hit_rate": round(workload.ideal_token_hit_rate, 6),
        "grid": {"replicas": sorted({p[1] for p in points}),
                 "cache_blocks": sorted({p[2] for p in points}), "policies": specs},
        "results": results,
    }
    outputs: list[tuple[str, str | bytes]] = []
    if args.json and args.json != "-":
        outputs.append((args.json, json.dumps(result, indent=2) + "\n"))
    if args.plot:
        outputs.append((str(Path(args.plot) / "sweep.png"), render_sweep_plot(result)))
    write_outputs(outputs)
    if args.json == "-":
        print_json(result)
    else:
        print_sweep_table(result, stdout_console(), args.table_format, args.columns)
        for path, _ in outputs:
            print(f"wrote {path}")
    return 0


def print_sweep_table(result: dict, console, fmt: str = "table",
                      columns: str | None = None) -> None:
    order = result["grid"]["policies"]
    rows = sorted(result["results"], key=lambda r: (r["replicas"], r["cache_blocks"],
                                                    order.index(r["policy"])))
    chosen = choose_columns(columns, POLICY_COLUMNS, SWEEP_DEFAULT,
                            present=set(rows[0]) if rows else None)
    if fmt != "csv":
        line = (f"ideal token hit rate {_pct(result['ideal_token_hit_rate'])} over "
                f"{result['workload']['requests']:,} requests")
        console.print(line) if fmt == "table" else print(line + "\n")
    print_rows(rows, chosen, fmt, console)


def sweep_axes(grid: dict) -> tuple[str, str | None]:
    """(x axis, panel dimension) of the sweep plot: the grid dimension with the most values is
    the x axis, so that every line has points to join; the other one, if it varies, makes the
    panels. With one fleet size and one cache size the policies are the x axis."""
    sizes = {"cache_blocks": len(grid["cache_blocks"]), "replicas": len(grid["replicas"])}
    if max(sizes.values()) == 1:
        return "policy", None
    x = "cache_blocks" if sizes["cache_blocks"] >= sizes["replicas"] else "replicas"
    other = "replicas" if x == "cache_blocks" else "cache_blocks"
    return x, other if sizes[other] > 1 else None


_LABELS = {"cache_blocks": "cache blocks per replica", "replicas": "replicas",
           "policy": "policy"}


def render_sweep_plot(result: dict) -> bytes:
    """Token hit rate (top) and TTFT p99 (bottom) against the grid's longest dimension, one
    line per policy, one column of panels per value of the other dimension; panels share
    their y scales so that columns compare at a glance."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
    grid = result["grid"]
    policies = grid["policies"]
    x_dim, panel_dim = sweep_axes(grid)
    panels = grid[panel_dim] if panel_dim else [None]
    fig, axes = plt.subplots(2, len(panels), figsize=(max(6.0, 4.5 * len(panels)), 7),
                             squeeze=False, sharey="row")
    for col, panel in enumerate(panels):
        rows_here = [r for r in result["results"] if panel_dim is None or r[panel_dim] == panel]
        if x_dim == "policy":
            xs = list(range(len(policies)))
            by_policy = {r["policy"]: r for r in rows_here}
            hit = [by_policy[p]["token_hit_rate"] for p in policies]
            p99 = [by_policy[p]["ttft_p99_s"] or 0 for p in policies]
            axes[0][col].bar(xs, hit)
            axes[1][col].bar(xs, p99)
            for ax in axes[:, col]:
                ax.set_xticks(xs)
                ax.set_xticklabels(policies, rotation=45, ha="right", fontsize=8)
        else:
            for spec in policies:
                rows = sorted((r for r in rows_here if r["policy"] == spec),
                              key=lambda r: r[x_dim])
                xs = [r[x_dim] for r in rows]
                axes[0][col].plot(xs, [r["token_hit_rate"] for r in rows], marker="o",
                                  label=spec)
                axes[1][col].plot(xs, [r["ttft_p99_s"] or 0 for r in rows], marker="o",
                                  label=spec)
            for ax in axes[:, col]:
                ax.set_xticks(grid[x_dim])
                if x_dim == "cache_blocks" and grid[x_dim][-1] >= 8 * grid[x_dim][0]:
                    ax.set_xscale("log")
                    ax.set_xticks(grid[x_dim])
                    ax.set_xticklabels([f"{v:,}" for v in grid[x_dim]])
                    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axes[0][col].axhline(result["ideal_token_hit_rate"], color="black", linestyle="--",
                             linewidth=1, label="ideal (one infinite cache)")
        if panel_dim:
            axes[0][col].set_title(f"{panel:,} {_LABELS[panel_dim]}")
        axes[0][col].set_ylim(0, 1)
        axes[1][col].set_yscale("log")
        axes[1][col].set_xlabel(_LABELS[x_dim])
        for ax in axes[:, col]:
            ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("token hit rate")
    axes[1][0].set_ylabel("TTFT p99 (s, log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(4, len(labels)), fontsize=8,
               frameon=False)
    fig.suptitle(f"Sweep: token hit rate and TTFT p99 against {_LABELS[x_dim]} "
                 f"({result['workload']['requests']:,} requests)")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return _png(fig)


__all__ = ["register", "run", "expand_alternatives"]
