"""Weights in memory (sao_core/rollout/weights.py): the learner's tensors copied into a colocated HF engine's own
parameters with a digest the engine recomputes. Planted faults: a tensor changed on the way, a tensor (bucket)
skipped, unknown names, wrong dtype, a stale version; each stops the update with an error saying what, and the
whole RL loop stops naming the service. Durable versions are written in the background (learner/durable.py)."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest
import torch
from rl_data import tool_arith_rl

from sao_core import storage
from sao_core.learner.config import RLConfig
from sao_core.learner.errors import LearnerError
from sao_core.learner.loop import train_rl
from sao_core.models import load_model
from sao_core.rollout import weights as weights_mod
from sao_core.rollout.engines.base import EngineError, SamplingParams
from sao_core.rollout.engines.hf import HFEngine
from sao_core.rollout.manager import ConflictError, RolloutError
from sao_core.rollout.weights import (
    WeightsCorrupted,
    WeightUpdate,
    WeightUpdateError,
    apply_update,
    tensors_digest,
)


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    return tool_arith_rl(tmp_path_factory.mktemp("wt-rl") / "rl", 200, seed=3)


def _moved(model: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """The float32 state dict of a copy of `model` whose parameters moved by a little noise (the next version;
    tied weights stay tied, as in a learner)."""
    generator = torch.Generator().manual_seed(seed)
    moved = copy.deepcopy(model).float()
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=generator))
    return moved.state_dict()


def test_digest_covers_names_dtypes_shapes_and_bytes():
    a = torch.arange(6, dtype=torch.float32)
    big = torch.randn(3 * weights_mod.CHUNK + 5)
    # Chunked conversion to the wire dtype hashes the bytes the whole converted tensor has.
    assert tensors_digest([("b", big)], [torch.bfloat16]) == tensors_digest([("b", big.to(torch.bfloat16))])
    assert WeightUpdate(1, [("b", big)], [torch.bfloat16]).digest == tensors_digest([("b", big.to(torch.bfloat16))])
    base = tensors_digest([("w", a)])
    assert base.startswith("xxh3-128:") and base == tensors_digest([("w", a.clone())])
    assert base != tensors_digest([("v", a)])
    assert base != tensors_digest([("w", a.reshape(2, 3))])
    assert base != tensors_digest([("w", a.to(torch.bfloat16))])
    changed = a.clone()
    changed[3] = torch.nextafter(changed[3], torch.tensor(10.0))   # one bit
    assert base != tensors_digest([("w", changed)])


def test_an_update_lands_in_place_in_the_engine_dtype(tiny_model_dir, sao_cache):
    learner = load_model(tiny_model_dir, sao_cache, "float32")
    engine = load_model(tiny_model_dir, sao_cache, "bfloat16")
    params_before = {n: p.data_ptr() for n, p in engine.named_parameters()}
    state = _moved(learner)
    dtypes = {n: t.dtype for n, t in engine.state_dict().items()}
    update = WeightUpdate.build(7, state, dtypes)
    assert set(update.dtypes) == {torch.bfloat16} and update.nbytes == sum(p.numel() * 2 for p in engine.parameters())
    assert apply_update(engine, update) == update.digest
    assert {n: p.data_ptr() for n, p in engine.named_parameters()} == params_before   # same tensors, new values
    for name, tensor in engine.state_dict().items():
        torch.testing.assert_close(tensor, state[name].to(torch.bfloat16), rtol=0, atol=0)


def test_a_tied_weight_is_sent_once(sao_cache):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    update = WeightUpdate.build(1, _moved(model), {n: t.dtype for n, t in model.state_dict().items()})
    names = [n for n, _ in update.tensors]
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in names
    target = LlamaForCausalLM(config)
    apply_update(target, update)
    assert torch.equal(target.lm_head.weight, dict(update.tensors)["model.embed_tokens.weight"])
    # A gathered learner state unties it (two tensors): sent under both names, equal values land once; values
    # that differ are refused before anything changes (one of them would be lost unseen).
    state = _moved(model, seed=2)
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    both = WeightUpdate.build(2, state, {n: t.dtype for n, t in model.state_dict().items()})
    assert "lm_head.weight" in [n for n, _ in both.tensors]
    assert apply_update(target, both) == both.digest == tensors_digest(both.tensors)
    assert torch.equal(target.lm_head.weight, state["model.embed_tokens.weight"])
    state = _moved(model, seed=3)
    state["lm_head.weight"] = state["model.embed_tokens.weight"] + 1.0
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(WeightUpdateError, match="sends model.embed_tokens.weight and lm_head.weight, which are one "
                                                "weight in this model \\(tied\\), with different values"):
        apply_update(target, WeightUpdate.build(3, state, {n: t.dtype for n, t in model.state_dict().items()}))
    assert all(torch.equal(t, before[k]) for k, t in target.state_dict().items())


def test_faults_in_an_update_are_refused_before_anything_changes(tiny_model_dir, sao_cache):
    engine = load_model(tiny_model_dir, sao_cache, "float32")
    before = {k: v.clone() for k, v in engine.state_dict().items()}
    dtypes = {n: t.dtype for n, t in engine.state_dict().items()}
    update = WeightUpdate.build(1, _moved(engine), dtypes)
    first = update.tensors[0][0]

    skipped = WeightUpdate(1, update.tensors[1:])                     # a bucket never sent
    with pytest.raises(WeightUpdateError, match=f"lacks 1 of the model's tensors \\(first: {first}\\)"):
        apply_update(engine, skipped)
    foreign = WeightUpdate(1, update.tensors + (("extra.weight", torch.zeros(2)),), digest="x")
    with pytest.raises(WeightUpdateError, match="does not have \\(first: extra.weight\\)"):
        apply_update(engine, foreign)
    half = WeightUpdate(1, update.tensors, [torch.bfloat16] * len(update.tensors))
    with pytest.raises(WeightUpdateError, match=f"{first} is .* torch.bfloat16, the model's is .* torch.float32"):
        apply_update(engine, half)
    for name, tensor in engine.state_dict().items():
        assert torch.equal(tensor, before[name]), name


def test_a_tensor_changed_in_transit_is_caught_by_the_receiver(tiny_model_dir, sao_cache):
    engine = load_model(tiny_model_dir, sao_cache, "float32")
    update = WeightUpdate.build(1, _moved(engine), {n: t.dtype for n, t in engine.state_dict().items()})
    assert update.digest                              # the sender's digest is taken ...
    update.tensors[3][1].view(-1)[0] += 1.0          # ... then the bytes change on the way
    with pytest.raises(WeightUpdateError, match="did not arrive intact"):
        apply_update(engine, update)


def _digest_by_definition(named, dtypes, hasher, chunk_digest) -> str:
    """The digest as its definition says, on one thread: each tensor's header, then the digest of each chunk of
    `CHUNK` elements of its bytes in its wire dtype."""
    step = weights_mod.CHUNK
    for (name, tensor), dtype in zip(named, dtypes, strict=True):
        hasher.update(f"{name}\0{str(dtype).removeprefix('torch.')}\0{tuple(tensor.shape)}\0".encode())
        flat = tensor.to(dtype).contiguous().reshape(-1)
        for begin in range(0, flat.numel(), step):
            hasher.update(chunk_digest(flat[begin:begin + step].view(torch.uint8).numpy().tobytes()))
    return hasher.hexdigest()


class _ManyTensors(torch.nn.Module):
    """300 small parameters of 3-9 elements, one of 52 (10 chunks of 5 and a partial one) and a buffer."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(3 + i % 7, dtype=dtype))
                                            for i in range(300))
        self.big = torch.nn.Parameter(torch.zeros(4, 13, dtype=dtype))
        self.register_buffer("steps", torch.zeros(2, dtype=torch.long))


