"""Direct Preference Optimization (sigmoid loss) on sequence log-probabilities.

    reward_c = β · (log πθ(chosen) − log π_ref(chosen)),   reward_r likewise for the rejected answer
    loss     = mean over pairs of − log σ(reward_c − reward_r)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sao_core.objectives.common import check_four_inputs


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sum of per-token log-probs over masked positions.

    Args:
        logprobs: [B, T] log p(token | prefix) (see `token_logprobs`).
        mask: [B, T] 1 on the tokens of the answer being scored.

    Returns:
        [B] float32 (gradient flows to `logprobs`). Positions outside the mask are ignored even when they
        hold inf or NaN.
    """
    if logprobs.dim() != 2 or logprobs.shape != mask.shape:
        raise ValueError(f"expected logprobs [B, T] and mask [B, T], got {tuple(logprobs.shape)} and "
                         f"{tuple(mask.shape)}")
    return torch.where(mask.bool(), logprobs.float(), 0.0).sum(dim=1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO sigmoid loss, averaged over the batch.

    Args:
        policy_chosen, policy_rejected: [B] sequence log-probs under the policy (with gradient).
        ref_chosen, ref_rejected: [B] sequence log-probs under the frozen reference (treated as constants).
        beta: inverse temperature β > 0.

    Returns:
        (scalar loss, metrics). Computed with logsigmoid, so very large margins neither overflow nor give
        log(0). Metrics: ``loss``, ``reward_accuracy`` (share of pairs with reward_c > reward_r, strictly),
        ``reward_margin`` (mean reward_c − reward_r), ``chosen_reward`` and ``rejected_reward`` (means).
    """
    check_four_inputs("dpo_loss", (policy_chosen, policy_rejected, ref_chosen, ref_rejected), "[B]")
    if not beta > 0.0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_reward = beta * (policy_chosen.float() - ref_chosen.detach().float())
    rejected_reward = beta * (policy_rejected.float() - ref_rejected.detach().float())
    margin = chosen_reward - rejected_reward
    loss = -F.logsigmoid(margin).mean()
    with torch.no_grad():
        metrics = {
            "loss": float(loss.detach()),
            "reward_accuracy": float((margin > 0).float().mean()),
            "reward_margin": float(margin.mean()),
            "chosen_reward": float(chosen_reward.mean()),
            "rejected_reward": float(rejected_reward.mean()),
        }
    return loss, metrics
