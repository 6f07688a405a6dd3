"""LoRA on the training core (issue 29, first part: the supervised methods in one process), with peft:
an update changes only the adapter's weights, the loss falls on a tiny task, the export is the merged model
(its logits equal the adapted model's), a resumed run ends with exactly the weights of an uninterrupted one,
DPO's reference is the base model (no second copy), and bad settings are refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_helpers import StopRun, stop_at
from safetensors.torch import load_file
from test_trainer import _common, _dpo_rows, _prepared

from sao_core.data.synthetic import tool_arith_sft_rows
from sao_core.models.tokenizer_corpus import corpus_lines
from sao_core.training.config import CPTConfig, DPOConfig, GKDConfig, SFTConfig
from sao_core.training.lora import apply_lora, plain_state_dict, trainable_parameters
from sao_core.training.trainer import TrainingError, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-data")
    return {"sft": _prepared(root, "sft", list(tool_arith_sft_rows(160, seed=11))),
            "cpt": _prepared(root, "cpt", [{"text": line} for line in corpus_lines(seed=5, num_lines=120)]),
            "dpo": _prepared(root, "dpo", _dpo_rows(80))}


def test_one_update_changes_only_the_adapter(tiny_model_dir, sao_cache):
    from sao_core.models import load_model
    from sao_core.training.core import build_optimizer

    model = apply_lora(load_model(tiny_model_dir, sao_cache), rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    trained, total = trainable_parameters(model)
    assert 0 < trained < total / 5
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = build_optimizer(model.parameters(), lr=1e-2, weight_decay=0.0)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    for _ in range(2):   # B starts at zero: the first step moves B only, the second A too
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    changed = {n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and all(".lora_" in n for n in changed)
    assert {n for n, p in model.named_parameters() if p.requires_grad} >= changed
    assert len(optimizer.state) == sum(1 for p in model.parameters() if p.requires_grad)


def test_the_export_is_the_merged_model_under_the_base_names(tiny_model_dir, sao_cache):
    from sao_core.models import load_model

    base = load_model(tiny_model_dir, sao_cache)
    names = set(base.state_dict())
    model = apply_lora(base, rank=4, alpha=8.0, dropout=0.0, target_modules="q_proj,v_proj")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)      # a trained adapter
    plain = plain_state_dict(model, lambda m: m.state_dict())
    assert set(plain) == names
    merged = load_model(tiny_model_dir, sao_cache)
    merged.load_state_dict(plain, strict=True)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        assert torch.allclose(merged(ids).logits, model(ids).logits, atol=1e-5)
        with model.disable_adapter():   # the live model was left unmerged: without the adapter it is the base
            assert not torch.allclose(model(ids).logits, merged(ids).logits, atol=1e-4)


@pytest.mark.parametrize("precision, checkpointing", [("float32", False), ("bf16", True)])
def test_sft_with_lora_learns_and_exports_a_plain_model(data, tmp_path, sao_cache, tiny_model_dir, precision,
                                                        checkpointing):
    """Also under bf16 autocast with activation checkpointing (the GPU settings; bf16 runs on CPU too)."""
    from sao_core.models import load_model

    s = train("sft", SFTConfig(data=data["sft"], steps=20, lr=1e-2, lora_rank=8, lora_alpha=16.0,
                               lora_target_modules="all-linear", model=tiny_model_dir, precision=precision,
                               gradient_checkpointing=checkpointing, **_common(tmp_path, sao_cache)))
    assert s["last_train_loss"] < s["first_train_loss"] and s["eval_loss_after"] < s["eval_loss_before"]
    assert s["lora"]["rank"] == 8 and 0 < s["lora"]["trainable_parameters"] < s["lora"]["parameters"]
    exported = load_file(f"{s['model']}/model.safetensors")
    base = load_model(tiny_model_dir, sao_cache).state_dict()
    assert set(exported) <= set(base) and not any("lora" in k for k in exported)
    assert any(not torch.equal(exported[k].float(), base[k].float()) for k in exported)


def test_a_resumed_lora_run_ends_with_the_weights_of_an_uninterrupted_one(data, tmp_path, sao_cache,
                                                                           tiny_model_dir):
    common = dict(data=data["cpt"], steps=6, lr=1e-2, lora_rank=4, checkpoint_every=2, model=tiny_model_dir)
    straight = train("cpt", CPTConfig(**common, **{**_common(tmp_path / "a", sao_cache), "max_tokens": 64}))
    config = CPTConfig(**common, **{**_common(tmp_path / "b", sao_cache), "max_tokens": 64})
    with pytest.raises(StopRun):
        train("cpt", config, progress=stop_at(3))
    config.resume = True
    resumed = train("cpt", config)
    assert resumed["resumed_from"].endswith("step-000002")
    a, b = load_file(f"{straight['model']}/model.safetensors"), load_file(f"{resumed['model']}/model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the checkpoints hold the adapter and its optimiser states only, sealed like every checkpoint
    from sao_core import storage

    checkpoint = resumed["resumed_from"]
    assert storage.read_manifest(checkpoint)["metadata"]["adapter_only"] == ["model"]
    storage.verify_checkpoint(checkpoint)
    size = sum(f.stat().st_size for f in (Path(checkpoint) / "dcp").iterdir())
    model_size = sum(v.numel() * v.element_size() for v in a.values())
    assert size < model_size / 3, (size, model_size)   # tiny model: DCP's own metadata is most of the 0.4 MB


def test_dpo_with_lora_trains_against_the_base_model_as_its_reference(data, tmp_path, sao_cache, tiny_model_dir):
    s = train("dpo", DPOConfig(data=data["dpo"], steps=8, lr=1e-2, beta=0.1, lora_rank=4, model=tiny_model_dir,
                               **_common(tmp_path, sao_cache)))
    # At step 1 the adapter is zero, so the policy is its reference: the DPO loss is log 2 exactly.
    assert s["first_train_loss"] == pytest.approx(0.6931, abs=2e-3)
    assert s["last_train_loss"] < s["first_train_loss"]


@pytest.mark.parametrize("field, value, message", [
    ("lora_rank", -1, "lora_rank must be >= 0"),
    ("lora_dropout", 1.0, "lora_dropout must be in"),
    ("lora_target_modules", "no_such_proj", "lora_target_modules 'no_such_proj'"),
])
def test_bad_lora_settings_are_refused_by_name(data, tmp_path, sao_cache, tiny_model_dir, field, value, message):
    kw = {"lora_rank": 4, field: value}
    with pytest.raises((TrainingError, ValueError), match=message):
        train("sft", SFTConfig(data=data["sft"], steps=1, model=tiny_model_dir, **kw, **_common(tmp_path, sao_cache)))


# LoRA with FSDP2 under torchrun (2 processes: the wrapped model sharded layer by layer, only the adapter trains,
# checkpoint, resume, the merged export under the base names): test_trainer.py's test_torchrun_two_processes_fsdp2,
# whose two launches run the LoRA command line beside the full-weight one (formerly
# test_lora_under_torchrun_fsdp2_two_processes_checkpoints_resumes_and_exports here).


def test_gkd_with_lora_learns_from_its_teacher(data, tmp_path, sao_cache, tiny_model_dir, warm_tool_model):
    """GKD with an adapter: the student (base + adapter) samples its on-policy half with the adapter on, and
    the distillation loss on held-out rows falls."""
    s = train("gkd", GKDConfig(data=data["sft"], teacher_model=warm_tool_model, steps=12, lr=1e-2, lora_rank=8,
                               lora_target_modules="all-linear", on_policy_fraction=0.5, max_new_tokens=8,
                               model=tiny_model_dir, **_common(tmp_path, sao_cache)))
    assert s["lora"]["rank"] == 8 and s["eval_loss_after"] < s["eval_loss_before"]


@pytest.mark.parametrize("method", ["sao", "grpo", "grpo_async", "grpo_dis", "running_mean"])
def test_every_rl_method_with_lora_changes_only_the_adapter(method, tmp_path, sao_cache, tiny_model_dir):
    """One learner step of each RL method with a LoRA policy: the policy's update lands in its adapter only
    (SAO's critic, a separate model, trains fully)."""
    from test_learner_parts import _learner, _on_policy, _recorded_batch

    learner = _learner(tmp_path, sao_cache, method=method, lora_rank=4, lora_target_modules="all-linear",
                       group_size=2, critic_warmup_steps=0)
    batch = _on_policy(learner, _recorded_batch())
    for i, t in enumerate(batch):   # two groups of two (the GRPO methods' advantages are within a group)
        t.prompt_id = f"p{i // 2}"
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    result = learner.step(batch)
    changed = {n for n, p in learner.policy.named_parameters() if not torch.equal(before[n], p.detach())}
    assert result.changed and changed and all(".lora_" in n for n in changed), (method, sorted(changed)[:3])


def test_a_critic_with_a_lora_body_trains_its_adapter_and_head_and_saves_merged(tmp_path, sao_cache, tiny_model_dir):
    """critic_lora_rank: the critic's body gets an adapter (peft), its new value head trains fully; checkpoints
    hold both adapters and the head, and a resume gives every weight back; the saved critic is plain (merged)
    and computes the live critic's values."""
    from test_learner_parts import _learner, _on_policy, _recorded_batch, _weights

    from sao_core import storage
    from sao_core.learner.batch import collate
    from sao_core.models.value import ValueModel

    learner = _learner(tmp_path, sao_cache, lora_rank=4, critic_lora_rank=4, lora_target_modules="all-linear")
    critic = learner.critic
    trainable = {n for n, p in critic.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_" in n or n.startswith("value_head") for n in trainable)
    assert {"value_head.weight", "value_head.bias"} <= trainable
    before = {n: p.detach().clone() for n, p in critic.named_parameters()}
    for version in (0, 1):
        learner.step(_on_policy(learner, _recorded_batch(version=version)))
    changed = {n for n, p in critic.named_parameters() if not torch.equal(before[n], p.detach())}
    assert changed and changed <= trainable and any(".lora_" in n for n in changed)
    uri = learner.checkpoint()
    assert storage.read_manifest(uri)["metadata"]["adapter_only"] == ["critic", "policy"]
    again = _learner(tmp_path, sao_cache, lora_rank=4, critic_lora_rank=4, lora_target_modules="all-linear")
    again.resume(uri)
    assert all(torch.equal(a, b) for a, b in zip(critic.state_dict().values(), again.critic.state_dict().values(),
                                                  strict=True))
    assert all(torch.equal(a, b) for a, b in zip(_weights(learner).values(), _weights(again).values(), strict=True))
    _, critic_uri = learner.save_final()
    saved = ValueModel.from_pretrained(critic_uri)
    assert not any(".lora_" in n for n, _ in saved.named_parameters())
    batch = collate(_recorded_batch(), learner.tokenizer.pad_token_id)
    with torch.no_grad():
        live = critic.eval()(batch.input_ids, batch.attention_mask)
        plain = saved.eval()(batch.input_ids, batch.attention_mask)
    torch.testing.assert_close(plain, live, rtol=0, atol=1e-5)
