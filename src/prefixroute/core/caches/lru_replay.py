"""Hits of a whole known sequence of requests on one LRU of blocks, computed at once.

The rule replayed is :meth:`KeyLRUCache.access <prefixroute.core.caches.key_lru.KeyLRUCache.access>`
without a TTL: the longest live prefix of a request's blocks hits; every block is then touched
or inserted in order, each insertion past the capacity evicting the least recently used. The
fleet worked example replays 2,000 prompts of 128 blocks per run this way; when the routing
does not depend on cache state, each replica's whole sequence is known before it is replayed.

Why no cache is simulated. Every access makes its block the most recent (a miss inserts it,
a hit touches it), so the cache at any moment holds exactly the ``capacity`` most recently
accessed distinct blocks: the inclusion property of LRU (Mattson et al., "Evaluation
techniques for storage hierarchies", 1970). Which blocks those are follows from the sequence
alone, not from the order of evictions, and even a block evicted by an earlier insertion of
its own request comes out right: it is simply no longer among the most recent.

So, with requests numbered in order and position ``k`` (one access of one block) *alive* at
the start of request ``b`` when ``k`` comes before ``b`` and its block is not accessed again
before ``b`` (``k`` is its block's latest access):

* the cache at the start of ``b`` holds the blocks of the ``capacity`` latest alive
  positions; call the oldest of them the *cut* (no cut while fewer are alive);
* while a request's leading blocks hit, it only touches blocks and the cache's contents do
  not change, so its hits are the leading run of its blocks whose previous access is at or
  after the cut (a block named twice in the request counts as present the second time, as
  its first access in the leading run was a hit and touched it).

Finding every request's cut in array operations. Position ``k`` of request ``j`` stays alive
until the request of its block's next access. A histogram per request of how many requests
later its positions die gives the alive count of request ``j`` at the start of any later
request; summing those counts over the ``window`` requests before ``b``, newest first, finds
the request that holds the cut, and within it the cut is the right alive position counted
from its end (worked out only where ``b`` last accessed some block in that request; anywhere
else in it gives the same answers). Requests that keep re-reading the same blocks leave
little alive each, so the cut can lie further back: a request whose window holds fewer than
``capacity`` alive positions while older requests exist looks again over a window four times
as long, and once the counts
would pass a few per access, the rest scan positions one request at a time. Cost: a sort of
the positions by block and a few passes over ``requests x window`` counts, with no step per
request.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from prefixroute.core.errors import ConfigError

DEFAULT_WINDOW = 32  # requests looked back at once (any value gives the same answers)
# Widening the window stops once its counts (requests x window) pass this many per access;
# the requests still unresolved then scan positions one request at a time.
_COUNT_BUDGET = 4


def replay_lru_hits(ids: np.ndarray, lengths: Sequence[int] | np.ndarray, capacity: int,
                    window: int = DEFAULT_WINDOW) -> np.ndarray:
    """Leading hit blocks of each request, replayed in order on an LRU of ``capacity``
    blocks that starts empty (module docstring).

    ``ids``: the requests' block ids (non-negative integers, equal ids for equal blocks), one
    request after the other; ``lengths``: how many of them each request has. ``window``:
    requests looked back at once when locating a cut (tuning only)."""
    if not isinstance(capacity, (int, np.integer)) or capacity < 0:
        raise ConfigError(f"capacity must be a non-negative integer, got {capacity!r}")
    if not isinstance(window, int) or window < 1:
        raise ConfigError(f"window must be a positive integer, got {window!r}")
    ids = np.asarray(ids, dtype=np.int64).ravel()
    lengths = np.asarray(lengths, dtype=np.int64)
    n, requests = len(ids), len(lengths)
    if lengths.ndim != 1 or np.any(lengths < 0) or int(lengths.sum()) != n:
        raise ConfigError(f"lengths must be non-negative and add up to the {n} ids")
    if n and ids.min() < 0:
        raise ConfigError("block ids must be non-negative")
    hits = np.zeros(requests, dtype=np.int64)
    if capacity == 0 or n == 0:
        return hits  # nothing is ever cached / nothing to serve
    starts = np.zeros(requests + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    request = np.repeat(np.arange(requests), lengths)  # the request of each position
    earlier, later = _repeats(ids)
    if not len(later):
        return hits  # no block is accessed twice: nothing can hit
    # The request of each position's next access (``requests`` when none): a position of
    # request j is alive at the start of request b > j exactly while this is >= b.
    comes_back = request[later]
    dies_at = np.full(n, requests, dtype=np.int64)
    dies_at[earlier] = comes_back
    cut = _cuts(request, dies_at, earlier, comes_back, lengths, starts, capacity, window)
    present = np.zeros(n, dtype=bool)
    present[later] = earlier >= cut[comes_back]
    missed = np.flatnonzero(~present)
    first = np.ones(len(missed), dtype=bool)
    missed_in = request[missed]
    first[1:] = missed_in[1:] != missed_in[:-1]
    hits[:] = lengths
    hits[missed_in[first]] = missed[first] - starts[missed_in[first]]
    return hits


def _repeats(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every pair of consecutive accesses of one block, as positions ``(earlier, later)``:
    one sort of the positions by block, then by position."""
    n = len(ids)
    shift = max(1, int(n).bit_length())
    top = int(ids.max())
    if top < 1 << 16:
        # Few distinct blocks: numpy's stable sort of 16-bit keys is a radix sort.
        small = ids.astype(np.uint16)
        order = np.argsort(small, kind="stable")
        block = small[order]
    elif top < 1 << (62 - shift):
        # One int64 key per access (block, then position): a plain sort, fast in numpy.
        keys = np.sort((ids << shift) | np.arange(n))
        order = keys & ((1 << shift) - 1)
        block = keys >> shift
    else:
        order = np.argsort(ids, kind="stable")
        block = ids[order]
    same = block[1:] == block[:-1]
    return order[:-1][same], order[1:][same]


