"""Typed configuration: dataclass trees, overridden from YAML and `key.sub=value` command-line pairs.

A leaf module (no project imports). Each package declares its own dataclasses with defaults;
`load_config(Cls, yaml_path, ["learner.lr=3e-4", ...])` builds one, validating types and
naming the field at fault (and the file it came from).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    pass


def _check_keys(cls: type, data: dict[str, Any], where: str) -> None:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key, value in data.items():
        if key not in names:
            raise ConfigError(f"{where}: unknown field '{key}' (known: {', '.join(names)})")
        if dataclasses.is_dataclass(hints[key]) and isinstance(value, dict):
            _check_keys(hints[key], value, f"{where}.{key}")


def _check_finite(node: Any, where: str) -> None:
    """Every float in the tree is finite: `lr=.inf` or `nan` is a typo, never a setting."""
    items = ((f.name, getattr(node, f.name)) for f in dataclasses.fields(node)) if dataclasses.is_dataclass(node) \
        else node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
    for key, value in items:
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{where}.{key}: {value} is not a finite number")
        _check_finite(value, f"{where}.{key}")


def _parse_scalar(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = data
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{dotted}': '{k}' is not a section")
    node[keys[-1]] = value


def merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def load_config(cls: type[C], yaml_path: str | Path | None = None, overrides: list[str] = (),
                base: dict[str, Any] | None = None) -> C:
    """Defaults of `cls`, then `base`, then the YAML file, then `key=value` overrides."""
    data: dict[str, Any] = dict(base or {})
    where = cls.__name__
    if yaml_path is not None:
        where = str(yaml_path)
        try:
            loaded = yaml.safe_load(Path(yaml_path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"{yaml_path}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{yaml_path}: expected a mapping at the top level")
        data = merge(data, loaded)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value")
        key, _, text = item.partition("=")
        _set_dotted(data, key.strip(), _parse_scalar(text))
    _check_keys(cls, data, where)
    try:
        cfg = msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {e}") from None
    _check_finite(cfg, where)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)
