"""Typed configuration: dataclass trees, overridden from YAML and `key.sub=value` command-line pairs.

A leaf module (no project imports). Each package declares its own dataclasses with defaults;
`load_config(Cls, yaml_path, ["optim.lr=3e-4", ...])` builds one, validating types (`Literal` choices too) and
naming the field at fault (and the file it came from). Every command takes `--config FILE --set KEY=VALUE`
(`add_config_args`); `sao up` writes the whole run's tree to `runs/<run>/config.yaml` and each role reads its
section of it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

C = TypeVar("C")


class ConfigError(ValueError):
    pass


# Exit codes after which `sao up` does not start a role again: the same start would end the same way.
EXIT_NO_SPACE = 74  # sysexits' EX_IOERR: a filesystem the role writes to is full
EXIT_REFUSED = 78  # sysexits' EX_CONFIG: the role refuses what it found (Refusal)
FINAL_EXIT_CODES = frozenset({EXIT_NO_SPACE, EXIT_REFUSED})


class Refusal(ConfigError):
    """A role refuses to go on with what it found at start (its checkpoints, its broker), not with how it was
    configured: it exits EXIT_REFUSED and is not restarted."""


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


def read_yaml(path: str | Path, section: str | None = None) -> dict[str, Any]:
    """A YAML mapping; with `section`, a run file's (`runs/<run>/config.yaml`) section of that name, or the whole
    file when it has no such key (a file of the role's own fields)."""
    try:
        loaded = yaml.safe_load(Path(path).read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: {e}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if section is not None and section in loaded:
        if not isinstance(loaded[section], dict):
            raise ConfigError(f"{path}: section '{section}' is not a mapping")
        return loaded[section]
    return loaded


_ENUM = re.compile(r"Invalid enum value (?P<value>.+) - at `\$\.(?P<path>[\w.]+)`")


def _field_type(cls: type, path: str) -> Any:
    hint: Any = cls
    for key in path.split("."):
        hints = typing.get_type_hints(hint) if dataclasses.is_dataclass(hint) else {}
        if key not in hints:
            return None
        hint = hints[key]
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if typing.get_origin(hint) is not typing.Literal and len(args) == 1:
            hint = args[0]  # Optional[X] -> X
    return hint


def _explain(cls: type, message: str) -> str:
    """msgspec's "Invalid enum value 'x' - at `$.a.b`", with the choices a Literal field allows."""
    m = _ENUM.fullmatch(message)
    choices = typing.get_args(_field_type(cls, m["path"])) if m else ()
    if not choices:
        return message
    return f"{m['path']}: {m['value']} is not one of {', '.join(map(str, choices))}"


def load_config(cls: type[C], yaml_path: str | Path | None = None, overrides: list[str] = (),
                base: dict[str, Any] | None = None, section: str | None = None) -> C:
    """Defaults of `cls`, then `base`, then the YAML file (its `section` if it is a run file), then `key=value`
    overrides."""
    data: dict[str, Any] = copy.deepcopy(base or {})  # overrides write into nested dicts: never the caller's
    where = cls.__name__
    if yaml_path is not None:
        where = f"{yaml_path}" + (f" [{section}]" if section else "")
        data = merge(data, read_yaml(yaml_path, section))
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}': expected key=value")
        key, _, text = item.partition("=")
        _set_dotted(data, key.strip(), _parse_scalar(text))
    _check_keys(cls, data, where)
    try:
        cfg = msgspec.convert(data, cls, strict=False)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {_explain(cls, str(e))}") from None
    _check_finite(cfg, where)
    validate = getattr(cfg, "validate", None)
    if validate is not None:
        validate()
    return cfg


def to_dict(cfg: Any) -> dict[str, Any]:
    return msgspec.to_builtins(cfg)


def write_yaml(cfg: Any, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def set_args(overrides: list[str]) -> list[str]:
    """`KEY=VALUE` overrides as command-line arguments: `--set KEY=VALUE` each."""
    return [arg for kv in overrides for arg in ("--set", kv)]


def add_config_args(parser, what: str, example: str) -> None:
    """The one override syntax of every command: `--config FILE` then `--set KEY=VALUE`, repeatable."""
    parser.add_argument("--config", default=None,
                        help=f"YAML with {what} fields, or a run's config.yaml (its section is read)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help=f"override a {what} field, e.g. {example} (repeatable; dotted keys for sections)")
