"""Skip-observation GAE and the adaptive λ of SAO (DESIGN.md §3).

Prompt and observation tokens are removed; GAE runs over each row's action tokens in order, with the
scalar reward on the last action token and a value of 0 after it (or, for a fragment of a running episode, the
critic's value at the cut: truncated GAE); results are scattered back. Tokens that are not actions get advantage
0 and return 0.
"""

from __future__ import annotations

import torch


def adaptive_lambda(num_action_tokens: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """λ_policy = clamp(1 − 1/(alpha·l), 0, 1) for each row; `num_action_tokens` is [B] (0 gives λ = 0)."""
    length = num_action_tokens.float()
    return torch.clamp(1.0 - 1.0 / (alpha * length), 0.0, 1.0)


def skip_observation_gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    action_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
    bootstrap: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE over action tokens only.

    Args:
        rewards: [B] scalar reward of each trajectory, placed on its last action token.
        values: [B, T] V of the state before each token (position-aligned with the log-probs).
        action_mask: [B, T] 1 on action tokens.
        gamma: discount per action token.
        lam: GAE λ, a float or a [B] tensor (one λ per row, e.g. `adaptive_lambda`).
        bootstrap: [B] value of the state after each row's last action token (None: 0, the episode ended). A
            fragment of a running episode (reward 0) passes the critic's value at its cut, so its last action
            token's TD error is γ·V(cut) − V(before it), as for any truncated rollout.

    Returns:
        (advantages [B, T], returns [B, T]); both 0 outside action tokens; returns = advantages + values
        on action tokens. Computed without gradient.
    """
    if values.dim() != 2 or values.shape != action_mask.shape or rewards.shape != values.shape[:1]:
        raise ValueError(f"expected rewards [B], values [B, T], action_mask [B, T]; got {tuple(rewards.shape)}, "
                         f"{tuple(values.shape)}, {tuple(action_mask.shape)}")
    with torch.no_grad():
        batch = values.shape[0]
        mask = action_mask.bool()
        counts = mask.sum(dim=1)
        width = int(counts.max()) if batch else 0
        rows, cols = mask.nonzero(as_tuple=True)
        rank = (mask.long().cumsum(dim=1) - 1)[rows, cols]
        # Compressed [B, width + 1] values; the extra column is the bootstrap value 0 after the last action.
        compact = values.new_zeros(batch, width + 1, dtype=torch.float32)
        compact[rows, rank] = values[rows, cols].float()
        positions = torch.arange(width, device=values.device)
        valid = positions.unsqueeze(0) < counts.unsqueeze(1)
        step_rewards = values.new_zeros(batch, width, dtype=torch.float32)
        has_actions = counts > 0
        step_rewards[has_actions, counts[has_actions] - 1] = rewards[has_actions].float()
        if bootstrap is not None:
            compact[torch.arange(batch, device=values.device), counts] = bootstrap.float().to(values.device)
        next_values = compact[:, 1:] * (positions.unsqueeze(0) + 1 <= counts.unsqueeze(1))
        deltas = (step_rewards + gamma * next_values - compact[:, :width]) * valid
        decay = gamma * (lam.float().to(values.device) if torch.is_tensor(lam) else torch.full((batch,), float(lam), device=values.device))
        compact_adv = torch.zeros_like(deltas)
        running = torch.zeros(batch, device=values.device)
        for k in range(width - 1, -1, -1):
            running = deltas[:, k] + decay * running
            compact_adv[:, k] = running
        advantages = torch.zeros_like(values, dtype=torch.float32)
        returns = torch.zeros_like(values, dtype=torch.float32)
        advantages[rows, cols] = compact_adv[rows, rank]
        returns[rows, cols] = compact_adv[rows, rank] + compact[rows, rank]
    return advantages, returns
