"""Pieces of the shared training core: log-prob alignment, the SFT loss, schedules, chat encoding."""

from __future__ import annotations

import math

import pytest
import torch

from sao_core.objectives.common import masked_mean, token_logprobs
from sao_core.objectives.sft import sft_loss
from sao_core.training.chat_batch import EncodedChat, encode_chat, pad_batch
from sao_core.training.schedule import lr_factor


def test_token_logprobs_alignment_by_hand():
    # Vocabulary of 2; logits at position 0 are (0, ln 3): p(token 1) = 3/4; at position 1 (ln 1, ln 1): 1/2.
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, 0.0], [5.0, 5.0]]])
    ids = torch.tensor([[0, 1, 0]])
    got = token_logprobs(logits, ids)
    assert got.shape == (1, 3)
    assert got[0, 0].item() == 0.0
    assert got[0, 1].item() == pytest.approx(math.log(0.75))
    assert got[0, 2].item() == pytest.approx(math.log(0.5))


def test_token_logprobs_shape_errors():
    with pytest.raises(ValueError, match=r"logits \[B, T, V\]"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.long))


def test_sft_loss_by_hand_and_gradient():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[0, 1, 1], [0, 0, 1]])
    loss, metrics = sft_loss(logprobs, mask)
    assert loss.item() == pytest.approx((2.0 + 3.0 + 6.0) / 3)
    assert metrics["tokens"] == 3.0
    loss.backward()
    expected = -mask.float() / 3
    assert torch.allclose(logprobs.grad, expected)
    with pytest.raises(ValueError, match="differ"):
        sft_loss(logprobs, mask[:, :2])


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0


@pytest.mark.parametrize("step, schedule, expected", [
    (0, "constant", 0.25), (3, "constant", 1.0), (50, "constant", 1.0),
    (4, "linear", 1.0), (54, "linear", 0.5), (104, "linear", 0.0),
    (4, "cosine", 1.0), (54, "cosine", 0.5), (104, "cosine", 0.0),
])
def test_lr_schedules_by_hand(step, schedule, expected):
    assert lr_factor(step, total_steps=104, warmup_steps=4, schedule=schedule) == pytest.approx(expected)


def test_unknown_schedule():
    with pytest.raises(ValueError, match="unknown schedule 'step'"):
        lr_factor(0, 10, schedule="step")


def test_encode_chat_and_pad(sao_cache):
    from sao_core.models import EMBEDDED_TINY, load_tokenizer

    tok = load_tokenizer(EMBEDDED_TINY, sao_cache)
    messages = [{"role": "user", "content": "Compute 2 + 2"}, {"role": "assistant", "content": "\\boxed{4}"}]
    enc = encode_chat(tok, messages, max_tokens=256)
    assert tok.decode([t for t, m in zip(enc.input_ids, enc.loss_mask, strict=True) if m]) == "\\boxed{4}<|im_end|>"
    with pytest.raises(ValueError, match="no assistant tokens"):
        encode_chat(tok, messages, max_tokens=5)
    batch = pad_batch([enc, EncodedChat([1, 2], [0, 1])], pad_id=tok.pad_token_id)
    assert batch["input_ids"].shape == (2, len(enc.input_ids))
    assert batch["attention_mask"][1].tolist()[:3] == [1, 1, 0]
    assert batch["loss_mask"][1].sum().item() == 1
