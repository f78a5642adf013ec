"""A decision's scores, each replica's built only when read.

A policy that scores every replica (``prefixroute`` does, over a fleet of 32 in a million-
request simulation) would otherwise build a dict of figures per replica per request, while
those dicts are read only by the gateway's decision log, the lifecycle's fallback and tests.
:class:`LazyScores` keeps each replica's row (the figures, already computed) and turns it
into its dict on first read, so the numbers are the same whether or not anyone looks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator, Sequence


class LazyScores(Mapping):
    """``index -> dict of figures`` over ``rows``, one record per replica whose first item
    is its index: a row is made into its dict by ``build`` when first read, then kept (and
    the index is built at the first lookup, so a decision nobody reads costs neither).
    Compares and iterates as a plain dict, in the rows' order, and pickles as one; a JSON
    encoder takes ``dict(scores)``."""

    __slots__ = ("_rows", "_build", "_built", "_by_index")

    def __init__(self, rows: Sequence[Sequence[Any]],
                 build: Callable[[Any], dict[str, float]]) -> None:
        self._rows = rows
        self._build = build
        self._built: dict[object, dict[str, float]] = {}
        self._by_index: dict[object, Any] | None = None

    def _index(self) -> dict[object, Any]:
        by_index = self._by_index
        if by_index is None:
            by_index = self._by_index = {row[0]: row for row in self._rows}
        return by_index

    # (``object``: a key of another type is missing, as in a dict, not a TypeError compiled.)
    def __getitem__(self, index: object) -> dict[str, float]:
        built = self._built.get(index)
        if built is None:
            built = self._built[index] = self._build(self._index()[index])
        return built

    def __iter__(self) -> Iterator[Any]:
        return iter(self._index())

    def __len__(self) -> int:
        return len(self._index())

    def __repr__(self) -> str:
        return repr(dict(self))

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)
