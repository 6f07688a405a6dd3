"""GRPO baselines (DESIGN.md §3): group-normalised advantages, the PPO clipped loss, a running-mean baseline.

- `group_advantages`: (R − group mean) / (group std + eps) over the G rollouts of each prompt, with the
  unbiased sample std (as `torch.std`), or only R − group mean.
- `ppo_clip_loss`: the asymmetric PPO clip (clip_low 0.2, clip_high 0.28), token mean over the batch. The
  "old" log-probs are either recomputed π_old (sync GRPO) or the rollout engine's (async GRPO).
- `RunningMeanBaseline`: the critic-free single-rollout baseline, R − mean of the last rewards of the prompt.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch

from sao_core.objectives.common import check_four_inputs


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    scale: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantage of each rollout relative to the other rollouts of its group.

    Args:
        rewards: [N] scalar rewards.
        group_ids: [N] integer group of each reward (any values, any order; e.g. a prompt index).
        scale: divide by (group std + eps); otherwise only subtract the group mean.
        eps: added to the std, so a group whose rewards are all equal gets advantage 0.

    Returns:
        [N] float32, without gradient. The std is the unbiased sample std (divisor n − 1), as
        `torch.std` and the usual GRPO implementations; a group of one rollout has advantage 0.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(f"expected rewards [N] and group_ids [N], got {tuple(rewards.shape)} and "
                         f"{tuple(group_ids.shape)}")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
    with torch.no_grad():
        values = rewards.detach().to(torch.float64)  # float64 sums: exact enough for large groups
        if values.numel() == 0:
            return values.to(torch.float32)
        _, index = torch.unique(group_ids, return_inverse=True)
        n_groups = int(index.max()) + 1
        counts = torch.zeros(n_groups, dtype=torch.float64, device=values.device)
        counts.index_add_(0, index, torch.ones_like(values))
        sums = torch.zeros_like(counts).index_add_(0, index, values)
        centered = values - (sums / counts)[index]
        if not scale:
            return centered.to(torch.float32)
        squares = torch.zeros_like(counts).index_add_(0, index, centered * centered)
        std = torch.sqrt(squares / (counts - 1.0).clamp(min=1.0))
        # A group of one: centered is exactly 0 and std 0, so 0 / eps = 0.
        return (centered / (std[index] + eps)).to(torch.float32)


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate loss with a token mean over the batch.

        r_t    = exp(logp_t − old_logp_t)
        loss_t = − min(r_t · A_t, clip(r_t, 1 − clip_low, 1 + clip_high) · A_t)
        loss   = Σ_t action_mask_t · loss_t / Σ_t action_mask_t        (over the whole batch)

    Args:
        logprobs: [B, T] log πθ(token_t | prefix) with gradient (see `token_logprobs`).
        old_logprobs: [B, T] log-probs of the behaviour policy (recomputed π_old, or the rollout engine's).
        advantages: [B, T] per-token advantages; treated as constants.
        action_mask: [B, T] 1 on action tokens.
        clip_low, clip_high: the clip range is [1 − clip_low, 1 + clip_high].

    Returns:
        (scalar loss, metrics). Outside action tokens the log-ratio is forced to 0 before exp(), so padding
        with any finite or infinite log-prob gives neither NaN nor inf. Metrics (fractions of all action
        tokens): ``clip_frac_low`` (A < 0 and r < 1 − clip_low: the clipped term is taken, no gradient),
        ``clip_frac_high`` (A > 0 and r > 1 + clip_high), ``clip_frac`` (their sum), ``ratio_mean`` over
        action tokens, ``action_tokens`` and ``loss``.
    """
    check_four_inputs("ppo_clip_loss", (logprobs, old_logprobs, advantages, action_mask), "[B, T]")
    if not (0.0 <= clip_low <= 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    mask = action_mask.bool()
    log_ratio = torch.where(mask, logprobs.float() - old_logprobs.detach().float(), 0.0)
    ratio = torch.exp(log_ratio)
    adv = torch.where(mask, advantages.detach().float(), 0.0)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = torch.where(mask, -torch.minimum(unclipped, clipped), 0.0)
    n_action = mask.sum().clamp(min=1).float()
    loss = per_token.sum() / n_action

    with torch.no_grad():
        low = mask & (adv < 0) & (ratio < 1.0 - clip_low)
        high = mask & (adv > 0) & (ratio > 1.0 + clip_high)
        metrics = {
            "clip_frac_low": float(low.sum() / n_action),
            "clip_frac_high": float(high.sum() / n_action),
            "clip_frac": float((low | high).sum() / n_action),
            "ratio_mean": float((ratio * mask).sum() / n_action),
            "action_tokens": float(mask.sum()),
            "loss": float(loss.detach()),
        }
    return loss, metrics


class RunningMeanBaseline:
    """Per-prompt running-mean baseline for critic-free single-rollout training.

    `advantage(prompt_id, reward)` returns reward − baseline, then records the reward. The baseline is the
    mean of the last `window` rewards seen for that prompt; for a prompt without history it is the mean of
    the last `global_window` rewards over all prompts, and 0.0 before any reward has been seen.
    Histories for every prompt seen are kept (at most `window` floats each).
    """

    def __init__(self, window: int = 8, global_window: int = 64) -> None:
        if window < 1 or global_window < 1:
            raise ValueError(f"window and global_window must be >= 1, got {window} and {global_window}")
        self.window = int(window)
        self.global_window = int(global_window)
        self._per_prompt: dict[str, deque[float]] = {}
        self._global: deque[float] = deque(maxlen=self.global_window)

    def baseline(self, prompt_id: str) -> float:
        """The current baseline for `prompt_id` (records nothing)."""
        history = self._per_prompt.get(prompt_id)
        if history:
            return sum(history) / len(history)
        if self._global:
            return sum(self._global) / len(self._global)
        return 0.0

    def advantage(self, prompt_id: str, reward: float) -> float:
        """reward − baseline(prompt_id); then `reward` joins the prompt's and the global history."""
        reward = float(reward)
        value = reward - self.baseline(prompt_id)
        self._per_prompt.setdefault(prompt_id, deque(maxlen=self.window)).append(reward)
        self._global.append(reward)
        return value

    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state: windows and histories (oldest first)."""
        return {
            "window": self.window,
            "global_window": self.global_window,
            "per_prompt": {key: list(history) for key, history in self._per_prompt.items()},
            "global": list(self._global),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore histories from `state_dict()`. This instance keeps its own windows: a history longer than
        the window keeps only its most recent rewards."""
        try:
            per_prompt = {str(key): [float(r) for r in rewards] for key, rewards in state["per_prompt"].items()}
            global_rewards = [float(r) for r in state["global"]]
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"not a RunningMeanBaseline state: {err!r}") from err
        self._per_prompt = {key: deque(rewards, maxlen=self.window) for key, rewards in per_prompt.items()}
        self._global = deque(global_rewards, maxlen=self.global_window)
