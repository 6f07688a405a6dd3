"""LoRA adapters handed to a colocated HF engine in memory (issue 37): the same `WeightUpdate` as full weights,
carrying the adapter's tensors under peft's file names, its adapter config and the xxh3 digest of the tensors.
The engine copies the tensors, checks their digest and checks them as it checks an adapter folder before it
touches the model: a hostile config or a tensor changed after the sender's digest is refused with the engine
unchanged (log-probs bit-identical), and the next good adapter is taken. A colocated LoRA run pushes its
adapters this way and writes adapter folders to storage only every `publish_every` versions and at the end."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from lora_helpers import make_adapter, move_lora_b
from rl_data import tool_arith_rl
from test_lora_delivery import PROBE, TARGETS, _close, _reference

from sao_core import storage
from sao_core.learner.config import RLConfig
from sao_core.learner.errors import LearnerError
from sao_core.learner.learner import Learner
from sao_core.learner.loop import train_rl
from sao_core.models import load_model
from sao_core.rollout import weights as weights_mod
from sao_core.rollout.engines.base import EngineError, SamplingParams
from sao_core.rollout.engines.hf import HFEngine
from sao_core.rollout.weights import WeightUpdate
from sao_core.training.lora import adapter_config, adapter_state_dict, is_adapter_dir, load_adapter_into


def _adapter_weights(model) -> dict[str, torch.Tensor]:
    """The adapter's weights as a learner sends them (own copies: a test may change them after the digest)."""
    return {name: t.clone() for name, t in adapter_state_dict(model, lambda m: m.state_dict()).items()}


def test_the_hf_engine_takes_adapters_in_memory_and_refuses_hostile_or_changed_ones(tiny_model_dir, sao_cache,
                                                                                     tmp_path):
    ref1 = make_adapter(tiny_model_dir, sao_cache, tmp_path / "v1", seed=1, target_modules=TARGETS)
    ref2 = make_adapter(tiny_model_dir, sao_cache, tmp_path / "v2", seed=2, target_modules=TARGETS)
    config = adapter_config(ref2)
    written = json.loads((tmp_path / "v2" / "adapter_config.json").read_text())   # what the folder holds
    assert config == {**written, "target_modules": sorted(written["target_modules"])}   # (a set, sorted here)

    async def refused(engine, update, match: str) -> None:
        before = await engine.score(PROBE, 1)
        with pytest.raises(EngineError, match=match):
            await engine.update_in_memory(update)
        assert engine.version == update.version - 1
        assert await engine.score(PROBE, 1) == before   # bit-identical: the model was not touched

    async def go() -> dict[str, float]:
        engine = HFEngine(str(tiny_model_dir), str(sao_cache), max_batch=4)
        try:
            # a tensor changed after the sender's digest, on the base model: refused before anything is injected
            changed = WeightUpdate.adapter(1, _adapter_weights(ref1), adapter_config(ref1))
            assert changed.digest
            next(iter(changed.tensors))[1].add_(0.5)
            await refused(engine, changed, r"adapter update v1 did not arrive intact")
            assert engine.stats()["lora"] is None
            v1 = WeightUpdate.adapter(1, _adapter_weights(ref1), adapter_config(ref1))
            assert await engine.update_in_memory(v1) == v1.digest
            found = {"v1": _close(await engine.score(PROBE, 1), _reference(ref1, PROBE))}
            generation = await engine.generate(PROBE[:4], SamplingParams(max_new_tokens=6, seed=3))
            assert set(generation.versions) == {1} and engine.stats()["lora"] == "adapter"
            found["v1_generate"] = _close(generation.logprobs, _reference(ref1, PROBE[:4] + generation.token_ids, 4))
            weights = _adapter_weights(ref2)
            await refused(engine, WeightUpdate.adapter(2, weights, {**config, "use_dora": True}),
                          r"use_dora True is refused: DoRA")
            await refused(engine, WeightUpdate.adapter(2, weights, {**config, "target_modules": "(.|.)*Z"}),
                          r"a string is read by peft as a regular expression")
            await refused(engine, WeightUpdate.adapter(2, weights, {**config, "r": 8}),
                          r"does not fit|differs from the adapter")
            changed = WeightUpdate.adapter(2, _adapter_weights(ref2), config)
            assert changed.digest
            changed.tensors[-1][1].mul_(2.0)
            await refused(engine, changed, r"adapter update v2 did not arrive intact")
            v2 = WeightUpdate.adapter(2, weights, config)
            assert await engine.update_in_memory(v2) == v2.digest and engine.version == 2
            found["v2"] = _close(await engine.score(PROBE, 1), _reference(ref2, PROBE))
            with pytest.raises(EngineError, match="cannot replace a model carrying a LoRA adapter"):
                await engine.update_in_memory(WeightUpdate(3, list(ref2.get_base_model().state_dict().items())))
            return found
        finally:
            await engine.close()

    found = asyncio.run(go())
    assert all(diff < 1e-4 for diff in found.values()), found


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    return tool_arith_rl(tmp_path_factory.mktemp("lora-mem-rl") / "rl", 200, seed=3)


