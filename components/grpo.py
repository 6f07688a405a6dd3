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

from sao_core.images import image


@dsl.component(base_image=image("rollout"), install_kfp_package=False)
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
    """GRPO-family RL training (grpo, grpo_async, grpo_dis, running_mean) with colocated rollouts.

    Args:
        data: Prepared rl dataset (prompt, reference answer or tests, environment).
        output_root: Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs.
        model: Pointer to the trained policy (checkpoint_uri, sha256, method, step, version).
        metrics: Summary numbers (reward first/last, dropped trajectories, versions, seconds).
        summary: Markdown page with the summary and the reward curve.
        report: The training report (HTML): loss / reward curves with moving averages (RL: DIS masks, staleness, drops, critic, throughput), the config and the checkpoints.
        method: RL method: sao, grpo (synchronous), grpo_async, grpo_dis or running_mean.
        base_model: Initial policy checkpoint: embedded:tiny, a directory, s3:// or a hub id.
        steps: Optimiser steps (RL: learner steps) in total.
        batch_size: Trajectories per step (B), one per prompt (GRPO: groups of group_size).
        group_size: G, rollouts per prompt of the GRPO methods (batch_size must be a multiple).
        policy_lr: Policy learning rate (peak, after the warm-up).
        max_staleness: S, the most weights versions a trained token may lag (window / version_order / requeue drop trajectories beyond it; no_drop / fragments drop only past the safety bound).
        admission: How the run admits episodes and batches them: no_drop, window, version_order, requeue or fragments. no_drop (the default): arrival order, nothing dropped or waited for, the early tokens of long episodes may lag more than S (DIS guards them; an episode older than the safety bound hard_staleness, default 4·S, is dropped); window: (S+1)·B episodes in flight, trained in arrival order, stale ones dropped; version_order: the oldest admission cohort first, never an episode admitted after one still running (nothing stale; the learner waits for each cohort); requeue: window, and a prompt dropped as stale is rolled out once more; fragments (sao only): long episodes are trained in pieces cut at turn boundaries, advantages bootstrapped from the critic (fewer tokens beyond S than no_drop, at a lower throughput).
        engine: Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).
        options: Any other RLConfig field, e.g. {"clip_low": 0.2, "clip_high": 0.28, "max_total_tokens": 32768}.
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
    """
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
