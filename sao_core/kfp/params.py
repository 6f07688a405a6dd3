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
    from sao_core.config import config_defaults, merge_options
    from sao_core.learner.config import RLConfig

    given = {"steps": steps, "batch_size": batch_size, "policy_lr": policy_lr}
    rl_options = merge_options(given, options, config_defaults(RLConfig), "placement=trainjob",
                               config=RLConfig)
    config = LaunchConfig(image="check", rollout_image="check", data="s3://check/data",
                          output=artifacts.run_dir(root, _CHECK_RUN_ID, method), run_id=_CHECK_RUN_ID, stage=method,
                          method=method, engine=engine, rl_options=rl_options, num_nodes=num_nodes,
                          gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                          tensor_parallel_size=tensor_parallel_size, s3_secret_name=s3_secret_name)
    try:
        config.validate()
    except ValueError as err:
        raise ConfigError(f"placement=trainjob: {err}") from None


#: The sao_rl pipeline's parameter groups, in the order the KFP UI lists them (alphabetically by name).
SAO_RL_GROUPS = {"a0": "required", "a": "what else to train on", "b": "SAO settings", "c": "evaluation",
                 "d": "cluster"}
#: sao_rl's warm-start SFT: the SFTConfig fields it sets itself (its data, steps and model come from the run).
WARM_START_DEFAULTS = {"lr": 1e-5, "batch_size": 16, "max_tokens": 512}


def check_sao_rl(output_root: str, steps: int, batch_size: int, policy_lr: float, max_staleness: int,
                 admission: str, eps_low: float, eps_high: float, engine: str, options: dict | None,
                 warm_start_source: str, warm_start_steps: int, warm_start_options: dict | None,
                 eval_options: dict | None, placement: str, num_nodes: int, gpus_per_node: int,
                 rollout_replicas: int, rollout_gpus: int, tensor_parallel_size: int, s3_secret_name: str) -> None:
    """Validate sao_rl's arguments as its steps will (RLConfig, the warm start's SFTConfig, EvalConfig and, for
    ``placement=trainjob``, the launcher's LaunchConfig), naming the pipeline field: an unknown key of
    ``b_options`` / ``b_warm_start_options`` / ``c_eval_options`` is refused by name before any other step runs."""
    from sao_core.eval.config import EvalConfig

    if placement not in PLACEMENTS:
        raise ConfigError(f"d_placement: unknown placement {placement!r}; choose one of {', '.join(PLACEMENTS)}")
    artifacts.run_dir(output_root, "check", "sao")  # output_root must be set
    placeholder = {"data": "<prepared data>", "output": "<output_root>/<run>/sao", "model": "<base_model>"}
    sao = {"max_staleness": max_staleness, "admission": admission, "eps_low": eps_low, "eps_high": eps_high}
    rl_config("sao", **placeholder, steps=steps, batch_size=batch_size, policy_lr=policy_lr, engine=engine,
              options=options, source="sao_rl (b_options and the b_ settings)", **sao)
    if isinstance(warm_start_steps, bool) or not isinstance(warm_start_steps, int) or warm_start_steps < 0:
        raise ConfigError(f"b_warm_start_steps must be an integer >= 0, got {warm_start_steps!r}")
    if warm_start_steps and not warm_start_source:
        raise ConfigError("b_warm_start_steps > 0 needs a_warm_start_source (the SFT data of the warm start)")
    training_config("sft", **placeholder, steps=max(warm_start_steps, 1), **WARM_START_DEFAULTS,
                    options=warm_start_options, source="sao_rl b_warm_start_options")
    artifacts.build(EvalConfig, {"model": "<trained model>", "output": "<output_root>/<run>/eval",
                                 "resume": True, "cache_dir": artifacts.cache_dir()}, eval_options,
                    "sao_rl c_eval_options")
    if placement == "trainjob":
        from sao_core.config import flatten_sections
        from sao_core.learner.config import RLConfig

        flat = flatten_sections(RLConfig, options or {}, "sao_rl b_options")  # `admission` may name its section
        check_trainjob("sao", output_root, steps=steps, batch_size=batch_size, policy_lr=policy_lr, engine=engine,
                       options={**sao, **flat}, num_nodes=num_nodes, gpus_per_node=gpus_per_node,
                       rollout_replicas=rollout_replicas, rollout_gpus=rollout_gpus,
                       tensor_parallel_size=tensor_parallel_size, s3_secret_name=s3_secret_name)


def sao_rl_description(top_level: set[str]) -> str:
    """The sao_rl pipeline's description in the KFP UI: the required fields, the groups, where the parameter
    reference is, and every key ``b_options`` accepts with its default (RLConfig's settings without a
    top-level field), generated from the settings registry."""
    from sao_core.config import settings_of
    from sao_core.learner.config import RLConfig

    reserved = {"data", "output", "model", "method", "resume", "cache_dir", "services", "service_token_file",
                "shutdown_services"}
    keys = [f"`{s.name}={s.default!r}`" for s in settings_of(RLConfig).values()
            if s.name not in top_level | reserved and s.name != "engine"]
    groups = "; ".join(f"`{k}_` {v}" for k, v in SAO_RL_GROUPS.items())
    warm = ", ".join(f"`{k}={v!r}`" for k, v in WARM_START_DEFAULTS.items())
    # The first line is what the KFP UI's pipeline list shows (~75 characters); names in code spans, because the UI
    # renders the description as Markdown and would turn the underscores of bare names into italics.
    return ("Required: `a0_rl_source` (RL prompts) and `a0_output_root` (where to).\n\n"
            "SAO end to end: data preparation, optional SFT warm start, SAO training (one pod or a TrainJob), "
            "evaluation and a report. The two `a0_` fields come first in the form; every other field has a default. "
            f"Fields are grouped by prefix, in the order listed: {groups}. Every field and setting is described in "
            "components/README.md (Settings reference) and pipelines/README.md. `b_options` takes any of these "
            f"RLConfig settings as JSON (defaults shown; an unknown key fails the first step): {', '.join(keys)}. "
            f"`b_warm_start_options` takes SFTConfig settings (defaults {warm}); `c_eval_options` takes EvalConfig "
            "settings (e.g. `max_new_tokens=4096`, `max_total_tokens=32768`).")
