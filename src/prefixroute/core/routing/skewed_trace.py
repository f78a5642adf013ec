"""The skewed routing trace (docs/concepts.md, worked example 3), replayed through the real
policy objects.

Three replicas each hold at most two prefix *families* (an LRU counted in entries, one key per
family: :class:`~prefixroute.core.caches.key_lru.KeyLRUCache`). Families have lengths A=1000,
B=800, C=600, D=400 tokens and arrive as ``AABACABDAACBADABCABA``. For each arrival the
policy, built by name through :func:`~prefixroute.core.routing.registry.create_policy`, sees a
:class:`RequestView` whose only block key is the family and one :class:`ReplicaView` per
replica whose ``cache`` is that replica's LRU (its ``match`` peeks without touching) and whose
``assignments`` count the requests routed there so far. Then the chosen replica serves it: a
family it holds is a hit (its length is reused, the entry becomes most recent), otherwise it is
inserted (an eviction when that pushes another family out); its assignments go up by one.

Expected, round_robin / affinity_only / hybrid(max_skew=1):
reused tokens 10,000 / 13,800 / 12,000; assignments [7,7,6] / [10,5,5] / [7,7,6]; final max
skew 1 / 5 / 1; evictions 2 / 0 / 0; hybrid's skew peaks at 2 mid-run.

**Queue-penalty estimate.** The trace has no clock, so queueing is estimated under one stated
assumption: arrivals are evenly spaced and a request stays on its replica (queued or in its
batch) for ``replicas`` arrival intervals, the span after which perfect round robin returns to
the same replica. A request therefore shares its replica with the requests routed there among
the previous ``queue_window = replicas - 1`` arrivals (under round robin, none). Summed over
requests:

* ``queue_penalty_tokens``: the *uncached* prompt tokens of those requests, the prefill a
  continuous-batching engine computes before or alongside this request's and so what delays
  its first token (a hit ahead recomputes only its last token, counted as 0);
* ``queued_ahead``: how many requests that is (the batch it shares for decode);
* ``net_prefill_saved_tokens = reused_prefix_tokens - queue_penalty_tokens``: prefill skipped minus
  prefill waited for, both in prompt tokens, a crude view of pure affinity's cost: hot replicas
  whose queues can erase the prefill saved.

The same window fills ``ReplicaView.in_flight`` and ``pending_prefill_tokens``, so load-aware
policies see the very queue the estimate charges.

Pure: no I/O, no clock; results depend only on the arguments (and ``seed`` for random
policies).
"""

from __future__ import annotations

from collections import deque
from typing import Any, Mapping

from prefixroute.core.caches.key_lru import KeyLRUCache
from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import ReplicaView, RequestView
from prefixroute.core.routing.registry import create_policy, parse_spec

SKEWED_TRACE_ARRIVALS = "AABACABDAACBADABCABA"
SKEWED_TRACE_LENGTHS: Mapping[str, int] = {"A": 1000, "B": 800, "C": 600, "D": 400}
SKEWED_TRACE_REPLICAS = 3
SKEWED_TRACE_CAPACITY = 2
SKEWED_TRACE_POLICIES = ("round_robin", "affinity_only", "hybrid")

HOT_PREFIX = "E"
HOT_PREFIX_TOKENS = 1200
HOT_BURST_REQUESTS = 8

# Per-step series dropped from the exercise summaries (the base trace keeps them).
_SERIES = ("choices", "hits", "assignment_skew_over_time", "branches")


def _with_max_skew(policy_spec: str, max_skew: int | None) -> str:
    if max_skew is None:
        return policy_spec
    name, params = parse_spec(policy_spec)
    params["max_skew"] = str(max_skew)
    return name + ":" + ",".join(f"{k}={v}" for k, v in params.items())


