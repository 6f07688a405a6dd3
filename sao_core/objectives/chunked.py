"""Memory-bounded output-layer maths: per-token log-probs, entropy and distillation divergences computed from
hidden states and the LM head's weight in chunks of positions, never as a full [N, V] tensor.

With a vocabulary of V = 151,936 and 16,384 positions, one float32 logits tensor is ~10 GB; these functions
hold one chunk of `chunk_rows(V)` positions at a time (about `LOGIT_CHUNK_ELEMENTS` floats), in the forward
and in the backward pass, so peak memory grows with positions × hidden size. The results equal the unchunked
computation (`common.token_logprobs` on full logits) up to float32 summation order (< 1e-5 in tests).

Precision: the head's matmul runs in `compute_dtype` (bf16 under a bf16 autocast, else the weight's dtype);
the logits are cast to float32 before the log-sum-exp, so log-probs, ratios and entropies are float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sao_core.objectives.gkd import generalized_jsd_loss

# Floats of one chunk of logits ([rows, V]); 2**25 is 128 MiB in float32 (~220 positions at V = 151,936).
LOGIT_CHUNK_ELEMENTS = 2 ** 25
GKD_CHUNK_DIVISOR = 8


def chunk_rows(vocab_size: int, chunk_elements: int | None = None) -> int:
    """Positions per chunk so that one chunk of logits holds at most `chunk_elements` floats (None:
    `LOGIT_CHUNK_ELEMENTS`), at least 1."""
    return max(1, (chunk_elements or LOGIT_CHUNK_ELEMENTS) // max(1, vocab_size))


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """[n, V] float32 logits of one chunk; the matmul runs in the dtype of its (already cast) operands."""
    return F.linear(hidden, weight, bias).float()


class _ChunkedLogprobs(torch.autograd.Function):
    """log p(target | hidden) for each row, and the entropy of each row's distribution (no gradient).

    The backward recomputes each chunk's logits: d logp / d logits = onehot(target) − softmax(logits).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, rows, compute_dtype, with_entropy):
        # hidden [N, H], weight [V, H], bias [V] or None, targets [N] (int64).
        n = hidden.shape[0]
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for s in range(0, n, rows):
                logits = _logits(hidden[s:s + rows].to(compute_dtype), w, b)
                chunk_lse = torch.logsumexp(logits, dim=-1)
                lse[s:s + rows] = chunk_lse
                logp[s:s + rows] = logits.gather(1, targets[s:s + rows, None]).squeeze(1) - chunk_lse
                if with_entropy:
                    # H = lse − Σ p · logits
                    probs = torch.exp(logits - chunk_lse[:, None])
                    entropy[s:s + rows] = chunk_lse - (probs * logits).sum(dim=-1)
                del logits
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.rows, ctx.compute_dtype = rows, compute_dtype
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        rows, compute_dtype = ctx.rows, ctx.compute_dtype
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        w = weight.to(compute_dtype)
        b = bias.to(compute_dtype) if bias is not None else None
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if need_b else None
        for s in range(0, hidden.shape[0], rows):
            h = hidden[s:s + rows].to(compute_dtype)
            g = grad_logp[s:s + rows].float()
            grad_logits = torch.exp(_logits(h, w, b) - lse[s:s + rows, None]).mul_(-g[:, None])
            grad_logits.scatter_add_(1, targets[s:s + rows, None], g[:, None])
            if need_h:
                grad_h[s:s + rows] = (grad_logits.to(compute_dtype) @ w).to(hidden.dtype)
            if need_w:
                grad_w.addmm_(grad_logits.t(), h.float())
            if need_b:
                grad_b += grad_logits.sum(dim=0)
            del grad_logits
        return (grad_h, grad_w.to(weight.dtype) if need_w else None, grad_b.to(bias.dtype) if need_b else None,
                None, None, None, None)


def chunked_logprobs(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                     compute_dtype: torch.dtype | None = None, with_entropy: bool = False,
                     chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under softmax(hidden @ weightᵀ + bias), in chunks of positions.

    Args:
        hidden: [N, H] hidden states (the positions whose next token is scored).
        weight: [V, H] output-layer weight; bias: [V] or None.
        targets: [N] token ids.
        compute_dtype: dtype of the matmul (None: the weight's).
        with_entropy: also return each position's entropy (nats, float32, no gradient).

    Returns:
        (logp [N] float32 with gradient to hidden, weight and bias; entropy [N] or None).
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1] or weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"expected hidden [N, H], weight [V, H], targets [N]; got {tuple(hidden.shape)}, "
                         f"{tuple(weight.shape)}, {tuple(targets.shape)}")
    rows = chunk_rows(weight.shape[0], chunk_elements)
    logp, entropy = _ChunkedLogprobs.apply(hidden, weight, bias, targets.long(), rows,
                                           compute_dtype or weight.dtype, with_entropy)
    return logp, entropy if with_entropy else None


