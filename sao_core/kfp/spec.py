"""Compile pipelines to KFP IR YAML, with the UI dropdowns patched in, and check the result loads.

The KFP UI renders a parameter as a dropdown when its ``ParameterSpec.literals`` lists the allowed
values; kfp 2.17's SDK cannot emit them (``typing.Literal`` annotations fail), so
:func:`compile_pipeline` compiles normally, then sets ``root.inputDefinitions.parameters.<name>.literals``
through the protobuf message (so only valid IR can be written) and writes the file with the SDK's
own writer. :func:`verify_package` re-reads a package the way the KFP backend and SDK do.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from sao_core.kfp.sdk_speed import libyaml

_PY_TYPES = {"STRING": str, "NUMBER_INTEGER": int, "NUMBER_DOUBLE": (int, float), "BOOLEAN": bool}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when available: packages are ~200 kB
_SDK_VERSION = re.compile(r"^sdkVersion: kfp-\S+$", re.MULTILINE)


class SpecError(ValueError):
    """A pipeline package is not valid, or a literals patch does not fit the pipeline's parameters."""


def _read(path: Path) -> tuple[Any, Any]:
    """(PipelineSpec, PlatformSpec or None) of a compiled YAML package, parsed strictly."""
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    try:
        docs = [d for d in yaml.load_all(path.read_text(), Loader=_LOADER) if d is not None]
    except (OSError, yaml.YAMLError) as err:
        raise SpecError(f"cannot read pipeline package {path}: {err}") from err
    if not docs or not isinstance(docs[0], dict):
        raise SpecError(f"{path} is not a KFP pipeline package (no pipeline spec document)")
    try:
        spec = json_format.ParseDict(docs[0], pipeline_spec_pb2.PipelineSpec())
        platform = None
        if len(docs) > 1:
            platform = json_format.ParseDict(docs[1], pipeline_spec_pb2.PlatformSpec())
    except json_format.ParseError as err:
        raise SpecError(f"{path} is not valid KFP IR: {err}") from err
    return spec, platform


def patch_literals(path: str | Path, literals: dict[str, list]) -> None:
    """Set the allowed values of root parameters (UI dropdowns) in the compiled package at `path`.

    Every named parameter must exist, every value must have the parameter's type, and the
    parameter's default (if any) must be one of the values.
    """
    from google.protobuf import json_format
    from kfp.compiler import pipeline_spec_builder
    from kfp.pipeline_spec import pipeline_spec_pb2

    path = Path(path)
    spec, platform = _read(path)
    parameters = spec.root.input_definitions.parameters
    type_names = pipeline_spec_pb2.ParameterType.ParameterTypeEnum
    for name, values in literals.items():
        if name not in parameters:
            raise SpecError(f"literals for {name!r}: the pipeline has no such parameter "
                            f"(parameters: {', '.join(sorted(parameters))})")
        parameter = parameters[name]
        kind = type_names.Name(parameter.parameter_type)
        if kind not in _PY_TYPES:
            raise SpecError(f"literals for {name!r}: a {kind} parameter cannot be a dropdown")
        if not values or len(set(map(repr, values))) != len(values):
            raise SpecError(f"literals for {name!r} must be a non-empty list of distinct values, got {values!r}")
        wrong = [v for v in values if not isinstance(v, _PY_TYPES[kind]) or (kind != "BOOLEAN" and isinstance(v, bool))]
        if wrong:
            raise SpecError(f"literals for {name!r}: {wrong[0]!r} is not a {kind} value")
        if parameter.HasField("default_value"):
            default = json_format.MessageToDict(parameter.default_value)
            if default not in values:
                raise SpecError(f"literals for {name!r}: the default {default!r} is not one of {values!r}")
        del parameter.literals[:]
        for value in values:
            parameter.literals.add().CopyFrom(json_format.ParseDict(value, parameter.default_value.__class__()))
    pipeline_spec_builder.write_pipeline_spec_to_file(
        spec, spec.pipeline_info.description or None,
        platform if platform is not None else pipeline_spec_pb2.PlatformSpec(), str(path))