def _many_tensors_state(seed: int) -> dict[str, torch.Tensor]:
    """A float32 learner's state for `_ManyTensors` (the buffer stays an integer)."""
    generator = torch.Generator().manual_seed(seed)
    return {name: (torch.randn(t.shape, generator=generator) if t.is_floating_point() else torch.arange(2))
            for name, t in _ManyTensors(torch.float32).state_dict().items()}


@pytest.mark.parametrize("chunk", [5, 1 << 19])
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_the_digest_follows_its_definition_whatever_the_threads(monkeypatch, chunk, workers):
    import xxhash

    monkeypatch.setattr(weights_mod, "CHUNK", chunk)
    monkeypatch.setattr(weights_mod, "update_threads", lambda: workers)
    named = [(f"t{i}", torch.randn(n)) for i, n in enumerate((1, 4, 5, 6, 11, 23, 52))] + [("m", torch.randn(3, 7))]
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16, torch.float32, torch.bfloat16,
              torch.float16, torch.bfloat16]   # conversions to two dtypes interleaved: each has its own buffer
    expected = "xxh3-128:" + _digest_by_definition(named, dtypes, xxhash.xxh3_128(), xxhash.xxh3_128_digest)
    assert tensors_digest(named, dtypes) == expected
    assert WeightUpdate(1, named, dtypes).digest == expected
    background = WeightUpdate(1, named, dtypes)
    background.hash_in_background()
    assert background.digest == expected
    # Nothing hashed it: the copy into the engine computes the sender's digest too, the same value.
    engine = torch.nn.Module()
    for (name, tensor), dtype in zip(named, dtypes, strict=True):
        engine.register_parameter(name, torch.nn.Parameter(torch.zeros(tensor.shape, dtype=dtype)))
    update = WeightUpdate(1, named, dtypes)
    assert apply_update(engine, update) == expected and update.digest == expected
    for (name, tensor), dtype in zip(named, dtypes, strict=True):
        assert torch.equal(getattr(engine, name), tensor.to(dtype)), name


