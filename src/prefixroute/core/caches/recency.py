"""Least-recently-used order over keys, kept where the cycle collector does not look.

A router keeps an LRU of every replica's blocks for as long as it runs: tens of thousands of
block hashes per replica. Kept in an ``OrderedDict``, each is a container CPython's cycle
collector walks in every full collection, one memory access per key, so every full
collection becomes a pause that grows with the records and that every request in flight
waits out. CPython does not track a plain dict that holds only atoms (numbers, strings,
bytes), so :class:`RecencyOrder` keeps the order in two of those:

* ``rank``: key -> its recency number, from a counter that only goes up;
* ``keyed``: number -> key, for the live keys only, inserted in increasing numbers (so a
  dict's insertion order is the recency order).

Touching a key gives it the next number and drops its old one, leaving a hole; the oldest
key is the lowest number still in ``keyed``, found by stepping a ``head`` over the holes, each
once (amortised O(1) per touch). Deleting from the front of a dict and reading
``next(iter(...))`` instead would rescan the deleted entries until the dict is rebuilt.

Keys that are containers themselves (tuples, for instance) make the dicts tracked again:
everything still works, the collector just walks them.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from operator import is_not
from typing import Hashable, Sequence

_is_number = partial(is_not, None)  # (a C-level test for filter)


class RecencyOrder:
    """Keys from least to most recently used; each key once."""

    __slots__ = ("rank", "keyed", "head", "next")

    def __init__(self) -> None:
        self.rank: dict[Hashable, int] = {}
        self.keyed: dict[int, Hashable] = {}
        self.head = 0  # every number below this is gone
        self.next = 0  # the number the next touch gets

    def __len__(self) -> int:
        return len(self.rank)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.rank

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        return list(self.keyed.values())

    def touch(self, key: Hashable) -> None:
        """``key`` (held or new) becomes the most recent."""
        rank = self.rank
        old = rank.get(key)
        if old is not None:
            del self.keyed[old]
        n = self.next
        self.keyed[n] = key
        rank[key] = n
        self.next = n + 1

    def touch_held(self, keys: Sequence[Hashable]) -> None:
        """:meth:`touch` each of ``keys`` (distinct, all held) in order: a few C-level
        passes instead of a Python step per key."""
        deque(map(self.keyed.__delitem__, map(self.rank.__getitem__, keys)), 0)
        self.add_new(keys)

    def touch_distinct(self, keys: Sequence[Hashable]) -> None:
        """:meth:`touch` each of ``keys`` (distinct, held or not) in order, in C-level
        passes."""
        held = filter(_is_number, map(self.rank.get, keys))
        deque(map(self.keyed.__delitem__, held), 0)
        self.add_new(keys)

    def add_new(self, keys: Sequence[Hashable]) -> None:
        """``keys`` (distinct, none held) become the most recent, in order."""
        n = self.next
        numbers = range(n, n + len(keys))
        self.keyed.update(zip(numbers, keys))
        self.rank.update(zip(keys, numbers))
        self.next = n + len(keys)

    def discard(self, key: Hashable) -> bool:
        """Forget ``key``; False if it was not held."""
        n = self.rank.pop(key, None)
        if n is None:
            return False
        del self.keyed[n]
        return True

    def pop_oldest(self) -> Hashable:
        """Forget the least recently used key and return it (``KeyError`` when empty)."""
        keyed = self.keyed
        if not keyed:
            raise KeyError("pop_oldest from an empty RecencyOrder")
        head = self.head
        while head not in keyed:
            head += 1
        key = keyed.pop(head)
        self.head = head + 1
        del self.rank[key]
        return key

    def pop_oldest_many(self, count: int) -> list[Hashable]:
        """The ``count`` least recently used keys, forgotten, oldest first."""
        pop = self.pop_oldest
        return [pop() for _ in range(count)]

    def clear(self) -> None:
        self.rank.clear()
        self.keyed.clear()
        self.head = self.next = 0

    def update_order(self, keys: Sequence[Hashable]) -> None:
        """:meth:`touch` each of ``keys`` in order (repeats allowed: a key repeated ends
        where its last touch puts it)."""
        self.touch_distinct(list(dict.fromkeys(reversed(keys)))[::-1])