def _jsd_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, beta: float, temperature: float
             ) -> torch.Tensor:
    """Σ over the rows of one chunk ([n, V] float32 logits each) of `generalized_jsd_loss`'s divergence."""
    ones = torch.ones(1, student_logits.shape[0], device=student_logits.device)
    loss, _ = generalized_jsd_loss(student_logits[None], teacher_logits[None], ones, beta=beta, temperature=temperature)
    return loss * student_logits.shape[0]


class _ChunkedJSD(torch.autograd.Function):
    """Σ of the generalised JSD over positions; the backward recomputes one chunk at a time and differentiates
    the divergence with respect to that chunk's student logits only, so no chunk's tensors outlive it."""

    @staticmethod
    def forward(ctx, h_s, w_s, h_t, w_t, beta, temperature, rows, compute_dtype):
        ws, wt = w_s.to(compute_dtype), w_t.to(compute_dtype)
        total = torch.zeros((), dtype=torch.float32, device=h_s.device)
        with torch.no_grad():
            for s in range(0, h_s.shape[0], rows):
                total += _jsd_sum(_logits(h_s[s:s + rows].to(compute_dtype), ws, None),
                                  _logits(h_t[s:s + rows].to(compute_dtype), wt, None), beta, temperature)
        ctx.save_for_backward(h_s, w_s, h_t, w_t)
        ctx.settings = (beta, temperature, rows, compute_dtype)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        h_s, w_s, h_t, w_t = ctx.saved_tensors
        beta, temperature, rows, compute_dtype = ctx.settings
        ws, wt = w_s.to(compute_dtype), w_t.to(compute_dtype)
        grad_h = torch.empty_like(h_s) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(w_s.shape, dtype=torch.float32, device=w_s.device) if ctx.needs_input_grad[1] else None
        for s in range(0, h_s.shape[0], rows):
            h = h_s[s:s + rows].to(compute_dtype)
            with torch.enable_grad():
                student = _logits(h, ws, None).detach().requires_grad_(True)
                teacher = _logits(h_t[s:s + rows].to(compute_dtype), wt, None)
                (grad_logits,) = torch.autograd.grad(_jsd_sum(student, teacher, beta, temperature), student)
            grad_logits = grad_logits.mul_(grad_total.float())
            if grad_h is not None:
                grad_h[s:s + rows] = (grad_logits.to(compute_dtype) @ ws).to(h_s.dtype)
            if grad_w is not None:
                grad_w.addmm_(grad_logits.t(), h.float())
            del student, teacher, grad_logits
        return (grad_h, grad_w.to(w_s.dtype) if grad_w is not None else None, None, None, None, None, None, None)


def chunked_generalized_jsd(student_hidden: torch.Tensor, student_weight: torch.Tensor,
                            teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor, beta: float,
                            temperature: float, compute_dtype: torch.dtype | None = None,
                            chunk_elements: int | None = None) -> torch.Tensor:
    """Sum over positions of the generalised JSD(β) between student and teacher next-token distributions
    (`objectives.gkd.generalized_jsd_loss`, the one definition), one chunk of positions at a time.

    Args:
        student_hidden: [N, H_s] (with gradient); student_weight: [V, H_s] (the student's LM head).
        teacher_hidden: [N, H_t] and teacher_weight [V, H_t]: constants (no gradient flows to them).

    Returns:
        Scalar float32: Σ over the N positions of the per-position divergence (divide by N for the mean).
        The backward pass recomputes each chunk's logits, so at most one chunk of [rows, V] tensors is alive.
    """
    if student_hidden.shape[0] != teacher_hidden.shape[0]:
        raise ValueError(f"student and teacher positions differ: {student_hidden.shape[0]} vs {teacher_hidden.shape[0]}")
    if student_weight.shape[0] != teacher_weight.shape[0]:
        raise ValueError(f"student and teacher vocabularies differ: {student_weight.shape[0]} vs "
                         f"{teacher_weight.shape[0]}")
    # The divergence keeps about a dozen [rows, V] float32 tensors alive per chunk (both log-softmaxes, the
    # mixture, the KL terms and their gradients): chunks of an eighth of the log-prob budget keep its peak near
    # that of `chunked_logprobs`.
    rows = chunk_rows(student_weight.shape[0], chunk_elements or LOGIT_CHUNK_ELEMENTS // GKD_CHUNK_DIVISOR)
    return _ChunkedJSD.apply(student_hidden, student_weight, teacher_hidden.detach(), teacher_weight.detach(),
                             beta, temperature, rows, compute_dtype or student_weight.dtype)
