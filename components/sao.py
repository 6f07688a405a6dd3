"""sao_train: SAO (Single-rollout Asynchronous Optimization) with a colocated rollout service.

Calls :func:`sao_core.learner.loop.train_rl` with ``method="sao"`` and no ``services``: the rollout
service (engine + environments) runs in the same pod as the learner (single node; KFP 2.17 has no
sidecars). One rollout per prompt, a learned token-level critic, DIS against the engine's log-probs.
The run goes to ``OUTPUT_ROOT/RUN_ID/sao`` and resumes from its checkpoints (and journal) when the pod
restarts. Outputs: the policy and the critic as Model pointers, Metrics, a Markdown reward curve.

Written by :func:`components._factory.rl_component` from the RLConfig settings named below: their types,
defaults and descriptions come from the settings registry.
"""

from components._factory import rl_component

sao_train = rl_component(
    "sao_train", __name__,
    "SAO training: one rollout per prompt, learned critic, DIS, asynchronous colocated rollouts.",
    method="sao", critic=True,
    settings=("steps", "batch_size", "policy_lr", "critic_lr", "critic_updates", "critic_warmup_steps",
              "max_staleness", "admission", "eps_low", "eps_high", "engine"),
    base_model="Initial policy (and critic) checkpoint: embedded:tiny, a directory, s3:// or a hub id.",
    options='Any other RLConfig field (or one left at its default above), e.g. {"max_total_tokens": 32768, '
            '"checkpoint_every": 50}.')
