"""Azure LLM inference traces (2023): ``TIMESTAMP,ContextTokens,GeneratedTokens`` per row.

They carry arrivals and lengths only, no prompt content; :func:`read_azure` yields
:class:`~prefixroute.core.simulator.generators.Shape` rows (arrival relative to the first row),
and :func:`~prefixroute.core.simulator.generators.with_prefixes` gives them prefix families.
"""

from __future__ import annotations

import csv
import os
from datetime import datetime
from typing import Iterator

from prefixroute.core.errors import InputError
from prefixroute.core.simulator.generators import Shape
from prefixroute.edges.traces.common import check_time_order, open_text

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")


def _parse_time(text: str, where: str) -> float:
    text = text.strip()
    date, _, fraction = text.partition(".")
    try:
        base = datetime.fromisoformat(date)
    except ValueError:
        raise InputError(f"expected a timestamp like 2023-11-16 18:17:03.9799600, got {text!r}",
                         where=where, field="TIMESTAMP") from None
    if fraction and not fraction.isdigit():
        raise InputError(f"bad fractional seconds in {text!r}", where=where, field="TIMESTAMP")
    return base.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)


def _count(row: dict, name: str, where: str, minimum: int) -> int:
    text = row.get(name)
    if text is None or text == "":
        raise InputError("missing field", where=where, field=name)
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"expected an integer, got {text!r}", where=where, field=name) from None
    if value < minimum:
        raise InputError(f"must be at least {minimum}, got {value}", where=where, field=name)
    return value


def read_azure(path: str | os.PathLike) -> Iterator[Shape]:
    with open_text(path) as fh:
        reader = csv.DictReader(fh)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"missing column(s) {', '.join(missing)} in the header",
                             where=f"{path}:1", field=missing[0])
        first = None
        previous = 0.0
        for row in reader:
            where = f"{path}:{reader.line_num}"
            t = _parse_time(row.get("TIMESTAMP") or "", where)
            if first is None:
                first = t
            arrival = t - first
            check_time_order(arrival, previous, where, "TIMESTAMP")
            previous = arrival
            yield Shape(arrival, _count(row, "ContextTokens", where, 1),
                        max(1, _count(row, "GeneratedTokens", where, 0)),
                        where=f"{os.path.basename(str(path))}:{reader.line_num}")
