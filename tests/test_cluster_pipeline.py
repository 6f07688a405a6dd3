"""launch_trainjob + delete_trainjob wired as the pipelines wire them (placement=trainjob), compiled to KFP IR.

``build_trainjob_stage`` is the reference wiring for ``pipelines/`` (a graph component: the delete step
guards the launcher in a ``dsl.ExitHandler`` and hands the model on, because KFP lets no task outside an
ExitHandler read an output of a task inside it). The test compiles a pipeline that chooses between it
and the single-pod ``sao_train`` with ``dsl.If(placement == "trainjob")`` and checks the IR.
"""

import pytest
import yaml
from kfp import compiler, dsl, kubernetes
from kfp.dsl import Dataset, Input

from sao_core.kfp import k8s

RUN_ID = dsl.PIPELINE_JOB_ID_PLACEHOLDER


def build_trainjob_stage(settings: k8s.ClusterSettings, stage: str = "sao"):
    from components.delete_trainjob import delete_trainjob
    from components.launch_trainjob import launch_trainjob

    @dsl.pipeline(name=f"{stage}-trainjob-stage")
    def trainjob_stage(data: Input[Dataset], output_root: str, base_model: str, method: str, steps: int,
                       batch_size: int, learning_rate: float, engine: str, method_options: dict, num_nodes: int,
                       gpus_per_node: int, rollout_replicas: int, rollout_gpus: int, tensor_parallel_size: int,
                       accelerator_type: str, node_selector: dict, tolerations: list, s3_secret_name: str) -> str:
        """RL as one TrainJob; the exit step deletes it whatever happens and returns the trained model's URI."""
        params = k8s.ClusterParams(s3_secret_name=s3_secret_name)
        cleanup = delete_trainjob(run_id=RUN_ID, stage=stage, output_root=output_root).set_display_name(
            "delete trainjob")
        k8s.apply(cleanup, "cpu", params, settings, image_kind="cpu")
        with dsl.ExitHandler(cleanup, name="trainjob"):
            launch = launch_trainjob(
                data=data, output_root=output_root, method=method, base_model=base_model, steps=steps,
                batch_size=batch_size, policy_lr=learning_rate, engine=engine, options=method_options, run_id=RUN_ID,
                stage=stage, queue_name=settings.queue_name, learner_image=settings.image("train"),
                rollout_image=settings.image("rollout"), num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                tensor_parallel_size=tensor_parallel_size, accelerator_type=accelerator_type,
                node_selector=node_selector, tolerations=tolerations, s3_secret_name=s3_secret_name,
                timeout_s=float(settings.training_timeout_s)).set_display_name(f"{stage} trainjob")
            k8s.apply(launch, "cpu", params, settings, image_kind="cpu")  # a CPU pod: no GPU, no GPU node
            kubernetes.set_timeout(launch, settings.training_timeout_s)  # it lives as long as the training
            launch.set_caching_options(False)
        return cleanup.outputs["model_uri"]

    return trainjob_stage


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
                summary=dsl.Markdown(name="s", uri=str(tmp_path / "s"), metadata={}))
    data = dsl.Dataset(name="d", uri="s3://d/rl", metadata={})
    with pytest.raises(ConfigError, match="options may not repeat steps"):
        launch_trainjob.python_func(data=data, output_root="s3://o", options={"steps": 5}, **arts)
    with pytest.raises(ConfigError, match="launch_options may not repeat num_nodes"):
        launch_trainjob.python_func(data=data, output_root="s3://o", launch_options={"num_nodes": 5}, **arts)
    with pytest.raises(ConfigError, match="s3_secret_name is empty"):
        launch_trainjob.python_func(data=data, output_root="s3://o", s3_secret_name="", run_id="r", **arts)
