"""What a simulation run measured, per policy, in stable JSON-ready form.

Token-level first (prefill saved is counted in tokens, so the token hit rate, not the request
hit rate, is the headline):

``token_hit_rate``
    prompt tokens served from cache / all prompt tokens (vLLM ``prefix_cache_hits_total`` /
    ``prefix_cache_queries_total`` over the fleet, with ``cached_tokens`` as reported);
``reused_prefix_tokens`` / ``fresh_prefill_tokens``
    their sum is the input tokens of the completed requests (conservation);
``ideal_reused_tokens`` and ``recomputed_prefill_tokens``
    one infinite cache that has seen every earlier request (same last-token rule) reuses
    ``ideal``; what the fleet recomputed beyond that is lost to routing and to finite caches;
``request_hit_rate``
    requests with any cached token;
``ttft_*`` / ``e2e_*``
    time to first token and end-to-end latency percentiles (linear interpolation between
    order statistics, numpy's default);
``assignments`` / ``max_assignment_skew``
    requests routed to each replica and max minus min;
``utilisation``
    per replica, the fraction of the run it spent in steps;
``evictions``
    cached blocks evicted from all replicas' pools.

Per replica busy seconds (not in the summary): :attr:`PolicyRun.busy_s` over the whole run and,
when asked for, :attr:`PolicyRun.busy_until_s` up to a given time; :func:`max_over_mean` makes
either a busiest-replica ratio.
"""

from __future__ import annotations

import math
from array import array
from typing import Iterable, Sequence

from prefixroute.core.caches.base import cacheable_blocks
from prefixroute.core.simulator.request import Request


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics
    (rank ``(n - 1) * q / 100``); ``None`` for no values. ``percentile([1, 2, 3, 4], 50)`` is
    2.5."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0..100, got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    fraction = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * fraction


def prompt_blocks(request: Request) -> int:
    return min(len(request.block_keys), request.input_tokens // request.block_size)


def cacheable_prompt_blocks(request: Request) -> int:
    """Prompt blocks that can hit: the last prompt token is always recomputed."""
    return min(prompt_blocks(request), cacheable_blocks(request.input_tokens, request.block_size))


def ideal_reuse(requests: Iterable[Request]) -> array:
    """Cached tokens per request under one infinite cache that holds every block (prompt and
    known reply) of every earlier request, with the last-token rule."""
    seen: set = set()
    out = array("q")
    for request in requests:
        keys = request.block_keys
        limit = cacheable_prompt_blocks(request)
        n = 0
        while n < limit and keys[n] in seen:
            n += 1
        out.append(n * request.block_size)
        seen.update(keys)
    return out


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def summarize_latencies(prefix: str, values: Sequence[float]) -> dict[str, float | None]:
    return {
        f"{prefix}_p50_s": _round(percentile(values, 50)),
        f"{prefix}_p90_s": _round(percentile(values, 90)),
        f"{prefix}_p99_s": _round(percentile(values, 99)),
        f"{prefix}_mean_s": _round(sum(values) / len(values)) if values else None,
    }


def max_skew(assignments: Sequence[int]) -> int:
    return max(assignments) - min(assignments) if assignments else 0


def max_over_mean(values: Sequence[float]) -> float:
    """The largest value over the mean (1.0 for no values or a zero mean): how much more the
    busiest replica carries than the average one. ``max_over_mean([1, 2, 3])`` is 1.5."""
    if not values:
        return 1.0
    mean = sum(values) / len(values)
    return max(values) / mean if mean > 0 else 1.0


def downsample(times: Sequence[float], rows: Sequence[Sequence[int]],
               points: int = 200) -> dict[str, list]:
    """At most ``points`` evenly spaced samples of a load time series."""
    if not times:
        return {"t": [], "in_flight": []}
    step = max(1, len(times) // points)
    picked = range(0, len(times), step)
    return {"t": [round(times[i], 3) for i in picked],
            "in_flight": [list(rows[i]) for i in picked]}
