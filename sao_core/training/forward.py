"""Model forwards that never build full-vocabulary logits: every method's log-probs come from here.

A Hugging Face causal LM computes ``logits = lm_head(hidden_states)`` inside its forward and returns them
untouched. For the duration of one call, `_head_as` replaces the head module's ``forward`` with a function of
the hidden states ([B, T, H]) — the chunked log-prob / entropy / divergence maths of
`sao_core.objectives.chunked` — so the output layer's weight is used inside the model's own forward. That
keeps FSDP2 (which unshards the root module's parameters, the head among them, only around the root's
forward and backward), activation checkpointing and autocast working unchanged, and the returned
``.logits`` is that function's result instead of [B, T, V].
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from sao_core.objectives.chunked import chunked_generalized_jsd, chunked_logprobs


def _compute_dtype(device: torch.device, weight: torch.Tensor) -> torch.dtype:
    """bf16 (or fp16) inside an autocast region of the device, else the weight's dtype."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return weight.dtype


@contextlib.contextmanager
def _head_as(model, fn: Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]) -> Iterator[None]:
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) with a weight")
    if getattr(model.config, "final_logit_softcapping", None):
        raise ValueError(f"{type(model).__name__} soft-caps its logits (final_logit_softcapping); the chunked "
                         "log-prob path does not implement soft-capping")
    head.forward = lambda hidden: fn(hidden, head)
    try:
        yield
    finally:
        del head.forward


def model_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                   positions: torch.Tensor | None = None, with_entropy: bool = False,
                   chunk_elements: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (with gradient) and, optionally, entropies (without) of a causal LM.

    Args:
        model: a Hugging Face causal LM (plain or FSDP2-sharded).
        input_ids, attention_mask: [B, T].
        positions: [B, T] 1 where the log-prob of token t is needed (e.g. action or loss tokens); None: all.
            Only those positions go through the output layer.
        with_entropy: also return the entropy of the next-token distribution that produced token t.

    Returns:
        (logp [B, T] float32, entropy [B, T] float32 or None). Position t holds log p(input_ids[:, t] |
        input_ids[:, :t]) — the alignment of `objectives.common.token_logprobs` and of the rollout engines;
        position 0 and unselected positions hold 0.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"expected input_ids [B, T], got {tuple(input_ids.shape)}")
    rows, width = input_ids.shape
    targets = input_ids[:, 1:]
    selected = (torch.ones_like(targets, dtype=torch.bool) if positions is None
                else positions[:, 1:].to(device=input_ids.device, dtype=torch.bool))

    def head_fn(hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        picked = hidden[:, :-1][selected]
        dtype = _compute_dtype(picked.device, head.weight)
        with torch.autocast(picked.device.type, enabled=False):
            logp, entropy = chunked_logprobs(picked, head.weight, getattr(head, "bias", None), targets[selected],
                                             compute_dtype=dtype, with_entropy=with_entropy,
                                             chunk_elements=chunk_elements)
        full = torch.zeros(rows, width - 1, dtype=torch.float32, device=picked.device).masked_scatter(selected, logp)
        channels = [full]
        if with_entropy:
            channels.append(torch.zeros_like(full).masked_scatter(selected, entropy))
        stacked = torch.stack(channels, dim=-1)
        return torch.cat([stacked.new_zeros(rows, 1, stacked.shape[-1]), stacked], dim=1)

    with _head_as(model, head_fn):
        out = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    if out.shape[:2] != (rows, width):
        raise ValueError(f"{type(model).__name__} does not return its lm_head output as logits unchanged "
                         f"(got {tuple(out.shape)}); the chunked log-prob path needs a standard causal LM head")
    return out[..., 0], (out[..., 1] if with_entropy else None)


def model_hidden_states(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """[B, T, H] final hidden states of a causal LM (the LM head's input), without computing logits."""
    with _head_as(model, lambda hidden, head: hidden):
        return model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits


def model_distillation_divergence(student, teacher, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                  positions: torch.Tensor, beta: float, temperature: float,
                                  chunk_elements: int | None = None) -> tuple[torch.Tensor, int]:
    """Σ of the generalised JSD(β) between student and teacher at `positions` ([B, T] 1 where the logits at
    position t — the distribution of token t + 1 — are compared), and the number of such positions.

    The teacher runs without gradient; both output layers are applied chunk by chunk.
    """
    selected = positions.to(device=input_ids.device, dtype=torch.bool)
    teacher_head = teacher.get_output_embeddings()
    for role, model in (("student", student), ("teacher", teacher)):
        if getattr(model.get_output_embeddings(), "bias", None) is not None:
            raise ValueError(f"the GKD {role} {type(model).__name__} has a bias in its output layer; the chunked "
                             "distillation path supports bias-free LM heads only")
    with torch.no_grad():
        teacher_hidden = model_hidden_states(teacher, input_ids, attention_mask)[selected]

    def head_fn(hidden: torch.Tensor, head: torch.nn.Module) -> torch.Tensor:
        picked = hidden[selected]
        dtype = _compute_dtype(picked.device, head.weight)
        with torch.autocast(picked.device.type, enabled=False):
            total = chunked_generalized_jsd(picked, head.weight, teacher_hidden, teacher_head.weight, beta,
                                            temperature, compute_dtype=dtype, chunk_elements=chunk_elements)
        return total.reshape(1, 1, 1).expand(input_ids.shape[0], input_ids.shape[1], 1)

    with _head_as(student, head_fn):
        out = student(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return out[0, 0, 0], int(selected.sum())