@pytest.mark.parametrize("chunk", [5, 1 << 20])
def test_many_small_tensors_land_exactly_and_a_change_in_any_chunk_is_caught(monkeypatch, chunk):
    monkeypatch.setattr(weights_mod, "CHUNK", chunk)
    engine = _ManyTensors(torch.bfloat16)
    dtypes = {n: t.dtype for n, t in engine.state_dict().items()}
    state = _many_tensors_state(seed=1)
    update = WeightUpdate.build(1, state, dtypes)
    assert apply_update(engine, update) == update.digest
    for name, tensor in engine.state_dict().items():
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name
    # One element changed after the sender's digest: in the first chunk, a middle one, the last partial one of
    # the 52-element tensor, the last small tensor, the buffer.
    for name, index in (("big", 0), ("big", 27), ("big", 51), ("small.299", 2), ("steps", 1)):
        update = WeightUpdate.build(2, _many_tensors_state(seed=2), dtypes)
        assert update.digest
        dict(update.tensors)[name].view(-1)[index] += 1
        with pytest.raises(WeightsCorrupted, match="v2 did not arrive intact"):
            apply_update(engine, update)


def test_the_blake2b_fallback_where_xxhash_is_missing(monkeypatch):
    import hashlib
    import sys

    monkeypatch.setitem(sys.modules, "xxhash", None)   # `import xxhash` raises ImportError
    engine = _ManyTensors(torch.bfloat16)
    dtypes = {n: t.dtype for n, t in engine.state_dict().items()}
    update = WeightUpdate.build(1, _many_tensors_state(seed=3), dtypes)
    expected = "blake2b-128:" + _digest_by_definition(update.tensors, update.dtypes, hashlib.blake2b(digest_size=16),
                                                      lambda data: hashlib.blake2b(data, digest_size=16).digest())
    assert update.digest == expected
    assert apply_update(engine, update) == expected


