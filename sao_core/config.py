"""Typed config dataclasses from YAML files and command-line overrides (one way for every command).

Every value is converted to its field's type and checked where it comes from: each field of the YAML file
(even one a flag overrides) with an error naming the file, each override naming the command line. Float
fields take finite numbers only (``inf`` / ``nan`` are refused) unless the field's metadata says
``allow_nonfinite``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override is wrong; the message names the field and the source."""


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of each dataclass field (string annotations evaluated)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(inner type, optional?) for `X | None` annotations; (annotation, False) otherwise."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0], True
    return annotation, False


def coerce(value: Any, annotation: Any, where: str, allow_nonfinite: bool = False) -> Any:
    """Convert `value` (from YAML or a CLI string) to `annotation`; ConfigError naming `where`. Floats must be
    finite unless `allow_nonfinite`."""
    inner, optional = _base_type(annotation)
    if value is None or (optional and isinstance(value, str) and value.lower() in ("none", "null")):
        if optional:
            return None
        raise ConfigError(f"{where}: a value is required")
    origin = typing.get_origin(inner)
    if origin is dict or inner is dict:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as err:
                raise ConfigError(f"{where}: expected a JSON object, got {value!r} ({err.msg})") from None
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        args = typing.get_args(inner)
        if len(args) == 2:
            key_type, value_type = args
            if key_type is str and not all(isinstance(k, str) for k in value):
                bad = next(k for k in value if not isinstance(k, str))
                raise ConfigError(f"{where}: keys must be strings, got {bad!r}")
            if value_type is not Any:
                value = {k: coerce(v, value_type, f"{where}[{k!r}]", allow_nonfinite) for k, v in value.items()}
        return value
    if origin in (tuple, list):
        items = value.split(",") if isinstance(value, str) else value
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = typing.get_args(inner)[0] if typing.get_args(inner) else str
        converted = [coerce(v.strip() if isinstance(v, str) else v, item_type, where, allow_nonfinite) for v in items]
        return tuple(converted) if origin is tuple else converted
    if inner is bool:
        if isinstance(value, bool):
            return value
        text = str(value).lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    if inner in (int, float):
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected {inner.__name__}, got {value!r}")
        try:
            number = inner(value)
        except (TypeError, ValueError, OverflowError):
            raise ConfigError(f"{where}: expected {inner.__name__}, got {value!r}") from None
        if inner is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if inner is float and not allow_nonfinite and not math.isfinite(number):
            raise ConfigError(f"{where}: expected a finite number, got {value!r}")
        return number
    if inner is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _allows_nonfinite(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("allow_nonfinite")}


def check_finite(instance: Any) -> None:
    """Raise ValueError naming the first float field of dataclass `instance` that is inf or nan (fields whose
    metadata says ``allow_nonfinite`` excepted); for configs built in Python, not from YAML or flags."""
    allowed = _allows_nonfinite(type(instance))
    for name, annotation in field_types(type(instance)).items():
        value = getattr(instance, name)
        if (_base_type(annotation)[0] is float and name not in allowed and isinstance(value, float)
                and not math.isfinite(value)):
            raise ValueError(f"{type(instance).__name__}.{name} must be a finite number, got {value}")


def _check_known(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    types_by_name = field_types(cls)
    unknown = sorted(set(values) - set(types_by_name))
    if unknown:
        raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(types_by_name)}")
    return types_by_name


def _coerce_all(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` converted to the field types of `cls`; unknown or mistyped fields raise ConfigError naming `source`."""
    types_by_name = _check_known(cls, values, source)
    nonfinite = _allows_nonfinite(cls)
    return {name: coerce(value, types_by_name[name], f"{source}: field {name!r}", name in nonfinite)
            for name, value in values.items()}


def build_config(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
    """Instantiate dataclass `cls` from `values`; unknown, missing or mistyped fields raise ConfigError."""
    _check_known(cls, values, source)
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [name for name in required if name not in values]
    if missing:
        raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)} for {cls.__name__}")
    instance = cls(**_coerce_all(cls, values, source))
    validate = getattr(instance, "validate", None)
    if callable(validate):
        try:
            validate()
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from err
    return instance


def load_config(cls: type[T], yaml_path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> T:
    """Defaults, then the YAML file's mapping (if any), then `overrides` (e.g. from the CLI).

    Every field of the file is checked (named with the file's path) before the overrides are applied, so a
    wrong value in the file is reported even when a flag replaces it; then the overrides (named "command
    line") and the merged config (`validate`) are checked.
    """
    values: dict[str, Any] = {}
    source = "command line"
    if yaml_path is not None:
        path = Path(yaml_path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as err:
            raise ConfigError(f"config file {path} cannot be read: {err.strerror or err}") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}: {raw[err.start:err.start + 1]!r}); "
                              "give a YAML file of field: value pairs") from None
        try:
            loaded = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of field: value")
        values.update(_coerce_all(cls, loaded or {}, f"config file {path}"))
        source = f"{path} + command line"
    values.update(_coerce_all(cls, overrides or {}, "command line"))
    return build_config(cls, values, source)
