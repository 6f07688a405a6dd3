"""One learner step per method: advantages, critic updates (SAO) and the policy update.

sao           critic values → skip-observation GAE (adaptive λ) for advantages, λ = 1 returns for the
              critic; K critic updates; after the warm-up one DIS policy step.
grpo          group-normalised advantages; PPO clip against π_old recomputed by the learner (the
              synchronous baseline: one update per batch, so π_old is the current policy).
grpo_async    group advantages; PPO clip against the rollout engine's log-probs.
grpo_dis      group advantages; DIS against the rollout log-probs.
running_mean  one rollout per prompt; advantage = R − mean of the prompt's last rewards; DIS.
"""

from __future__ import annotations

import torch

from sao_core.learner.batch import RLBatch
from sao_core.learner.config import RLConfig
from sao_core.objectives.common import token_logprobs
from sao_core.objectives.gae import adaptive_lambda, skip_observation_gae
from sao_core.objectives.grpo import RunningMeanBaseline, group_advantages, ppo_clip_loss
from sao_core.objectives.sao import dis_policy_loss, value_loss


def _policy_forward(policy, batch: RLBatch) -> tuple[torch.Tensor, dict[str, float]]:
    """Log-probs [B, T] with gradient, plus entropy and |logp − rollout_logp| statistics."""
    logits = policy(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = token_logprobs(logits, batch.input_ids)
    mask = batch.action_mask.bool()
    with torch.no_grad():
        # Entropy of the next-token distribution at the positions that sampled action tokens.
        shifted = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        entropy = -(shifted.exp() * shifted).sum(-1)
        entropy = torch.cat([entropy.new_zeros(entropy.shape[0], 1), entropy], dim=1)
        diff = (logp.detach() - batch.rollout_logprobs).abs()[mask]
        stats = {"entropy": float(entropy[mask].mean()) if mask.any() else 0.0,
                 "logp_diff_mean": float(diff.mean()) if diff.numel() else 0.0,
                 "logp_diff_max": float(diff.max()) if diff.numel() else 0.0}
    return logp, stats


def _whiten(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    values = adv[mask.bool()]
    if values.numel() < 2:
        return adv
    return torch.where(mask.bool(), (adv - values.mean()) / (values.std() + 1e-8), torch.zeros_like(adv))


def _step(optimizer, params, clip: float) -> float:
    norm = torch.nn.utils.clip_grad_norm_(params, clip or float("inf"))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(norm)


def group_index(batch: RLBatch) -> torch.Tensor:
    """[B] integer id of each trajectory's group (same prompt and epoch)."""
    keys: dict[tuple, int] = {}
    return torch.tensor([keys.setdefault((t.prompt_id, t.metadata.get("epoch", 0)), len(keys))
                         for t in batch.trajectories])


class Updater:
    """Holds the models and optimisers of one run and performs learner steps."""

    def __init__(self, config: RLConfig, policy, critic=None):
        self.config = config
        self.policy = policy
        self.critic = critic
        self.policy_opt = torch.optim.AdamW(policy.parameters(), lr=config.policy_lr, weight_decay=0.0)
        self.critic_opt = (torch.optim.AdamW([p for p in critic.parameters() if p.requires_grad],
                                             lr=config.critic_lr, weight_decay=0.0) if critic is not None else None)
        self.baseline = RunningMeanBaseline(window=config.baseline_window)

    def step(self, batch: RLBatch, step_index: int) -> tuple[dict[str, float], bool]:
        """One learner step; returns (metrics, whether the policy changed)."""
        method = self.config.method
        mask = batch.action_mask
        metrics: dict[str, float] = {"reward_mean": float(batch.rewards.mean()),
                                     "action_tokens": float(mask.sum())}
        if method == "sao":
            advantages = self._critic_phase(batch, metrics)
            if step_index < self.config.critic_warmup_steps:
                metrics["critic_warmup"] = 1.0
                return metrics, False
        elif method == "running_mean":
            scalar = torch.tensor([self.baseline.advantage(t.prompt_id, t.reward) for t in batch.trajectories])
            advantages = scalar.unsqueeze(1) * mask
        else:
            scalar = group_advantages(batch.rewards, group_index(batch))
            advantages = scalar.unsqueeze(1).to(torch.float32) * mask
        if self.config.whiten_advantages:
            advantages = _whiten(advantages, mask)
        self.policy.train()
        logp, stats = _policy_forward(self.policy, batch)
        metrics.update(stats)
        if method in ("sao", "grpo_dis", "running_mean"):
            loss, m = dis_policy_loss(logp, batch.rollout_logprobs, advantages, mask, self.config.eps_low,
                                      self.config.eps_high)
        elif method == "grpo_async":
            loss, m = ppo_clip_loss(logp, batch.rollout_logprobs, advantages, mask, self.config.clip_low,
                                    self.config.clip_high)
        else:  # grpo: π_old recomputed by the learner; one update per batch, so it is the current policy
            loss, m = ppo_clip_loss(logp, logp.detach(), advantages, mask, self.config.clip_low,
                                    self.config.clip_high)
        loss.backward()
        metrics["policy_grad_norm"] = _step(self.policy_opt, self.policy.parameters(), self.config.grad_clip)
        metrics["policy_loss"] = float(loss.detach())
        metrics.update({f"policy_{k}": v for k, v in m.items() if k != "loss"})
        metrics["advantage_mean"] = float(advantages[mask.bool()].mean()) if mask.any() else 0.0
        return metrics, True

    def _critic_phase(self, batch: RLBatch, metrics: dict[str, float]) -> torch.Tensor:
        cfg = self.config
        mask = batch.action_mask
        self.critic.eval()
        with torch.no_grad():
            old_values = self.critic(batch.input_ids, batch.attention_mask)
        lam = adaptive_lambda(mask.sum(dim=1), cfg.lambda_alpha)
        advantages, _ = skip_observation_gae(batch.rewards, old_values, mask, cfg.gamma, lam)
        _, returns = skip_observation_gae(batch.rewards, old_values, mask, cfg.gamma, 1.0)
        self.critic.train()
        for k in range(cfg.critic_updates):
            values = self.critic(batch.input_ids, batch.attention_mask)
            loss, m = value_loss(values, old_values, returns, mask, cfg.value_clip)
            loss.backward()
            norm = _step(self.critic_opt, [p for p in self.critic.parameters() if p.requires_grad], cfg.grad_clip)
            if k == 0:
                metrics["explained_variance"] = m["explained_variance"]
            metrics["critic_loss"] = m["value_loss"]
            metrics["critic_grad_norm"] = norm
        metrics["lambda_mean"] = float(lam.mean())
        return advantages

    # ------------------------------------------------------------------ state for checkpoints
    def state_dict(self) -> dict:
        state = {"policy": self.policy.state_dict(), "policy_opt": self.policy_opt.state_dict(),
                 "baseline": self.baseline.state_dict()}
        if self.critic is not None:
            state.update(critic=self.critic.state_dict(), critic_opt=self.critic_opt.state_dict())
        return state

    def load_state_dict(self, state: dict) -> None:
        self.policy.load_state_dict(state["policy"])
        self.policy_opt.load_state_dict(state["policy_opt"])
        self.baseline.load_state_dict(state["baseline"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