class _FailingHasher:
    """A streaming hasher that fails at its `fail_at`-th update."""

    def __init__(self, fail_at: int):
        self.calls, self.fail_at = 0, fail_at

    def update(self, data) -> None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise RuntimeError("hasher failed")

    def hexdigest(self) -> str:
        return "0" * 32


def test_an_error_of_either_hash_reaches_the_caller(monkeypatch):
    import xxhash

    engine = _ManyTensors(torch.float32)
    dtypes = {n: t.dtype for n, t in engine.state_dict().items()}
    monkeypatch.setattr(weights_mod, "_hashers",
                        lambda: (_FailingHasher(fail_at=7), xxhash.xxh3_128_digest, "xxh3-128"))
    update = WeightUpdate.build(1, _many_tensors_state(seed=4), dtypes)
    update.hash_in_background()   # the sender's hash, on its thread
    with pytest.raises(WeightUpdateError, match="v1: the sender's digest failed: hasher failed"):
        _ = update.digest
    # once the copy has begun, any failure leaves a mixture: WeightsCorrupted, which makes an engine refuse to serve
    given = WeightUpdate(1, update.tensors, update.dtypes, digest="xxh3-128:" + "0" * 32)
    with pytest.raises(WeightsCorrupted, match=r"failed part-way \(RuntimeError: hasher failed\); the model holds a "
                                              "mixture"):   # the receiver's hash
        apply_update(engine, given)
    monkeypatch.undo()   # the receiver hashes again; the sender's digest of `update` had failed
    with pytest.raises(WeightsCorrupted, match=r"v1 failed part-way \(WeightUpdateError: weight update v1: the "
                                              r"sender's digest failed: hasher failed\); the model holds a mixture"):
        apply_update(_ManyTensors(torch.float32), update)
    # A chunk's hash fails on one of the threads while the copy hashes for the sender: the copy stops, and a
    # reader of the sender's digest learns why there is none.
    calls = []

    def failing_chunk(data) -> bytes:
        calls.append(1)
        if len(calls) >= 40:
            raise RuntimeError("chunk hash failed")
        return xxhash.xxh3_128_digest(data)

    monkeypatch.setattr(weights_mod, "_hashers", lambda: (xxhash.xxh3_128(), failing_chunk, "xxh3-128"))
    monkeypatch.setattr(weights_mod, "update_threads", lambda: 2)
    fresh = WeightUpdate.build(2, _many_tensors_state(seed=4), dtypes)
    with pytest.raises(WeightsCorrupted, match=r"v2 failed part-way \(RuntimeError: chunk hash failed\)"):
        apply_update(engine, fresh)
    with pytest.raises(WeightUpdateError, match="v2: the sender's digest failed: chunk hash failed"):
        _ = fresh.digest


def test_a_copy_gone_wrong_is_caught_when_the_copy_hashes_for_the_sender(monkeypatch):
    """Nothing hashed the update before the copy: each chunk is hashed as the sender holds it, copied, and hashed
    again as the engine holds it; a byte changed by the copy itself is caught."""
    engine = _ManyTensors(torch.bfloat16)
    dtypes = {n: t.dtype for n, t in engine.state_dict().items()}
    update = WeightUpdate.build(1, _many_tensors_state(seed=5), dtypes)
    big = engine.big.data.untyped_storage().data_ptr()
    copy_ = torch.Tensor.copy_

    def faulty(self, source, non_blocking=False):
        out = copy_(self, source, non_blocking)
        if self.untyped_storage().data_ptr() == big:
            self.view(-1)[-1] += 1   # the engine's tensor is not what was sent
        return out

    monkeypatch.setattr(torch.Tensor, "copy_", faulty)
    with pytest.raises(WeightsCorrupted, match="v1 did not arrive intact"):
        apply_update(engine, update)
    monkeypatch.undo()
    assert update.digest == tensors_digest(update.tensors, update.dtypes)   # what the sender held
    assert apply_update(engine, WeightUpdate.build(1, _many_tensors_state(seed=5), dtypes)) == update.digest


