"""Spec of deterministic serialisation: equal content, equal text."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from prefixroute.core.diagnostics.serialize import (canonical, canonical_json, canonical_tools,
                                                    canonical_tools_json)
from prefixroute.core.errors import InputError


def tool(name: str, **properties) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": properties}}}


def test_keys_are_sorted_at_every_level_with_compact_separators():
    assert canonical_json({"b": 1, "a": [{"d": 2, "c": 3}]}) == '{"a":[{"c":3,"d":2}],"b":1}'


def test_lists_keep_their_order():
    assert canonical_json({"required": ["z", "a"]}) == '{"required":["z","a"]}'


def test_non_ascii_text_is_kept_as_is():
    assert canonical_json({"name": "Zoë"}) == '{"name":"Zoë"}'


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_are_rejected_with_their_path(bad):
    with pytest.raises(InputError, match=r"\$\.a\[1\]"):
        canonical_json({"a": [0, bad]})


def test_non_json_values_and_keys_are_rejected():
    with pytest.raises(InputError):
        canonical({"a": {1, 2}})
    with pytest.raises(InputError):
        canonical({1: "x"})


def test_tools_are_sorted_by_name():
    tools = [tool("track_shipment"), tool("create_return"), tool("lookup_order")]
    names = [t["function"]["name"] for t in canonical_tools(tools)]
    assert names == ["create_return", "lookup_order", "track_shipment"]


def test_bare_function_schemas_are_sorted_by_name_too():
    assert [t["name"] for t in canonical_tools([{"name": "b"}, {"name": "a"}])] == ["a", "b"]


def test_any_order_of_tools_and_of_schema_keys_gives_the_same_text():
    tools = [tool("a", x={"type": "string"}), tool("b"), tool("c", y={"type": "integer"})]
    reference = canonical_tools_json(tools)
    for order in itertools.permutations(tools):
        reversed_keys = json.loads(json.dumps(list(order)), object_pairs_hook=lambda pairs:
                                   dict(reversed(pairs)))
        assert canonical_tools_json(reversed_keys) == reference


def test_canonical_tools_are_ordinary_dicts_that_serialise_the_same_without_sort_keys():
    tools = canonical_tools([tool("b", z={"type": "string"}, a={"type": "string"})])
    assert json.dumps(tools, separators=(",", ":")) == canonical_tools_json(tools)


def test_no_tools_stay_none():
    assert canonical_tools(None) is None
    assert canonical_tools_json(None) == "null"


def test_tools_must_be_a_list():
    with pytest.raises(InputError):
        canonical_tools({"name": "a"})  # type: ignore[arg-type]


def test_a_nan_inside_a_tool_names_the_tool():
    with pytest.raises(InputError, match=r"\$\.tools\[1\]\.function"):
        canonical_tools([tool("a"), {"type": "function", "function": {"name": "b", "x": math.nan}}])
