"""Typed config dataclasses from YAML files and command-line overrides (one way for every command).

Every value is converted to its field's type and checked where it comes from: each field of the YAML file
(even one a flag overrides) with an error naming the file, each override naming the command line. Float
fields take finite numbers only (``inf`` / ``nan`` are refused) unless the field's metadata says
``allow_nonfinite``.

Settings are defined once, as dataclass fields made with :func:`setting` (default, one-line help, section,
unit, the methods and placements that use it; a ``Literal`` annotation where the values are fixed). The CLI's
``--help`` (grouped by section), the KFP components' and pipelines' parameter descriptions and dropdowns, and
the settings tables of the READMEs and the docs are generated from these fields or checked against them
(tests/kubeflow/test_settings_parity.py). A YAML config or a component's ``options`` may give a setting flat
(``max_staleness: 4``) or inside its section (``admission: {max_staleness: 4}``): :func:`flatten_sections`.
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

_NO_DEFAULT: Any = dataclasses.MISSING


#: The sections settings are grouped in. A setting names its section where it is defined
#: (``setting(..., section="admission")``); the key is also what a YAML config or a component's ``options``
#: may nest settings under (``admission: {max_staleness: 4}``), and the title heads the setting's group in
#: ``--help`` and in the settings reference. Key -> title.
SECTIONS: dict[str, str] = {
    "model_and_data": "model and data",
    "optimisation": "optimisation",
    "checkpoints": "checkpoints and logging",
    "lora": "LoRA",
    "objective": "RL method and objective",
    "rollout": "rollout services",
    "admission": "staleness and admission",
    "publishing": "weight publishing",
    "critic": "critic (sao)",
    "evaluation": "evaluation during training",
    "dpo": "DPO",
    "gkd": "GKD",
    "runtime": "runtime shape",
    "trainjob": "TrainJob",
    "eval_run": "model and run",
    "datasets": "benchmarks and data",
    "sampling": "sampling and token budget",
    "swe": "SWE-bench",
    "grading": "grading and LLM judge",
}


def setting(default: Any = _NO_DEFAULT, help: str = "", *, section: str = "", factory: Any = None, unit: str = "",
            methods: tuple[str, ...] = (), placements: tuple[str, ...] = (), allow_nonfinite: bool = False) -> Any:
    """A dataclass field that is a user-facing setting: its default (or `factory` for a mutable one; neither
    for a required field), its one-line `help`, its `section` (a key of :data:`SECTIONS`), its `unit` (tokens,
    seconds, versions, ...), and the `methods` and `placements` (single_pod, trainjob) that use it (empty: all
    of them). A missing help or section raises ValueError when the config's module is imported."""
    if not help:
        raise ValueError("a setting needs its help text")
    if section not in SECTIONS:
        raise ValueError(f"the setting {help[:40]!r}... needs its section, one of {', '.join(SECTIONS)}; "
                         f"got {section!r}")
    metadata = {"help": help, "section": section, "unit": unit, "methods": tuple(methods),
                "placements": tuple(placements)}
    if allow_nonfinite:
        metadata["allow_nonfinite"] = True
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class Setting:
    """One setting as the registry knows it (read from a config dataclass's field)."""

    name: str
    type: Any                          # the resolved annotation
    default: Any                       # dataclasses.MISSING for a required setting
    help: str
    unit: str
    choices: tuple[Any, ...] | None    # the Literal's values, None where any value of `type` is allowed
    methods: tuple[str, ...]
    placements: tuple[str, ...]
    owner: str                         # the dataclass that defines it
    section: str                       # a key of SECTIONS

    @property
    def title(self) -> str:
        """The title of its section (its group in --help and in the settings reference)."""
        return SECTIONS[self.section]

    @property
    def required(self) -> bool:
        return self.default is dataclasses.MISSING

    def type_name(self) -> str:
        """`int`, `float`, `str`, `bool`, `dict`, `list`, ... (the Literal's base type for a Literal)."""
        inner, _ = _base_type(self.type)
        if self.choices:
            return type(self.choices[0]).__name__
        origin = typing.get_origin(inner) or inner
        return getattr(origin, "__name__", str(origin))


def literal_choices(annotation: Any) -> tuple[Any, ...] | None:
    """The values of a ``Literal[...]`` annotation (also inside ``X | None``), else None."""
    inner, _ = _base_type(annotation)
    if typing.get_origin(inner) is typing.Literal:
        return typing.get_args(inner)
    return None