def _engine_call(engine, coroutine):
    return asyncio.run(coroutine)


def test_the_hf_engine_takes_an_update_between_steps_and_refuses_corrupt_ones(tiny_model_dir, sao_cache):
    engine = HFEngine(tiny_model_dir, str(sao_cache), max_batch=4, seed=0)
    try:
        moved = _moved(engine.model)
        update = WeightUpdate.build(1, moved, engine.weight_dtypes())
        assert asyncio.run(engine.update_in_memory(update)) == update.digest and engine.version == 1
        generation = asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=3, seed=1)))
        assert set(generation.versions) == {1}
        # A skipped tensor: refused, the engine still serves version 1.
        bad = WeightUpdate(2, update.tensors[1:])
        with pytest.raises(EngineError, match="lacks 1 .* the current weights \\(version 1\\) stay"):
            asyncio.run(engine.update_in_memory(bad))
        assert engine.version == 1
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, seed=1)))
        # Changed on the way: the engine refuses to serve until good weights arrive.
        corrupt = WeightUpdate.build(2, _moved(engine.model, seed=2), engine.weight_dtypes())
        assert corrupt.digest
        corrupt.tensors[0][1].view(-1)[0] += 1.0
        with pytest.raises(EngineError, match="did not arrive intact"):
            asyncio.run(engine.update_in_memory(corrupt))
        with pytest.raises(EngineError, match="weights are unusable"):
            asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, seed=1)))
        with pytest.raises(EngineError, match="weights are unusable"):
            asyncio.run(engine.score([1, 2, 3], 1))
        good = WeightUpdate.build(2, _moved(engine.model, seed=3), engine.weight_dtypes())
        asyncio.run(engine.update_in_memory(good))
        assert engine.version == 2
        asyncio.run(engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, seed=1)))
    finally:
        asyncio.run(engine.close())


def test_the_service_in_this_process_keeps_the_version_rules(tiny_model_dir, sao_cache, tmp_path):
    from sao_core.rollout.server import RolloutServer, ServeConfig

    server = RolloutServer(ServeConfig(model=tiny_model_dir, port=0, cache_dir=str(sao_cache),
                                       allowed_weight_roots=[str(tmp_path)])).start()
    try:
        assert server.takes_weights_in_memory()
        model = server.manager.engine.model
        v1 = WeightUpdate.build(1, _moved(model), server.weight_dtypes())
        answer = server.update_in_memory(v1)
        assert answer["version"] == 1 and answer["sha256"] == v1.digest
        with pytest.raises(ConflictError, match="not newer than the current version 1"):
            server.update_in_memory(v1)                                   # stale
        v3 = WeightUpdate.build(3, _moved(model, seed=4), server.weight_dtypes())
        with pytest.raises(ConflictError, match="skips versions"):
            server.update_in_memory(v3)
        assert server.update_in_memory(v3, resync=True)["version"] == 3   # a learner re-syncing
        assert server.update_in_memory(v3, resync=True)["unchanged"]      # the same again: a no-op
        status = server.manager.status()
        assert status["version"] == 3 and status["weights_sha256"] == v3.digest
        with pytest.raises(RolloutError, match="did not arrive intact"):
            bad = WeightUpdate.build(4, _moved(model, seed=5), server.weight_dtypes())
            assert bad.digest
            bad.tensors[1][1].view(-1)[0] += 1.0
            server.update_in_memory(bad)
    finally:
        server.stop()


