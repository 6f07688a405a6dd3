"""LoRA adapters delivered to the rollout engines (issue 29): the HF engine applies a pushed adapter to its
base model (log-probs equal peft's, version by version; a broken adapter is refused and the old weights stay),
the rollout service scores a probe (`POST /v1/score`), and the learner's delivery check passes on a real
service and stops, naming the service, when the engine does not apply what was pushed (verl #7495's failure)."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from lora_helpers import make_adapter
from test_learner_parts import _learner, _on_policy, _recorded_batch

from sao_core.learner.errors import LearnerError
from sao_core.learner.services import ServiceSet
from sao_core.rollout.client import RolloutClient, RolloutRequestError
from sao_core.rollout.engines.base import EngineError, SamplingParams
from sao_core.rollout.engines.hf import HFEngine
from sao_core.rollout.server import RolloutServer, ServeConfig

PROBE = [3, 17, 5, 42, 9, 11, 28, 7, 64, 2, 33, 19]
TARGETS = "q_proj,v_proj,down_proj"


def _reference(model, ids: list[int], start: int = 1) -> list[float]:
    with torch.no_grad():
        logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    return [float(logp[t - 1, ids[t]]) for t in range(start, len(ids))]


def _close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_the_hf_engine_applies_adapters_version_by_version(tiny_model_dir, sao_cache, tmp_path):
    ref1 = make_adapter(tiny_model_dir, sao_cache, tmp_path / "v1", seed=1, target_modules=TARGETS)
    ref2 = make_adapter(tiny_model_dir, sao_cache, tmp_path / "v2", seed=2, target_modules=TARGETS)
    from sao_core.models import load_model

    base = load_model(str(tiny_model_dir), str(sao_cache)).eval()

    async def go():
        engine = HFEngine(str(tiny_model_dir), str(sao_cache), max_batch=4)
        try:
            found = {"base": _close(await engine.score(PROBE, 1), _reference(base, PROBE))}
            await engine.load_weights(str(tmp_path / "v1"), 1)
            found["v1"] = _close(await engine.score(PROBE, 1), _reference(ref1, PROBE))
            generation = await engine.generate(PROBE[:4], SamplingParams(max_new_tokens=6, seed=3))
            ids = PROBE[:4] + generation.token_ids
            found["v1_generate"] = _close(generation.logprobs, _reference(ref1, ids, 4))
            assert set(generation.versions) == {1}
            await engine.load_weights(str(tmp_path / "v2"), 2)
            found["v2"] = _close(await engine.score(PROBE, 1), _reference(ref2, PROBE))
            assert engine.stats()["lora"] == "adapter" and engine.version == 2
            # a broken adapter: its config says rank 8, its weights are rank 4
            broken = tmp_path / "broken"
            broken.mkdir()
            (broken / "adapter_model.safetensors").write_bytes((tmp_path / "v2" / "adapter_model.safetensors").read_bytes())
            config = json.loads((tmp_path / "v2" / "adapter_config.json").read_text())
            (broken / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
            with pytest.raises(EngineError, match="differs from the adapter|does not fit"):
                await engine.load_weights(str(broken), 3)
            assert engine.version == 2
            found["v2_after_refusal"] = _close(await engine.score(PROBE, 1), _reference(ref2, PROBE))
            with pytest.raises(EngineError, match="not a LoRA adapter folder"):
                (tmp_path / "half").mkdir()
                (tmp_path / "half" / "adapter_config.json").write_text(json.dumps(config))
                await engine.load_weights(str(tmp_path / "half"), 3)
            # full weights, then an adapter again: applied to the base, not to the full weights
            await engine.load_weights(str(tiny_model_dir), 3)
            assert engine.stats()["lora"] is None
            await engine.load_weights(str(tmp_path / "v1"), 4)
            found["v1_again"] = _close(await engine.score(PROBE, 1), _reference(ref1, PROBE))
            with pytest.raises(EngineError, match="start"):
                await engine.score(PROBE, 0)
            return found
        finally:
            await engine.close()

    found = asyncio.run(go())
    assert all(diff < 1e-4 for diff in found.values()), found
    assert _close(_reference(ref1, PROBE), _reference(base, PROBE)) > 1e-2   # the adapters do change the model


@pytest.fixture
def served(tiny_model_dir, sao_cache, tmp_path):
    server = RolloutServer(ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache), max_batch=4,
                                       allowed_weight_roots=[str(tmp_path)])).start()
    yield server
    server.stop()


def test_the_learner_pushes_its_adapter_and_the_delivery_check_passes_then_catches_an_ignored_one(
        served, tmp_path, sao_cache, monkeypatch):
    with torch.random.fork_rng():   # the adapter's A matrices: the same draw whichever tests ran before
        torch.manual_seed(0)
        learner = _learner(tmp_path, sao_cache, lora_rank=4, lora_target_modules="all-linear", policy_lr=5e-2)
    services = ServiceSet([served.url], consumer="learner", plan={}, retry_s=5.0)
    learner.step(_on_policy(learner, _recorded_batch()))
    learner.publish(services.push)
    assert services.holds == {0: 1} and services.delivery["mean"] < 1e-4, services.delivery
    status = RolloutClient(served.url, consumer="x").status()
    assert status["version"] == 1 and status["engine"]["lora"] == "adapter"

    engine = served.manager.engine

    async def ignores_adapters(model_dir: str, version: int) -> None:   # verl #7495: the version, not the weights
        engine.version = version

    monkeypatch.setattr(engine, "load_weights", ignores_adapters)
    for version in (1, 2):
        learner.step(_on_policy(learner, _recorded_batch(version=version)))
    with pytest.raises(LearnerError, match=rf"delivery check: rollout service {served.url} does not serve the "
                                           r"learner's weights version 3: .* nats per token"):
        learner.publish(services.push)


def _another_base(tiny_model_dir, sao_cache, out) -> str:
    """A published model of the embedded model's shape with other (random) weights: another base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sao_core import storage

    with torch.random.fork_rng():
        torch.manual_seed(1)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    model.save_pretrained(out / "staging")
    storage.publish_checkpoint(out / "staging", str(out / "other"), metadata={"version": 0})
    return str(out / "other")


