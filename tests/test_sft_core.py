"""The first pieces of the shared training core: log-prob alignment, the SFT loss, schedules, chat
encoding and a real short SFT run that publishes a checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch

from sao_core import storage
from sao_core.objectives.common import masked_mean, token_logprobs
from sao_core.objectives.sft import sft_loss
from sao_core.training.chat_batch import EncodedChat, encode_chat, pad_batch
from sao_core.training.schedule import lr_factor
from sao_core.training.sft import SFTConfig, read_prepared_rows, run_sft


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


def _write_prepared(folder, rows):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_short_sft_run_learns_and_publishes(tmp_path, sao_cache):
    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.models import load_model

    data = _write_prepared(tmp_path / "prepared", list(tool_arith_sft_rows(200, seed=3)))
    seen = []
    summary = run_sft(SFTConfig(data=str(data), output=str(tmp_path / "run"), steps=30, batch_size=8, lr=3e-3,
                                warmup_steps=3, log_every=10, cache_dir=str(sao_cache)),
                      progress=lambda step, m: seen.append(step))
    assert seen == list(range(1, 31))
    assert summary["eval_loss_after"] < summary["eval_loss_before"] * 0.7
    assert storage.is_complete_checkpoint(summary["checkpoint"])
    manifest = storage.read_manifest(summary["checkpoint"])
    assert manifest["metadata"]["step"] == 30 and "model.safetensors" in manifest["files"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [10, 20, 30]
    assert load_model(summary["checkpoint"], sao_cache).config.model_type == "llama"


def test_sft_to_s3_output(moto_s3, tmp_path, sao_cache):
    from sao_core.data.synthetic import tool_arith_sft_rows

    data = _write_prepared(tmp_path / "prepared", list(tool_arith_sft_rows(20, seed=4)))
    out = moto_s3.uri("runs/sft1")
    summary = run_sft(SFTConfig(data=str(data), output=out, steps=2, batch_size=4, cache_dir=str(sao_cache)))
    assert summary["checkpoint"] == f"{out}/checkpoints/step-000002"
    assert storage.latest_checkpoint(storage.join(out, "checkpoints")) == summary["checkpoint"]
    assert json.loads(storage.read_text(storage.join(out, "summary.json")))["steps"] == 2


@pytest.mark.parametrize("field, value, message", [
    ("steps", 0, "steps must be >= 1"),
    ("lr", 0.0, "lr must be > 0"),
    ("schedule", "exp", "schedule must be one of"),
    ("eval_fraction", 1.5, "eval_fraction"),
])
def test_sft_config_validation(field, value, message, tmp_path):
    config = SFTConfig(data=str(tmp_path), output=str(tmp_path / "o"), **{field: value})
    with pytest.raises(ValueError, match=message):
        run_sft(config)


def test_prepared_data_errors(tmp_path, sao_cache):
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "data.jsonl").write_text('{"messages": []}\n{oops\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_prepared_rows(str(tmp_path / "bad"))
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "data.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="holds no rows"):
        read_prepared_rows(str(tmp_path / "empty"))
    with pytest.raises(storage.StorageError, match="not found|does not exist|No such"):
        read_prepared_rows(str(tmp_path / "missing"))
    _write_prepared(tmp_path / "cpt", [{"text": "hello"}])
    with pytest.raises(ValueError, match="row 0 has no 'messages'"):
        run_sft(SFTConfig(data=str(tmp_path / "cpt"), output=str(tmp_path / "o"), steps=1, cache_dir=str(sao_cache)))
