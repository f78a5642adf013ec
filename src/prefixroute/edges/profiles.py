"""Engine profiles and model configs named on a command line: a preset's name or a file.

One loader for every command that takes them (``simulate``, ``sweep``, ``plan``, ``replica``):
a preset by name, else a JSON or YAML file as ``prefixroute calibrate`` writes (profiles) or as
:class:`~prefixroute.core.identity.model_config.ModelConfig` reads (model configs). A name that
is neither, a file that cannot be read or parsed, or one that holds no mapping is an input
error naming the flag or the file.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from prefixroute.core.errors import ConfigError, InputError
from prefixroute.core.identity.model_config import MODEL_PRESETS, ModelConfig
from prefixroute.core.replica.service_time import PRESETS, ServiceTimeModel, profile_from_dict

_FILE_SUFFIXES = (".json", ".yaml", ".yml")


def read_mapping(path: str, what: str) -> dict:
    """The mapping a JSON (or, by its suffix, YAML) file holds."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"no such {what} file", where=path) from None
    except OSError as exc:
        raise InputError(f"cannot read {what} file: {exc.strerror}", where=path) from None
    is_yaml = path.endswith((".yaml", ".yml"))
    try:
        if is_yaml:
            import yaml
            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as exc:  # json.JSONDecodeError, yaml.YAMLError
        raise InputError(f"not valid {'YAML' if is_yaml else 'JSON'}: {exc}",
                         where=path) from None
    if not isinstance(data, dict):
        raise InputError(f"a {what} file holds a mapping", where=path)
    return data


def _preset_or_file(spec: str, flag: str, presets: dict, what: str, build):
    if spec in presets:
        return presets[spec]
    if not (os.path.exists(spec) or spec.endswith(_FILE_SUFFIXES)):
        raise ConfigError(f"{flag} {spec!r}: neither a preset ({', '.join(presets)}) nor "
                          f"a file (JSON or YAML)")
    return build(read_mapping(spec, what), where=spec)


def load_profile(spec: str, flag: str = "--engine-profile") -> ServiceTimeModel:
    """A preset engine profile by name, or a profile file."""
    return _preset_or_file(spec, flag, PRESETS, "engine profile", profile_from_dict)


def load_model_config(spec: str, flag: str = "--model-config") -> ModelConfig:
    """A preset model config by name (what sizes a token's KV), or a model config file."""
    return _preset_or_file(spec, flag, MODEL_PRESETS, "model config", ModelConfig.from_dict)