def _config(rl_data, output, model, sao_cache, **kw) -> RLConfig:
    base = dict(data=rl_data, output=str(output), model=model, batch_size=8, policy_lr=3e-4, critic_lr=3e-4,
                critic_warmup_steps=1, max_new_tokens_per_turn=12, max_total_tokens=80, cache_dir=str(sao_cache))
    return RLConfig(**{**base, **kw})


def test_a_colocated_run_pushes_in_memory_and_writes_durable_versions_in_the_background(
        rl_data, tmp_path, sao_cache, tiny_model_dir):
    out = tmp_path / "run"
    summary = train_rl(_config(rl_data, out, tiny_model_dir, sao_cache, steps=5, publish_every=2,
                               keep_weight_versions=10))
    assert summary["version"] == 4
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("durable_wait_s" in r for r in lines)
    pushed = [r for r in lines if r.get("weight_push_s")]
    assert len(pushed) == 4 and all(r["delivery_logp_diff_mean"] < 1e-4 for r in pushed)   # fp32 engine: exact
    # Durable: every 2nd version and the end's (v4 is both), each a verified folder that loads; the summary's
    # model and critic are complete checkpoints (also the claim of test_learner.py's former
    # test_published_weights_are_verifiable, whose run this one replaced).
    assert storage.list_dirs(str(out / "weights")) == ["v000002", "v000004"]
    assert storage.latest_checkpoint(str(out / "weights")).endswith("v000004")
    for name in ("v000002", "v000004"):
        storage.verify_checkpoint(out / "weights" / name)
    assert storage.is_complete_checkpoint(summary["model"]) and storage.is_complete_checkpoint(summary["critic"])
    final = load_model(str(out / "weights" / "v000004"), sao_cache)
    model = load_model(summary["model"], sao_cache)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, final.state_dict()[name]), name


def test_files_transport_still_publishes_every_version(rl_data, tmp_path, sao_cache, tiny_model_dir):
    out = tmp_path / "run"
    summary = train_rl(_config(rl_data, out, tiny_model_dir, sao_cache, steps=3, weight_transport="files",
                               keep_weight_versions=10))
    assert summary["version"] == 2
    assert storage.list_dirs(str(out / "weights")) == ["v000001", "v000002"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert not any("durable_wait_s" in r for r in lines)


def test_a_tensor_corrupted_in_a_push_stops_the_run_naming_the_service(rl_data, tmp_path, sao_cache,
                                                                       tiny_model_dir, monkeypatch):
    build = WeightUpdate.build.__func__

    def corrupting(cls, version, state, dtypes):
        update = build(cls, version, state, dtypes)
        if version == 2:   # the sender's digest of the true tensors, then one tensor changed on the way
            name, tensor = update.tensors[-1]
            update = WeightUpdate(version, update.tensors[:-1] + ((name, tensor.clone() + 1.0),), update.dtypes,
                                  digest=update.digest)
        return update

    monkeypatch.setattr(weights_mod.WeightUpdate, "build", classmethod(corrupting))
    with pytest.raises(LearnerError, match=r"rollout service http://127\.0\.0\.1:\d+ \(in this process\) refused "
                                           r"weights version 2 .*did not arrive intact"):
        train_rl(_config(rl_data, tmp_path / "run", tiny_model_dir, sao_cache, steps=4))


def test_a_skipped_tensor_stops_the_run_naming_the_service(rl_data, tmp_path, sao_cache, tiny_model_dir,
                                                           monkeypatch):
    build = WeightUpdate.build.__func__

    def skipping(cls, version, state, dtypes):
        update = build(cls, version, state, dtypes)
        return WeightUpdate(version, update.tensors[1:], update.dtypes[1:])

    monkeypatch.setattr(weights_mod.WeightUpdate, "build", classmethod(skipping))
    with pytest.raises(LearnerError, match="refused weights version 1 handed over in memory: .*lacks 1 of the "
                                           "model's tensors"):
        train_rl(_config(rl_data, tmp_path / "run", tiny_model_dir, sao_cache, steps=3))