def test_a_bf16_engine_passes_the_check_of_the_float32_learner_and_one_on_another_base_stops_the_run(
        tiny_model_dir, sao_cache, tmp_path, monkeypatch):
    """Issue 37: a bf16 engine that loaded the pushed adapter scores the chat probe within bf16 noise of the
    float32 learner (no false alarm); one that loads another base model instead stops the run, naming it."""
    server = RolloutServer(ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache), max_batch=4,
                                       allowed_weight_roots=[str(tmp_path)],
                                       engine_options={"dtype": "bfloat16"})).start()
    try:
        engine = server.manager.engine
        assert engine.model.dtype == torch.bfloat16
        with torch.random.fork_rng():
            torch.manual_seed(0)
            learner = _learner(tmp_path, sao_cache, lora_rank=4, lora_target_modules="all-linear", policy_lr=5e-2)
        services = ServiceSet([server.url], consumer="learner", plan={}, retry_s=5.0)
        for version in (0, 1):
            learner.step(_on_policy(learner, _recorded_batch(version=version)))
            learner.publish(services.push)
            assert services.holds == {0: version + 1}
            assert 0 < services.delivery["mean"] < learner.config.delivery_tolerance / 10, services.delivery

        other, load = _another_base(tiny_model_dir, sao_cache, tmp_path), engine.load_weights

        async def loads_another_base(model_dir: str, version: int) -> None:
            await load(other, version)

        monkeypatch.setattr(engine, "load_weights", loads_another_base)
        learner.step(_on_policy(learner, _recorded_batch(version=2)))
        with pytest.raises(LearnerError, match=rf"delivery check: rollout service {server.url} does not serve the "
                                               r"learner's weights version 3: .* nats per token"):
            learner.publish(services.push)
    finally:
        server.stop()


def test_the_score_endpoint_refuses_bad_requests_with_4xx(served):
    client = RolloutClient(served.url, consumer="x")
    assert len(client.score(PROBE, 1)["logprobs"]) == len(PROBE) - 1
    for ids, start, message in ((PROBE, len(PROBE), "start"), ([10**9, 1], 1, "out of range"),
                                ([1], 1, "422|400"), (PROBE, 0, "422|400")):
        with pytest.raises(RolloutRequestError, match=message):
            client.score(ids, start)


def test_a_run_that_publishes_adapters_gives_its_vllm_rollout_services_the_rank(tmp_path):
    """vLLM takes adapters only up to the max_lora_rank it was started with: the colocated service and the
    TrainJob's replicas get the run's lora_rank (not when the run publishes merged weights, nor for hf)."""
    from test_cluster_launcher import config as launch_config

    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import colocated_serve_config

    def serve(**kw):
        return colocated_serve_config(RLConfig(data="d", output=str(tmp_path / "out"), engine="vllm", **kw))

    assert serve(lora_rank=8).engine_options["max_lora_rank"] == 8
    assert "max_lora_rank" not in serve(lora_rank=8, lora_publish="merged").engine_options
    assert "max_lora_rank" not in serve().engine_options
    assert serve(lora_rank=8, rollout_options={"engine_options": {"max_lora_rank": 32}}).engine_options == \
        {"max_lora_rank": 32}
    assert launch_config(engine="vllm", rl_options={"lora_rank": 16}).run_engine_options()["max_lora_rank"] == 16
    assert "max_lora_rank" not in launch_config(engine="vllm").run_engine_options()
    assert "max_lora_rank" not in launch_config(engine="hf", rl_options={"lora_rank": 16}).run_engine_options()
