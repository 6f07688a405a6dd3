"""How component and pipeline parameters become `sao_core` configs, shared by the components (at run
time) and the pipelines' argument check (before any training pod starts), so both apply the same
rules and give the same messages as the CLI (:class:`sao_core.config.ConfigError`).
"""

from __future__ import annotations

from typing import Any

from sao_core.config import ConfigError
from sao_core.kfp import artifacts

#: Methods of the post_training pipeline, in the order of its UI dropdown.
POST_TRAINING_METHODS = ("sft", "cpt", "dpo", "gkd", "grpo", "sao")
#: Data kind each post_training method trains on.
DATA_KIND = {"sft": "sft", "cpt": "cpt", "dpo": "dpo", "gkd": "sft", "grpo": "rl", "sao": "rl"}
#: RL methods of the GRPO component (SAO has its own).
GRPO_METHODS = ("grpo", "grpo_async", "grpo_dis", "running_mean")
ENGINES = ("hf", "vllm")


def training_config(method: str, data: str, output: str, model: str, steps: int, batch_size: int, lr: float,
                    max_tokens: int, options: dict | None = None, source: str | None = None, **explicit: Any):
    """The TrainConfig of an sft / cpt / dpo / gkd step (resumes from the run's own checkpoints).

    `explicit` holds method parameters that have their own component parameter (``reference_model``,
    ``teacher_model``); empty strings there mean "not set" and leave the config's default.
    """
    from sao_core.training.config import METHOD_CONFIGS

    if method not in METHOD_CONFIGS:
        raise ConfigError(f"unknown training method {method!r}; choose one of {', '.join(METHOD_CONFIGS)}")
    explicit = {"data": data, "output": output, "model": model, "steps": steps, "batch_size": batch_size,
                "lr": lr, "max_tokens": max_tokens, "resume": True, "cache_dir": artifacts.cache_dir(),
                **{k: v for k, v in explicit.items() if v not in ("", None)}}
    return artifacts.build(METHOD_CONFIGS[method], explicit, options, source or f"{method}_train")


