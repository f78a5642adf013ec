"""The cost terms: seconds until a request's first token on one replica.

``cost = wait + kv_wait + prefill + decode + delay_to_others + copy``, all in seconds at the
replica's learned speed ``s`` (seconds per token-equivalent):

prefill
    ``u`` new tokens after ``h`` cached ones are ``u + u (h + u / 2) / L`` token-equivalents
    plus one step overhead per chunk, ``L`` the context length at which attention costs as
    much as the linear part. A hit skips the linear *and* the attention cost of its tokens,
    so hits on long prompts are worth more than their length.
decode
    every step of that prefill also decodes one token for each running request and reads the
    KV they hold (``kv_usage`` of the capacity).
kv_wait
    a replica whose KV is held by running requests admits the request only when enough of
    them finish: the blocks it lacks, as a share of the capacity, times how long requests
    stay (learned from completions).
delay to others
    under load, work also delays the requests that will queue behind it, by about
    ``rho / (1 - rho)`` of its length at prefill utilisation ``rho`` (an M/G/1 queue), ``rho``
    the fleet's. Charged to every candidate alike, it weighs the work a choice saves: near
    zero on a quiet fleet, it keeps an overloaded one on its cached prefixes. On a priority
    replica a request also delays each queued request it passes by its prefill.

copy
    a replica that holds less of the prompt than another (``cached`` below the fleet's most,
    ``most``) computes the prefix it lacks again, which ``prefill`` counts, and writes it
    into its cache a second time: as many blocks of other prefixes leave its cache, to be
    computed again when next asked for. That later recompute is priced as the copy's own,
    the prefill of the tokens it lacks after the holder's hit. So moving a prefix away from
    its holder must save twice its recompute (the hysteresis the SGLang router gets from its
    imbalance thresholds): a short queue at the holder, or noise in the estimates, does not
    move it, while a long one still does. A request nobody holds pays no copy.

``wait`` is the replica's prefill queue (:mod:`.queue`).
"""

from __future__ import annotations

from typing import NamedTuple

from prefixroute.core.routing.base import ReplicaView

from .params import PrefixRouteParams


class CostTerms(NamedTuple):
    """One replica's cost evaluation, the terms beside its cost and expected hit (which its
    candidate holds): what the decision's scores show."""

    mirror_blocks: int     # leading blocks the mirror counts
    view_blocks: int       # leading blocks the runner's view confirms
    wait_s: float
    kv_wait_s: float
    prefill_s: float
    decode_s: float
    delay_others_s: float
    copy_s: float
    s_per_token: float


def to_ms(seconds: float) -> int:
    """A deadline as the integer milliseconds sent as vLLM's ``priority``."""
    return round(seconds * 1000.0)


class CostModel:
    """The engine constants of :class:`PrefixRouteParams` as the cost terms."""

    __slots__ = ("params",)

    def __init__(self, params: PrefixRouteParams) -> None:
        self.params = params

    def prefill_work(self, uncached: float, cached: float) -> float:
        """Token-equivalents to compute ``uncached`` tokens after ``cached`` ones."""
        if uncached <= 0:
            return 0.0
        p = self.params
        attention = uncached * (cached + uncached / 2) / p.attention_context_tokens
        steps = -(-uncached // p.chunk_tokens)
        return uncached + attention + steps * p.step_overhead_tokens

    def copy_work(self, prompt: float, cached: float, most: float) -> float:
        """Token-equivalents of the prefix a replica holding ``cached`` tokens of a
        ``prompt`` lacks against the fleet's best holder (``most``): what it computes beyond
        the holder's prefill, the price of the copy's cache space (module docstring)."""
        if most <= cached:
            return 0.0
        return self.prefill_work(prompt - cached, cached) - self.prefill_work(prompt - most,
                                                                              most)

    def decode_work(self, replica: ReplicaView, uncached: float, block_size: int) -> float:
        """Token-equivalents the replica's decoding requests add to the steps that compute
        ``uncached`` tokens."""
        p = self.params
        steps = max(1, -(-int(uncached) // p.chunk_tokens))
        context = replica.kv_usage * replica.capacity_blocks * block_size
        return steps * (p.decode_tokens_per_seq * replica.running
                        + p.decode_tokens_per_context_token * context)

    @staticmethod
    def kv_wait(replica: ReplicaView, uncached: float, block_size: int,
                residence_s: float) -> float:
        """Seconds until the replica's KV has room for the request's new blocks."""
        capacity = replica.capacity_blocks
        if capacity <= 0 or block_size <= 0 or residence_s <= 0:
            return 0.0
        free = (1.0 - replica.kv_usage) * capacity
        lacking = uncached / block_size - free
        if lacking <= 0:
            return 0.0
        return min(1.0, lacking / capacity) * residence_s

    def delay_factor(self, rho: float) -> float:
        """How many times its own prefill a request delays the others, at fleet prefill
        utilisation ``rho`` (< 1)."""
        return min(rho / (1.0 - rho), self.params.max_externality)
