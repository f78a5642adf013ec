"""Deterministic serialisation of JSON and tool schemas (a layout rule: serialise
deterministically).

Chat templates render tools with ``tojson``, which keeps the caller's key order, and most clients
build tool lists from dicts and registries whose order depends on import order or a set. Two
requests with the same tools in another order, or the same schema with keys in another order,
render different tokens and share no cached block past the first difference. Serialising through
this module makes equal content give equal bytes: keys sorted at every level, fixed separators,
tools sorted by name, and no NaN or infinity (not JSON, and rendered differently by different
serialisers).
"""

from __future__ import annotations

import json
import math
from typing import Any

from prefixroute.core.errors import InputError

SEPARATORS = (",", ":")


def canonical(value: Any, path: str = "$") -> Any:
    """A copy of a JSON value with every object's keys in sorted order.

    Lists keep their order (it is meaning: ``required``, ``enum``, messages). Raises
    :class:`InputError` for NaN, infinities and values JSON cannot hold, naming the path.
    """
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise InputError(f"object key {key!r} is not a string", where=path)
        return {key: canonical(value[key], f"{path}.{key}") for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(item, f"{path}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, float):
        if math.isnan(value) or math.isinf(value):
            raise InputError(f"{value} is not valid JSON", where=path)
        return value
    if value is None or isinstance(value, (str, int, bool)):
        return value
    raise InputError(f"{type(value).__name__} is not a JSON value", where=path)


def canonical_json(value: Any) -> str:
    """``value`` as compact JSON with sorted keys: equal content, equal text."""
    return json.dumps(canonical(value), separators=SEPARATORS, ensure_ascii=False,
                      allow_nan=False)


def tool_name(tool: Any) -> str:
    """The name of an OpenAI tool (``{"type": "function", "function": {"name": ...}}``) or of a
    bare function schema (``{"name": ...}``); ``""`` when it has none."""
    if isinstance(tool, dict):
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            return function["name"]
        if isinstance(tool.get("name"), str):
            return tool["name"]
    return ""


def canonical_tools(tools: list[Any] | None) -> list[Any] | None:
    """The tool list sorted by name (ties by their canonical JSON), each schema key-sorted.

    Pass the result as ``tools`` and every request with the same tools renders the same tokens.
    """
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InputError("tools must be a list", field="tools")
    keyed = []
    for i, tool in enumerate(tools):
        clean = canonical(tool, f"$.tools[{i}]")
        text = json.dumps(clean, separators=SEPARATORS, ensure_ascii=False, allow_nan=False)
        keyed.append((tool_name(tool), text, clean))
    keyed.sort(key=lambda item: (item[0], item[1]))
    return [item[2] for item in keyed]


def canonical_tools_json(tools: list[Any] | None) -> str:
    """The canonical tool list as compact JSON (``"null"`` for no tools)."""
    return json.dumps(canonical_tools(tools), separators=SEPARATORS, ensure_ascii=False,
                      allow_nan=False)
