"""sao_train: SAO (Single-rollout Asynchronous Optimization) with a colocated rollout service.

Calls :func:`sao_core.learner.loop.train_rl` with ``method="sao"`` and no ``services``: the rollout
service (engine + environments) runs in the same pod as the learner (single node; KFP 2.17 has no
sidecars). One rollout per prompt, a learned token-level critic, DIS against the engine's log-probs.
The run goes to ``OUTPUT_ROOT/RUN_ID/sao`` and resumes from its checkpoints (and journal) when the pod
restarts. Outputs: the policy and the critic as Model pointers, Metrics, a Markdown reward curve.
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Dataset, Input, Markdown, Metrics, Model, Output

from components._factory import rl_described
from sao_core.images import image


@dsl.component(base_image=image("rollout"), install_kfp_package=False)
@rl_described(
    "SAO training: one rollout per prompt, learned critic, DIS, asynchronous colocated rollouts.",
    base_model="Initial policy (and critic) checkpoint: embedded:tiny, a directory, s3:// or a hub id.",
    options='Any other RLConfig field (or one left at its default above), e.g. {"max_total_tokens": 32768, '
            '"checkpoint_every": 50}.')
def sao_train(
    data: Input[Dataset],
    output_root: str,
    model: Output[Model],
    critic: Output[Model],
    metrics: Output[Metrics],
    summary: Output[Markdown],
    report: Output[HTML],
    base_model: str = "embedded:tiny",
    steps: int = 100,
    batch_size: int = 32,
    policy_lr: float = 1e-6,
    critic_lr: float = 5e-6,
    critic_updates: int = 2,
    critic_warmup_steps: int = 10,
    max_staleness: int = 4,
    admission: str = "no_drop",
    eps_low: float = 0.3,
    eps_high: float = 5.0,
    engine: str = "vllm",
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
) -> NamedTuple("RLOutputs", model_uri=str, checkpoint_uri=str):
    from sao_core.kfp import artifacts, params
    from sao_core.learner.loop import train_rl

    artifacts.quiet_http_logs()
    run = artifacts.run_dir(output_root, run_id, "sao")
    config = params.rl_config("sao", data=data.path, output=run, model=base_model, steps=steps,
                              batch_size=batch_size, policy_lr=policy_lr, engine=engine, options=options,
                              critic_lr=critic_lr, critic_updates=critic_updates,
                              critic_warmup_steps=critic_warmup_steps, max_staleness=max_staleness,
                              admission=admission, eps_low=eps_low, eps_high=eps_high)
    result = train_rl(config)
    model_uri, checkpoint_uri = artifacts.finish_training(result, "sao", base_model, run, model, metrics, summary,
                                                          curve_key="reward_mean", critic_artifact=critic,
                                                          report_artifact=report)
    return (model_uri, checkpoint_uri)  # the NamedTuple outputs, in order
