"""Compiled KFP IR of the three pipelines: golden files, Kubernetes settings, parameter descriptions, the
method dropdown (literals patched in and read back by kfp and protobuf), and IR consistency (DAG inputs,
and Kubernetes configs that resolve where their task runs after kfp merged the sub-pipelines)."""

from __future__ import annotations

import functools
import re
import shutil
from pathlib import Path

import pytest
import yaml

import pipelines
from pipelines._kfp_merge import platform_problems
from pipelines.commands import compile_pipelines
from pipelines.compile import GOLDEN_DIR, GOLDEN_SETTINGS
from sao_core import images
from sao_core.kfp import k8s
from sao_core.kfp.params import POST_TRAINING_METHODS
from sao_core.kfp.spec import SpecError, normalise_for_golden, patch_literals, root_parameters, verify_package
from sao_core.learner.config import ADMISSION_RULES

TRAINING_FUNCS = {"sft_train", "cpt_train", "dpo_train", "gkd_train", "grpo_train", "sao_train"}
PLACEHOLDER = re.compile(r"\{\{\$\.inputs\.parameters\['([^']+)'\]\}\}")


@pytest.fixture(scope="module")
def compiled(golden_compiled) -> dict[str, Path]:
    assert sorted(golden_compiled) == sorted(pipelines.PIPELINES)
    return golden_compiled


