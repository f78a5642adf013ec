"""``prefix_hash``: the hash of a request's leading prefix, modulo the number of replicas.

Requests that share their first ``P`` tokens always land on the same replica, so that replica
keeps their shared prefix warm; no router state, no cache view, no load signal. The price is
the usual one of modulo hashing: one hot prefix makes one hot replica, and when the candidate
set changes (a replica unhealthy) most prefixes move (``consistent_hash`` moves only the lost
replica's keys).

How long a prefix decides is the one real choice. Too short and every request sharing an
opening (a system prompt) hashes alike, so one replica takes all of it; too long and the hash
reaches per-request content (user turn, timestamps) and scatters requests that could have
shared a cache. The default, 64 tokens (4 blocks at vLLM's default block size of 16), is short
on purpose: ``prefix_hash`` is the pure hash-affinity baseline, grouping every request that
shares its opening, so a universal system prompt lands on one replica, as a prefix-keyed policy
should (docs/concepts.md, worked example 2). Longer values separate families that share a
longer opening: the SGLang model gateway's ``prefix_hash`` uses ``prefix_token_count = 256``,
the fleet hit-rate example's rule 1,280 (docs/concepts.md, worked example 4: system prompt
plus the start of each tenant's document). Set it to where your cache families start to differ
(docs/concepts.md, "Prompt layout").

Parameters:

``prefix_tokens`` (default 64 = 4 blocks of 16; see above)
    the prefix length that decides the replica.
``prefix_blocks`` (default unset)
    state the length in blocks instead: hash the leading ``prefix_blocks`` block keys.
    Unset, the policy hashes ``max(1, prefix_tokens // block_size)`` block keys.
``hash_token_ids`` (default false)
    hash the request's token ids instead of its block keys, when it carries them:
    ``int(md5(" ".join(str(t) for t in token_ids[:prefix_tokens])).hexdigest(), 16) % n``.
    With ``prefix_tokens=1280`` over 4 replicas that is exactly the fleet hit-rate example's
    prefix-aware rule (its tokens are strings, and ``str`` of a string is itself). A request
    without token ids falls back to its block keys.

What is hashed, and why: by default the chained block keys (MD5 over each key's bytes, length
prefixed), because they come from :mod:`prefixroute.core.identity.hashing` and already bind the
cache identity (model, adapter, trust-group salt): requests that could never share KV are not
forced together. MD5 here is a well-spread, stable-across-processes digest, not a security
measure.

Replica = ``candidates[h % len(candidates)]`` with candidates sorted by index, so with all N
replicas offered and indexed 0..N-1 the replica is ``h % N``. A request with no full block and
no token ids has no prefix to be affine to: it goes to the least-loaded replica.
"""

from __future__ import annotations

import hashlib
from typing import Hashable, Sequence

from prefixroute.core.errors import ConfigError
from prefixroute.core.routing.base import (BasePolicy, Decision, ReplicaView, RequestView,
                                           least_loaded)
from prefixroute.core.routing.policies.common import stable_key_bytes
from prefixroute.core.routing.registry import register

DEFAULT_PREFIX_TOKENS = 64  # 4 blocks of vLLM's default 16 tokens: group by the opening


def md5_of_keys(keys: Sequence[Hashable]) -> int:
    """MD5 over the keys' bytes, each prefixed by its length (so no two key lists collide by
    concatenation), read as an unsigned integer."""
    digest = hashlib.md5(usedforsecurity=False)
    for key in keys:
        raw = stable_key_bytes(key)
        digest.update(len(raw).to_bytes(4, "big"))
        digest.update(raw)
    return int(digest.hexdigest(), 16)


def md5_of_tokens(tokens: Sequence[object]) -> int:
    """``int(md5(" ".join(tokens)).hexdigest(), 16)``: the fleet hit-rate example's formula."""
    text = " ".join(str(t) for t in tokens)
    return int(hashlib.md5(text.encode("utf-8"), usedforsecurity=False).hexdigest(), 16)


@register("prefix_hash")
class PrefixHash(BasePolicy):
    def __init__(self, prefix_tokens: int = DEFAULT_PREFIX_TOKENS,
                 prefix_blocks: int | None = None, hash_token_ids: bool = False) -> None:
        if not isinstance(prefix_tokens, int) or prefix_tokens < 1:
            raise ConfigError(f"prefix_tokens must be a positive integer, got {prefix_tokens!r}")
        if prefix_blocks is not None and (not isinstance(prefix_blocks, int) or prefix_blocks < 1):
            raise ConfigError(f"prefix_blocks must be a positive integer, got {prefix_blocks!r}")
        self.prefix_tokens = prefix_tokens
        self.prefix_blocks = prefix_blocks
        self.hash_token_ids = hash_token_ids

    def blocks_hashed(self, block_size: int) -> int:
        """How many leading block keys decide the replica at this block size."""
        if self.prefix_blocks is not None:
            return self.prefix_blocks
        return max(1, self.prefix_tokens // block_size)

    def prefix_digest(self, request: RequestView) -> tuple[int, str] | None:
        """The request's prefix hash and what it was taken over; ``None`` without a prefix."""
        if self.hash_token_ids and request.token_ids:
            tokens = request.token_ids[:self.prefix_tokens]
            return md5_of_tokens(tokens), f"{len(tokens)} leading tokens"
        keys = request.block_keys[:self.blocks_hashed(request.block_size)]
        if keys:
            return md5_of_keys(keys), f"{len(keys)} leading block keys"
        return None

    def route(self, request: RequestView, replicas: Sequence[ReplicaView]) -> Decision:
        digest = self.prefix_digest(request)
        if digest is None:
            choice = least_loaded(replicas)
            return Decision(choice.index, "no_prefix",
                            f"no full block or token ids to hash: least-loaded replica "
                            f"{choice.index}", {r.index: {"load": float(r.load)} for r in replicas})
        value, over = digest
        ordered = sorted(replicas, key=lambda r: r.index)
        slot = value % len(ordered)
        choice = ordered[slot]
        scores = {choice.index: {"hash_mod": float(slot)}}
        return Decision(choice.index, "prefix_hash",
                        f"md5 of {over} mod {len(ordered)} candidates = {slot}: "
                        f"replica {choice.index}", scores)
