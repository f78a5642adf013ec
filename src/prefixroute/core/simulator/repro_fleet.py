"""The fleet hit-rate example (docs/concepts.md, example 4): token hit rates 83.7% (random),
96.8% (prefix-aware), 0.0% (a timestamp at the top), computed by running the library.

Setup, as the example states it: 4 replicas, each an LRU of 400 blocks of 16 tokens (hit
blocks move to the recent end, missed blocks are inserted one by one, evicting the oldest);
2,000 requests per run, each a shared 1,200-token system prompt, one of 8 tenants' 800-token
documents and 60 fresh user tokens; one random stream
(``random.seed(3)``) shared by the three runs in order, drawn per request as
:func:`~prefixroute.core.simulator.generators.draw_fleet_prompt` does, then, for random
routing, ``randrange(4)``. Prefix-aware routing sends a request to
``int(md5(' '.join(first 1,280 tokens)).hexdigest(), 16) % 4``. The hit rate is hit blocks x
16 over all prompt tokens.

How it runs fast without changing a single figure:

* the random stream is drawn in one block (:func:`draw_fleet_batch`: the same values and the
  same generator state as one call at a time);
* tokens are integer ids in closed form (:func:`fleet_static_ids`, user token ``u{v}`` is
  ``FLEET_USER_ID_BASE + v``), packed per run into one numpy array;
* keys are the ``native`` block keys of :class:`BlockHasher` (xxh3-64 over packed uint32 ids,
  chained through the seed): a tenant's 124 whole static blocks are hashed once, each
  request then hashes only its last 4 blocks, every request's block ``b`` in one numpy pass
  (:func:`~prefixroute.core.identity.xxh3_rows.chain_blocks`). After a volatile head every
  block depends on the head, so all 128 blocks of every prompt are hashed, the same way; the
  blocks that lie inside the static text read their tokens from the tenant's row;
* the keys are numbered (``numpy.unique``; after a volatile head, each block by its position
  unless a sort shows its key repeated: prompts that draw the same head share their
  system-prompt blocks, whatever their tenants);
* the routing functions are plain functions of the request (neither depends on cache state),
  computed per request with the leading text of each tenant joined once. So each replica's
  whole sequence of requests is known before it is served, and its hits are computed from
  that sequence at once (:func:`~prefixroute.core.caches.lru_replay.replay_lru_hits`, which
  relies on the inclusion property of LRU): the answers of
  :meth:`~prefixroute.core.caches.key_lru.KeyLRUCache.access` one request after another,
  without a step per request.
"""

from __future__ import annotations

import hashlib
import random

import numpy as np

from prefixroute.core.caches.lru_replay import replay_lru_hits
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.xxh3_rows import chain_blocks
from prefixroute.core.simulator.generators import (FLEET_DOCUMENTS, FLEET_HEAD_ID_BASE,
                                                   FLEET_SYSTEM, FLEET_TENANTS,
                                                   FLEET_USER_ID_BASE, FLEET_USER_TOKENS,
                                                   draw_fleet_batch, fleet_static_ids)

FLEET_REPLICAS = 4
FLEET_CAPACITY_BLOCKS = 400
FLEET_BLOCK_SIZE = 16
FLEET_REQUESTS = 2000
FLEET_SEED = 3
ROUTING_PREFIX_TOKENS = 1280


def md5_route(text: bytes, replicas: int) -> int:
    """Prefix-aware routing of the worked example: ``int(md5(text).hexdigest(), 16) % n``."""
    return int.from_bytes(hashlib.md5(text).digest(), "big") % replicas


