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


def collate(trajectories: list[Trajectory], pad_id: int) -> RLBatch:
    """Right-pad `trajectories` into one batch."""
    width = max(len(t.token_ids) for t in trajectories)
    n = len(trajectories)
    ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros((n, width), dtype=torch.long)
    action = torch.zeros((n, width), dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    versions = torch.full((n, width), -1, dtype=torch.long)
    for row, t in enumerate(trajectories):
        k = len(t.token_ids)
        ids[row, :k] = torch.tensor(t.token_ids)
        attention[row, :k] = 1
        action[row, :k] = torch.tensor(t.action_mask)
        logprobs[row, :k] = torch.tensor(t.rollout_logprobs)
        versions[row, :k] = torch.tensor(t.versions)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    return RLBatch(trajectories, ids, attention, action, logprobs, versions, rewards)
