"""grpo_train: the GRPO baselines with a colocated rollout service.

Calls :func:`sao_core.learner.loop.train_rl` with one of ``grpo`` (synchronous, G rollouts per
prompt, PPO clip against a recomputed pi_old), ``grpo_async`` (ratio against the rollout log-probs),
``grpo_dis`` (GRPO advantages + DIS) or ``running_mean`` (one rollout per prompt, per-prompt
running-mean baseline + DIS). The rollout service runs in the same pod. The run goes to
``OUTPUT_ROOT/RUN_ID/METHOD`` and resumes from its checkpoints when the pod restarts.

Written by :func:`components._factory.rl_component` from the RLConfig settings named below (``method`` is a
parameter: one of the GRPO family); their types, defaults and descriptions come from the settings registry.
"""

from components._factory import rl_component

grpo_train = rl_component(
    "grpo_train", __name__,
    "GRPO-family RL training (grpo, grpo_async, grpo_dis, running_mean) with colocated rollouts.",
    method=None,
    settings=("steps", "batch_size", "group_size", "policy_lr", "max_staleness", "admission", "engine"),
    base_model="Initial policy checkpoint: embedded:tiny, a directory, s3:// or a hub id.",
    options='Any other RLConfig field, e.g. {"clip_low": 0.2, "clip_high": 0.28, "max_total_tokens": 32768}.')
