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

from sao_core.images import image


@dsl.component(base_image=image("rollout"), install_kfp_package=False)
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
    """SAO training: one rollout per prompt, learned critic, DIS, asynchronous colocated rollouts.

    Args:
        data: Prepared rl dataset (prompt, reference answer or tests, environment).
        output_root: Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs.
        model: Pointer to the trained policy (checkpoint_uri, sha256, method, step, version).
        critic: Pointer to the trained critic (value model).
        metrics: Summary numbers (reward first/last, dropped trajectories, versions, seconds).
        summary: Markdown page with the summary and the reward curve.
        report: The training report (HTML): loss / reward curves with moving averages (RL: DIS masks, staleness, drops, critic, throughput), the config and the checkpoints.
        base_model: Initial policy (and critic) checkpoint: embedded:tiny, a directory, s3:// or a hub id.
        steps: Optimiser steps (RL: learner steps) in total.
        batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
        policy_lr: Policy learning rate (peak, after the warm-up).
        critic_lr: Critic learning rate.
        critic_updates: Critic updates per policy update (K).
        critic_warmup_steps: Critic-only steps before the first policy update.
        max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound).
        admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
        eps_low: DIS band lower width: tokens with ratio <= 1 - eps_low are masked (0.3 math with tools, 0.8 agentic coding).
        eps_high: DIS band upper width: tokens with ratio >= 1 + eps_high are masked (5.0 math with tools, 3.0 agentic coding).
        engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
        options: Any other RLConfig field (or one left at its default above), e.g. {"max_total_tokens": 32768, "checkpoint_every": 50}.
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
    """
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
