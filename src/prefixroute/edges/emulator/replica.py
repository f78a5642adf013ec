"""One emulated vLLM replica without I/O: the engine, its block pool, hashing and KV events.

:class:`EmulatedReplica` puts together the pieces the rest of the project owns — the
continuous-batching :class:`~prefixroute.core.replica.engine.ReplicaEngine` over a
:class:`~prefixroute.core.caches.paged_pool.PagedBlockPool`, block keys from
:class:`~prefixroute.core.identity.hashing.BlockHasher` (the ``vllm`` profile, so keys are
vLLM's own digests) and the event types of :mod:`prefixroute.core.kvevents` — and adds only
what an engine server needs on top: per-request metadata for the events, and the order in
which vLLM 0.32 emits them. It reads no clock: the caller passes ``now``.

Keys cover the prompt *and* the output tokens (the dummy reply is known at submission), so
decode blocks are cached as they fill, as vLLM caches them; the engine never caches the block
holding the last sampled token's slot, which has no KV.

Events, in vLLM's order (``vllm/v1/core/block_pool.py``; see docs/vllm-0.32-kv-semantics.md):

* ``BlockStored`` when a step schedules the tokens that fill blocks (one event per request and
  step: the new blocks, their parent, tokens, per-block untagged ``extra_keys``, the LoRA
  name and id, ``medium="GPU"``, ``group_idx=0``, ``kv_cache_spec_kind="full_attention"``,
  the request's ``session_id``);
* ``BlockRemoved`` (one hash each) when an allocation reuses a cached free block (lazy LRU
  eviction), never when a block is merely freed;
* ``AllBlocksCleared`` on a successful prefix-cache reset;
* with ``kv_cache_report_mode="full"`` a request's prefix hit is re-published as one
  ``BlockStored`` from the root at lookup time, before anything its admission evicts.

:meth:`EmulatedReplica.take_events` hands out what accumulated; the server publishes it as one
batch per engine step, as vLLM's scheduler does in ``update_from_output``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Hashable, Sequence

from prefixroute.core.caches.base import cacheable_blocks
from prefixroute.core.caches.paged_pool import PagedBlockPool
from prefixroute.core.identity.hashing import BlockHasher
from prefixroute.core.identity.identity import Adapter, CacheIdentity, MediaItem
from prefixroute.core.kvevents import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)
from prefixroute.core.replica.engine import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_MAX_NUM_SEQS,
    EngineEvent,
    ReplicaEngine,
)
from prefixroute.core.replica.service_time import ServiceTimeModel

KV_CACHE_SPEC_KIND = "full_attention"  # vLLM 0.32 stamps this on every BlockStored of a
# plain decoder model (KVCacheManager.take_events); the only KV cache group is 0.
KV_CACHE_GROUP = 0
ABORTED_KEPT = 1024  # aborted requests whose event metadata is kept (see abort)


@dataclass(slots=True)
class SequenceMeta:
    """What the KV events of one engine request carry besides hashes and tokens."""

    identity: CacheIdentity
    media: tuple[MediaItem, ...] = ()
    lora_id: int | None = None
    session_id: str | None = None
    report_full: bool = False
    priority: int = 0  # the request's ``priority`` (orders the queue under priority scheduling)

    @property
    def plain(self) -> bool:
        return (self.identity.adapter is None and not self.media and not self.identity.cache_salt
                and self.session_id is None)


class _EventRecorder:
    """The pool's :class:`~prefixroute.core.caches.base.CacheEventListener`: turns cache
    changes into vLLM events. ``owner`` is the request the pool is working for (set by
    :class:`_ObservedPool`), whose metadata fills the event."""

    def __init__(self, replica: "EmulatedReplica"):
        self.replica = replica
        self.owner: Hashable | None = None
        self.first_index = 0  # chain index of the first block the pool is about to store
        self.events: list[KVEvent] = []

    def on_stored(self, keys: Sequence[Hashable], parent: Hashable | None,
                  token_ids: Sequence[int] | None) -> None:
        replica = self.replica
        meta = replica.meta_of(self.owner)
        self.events.append(replica.stored_event(keys, parent, token_ids, meta,
                                                self.first_index))

    def on_removed(self, keys: Sequence[Hashable]) -> None:
        to_id = self.replica.hasher.event_block_hash
        for key in keys:
            self.events.append(BlockRemoved((to_id(key),), MEDIUM_GPU, KV_CACHE_GROUP))

    def on_cleared(self) -> None:
        self.events.append(AllBlocksCleared())


class _ObservedPool(PagedBlockPool):
    """The project's paged pool, telling the event recorder which request it serves.

    Nothing about caching changes; the two hooks only add what vLLM's events carry per request
    (``commit`` names the owner; ``admit`` publishes a full-mode hit report at lookup time,
    before the admission's allocations can evict anything, as ``get_computed_blocks`` does).
    """

    recorder: _EventRecorder

    def admit(self, owner, keys, num_tokens):
        recorder = self.recorder
        recorder.owner = owner
        meta = recorder.replica.meta_of(owner)
        if meta is not None and meta.report_full:
            hit = min(self.match(keys), cacheable_blocks(num_tokens, self.block_size))
            if hit:
                recorder.events.append(recorder.replica.stored_event(
                    keys[:hit], None, recorder.replica.token_ids_of(owner, hit), meta, 0))
        return super().admit(owner, keys, num_tokens)

    def commit(self, owner, keys, computed_tokens, token_ids=None):
        recorder = self.recorder
        recorder.owner = owner
        # The blocks stored next start after the ones the request already registered.
        recorder.first_index = self._owners[owner].num_cached
        super().commit(owner, keys, computed_tokens, token_ids)


class EmulatedReplica:
    """A vLLM replica as the emulator runs it: submit token sequences, advance time, read
    client-visible engine events and KV events."""

    def __init__(self, *, num_blocks: int, block_size: int, service: ServiceTimeModel,
                 hash_algo: str = "sha256", none_hash_seed: str | None = None,
                 record_events: bool = True,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS, scheduling_policy: str = "fcfs"):
        self.block_size = block_size
        self.hasher = BlockHasher("vllm", hash_algo, block_size, none_hash_seed=none_hash_seed)
        self.record_events = record_events
        self._recorder = _EventRecorder(self) if record_events else None
        if record_events:
            self.pool: PagedBlockPool = _ObservedPool(num_blocks, block_size, self._recorder)
            self.pool.recorder = self._recorder  # type: ignore[attr-defined]
        else:
            self.pool = PagedBlockPool(num_blocks, block_size)
        self.engine = ReplicaEngine(self.pool, service,
                                    max_num_batched_tokens=max_num_batched_tokens,
                                    max_num_seqs=max_num_seqs,
                                    scheduling_policy=scheduling_policy)
        # Per engine request, while it is in the engine (only when events are recorded): its
        # metadata and its tokens (full-mode hit reports carry the hit blocks' tokens).
        self._meta: dict[Hashable, SequenceMeta] = {}
        self._tokens: dict[Hashable, Sequence[int]] = {}
        self._aborted: deque[Hashable] = deque(maxlen=ABORTED_KEPT)

    # -- requests ------------------------------------------------------------------------------
    def block_keys(self, token_ids: Sequence[int], identity: CacheIdentity,
                   media: Sequence[MediaItem] = ()) -> list:
        return self.hasher.block_hashes(token_ids, identity, media)

    def submit(self, request_id: Hashable, prompt_ids: Sequence[int],
               output_ids: Sequence[int], now: float, meta: SequenceMeta,
               keys: list | None = None) -> None:
        """Queue one sequence: ``prompt_ids`` then the ``output_ids`` it will generate."""
        tokens = list(prompt_ids) + list(output_ids)
        if keys is None:
            keys = self.block_keys(tokens, meta.identity, meta.media)
        if self.record_events:
            self._meta[request_id] = meta
            self._tokens[request_id] = tokens
        self.engine.submit(request_id, len(prompt_ids), len(output_ids), keys, now,
                           token_ids=tokens if self.record_events else None,
                           priority=meta.priority)

    def advance(self, now: float) -> list[EngineEvent]:
        events = self.engine.advance(now)
        if self.record_events:
            for event in events:
                if event.kind != "first_token":
                    self.forget(event.request_id)
        return events

    def abort(self, request_id: Hashable, now: float) -> bool:
        """Drop a request. A running one leaves at the end of the step in progress and may
        still store blocks until then, so its event metadata is kept a while (the last
        ``ABORTED_KEPT`` aborted requests) rather than dropped at once."""
        if self.record_events:
            if len(self._aborted) == self._aborted.maxlen:
                self.forget(self._aborted[0])
            self._aborted.append(request_id)
        return self.engine.abort(request_id, now)

    def forget(self, request_id: Hashable) -> None:
        """Drop a request's event metadata (it finished, was rejected or aborted)."""
        self._meta.pop(request_id, None)
        self._tokens.pop(request_id, None)

    def reset_prefix_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache``: refused (False) while requests hold blocks."""
        return self.pool.reset()

    # -- KV events -----------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        if self._recorder is None or not self._recorder.events:
            return []
        events, self._recorder.events = self._recorder.events, []
        return events

    def meta_of(self, request_id: Hashable | None) -> SequenceMeta | None:
        return self._meta.get(request_id)

    def token_ids_of(self, request_id: Hashable, num_blocks: int) -> tuple[int, ...]:
        tokens = self._tokens.get(request_id, ())
        return tuple(tokens[:num_blocks * self.block_size])

    def stored_event(self, keys: Sequence[Hashable], parent: Hashable | None,
                     token_ids: Sequence[int] | None, meta: SequenceMeta | None,
                     first_index: int) -> BlockStored:
        to_id = self.hasher.event_block_hash
        extra: tuple | None
        adapter: Adapter | None = None
        lora_id = session_id = None
        if meta is None or meta.plain:
            extra = (None,) * len(keys)
        else:
            adapter = meta.identity.adapter
            lora_id = meta.lora_id
            session_id = meta.session_id
            extra = tuple(_event_extra_keys(self.hasher.extra_keys(first_index + i,
                                                                   meta.identity, meta.media))
                          for i in range(len(keys)))
        return BlockStored(
            block_hashes=tuple(to_id(k) for k in keys),
            parent_block_hash=to_id(parent) if parent is not None else None,
            token_ids=tuple(token_ids) if token_ids is not None else (),
            block_size=self.block_size,
            lora_id=lora_id if adapter is not None else None,
            medium=MEDIUM_GPU,
            lora_name=adapter.name if adapter is not None else None,
            extra_keys=extra,
            group_idx=KV_CACHE_GROUP,
            kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            session_id=session_id)


def _event_extra_keys(keys: tuple | None) -> tuple | None:
    """vLLM ``to_event_extra_keys``: the untagged form consumers read (LoRA name and salt bare,
    multimodal items as ``(identifier, offset)``)."""
    if keys is None:
        return None
    return tuple(key[1:] if key[0] == "mm" else key[1] for key in keys)
