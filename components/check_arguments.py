"""check_post_training_arguments and check_sao_rl_arguments: the first step of post_training and of sao_rl.

Validates the run's arguments exactly as the chosen method's training step will (the same config
classes and messages as the CLI), so an unknown method or placement, a misspelt option, a bad value
or (``placement=trainjob``) a local output_root or a TrainJob shape the launcher would refuse fails in
seconds on a small CPU pod instead of after data preparation on a GPU node. Returns the data kind
the method trains on (sft, cpt, dpo or rl), which the data preparation step uses.
"""

from typing import NamedTuple, Optional

from kfp import dsl

from sao_core.images import image


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def check_post_training_arguments(
    method: str,
    output_root: str,
    steps: int,
    batch_size: int,
    learning_rate: float,
    max_tokens: int,
    engine: str,
    warm_start_source: str,
    warm_start_steps: int,
    method_options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    placement: str = "single_pod",
    num_nodes: int = 1,
    gpus_per_node: int = 8,
    rollout_replicas: int = 2,
    rollout_gpus: int = 1,
    tensor_parallel_size: int = 1,
    s3_secret_name: str = "sao-s3",
) -> NamedTuple("CheckOutputs", data_kind=str):
    """Validate post_training's arguments for the chosen method; return its data kind.

    Args:
        method: sft, cpt, dpo, gkd, grpo or sao.
        output_root: Where runs are written (must be set).
        steps: Training steps.
        batch_size: Examples (or trajectories) per step.
        learning_rate: Learning rate (policy learning rate for grpo and sao).
        max_tokens: Token limit of sft/cpt/dpo/gkd examples.
        engine: Rollout engine of grpo and sao: vllm or hf.
        warm_start_source: SFT data of the warm start before grpo/sao ('' = none).
        warm_start_steps: SFT steps of the warm start (0 = none).
        method_options: Other config fields of the chosen method.
        placement: Where grpo and sao train: single_pod or trainjob (then output_root must be s3:// and the shape below must be one the launcher accepts).
        num_nodes: trainjob: learner nodes.
        gpus_per_node: trainjob: GPUs per learner node.
        rollout_replicas: trainjob: rollout service replicas.
        rollout_gpus: trainjob: GPUs per rollout replica.
        tensor_parallel_size: trainjob: vLLM tensor-parallel size inside a replica.
        s3_secret_name: trainjob: Secret with the S3 credentials of the TrainJob's pods (required there).
    """
    from sao_core.kfp import params

    kind = params.check_post_training(method, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
                                      max_tokens=max_tokens, engine=engine, method_options=method_options,
                                      warm_start_source=warm_start_source, warm_start_steps=warm_start_steps,
                                      output_root=output_root, placement=placement, num_nodes=num_nodes,
                                      gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas,
                                      rollout_gpus=rollout_gpus, tensor_parallel_size=tensor_parallel_size,
                                      s3_secret_name=s3_secret_name)
    return (kind,)  # the NamedTuple outputs, in order


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def check_sao_rl_arguments(
    output_root: str,
    steps: int,
    batch_size: int,
    policy_lr: float,
    max_staleness: int,
    admission: str,
    eps_low: float,
    eps_high: float,
    engine: str,
    warm_start_source: str,
    warm_start_steps: int,
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    warm_start_options: Optional[dict] = None,  # noqa: UP045
    eval_options: Optional[dict] = None,  # noqa: UP045
    placement: str = "single_pod",
    num_nodes: int = 1,
    gpus_per_node: int = 8,
    rollout_replicas: int = 2,
    rollout_gpus: int = 1,
    tensor_parallel_size: int = 1,
    s3_secret_name: str = "sao-s3",
):
    """Validate sao_rl's arguments as its steps will, naming the pipeline field (the first step of sao_rl).

    Args:
        output_root: Where runs are written (must be set).
        steps: SAO learner steps.
        batch_size: Trajectories per step.
        policy_lr: Policy learning rate.
        max_staleness: S, in versions.
        admission: Admission rule.
        eps_low: DIS band lower width.
        eps_high: DIS band upper width.
        engine: Rollout engine: vllm or hf.
        warm_start_source: SFT data of the warm start ('' = none).
        warm_start_steps: SFT steps of the warm start (0 = none).
        options: b_options: other RLConfig settings (an unknown key is refused by name).
        warm_start_options: b_warm_start_options: SFTConfig settings of the warm start.
        eval_options: c_eval_options: EvalConfig settings of the final evaluation.
        placement: single_pod or trainjob (then output_root must be s3:// and the shape one the launcher accepts).
        num_nodes: trainjob: learner nodes.
        gpus_per_node: trainjob: GPUs per learner node.
        rollout_replicas: trainjob: rollout service replicas.
        rollout_gpus: trainjob: GPUs per rollout replica.
        tensor_parallel_size: trainjob: vLLM tensor-parallel size inside a replica.
        s3_secret_name: trainjob: Secret with the S3 credentials of the TrainJob's pods.
    """
    from sao_core.kfp import params

    params.check_sao_rl(output_root, steps, batch_size, policy_lr, max_staleness, admission, eps_low, eps_high,
                        engine, options, warm_start_source, warm_start_steps, warm_start_options, eval_options,
                        placement, num_nodes, gpus_per_node, rollout_replicas, rollout_gpus, tensor_parallel_size,
                        s3_secret_name)
