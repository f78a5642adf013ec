"""Block hashing: the one place every block key in prefixroute comes from.

A prompt is cut into fixed-size *full* blocks; block i's key hashes its parent's key, its
tokens and its extra keys, so equal keys mean equal prefixes (vLLM ``hash_block_tokens``,
``vllm/v1/core/kv_cache_utils.py``). A trailing partial block gets no key.

Two profiles:

``vllm``
    Byte-identical to vLLM 0.32: ``hash_fn((parent, tuple(block_token_ids), extra_keys))``
    where ``hash_fn`` is one of ``sha256`` (SHA-256 of ``pickle.dumps(obj, protocol=5)``),
    ``sha256_cbor`` (SHA-256 of canonical CBOR), ``xxhash`` / ``xxhash_cbor`` (xxh3-128 of the
    same serialisations). The first parent is ``NONE_HASH = hash_fn(seed)``, seed
    ``"vllm-none-hash"`` for the sha256 family, ``PYTHONHASHSEED`` when set (the xxhash family
    has a random per-process seed otherwise, so it can only be reproduced with a known seed).
    Extra keys, in vLLM's order: ``("lora", name, path)`` on every block, ``("mm", identifier,
    item_offset - block_start)`` for every multimodal item overlapping the block,
    ``("cache_salt", salt)`` on block 0 only; none gives ``None``. KV events publish a block as
    the low 64 bits of its digest read big-endian (``maybe_convert_block_hash``,
    ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, the default).

``native``
    The default for prefixroute's own caches: xxh3-64 over the block's token ids packed as
    little-endian uint32, seeded with the parent key, so one C call hashes a block and keys are
    small ints. The whole :class:`CacheIdentity` (model, revisions, adapter, attention, KV dtype
    and layout, salt) is folded into the first block's seed, so changing any field changes every
    key. Collision odds are those of a 64-bit hash: about n^2 / 2^65 for n distinct blocks
    (3e-8 at a million blocks); it is a routing and simulation key, not a security boundary
    (salts are, and they change the seed).
"""

from __future__ import annotations

import hashlib
import pickle
from array import array
from collections.abc import Mapping, Sequence
from typing import Any, Callable

import cbor2

from prefixroute.core.errors import ConfigError
from prefixroute.core.identity.identity import DEFAULT_IDENTITY, CacheIdentity, MediaItem

try:  # optional, as in vLLM: only the xxhash algorithms need it
    import xxhash as _xxhash
except ImportError:  # pragma: no cover - xxhash is a pinned dependency
    _xxhash = None

PROFILES = ("native", "vllm")
VLLM_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
VLLM_DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
_LOW64 = (1 << 64) - 1
_PICKLE_PROTOCOL = 5  # pickle.HIGHEST_PROTOCOL on Python 3.8+, what vLLM passes


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_pickle(obj: Any) -> bytes:
    return _require_xxhash().xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


def _xxhash_cbor(obj: Any) -> bytes:
    return _require_xxhash().xxh3_128_digest(cbor2.dumps(obj, canonical=True))


def _require_xxhash():
    if _xxhash is None:
        raise ConfigError("the xxhash algorithms need the 'xxhash' package: pip install xxhash")
    return _xxhash


VLLM_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}


def resolve_vllm_none_hash_seed(algo: str, environ: Mapping[str, str]) -> str:
    """The seed vLLM 0.32 derives NONE_HASH from (``resolve_none_hash_seed``).

    ``PYTHONHASHSEED`` wins when set; otherwise the sha256 family uses the fixed
    ``"vllm-none-hash"``, and the xxhash family a random per-process seed that nobody outside
    the engine can know, so we refuse rather than guess.
    """
    seed = environ.get("PYTHONHASHSEED")
    if seed is not None:
        return seed
    if algo.startswith("xxhash"):
        raise ConfigError(f"vLLM seeds {algo} with a random per-process value unless "
                          "PYTHONHASHSEED is set; set PYTHONHASHSEED (here and on the engine) "
                          "to reproduce its hashes")
    return VLLM_DEFAULT_NONE_HASH_SEED


def vllm_event_block_hash(digest: bytes) -> int:
    """The id vLLM publishes in KV events for a block: the digest's low 64 bits, unsigned."""
    return int.from_bytes(digest, "big") & _LOW64


def mm_extra_keys(block_start: int, block_end: int,
                  media: Sequence[MediaItem]) -> list[tuple[str, str, int]]:
    """vLLM's ``("mm", identifier, offset - block_start)`` for items overlapping a block.

    An item overlaps [block_start, block_end) when it starts before the block ends and ends
    after the block starts; ``media`` must be sorted by offset, as vLLM assumes.
    """
    keys = []
    for item in media:
        if item.offset >= block_end:
            break
        if item.offset + item.length > block_start:
            keys.append(("mm", item.identifier, item.offset - block_start))
    return keys


