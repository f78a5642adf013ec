"""The request model every workload reader and generator produces.

A request carries its prompt either as token ids (generators, native JSONL with tokens, the
gateway) or as prefix-chained block ids (Mooncake: 512-token blocks; agentic sessions: 64-token
blocks), where equal ids at the same position mean equal prefixes up to and including that block.
``block_keys`` is the view caches use: one key per *full* block, chained, so equal keys at
position i imply equal prompts up to the end of block i.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from prefixroute.core.identity.identity import DEFAULT_IDENTITY, CacheIdentity


@dataclass(slots=True)
class Request:
    """One inference request as the simulator and the economics replay see it.

    ``input_tokens`` is the prompt length. When ``token_ids`` is set its length equals it; when
    only ``hash_ids`` is set (one id per ``block_size`` tokens, the last block possibly partial,
    ``len(hash_ids) == ceil(input_tokens / block_size)``) the ids stand for the tokens.
    ``prefix_group`` names the shared prefix family the request belongs to, when the generator
    knows it (tenant documents, system prompts); economics reports costs per group. When
    ``prefix_tokens`` is also set, every request of the group with the same identity starts with
    the same ``prefix_tokens`` tokens, so their keys are hashed once per group
    (:mod:`prefixroute.core.simulator.keys`).

    ``output_token_ids`` is the reply the engine will produce, when a generator knows it (a
    conversation whose next turn contains it): decode blocks then get keys and are cached as
    they fill, as vLLM caches them. ``namespace`` scopes ``hash_ids`` that are local to one file
    (agentic-session traces), so equal ids from different files stay different blocks.

    ``think_s`` is, for a turn after its session's first, how long the client waited after the
    previous turn's reply before sending it (kv-cache-tester's ``think_time``): a closed-loop
    replay (:func:`~prefixroute.core.simulator.simulation.prepare_workload`) sends the turn
    that long after the previous one completes, instead of at ``arrival_s``.
    """

    request_id: str
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_size: int
    token_ids: Sequence[int] | None = None
    hash_ids: Sequence[int] | None = None
    tenant: str = ""
    identity: CacheIdentity = DEFAULT_IDENTITY
    session: str | None = None
    turn: int = 0
    prefix_group: str | None = None
    prefix_tokens: int = 0
    output_token_ids: Sequence[int] | None = None
    namespace: str = ""
    think_s: float | None = None
    block_keys: list = field(default_factory=list)  # filled by keys.fill_block_keys(); module doc

    @property
    def full_blocks(self) -> int:
        return self.input_tokens // self.block_size