def settings_of(cls: type) -> dict[str, Setting]:
    """The settings of config dataclass `cls`, by name, in field order; a field made without :func:`setting`
    raises TypeError (every field of a config is a documented setting), and so does a mapping-typed setting
    named like a section (a nested mapping under its name could be either)."""
    types_by_name = field_types(cls)
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not defined with sao_core.config.setting (no help text)")
        if f.name in SECTIONS and _is_mapping(types_by_name[f.name]):
            raise TypeError(f"{cls.__name__}.{f.name} is a mapping named like the section {f.name!r}: rename one")
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        owner = next(k.__name__ for k in cls.__mro__ if f.name in getattr(k, "__annotations__", {}))
        out[f.name] = Setting(f.name, types_by_name[f.name], default, f.metadata["help"], f.metadata["unit"],
                              literal_choices(types_by_name[f.name]), f.metadata["methods"],
                              f.metadata["placements"], owner, f.metadata["section"])
    return out


def is_registered(cls: type) -> bool:
    """Whether config dataclass `cls` is made of settings (:func:`setting` fields, with sections), rather than
    of plain dataclass fields (which have no sections and are given flat only)."""
    return any("section" in f.metadata for f in dataclasses.fields(cls))


def sections_of(cls: type) -> list[str]:
    """The section keys of the settings of `cls`, in the order of their first setting."""
    return list(dict.fromkeys(s.section for s in settings_of(cls).values()))


def _is_mapping(annotation: Any) -> bool:
    inner, _ = _base_type(annotation)
    return inner is dict or typing.get_origin(inner) is dict


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
    if origin is typing.Literal:
        return _coerce_literal(value, typing.get_args(inner), where)
    if origin is dict or inner is dict:
        return _coerce_mapping(value, typing.get_args(inner), where, allow_nonfinite)
    if origin in (tuple, list):
        items = _coerce_sequence(value, typing.get_args(inner), where, allow_nonfinite)
        return tuple(items) if origin is tuple else items
    if inner is bool:
        return _coerce_bool(value, where)
    if inner in (int, float):
        return _coerce_number(value, inner, where, allow_nonfinite)
    if inner is str:
        if isinstance(value, dict | list):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return str(value)
    return value


def _coerce_literal(value: Any, allowed: tuple[Any, ...], where: str) -> Any:
    """`value` if it is one of `allowed` (a bool only where the allowed values are bools)."""
    if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
        raise ConfigError(f"{where} must be one of {', '.join(map(str, allowed))}, got {value!r}")
    return value


def _coerce_mapping(value: Any, args: tuple[Any, ...], where: str, allow_nonfinite: bool) -> dict:
    """A mapping (or its JSON text), its keys and values checked against `args` (key type, value type) if given."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{where}: expected a JSON object, got {value!r} ({err.msg})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a mapping, got {value!r}")
    if len(args) != 2:
        return value
    key_type, value_type = args
    if key_type is str and not all(isinstance(k, str) for k in value):
        bad = next(k for k in value if not isinstance(k, str))
        raise ConfigError(f"{where}: keys must be strings, got {bad!r}")
    if value_type is Any:
        return value
    return {k: coerce(v, value_type, f"{where}[{k!r}]", allow_nonfinite) for k, v in value.items()}


def _coerce_sequence(value: Any, args: tuple[Any, ...], where: str, allow_nonfinite: bool) -> list:
    """A list of items of type ``args[0]`` (str if none) from a list, a tuple or comma-separated text."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list | tuple):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    item_type = args[0] if args else str
    return [coerce(v.strip() if isinstance(v, str) else v, item_type, where, allow_nonfinite) for v in items]


