"""Token- and block-level diff of two prompts: how much of the first one's cache the second reuses.

Prefix caches match whole blocks, token for token, from the start: the first
differing token invalidates its block and every block after it, never the ones before. So the
second prompt reuses exactly the *full* blocks that lie entirely before the first difference; a
partial last block is never cached. For identical prompts every full block is reusable (an engine
still recomputes the last token, so vLLM reports at most ``floor((n - 1) / B) * B`` cached
tokens, :func:`~prefixroute.core.caches.base.cacheable_tokens`;
:attr:`PromptDiff.engine_cached_tokens` gives that figure beside the block count).

Prompt A is the one already cached, prompt B the new one: totals and fractions are B's.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

from prefixroute.core.caches.base import cacheable_tokens
from prefixroute.core.diagnostics.volatile import CHANGED_CONTENT, with_article
from prefixroute.core.errors import ConfigError

_CHUNK = 256  # tokens compared per slice before scanning one by one


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share. Compares slices first, so long equal
    prefixes cost C-speed comparisons rather than a Python loop per token."""
    n = min(len(a), len(b))
    i = 0
    while i + _CHUNK <= n and a[i:i + _CHUNK] == b[i:i + _CHUNK]:
        i += _CHUNK
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass(frozen=True, slots=True)
class PromptDiff:
    """Where two token sequences part and what that costs in cached blocks.

    ``first_divergence_token`` is 0-based and ``None`` for identical prompts; when one prompt is a
    strict prefix of the other it is the shorter one's length (the first token only one has).
    ``reusable_blocks`` counts full blocks of B entirely before the divergence (all of B's full
    blocks if identical); ``reusable_tokens = reusable_blocks * block_size``.
    ``invalidated_fraction`` is the share of B's full blocks that cannot be reused (0.0 when B has
    no full block: nothing of it was cacheable).
    """

    block_size: int
    tokens_a: int
    tokens_b: int
    first_divergence_token: int | None
    first_divergence_block: int | None
    reusable_blocks: int
    reusable_tokens: int
    total_tokens: int
    total_blocks: int
    invalidated_blocks: int
    invalidated_fraction: float
    engine_cached_tokens: int

    @property
    def identical(self) -> bool:
        return self.first_divergence_token is None

    @property
    def extends(self) -> bool:
        """B starts with all of A (A is cached, B appends to it): the layout rules' ideal."""
        return (self.first_divergence_token is not None
                and self.first_divergence_token == self.tokens_a < self.tokens_b)

    def to_dict(self) -> dict:
        return asdict(self)


def diff_tokens(a: Sequence[int], b: Sequence[int], block_size: int) -> PromptDiff:
    """Compare prompt ``b`` against the cached prompt ``a`` at ``block_size``-token blocks."""
    if block_size < 1:
        raise ConfigError(f"block size must be at least 1, got {block_size}")
    shared = common_prefix_length(a, b)
    identical = shared == len(a) == len(b)
    total_blocks = len(b) // block_size
    if identical:
        divergence = None
        reusable_blocks = total_blocks
    else:
        divergence = shared
        reusable_blocks = min(shared // block_size, total_blocks)
    invalidated = total_blocks - reusable_blocks
    # vLLM never serves the prompt's last token from cache: it needs its logits.
    engine_cap = cacheable_tokens(len(b), block_size)
    return PromptDiff(
        block_size=block_size,
        tokens_a=len(a),
        tokens_b=len(b),
        first_divergence_token=divergence,
        first_divergence_block=None if divergence is None else divergence // block_size,
        reusable_blocks=reusable_blocks,
        reusable_tokens=reusable_blocks * block_size,
        total_tokens=len(b),
        total_blocks=total_blocks,
        invalidated_blocks=invalidated,
        invalidated_fraction=invalidated / total_blocks if total_blocks else 0.0,
        engine_cached_tokens=min(reusable_blocks * block_size, engine_cap),
    )


def verdict(diff: PromptDiff, kind: str = CHANGED_CONTENT) -> str:
    """One sentence a platform engineer can act on, e.g. "a timestamp at token 3 invalidates
    100% of blocks". ``kind`` names what changed (see :mod:`.volatile`)."""
    if diff.identical:
        return (f"identical prompts: all {diff.total_blocks} full blocks "
                f"({diff.reusable_tokens} tokens) are reusable")
    at = diff.first_divergence_token
    share = f"{diff.invalidated_fraction:.0%}"
    blocks = f"{diff.invalidated_blocks} of {diff.total_blocks} blocks"
    if diff.extends:
        return (f"B extends A at token {at}: {diff.reusable_blocks} of {diff.total_blocks} "
                f"blocks reusable, the new tokens start a fresh block")
    if diff.tokens_b == at:
        return f"B is a prefix of A: {diff.reusable_blocks} of {diff.total_blocks} blocks reusable"
    if kind == CHANGED_CONTENT:
        return f"changed content at token {at} invalidates {share} of blocks ({blocks})"
    return f"{with_article(kind)} at token {at} invalidates {share} of blocks ({blocks})"
