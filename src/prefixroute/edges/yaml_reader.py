"""Reading our YAML files (gateway config, plan files) with errors that name file, line and field.

:func:`load_yaml` parses with a loader that records the line of every key and list;
:class:`ConfigReader` gives typed access to one mapping and refuses unknown keys, so a typo in a
setting is an error, not a silently ignored line.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, NoReturn

import yaml

from prefixroute.core.errors import InputError



class LineMapping(dict):
    """A YAML mapping that remembers the line of each key (1-based)."""

    line: int = 0

    def __init__(self) -> None:
        super().__init__()
        self.lines: dict[Any, int] = {}


class LineSequence(list):
    line: int = 0


class LineLoader(yaml.SafeLoader):
    pass


def _construct_mapping(loader: LineLoader, node: yaml.MappingNode) -> LineMapping:
    loader.flatten_mapping(node)
    out = LineMapping()
    out.line = node.start_mark.line + 1
    for key_node, value_node in node.value:
        key = loader.construct_object(key_node, deep=True)
        if key in out:
            raise InputError(f"duplicate key {key!r}",
                             where=f"{node.start_mark.name}:{key_node.start_mark.line + 1}")
        out[key] = loader.construct_object(value_node, deep=True)
        out.lines[key] = key_node.start_mark.line + 1
    return out


def _construct_sequence(loader: LineLoader, node: yaml.SequenceNode) -> LineSequence:
    out = LineSequence(loader.construct_object(child, deep=True) for child in node.value)
    out.line = node.start_mark.line + 1
    return out


LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)
LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, _construct_sequence)


class ConfigReader:
    """Typed access to one mapping, with errors that name file, line and field path."""

    def __init__(self, source: str, data: Any, path: str, line: int):
        self.source = source
        self.path = path
        self.line = getattr(data, "line", line)
        if not isinstance(data, dict):
            self.fail(f"expected a mapping, got {kind(data)}")
        self.data = data
        self.lines: dict = getattr(data, "lines", {})
        self.used: set[str] = set()

    def child_path(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def fail(self, message: str, key: str | None = None, line: int | None = None) -> NoReturn:
        field_path = self.child_path(key) if key is not None else (self.path or None)
        if line is None:
            line = self.lines.get(key, self.line) if key is not None else self.line
        raise InputError(message, where=f"{self.source}:{line}", field=field_path)

    def missing(self, key: str, message: str = "is required") -> NoReturn:
        """``key`` is required and absent: name a key here that looks like a typo of it
        (``ulr`` for ``url``) rather than only the absence, which would hide the cause. Only
        near-equal lengths count: the keys not read yet include valid ones read later
        (``replay_endpoint`` beside a missing ``endpoint`` is not a typo of it)."""
        others = [str(k) for k in self.data if k not in self.used and k != key
                  and abs(len(str(k)) - len(key)) <= 2]
        typo = difflib.get_close_matches(key, others, n=1, cutoff=0.6)
        if typo:
            self.fail(f"unknown key {typo[0]!r}: did you mean {key!r}? ({key!r} {message})",
                      typo[0], self.lines.get(typo[0], self.line))
        self.fail(message, key)

    def has(self, key: str) -> bool:
        return key in self.data and self.data[key] is not None

    def raw(self, key: str, default: Any = None) -> Any:
        self.used.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def string(self, key: str, default: str | None = None, *, required: bool = False,
               choices: tuple[str, ...] | None = None) -> str | None:
        value = self.raw(key)
        if value is None:
            if required:
                self.missing(key)
            return default
        if not isinstance(value, str) or not value:
            self.fail(f"expected a non-empty string, got {kind(value)}", key)
        if choices and value not in choices:
            self.fail(f"must be one of {', '.join(choices)}, got {value!r}", key)
        return value

    def integer(self, key: str, default: int | None, *, minimum: int = 0) -> int | None:
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(f"expected an integer, got {kind(value)}", key)
        if value < minimum:
            self.fail(f"must be at least {minimum}, got {value}", key)
        return value

    def number(self, key: str, default: float, *, non_negative: bool = False) -> float:
        """A number above 0; with ``non_negative``, 0 or above and finite (a switch-like
        value where 0 means off)."""
        value = self.raw(key)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
            self.fail(f"expected a number, got {kind(value)}", key)
        if non_negative:
            if not 0 <= value < float("inf"):
                self.fail(f"must be non-negative and finite, got {value:g}", key)
        elif value <= 0:
            self.fail(f"must be greater than 0, got {value}", key)
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(f"expected true or false, got {kind(value)}", key)
        return value

    def section(self, key: str) -> "ConfigReader":
        value = self.raw(key, {})
        return ConfigReader(self.source, value, self.child_path(key), self.lines.get(key, self.line))

    def sequence(self, key: str, *, required: bool = False) -> list:
        value = self.raw(key)
        if value is None:
            if required:
                self.missing(key, "is required (a list)")
            return []
        if not isinstance(value, list):
            self.fail(f"expected a list, got {kind(value)}", key)
        return value

    def item_line(self, key: str, item: Any) -> int:
        return getattr(item, "line", self.lines.get(key, self.line))

    def finish(self) -> None:
        """Unknown keys are typos: refuse them rather than silently ignore a setting."""
        for key in self.data:
            if key not in self.used:
                known = ", ".join(sorted(self.used))
                self.fail(f"unknown key {key!r} (known here: {known})", str(key),
                          self.lines.get(key, self.line))


def kind(value: Any) -> str:
    if value is None:
        return "nothing"
    if isinstance(value, bool):
        return f"a boolean ({value})"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"{type(value).__name__} {value!r}"[:60]




def load_yaml(path: str | Path, what: str = "config") -> Any:
    """Parse a YAML file with line numbers; :class:`InputError` naming the file and line."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{what} file not found", where=str(path)) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the {what} file: {exc}", where=str(path)) from None
    loader = LineLoader(text)
    loader.name = str(path)  # marks (and so our line numbers) name the file
    try:
        data = loader.get_single_data()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise InputError(f"not valid YAML: {exc.problem or exc}", where=f"{path}{line}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"not valid YAML: {exc}", where=str(path)) from None
    finally:
        loader.dispose()
    if data is None:
        raise InputError(f"the {what} file is empty", where=str(path))
    return data