class BlockHasher:
    """Computes the chained keys of a prompt's full blocks for one profile and block size.

    ``block_hashes(token_ids, identity, media)`` returns one key per full block: ``bytes``
    digests for the ``vllm`` profile, ``int`` for ``native``. Pass ``parent`` and ``start`` to
    extend an existing chain (decode tokens filling new blocks) without rehashing the prefix.

    ``memo_blocks`` (``vllm`` profile, prompts without adapter or media): remember the digest
    of about that many recent blocks by their exact hash input (parent, tokens, extra keys),
    so a prompt that shares a long prefix with an earlier one looks its blocks up instead of
    pickling and hashing them again (what a gateway sees: many requests on one system prompt
    or document). Two generations of at most ``memo_blocks`` each: a lookup in the older one
    moves the entry to the newer, and when the newer fills up it becomes the older (an LRU
    approximation at dictionary speed). About 0.3 kB per block of 16 tokens.
    """

    def __init__(self, profile: str = "native", algo: str | None = None, block_size: int = 16,
                 none_hash_seed: str | None = None, memo_blocks: int = 0):
        if profile not in PROFILES:
            raise ConfigError(f"unknown hashing profile {profile!r}; choose one of "
                              f"{', '.join(PROFILES)}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ConfigError(f"block size must be an integer of at least 1, got {block_size!r}")
        if not isinstance(memo_blocks, int) or memo_blocks < 0:
            raise ConfigError(f"memo_blocks must be a non-negative integer, got {memo_blocks!r}")
        self.profile = profile
        self.block_size = block_size
        self.memo_blocks = memo_blocks
        self._memo_new: dict[tuple, bytes] = {}  # (parent, ids as bytes, extra) -> digest
        self._memo_old: dict[tuple, bytes] = {}
        if profile == "vllm":
            algo = algo or "sha256"
            if algo not in VLLM_ALGOS:
                raise ConfigError(f"unknown vllm hash algorithm {algo!r}; choose one of "
                                  f"{', '.join(VLLM_ALGOS)}")
            if algo.startswith("xxhash"):
                _require_xxhash()
                if none_hash_seed is None:
                    none_hash_seed = resolve_vllm_none_hash_seed(algo, {})
            self.algo = algo
            self._hash_fn = VLLM_HASH_FUNCTIONS[algo]
            self.none_hash_seed = none_hash_seed or VLLM_DEFAULT_NONE_HASH_SEED
            self.none_hash = self._hash_fn(self.none_hash_seed)
        else:
            if algo not in (None, "xxh3_64"):
                raise ConfigError(f"the native profile has one algorithm, xxh3_64; got {algo!r}")
            self.algo = "xxh3_64"
            _require_xxhash()
            self.none_hash_seed = none_hash_seed
            self.none_hash = None
            self._native_seeds: dict[CacheIdentity, int] = {}

    # -- public ---------------------------------------------------------------------------
    def block_hashes(self, token_ids: Sequence[int], identity: CacheIdentity = DEFAULT_IDENTITY,
                     media: Sequence[MediaItem] = (), *, parent: Any = None,
                     start: int = 0) -> list:
        """Keys of the full blocks of ``token_ids[start:]`` (``start`` a block boundary)."""
        if self.profile == "vllm":
            return self._vllm(token_ids, identity, media, parent, start)
        return self._native(token_ids, identity, media, parent, start)

    def event_block_hash(self, key: Any) -> int:
        """The 64-bit id a KV event carries for ``key`` (vLLM's convention for both profiles)."""
        if isinstance(key, int):
            return key & _LOW64
        return vllm_event_block_hash(key)

    def extra_keys(self, block_index: int, identity: CacheIdentity,
                   media: Sequence[MediaItem] = ()) -> tuple | None:
        """vLLM's extra keys for block ``block_index`` (None when there are none)."""
        keys: list = []
        if identity.adapter is not None:
            keys.append(("lora", identity.adapter.name, identity.adapter.path))
        if media:
            start = block_index * self.block_size
            keys.extend(mm_extra_keys(start, start + self.block_size, media))
        if block_index == 0 and identity.cache_salt:
            keys.append(("cache_salt", identity.cache_salt))
        return tuple(keys) if keys else None

    # -- vllm profile -----------------------------------------------------------------------
    def _vllm(self, token_ids, identity, media, parent, start) -> list[bytes]:
        block_size = self.block_size
        hash_fn = self._hash_fn
        n_full = len(token_ids) // block_size
        out: list[bytes] = []
        prev = parent if parent else self.none_hash
        first = start // block_size
        if identity.adapter is None and not media:
            # No adapter and no media: extra keys are None on every block but (with a salt)
            # the first one.
            salted = self.extra_keys(0, identity)
            if self.memo_blocks and n_full > first:
                memo = self._vllm_memo(token_ids, salted, prev, first, n_full)
                if memo is not None:
                    return memo
            # This loop is the cost we benchmark against bare pickling.
            pos = first
            if first == 0 and n_full and salted:
                prev = hash_fn((prev, tuple(token_ids[0:block_size]), salted))
                out.append(prev)
                pos = 1
            for i in range(pos * block_size, n_full * block_size, block_size):
                prev = hash_fn((prev, tuple(token_ids[i:i + block_size]), None))
                out.append(prev)
            return out
        for b in range(first, n_full):
            s = b * block_size
            prev = hash_fn((prev, tuple(token_ids[s:s + block_size]),
                            self.extra_keys(b, identity, media)))
            out.append(prev)
        return out

    def _vllm_memo(self, token_ids, salted: tuple | None, prev: bytes, first: int,
                   n_full: int) -> list[bytes] | None:
        """The plain path through the memo (see ``memo_blocks``; ``salted``: block 0's extra
        keys); None for token ids that do not fit 32 bits (the engine refuses them; the
        caller hashes them as they are).

        The memo's key is (parent digest, the block's ids as 4-byte little-endian bytes, extra
        keys): the same information as the hash input, in about a third of the memory of a
        tuple of ints. Safe from several threads: an entry is always the true digest of its
        key, so a race can only lose one."""
        block_size = self.block_size
        try:
            data = array("I", token_ids[first * block_size:n_full * block_size]).tobytes()
        except OverflowError:
            return None
        step = 4 * block_size
        hash_fn = self._hash_fn
        out: list[bytes] = []
        for b in range(first, n_full):
            off = (b - first) * step
            extra = salted if b == 0 else None
            key = (prev, data[off:off + step], extra)
            digest = self._memo_new.get(key)
            if digest is None:
                digest = self._memo_old.get(key)
                if digest is None:
                    s = b * block_size
                    digest = hash_fn((prev, tuple(token_ids[s:s + block_size]), extra))
                self._memo_new[key] = digest
                if len(self._memo_new) >= self.memo_blocks:
                    self._memo_old, self._memo_new = self._memo_new, {}
            prev = digest
            out.append(digest)
        return out

    # -- native profile ---------------------------------------------------------------------
    def _native_seed(self, identity: CacheIdentity) -> int:
        seed = self._native_seeds.get(identity)
        if seed is None:
            material = b"prefixroute-native/v1\x00" + identity.digest()
            if self.none_hash_seed:
                material += self.none_hash_seed.encode()
            seed = int.from_bytes(hashlib.sha256(material).digest()[:8], "little")
            self._native_seeds[identity] = seed
        return seed

    def native_seed(self, identity: CacheIdentity = DEFAULT_IDENTITY) -> int:
        """The parent of a ``native`` chain's first block for ``identity``."""
        return self._native_seed(identity)

    def native_chain(self, data: bytes | memoryview, parent: int) -> list[int]:
        """``native`` keys of the full blocks packed in ``data`` (token ids as little-endian
        uint32, a whole number of blocks), chained from ``parent``: the hot loop of the
        profile, for callers that already hold packed ids (many prompts in one numpy array)
        and compute their prefix's keys once."""
        digest = _xxhash.xxh3_64_intdigest
        step = self.block_size * 4
        view = memoryview(data).cast("B")
        prev = parent
        out: list[int] = []
        append = out.append
        for off in range(0, len(view) - step + 1, step):
            prev = digest(view[off:off + step], prev)
            append(prev)
        return out

    def _native(self, token_ids, identity, media, parent, start) -> list[int]:
        block_size = self.block_size
        n_full = len(token_ids) // block_size
        first = start // block_size
        if n_full <= first:
            return []
        data = memoryview(array("I", token_ids[first * block_size:n_full * block_size]).tobytes()) \
            if not isinstance(token_ids, array) else memoryview(token_ids).cast("B")[
                first * block_size * 4:n_full * block_size * 4]
        digest = _xxhash.xxh3_64_intdigest
        prev = parent if parent is not None else self._native_seed(identity)
        step = block_size * 4
        if not media:
            return self.native_chain(data, prev)
        out: list[int] = []
        for b in range(first, n_full):
            off = (b - first) * step
            keys = mm_extra_keys(b * block_size, (b + 1) * block_size, media)
            chunk = bytes(data[off:off + step])
            if keys:
                chunk += repr(keys).encode()
            prev = digest(chunk, prev)
            out.append(prev)
        return out


def tokens_for_hashing(values: Sequence[Any]) -> list[int]:
    """Token ids as plain Python ints (numpy ints pickle differently from vLLM's lists)."""
    return [int(v) for v in values]