@functools.cache
def _docs(path: Path) -> tuple[dict, dict]:
    """(pipeline spec, Kubernetes executor configs) of the package at `path`, parsed once per file: the tests only
    read them, and post_training's ~500 kB took ~1.3 s per parse in PyYAML's pure-Python loader (libyaml's gives
    the same documents)."""
    docs = [d for d in yaml.load_all(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)) if d]
    return docs[0], (docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"] if len(docs) > 1 else {})


def _executors_by_function(spec: dict) -> dict[str, list[str]]:
    """Python function name -> executor labels running it."""
    found: dict[str, list[str]] = {}
    for label, executor in spec["deploymentSpec"]["executors"].items():
        args = executor["container"]["args"]
        found.setdefault(args[args.index("--function_to_execute") + 1], []).append(label)
    return found


def _tasks(spec: dict):
    """(component name, task name, task) for every task of every DAG, root included."""
    for name, component in [("root", spec["root"]), *spec["components"].items()]:
        for task_name, task in component.get("dag", {}).get("tasks", {}).items():
            yield name, task_name, task


def _executor_of(spec: dict, task: dict) -> str | None:
    return spec["components"][task["componentRef"]["name"]].get("executorLabel")


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_compiled_yaml_matches_the_golden_file(compiled, name):
    """Regenerate after an intended change with `.venv/bin/python -m pipelines.compile --golden`."""
    golden = GOLDEN_DIR / f"{name}.yaml"
    assert golden.is_file(), "run .venv/bin/python -m pipelines.compile --golden"
    assert normalise_for_golden(compiled[name].read_text()) == normalise_for_golden(golden.read_text()), (
        f"{name} changed; if intended: .venv/bin/python -m pipelines.compile --golden")


def test_golden_normalisation_only_hides_the_sdk_version():
    text = "a: 1\nsdkVersion: kfp-2.17.3\nb: kfp-2.17.3\n"
    assert normalise_for_golden(text) == "a: 1\nsdkVersion: kfp-<version>\nb: kfp-2.17.3\n"


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_every_parameter_has_a_description(compiled, name):
    parameters = root_parameters(compiled[name])
    assert parameters
    missing = [p for p, spec in parameters.items() if not spec["description"].strip()]
    assert not missing, f"{name}: parameters without a description: {missing}"


def test_method_dropdown_lists_every_method_and_round_trips(compiled):
    path = compiled["post_training"]
    spec, _ = _docs(path)
    assert spec["root"]["inputDefinitions"]["parameters"]["a_method"]["literals"] == list(POST_TRAINING_METHODS)
    assert POST_TRAINING_METHODS == ("sft", "cpt", "dpo", "gkd", "grpo", "sao")
    info = verify_package(path, {"a_method": list(POST_TRAINING_METHODS)})  # kfp loads it, protobuf parses it
    assert info["name"] == "sao-post-training"
    assert info["literals"]["a_method"] == list(POST_TRAINING_METHODS)
    from kfp import components

    from sao_core.kfp.sdk_speed import libyaml

    with libyaml():   # kfp's loader on libyaml, as compile_pipeline runs it (verify_package read it the slow way)
        loaded = components.load_component_from_file(str(path))
    assert "a_method" in loaded.component_spec.inputs


def test_sao_rl_admission_is_a_dropdown_that_reaches_every_sao_step(compiled):
    """sao_rl's `b_admission` lists ADMISSION_RULES (default no_drop), survives the kfp / protobuf round trip,
    refuses other values at submission, and is wired into both placements' SAO step."""
    from sao_core.kfp.client import KFPError, check_arguments, parameters_of

    path = compiled["sao_rl"]
    spec, _ = _docs(path)
    admission = spec["root"]["inputDefinitions"]["parameters"]["b_admission"]
    assert admission["literals"] == list(ADMISSION_RULES) == ["window", "version_order", "requeue", "no_drop", "fragments"]
    assert admission["defaultValue"] == "no_drop" and admission["parameterType"] == "STRING"
    assert pipelines.build("sao_rl").literals["b_admission"] == list(ADMISSION_RULES)
    assert verify_package(path, {"b_admission": list(ADMISSION_RULES)})["literals"]["b_admission"] == \
        list(ADMISSION_RULES)
    parameters = parameters_of(path)
    required = {"a0_rl_source": "s3://b/rl.jsonl", "a0_output_root": "s3://b/runs"}
    assert check_arguments(parameters, {**required, "b_admission": "version_order"})["b_admission"] == \
        "version_order"
    with pytest.raises(KFPError, match="pipeline parameter 'b_admission' must be one of window, version_order, "
                                       "requeue, no_drop, fragments"):
        check_arguments(parameters, {**required, "b_admission": "fifo"})
    function_of = {label: func for func, labels in _executors_by_function(spec).items() for label in labels}
    reached = set()
    for _, task_name, task in _tasks(spec):
        function = function_of.get(_executor_of(spec, task))
        if function in ("sao_train", "launch_trainjob"):
            source = task["inputs"]["parameters"]["admission"]["componentInputParameter"]
            assert source == "pipelinechannel--admission", (task_name, source)
            reached.add(function)
    assert reached == {"sao_train", "launch_trainjob"}
    # post_training has no admission parameter: it takes the setting in method_options
    assert "admission" not in root_parameters(compiled["post_training"])


def test_every_method_has_a_branch(compiled):
    spec, _ = _docs(compiled["post_training"])
    conditions = [task.get("triggerPolicy", {}).get("condition", "") for _, _, task in _tasks(spec)]
    for method in POST_TRAINING_METHODS[:-1]:  # the last one is the Else branch
        assert any(f"== '{method}'" in c for c in conditions), method
    else_branch = [c for c in conditions if "!(" in c and "'grpo'" in c]
    assert else_branch, "sao must be the Else branch after grpo"


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_ir_is_consistent(compiled, name):
    """Every input a DAG task reads from its enclosing component is declared there, and every placeholder
    in a task's runtime values names one of the task's own inputs (kfp 2.17 forgets the accelerator
    channels inside dsl.If / ParallelFor unless registered; this catches that class of bug)."""
    spec, _ = _docs(compiled[name])
    components = {"root": spec["root"], **spec["components"]}
    for component_name, task_name, task in _tasks(spec):
        declared = components[component_name].get("inputDefinitions", {})
        for key, value in task.get("inputs", {}).get("parameters", {}).items():
            if "componentInputParameter" in value:
                assert value["componentInputParameter"] in declared.get("parameters", {}), (component_name, task_name, key)
            constant = value.get("runtimeValue", {}).get("constant")
            if isinstance(constant, str):
                for ref in PLACEHOLDER.findall(constant):
                    assert ref in task["inputs"]["parameters"], (component_name, task_name, ref)
        for key, value in task.get("inputs", {}).get("artifacts", {}).items():
            if "componentInputArtifact" in value:
                assert value["componentInputArtifact"] in declared.get("artifacts", {}), (component_name, task_name, key)


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_kubernetes_configs_name_parameters_their_task_can_see(compiled, name):
    """kfp 2.17 merges sub-pipelines in an order that overwrote the root prepare-data step's secret
    parameter with a nested step's (pipelines/_kfp_merge.py); each config must resolve where it runs."""
    spec, platform = _docs(compiled[name])
    assert not platform_problems(spec, platform)


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_training_tasks_get_gpus_no_cache_no_retry(compiled, name):
    spec, platform = _docs(compiled[name])
    executors = spec["deploymentSpec"]["executors"]
    training = {label for func, labels in _executors_by_function(spec).items() if func in TRAINING_FUNCS
                for label in labels}
    assert training or name == "evaluation"
    for label in training:
        accelerator = executors[label]["container"]["resources"]["accelerator"]
        # the root's d_ (cluster) fields, or a stage's own names for them
        assert re.fullmatch(r"\{\{\$.inputs.parameters\['pipelinechannel--(d_)?accelerator_type'\]\}\}",
                            accelerator["resourceType"]), accelerator
        assert re.fullmatch(r"\{\{\$.inputs.parameters\['pipelinechannel--(d_)?gpu_count'\]\}\}",
                            accelerator["resourceCount"]), accelerator
        kube = platform[label]
        assert kube["activeDeadlineSeconds"] == str(GOLDEN_SETTINGS.training_timeout_s)
        assert kube["emptyDirMounts"] == [{"medium": "Memory", "mountPath": "/dev/shm",
                                          "sizeLimit": GOLDEN_SETTINGS.shm_size, "volumeName": "dshm"}]
        assert kube["nodeSelector"]["nodeSelectorJson"]["componentInputParameter"].endswith("node_selector")
        assert kube["tolerations"][0]["tolerationJson"]["componentInputParameter"].endswith("tolerations")
    for _, task_name, task in _tasks(spec):
        if _executor_of(spec, task) in training:
            assert not task.get("cachingOptions", {}).get("enableCache"), task_name
            assert "retryPolicy" not in task, task_name


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_data_and_evaluation_tasks_retry(compiled, name):
    spec, platform = _docs(compiled[name])
    by_function = _executors_by_function(spec)
    prepare = set(by_function.get("prepare_data", []))
    evaluate = set(by_function["evaluate"])
    seen = set()
    for _, _name, task in _tasks(spec):
        label = _executor_of(spec, task)
        if label in prepare:
            seen.add("prepare")
            assert task["retryPolicy"]["maxRetryCount"] == GOLDEN_SETTINGS.data_retries
            assert task["cachingOptions"]["enableCache"] is True
        if label in evaluate:
            seen.add("evaluate")
            assert task["retryPolicy"] == {"backoffDuration": "60s", "backoffFactor": 2.0,
                                           "backoffMaxDuration": "3600s",
                                           "maxRetryCount": GOLDEN_SETTINGS.evaluation_retries}
            assert not task.get("cachingOptions", {}).get("enableCache")
            assert spec["deploymentSpec"]["executors"][label]["container"]["resources"]["accelerator"]
    assert "evaluate" in seen and ("prepare" in seen or name == "evaluation")
    for label in evaluate:
        assert platform[label]["activeDeadlineSeconds"] == str(GOLDEN_SETTINGS.evaluation_timeout_s)


@pytest.mark.parametrize("name", list(pipelines.PIPELINES))
def test_every_task_has_queue_label_secret_env_and_image(compiled, name):
    spec, platform = _docs(compiled[name])
    executors = spec["deploymentSpec"]["executors"]
    assert set(platform) == set(executors)
    for label, kube in platform.items():
        assert kube["podMetadata"]["labels"] == {k8s.KUEUE_QUEUE_LABEL: GOLDEN_SETTINGS.queue_name}
        (secret,) = kube["secretAsEnv"]
        assert secret["optional"] is True
        assert secret["secretNameParameter"]["componentInputParameter"].endswith("s3_secret_name")
        assert {e["envVar"] for e in secret["keyToEnv"]} == set(k8s.DEFAULT_S3_SECRET_KEYS.values())
        assert executors[label]["container"]["image"] in GOLDEN_SETTINGS.images.values()
    funcs = _executors_by_function(spec)
    for func, kind in (("prepare_data", "cpu"), ("report", "cpu"), ("evaluate", "rollout"), ("sao_train", "rollout"),
                       ("sft_train", "train")):
        for label in funcs.get(func, []):
            assert executors[label]["container"]["image"] == GOLDEN_SETTINGS.images[kind], (func, label)


def test_no_queue_label_without_a_queue(tmp_path):
    path = compile_pipelines(["evaluation"], tmp_path, k8s.ClusterSettings())[0]
    _, platform = _docs(path)
    assert all("podMetadata" not in kube for kube in platform.values())


def test_default_images_come_from_images_module(tmp_path, monkeypatch):
    monkeypatch.setenv("SAO_IMAGE_REGISTRY", "registry.test/team")
    monkeypatch.setenv("SAO_IMAGE_TAG", "v9")
    monkeypatch.setenv("SAO_IMAGE_ROLLOUT", "other.test/vllm:7")
    assert images.all_images() == {"cpu": "registry.test/team/sao-kfp-cpu:v9", "train": "registry.test/team/sao-kfp-cuda:v9",
                                   "rollout": "other.test/vllm:7"}
    spec, _ = _docs(compile_pipelines(["evaluation"], tmp_path, k8s.ClusterSettings())[0])
    used = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert used == {"registry.test/team/sao-kfp-cpu:v9", "other.test/vllm:7"}
    with pytest.raises(ValueError, match="unknown image kind"):
        images.image("gpu")


@pytest.mark.parametrize("settings, message", [
    (dict(queue_name="Team A"), "not a valid Kubernetes label value"),
    (dict(shm_size="lots"), "not a Kubernetes quantity"),
    (dict(training_timeout_s=0), "training_timeout_s"),
    (dict(data_retries=11), "data_retries"),
    (dict(retry_backoff="1m"), "retry_backoff"),
    (dict(images={"gpu": "x"}), "unknown image kind"),
    (dict(s3_secret_keys={}), "s3_secret_keys"),
])
def test_bad_cluster_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        k8s.ClusterSettings(**settings).validate()


def test_literals_patch_checks_names_types_and_default(compiled, tmp_path):
    """On the evaluation package (34 kB; post_training's 500 kB made each of the seven reads and the rewrite ~15x
    slower): the checks are the same code for every pipeline. post_training's own dropdown is read back by
    test_method_dropdown_lists_every_method_and_round_trips."""
    path = tmp_path / "e.yaml"
    shutil.copy(compiled["evaluation"], path)
    with pytest.raises(SpecError, match="no such parameter"):
        patch_literals(path, {"engin": ["hf"]})
    with pytest.raises(SpecError, match="is not a NUMBER_INTEGER value"):
        patch_literals(path, {"c_k": [4, "many"]})
    with pytest.raises(SpecError, match="default 'vllm' is not one of"):
        patch_literals(path, {"c_engine": ["hf"]})
    with pytest.raises(SpecError, match="cannot be a dropdown"):
        patch_literals(path, {"d_node_selector": [{}]})
    with pytest.raises(SpecError, match="distinct"):
        patch_literals(path, {"c_engine": ["vllm", "vllm"]})
    patch_literals(path, {"c_k": [4, 8]})
    assert root_parameters(path)["c_k"]["literals"] == [4, 8]
    assert verify_package(path)["literals"]["c_engine"] == ["vllm", "hf"]


def test_rewriting_a_package_changes_nothing_but_the_literals(compiled, tmp_path):
    path = tmp_path / "e.yaml"
    shutil.copy(compiled["evaluation"], path)
    before = path.read_text()
    patch_literals(path, {})
    assert path.read_text() == before


def test_verify_refuses_broken_packages(tmp_path, compiled):
    bad = tmp_path / "bad.yaml"
    bad.write_text("root: {dag: {tasks: {}}}\nnotAField: 1\n")
    with pytest.raises(SpecError, match="not valid KFP IR"):
        verify_package(bad)
    with pytest.raises(SpecError, match="literals are"):
        verify_package(compiled["evaluation"], {"engine": ["hf"]})
    (tmp_path / "empty.yaml").write_text("")
    with pytest.raises(SpecError, match="not a KFP pipeline package"):
        verify_package(tmp_path / "empty.yaml")


def test_the_sao_rl_form_reads_in_groups_in_the_order_the_kfp_ui_lists_it(compiled):
    """The KFP UI lists a run's fields alphabetically by name (the IR's parameter map). Rendered in that order,
    sao_rl's form runs a0_ (the two required fields) -> a_ (other inputs) -> b_ (SAO) -> c_ (evaluation) -> d_
    (cluster), the TrainJob shape sits together, every field has a description, and the pipeline's description
    names the required fields and lists every b_options key with its default."""
    from sao_core.config import settings_of
    from sao_core.learner.config import RLConfig

    spec, _ = _docs(compiled["sao_rl"])
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    form = sorted(parameters)                      # the UI's order
    groups = [name.split("_", 1)[0] for name in form]
    assert groups == sorted(groups, key=lambda g: g + "_") and set(groups) == {"a0", "a", "b", "c", "d"}, form
    required = [n for n in form if not parameters[n].get("isOptional")]
    assert required == ["a0_output_root", "a0_rl_source"] == form[:2]
    shape = [n for n in form if n.startswith("d_trainjob_")]
    assert len(shape) == 5 and form.index(shape[-1]) - form.index(shape[0]) == 4   # one block
    assert form.index(shape[0]) - form.index("d_placement") <= 3
    assert all(parameters[n].get("description") for n in form) and len(form) == 35
    described = spec["pipelineInfo"]["description"]
    assert described.startswith("Required: `a0_rl_source` (RL prompts) and `a0_output_root`")
    fields = {n.split("_", 1)[1] for n in form}
    for setting in settings_of(RLConfig).values():
        if setting.name not in fields | {"data", "output", "model", "method", "resume", "cache_dir", "services",
                                         "service_token_file", "shutdown_services"}:
            assert f"{setting.name}={setting.default!r}" in described, setting.name
