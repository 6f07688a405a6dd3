"""The memory-bounded output layer (`objectives.chunked`, `training.forward`) equals the unchunked computation,
and the training core's precision and schedule reach every method (`training.core`)."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sao_core.objectives.chunked import chunk_rows, chunked_generalized_jsd, chunked_logprobs
from sao_core.objectives.common import token_logprobs
from sao_core.objectives.gkd import generalized_jsd_loss
from sao_core.training.core import autocast, autocast_dtype
from sao_core.training.forward import model_distillation_divergence, model_logprobs

VOCAB = 1000


def small_lm(seed: int = 0, tied: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=tied)
    return LlamaForCausalLM(config)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def batch(seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (3, 37), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 25:] = 0                       # a right-padded row
    positions = (torch.rand(ids.shape, generator=g) < 0.6).long() * attention
    return ids, attention, positions


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_logprobs_and_entropy_equal_the_full_logits(tied):
    model = small_lm(tied=tied)
    ids, attention, positions = batch()
    logits = model(input_ids=ids, attention_mask=attention).logits
    ref = token_logprobs(logits, ids) * positions
    full = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    ref_entropy = torch.cat([torch.zeros(3, 1), -(full.exp() * full).sum(-1)], dim=1) * positions
    weights = torch.randn(ids.shape)
    (ref * weights).sum().backward()
    ref_grads = grads(model)
    # 7 positions per chunk: many chunks, the last one partial.
    logp, entropy = model_logprobs(model, ids, attention, positions=positions, with_entropy=True,
                                   chunk_elements=7 * VOCAB)
    (logp * weights).sum().backward()
    got = grads(model)
    assert chunk_rows(VOCAB, 7 * VOCAB) == 7 and int(positions[:, 1:].sum()) > 7 * 5
    assert (logp - ref).abs().max() < 1e-5
    assert (entropy - ref_entropy).abs().max() < 1e-5
    assert float(ref.detach().abs().max()) > 1.0           # not trivially zero
    assert set(got) == set(ref_grads)
    for name, g in ref_grads.items():
        assert (got[name] - g).abs().max() < 1e-5, name
    # Unselected positions hold 0 and position 0 has no prefix.
    assert torch.all(logp[positions == 0] == 0) and torch.all(logp[:, 0] == 0)


def test_all_positions_by_default_and_bias_is_supported():
    hidden = torch.randn(11, 8, requires_grad=True)
    weight = torch.randn(50, 8, requires_grad=True)
    bias = torch.randn(50, requires_grad=True)
    targets = torch.randint(0, 50, (11,))
    logits = hidden @ weight.T + bias
    ref = torch.log_softmax(logits, -1).gather(1, targets[:, None]).squeeze(1)
    ref.sum().backward()
    ref_grads = [t.grad.clone() for t in (hidden, weight, bias)]
    for t in (hidden, weight, bias):
        t.grad = None
    logp, entropy = chunked_logprobs(hidden, weight, bias, targets, chunk_elements=3 * 50)
    assert entropy is None
    logp.sum().backward()
    assert (logp - ref).abs().max() < 1e-5
    for t, g in zip((hidden, weight, bias), ref_grads, strict=True):
        assert (t.grad - g).abs().max() < 1e-5
    model = small_lm()
    ids, attention, _ = batch()
    every, _ = model_logprobs(model, ids, attention)
    assert (every - token_logprobs(model(input_ids=ids, attention_mask=attention).logits, ids)).abs().max() < 1e-5


def test_shape_errors_are_named():
    with pytest.raises(ValueError, match=r"expected hidden \[N, H\]"):
        chunked_logprobs(torch.zeros(3, 4), torch.zeros(5, 6), None, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="vocabularies differ"):
        chunked_generalized_jsd(torch.zeros(2, 4), torch.zeros(5, 4), torch.zeros(2, 4), torch.zeros(6, 4), 0.5, 1.0)


@pytest.mark.parametrize("beta, temperature", [(0.0, 1.0), (0.5, 1.0), (1.0, 2.0), (0.3, 0.7)])
def test_chunked_distillation_equals_the_full_generalized_jsd(beta, temperature):
    student, teacher = small_lm(0), small_lm(5)
    ids, attention, positions = batch(2)
    mask = torch.zeros_like(positions)
    mask[:, :-1] = positions[:, 1:]
    s_logits = student(input_ids=ids, attention_mask=attention).logits
    with torch.no_grad():
        t_logits = teacher(input_ids=ids, attention_mask=attention).logits
    ref, _ = generalized_jsd_loss(s_logits, t_logits, mask, beta=beta, temperature=temperature)
    ref.backward()
    ref_grads = grads(student)
    total, count = model_distillation_divergence(student, teacher, ids, attention, mask, beta, temperature,
                                                 chunk_elements=5 * VOCAB)
    loss = total / count
    loss.backward()
    got = grads(student)
    assert count == int(mask.sum()) and count > 10
    assert float(ref.detach()) > 1e-3 and abs(float(loss.detach()) - float(ref.detach())) < 1e-5
    for name, g in ref_grads.items():
        assert (got[name] - g).abs().max() < 1e-5, name
    assert all(p.grad is None for p in teacher.parameters())


def test_precision_rule():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert autocast_dtype("auto", cpu) is None and autocast_dtype("float32", cpu) is None
    assert autocast_dtype("bf16", cpu) == torch.bfloat16 and autocast_dtype("float32", gpu) is None
    with pytest.raises(ValueError, match="precision must be one of auto, float32, bf16"):
        autocast_dtype("fp8", cpu)


def test_bf16_logprobs_are_float32_and_close_to_float32():
    model = small_lm()
    ids, attention, positions = batch()
    exact, _ = model_logprobs(model, ids, attention, positions=positions)
    with autocast("bf16", torch.device("cpu")):
        low, entropy = model_logprobs(model, ids, attention, positions=positions, with_entropy=True)
    assert low.dtype == torch.float32 and entropy.dtype == torch.float32
    diff = float((low - exact).abs().max())
    assert 0 < diff < 0.1                                    # bf16 ran (not bit-equal), and stayed close
    low.sum().backward()
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32
               for p in model.parameters() if p.grad is not None)


def test_distillation_refuses_a_biased_head():
    student, teacher = small_lm(0), small_lm(5)
    teacher.lm_head.bias = torch.nn.Parameter(torch.zeros(VOCAB))
    ids, attention, positions = batch()
    with pytest.raises(ValueError, match="the GKD teacher LlamaForCausalLM has a bias in its output layer"):
        model_distillation_divergence(student, teacher, ids, attention, positions, 0.5, 1.0)