def _config(rl_data, output, model, sao_cache, **kw) -> RLConfig:
    base = dict(data=rl_data, output=str(output), model=model, batch_size=8, policy_lr=3e-3, critic_lr=3e-4,
                critic_warmup_steps=1, max_new_tokens_per_turn=12, max_total_tokens=80, cache_dir=str(sao_cache),
                lora_rank=4, lora_target_modules="all-linear")
    return RLConfig(**{**base, **kw})


def _moving_adapters(monkeypatch) -> None:
    """Each learner step also moves the adapter's B matrices a little (as training would: the tiny model earns no
    reward in a few steps, so its gradients are zero and the adapter would stay the base's)."""
    step = Learner.step

    def step_and_move(self, trajectories, allow_empty_rows=False):
        result = step(self, trajectories, allow_empty_rows)
        move_lora_b(self.policy, self.state.step)
        return result

    monkeypatch.setattr(Learner, "step", step_and_move)


@pytest.mark.parametrize("method", ["sao", "grpo"])
def test_a_colocated_lora_run_pushes_its_adapters_in_memory(rl_data, tmp_path, sao_cache, tiny_model_dir, method,
                                                           monkeypatch):
    _moving_adapters(monkeypatch)
    out = tmp_path / "run"
    summary = train_rl(_config(rl_data, out, tiny_model_dir, sao_cache, method=method, steps=5, publish_every=2,
                               keep_weight_versions=10, critic_warmup_steps=1 if method == "sao" else 0))
    version = summary["version"]
    assert version >= 3
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all("durable_wait_s" in r for r in lines)
    pushed = [r for r in lines if r.get("weight_push_s")]
    assert len(pushed) == version
    assert all(r["delivery_logp_diff_max"] < 1e-4 for r in pushed), pushed   # fp32 engine: peft's log-probs
    # Durable adapter folders: every 2nd version and the end's, none between them.
    durable = sorted({f"v{v:06d}" for v in range(2, version + 1, 2)} | {f"v{version:06d}"})
    assert storage.list_dirs(str(out / "weights")) == durable
    for name in durable:
        folder = out / "weights" / name
        storage.verify_checkpoint(folder)
        metadata = storage.read_manifest(str(folder))["metadata"]
        assert is_adapter_dir(folder) and metadata["kind"] == "lora_adapter"
        assert metadata["version"] == int(name[1:])
    # the last durable adapter on the base model is the trained policy (merged at the end)
    final = load_adapter_into(load_model(str(tiny_model_dir), sao_cache), out / "weights" / durable[-1]).eval()
    merged = load_model(summary["model"], sao_cache).eval()
    assert _close(_reference(final, PROBE), _reference(merged, PROBE)) < 1e-4
    base = load_model(str(tiny_model_dir), sao_cache).eval()
    assert _close(_reference(merged, PROBE), _reference(base, PROBE)) > 1e-3   # the adapters did move


def test_an_adapter_changed_after_its_digest_stops_the_run_naming_the_service(rl_data, tmp_path, sao_cache,
                                                                              tiny_model_dir, monkeypatch):
    build = WeightUpdate.adapter.__func__

    def changing(cls, version, weights, config):
        update = build(cls, version, weights, config)
        if version == 2 and update.digest:   # the learner's tensor changed after the sender's digest
            update.tensors[-1][1].add_(1.0)
        return update

    monkeypatch.setattr(weights_mod.WeightUpdate, "adapter", classmethod(changing))
    with pytest.raises(LearnerError, match=r"rollout service http://127\.0\.0\.1:\d+ \(in this process\) refused "
                                           r"weights version 2 .*did not arrive intact"):
        train_rl(_config(rl_data, tmp_path / "run", tiny_model_dir, sao_cache, method="grpo", steps=4))


def test_an_engine_that_ignores_in_memory_adapters_is_caught_by_the_delivery_check(rl_data, tmp_path, sao_cache,
                                                                                  tiny_model_dir, monkeypatch):
    _moving_adapters(monkeypatch)

    async def ignores_adapters(self, update) -> str:   # verl #7495: the version and digest, not the weights
        self.version = update.version
        return update.digest

    monkeypatch.setattr(HFEngine, "_update_adapter_in_memory", ignores_adapters)
    with pytest.raises(LearnerError, match=r"delivery check: rollout service http://127\.0\.0\.1:\d+ does not "
                                           r"serve the learner's weights version \d+"):
        train_rl(_config(rl_data, tmp_path / "run", tiny_model_dir, sao_cache, method="grpo", steps=4,
                         delivery_tolerance=1e-3))
