"""Exact ``random.Random`` draws, many at once.

The seed's fleet exercise fixes its workload by a stream of Python ``random`` calls
(``choice``, ``randint``, ``randrange``). Drawing them one call at a time costs more than the
whole simulation it feeds, so this module reproduces the same values from a block of raw
generator output.

Why this is exact (CPython's ``Random``, unchanged since 3.2 for these calls):

* ``choice(seq)``, ``randint(a, b)`` and ``randrange(n)`` all come down to ``_randbelow(n)``,
  which takes ``k = n.bit_length()`` bits with ``getrandbits(k)`` and draws again while the
  value is ``>= n`` (rejection sampling);
* ``getrandbits(k)`` for ``k <= 32`` consumes exactly one 32-bit Mersenne Twister output ``w``
  and returns ``w >> (32 - k)``;
* those outputs are MT19937's tempered 32-bit words, and numpy's ``MT19937`` bit generator is
  the same generator with the same state (624 words and an index): started from the caller's
  state, its ``random_raw`` yields the next outputs, a block of them at C speed.

So a draw of ``_randbelow(n)`` is "the next word whose top ``k`` bits are below ``n``", read
from one block of outputs. The caller's generator is then set exactly where the
one-at-a-time calls would have left it (the numpy twister's state after the words used,
handed back as a ``random`` state; the words read ahead but not used are thus given back).
``tests/unit/test_batched_draws.py`` checks every claim against ``random`` itself.
"""

from __future__ import annotations

import random

import numpy as np

from prefixroute.core.errors import ConfigError


def _check_bound(n: int) -> int:
    if not isinstance(n, int) or n < 1 or n.bit_length() > 32:
        raise ConfigError(f"batched draws need a bound between 1 and 2**32 - 1, got {n!r}")
    return 32 - n.bit_length()


class WordBlock:
    """A block of raw 32-bit outputs read ahead from a ``random.Random``, with fast lookups for
    "the next accepted draw of ``_randbelow(n)`` at or after word ``i``".

    ``accepted(n)`` lists the word indices accepted for bound ``n`` in order and ``rank(n)[i]``
    (a memoryview: Python ints on indexing, no list copy) how many of them come before word
    ``i``, so the next draw at or after word ``i`` reads word ``accepted[rank[i]]`` (none when
    that rank is past the end) and "the next ``c`` draws from ``i``" are
    ``accepted[rank[i]:rank[i] + c]`` when nothing else draws in between."""

    def __init__(self, rng: random.Random, words: int):
        self.rng = rng
        self.state = rng.getstate()
        self.size = words
        twister = _twister_at(self.state)
        if twister is not None:
            self.words = twister.random_raw(words).astype(np.uint32)
        else:  # not CPython's state layout: the generator's own words, as one integer
            raw = rng.getrandbits(32 * words).to_bytes(4 * words, "little") if words else b""
            self.words = np.frombuffer(raw, dtype="<u4").astype(np.uint32)
        self._values: dict[int, np.ndarray] = {}
        self._ok: dict[int, np.ndarray] = {}
        self._accepted: dict[int, np.ndarray] = {}
        self._rank: dict[int, memoryview] = {}

    def values(self, n: int) -> np.ndarray:
        """``getrandbits(k)`` of every word for bound ``n`` (accepted or not)."""
        out = self._values.get(n)
        if out is None:
            out = self._values[n] = self.words >> np.uint32(_check_bound(n))  # uint32
        return out

    def _accept(self, n: int) -> np.ndarray:
        ok = self._ok.get(n)
        if ok is None:
            ok = self._ok[n] = self.values(n) < n
        return ok

    def accepted(self, n: int) -> np.ndarray:
        out = self._accepted.get(n)
        if out is None:
            out = self._accepted[n] = np.flatnonzero(self._accept(n))
        return out

    def rank(self, n: int) -> memoryview:
        out = self._rank.get(n)
        if out is None:
            counts = np.zeros(self.size + 1, dtype=np.int32 if self.size < 2**31 else np.int64)
            np.cumsum(self._accept(n), out=counts[1:])
            out = self._rank[n] = memoryview(counts)
        return out

    def release(self, used: int) -> None:
        """Leave the generator as if only the first ``used`` words had been drawn."""
        twister = _twister_at(self.state)
        if twister is None:
            self.rng.setstate(self.state)
            if used:
                self.rng.getrandbits(32 * used)
            return
        twister.random_raw(used, output=False)
        position = twister.state["state"]
        version, _, gauss_next = self.state
        self.rng.setstate((version, tuple(position["key"].tolist()) + (int(position["pos"]),),
                           gauss_next))


def _twister_at(state: tuple) -> np.random.MT19937 | None:
    """numpy's Mersenne Twister at the position of a ``random.Random`` state: the same
    generator (MT19937, same tempering), its state the same 624 words and index, and
    ``random_raw`` the 32-bit outputs ``getrandbits(32)`` returns, without building one
    large Python integer of them. The state's layout, ``(3, 624 words + index, gauss)``, is
    CPython's (``getstate`` documents it as opaque): any other gives ``None``, and the
    caller draws through ``random`` itself."""
    if not (isinstance(state, tuple) and len(state) == 3 and state[0] == 3
            and isinstance(state[1], tuple) and len(state[1]) == 625):
        return None
    internal = state[1]
    twister = np.random.MT19937()
    twister.state = {"bit_generator": "MT19937",
                     "state": {"key": np.array(internal[:-1], dtype=np.uint32),
                               "pos": internal[-1]}}
    return twister


class ShortBlock(Exception):
    """The words read ahead ran out; read a larger block."""
