"""``preble_e2``: Preble's E2 (exploitation + exploration) global scheduling.

Sources: Srivatsa et al., *Preble: Efficient Distributed Prompt Scheduling for LLM Serving*,
ICLR 2025 (section 3, the E2 algorithm), and its code ``WukLab/preble``,
``multi_node/global_scheduler_with_time.py`` (``GlobalSchedulerWithTime.runtime_selector``,
``SlidingWindowHistogram``, ``virtual_evict_for_routing``). Defaults from that file: the load
window ``H`` is 3 minutes (``SlidingWindowHistogram(window_duration=timedelta(minutes=3))``), a
request without ``max_new_tokens`` is assumed to decode 45 tokens, and eviction assumes a full
GPU when the capacity is unknown ("assume GPU memory is always full").

The rule, per request (units are the request's block keys):

* **Exploit** when the longest prefix cached anywhere is longer than the rest of the prompt
  (``cached > uncached``, the source's ``leaf.num_tokens < context - leaf.num_tokens``): among
  the replicas holding that longest prefix, the one with the lowest cost below
  (``exploit_longest_prefix``).
* **Explore** otherwise: every candidate is costed and the cheapest wins
  (``explore_lowest_cost``), with ``cost(i) = L(i) + M(i) + P(i)`` in seconds:

  - ``L`` (load): the prefill plus decode time of the requests routed to ``i`` within the
    last ``window_s`` seconds. A request's prefill time is its uncached tokens at routing times
    the seconds per token; its decode time is its output tokens (the hint, else 45) times
    ``tpot_s``.
  - ``M`` (eviction): making room for the request's new blocks on ``i`` evicts its least
    recently used blocks; each victim costs the prefill time of one block times the number of
    requests in the window that used it (Preble: miss rate x requests in window x prefill
    time of the evicted node).
  - ``P`` (prefill): the request's tokens not cached on ``i`` times ``i``'s seconds per token.

Ties go to the lowest index. Seconds per token come from :attr:`ReplicaView.prefill_s_per_token`
when the runner knows it, else ``prefill_s_per_token`` (default 1e-4 s, about 10k prefill
tokens/s, and ``tpot_s`` 0.02 s: an 8B-class model on one H100-class GPU; these two are ours,
Preble fits its own per GPU and measures TPOT online).

The router keeps its own view of each replica's cache, as Preble's global scheduler does: an
LRU of the block keys it routed there, sized by :attr:`ReplicaView.capacity_blocks` when known
(unbounded otherwise). Blocks are touched tail first, so prefixes outlive their suffixes.

Approximations: Preble's GPU-specific prefill regressions become one linear rate, and its
measured TPOT (fed back on completion) a fixed ``tpot_s``; the scheduler's post-assignment
rebalancing (moving prefixes off a GPU whose load is 15x another's) and prefix autoscaling are
not modelled, since they act between requests rather than on one. The released code's defaults
drop ``M`` (``enable_eviction=False``) and ``P`` (recomputation cost 0); this policy follows the
paper and keeps both (``eviction_cost=false`` drops ``M``).

Parameters: ``window_s``, ``prefill_s_per_token``, ``tpot_s``, ``default_output_tokens``,
``eviction_cost``.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from itertools import islice
from typing import Hashable, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import BasePolicy, Decision, ReplicaView, RequestView
from prefixroute.core.routing.policies.common import expected_cached_tokens
from prefixroute.core.routing.registry import register


class ReplicaRecord:
    """What the global scheduler remembers of one replica: its cached blocks (LRU) and the
    requests it received within the load window."""

    def __init__(self) -> None:
        self.blocks: OrderedDict[Hashable, None] = OrderedDict()  # oldest first
        self.capacity = 0  # blocks; 0 = unknown
        self.window: deque[tuple[float, float, tuple[Hashable, ...]]] = deque()
        self.window_work_s = 0.0
        self.uses: Counter[Hashable] = Counter()  # block -> requests in window that used it

    def expire(self, now: float, window_s: float) -> None:
        while self.window and self.window[0][0] < now - window_s:
            _, work, keys = self.window.popleft()
            self.window_work_s -= work
            self.uses.subtract(keys)
            for key in keys:
                if self.uses[key] <= 0:
                    del self.uses[key]
        if not self.window:
            self.window_work_s = 0.0  # no drift from float subtraction

    def match(self, keys: Sequence[Hashable]) -> int:
        n = 0
        for key in keys:
            if key not in self.blocks:
                break
            n += 1
        return n

    def victims(self, keys: Sequence[Hashable]) -> list[Hashable]:
        """Blocks LRU eviction would drop to make room for the request's new blocks."""
        own = set(keys)
        new = sum(1 for key in own if key not in self.blocks)
        if self.capacity:
            needed = new - (self.capacity - len(self.blocks))
        else:
            needed = new  # Preble's heuristic: assume GPU memory is always full
        if needed <= 0:
            return []
        out = []
        for key in islice(self.blocks, needed + len(own)):
            if key not in own:
                out.append(key)
                if len(out) == needed:
                    break
        return out

    def record(self, now: float, work_s: float, keys: Sequence[Hashable]) -> None:
        keys = tuple(dict.fromkeys(keys))  # each block counts once per request
        self.window.append((now, work_s, keys))
        self.window_work_s += work_s
        self.uses.update(keys)
        blocks = self.blocks
        for key in reversed(keys):  # tail first: the prefix ends up most recent
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
        if self.capacity:
            while len(blocks) > self.capacity:
                blocks.popitem(last=False)


