"""placement=trainjob: launch_trainjob + delete_trainjob wired into the pipelines, compiled to KFP IR.

``pipelines._stages.build_trainjob_stage`` is the wiring (a graph component: the delete step guards the
launcher in a ``dsl.ExitHandler`` and hands the model on, because KFP lets no task outside an
ExitHandler read an output of a task inside it). The tests compile a small pipeline that chooses
between it and the single-pod ``sao_train``, then the real ``post_training`` and ``sao_rl``: the
placement dropdown, the launcher inside an exit handler with the delete step and the Kueue label in
the trainjob branch only, the single-pod branch unchanged; and the argument check's refusals.
"""


import pytest
import yaml
from kfp import compiler, dsl

import pipelines
from pipelines import _kfp_merge
from pipelines._stages import RUN_ID, SAO_PARAMETERS, build_trainjob_stage
from pipelines.compile import GOLDEN_SETTINGS
from sao_core.config import ConfigError
from sao_core.kfp import k8s, params


def test_placement_trainjob_compiles_with_the_launcher_the_exit_handler_and_the_kueue_label(tmp_path):
    from components.prepare_data import prepare_data
    from components.sao import sao_train

    settings = k8s.ClusterSettings(queue_name="team-a-gpu")
    stage = build_trainjob_stage(settings)

    @dsl.pipeline(name="placement")
    def placement_pipeline(rl_source: str, output_root: str, placement: str = "single_pod",
                           base_model: str = "embedded:tiny", num_nodes: int = 2, gpus_per_node: int = 8,
                           rollout_replicas: int = 4, s3_secret_name: str = "sao-s3") -> str:
        data = prepare_data(source=rl_source, kind="rl")
        with dsl.If(placement == "trainjob", name="trainjob"):
            multi = stage(data=data.outputs["dataset"], output_root=output_root, base_model=base_model, method="sao",
                          steps=100, batch_size=32, learning_rate=1e-6, engine="vllm", method_options={},
                          num_nodes=num_nodes, gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas,
                          rollout_gpus=1, tensor_parallel_size=1, accelerator_type="nvidia.com/gpu",
                          node_selector={}, tolerations=[], s3_secret_name=s3_secret_name)
        with dsl.Else(name="single-pod"):
            single = sao_train(data=data.outputs["dataset"], output_root=output_root, base_model=base_model,
                               run_id=RUN_ID)
        return dsl.OneOf(multi.output, single.outputs["model_uri"])

    path = tmp_path / "placement.yaml"
    compiler.Compiler().compile(placement_pipeline, str(path))
    docs = list(yaml.safe_load_all(path.read_text()))
    ir = docs[0]
    executors = ir["deploymentSpec"]["executors"]
    assert any("def launch_trainjob(" in " ".join(e["container"].get("command", [])) for e in executors.values())
    stage_dag = ir["components"]["comp-sao-trainjob-stage"]["dag"]["tasks"]
    assert stage_dag["delete-trainjob"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    assert "exit-handler-1" in stage_dag["delete-trainjob"]["dependentTasks"]
    platform = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    labels = [e.get("podMetadata", {}).get("labels", {}) for e in platform.values()]
    assert any(lbl.get(k8s.KUEUE_QUEUE_LABEL) == "team-a-gpu" for lbl in labels)
    launcher_exec = next(k for k, e in executors.items() if "def launch_trainjob(" in " ".join(e["container"]["command"]))
    assert platform[launcher_exec]["activeDeadlineSeconds"] == str(settings.training_timeout_s)
    assert "accelerator" not in executors[launcher_exec]["container"].get("resources", {})
    launch_inputs = ir["components"]["comp-launch-trainjob"]["inputDefinitions"]["parameters"]
    assert {"queue_name", "rollout_replicas", "tensor_parallel_size", "num_nodes"} <= set(launch_inputs)


def test_the_launcher_component_refuses_repeated_settings(tmp_path):
    from components.launch_trainjob import launch_trainjob
    from sao_core.config import ConfigError

    arts = {n: dsl.Model(name=n, uri=str(tmp_path / n), metadata={}) for n in ("model", "critic")}
    arts.update(metrics=dsl.Metrics(name="m", uri=str(tmp_path / "m"), metadata={}),
                summary=dsl.Markdown(name="s", uri=str(tmp_path / "s"), metadata={}),
                report=dsl.HTML(name="r", uri=str(tmp_path / "r"), metadata={}))
    data = dsl.Dataset(name="d", uri="s3://d/rl", metadata={})
    # The one rule of every component (sao_core.config.merge_options): options may set a field whose parameter
    # is left at its default, never one given both ways.
    with pytest.raises(ConfigError, match=r"steps is given both as a parameter \(50\) and in options \(5\)"):
        launch_trainjob.python_func(data=data, output_root="s3://o", steps=50, options={"steps": 5}, **arts)
    with pytest.raises(ConfigError, match=r"launch_options: num_nodes is given both as a parameter \(2\)"):
        launch_trainjob.python_func(data=data, output_root="s3://o", num_nodes=2, launch_options={"num_nodes": 5},
                                    **arts)
    with pytest.raises(ConfigError, match="launch_options: output is given both"):
        launch_trainjob.python_func(data=data, output_root="s3://o", launch_options={"output": "s3://x"}, **arts)
    with pytest.raises(ConfigError, match="s3_secret_name is empty"):
        launch_trainjob.python_func(data=data, output_root="s3://o", s3_secret_name="", run_id="r", **arts)
    with pytest.raises(ConfigError, match="admission is given both as a parameter"):
        launch_trainjob.python_func(data=data, output_root="s3://o", admission="requeue",
                                    options={"admission": "requeue"}, **arts)
    with pytest.raises(ConfigError, match="field .admission. must be one of window, version_order, requeue, "
                                          "no_drop, fragments, got 'fifo'"):
        launch_trainjob.python_func(data=data, output_root="s3://o", admission="fifo", run_id="r", **arts)


# --- the pipelines ------------------------------------------------------------------------------------

RL_PIPELINES = ("post_training", "sao_rl")
SHAPE = {"num_nodes": 1, "gpus_per_node": 8, "rollout_replicas": 2, "rollout_gpus": 1, "tensor_parallel_size": 1}


@pytest.fixture(scope="module")
def compiled(golden_compiled) -> dict[str, tuple[dict, dict]]:
    """post_training and sao_rl as compiled with GOLDEN_SETTINGS (the session's packages, see conftest.py)."""
    found = {}
    for name in RL_PIPELINES:
        docs = [d for d in yaml.safe_load_all(golden_compiled[name].read_text()) if d]
        found[name] = (docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"])
    return found


def _function(spec: dict, component: str) -> str | None:
    """Python function a (container) component runs; None for a DAG."""
    label = spec["components"][component].get("executorLabel")
    if label is None:
        return None
    args = spec["deploymentSpec"]["executors"][label]["container"]["args"]
    return args[args.index("--function_to_execute") + 1]


def _dag(spec: dict, component: str) -> dict:
    return (spec["root"] if component == "root" else spec["components"][component]).get("dag", {}).get("tasks", {})


def _reachable(spec: dict, component: str) -> set[str]:
    """Components reachable from `component` (itself included) through DAG tasks."""
    seen, todo = set(), [component]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(task["componentRef"]["name"] for task in _dag(spec, name).values())
    return seen


def _root(name: str, key: str) -> str:
    """The run form's name of `key` (placement or a TrainJob shape field): the pipelines group their fields by
    prefix (d_placement, d_trainjob_num_nodes, ...)."""
    return "d_placement" if key == "placement" else f"d_trainjob_{key}"


def _branches(spec: dict, placement_is_trainjob: bool) -> list[str]:
    """Components of the dsl.If (trainjob) or dsl.Else (single-pod) branches on the placement field."""
    found = []
    for placement in ("placement", "d_placement"):    # a stage's own name, or the root's grouped one
        wanted = f"inputs.parameter_values['pipelinechannel--{placement}'] == 'trainjob'"
        for name in ["root", *spec["components"]]:
            for task in _dag(spec, name).values():
                condition = task.get("triggerPolicy", {}).get("condition", "")
                if condition == wanted if placement_is_trainjob else condition == f"!({wanted})":
                    found.append(task["componentRef"]["name"])
    return found


@pytest.mark.parametrize("name", RL_PIPELINES)
def test_placement_is_a_dropdown_and_the_shape_parameters_are_described(compiled, name):
    spec, _ = compiled[name]
    parameters = spec["root"]["inputDefinitions"]["parameters"]
    placement = _root(name, "placement")
    assert parameters[placement]["literals"] == ["single_pod", "trainjob"] == list(params.PLACEMENTS)
    assert parameters[placement]["defaultValue"] == "single_pod"
    assert pipelines.build(name).literals[placement] == ["single_pod", "trainjob"]
    for key, default in SHAPE.items():
        assert parameters[_root(name, key)]["defaultValue"] == default, key
        assert parameters[_root(name, key)]["description"].startswith("`d_placement=trainjob`: "), key
    assert "trainjob" in parameters[placement]["description"]


@pytest.mark.parametrize("name, stages", [("post_training", {"sao", "grpo"}), ("sao_rl", {"sao"})])
def test_the_trainjob_branch_launches_inside_an_exit_handler_with_the_delete_step_and_the_kueue_label(
        compiled, name, stages):
    spec, platform = compiled[name]
    branches = _branches(spec, placement_is_trainjob=True)
    assert len(branches) == len(stages)  # one placement choice per RL stage
    launches = []
    for branch in branches:
        reachable = _reachable(spec, branch)
        functions = {_function(spec, c) for c in reachable} - {None}
        assert {"launch_trainjob", "delete_trainjob"} <= functions
        assert not functions & {"sao_train", "grpo_train"}, "no single-pod RL step in the trainjob branch"
        # every launcher sits in an exit handler whose exit task is the delete step of the same stage
        for stage_component in reachable:
            tasks = _dag(spec, stage_component)
            handlers = [t for t, task in tasks.items() if task["componentRef"]["name"].startswith("comp-exit-handler")]
            if not handlers:
                continue
            (handler,) = handlers
            cleanup = tasks["delete-trainjob"]
            assert _function(spec, cleanup["componentRef"]["name"]) == "delete_trainjob"
            assert cleanup["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
            assert cleanup["dependentTasks"] == [handler]
            assert not cleanup["cachingOptions"].get("enableCache")
            guarded = _dag(spec, tasks[handler]["componentRef"]["name"])
            assert set(guarded) == {"launch-trainjob"}
            launch = guarded["launch-trainjob"]
            assert _function(spec, launch["componentRef"]["name"]) == "launch_trainjob"
            assert not launch["cachingOptions"].get("enableCache")
            stage = cleanup["inputs"]["parameters"]["stage"]["runtimeValue"]["constant"]
            assert launch["inputs"]["parameters"]["stage"]["runtimeValue"]["constant"] == stage
            assert stage in stages
            launches.append((stage, launch))
    assert {stage for stage, _ in launches} == stages
    for _, launch in launches:
        inputs = launch["inputs"]["parameters"]
        constant = {k: v["runtimeValue"]["constant"] for k, v in inputs.items() if "runtimeValue" in v}
        assert constant["queue_name"] == GOLDEN_SETTINGS.queue_name
        assert constant["learner_image"] == GOLDEN_SETTINGS.images["train"]
        assert constant["rollout_image"] == GOLDEN_SETTINGS.images["rollout"]
        assert constant["run_id"] == "{{$.pipeline_job_uuid}}"
        assert constant["timeout_s"] == float(GOLDEN_SETTINGS.training_timeout_s)
        for key in SHAPE:
            assert inputs[key]["componentInputParameter"] == f"pipelinechannel--{key}", key
        if name == "sao_rl":  # its SAO settings reach the launcher as they reach sao_train
            for key in SAO_PARAMETERS:
                assert inputs[key]["componentInputParameter"] == f"pipelinechannel--{key}", key
    executors = spec["deploymentSpec"]["executors"]
    launcher_labels = {spec["components"][c]["executorLabel"] for c in spec["components"]
                       if _function(spec, c) == "launch_trainjob"}
    assert launcher_labels
    for label in launcher_labels:
        assert platform[label]["podMetadata"]["labels"] == {k8s.KUEUE_QUEUE_LABEL: GOLDEN_SETTINGS.queue_name}
        assert platform[label]["activeDeadlineSeconds"] == str(GOLDEN_SETTINGS.training_timeout_s)
        assert "accelerator" not in executors[label]["container"].get("resources", {})  # a CPU pod
        assert executors[label]["container"]["image"] == GOLDEN_SETTINGS.images["cpu"]
        assert "nodeSelector" not in platform[label] and "tolerations" not in platform[label]


@pytest.mark.parametrize("name, rl_function", [("post_training", {"sao_train", "grpo_train"}),
                                               ("sao_rl", {"sao_train"})])
def test_the_single_pod_branch_runs_the_colocated_step_and_no_launcher(compiled, name, rl_function):
    spec, _ = compiled[name]
    branches = _branches(spec, placement_is_trainjob=False)
    assert len(branches) == len(rl_function)
    found = set()
    for branch in branches:
        functions = {_function(spec, c) for c in _reachable(spec, branch)} - {None}
        assert not functions & {"launch_trainjob", "delete_trainjob"}
        assert "sft_train" in functions  # the optional warm start
        found |= functions & rl_function
    assert found == rl_function
    # outside the two placement branches nothing launches a TrainJob (local single_pod runs need no cluster)
    in_trainjob = set().union(*(_reachable(spec, b) for b in _branches(spec, placement_is_trainjob=True)))
    for component in spec["components"]:
        if _function(spec, component) in ("launch_trainjob", "delete_trainjob"):
            assert component in in_trainjob, component


def test_the_trainjob_stage_of_grpo_uses_the_method_as_its_run_directory(compiled):
    spec, _ = compiled["post_training"]
    stages = {c for c in spec["components"] if c.startswith("comp-grpo-trainjob-stage")}
    assert stages
    for component in stages:
        cleanup = _dag(spec, component)["delete-trainjob"]
        assert cleanup["inputs"]["parameters"]["stage"]["runtimeValue"]["constant"] == "grpo"  # grpo.py: RUN_ID/grpo
    rl_stage = _dag(spec, "comp-grpo-trainjob-rl-stage")
    conditions = [t["componentRef"]["name"] for t in rl_stage.values()]
    methods = set()
    for name in _reachable(spec, "comp-grpo-trainjob-rl-stage"):
        for task in _dag(spec, name).values():
            if task["componentRef"]["name"].startswith("comp-grpo-trainjob-stage"):
                methods.add(task["inputs"]["parameters"]["method"]["runtimeValue"]["constant"])
    assert conditions and methods == {"grpo"}


def test_sao_parameters_belong_to_the_sao_stage():
    with pytest.raises(ValueError, match="sao_parameters applies to the sao stage only"):
        build_trainjob_stage(k8s.ClusterSettings(), "grpo", sao_parameters=True)


# --- nesting: kfp's sub-pipeline merge -----------------------------------------------------------------

def test_sub_pipeline_merge_keeps_each_tasks_kubernetes_config(tmp_path):
    """An outer task and the same component nested twice (and twice inside the nested pipeline, the
    exec-x / exec-x-2 rename chain): every task keeps its own config, whatever the map order."""
    from kfp import kubernetes

    assert _kfp_merge.install()

    @dsl.component(base_image="python:3.11")
    def echo(text: str) -> str:
        return text

    @dsl.component(base_image="python:3.11")
    def other(text: str) -> str:
        return text

    def secret(task, name):
        kubernetes.use_secret_as_env(task, secret_name=name, secret_key_to_env={"KEY": "KEY"}, optional=True)
        return task

    @dsl.pipeline(name="inner")
    def inner(flag: int, secret_name: str) -> str:
        first = secret(other(text="a"), secret_name)
        with dsl.If(flag > 0):
            secret(echo(text="b"), secret_name)
            secret(echo(text="c"), secret_name)
        return first.output

    @dsl.pipeline(name="outer")
    def outer(flag: int = 1, secret_name: str = "s3"):
        secret(echo(text="top"), secret_name)
        inner(flag=flag, secret_name=secret_name)
        inner(flag=flag, secret_name=secret_name)

    path = tmp_path / "outer.yaml"
    compiler.Compiler().compile(outer, str(path))
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    spec, platform = docs[0], docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert not _kfp_merge.platform_problems(spec, platform)
    top = spec["components"][spec["root"]["dag"]["tasks"]["echo"]["componentRef"]["name"]]["executorLabel"]
    assert platform[top]["secretAsEnv"][0]["secretNameParameter"] == {"componentInputParameter": "secret_name"}
    echoes = {label for label, e in spec["deploymentSpec"]["executors"].items()
              if e["container"]["args"][e["container"]["args"].index("--function_to_execute") + 1] == "echo"}
    assert len(echoes) == 5


# --- the argument check -------------------------------------------------------------------------------

CHECK = dict(method="sao", output_root="s3://bucket/runs", steps=10, batch_size=16, learning_rate=1e-5, max_tokens=256,
             engine="vllm", warm_start_source="", warm_start_steps=0, method_options={})


@pytest.mark.parametrize("overrides", [
    dict(placement="trainjob"),
    dict(method="grpo", placement="trainjob", num_nodes=4, rollout_replicas=8, rollout_gpus=2, tensor_parallel_size=2),
    dict(placement="single_pod", output_root="/tmp/runs"),
    dict(method="sft", placement="single_pod"),
])
def test_the_check_accepts_both_placements(overrides):
    assert params.check_post_training(**{**CHECK, **overrides}) in ("rl", "sft")


@pytest.mark.parametrize("overrides, message", [
    (dict(placement="multi_node"), "unknown placement 'multi_node'; choose one of single_pod, trainjob"),
    (dict(placement="trainjob", output_root="/tmp/runs"),
     "placement=trainjob needs an s3://bucket/prefix output_root, got '/tmp/runs'"),
    (dict(method="sft", placement="trainjob"), "placement=trainjob applies to grpo and sao only"),
    (dict(placement="trainjob", num_nodes=0), "placement=trainjob: num_nodes must be an integer in \\[1, 10000\\]"),
    (dict(placement="trainjob", rollout_gpus=2), "rollout_gpus \\(2\\) must equal tensor_parallel_size"),
    (dict(placement="trainjob", s3_secret_name=""), "placement=trainjob: s3_secret_name is empty"),
    (dict(placement="trainjob", batch_size=64, method_options={"batch_size": 32}),  # one rule: set it once
     "batch_size is given both as a parameter \\(64\\) and in options \\(32\\)"),
    (dict(placement="trainjob", method_options={"critic_lrr": 1}), "unknown field\\(s\\) critic_lrr"),
])
def test_the_check_refuses_a_bad_placement_or_shape_with_a_clear_message(overrides, message):
    with pytest.raises(ConfigError, match=message):
        params.check_post_training(**{**CHECK, **overrides})


def test_the_check_component_passes_the_placement_on():
    from components.check_arguments import check_post_training_arguments

    check = check_post_training_arguments.python_func
    assert check(**CHECK, placement="trainjob", num_nodes=2) == ("rl",)
    with pytest.raises(ConfigError, match="needs an s3://bucket/prefix output_root"):
        check(**{**CHECK, "output_root": "/tmp/runs"}, placement="trainjob")
    with pytest.raises(ConfigError, match="unknown placement"):
        check(**CHECK, placement="everywhere")