def _cuts(request: np.ndarray, dies_at: np.ndarray, earlier: np.ndarray,
          comes_back: np.ndarray, lengths: np.ndarray, starts: np.ndarray, capacity: int,
          window: int) -> np.ndarray:
    """For each request, a cut: its previous accesses at or after the cut are cached at its
    start (0 while fewer than ``capacity`` positions are alive: every earlier access is then
    cached). ``earlier``: the positions whose block comes back, ``comes_back`` the request
    where it does.

    The cut is exact (the oldest cached position) where the request's blocks were last
    accessed in the request that holds it; elsewhere any position of that request serves.
    Requests whose ``window`` latest predecessors hold fewer than ``capacity`` alive
    positions look again over a window four times as long, while the counts stay within a
    few times the number of accesses; the rest scan positions."""
    requests = len(lengths)
    cut = np.zeros(requests, dtype=np.int64)
    pending = np.arange(requests)
    window = min(window, requests)
    last_in = request[earlier]
    lag = comes_back - last_in
    while len(pending):
        # dead[j, i - 1]: positions of request j whose block comes back within i requests
        # (before request j + i), i = 1 .. window.
        dead = np.bincount(last_in * (window + 1) + np.minimum(lag, window),
                           minlength=requests * (window + 1))
        dead = np.cumsum(dead.reshape(requests, window + 1)[:, :window], axis=1)
        # alive[b, i - 1]: positions of request pending[b] - i alive at its start.
        back = np.arange(1, window + 1)
        source = pending[:, None] - back
        valid = source >= 0
        source = np.where(valid, source, 0)
        alive = np.where(valid, lengths[source] - dead[source, back - 1], 0)
        newest = np.cumsum(alive, axis=1)  # alive in the i latest requests
        reached = newest[:, -1] >= capacity
        boundary = pending[reached]
        if len(boundary):
            depth = np.argmax(newest[reached] >= capacity, axis=1)  # i - 1 of the holder
            holder = np.full(requests, -1, dtype=np.int64)
            holder[boundary] = boundary - depth - 1
            cut[boundary] = starts[holder[boundary]]
            # Where the holder is where some block of the request was last accessed, the
            # cut is the need-th alive position of the holder counted from its end.
            exact = np.zeros(requests, dtype=bool)
            exact[comes_back[holder[comes_back] == last_in]] = True
            exact = exact[boundary]
            if np.any(exact):
                depth, boundary = depth[exact], boundary[exact]
                above = np.where(depth > 0, newest[reached][exact, np.maximum(depth - 1, 0)],
                                 0)
                cut[boundary] = _nth_alive_from_end(holder[boundary], boundary,
                                                    capacity - above, lengths, starts,
                                                    dies_at)
        # Not reached with every earlier request in the window: fewer than capacity alive.
        pending = pending[~reached & (pending > window)]
        if len(pending) and requests * window * 4 > _COUNT_BUDGET * len(request):
            for b in pending.tolist():
                cut[b] = _scan_cut(dies_at, b, int(starts[b]), int(starts[b - window]),
                                   capacity)
            break
        window = min(4 * window, requests)
    return cut


def _nth_alive_from_end(holder: np.ndarray, boundary: np.ndarray, need: np.ndarray,
                        lengths: np.ndarray, starts: np.ndarray,
                        dies_at: np.ndarray) -> np.ndarray:
    """Position of the ``need``-th alive position of request ``holder`` counted from its
    end, alive meaning at the start of request ``boundary`` (element-wise; all at once)."""
    size = lengths[holder]
    offset = np.zeros(len(holder) + 1, dtype=np.int64)
    np.cumsum(size, out=offset[1:])
    row = np.repeat(np.arange(len(holder)), size)
    position = starts[holder][row] + np.arange(offset[-1]) - offset[row]
    alive = dies_at[position] >= boundary[row]
    running = np.cumsum(alive)
    # Alive positions from each one to the end of its request, itself included.
    from_end = running[offset[1:] - 1][row] - running + alive
    return position[alive & (from_end == need[row])]


def _scan_cut(dies_at: np.ndarray, b: int, start: int, low: int, capacity: int) -> int:
    """The oldest cached position at the start of request ``b`` (position ``start``),
    scanning positions back from ``low`` (known to leave fewer than ``capacity`` alive after
    it) over ever wider spans."""
    span = max(start - low, 1)
    while True:
        low = max(0, start - 2 * span)
        alive = low + np.flatnonzero(dies_at[low:start] >= b)
        if len(alive) >= capacity:
            return int(alive[-capacity])
        if low == 0:
            return 0
        span *= 2
