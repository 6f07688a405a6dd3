"""Deterministic, collision-safe merging of sub-pipelines for kfp 2.17's compiler.

When a pipeline calls another pipeline (a graph component), kfp folds the inner pipeline's executors,
components and Kubernetes platform configs into the outer one, renaming labels that are already taken
(``exec-prepare-data`` -> ``exec-prepare-data-2``). kfp 2.17.3 (``pipeline_spec_builder``) does this
in protobuf map order, which changes from one process to the next, and with two faults:

- it merges the inner platform spec into the outer one *before* every taken label is renamed, so the
  outer task's Kubernetes config (for instance its ``secretNameParameter``) is overwritten by the inner
  task's, whose parameter names (``pipelinechannel--s3_secret_name``) the outer DAG does not declare;
- it renames executor labels one at a time, so ``exec-x`` -> ``exec-x-2`` followed by ``exec-x-2`` ->
  ``exec-x-2-2`` moves both inner components onto one executor.

The pipelines here nest three deep (RL stage -> placement -> TrainJob stage with its ExitHandler), so
both faults show up, and the compiled YAML differs between runs. :func:`install` replaces the two
private merge steps with versions that rename every taken label first (against the outer *and* the
inner labels, in sorted order) and merge the platform configs once, afterwards. The result is the IR
kfp intends, the same in every process. Installed by ``pipelines/__init__.py`` for kfp 2.17.x only.
"""

from __future__ import annotations

import copy
import warnings

from google.protobuf import json_format

SUPPORTED_KFP = "2.17."


def _renames(existing, incoming: list[str]) -> dict[str, str]:
    """New names for the `incoming` names (sorted) already taken in `existing`: KFP's ``-2``, ``-3``, ... suffixes,
    unique among both; the other names keep theirs (not in the result)."""
    from kfp.dsl import utils

    taken = sorted(set(existing) | set(incoming))
    renamed: dict[str, str] = {}
    for name in incoming:
        if name in existing:
            renamed[name] = utils.make_name_unique_by_adding_index(name=name, collection=taken, delimiter="-")
            taken.append(renamed[name])
    return renamed


def _merge_deployment_spec(main_deployment_config, sub_pipeline_spec, main_platform_spec, sub_platform_spec) -> None:
    """Fold the inner pipeline's executors and platform configs into the outer ones, renaming taken labels."""
    from kfp.compiler import pipeline_spec_builder
    from kfp.pipeline_spec import pipeline_spec_pb2

    sub_deployment = pipeline_spec_pb2.PipelineDeploymentConfig()
    json_format.ParseDict(json_format.MessageToDict(sub_pipeline_spec.deployment_spec), sub_deployment)
    labels = sorted(sub_deployment.executors)
    renamed = _renames(main_deployment_config.executors, labels)
    for component in sub_pipeline_spec.components.values():  # all at once: no chain of renames
        if component.executor_label in renamed:
            component.executor_label = renamed[component.executor_label]
    for platform in sub_platform_spec.platforms.values():
        executors = platform.deployment_spec.executors
        moved = {label: copy.deepcopy(executors[label]) for label in renamed if label in executors}
        for label in moved:
            del executors[label]
        for label, config in moved.items():
            executors[renamed[label]].CopyFrom(config)
    for label in labels:
        main_deployment_config.executors[renamed.get(label, label)].CopyFrom(sub_deployment.executors[label])
    pipeline_spec_builder.merge_platform_specs(main_msg=main_platform_spec, sub_msg=sub_platform_spec)


def _merge_component_spec(main_pipeline_spec, sub_pipeline_spec) -> None:
    """Fold the inner pipeline's components into the outer ones, renaming taken names (sorted order)."""
    names = sorted(sub_pipeline_spec.components)
    renamed = _renames(main_pipeline_spec.components, names)
    dags = [sub_pipeline_spec.root, *(c for c in sub_pipeline_spec.components.values() if c.HasField("dag"))]
    for dag_component in dags:  # all at once: no chain of renames
        for task in dag_component.dag.tasks.values():
            if task.component_ref.name in renamed:
                task.component_ref.name = renamed[task.component_ref.name]
    for name in names:
        main_pipeline_spec.components[renamed.get(name, name)].CopyFrom(sub_pipeline_spec.components[name])


def platform_problems(spec: dict, platform: dict) -> list[tuple]:
    """What is wrong with a compiled package's Kubernetes configs (`spec`: the pipeline spec document,
    `platform`: its ``platforms.kubernetes.deploymentSpec.executors``), as tuples; empty when nothing.

    A config may only name parameters (``componentInputParameter``) that the component enclosing its
    task declares (the backend resolves them there); every container component needs its own executor,
    and every executor a component.
    """
    components = {"root": spec["root"], **spec.get("components", {})}
    problems: list[tuple] = []
    for parent, component in components.items():
        declared = component.get("inputDefinitions", {}).get("parameters", {})
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            label = components[task["componentRef"]["name"]].get("executorLabel")
            for ref in _input_refs(platform.get(label, {})) if label else ():
                if ref not in declared:
                    problems.append((parent, task_name, label, ref))
    labels = [c["executorLabel"] for c in components.values() if "executorLabel" in c]
    problems += [("shared executor", label) for label in sorted(set(labels)) if labels.count(label) > 1]
    executors = spec.get("deploymentSpec", {}).get("executors", {})
    problems += [("unused executor", label) for label in sorted(set(executors) - set(labels))]
    return problems


def _input_refs(value):
    if isinstance(value, dict):
        for key, inner in value.items():
            if key == "componentInputParameter":
                yield inner
            else:
                yield from _input_refs(inner)
    elif isinstance(value, list):
        for inner in value:
            yield from _input_refs(inner)


def install() -> bool:
    """Use the merge steps above in kfp's compiler (kfp 2.17.x); returns whether they are installed."""
    import kfp
    from kfp.compiler import pipeline_spec_builder

    if not kfp.__version__.startswith(SUPPORTED_KFP):
        warnings.warn(f"pipelines: kfp {kfp.__version__} is not {SUPPORTED_KFP}x; its own sub-pipeline merge is "
                      "used (check the compiled YAML with tests/kubeflow/test_kfp_spec.py)", stacklevel=2)
        return False
    pipeline_spec_builder._merge_deployment_spec = _merge_deployment_spec
    pipeline_spec_builder._merge_component_spec = _merge_component_spec
    return True
