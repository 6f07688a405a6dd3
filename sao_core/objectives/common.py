"""Tensor helpers shared by every objective."""

from __future__ import annotations

import torch


def token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each token given its prefix.

    Args:
        logits: [B, T, V] model outputs for `input_ids` (float).
        input_ids: [B, T] token ids.

    Returns:
        [B, T] float32: position t holds log p(input_ids[:, t] | input_ids[:, :t]); position 0 has no
        prefix and holds 0. This is the alignment of the rollout engine's per-token log-probs.
    """
    if logits.dim() != 3 or input_ids.dim() != 2 or logits.shape[:2] != input_ids.shape:
        raise ValueError(f"expected logits [B, T, V] and input_ids [B, T], got {tuple(logits.shape)} and "
                         f"{tuple(input_ids.shape)}")
    shifted = logits[:, :-1].float()
    targets = input_ids[:, 1:].unsqueeze(-1)
    # gather − logsumexp avoids materialising a [B, T, V] log_softmax.
    picked = shifted.gather(-1, targets).squeeze(-1) - torch.logsumexp(shifted, dim=-1)
    return torch.cat([picked.new_zeros(picked.shape[0], 1), picked], dim=1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is 1 (0 when the mask is empty). Shapes equal."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def check_four_inputs(function: str, tensors: tuple[torch.Tensor, ...], dims: str) -> None:
    """ValueError naming `function` unless its four input `tensors` share one shape with the dimensions `dims`
    (``"[B, T]"`` or ``"[B]"``)."""
    if len({t.shape for t in tensors}) != 1 or tensors[0].dim() != len(dims.split(",")):
        raise ValueError(f"{function} expects four {dims} tensors of one shape, got {[tuple(t.shape) for t in tensors]}")