def rl_config(method: str, data: str, output: str, model: str, steps: int, batch_size: int, policy_lr: float,
              engine: str, options: dict | None = None, source: str | None = None, **explicit: Any):
    """The RLConfig of a grpo-family or sao step: colocated rollout service (no `services`), resumable.

    `explicit` holds the component's optional parameters; None means "not set" (``options`` or the
    RLConfig default decides).
    """
    from sao_core.learner.config import RL_METHODS, RLConfig

    if method not in RL_METHODS:
        raise ConfigError(f"unknown RL method {method!r}; choose one of {', '.join(RL_METHODS)}")
    if engine not in ENGINES:
        raise ConfigError(f"{source or method}: engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if options and options.get("services"):
        raise ConfigError(f"{source or method}: options.services is not supported in a pipeline step: the "
                          "rollout service runs in the same pod (see the multi-node TrainJob for split services)")
    values = {"method": method, "data": data, "output": output, "model": model, "steps": steps,
              "batch_size": batch_size, "policy_lr": policy_lr, "engine": engine, "resume": True,
              "cache_dir": artifacts.cache_dir(), **{k: v for k, v in explicit.items() if v is not None}}
    return artifacts.build(RLConfig, values, options, source or f"{method}_train")


#: Where the RL step of grpo and sao runs (post_training and sao_rl ``placement``).
PLACEMENTS = ("single_pod", "trainjob")
#: A run id of the length of a KFP run id (a UUID), so the check sees TrainJob names as long as a run's.
_CHECK_RUN_ID = "00000000-0000-0000-0000-000000000000"


def check_post_training(method: str, steps: int, batch_size: int, learning_rate: float, max_tokens: int,
                        engine: str, method_options: dict | None, warm_start_source: str,
                        warm_start_steps: int, output_root: str, placement: str = "single_pod", num_nodes: int = 1,
                        gpus_per_node: int = 8, rollout_replicas: int = 2, rollout_gpus: int = 1,
                        tensor_parallel_size: int = 1, s3_secret_name: str = "sao-s3") -> str:
    """Validate post_training's arguments as the chosen method's step will; return its data kind.

    Raises ConfigError (unknown method or placement, bad values, unknown or misspelt options, a TrainJob
    shape the launcher would refuse) so a bad run fails in seconds instead of after data preparation.
    """
    if method not in POST_TRAINING_METHODS:
        raise ConfigError(f"unknown method {method!r}; choose one of {', '.join(POST_TRAINING_METHODS)}")
    if placement not in PLACEMENTS:
        raise ConfigError(f"unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)} (single_pod: "
                          "the rollout service and the learner in one pod; trainjob: one Kubeflow Trainer TrainJob)")
    artifacts.run_dir(output_root, "check", method)  # output_root must be set
    placeholder = {"data": "<prepared data>", "output": "<output_root>/<run>/" + method, "model": "<base_model>"}
    if DATA_KIND[method] == "rl":
        rl_config(method, **placeholder, steps=steps, batch_size=batch_size, policy_lr=learning_rate,
                  engine=engine, options=method_options, source=f"post_training ({method})")
        if isinstance(warm_start_steps, bool) or not isinstance(warm_start_steps, int) or warm_start_steps < 0:
            raise ConfigError(f"warm_start_steps must be an integer >= 0, got {warm_start_steps!r}")
        if warm_start_steps and not warm_start_source:
            raise ConfigError("warm_start_steps > 0 needs warm_start_source (the SFT data of the warm start)")
        if placement == "trainjob":
            check_trainjob(method, output_root, steps=steps, batch_size=batch_size, policy_lr=learning_rate,
                           engine=engine, options=method_options, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                           rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                           tensor_parallel_size=tensor_parallel_size, s3_secret_name=s3_secret_name)
    else:
        training_config(method, **placeholder, steps=steps, batch_size=batch_size, lr=learning_rate,
                        max_tokens=max_tokens, options=method_options, source=f"post_training ({method})")
        if warm_start_steps:
            raise ConfigError(f"warm_start_steps applies to grpo and sao only (method is {method!r}); set it to 0")
        if placement != "single_pod":
            raise ConfigError(f"placement={placement} applies to grpo and sao only (method is {method!r}); "
                              "set it to single_pod")
    return DATA_KIND[method]


def check_trainjob(method: str, output_root: str, *, steps: int, batch_size: int, policy_lr: float, engine: str,
                   options: dict | None, num_nodes: int, gpus_per_node: int, rollout_replicas: int,
                   rollout_gpus: int, tensor_parallel_size: int, s3_secret_name: str) -> None:
    """Refuse what the ``launch_trainjob`` step would refuse (``placement=trainjob``), without a cluster.

    Builds the launcher's :class:`sao_core.cluster.launcher.LaunchConfig` with placeholder images,
    data and run id and validates it (shape, RL options, S3 secret name, TrainJob name length);
    raises ConfigError naming the setting.
    """
    from sao_core import storage
    from sao_core.cluster.launcher import LaunchConfig

    root = output_root.strip() if isinstance(output_root, str) else output_root
    if not isinstance(root, str) or not storage.is_s3_uri(root):
        raise ConfigError(f"placement=trainjob needs an s3://bucket/prefix output_root, got {output_root!r}: the "
                          "TrainJob's learner nodes and rollout replicas run in separate pods and share checkpoints, "
                          "weights and the final model through it")
    given = {"steps": steps, "batch_size": batch_size, "policy_lr": policy_lr}
    repeated = sorted(set(options or {}) & set(given))
    if repeated:  # launch_trainjob refuses these even at their default values
        raise ConfigError(f"placement=trainjob: method_options may not repeat {', '.join(repeated)} (they are "
                          "parameters: steps, batch_size, learning_rate)")
    rl_options = {**(options or {}), **given}
    config = LaunchConfig(image="check", rollout_image="check", data="s3://check/data",
                          output=artifacts.run_dir(root, _CHECK_RUN_ID, method), run_id=_CHECK_RUN_ID, stage=method,
                          method=method, engine=engine, rl_options=rl_options, num_nodes=num_nodes,
                          gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                          tensor_parallel_size=tensor_parallel_size, s3_secret_name=s3_secret_name)
    try:
        config.validate()
    except ValueError as err:
        raise ConfigError(f"placement=trainjob: {err}") from None
