"""A decision's scores, each replica's built only when read.

A policy that scores every replica (``prefixroute`` does, over a fleet of 32 in a million-
request simulation) would otherwise build a dict of figures per replica per request, while
those dicts are read only by the gateway's decision log, the lifecycle's fallback and tests.
:class:`LazyScores` keeps each replica's row (the figures, already computed) and turns it
into its dict on first read, so the numbers are the same whether or not anyone looks.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Iterator


class LazyScores(Mapping):
    """``index -> dict of figures``: ``rows[index]`` made into a dict by ``build`` when first
    read, then kept. Compares and iterates as a plain dict and pickles as one; a JSON
    encoder takes ``dict(scores)``."""

    __slots__ = ("_rows", "_build", "_built")

    def __init__(self, rows: dict[int, Any], build: Callable[[Any], dict[str, float]]) -> None:
        self._rows = rows
        self._build = build
        self._built: dict[int, dict[str, float]] = {}

    def __getitem__(self, index: int) -> dict[str, float]:
        built = self._built.get(index)
        if built is None:
            built = self._built[index] = self._build(self._rows[index])
        return built

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def __repr__(self) -> str:
        return repr(dict(self))

    def __reduce__(self) -> tuple:
        return dict, (dict(self),)
