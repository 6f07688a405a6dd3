"""Typed config dataclasses from YAML files and command-line overrides (one way for every command).

Every value is converted to its field's type and checked where it comes from: each field of the YAML file
(even one a flag overrides) with an error naming the file, each override naming the command line. Float
fields take finite numbers only (``inf`` / ``nan`` are refused) unless the field's metadata says
``allow_nonfinite``.

Settings are defined once, as dataclass fields made with :func:`setting` (default, one-line help, unit,
the methods and placements that use it; a ``Literal`` annotation where the values are fixed). The CLI's
``--help``, the KFP components' and pipelines' parameter descriptions and dropdowns, and the settings
tables of the READMEs are generated from these fields or checked against them (tests/test_settings_parity.py).
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


def setting(default: Any = _NO_DEFAULT, help: str = "", *, factory: Any = None, unit: str = "",
            methods: tuple[str, ...] = (), placements: tuple[str, ...] = (), allow_nonfinite: bool = False,
            section: str = "") -> Any:
    """A dataclass field that is a user-facing setting: its default (or `factory` for a mutable one; neither
    for a required field), its one-line `help`, its `unit` (tokens, seconds, versions, ...), the `methods`
    and `placements` (single_pod, trainjob) that use it (empty: all of them), and its `section` (the
    --help group it is listed in; empty: derived by :func:`section_of`)."""
    if not help:
        raise ValueError("a setting needs its help text")
    metadata = {"help": help, "unit": unit, "methods": tuple(methods), "placements": tuple(placements)}
    if section:
        metadata["section"] = section
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
    section: str = ""                  # the --help group it is listed in (`section_of`)

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
    raises TypeError (every field of a config is a documented setting)."""
    types_by_name = field_types(cls)
    out: dict[str, Setting] = {}
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not defined with sao_core.config.setting (no help text)")
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        owner = next(k.__name__ for k in cls.__mro__ if f.name in getattr(k, "__annotations__", {}))
        out[f.name] = Setting(f.name, types_by_name[f.name], default, f.metadata["help"], f.metadata["unit"],
                              literal_choices(types_by_name[f.name]), f.metadata["methods"],
                              f.metadata["placements"], owner, section_of(cls, f))
    return out


# Sections of fields made without an explicit `setting(section=...)`, per config dataclass (looked up along the
# MRO of the config): title -> names; a name ending in "_" is a prefix. Exact names win over prefixes. A field
# in none of them is listed under its defining dataclass's title (`_OWNER_TITLES`, else "<Name> settings").
# Giving a setting `section=` where it is defined overrides this.
_DERIVED_SECTIONS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "CoreConfig": (
        ("model and data", ("data", "output", "model", "seed", "cache_dir", "unverified")),
        ("optimisation", ("steps", "schedule", "warmup_steps", "min_lr_ratio", "weight_decay", "grad_clip",
                          "precision", "gradient_checkpointing")),
        ("checkpoints and logging", ("checkpoint_every", "keep_checkpoints", "pin_checkpoints", "resume",
                                     "log_every", "report_every")),
        ("LoRA", ("lora_",)),
    ),
    "TrainConfig": (
        ("optimisation", ("batch_size", "grad_accum", "lr", "max_tokens")),
    ),
    "RLConfig": (
        ("rollout services", ("services", "service_token_file", "service_retry_s", "shutdown_services", "engine",
                              "rollout_", "take_wait_s", "env_options", "max_new_tokens_per_turn",
                              "max_total_tokens", "max_in_flight")),
        ("staleness and admission", ("max_staleness", "admission", "hard_staleness", "failed_episodes",
                                     "failed_reward")),
        ("weight publishing", ("keep_weight_versions", "weight_transport", "publish_every", "lora_publish",
                               "delivery_")),
        ("critic (sao)", ("critic_", "freeze_critic_attention", "value_clip")),
        ("optimisation", ("policy_lr", "micro_batch_tokens")),
        ("checkpoints and logging", ("metrics_port",)),
        ("evaluation during training", ("eval_",)),
    ),
    "EvalConfig": (
        ("model and run", ("model", "output", "adapter", "engine", "engine_options", "seed", "concurrency",
                           "resume", "previous_summary", "response_chars", "upload_every_s", "cache_dir",
                           "unverified")),
        ("benchmarks and data", ("benchmarks", "k", "limit", "swe_verified_source", "beyond_aime_source",
                                 "imo_answerbench_source", "splits", "max_reject_fraction")),
        ("sampling and token budget", ("max_new_tokens", "max_total_tokens", "temperature", "top_p", "top_k",
                                       "sample_timeout_s", "math_prompt", "system_prompt")),
        ("SWE-bench", ("swe_", "sandbox", "env_options")),
        ("grading and LLM judge", ("grader_workers", "grade_timeout_s", "judge_")),
    ),
}
_OWNER_TITLES = {"RLConfig": "RL method and objective", "DPOConfig": "DPO", "GKDConfig": "GKD",
                 "PrepareConfig": "data preparation", "ServeConfig": "rollout service",
                 "ProjectConfig": "simulated cluster and workload", "RuntimeSpec": "runtime shape",
                 "LaunchConfig": "TrainJob"}


def section_of(cls: type, f: dataclasses.Field) -> str:
    """The --help section of field `f` of config dataclass `cls`: its ``setting(section=...)``, else derived
    from the config's class hierarchy and the field's name (`_DERIVED_SECTIONS`), else the title of the
    dataclass that defines it."""
    if f.metadata.get("section"):
        return f.metadata["section"]
    klasses = [k for k in cls.__mro__ if dataclasses.is_dataclass(k)]
    for exact in (True, False):
        for klass in klasses:
            for title, names in _DERIVED_SECTIONS.get(klass.__name__, ()):
                if any(f.name == n if exact else (n.endswith("_") and f.name.startswith(n)) for n in names):
                    return title
    owner = next((k.__name__ for k in klasses if f.name in getattr(k, "__annotations__", {})), cls.__name__)
    return _OWNER_TITLES.get(owner, f"{owner.removesuffix('Config') or owner} settings")


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
        allowed = typing.get_args(inner)
        if value not in allowed or isinstance(value, bool) != isinstance(allowed[0], bool):
            raise ConfigError(f"{where} must be one of {', '.join(map(str, allowed))}, got {value!r}")
        return value
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
                  reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """The one rule for a component's ``options`` mapping beside its explicit parameters: options may set any
    other field, and a field that has a parameter only while that parameter is at its default (`defaults`;
    a parameter given as None is "not set"); a field given both ways with different values, or one of
    `reserved` (set by the component itself), is refused, naming the field. Returns explicit updated by
    options (None-valued parameters left out)."""
    if options is not None and not isinstance(options, dict):
        raise ConfigError(f"{source}: options must be a mapping of field: value, got {options!r}")
    options = dict(options or {})
    given = {k: v for k, v in explicit.items() if v is not None}
    for key in sorted(set(options) & (set(given) | set(reserved))):
        if key in reserved or key not in defaults or given[key] != defaults[key]:
            shown = given.get(key, "(set by the component)")
            raise ConfigError(f"{source}: {key} is given both as a parameter ({shown!r}) and in options "
                              f"({options[key]!r}); set it once")
    return {**given, **options}


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
