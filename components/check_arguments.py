"""check_post_training_arguments and check_sao_rl_arguments: the first step of post_training and of sao_rl.

Validates the run's arguments exactly as the chosen method's training step will (the same config
classes and messages as the CLI), so an unknown method or placement, a misspelt option, a bad value
or (``placement=trainjob``) a local output_root or a TrainJob shape the launcher would refuse fails in
seconds on a small CPU pod instead of after data preparation on a GPU node. Returns the data kind
the method trains on (sft, cpt, dpo or rl), which the data preparation step uses.

Written by :func:`components._factory.build_component`: both checks end with the same TrainJob shape
parameters (:data:`TRAINJOB_SHAPE`).
"""

from components._factory import Parameter, build_component

_OUTPUT_ROOT = Parameter("output_root", "str", "Where runs are written (must be set).")
_WARM_START_STEPS = Parameter("warm_start_steps", "int", "SFT steps of the warm start (0 = none).")
#: The TrainJob shape both checks take after `placement` (validated only with placement=trainjob).
TRAINJOB_SHAPE = [
    Parameter("num_nodes", "int", "trainjob: learner nodes.", 1),
    Parameter("gpus_per_node", "int", "trainjob: GPUs per learner node.", 8),
    Parameter("rollout_replicas", "int", "trainjob: rollout service replicas.", 2),
    Parameter("rollout_gpus", "int", "trainjob: GPUs per rollout replica.", 1),
    Parameter("tensor_parallel_size", "int", "trainjob: vLLM tensor-parallel size inside a replica.", 1),
]


def _placement_parameters(placement: str, s3_secret: str) -> list[Parameter]:
    """`placement`, the :data:`TRAINJOB_SHAPE` and `s3_secret_name` (the last parameters of both checks);
    `placement` and `s3_secret` describe the first and the last."""
    return [Parameter("placement", "str", placement, "single_pod"), *TRAINJOB_SHAPE,
            Parameter("s3_secret_name", "str", s3_secret, "sao-s3")]


check_post_training_arguments = build_component(
    "check_post_training_arguments",
    [
        Parameter("method", "str", "sft, cpt, dpo, gkd, grpo or sao."),
        _OUTPUT_ROOT,
        Parameter("steps", "int", "Training steps."),
        Parameter("batch_size", "int", "Examples (or trajectories) per step."),
        Parameter("learning_rate", "float", "Learning rate (policy learning rate for grpo and sao)."),
        Parameter("max_tokens", "int", "Token limit of sft/cpt/dpo/gkd examples."),
        Parameter("engine", "str", "Rollout engine of grpo and sao: vllm or hf."),
        Parameter("warm_start_source", "str", "SFT data of the warm start before grpo/sao ('' = none)."),
        _WARM_START_STEPS,
        Parameter("method_options", "Optional[dict]", "Other config fields of the chosen method.", None),
        *_placement_parameters(
            "Where grpo and sao train: single_pod or trainjob (then output_root must be s3:// and the shape below "
            "must be one the launcher accepts).",
            "trainjob: Secret with the S3 credentials of the TrainJob's pods (required there)."),
    ],
    'NamedTuple("CheckOutputs", data_kind=str)',
    "Validate post_training's arguments for the chosen method; return its data kind.",
    '''
from sao_core.kfp import params

kind = params.check_post_training(method, steps=steps, batch_size=batch_size, learning_rate=learning_rate,
                                  max_tokens=max_tokens, engine=engine, method_options=method_options,
                                  warm_start_source=warm_start_source, warm_start_steps=warm_start_steps,
                                  output_root=output_root, placement=placement, num_nodes=num_nodes,
                                  gpus_per_node=gpus_per_node, rollout_replicas=rollout_replicas,
                                  rollout_gpus=rollout_gpus, tensor_parallel_size=tensor_parallel_size,
                                  s3_secret_name=s3_secret_name)
return (kind,)  # the NamedTuple outputs, in order
''',
    "cpu", __name__)

check_sao_rl_arguments = build_component(
    "check_sao_rl_arguments",
    [
        _OUTPUT_ROOT,
        Parameter("steps", "int", "SAO learner steps."),
        Parameter("batch_size", "int", "Trajectories per step."),
        Parameter("policy_lr", "float", "Policy learning rate."),
        Parameter("max_staleness", "int", "S, in versions."),
        Parameter("admission", "str", "Admission rule."),
        Parameter("eps_low", "float", "DIS band lower width."),
        Parameter("eps_high", "float", "DIS band upper width."),
        Parameter("engine", "str", "Rollout engine: vllm or hf."),
        Parameter("warm_start_source", "str", "SFT data of the warm start ('' = none)."),
        _WARM_START_STEPS,
        Parameter("options", "Optional[dict]",
                  "b_options: other RLConfig settings (an unknown key is refused by name).", None),
        Parameter("warm_start_options", "Optional[dict]", "b_warm_start_options: SFTConfig settings of the warm start.",
                  None),
        Parameter("eval_options", "Optional[dict]", "c_eval_options: EvalConfig settings of the final evaluation.",
                  None),
        *_placement_parameters(
            "single_pod or trainjob (then output_root must be s3:// and the shape one the launcher accepts).",
            "trainjob: Secret with the S3 credentials of the TrainJob's pods."),
    ],
    "None",
    "Validate sao_rl's arguments as its steps will, naming the pipeline field (the first step of sao_rl).",
    '''
from sao_core.kfp import params

params.check_sao_rl(output_root, steps, batch_size, policy_lr, max_staleness, admission, eps_low, eps_high,
                    engine, options, warm_start_source, warm_start_steps, warm_start_options, eval_options,
                    placement, num_nodes, gpus_per_node, rollout_replicas, rollout_gpus, tensor_parallel_size,
                    s3_secret_name)
''',
    "cpu", __name__)
