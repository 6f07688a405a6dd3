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

Written by :func:`components._factory.build_component`: the parameters that carry an RLConfig or LaunchConfig
setting take their type, default and description from the settings registry.
"""

from dataclasses import replace

from components._factory import REPORT, Parameter, artifact_parameters, build_component, carried_parameter
from sao_core.cluster.launcher import LaunchConfig
from sao_core.learner.config import RLConfig

#: The parameters that carry no setting (or, like `model`, another thing than the setting of that name).
_OWN = {parameter.name: parameter for parameter in (
    *artifact_parameters({
        "data": "Prepared rl dataset (copied to the run's s3:// directory when the artifact store is not S3).",
        "output_root": "s3://bucket/prefix; the run writes OUTPUT_ROOT/RUN_ID/STAGE (checkpoints, weights, model).",
        "model": "Pointer to the trained policy (checkpoint_uri, sha256, method, step, version).",
        "critic": "Pointer to the trained critic (sao); an empty pointer for methods without one.",
        "metrics": "Summary numbers of the run (reward first/last, drops, seconds, queueing seconds).",
        "summary": "Markdown page with the summary and the reward curve.",
        "report": REPORT,
    }, critic=True),
    Parameter("base_model", "str", "Initial policy (and critic): an s3:// checkpoint or a hub id the pods can reach.",
              "embedded:tiny"),
    Parameter("options", "Optional[dict]", 'Any other RLConfig field, e.g. {"critic_lr": 5e-6, "max_total_tokens": '
                                           '32768, "checkpoint_every": 50}.', None),
    Parameter("learner_image", "str", "Image of the learner nodes ('' = the project's train image of this version).",
              ""),
    Parameter("launch_options", "Optional[dict]", 'Other LaunchConfig fields, e.g. {"priority_class": "high", '
                                                  '"node_memory": "900Gi", "env": {"NCCL_DEBUG": "INFO"}}.', None),
)}
#: Settings whose parameter may stay None: the setting keeps its default.
_OPTIONAL = {"critic_lr", "critic_updates", "critic_warmup_steps", "max_staleness", "admission", "eps_low", "eps_high",
             "node_selector", "tolerations"}
#: The component's defaults that are not the registry's: 8-GPU learner nodes, vLLM rollouts.
_DEFAULTS = {"gpus_per_node": 8, "engine": "vllm"}
#: Every parameter, in signature order.
_SIGNATURE = (
    "data", "output_root", "model", "critic", "metrics", "summary", "report", "method", "base_model", "steps",
    "batch_size", "policy_lr", "critic_lr", "critic_updates", "critic_warmup_steps", "max_staleness", "admission",
    "eps_low", "eps_high", "options", "run_id", "stage", "namespace", "queue_name", "cluster_runtime",
    "learner_image", "rollout_image", "num_nodes", "gpus_per_node", "rollout_replicas", "rollout_gpus",
    "tensor_parallel_size", "data_parallel_size", "engine", "gpu_memory_utilization", "max_num_seqs",
    "enable_prefix_caching", "max_model_len", "accelerator_type", "node_selector", "tolerations", "s3_secret_name",
    "timeout_s", "launch_options")


def _parameter(name: str) -> Parameter:
    """Parameter `name`: its own (:data:`_OWN`), else the RLConfig or LaunchConfig setting it carries."""
    if name in _OWN:
        return _OWN[name]
    parameter = carried_parameter(name, (RLConfig, LaunchConfig), optional=name in _OPTIONAL)
    return replace(parameter, default=_DEFAULTS[name]) if name in _DEFAULTS else parameter


_BODY = '''
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
    Path(critic.path).write_text(json.dumps({"checkpoint_uri": "", "method": method, "note": "no critic"}) + "\\n")
model_uri, checkpoint_uri = artifacts.finish_training(
    result.training_result(), method, base_model, run, model, metrics, summary, curve_key="reward_mean",
    critic_artifact=critic, report_artifact=report)
outputs = NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str, trainjob=str)  # as declared
return outputs(model_uri, checkpoint_uri, f"{result.namespace}/{result.name}")
'''

launch_trainjob = build_component(
    "launch_trainjob", [_parameter(name) for name in _SIGNATURE],
    'NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str, trainjob=str)',
    "Run RL as a TrainJob (rollout replicas + torchrun learner) and return pointers to its final model.",
    _BODY, "cpu", __name__)