def verify_package(path: str | Path, literals: dict[str, list] | None = None) -> dict[str, Any]:
    """Re-read a compiled package: strict protobuf parse, ``kfp.components.load_component_from_file``,
    and (if given) the expected literals. Returns ``{"name", "parameters", "literals"}``."""
    from google.protobuf import json_format
    from kfp import components

    path = Path(path)
    spec, _ = _read(path)
    try:
        components.load_component_from_file(str(path))
    except Exception as err:  # the SDK raises many types for an unloadable package
        raise SpecError(f"kfp cannot load {path}: {type(err).__name__}: {err}") from err
    parameters = spec.root.input_definitions.parameters
    found = {name: [json_format.MessageToDict(v) for v in p.literals] for name, p in parameters.items() if p.literals}
    for name, values in (literals or {}).items():
        if found.get(name) != list(values):
            raise SpecError(f"{path}: parameter {name!r} literals are {found.get(name)!r}, expected {list(values)!r}")
    return {"name": spec.pipeline_info.name, "parameters": sorted(parameters), "literals": found}


def compile_pipeline(pipeline, output_path: str | Path, literals: dict[str, list] | None = None) -> Path:
    """Compile `pipeline` to YAML at `output_path`, patch `literals` in, verify the package; return the path."""
    from kfp import compiler

    path = Path(output_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with libyaml():   # the SDK's writer and reader in C (sdk_speed): same bytes, ~2 s less per package
        compiler.Compiler().compile(pipeline, str(path))
        if literals:
            patch_literals(path, literals)
        verify_package(path, literals)
    return path


def normalise_for_golden(text: str) -> str:
    """Compiled YAML with the SDK version line replaced, for comparison with a golden file."""
    return _SDK_VERSION.sub("sdkVersion: kfp-<version>", text)


def root_parameters(path: str | Path) -> dict[str, dict[str, Any]]:
    """The pipeline's root parameters: ``{name: {"type", "optional", "default", "description", "literals"}}``."""
    from google.protobuf import json_format
    from kfp.pipeline_spec import pipeline_spec_pb2

    spec, _ = _read(Path(path))
    type_names = pipeline_spec_pb2.ParameterType.ParameterTypeEnum
    result = {}
    for name, p in spec.root.input_definitions.parameters.items():
        result[name] = {
            "type": type_names.Name(p.parameter_type),
            "optional": p.is_optional,
            "default": json_format.MessageToDict(p.default_value) if p.HasField("default_value") else None,
            "has_default": p.HasField("default_value"),
            "description": p.description,
            "literals": [json_format.MessageToDict(v) for v in p.literals],
        }
    return result


def parameters_markdown(path: str | Path) -> str:
    """A Markdown table of a compiled pipeline's parameters (sorted by name, as the IR stores them): type,
    default or **required**, description and the dropdown's allowed values."""
    import json

    kinds = {"STRING": "string", "NUMBER_INTEGER": "int", "NUMBER_DOUBLE": "float", "BOOLEAN": "bool",
             "LIST": "list", "STRUCT": "dict"}
    rows = ["| parameter | type | default | description |", "| --- | --- | --- | --- |"]
    for name, p in sorted(root_parameters(path).items()):
        value = int(p["default"]) if p["type"] == "NUMBER_INTEGER" and p["has_default"] else p["default"]
        default = "**required**" if not p["has_default"] else f"`{json.dumps(value)}`"
        description = " ".join(p["description"].split()).replace("|", "\\|")
        if p["literals"]:
            description += " One of: " + ", ".join(f"`{v}`" for v in p["literals"]) + "."
        rows.append(f"| `{name}` | {kinds.get(p['type'], p['type'])} | {default} | {description} |")
    return "\n".join(rows) + "\n"
