"""Policies by name: ``NAME[:key=value,...]`` specs, as the CLI and the gateway config write them.

Each policy module under ``policies/`` registers its class with :func:`register`; the module
list below is the catalogue (order = the order ``all`` expands to). A policy's parameters are
its constructor's keyword arguments, or, for a class with a ``params_type`` (a dataclass), that
dataclass's fields: the policy is then built as ``cls(params_type(**values))``, and a
parameter the dataclass lists in its ``REMOVED`` mapping gets that mapping's explanation.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable

from prefixroute.core.errors import ConfigError

POLICY_MODULES = [
    "round_robin", "random_choice", "least_loaded", "power_of_two", "consistent_hash",
    "prefix_hash", "affinity_only", "hybrid",
    "sglang_cache_aware", "ray_prefix_affinity", "llmd_weighted", "dynamo_kv_cost",
    "aibrix_prefix_cache", "preble_e2",
    "prefixroute",
]

_REGISTRY: dict[str, type] = {}
_loaded = False


def register(name: str) -> Callable[[type], type]:
    def wrap(cls: type) -> type:
        cls.name = name
        _REGISTRY[name] = cls
        return cls
    return wrap


def _load() -> None:
    global _loaded
    if _loaded:
        return
    for module in POLICY_MODULES:
        try:
            importlib.import_module(f"prefixroute.core.routing.policies.{module}")
        except ModuleNotFoundError as exc:
            if exc.name != f"prefixroute.core.routing.policies.{module}":
                raise
    _loaded = True


def policy_names() -> list[str]:
    _load()
    return list(_REGISTRY)


def _convert(text: str, annotation: Any, default: Any) -> Any:
    kind = annotation if annotation is not inspect.Parameter.empty else type(default)
    if isinstance(kind, str):
        kind = {"int": int, "float": float, "bool": bool, "str": str}.get(
            kind.split("|")[0].strip(), type(default))
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected true/false, got {text!r}")
    if kind in (int, float):
        return kind(text)
    if default is None:
        for candidate in (int, float):
            try:
                return candidate(text)
            except ValueError:
                pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, str]]:
    name, _, rest = spec.partition(":")
    params: dict[str, str] = {}
    if rest:
        for item in rest.split(","):
            key, eq, value = item.partition("=")
            if not eq or not key:
                raise ConfigError(f"policy {spec!r}: parameters are key=value, got {item!r}")
            params[key.strip()] = value.strip()
    return name.strip(), params


def create_policy(spec: str, **context: Any):
    """Build a policy from ``NAME[:key=value,...]``. ``context`` passes run facts a policy may
    accept (``seed``, ``num_replicas``, ``block_size``); unknown parameters are an error."""
    _load()
    name, raw = parse_spec(spec)
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ConfigError(f"unknown policy {name!r}; known: {', '.join(_REGISTRY)}")
    params_type = getattr(cls, "params_type", None)
    if params_type is not None:
        return _create_with_params(name, cls, params_type, raw)
    signature = inspect.signature(cls.__init__)
    params = {k: v for k, v in signature.parameters.items() if k != "self"}
    kwargs: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in params:
            known = ", ".join(params) or "none"
            raise ConfigError(f"policy {name!r} has no parameter {key!r}; its parameters: {known}")
        p = params[key]
        try:
            kwargs[key] = _convert(text, p.annotation, p.default)
        except ValueError as exc:
            raise ConfigError(f"policy {name!r} parameter {key!r}: {exc}") from None
    for key, value in context.items():
        if key in params and key not in kwargs:
            kwargs[key] = value
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {name!r}: {exc}") from None


def _create_with_params(name: str, cls: type, params_type: type, raw: dict[str, str]):
    """A policy configured by one parameters dataclass (run facts are not its parameters)."""
    fields = {f.name: f for f in dataclasses.fields(params_type)}
    values: dict[str, Any] = {}
    for key, text in raw.items():
        field = fields.get(key)
        if field is None:
            why = getattr(params_type, "REMOVED", {}).get(key)
            if why:
                raise ConfigError(f"policy {name!r} parameter {key!r}: {why}")
            raise ConfigError(f"policy {name!r} has no parameter {key!r}; its parameters: "
                              f"{', '.join(fields)}")
        try:
            values[key] = _convert(text, field.type, field.default)
        except ValueError as exc:
            raise ConfigError(f"policy {name!r} parameter {key!r}: {exc}") from None
    try:
        return cls(params_type(**values))
    except ConfigError:
        raise
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"policy {name!r}: {exc}") from None


def expand_specs(specs: list[str]) -> list[str]:
    """``all`` stands for every registered policy with its defaults."""
    out: list[str] = []
    for spec in specs:
        if spec == "all":
            out.extend(n for n in policy_names() if n not in out)
        elif spec not in out:
            out.append(spec)
    return out
