"""Trajectories to padded tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sao_core.rollout.trajectory import Trajectory


@dataclass
class RLBatch:
    """A learner batch; every tensor is [B, T] (right-padded) except `rewards` [B]."""

    trajectories: list[Trajectory]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    rollout_logprobs: torch.Tensor
    versions: torch.Tensor
    rewards: torch.Tensor

    def to(self, device: torch.device) -> RLBatch:
        moved = {k: getattr(self, k).to(device) for k in ("input_ids", "attention_mask", "action_mask",
                                                          "rollout_logprobs", "versions", "rewards")}
        return RLBatch(self.trajectories, **moved)

    def rows(self, start: int, stop: int) -> RLBatch:
        """Trajectories [start, stop) of the batch (same padded width T)."""
        sliced = {k: getattr(self, k)[start:stop] for k in ("input_ids", "attention_mask", "action_mask",
                                                             "rollout_logprobs", "versions", "rewards")}
        return RLBatch(self.trajectories[start:stop], **sliced)

    def select(self, indices: list[int]) -> RLBatch:
        """Rows `indices` (in that order), trimmed to the width of the longest selected row: [b, w] with w ≤ T
        (at least 1). Rows are right-padded, so the trimmed columns are padding in every selected row."""
        index = torch.tensor(indices, dtype=torch.long, device=self.input_ids.device)
        used = self.attention_mask[index].bool().any(dim=0).nonzero()
        width = int(used[-1]) + 1 if used.numel() else 1
        picked = {k: getattr(self, k)[index, :width] for k in ("input_ids", "attention_mask", "action_mask",
                                                                "rollout_logprobs", "versions")}
        return RLBatch([self.trajectories[i] for i in indices], rewards=self.rewards[index], **picked)


def micro_batch_rows(lengths: list[int], budget: int) -> list[list[int]]:
    """Split rows into micro-batches of at most `budget` padded positions each.

    Rows are sorted by length, longest first (stable), and consecutive rows are grouped greedily while
    rows × the group's longest length ≤ `budget` and the row is at least half as long as the group's longest
    (so padding is at most half of any micro-batch, whatever the budget); a group always holds at least one
    row, so a row longer than the budget forms a micro-batch of its own. `budget` ≤ 0: one group of every
    row in order.

    Args:
        lengths: [B] real length of each row in tokens (e.g. its attention-mask sum).
        budget: maximum rows × width per micro-batch, in tokens.

    Returns:
        Lists of row indices; every row appears in exactly one list.
    """
    if budget <= 0:
        return [list(range(len(lengths)))] if lengths else []
    groups: list[list[int]] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        # Longest first: the group's width is the length of its first row.
        width = max(lengths[groups[-1][0]], 1) if groups else 0
        if groups and (len(groups[-1]) + 1) * width <= budget and 2 * lengths[row] >= width:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def collate(trajectories: list[Trajectory], pad_id: int) -> RLBatch:
    """Right-pad `trajectories` into one batch.

    A fragment (`Trajectory.is_fragment`) gets one extra real position: a pad token with attention 1 after its
    last token. The critic's value at position n is computed from the hidden state at n − 1 (`ValueModel`), so
    the value there is V(the fragment's whole prefix): the bootstrap value at the cut, whatever token sits at n.
    The extra token is never an action."""
    width = max(len(t.token_ids) + t.is_fragment for t in trajectories)
    n = len(trajectories)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    action = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for row, t in enumerate(trajectories):
        k = len(t.token_ids)
        ids[row, :k] = torch.tensor(t.token_ids)
        attention[row, :k + t.is_fragment] = 1
        action[row, :k] = torch.tensor(t.action_mask)
        logprobs[row, :k] = torch.tensor(t.rollout_logprobs)
        versions[row, :k] = torch.tensor(t.versions)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return RLBatch(trajectories, ids, attention, action, logprobs, versions, rewards)
