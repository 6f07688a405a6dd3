"""Supervised fine-tuning loss: negative log-likelihood of the assistant tokens."""

from __future__ import annotations

import torch

from sao_core.objectives.common import masked_mean


def sft_loss(logprobs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-mean NLL over the batch.

    Args:
        logprobs: [B, T] log p(token | prefix) (see `token_logprobs`).
        loss_mask: [B, T] 1 on tokens to learn (assistant tokens), 0 elsewhere.

    Returns:
        (scalar loss, metrics) with metrics ``{"loss", "tokens"}``.
    """
    if logprobs.shape != loss_mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and loss_mask {tuple(loss_mask.shape)} differ")
    loss = -masked_mean(logprobs, loss_mask)
    return loss, {"loss": float(loss.detach()), "tokens": float(loss_mask.sum())}
