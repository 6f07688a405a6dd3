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
        method: RL method: sao, grpo (synchronous), grpo_async, grpo_dis or running_mean.
        base_model: Initial policy (and critic): an s3:// checkpoint or a hub id the pods can reach.
        steps: Optimiser steps (RL: learner steps) in total.
        batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
        policy_lr: Policy learning rate (peak, after the warm-up).
        critic_lr: Critic learning rate (None = default 5e-06).
        critic_updates: Critic updates per policy update (K) (None = default 2).
        critic_warmup_steps: Critic-only steps before the first policy update (None = default 10).
        max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound) (None = default 4).
        admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput) (None = default no_drop).
        eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding) (None = default 0.3).
        eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding) (None = default 5.0).
        options: Any other RLConfig field, e.g. {"critic_lr": 5e-6, "max_total_tokens": 32768, "checkpoint_every": 50}.
        run_id: Pipeline run id: names the TrainJob; a relaunch with the same id re-attaches.
        stage: Pipeline stage (part of the TrainJob name and labels).
        namespace: '' = the launcher pod's namespace, else the kubeconfig context's, else default.
        queue_name: Kueue LocalQueue in the namespace (label kueue.x-k8s.io/queue-name; '' = no Kueue).
        cluster_runtime: '' = a per-run TrainingRuntime with this shape; else an installed ClusterTrainingRuntime (e.g. sao-rl).
        learner_image: Image of the learner nodes ('' = the project's train image of this version).
        rollout_image: Rollout image (vLLM + sao-kfp), e.g. ghcr.io/sao-kfp/sao-kfp-vllm:0.1.0.
        num_nodes: Learner nodes (pods of the node job); torchrun --nnodes.
        gpus_per_node: GPUs per learner node = torchrun processes per node (0: one CPU process).
        rollout_replicas: Rollout service replicas (one pod and one Job each).
        rollout_gpus: GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size).
        tensor_parallel_size: VLLM tensor-parallel size inside one replica.
        data_parallel_size: VLLM data-parallel engines inside one replica.
        engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
        gpu_memory_utilization: Vllm: share of each GPU's memory the engine may use (0, 1].
        max_num_seqs: Vllm: sequences scheduled concurrently per engine.
        enable_prefix_caching: Vllm: reuse the KV cache of shared prefixes (multi-turn episodes).
        max_model_len: Vllm: context in tokens (prompt + every turn); 0: a TrainJob's max_total_tokens (a runtime alone: the model's).
        accelerator_type: Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu.
        node_selector: Node labels the GPU pods require (a TrainJob: every pod), e.g. {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"} (None = default {}).
        tolerations: Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{"key": "nvidia.com/gpu", "operator": "Exists"}] (None = default []).
        s3_secret_name: Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION).
        timeout_s: Whole run, queueing included; then the TrainJob is deleted.
        launch_options: Other LaunchConfig fields, e.g. {"priority_class": "high", "node_memory": "900Gi", "env": {"NCCL_DEBUG": "INFO"}}.
    """
    import json
    from pathlib import Path

    from sao_core import images
    from sao_core.cluster.launcher import LaunchConfig, launch
    from sao_core.config import build_config, config_defaults, merge_options
    from sao_core.kfp import artifacts
    from sao_core.learner.config import RLConfig

    run = artifacts.run_dir(output_root, run_id, stage)
    given = {"steps": steps, "batch_size": batch_size, "policy_lr": policy_lr, "critic_lr": critic_lr,
             "critic_updates": critic_updates, "critic_warmup_steps": critic_warmup_steps,
             "max_staleness": max_staleness, "admission": admission, "eps_low": eps_low, "eps_high": eps_high}
    rl_options = merge_options(given, options, config_defaults(RLConfig), "launch_trainjob", config=RLConfig)
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
    values = merge_options(explicit, launch_options, config_defaults(LaunchConfig), "launch_trainjob launch_options",
                           reserved=("method", "data", "output", "model", "rl_options", "run_id", "stage"),
                           config=LaunchConfig)
    config = build_config(LaunchConfig, values, source="launch_trainjob")
    result = launch(config)
    if not result.critic_uri:  # methods without a critic: an empty pointer keeps the output well-formed
        Path(critic.path).parent.mkdir(parents=True, exist_ok=True)
        Path(critic.path).write_text(json.dumps({"checkpoint_uri": "", "method": method, "note": "no critic"}) + "\n")
    model_uri, checkpoint_uri = artifacts.finish_training(
        result.training_result(), method, base_model, run, model, metrics, summary, curve_key="reward_mean",
        critic_artifact=critic, report_artifact=report)
    outputs = NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str, trainjob=str)  # noqa: UP014 (as declared)
    return outputs(model_uri, checkpoint_uri, f"{result.namespace}/{result.name}")
