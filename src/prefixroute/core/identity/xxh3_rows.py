"""``native`` block keys of many prompts at once: xxh3-64 in numpy, one block position a step.

A ``native`` key is ``xxh3_64(block's token ids as little-endian uint32, seed=parent key)``
(:mod:`prefixroute.core.identity.hashing`). Chaining makes one prompt's keys sequential, but
block ``b`` of *different* prompts are independent, so a batch of prompts is hashed one block
position at a time, each position one pass of numpy over every prompt: the Python cost is per
block position, not per block. The tokens come block-major (``(blocks, block_size, rows)``),
so every step reads contiguous memory; callers build that layout directly (transposing a
prompt-major array costs about as much as hashing it one block at a time).

The arithmetic is XXH3's for inputs of 17 to 128 bytes with a seed and the default secret
(``XXH3_len_17to128_64b`` in xxhash 0.8, which the ``xxhash`` package wraps): the input is read
as 16-byte lanes, lane ``i`` from the front paired with secret bytes ``32 i`` and lane ``i``
from the back with ``32 i + 16``; each lane gives ``mul128_fold64(lo ^ (secret_lo + seed),
hi ^ (secret_hi - seed))``; the sum, started at ``len * PRIME64_1``, is avalanched. numpy has
no 64 x 64 -> 128-bit product, so it is built from four 32 x 32 products (xxhash's portable
``XXH_mult64to128``). The tests check it against the ``xxhash`` package.

Supported: blocks of 8 to 32 tokens in steps of 4 (whole 16-byte lanes, 32 to 128 bytes);
:func:`supports` says whether a block size is.
"""

from __future__ import annotations

import numpy as np

_MASK32 = np.uint64(0xFFFFFFFF)
_SHIFT32 = np.uint64(32)
_SHIFT37 = np.uint64(37)
_PRIME64_1 = 0x9E3779B185EBCA87
_PRIME_MX1 = np.uint64(0x165667919E3779F9)
# The first 128 bytes of XXH3's default secret (kSecret): all that a 17..128-byte input reads.
_SECRET = np.frombuffer(bytes([
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
]), dtype="<u8").astype(np.uint64)


def supports(block_size: int) -> bool:
    """Whether :func:`chain_blocks` hashes blocks of ``block_size`` uint32 tokens."""
    return block_size % 4 == 0 and 16 < block_size * 4 <= 128


def _fold_into(a: np.ndarray, b: np.ndarray, work: list[np.ndarray]) -> np.ndarray:
    """``low64(a * b) ^ high64(a * b)`` of the 128-bit products, elementwise, written over
    ``a`` (``b`` and the four ``work`` arrays of the same shape are overwritten too). Every
    operation writes into an existing array: at a few thousand elements, allocating each
    intermediate costs about as much as computing it."""
    a_lo, a_hi, b_lo, cross = work
    np.bitwise_and(a, _MASK32, out=a_lo)
    np.right_shift(a, _SHIFT32, out=a_hi)
    np.bitwise_and(b, _MASK32, out=b_lo)
    np.multiply(a, b, out=a)  # the low 64 bits: uint64 products wrap
    np.right_shift(b, _SHIFT32, out=b)  # b_hi
    # cross = (lo_lo >> 32) + low32(hi_lo) + a_lo * b_hi  (< 2^64: no carry lost)
    np.multiply(a_lo, b, out=cross)
    np.multiply(a_lo, b_lo, out=a_lo)  # lo_lo
    np.right_shift(a_lo, _SHIFT32, out=a_lo)
    np.add(cross, a_lo, out=cross)
    np.multiply(a_hi, b_lo, out=b_lo)  # hi_lo
    np.multiply(a_hi, b, out=b)  # hi_hi
    np.bitwise_and(b_lo, _MASK32, out=a_lo)
    np.add(cross, a_lo, out=cross)
    # high 64 bits = hi_hi + (hi_lo >> 32) + (cross >> 32)
    np.right_shift(b_lo, _SHIFT32, out=b_lo)
    np.add(b, b_lo, out=b)
    np.right_shift(cross, _SHIFT32, out=cross)
    np.add(b, cross, out=b)
    return np.bitwise_xor(a, b, out=a)


def chain_blocks(tokens: np.ndarray, parents: np.ndarray,
                 columns: np.ndarray | None = None) -> np.ndarray:
    """Chained ``native`` keys of many prompts' blocks.

    ``tokens``: ``(blocks, block_size, rows)`` token ids (uint32 values), block ``b`` of
    prompt ``r`` being ``tokens[b, :, r]``; ``parents``: ``(rows,)`` the parent key of each
    prompt's first block. Returns ``(blocks, rows)`` uint64, ``out[b, r]`` the key of block
    ``b`` of prompt ``r`` (seeded with ``out[b - 1, r]``, block 0 with ``parents[r]``).

    ``columns``: prompts whose tokens come from a few shared texts (tenants' documents)
    pass those texts once, ``tokens[b, :, c]`` for text ``c``, and each prompt's text
    ``columns[r]``: the texts' lanes are read once and copied per prompt, instead of
    copying every prompt's tokens first."""
    blocks, block_size, rows = tokens.shape
    if columns is not None:
        rows = len(columns)
    if not supports(block_size):
        raise ValueError(f"blocks of {block_size} tokens are not hashed in rows (8 to 32, a "
                         f"multiple of 4)")
    length = block_size * 4
    lanes = length // 16
    # Lane i from the front reads secret bytes 32 i, lane i from the back 32 i + 16.
    order, secret_at = [], []
    for i in range((length - 1) // 32 + 1):
        order += [i, lanes - 1 - i]
        secret_at += [32 * i, 32 * i + 16]
    lane_index = np.array(order)
    secret_lo = _SECRET[[s // 8 for s in secret_at]][:, None]
    secret_hi = _SECRET[[s // 8 + 1 for s in secret_at]][:, None]
    start = np.uint64(length * _PRIME64_1 & 0xFFFFFFFFFFFFFFFF)
    out = np.empty((blocks, rows), dtype=np.uint64)
    prev = np.asarray(parents, dtype=np.uint64)
    lo_seeded, hi_seeded, lo_rows, hi_rows, *work = (
        np.empty((len(lane_index), rows), dtype=np.uint64) for _ in range(8))
    # Lane i is tokens 4i .. 4i+3: two little-endian 64-bit words; every block's at once.
    words = tokens.reshape(blocks, lanes, 4, -1).astype(np.uint64)[:, lane_index]
    lo_lanes = words[:, :, 0] | (words[:, :, 1] << _SHIFT32)
    hi_lanes = words[:, :, 2] | (words[:, :, 3] << _SHIFT32)
    with np.errstate(over="ignore"):
        for b in range(blocks):
            lo, hi = lo_lanes[b], hi_lanes[b]
            if columns is not None:
                lo = np.take(lo, columns, axis=1, out=lo_rows)
                hi = np.take(hi, columns, axis=1, out=hi_rows)
            np.add(secret_lo, prev, out=lo_seeded)
            np.bitwise_xor(lo_seeded, lo, out=lo_seeded)
            np.subtract(secret_hi, prev, out=hi_seeded)
            np.bitwise_xor(hi_seeded, hi, out=hi_seeded)
            acc = _fold_into(lo_seeded, hi_seeded, work).sum(axis=0, dtype=np.uint64)
            acc += start
            acc ^= acc >> _SHIFT37
            acc *= _PRIME_MX1
            acc ^= acc >> _SHIFT32
            out[b] = prev = acc
    return out