def _coerce_bool(value: Any, where: str) -> bool:
    """A bool, or its spelling: 1 / true / yes / on, 0 / false / no / off (any case)."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def _coerce_number(value: Any, kind: type, where: str, allow_nonfinite: bool) -> int | float:
    """`value` as `kind` (int or float): no bools, no fractional ints, finite floats unless `allow_nonfinite`."""
    if isinstance(value, bool):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}")
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{where}: expected {kind.__name__}, got {value!r}") from None
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if kind is float and not allow_nonfinite and not math.isfinite(number):
        raise ConfigError(f"{where}: expected a finite number, got {value!r}")
    return number


def _allows_nonfinite(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls) if f.metadata.get("allow_nonfinite")}


def config_defaults(cls: type) -> dict[str, Any]:
    """Each field's default value (a factory's value for mutable ones; required fields left out)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def merge_options(explicit: dict[str, Any], options: Any, defaults: dict[str, Any], source: str,
                  reserved: tuple[str, ...] = (), config: type | None = None) -> dict[str, Any]:
    """The one rule for a component's ``options`` mapping beside its explicit parameters: options may set any
    other field, and a field that has a parameter only while that parameter is at its default (`defaults`;
    a parameter given as None is "not set"); a field given both ways with different values, or one of
    `reserved` (set by the component itself), is refused, naming the field. With `config` (the dataclass the
    options are fields of), options may also be written in sections (:func:`flatten_sections`). Returns
    explicit updated by options (None-valued parameters left out)."""
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"{source}: options must be a mapping of field: value, got {options!r}")
    options = flatten_sections(config, options or {}, f"{source} options") if config else dict(options or {})
    given = {k: v for k, v in explicit.items() if v is not None}
    for key in sorted(set(options) & (set(given) | set(reserved))):
        if key in reserved or key not in defaults or given[key] != defaults[key]:
            shown = given.get(key, "(set by the component)")
            raise ConfigError(f"{source}: {key} is given both as a parameter ({shown!r}) and in options "
                              f"({options[key]!r}); set it once")
    return {**given, **options}


def flatten_sections(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` (a YAML config's or an options mapping's) with each section entry, ``admission: {max_staleness:
    4}``, replaced by its settings; flat keys (``max_staleness: 4``) pass as they are. A key that names both a
    section and a setting (``admission``) is the section when its value is a mapping. ConfigError naming
    `source` for a section `cls` does not have, a setting in the wrong section (naming the right one), or a
    setting given twice. A config of plain dataclass fields (no sections) is returned as it is."""
    if not is_registered(cls):
        return dict(values)
    flat: dict[str, Any] = {}
    spelled: dict[str, str] = {}      # setting -> how it was given (`max_staleness`, `admission.max_staleness`)
    for key, value in values.items():
        if key in SECTIONS and isinstance(value, dict):
            entries = [(name, item, f"{key}.{name}") for name, item in _section_entries(cls, key, value, source)]
        else:
            entries = [(key, value, key)]
        for name, item, how in entries:
            if name in flat:
                raise ConfigError(f"{source}: {name} is given twice, as {spelled[name]} and as {how}; set it once")
            flat[name], spelled[name] = item, how
    return flat


def _section_entries(cls: type, section: str, values: dict[str, Any], source: str) -> list[tuple[str, Any]]:
    """The (setting, value) pairs of section `section` of config `cls`, each checked to belong there."""
    settings = settings_of(cls)
    if section not in sections_of(cls):
        raise ConfigError(f"{source}: {cls.__name__} has no section {section!r}; its sections: "
                          f"{', '.join(sections_of(cls))}")
    members = [name for name, s in settings.items() if s.section == section]
    for name in values:
        if name not in settings:
            raise ConfigError(f"{source}: unknown field {name!r} in section {section!r} of {cls.__name__}; "
                              f"the section holds: {', '.join(members)}")
        if settings[name].section != section:
            raise ConfigError(f"{source}: {name} is not in section {section!r} of {cls.__name__}: write it in "
                              f"section {settings[name].section!r} ({settings[name].title}) or at the top level")
    return list(values.items())


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
        sections = f"; or grouped in sections: {', '.join(sections_of(cls))}" if is_registered(cls) else ""
        raise ConfigError(f"{source}: unknown field(s) {', '.join(unknown)} for {cls.__name__}; "
                          f"known: {', '.join(types_by_name)}{sections}")
    return types_by_name


def _coerce_all(cls: type, values: dict[str, Any], source: str) -> dict[str, Any]:
    """`values` (flat or in sections) converted to the field types of `cls`, flat; unknown or mistyped fields
    raise ConfigError naming `source`."""
    values = flatten_sections(cls, values, source)
    types_by_name = _check_known(cls, values, source)
    nonfinite = _allows_nonfinite(cls)
    return {name: coerce(value, types_by_name[name], f"{source}: field {name!r}", name in nonfinite)
            for name, value in values.items()}


def build_config(cls: type[T], values: dict[str, Any], source: str = "config") -> T:
    """Instantiate dataclass `cls` from `values` (flat, or in sections: :func:`flatten_sections`); unknown,
    missing or mistyped fields raise ConfigError."""
    values = flatten_sections(cls, values, source)
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
