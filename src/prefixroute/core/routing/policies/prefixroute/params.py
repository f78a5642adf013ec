"""Every setting of ``prefixroute`` a user may change, with its meaning and the source of its
default. One configuration serves every workload; ``docs/routing-policy.md`` tells how each
number was found.

The engine constants come from the simulator's Llama-3-8B on H100 preset (``llama-3-8b-h100``:
2 x 8.03e9 FLOPs per prompt token at 40% of 989 TFLOPS, 9.0e-10 s of attention per context
token, a 6 ms forward pass, 5.0e-5 s per decoding sequence and 5.2e-8 s per context token
decoded); the rest are ours, from the benchmark ``benchmarks/policy_comparison.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from prefixroute.core.errors import ConfigError

_LOST = "removed: it lost on every benchmark workload (docs/routing-policy.md, How we got here)"
_SWITCH = ("removed: an experiment switch, available to the benchmarks only "
           "(benchmarks/prefixroute_ablations.py)")


@dataclass(frozen=True, slots=True)
class PrefixRouteParams:
    # -- the cost model (engine preset llama-3-8b-h100) ----------------------------------------
    # Seconds per uncached prompt token where the runner states none (4.0e-5: the preset).
    prefill_s_per_token: float = 4.0e-5
    # Context length at which attention costs as much as the linear part: 4.0e-5 / 9.0e-10.
    attention_context_tokens: float = 44_000.0
    # A forward pass's fixed cost in token-equivalents: 6 ms / 4.0e-5 s.
    step_overhead_tokens: float = 150.0
    # Prompt tokens per step: vLLM's max_num_batched_tokens default.
    chunk_tokens: int = 8192
    # A decoding request's cost per step, in prompt-token equivalents: 5.0e-5 / 4.0e-5 s.
    decode_tokens_per_seq: float = 1.25
    # ... and per context token it holds: 5.2e-8 / 4.0e-5 s.
    decode_tokens_per_context_token: float = 1.3e-3
    # -- the block mirror ----------------------------------------------------------------------
    # Share of the KV before its end at which a block's survival starts to fall (0.25: pinned
    # blocks and tail-first freeing make blocks go up to a quarter of the pool early).
    survival_width: float = 0.25
    # -- what the policy learns ----------------------------------------------------------------
    # Weight of one completion on how long requests stay on a replica (about the last five).
    learning_rate: float = 0.2
    # Forgetting per observation of a replica's speed (0.99: about the last hundred).
    speed_memory: float = 0.99
    # Time constant of the utilisation and recent-request estimates: a few hundred requests
    # of a busy fleet, short enough to follow a burst.
    load_horizon_s: float = 30.0
    # -- cost to others --------------------------------------------------------------------------
    # Cap on the M/G/1 delay factor rho / (1 - rho) (20: rho = 0.95, where the estimate stops
    # meaning much); 0 charges no delay to others.
    max_externality: float = 20.0
    # Deadline sent as priority to a priority-scheduled replica: arrival plus this many times
    # the request's own prefill (2, measured; 0 sends none).
    priority_slack: float = 2.0
    # -- balance on a quiet fleet (ours, from the benchmark) ---------------------------------
    # Fleet prefill utilisation below which the balance rules act (0.1: queues are mostly
    # empty; an M/M/1 queue waits with probability rho).
    cold_rho_max: float = 0.1
    # Horizon of the longer-term load and occupancy (300 s: ten load horizons, a few turns).
    balance_horizon_s: float = 300.0
    # Cold balance: a request avoids replicas above this times the mean prefill routed
    # (1.1; 0 turns the rule off) ...
    cold_cap: float = 1.1
    # ... for a replica holding at most this share of the prompt less than the chosen one ...
    free_share: float = 0.1
    # ... when no replica holds more than this share of it.
    cold_share: float = 0.5
    # Session move: a replica with work over this times the fleet's mean occupancy (1.1; 0
    # turns the rule off) ...
    move_cap: float = 1.1
    # ... and over this share of the time ...
    move_floor: float = 0.7
    # ... hands the request to an idle replica at most this many seconds dearer.
    move_max_s: float = 10.0

    # Parameters earlier versions took, and why they are gone (the registry's message).
    REMOVED: ClassVar[dict[str, str]] = {
        **{name: _LOST for name in ("replicate", "replica_share", "balance_cap", "max_copy",
                                    "tie_tolerance", "tie_s", "cold_slack")},
        **{name: _SWITCH for name in ("learn_speed", "feedback", "follow_inflight",
                                      "drop_ended", "debias")},
        "externality": "removed: max_externality=0 charges no delay to others",
    }

    def __post_init__(self) -> None:
        def need(ok: bool, what: str) -> None:
            if not ok:  # (comparisons with NaN are false, so NaN is refused too)
                raise ConfigError(f"prefixroute: {what}")

        need(self.prefill_s_per_token > 0 and self.attention_context_tokens > 0,
             "prefill_s_per_token and attention_context_tokens must be positive")
        need(self.step_overhead_tokens >= 0 and self.decode_tokens_per_seq >= 0
             and self.decode_tokens_per_context_token >= 0,
             "step_overhead_tokens and the decode costs must be >= 0")
        need(isinstance(self.chunk_tokens, int) and self.chunk_tokens >= 1,
             f"chunk_tokens must be a positive integer, got {self.chunk_tokens!r}")
        need(0.0 <= self.survival_width < 1.0,
             f"survival_width must be in [0, 1), got {self.survival_width!r}")
        need(0.0 < self.learning_rate <= 1.0,
             f"learning_rate must be in (0, 1], got {self.learning_rate!r}")
        need(0.0 < self.speed_memory <= 1.0,
             f"speed_memory must be in (0, 1], got {self.speed_memory!r}")
        need(self.load_horizon_s > 0 and self.max_externality >= 0,
             "load_horizon_s must be positive and max_externality >= 0")
        need(0.0 <= self.priority_slack < math.inf,
             f"priority_slack must be 0 (off) or positive and finite, got "
             f"{self.priority_slack!r}")
        need(self.balance_horizon_s > 0 and 0.0 <= self.free_share <= 1.0,
             "balance_horizon_s must be positive and free_share in [0, 1]")
        need(self.cold_cap == 0 or self.cold_cap >= 1,
             f"cold_cap must be 0 (off) or at least 1, got {self.cold_cap!r}")
        need(self.move_cap == 0 or self.move_cap >= 1,
             f"move_cap must be 0 (off) or at least 1, got {self.move_cap!r}")
        need(self.move_max_s >= 0 and 0 <= self.move_floor <= 1,
             f"move_max_s must be >= 0 and move_floor in [0, 1], got {self.move_max_s!r} "
             f"and {self.move_floor!r}")