def _run(rng: random.Random, hasher: BlockHasher, static: np.ndarray, prefix_aware: bool,
         volatile: bool, requests: int, replicas: int, capacity: int) -> float:
    block_size = hasher.block_size
    batch = draw_fleet_batch(rng, requests, volatile, 0 if prefix_aware else replicas)
    tenants = np.asarray(batch.tenants, dtype=np.int64)
    user = (batch.user + FLEET_USER_ID_BASE).astype(np.uint32)
    static_len = static.shape[1]
    seed = hasher.native_seed()
    if prefix_aware:
        # The text the router hashes: the first 1,280 tokens (one fewer static token after a
        # head), joined once per tenant.
        lead = ROUTING_PREFIX_TOKENS - volatile
        leading = [" ".join((FLEET_SYSTEM + FLEET_DOCUMENTS[t])[:lead]).encode()
                   for t in FLEET_TENANTS]
        tenant_route = [md5_route(text, replicas) for text in leading]
    if volatile:
        # Every block follows the head: prompts share blocks only when they draw the same
        # head, so each prompt is hashed whole, block-major (token position, then request),
        # as chain_blocks hashes it. The blocks that lie inside the static text read it
        # from the tenants' rows rather than from a copy per request.
        full = (1 + static_len + FLEET_USER_TOKENS) // block_size * block_size
        inside = (1 + static_len) // block_size  # blocks that end within the static text
        by_tenant = np.ascontiguousarray(static.T)  # (token position, tenant)
        head_block = np.empty((block_size, requests), dtype=np.uint32)
        head_block[0] = np.asarray(batch.head, dtype=np.uint32) + FLEET_HEAD_ID_BASE
        head_block[1:] = by_tenant[:block_size - 1][:, tenants]
        end = np.empty((full - inside * block_size, requests), dtype=np.uint32)
        in_static = 1 + static_len - inside * block_size
        end[:in_static] = by_tenant[inside * block_size - 1:][:, tenants]
        end[in_static:] = user.T[:len(end) - in_static]
        first = chain_blocks(head_block.reshape(1, block_size, requests),
                             np.full(requests, seed, dtype=np.uint64))
        middle = chain_blocks(by_tenant[block_size - 1:inside * block_size - 1].reshape(
            inside - 1, block_size, len(FLEET_TENANTS)), first[-1], columns=tenants)
        keys = np.concatenate([first, middle, chain_blocks(
            end.reshape(-1, block_size, requests), middle[-1])])
        route = [md5_route(f"time={head} ".encode() + leading[tenant], replicas)
                 for head, tenant in zip(batch.head, batch.tenants)]
        # Number the blocks: each its own position, except keys that occur more than once
        # (prompts with the same head share the system prompt's blocks), found from one
        # sort. Their places are looked up by the key's low 16 bits in a table (a few false
        # candidates), then checked: a binary search of every key would cost several sorts.
        ordered = np.sort(keys, axis=None)
        repeated = np.unique(ordered[1:][ordered[1:] == ordered[:-1]])
        ids = np.arange(keys.size).reshape(requests, -1)  # request-major
        if len(repeated):
            flat, low = keys.ravel(), np.uint64(0xFFFF)
            table = np.zeros(1 << 16, dtype=bool)
            table[(repeated & low).astype(np.intp)] = True
            candidate = np.flatnonzero(table[(flat & low).astype(np.intp)])
            which = np.minimum(np.searchsorted(repeated, flat[candidate]), len(repeated) - 1)
            shared = repeated[which] == flat[candidate]
            block, request = np.divmod(candidate[shared], requests)  # keys are block-major
            ids[request, block] = keys.size + which[shared]
    else:
        # A tenant's static blocks are hashed once; each request hashes the rest of its
        # prompt (the static remainder that does not fill a block, then its user tokens).
        shared = static_len // block_size * block_size
        prefix = np.array([hasher.native_chain(memoryview(static[t, :shared]), seed)
                           for t in range(len(FLEET_TENANTS))], dtype=np.uint64)
        rest = static_len - shared
        tail_len = (rest + FLEET_USER_TOKENS) // block_size * block_size
        tail_tokens = np.empty((tail_len, requests), dtype=np.uint32)  # block-major
        tail_tokens[:rest] = static[:, shared:].T[:, tenants]
        tail_tokens[rest:] = user.T[:tail_len - rest]
        tail_keys = chain_blocks(tail_tokens.reshape(-1, block_size, requests),
                                 prefix[tenants, -1]).T
        # Block ids numbered once over the tenants' prefixes and the requests' tails.
        _, ids = np.unique(np.concatenate([prefix.ravel(), tail_keys.ravel()]),
                           return_inverse=True)
        prefix_ids = ids[:prefix.size].reshape(prefix.shape)
        ids = np.hstack([prefix_ids[tenants], ids[prefix.size:].reshape(tail_keys.shape)])
        route = [tenant_route[t] for t in batch.tenants] if prefix_aware else batch.routes
    # Routing never looks at cache state, so each replica's whole sequence is known: replay
    # it at once.
    route = np.asarray(route)
    hit_blocks = 0
    for replica in range(replicas):
        served = ids[route == replica]
        hit_blocks += int(replay_lru_hits(served, np.full(len(served), served.shape[1]),
                                          capacity).sum())
    total_tokens = requests * (static_len + FLEET_USER_TOKENS + volatile)
    return hit_blocks * block_size / total_tokens


def repro_fleet(requests: int = FLEET_REQUESTS, replicas: int = FLEET_REPLICAS,
                capacity_blocks: int = FLEET_CAPACITY_BLOCKS,
                block_size: int = FLEET_BLOCK_SIZE, seed: int = FLEET_SEED) -> dict[str, float]:
    """Token hit rates (fractions) of the three runs: ``random``, ``prefix_aware`` and
    ``timestamp_at_top`` (prefix-aware routing with a volatile first token)."""
    rng = random.Random(seed)
    hasher = BlockHasher("native", block_size=block_size)
    # Each tenant's static token ids, one row per tenant.
    static = np.stack([np.frombuffer(fleet_static_ids(t), dtype=np.uint32)
                       for t in FLEET_TENANTS])
    out = {}
    for name, prefix_aware, volatile in (("random", False, False),
                                         ("prefix_aware", True, False),
                                         ("timestamp_at_top", True, True)):
        out[name] = _run(rng, hasher, static, prefix_aware, volatile, requests, replicas,
                         capacity_blocks)
    return out
