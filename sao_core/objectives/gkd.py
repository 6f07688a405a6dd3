"""Generalized Knowledge Distillation loss: the generalized Jensen–Shannon divergence JSD(β).

With T = softmax(teacher_logits / τ), S = softmax(student_logits / τ) at each position:

    β = 0      : KL(T ‖ S)                                  (forward KL, mode covering)
    β = 1      : KL(S ‖ T)                                  (reverse KL, mode seeking)
    0 < β < 1  : β · KL(T ‖ M) + (1 − β) · KL(S ‖ M),  M = β · T + (1 − β) · S

The two endpoints are special cases, not the limit of the mixed formula (which tends to 0 as β → 0 or 1).
No τ² factor is applied.

Position alignment: both logits tensors are [B, T, V] exactly as the models output them, so the logits at
position t are the next-token distribution for token t + 1. The caller's mask selects the positions whose
distributions are compared (e.g. every position whose next token is a response token).
"""

from __future__ import annotations

import math

import torch

_LOG_FLOOR = torch.finfo(torch.float32).min  # replaces log 0 = −inf so that 0 · (log p − log q) stays 0


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(P ‖ Q) summed over the last dimension, from log-probabilities."""
    return (log_p.exp() * (log_p - log_q)).sum(dim=-1)


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Generalized JSD between student and teacher next-token distributions.

    Args:
        student_logits: [B, T, V] student outputs (with gradient).
        teacher_logits: [B, T, V] teacher outputs for the same tokens; a constant (no gradient flows to it).
        mask: [B, T] 1 on the positions to compare (see the module docstring for the alignment).
        beta: in [0, 1]; 0 gives forward KL, 1 reverse KL, otherwise the mixture form above.
        temperature: τ > 0; both distributions are softmax(logits / τ).

    Returns:
        (scalar loss, metrics): the per-position divergence summed over the vocabulary, then averaged over
        masked positions (Σ / Σ mask; 0 when the mask is empty). Unmasked positions are ignored even when
        their logits are not finite. Metrics: ``loss`` and ``tokens``.
    """
    if student_logits.dim() != 3 or student_logits.shape != teacher_logits.shape:
        raise ValueError(f"expected student and teacher logits of one shape [B, T, V], got "
                         f"{tuple(student_logits.shape)} and {tuple(teacher_logits.shape)}")
    if mask.shape != student_logits.shape[:2]:
        raise ValueError(f"mask {tuple(mask.shape)} does not match logits {tuple(student_logits.shape)}")
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if not temperature > 0.0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    selected = mask.bool()
    keep = selected.unsqueeze(-1)
    # Unmasked positions get zero logits first, so that non-finite padding cannot reach loss or gradient.
    student = torch.where(keep, student_logits.float(), 0.0) / temperature
    teacher = torch.where(keep, teacher_logits.detach().float(), 0.0) / temperature
    log_s = torch.log_softmax(student, dim=-1).clamp(min=_LOG_FLOOR)
    log_t = torch.log_softmax(teacher, dim=-1).clamp(min=_LOG_FLOOR)
    if beta == 0.0:
        divergence = _kl(log_t, log_s)
    elif beta == 1.0:
        divergence = _kl(log_s, log_t)
    else:
        log_m = torch.logsumexp(torch.stack([log_t + math.log(beta), log_s + math.log(1.0 - beta)]), dim=0)
        divergence = beta * _kl(log_t, log_m) + (1.0 - beta) * _kl(log_s, log_m)

    n_tokens = selected.sum().clamp(min=1).float()
    loss = torch.where(selected, divergence, 0.0).sum() / n_tokens
    return loss, {"loss": float(loss.detach()), "tokens": float(selected.sum())}