@register("preble_e2")
class PrebleE2(BasePolicy):
    def __init__(self, window_s: float = 180.0, prefill_s_per_token: float = 1e-4,
                 tpot_s: float = 0.02, default_output_tokens: int = 45,
                 eviction_cost: bool = True) -> None:
        if window_s <= 0 or prefill_s_per_token <= 0 or tpot_s < 0:
            raise ConfigError("window_s and prefill_s_per_token must be positive, "
                              "tpot_s non-negative")
        if default_output_tokens < 0:
            raise ConfigError("default_output_tokens must be non-negative")
        self.window_s = window_s
        self.prefill_s_per_token = prefill_s_per_token
        self.tpot_s = tpot_s
        self.default_output_tokens = default_output_tokens
        self.eviction_cost = eviction_cost
        self._records: dict[int, ReplicaRecord] = {}
        self._rates: dict[int, float] = {}

    def _record(self, replica: ReplicaView, now: float) -> ReplicaRecord:
        record = self._records.get(replica.index)
        if record is None:
            record = self._records[replica.index] = ReplicaRecord()
        record.capacity = replica.capacity_blocks
        record.expire(now, self.window_s)
        self._rates[replica.index] = replica.prefill_s_per_token or self.prefill_s_per_token
        return record

    def _uncached_tokens(self, request: RequestView, matched_blocks: int) -> int:
        return max(0, request.num_tokens - matched_blocks * request.block_size)

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        keys = request.block_keys
        block = request.block_size
        costs: dict[int, float] = {}
        matched: dict[int, int] = {}
        scores: dict[int, dict[str, float]] = {}
        for replica in replicas:
            record = self._record(replica, request.now)
            rate = self._rates[replica.index]
            matched[replica.index] = record.match(keys)
            load = record.window_work_s
            evict = 0.0
            if self.eviction_cost:
                evict = sum(record.uses[v] for v in record.victims(keys)) * block * rate
            prefill = self._uncached_tokens(request, matched[replica.index]) * rate
            costs[replica.index] = load + evict + prefill
            scores[replica.index] = {"matched_blocks": float(matched[replica.index]),
                                     "load_s": load, "eviction_s": evict, "prefill_s": prefill,
                                     "cost_s": costs[replica.index]}
        best = max(matched.values())
        cached = min(best * block, request.num_tokens)
        uncached = request.num_tokens - cached
        if cached > uncached:
            holders = [r.index for r in replicas if matched[r.index] == best]
            choice = min(holders, key=lambda i: (costs[i], i))
            return Decision(choice, "exploit_longest_prefix",
                            f"{cached} cached tokens > {uncached} uncached: replica {choice} "
                            f"holds the longest prefix ({best} blocks) at cost "
                            f"{costs[choice]:.3f} s", scores,
                            expected_cached_tokens(request, best, block))
        choice = min(costs, key=lambda i: (costs[i], i))
        parts = scores[choice]
        return Decision(choice, "explore_lowest_cost",
                        f"{cached} cached tokens <= {uncached} uncached: replica {choice} has "
                        f"the lowest cost {parts['cost_s']:.3f} s = load {parts['load_s']:.3f} "
                        f"+ eviction {parts['eviction_s']:.3f} + prefill "
                        f"{parts['prefill_s']:.3f}", scores,
                        expected_cached_tokens(request, matched[choice], block))

    def on_routed(self, request: RequestView, decision: Decision) -> None:
        record = self._records.get(decision.replica)
        if record is None:
            record = self._records[decision.replica] = ReplicaRecord()
        rate = self._rates.get(decision.replica, self.prefill_s_per_token)
        prefill_s = self._uncached_tokens(request, record.match(request.block_keys)) * rate
        outputs = request.output_tokens_hint
        if outputs is None:
            outputs = self.default_output_tokens
        record.record(request.now, prefill_s + outputs * self.tpot_s, request.block_keys)
