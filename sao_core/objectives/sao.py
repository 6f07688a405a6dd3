"""SAO policy loss: direct double-sided importance sampling (DIS), DESIGN.md §3.

    r_t    = exp(logp_t − rollout_logp_t)
    keep_t = action_mask_t and (1 − eps_low < r_t < 1 + eps_high)      (strict, independent of sign(A))
    loss   = − Σ_t stopgrad(r_t · keep_t) · A_t · logp_t / Σ_t action_mask_t   (over the whole batch)

There is no π_old and no recompute: the ratio is taken against the log-probs the rollout engine recorded
when it sampled each token. Masked tokens stay in the denominator, so masking lowers the step size
instead of re-weighting the surviving tokens.
"""

from __future__ import annotations

import torch

from sao_core.objectives.common import check_four_inputs


def dis_policy_loss(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    action_mask: torch.Tensor,
    eps_low: float = 0.3,
    eps_high: float = 5.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DIS policy loss.

    Args:
        logprobs: [B, T] log πθ(token_t | prefix) with gradient (see `token_logprobs`).
        rollout_logprobs: [B, T] the engine's log-prob of each sampled token (0 where not an action).
        advantages: [B, T] per-token advantages (0 outside action tokens); treated as constants.
        action_mask: [B, T] 1 where the model produced the token.
        eps_low, eps_high: the band is (1 − eps_low, 1 + eps_high), open at both ends.

    Returns:
        (scalar loss, metrics). The gradient equals − Σ keep·r·A·∇logp / (number of action tokens).
        Metrics (fractions of all action tokens): ``kept``, ``masked_low``, ``masked_high``, the same
        three split by advantage sign (``*_pos``: A > 0, ``*_neg``: A < 0), ``ratio_mean`` over action
        tokens and ``action_tokens``.
    """
    check_four_inputs("dis_policy_loss", (logprobs, rollout_logprobs, advantages, action_mask), "[B, T]")
    if not (0.0 <= eps_low <= 1.0 and eps_high >= 0.0):
        raise ValueError(f"need 0 <= eps_low <= 1 and eps_high >= 0, got eps_low={eps_low}, eps_high={eps_high}")
    mask = action_mask.bool()
    with torch.no_grad():
        # Outside action tokens the difference is forced to 0 so that exp() cannot overflow on padding.
        log_ratio = torch.where(mask, logprobs.detach().float() - rollout_logprobs.float(), 0.0)
        ratio = torch.exp(log_ratio)
        low = mask & (ratio <= 1.0 - eps_low)
        high = mask & (ratio >= 1.0 + eps_high)
        keep = mask & ~low & ~high
        weight = ratio * keep
        n_action = mask.sum().clamp(min=1).float()
    loss = -(weight * advantages.detach().float() * logprobs.float()).sum() / n_action

    with torch.no_grad():
        adv = advantages.float()
        pos, neg = mask & (adv > 0), mask & (adv < 0)

        def share(selected: torch.Tensor) -> float:
            return float(selected.sum() / n_action)

        metrics = {
            "kept": share(keep), "masked_low": share(low), "masked_high": share(high),
            "kept_pos": share(keep & pos), "masked_low_pos": share(low & pos), "masked_high_pos": share(high & pos),
            "kept_neg": share(keep & neg), "masked_low_neg": share(low & neg), "masked_high_neg": share(high & neg),
            "ratio_mean": float((ratio * mask).sum() / n_action),
            "action_tokens": float(mask.sum()),
        }
    return loss, metrics


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor,
               clip: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """Critic loss: mean squared error on action tokens, optionally clipped around the old values.

    Args:
        values: [B, T] current critic values (with gradient).
        old_values: [B, T] values before this round of critic updates (constants).
        returns: [B, T] targets (λ = 1 returns; with γ = 1 every target is the trajectory's reward).
        action_mask: [B, T] 1 on action tokens; the loss is the mean over them.
        clip: 0 disables; otherwise the loss per token is max((v − R)², (v_clip − R)²) with
            v_clip = old + clamp(v − old, −clip, clip).

    Returns:
        (scalar loss, metrics with ``value_loss``, ``explained_variance``, ``value_mean``).
    """
    mask = action_mask.bool()
    n = mask.sum().clamp(min=1).float()
    err = (values.float() - returns.float()) ** 2
    if clip > 0:
        clipped = old_values.float() + torch.clamp(values.float() - old_values.float(), -clip, clip)
        err = torch.maximum(err, (clipped - returns.float()) ** 2)
    loss = (err * mask).sum() / n
    with torch.no_grad():
        metrics = {"value_loss": float(loss.detach()), "explained_variance": explained_variance(values, returns, mask),
                   "value_mean": float(values.float()[mask].mean()) if mask.any() else 0.0}
    return loss, metrics


def explained_variance(values: torch.Tensor, returns: torch.Tensor, action_mask: torch.Tensor) -> float:
    """1 − Var(returns − values) / Var(returns) over the action tokens (population variances); 0 when the
    returns have no variance. `values`, `returns`, `action_mask`: [B, T]. Not a mean over tokens, so it
    cannot be combined from parts of a batch: compute it on the whole batch."""
    with torch.no_grad():
        mask = action_mask.bool()
        target = returns.float()[mask]
        residual = target - values.float()[mask]
        variance = target.var(unbiased=False) if target.numel() > 1 else torch.tensor(0.0)
        return float(1.0 - residual.var(unbiased=False) / variance) if float(variance) > 1e-12 else 0.0
