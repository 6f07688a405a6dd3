"""The critic: zero head, position alignment, attention freezing, save/load, error on bogus directories."""

from __future__ import annotations

import json

import pytest
import torch

from sao_core.models import load_model
from sao_core.models.value import HEAD_FILE, META_FILE, ValueModel


@pytest.fixture
def critic(tiny_model_dir) -> ValueModel:
    return ValueModel.from_pretrained(tiny_model_dir)


def _perturb_head(model: ValueModel, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.value_head.weight.copy_(torch.randn(model.value_head.weight.shape, generator=generator))
        model.value_head.bias.fill_(0.25)


def _ids(seed: int = 0, shape: tuple[int, int] = (2, 6)) -> torch.Tensor:
    return torch.randint(0, 512, shape, generator=torch.Generator().manual_seed(seed))


def test_zero_head_gives_zero_values_at_init(critic):
    assert torch.all(critic.value_head.weight == 0) and critic.value_head.bias.item() == 0.0
    ids = _ids()
    values = critic(ids, torch.ones_like(ids))
    assert values.shape == (2, 6) and values.dtype == torch.float32
    assert torch.all(values == 0)


def test_plain_causal_lm_directory_loads_the_backbone_weights(critic, tiny_model_dir, sao_cache):
    lm = load_model(tiny_model_dir, sao_cache)
    ids = _ids(1)
    with torch.no_grad():
        ours = critic.backbone(input_ids=ids).last_hidden_state
        theirs = lm.model(input_ids=ids).last_hidden_state
    assert torch.allclose(ours, theirs)
    assert critic.hidden_size == lm.config.hidden_size == 128


def test_values_are_aligned_with_the_state_before_each_token(critic):
    _perturb_head(critic)
    critic.eval()
    ids = _ids(2)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        values = critic(ids, mask)
        hidden = critic.backbone(input_ids=ids, attention_mask=mask).last_hidden_state
    assert torch.all(values[:, 0] == 0)
    # values[:, t] = head(hidden[:, t − 1])
    assert torch.allclose(values[:, 1:], critic.value_head(hidden[:, :-1]).squeeze(-1), atol=1e-6)
    for t in range(ids.shape[1]):
        changed = ids.clone()
        changed[:, t] = (changed[:, t] + 1) % 512
        with torch.no_grad():
            other = critic(changed, mask)
        assert torch.allclose(other[:, : t + 1], values[:, : t + 1], rtol=0, atol=1e-6)   # only tokens < t
        if t + 1 < ids.shape[1]:
            assert not torch.allclose(other[:, t + 1], values[:, t + 1])


def test_freeze_attention_freezes_exactly_the_attention_parameters(critic):
    frozen = critic.freeze_attention()
    assert frozen == 8   # 2 layers × q, k, v, o projections
    for name, parameter in critic.named_parameters():
        assert parameter.requires_grad == ("self_attn" not in name), name
    assert critic.value_head.weight.requires_grad
    # Gradients still reach the head and the non-attention weights.
    _perturb_head(critic)
    ids = _ids(3)
    critic(ids, torch.ones_like(ids)).sum().backward()
    assert critic.value_head.weight.grad is not None
    assert critic.backbone.layers[0].mlp.up_proj.weight.grad is not None
    assert critic.backbone.layers[0].self_attn.q_proj.weight.grad is None


def test_save_load_round_trip_keeps_the_head(critic, tmp_path):
    _perturb_head(critic, seed=5)
    with torch.no_grad():
        critic.backbone.norm.weight.mul_(1.5)
    ids = _ids(4)
    mask = torch.ones_like(ids)
    mask[1, -2:] = 0
    with torch.no_grad():
        before = critic(ids, mask)
    assert before.abs().max() > 0
    out = tmp_path / "critic"
    critic.save_pretrained(out)
    assert (out / HEAD_FILE).is_file() and (out / "config.json").is_file()
    assert json.loads((out / META_FILE).read_text()) == {"format": 1, "hidden_size": 128}
    loaded = ValueModel.from_pretrained(out)
    with torch.no_grad():
        after = loaded(ids, mask)
    assert torch.equal(after, before)


def test_bfloat16_backbone_still_gives_float32_values(tiny_model_dir):
    model = ValueModel.from_pretrained(tiny_model_dir, dtype="bfloat16")
    assert next(model.backbone.parameters()).dtype == torch.bfloat16
    assert model.value_head.weight.dtype == torch.float32
    ids = _ids(5)
    assert model(ids, torch.ones_like(ids)).dtype == torch.float32


def test_gradient_checkpointing_passthrough(critic):
    critic.gradient_checkpointing_enable()
    assert critic.backbone.is_gradient_checkpointing
    critic.train()
    _perturb_head(critic)
    ids = _ids(6)
    critic(ids, torch.ones_like(ids)).sum().backward()
    assert critic.backbone.layers[1].mlp.down_proj.weight.grad is not None


def test_bogus_directories_give_a_clear_error(tmp_path):
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    (empty / "weights.bin").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not-a-model.*neither"):
        ValueModel.from_pretrained(empty)
    with pytest.raises(ValueError, match="missing-dir"):
        ValueModel.from_pretrained(tmp_path / "missing-dir")
    with pytest.raises(ValueError, match="unknown dtype"):
        ValueModel.from_pretrained(empty, dtype="float7")


def test_saved_critic_with_wrong_head_metadata_is_rejected(critic, tmp_path):
    out = critic.save_pretrained(tmp_path / "critic")
    (out / META_FILE).write_text(json.dumps({"format": 1, "hidden_size": 64}))
    with pytest.raises(ValueError, match="hidden_size 64"):
        ValueModel.from_pretrained(out)
    (out / META_FILE).write_text(json.dumps({"format": 99, "hidden_size": 128}))
    with pytest.raises(ValueError, match="unsupported value-model format"):
        ValueModel.from_pretrained(out)