def run_skewed_trace(policy_spec: str, arrivals: str = SKEWED_TRACE_ARRIVALS,
                       lengths: Mapping[str, int] = SKEWED_TRACE_LENGTHS,
                       replicas: int = SKEWED_TRACE_REPLICAS, capacity: int = SKEWED_TRACE_CAPACITY,
                       max_skew: int | None = None, *, queue_window: int | None = None,
                       seed: int = 0) -> dict[str, Any]:
    """Replay ``arrivals`` (one family name per character) through ``policy_spec``.

    ``max_skew``, when given, is set on the spec (only policies with that parameter accept
    it). ``queue_window`` defaults to ``replicas - 1`` (see the module docstring).

    Returns ``policy``, ``replicas``, ``capacity``, ``arrivals``, ``queue_window``;
    per-step ``choices`` (replica per arrival), ``hits``, ``branches``,
    ``assignment_skew_over_time`` (max minus min assignments after each arrival); totals
    ``reused_prefix_tokens``, ``fresh_prefill_tokens``, ``total_prompt_tokens``,
    ``token_hit_rate``, ``assignments``, ``max_assignment_skew`` (final),
    ``peak_assignment_skew``, ``evictions``, ``queued_ahead``, ``queue_penalty_tokens`` and
    ``net_prefill_saved_tokens``. Key names follow the simulator's JSON and ``repro``'s.
    """
    if replicas < 1:
        raise ConfigError(f"replicas must be at least 1, got {replicas}")
    unknown = sorted(set(arrivals) - set(lengths))
    if unknown:
        raise ConfigError(f"arrivals name families without a length: {', '.join(unknown)}")
    window = replicas - 1 if queue_window is None else queue_window
    if window < 0:
        raise ConfigError(f"queue_window must not be negative, got {window}")
    spec = _with_max_skew(policy_spec, max_skew)
    # Families have different lengths, so there is no one block size to pass: each request
    # states its own (one block = the whole family).
    policy = create_policy(spec, seed=seed, num_replicas=replicas)

    caches = [KeyLRUCache(capacity) for _ in range(replicas)]
    assignments = [0] * replicas
    recent: deque[tuple[int, int]] = deque(maxlen=window)  # (replica, uncached tokens)
    choices: list[int] = []
    hits: list[bool] = []
    branches: list[str] = []
    skew_over_time: list[int] = []
    reused = fresh = evictions = queued_ahead = queue_penalty = 0

    for step, family in enumerate(arrivals):
        length = lengths[family]
        in_window = [0] * replicas
        pending = [0] * replicas
        for replica, uncached in (recent if window else ()):
            in_window[replica] += 1
            pending[replica] += uncached
        request = RequestView(request_id=f"{step}:{family}", num_tokens=length,
                              block_size=length, block_keys=[family], routing_key=None,
                              now=float(step))
        views = [ReplicaView(index=i, in_flight=in_window[i], pending_prefill_tokens=pending[i],
                             assignments=assignments[i], capacity_blocks=capacity,
                             cache=caches[i]) for i in range(replicas)]
        decision = policy.route(request, views)
        chosen = decision.replica
        if not 0 <= chosen < replicas:
            raise ConfigError(f"policy {spec!r} chose replica {chosen}, not a candidate")
        policy.on_routed(request, decision)

        queued_ahead += in_window[chosen]
        queue_penalty += pending[chosen]
        if caches[chosen].lookup(family):
            reused += length
            uncached = 0
            hits.append(True)
        else:
            evictions += len(caches[chosen].put(family))
            fresh += length
            uncached = length
            hits.append(False)
        assignments[chosen] += 1
        if window:
            recent.append((chosen, uncached))
        choices.append(chosen)
        branches.append(decision.branch)
        skew_over_time.append(max(assignments) - min(assignments))

    total = reused + fresh
    return {
        "policy": spec,
        "replicas": replicas,
        "capacity": capacity,
        "arrivals": arrivals,
        "queue_window": window,
        "choices": choices,
        "hits": hits,
        "branches": branches,
        "assignment_skew_over_time": skew_over_time,
        "reused_prefix_tokens": reused,
        "fresh_prefill_tokens": fresh,
        "total_prompt_tokens": total,
        "token_hit_rate": reused / total if total else 0.0,
        "assignments": assignments,
        "max_assignment_skew": skew_over_time[-1] if skew_over_time else 0,
        "peak_assignment_skew": max(skew_over_time, default=0),
        "evictions": evictions,
        "queued_ahead": queued_ahead,
        "queue_penalty_tokens": queue_penalty,
        "net_prefill_saved_tokens": reused - queue_penalty,
    }


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k not in _SERIES}


def skewed_trace_exercises(policies: tuple[str, ...] = SKEWED_TRACE_POLICIES) -> dict[str, Any]:
    """The exercises on the skewed routing trace, each a full replay.

    Returns ``{exercise: {policy spec: run}}`` with three exercises:

    * ``capacity_1``: every replica holds a single family, per policy;
    * ``hybrid_max_skew``: ``hybrid:max_skew=0``, ``=1`` and ``=2``;
    * ``hot_burst``: a hot prefix E of 1,200 tokens, an 8-request burst of E appended to the
      arrivals (each run shows its ``arrivals`` and ``lengths``), per policy.

    Each run has the totals of :func:`run_skewed_trace` (``reused_prefix_tokens``,
    ``assignments``, ``max_assignment_skew``, ``peak_assignment_skew``, ``evictions``, the
    queue-penalty estimate of the module docstring), without the per-step series.
    """
    hot_arrivals = SKEWED_TRACE_ARRIVALS + HOT_PREFIX * HOT_BURST_REQUESTS
    hot_lengths = {**SKEWED_TRACE_LENGTHS, HOT_PREFIX: HOT_PREFIX_TOKENS}
    hybrid_runs = (run_skewed_trace("hybrid", max_skew=skew) for skew in (0, 1, 2))
    return {
        "capacity_1": {name: _summary(run_skewed_trace(name, capacity=1))
                       for name in policies},
        "hybrid_max_skew": {run["policy"]: _summary(run) for run in hybrid_runs},
        "hot_burst": {name: {**_summary(run_skewed_trace(name, arrivals=hot_arrivals,
                                                           lengths=hot_lengths)),
                             "lengths": hot_lengths}
                      for name in policies},
    }
