"""Replay against the live fleet: ``simulate --trace RECORDING`` sets each policy's
counterfactual beside what the live router did (docs/trace-format.md, "Recordings").

The live figures come from the recording itself (:meth:`Recording.live_summary`): the token
hit rate the engines reported over the requests whose answer carried a usage object, and the
TTFT of the streamed requests as the gateway measured it (arrival to first event, so gateway
queueing included), stretched by ``--time-scale`` like the arrivals. The report adds
``live`` to the JSON and, per policy, ``vs_live``: the hit rate's difference in percentage
points and the TTFT percentiles' ratios.
"""

from __future__ import annotations

from typing import Any


def add_live(result: dict[str, Any], recording: Any, count: int, time_scale: float) -> None:
    """Put the live summary of the first ``count`` recorded requests and each policy's
    difference from it into ``result`` (the simulate report)."""
    live = recording.live_summary(count, time_scale)
    result["live"] = live
    for summary in result["policies"].values():
        summary["vs_live"] = compare(summary, live)


def compare(summary: dict[str, Any], live: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"token_hit_rate_points": None}
    if summary.get("token_hit_rate") is not None and live["token_hit_rate"] is not None:
        out["token_hit_rate_points"] = round(
            (summary["token_hit_rate"] - live["token_hit_rate"]) * 100.0, 2)
    for name in ("ttft_p50_s", "ttft_p99_s"):
        ours, theirs = summary.get(name), live.get(name)
        out[name.replace("_s", "_ratio")] = round(ours / theirs, 3) \
            if ours is not None and theirs else None
    return out


def print_live(result: dict[str, Any], console) -> None:
    """The comparison as a table: the live row first, then each replayed policy."""
    from rich.table import Table

    from prefixroute.edges.cli.columns import pct, secs

    live = result["live"]
    fleet = result["fleet"]
    console.print(f"live fleet (recorded): policy {live['policy'] or 'unknown'}, "
                  f"{live['replicas'] or '?'} replicas, {live['requests']:,} requests "
                  f"({live['requests_reported']:,} with cached tokens reported, "
                  f"{live['ttft_requests']:,} streamed); replayed on {fleet['replicas']} "
                  f"replicas x {fleet['cache_blocks']:,} blocks")
    table = Table(title="replay vs live")
    for column, justify in (("", "left"), ("token hit rate", "right"),
                            ("vs live", "right"), ("TTFT p50", "right"),
                            ("TTFT p99", "right")):
        table.add_column(column, justify=justify)
    table.add_row("live" + (f" ({live['policy']})" if live["policy"] else ""),
                  pct(live["token_hit_rate"]), "", secs(live["ttft_p50_s"]),
                  secs(live["ttft_p99_s"]))
    for spec, summary in result["policies"].items():
        points = summary["vs_live"]["token_hit_rate_points"]
        table.add_row(spec, pct(summary["token_hit_rate"]),
                      "" if points is None else f"{points:+.1f} pts",
                      secs(summary["ttft_p50_s"]), secs(summary["ttft_p99_s"]))
    console.print(table)
