"""launch_trainjob: multi-node RL (SAO or a GRPO baseline) as one Kubeflow Trainer TrainJob.

Calls :func:`sao_core.cluster.launcher.launch` from a small CPU pod: it creates a TrainJob on the
``sao-rl`` runtime (rollout replicas running vLLM + a torchrun learner over ``num_nodes`` x
``gpus_per_node`` GPUs, one Kueue workload admitted as a whole), prints its progress and the learner's
log, and when it completes fills the Model artifacts with pointers to the verified final checkpoint
(``OUTPUT_ROOT/RUN_ID/STAGE/model``) and its critic. KFP 2.17 has no sidecar or Service primitive, so
this is how the pipelines scale past one pod (``placement=trainjob``); pair it with ``delete_trainjob``
in a ``dsl.ExitHandler`` so a failed or cancelled run never leaves GPUs behind.

The pod's service account needs the RBAC in ``deploy/rbac.yaml``; the S3 secret and the Kueue
LocalQueue must exist in the namespace (``deploy/README.md``).
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from sao_core.images import image


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def launch_trainjob(
    data: Input[Dataset],
    output_root: str,
    model: Output[Model],
    critic: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
    report: Output[HTML],
    method: str = "sao",
    base_model: str = "embedded:tiny",
    steps: int = 100,
    batch_size: int = 32,
    policy_lr: float = 1e-6,
    critic_lr: Optional[float] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    critic_updates: Optional[int] = None,  # noqa: UP045
    critic_warmup_steps: Optional[int] = None,  # noqa: UP045
    max_staleness: Optional[int] = None,  # noqa: UP045
    admission: Optional[str] = None,  # noqa: UP045
    eps_low: Optional[float] = None,  # noqa: UP045
    eps_high: Optional[float] = None,  # noqa: UP045
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
    stage: str = "sao",
    namespace: str = "",
    queue_name: str = "",
    cluster_runtime: str = "",
    learner_image: str = "",
    rollout_image: str = "",
    num_nodes: int = 1,
    gpus_per_node: int = 8,
    rollout_replicas: int = 2,
    rollout_gpus: int = 1,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    engine: str = "vllm",
    gpu_memory_utilization: float = 0.9,
    max_num_seqs: int = 256,
    enable_prefix_caching: bool = True,
    max_model_len: int = 0,
    accelerator_type: str = "nvidia.com/gpu",
    node_selector: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    tolerations: Optional[list] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    s3_secret_name: str = "sao-s3",
    timeout_s: float = 604800.0,
    launch_options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
) -> NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str, trainjob=str):
    """Run RL as a TrainJob (rollout replicas + torchrun learner) and return pointers to its final model.

    Args:
        data: Prepared rl dataset (copied to the run's s3:// directory when the artifact store is not S3).
        output_root: s3://bucket/prefix; the run writes OUTPUT_ROOT/RUN_ID/STAGE (checkpoints, weights, model).
        model: Pointer to the trained policy (checkpoint_uri, sha256, method, step, version).
        critic: Pointer to the trained critic (sao); an empty pointer for methods without one.
        metrics: Summary numbers of the run (reward first/last, drops, seconds, queueing seconds).
        summary: Markdown page with the summary and the reward curve.
        report: The training report (HTML): loss / reward curves with moving averages (RL: DIS masks, staleness, drops, critic, throughput), the config and the checkpoints.
        method: sao, grpo, grpo_async, grpo_dis or running_mean.
        base_model: Initial policy (and critic): an s3:// checkpoint or a hub id the pods can reach.
        steps: Learner steps.
        batch_size: Trajectories per step (B).
        policy_lr: Policy learning rate (constant).
        critic_lr: SAO critic learning rate (None = the RLConfig default, 5e-6).
        critic_updates: SAO critic updates per policy update, K (None = default 2).
        critic_warmup_steps: SAO critic-only steps before the first policy update (None = default 10).
        max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound) (None = default 4).
        admission: How the run admits episodes and batches them (None = default no_drop): window, version_order, requeue, no_drop or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
        eps_low: DIS band lower width (None = default 0.3).
        eps_high: DIS band upper width (None = default 5.0).
        options: Any other RLConfig field, e.g. {"critic_lr": 5e-6, "max_total_tokens": 32768, "checkpoint_every": 50}.
        run_id: Pipeline run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER): names the TrainJob sao-STAGE-RUN_ID; a retried launcher re-attaches to it.
        stage: Pipeline stage name (part of the TrainJob name and of the output path).
        namespace: Namespace of the TrainJob ('' = the launcher pod's namespace).
        queue_name: Kueue LocalQueue (label kueue.x-k8s.io/queue-name; '' = no Kueue).
        cluster_runtime: '' = a per-run TrainingRuntime with the shape below; else an installed ClusterTrainingRuntime such as sao-rl (its shape wins).
        learner_image: Image of the learner nodes ('' = the project's train image of this version).
        rollout_image: Image of the rollout replicas ('' = the project's rollout image of this version).
        num_nodes: Learner nodes (torchrun --nnodes).
        gpus_per_node: GPUs per learner node (torchrun processes per node).
        rollout_replicas: Rollout service replicas (one pod each).
        rollout_gpus: GPUs per rollout replica (= tensor_parallel_size x data_parallel_size with vllm).
        tensor_parallel_size: vLLM tensor-parallel size inside a replica.
        data_parallel_size: vLLM data-parallel engines inside a replica.
        engine: Rollout engine: vllm or hf.
        gpu_memory_utilization: vLLM: share of each GPU's memory the engine may use.
        max_num_seqs: vLLM: sequences scheduled concurrently.
        enable_prefix_caching: vLLM: reuse the KV cache of shared prefixes.
        max_model_len: vLLM: context in tokens; 0: the run's max_total_tokens.
        accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
        node_selector: Node labels every pod of the TrainJob requires.
        tolerations: Tolerations of every pod of the TrainJob.
        s3_secret_name: Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL) for the TrainJob's pods.
        timeout_s: Longest run, queueing included; then the TrainJob is deleted and the step fails.
        launch_options: Other LaunchConfig fields, e.g. {"priority_class": "high", "node_memory": "900Gi", "env": {"NCCL_DEBUG": "INFO"}}.
    """
    import json
    from pathlib import Path

    from sao_core import images
    from sao_core.cluster.launcher import LaunchConfig, launch
    from sao_core.config import ConfigError, build_config
    from sao_core.kfp import artifacts

    run = artifacts.run_dir(output_root, run_id, stage)
    rl_options = dict(options or {})
    given = {"steps": steps, "batch_size": batch_size, "policy_lr": policy_lr, "critic_lr": critic_lr,
             "critic_updates": critic_updates, "critic_warmup_steps": critic_warmup_steps,
             "max_staleness": max_staleness, "admission": admission, "eps_low": eps_low, "eps_high": eps_high}
    given = {k: v for k, v in given.items() if v is not None}
    repeated = sorted(set(rl_options) & set(given))
    if repeated:
        raise ConfigError(f"launch_trainjob: options may not repeat {', '.join(repeated)} (they are parameters)")
    rl_options.update(given)
    explicit = {
        "method": method, "data": data.uri if data.uri.startswith("s3://") else data.path, "output": run,
        "model": base_model, "rl_options": rl_options, "run_id": run_id, "stage": stage, "namespace": namespace,
        "queue_name": queue_name, "cluster_runtime": cluster_runtime,
        "image": learner_image or images.image("train"),
        "rollout_image": rollout_image or ("" if cluster_runtime else images.image("rollout")),
        "num_nodes": num_nodes, "gpus_per_node": gpus_per_node, "rollout_replicas": rollout_replicas,
        "rollout_gpus": rollout_gpus, "tensor_parallel_size": tensor_parallel_size,
        "data_parallel_size": data_parallel_size, "engine": engine, "gpu_memory_utilization": gpu_memory_utilization,
        "max_num_seqs": max_num_seqs, "enable_prefix_caching": enable_prefix_caching, "max_model_len": max_model_len,
        "accelerator": accelerator_type, "node_selector": node_selector or {}, "tolerations": tolerations or [],
        "s3_secret_name": s3_secret_name, "timeout_s": timeout_s,
    }
    extra = dict(launch_options or {})
    clash = sorted(set(extra) & set(explicit))
    if clash:
        raise ConfigError(f"launch_trainjob: launch_options may not repeat {', '.join(clash)} (they are parameters)")
    config = build_config(LaunchConfig, {**explicit, **extra}, source="launch_trainjob")
    result = launch(config)
    if not result.critic_uri:  # methods without a critic: an empty pointer keeps the output well-formed
        Path(critic.path).parent.mkdir(parents=True, exist_ok=True)
        Path(critic.path).write_text(json.dumps({"checkpoint_uri": "", "method": method, "note": "no critic"}) + "\n")
    model_uri, checkpoint_uri = artifacts.finish_training(
        result.training_result(), method, base_model, run, model, metrics, summary, curve_key="reward_mean",
        critic_artifact=critic, report_artifact=report)
    outputs = NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str, trainjob=str)  # noqa: UP014 (as declared)
    return outputs(model_uri, checkpoint_uri, f"{result.namespace}/{result.name}")
