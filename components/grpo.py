"""grpo_train: the GRPO baselines with a colocated rollout service.

Calls :func:`sao_core.learner.loop.train_rl` with one of ``grpo`` (synchronous, G rollouts per
prompt, PPO clip against a recomputed pi_old), ``grpo_async`` (ratio against the rollout log-probs),
``grpo_dis`` (GRPO advantages + DIS) or ``running_mean`` (one rollout per prompt, per-prompt
running-mean baseline + DIS). The rollout service runs in the same pod. The run goes to
``OUTPUT_ROOT/RUN_ID/METHOD`` and resumes from its checkpoints when the pod restarts.
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from components._factory import rl_described
from sao_core.images import image


@dsl.component(base_image=image("rollout"), install_kfp_package=False)
@rl_described(
    "GRPO-family RL training (grpo, grpo_async, grpo_dis, running_mean) with colocated rollouts.",
    base_model="Initial policy checkpoint: embedded:tiny, a directory, s3:// or a hub id.",
    options='Any other RLConfig field, e.g. {"clip_low": 0.2, "clip_high": 0.28, "max_total_tokens": 32768}.')
def grpo_train(
    data: Input[Dataset],
    output_root: str,
    model: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
    report: Output[HTML],
    method: str = "grpo",
    base_model: str = "embedded:tiny",
    steps: int = 100,
    batch_size: int = 32,
    group_size: int = 8,
    policy_lr: float = 1e-6,
    max_staleness: int = 4,
    admission: str = "no_drop",
    engine: str = "vllm",
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
) -> NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str):
    from sao_core.config import ConfigError
    from sao_core.kfp import artifacts, params
    from sao_core.learner.loop import train_rl

    if method not in params.GRPO_METHODS:
        raise ConfigError(f"grpo_train: method must be one of {', '.join(params.GRPO_METHODS)}, got {method!r} "
                          "(SAO has its own component, sao_train)")
    artifacts.quiet_http_logs()
    run = artifacts.run_dir(output_root, run_id, method)
    config = params.rl_config(method, data=data.path, output=run, model=base_model, steps=steps,
                              batch_size=batch_size, policy_lr=policy_lr, engine=engine, options=options,
                              group_size=group_size, max_staleness=max_staleness, admission=admission)
    result = train_rl(config)
    model_uri, checkpoint_uri = artifacts.finish_training(result, method, base_model, run, model, metrics, summary,
                                                          curve_key="reward_mean", report_artifact=report)
    return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
