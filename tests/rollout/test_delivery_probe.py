"""The delivery check's probe (issue 37): a fixed chat exchange through the tokenizer's chat template, its first
`delivery_check_tokens` assistant tokens scored, the same ids in every process; the learner scores it as it
trains; a bf16 engine that got the weights passes against the float32 learner (no false alarm: random ids,
the probe before, differed by 0.29 nats/token on SmolLM2 in bf16), one that serves other weights does not;
`bench/delivery_probe.py` (the measurements behind `delivery_tolerance`) runs."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from test_learner_parts import _learner

from sao_core.learner.config import RLConfig
from sao_core.learner.delivery import PROBE_ANSWER, Probe, chat_probe, compare, learner_logprobs
from sao_core.learner.errors import LearnerError
from sao_core.models import load_tokenizer


def _ids(encoded) -> list[int]:
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_the_probe_is_the_chat_template_of_the_built_in_exchange_cut_after_its_first_assistant_tokens(
        tiny_model_dir, sao_cache):
    tokenizer = load_tokenizer(str(tiny_model_dir), sao_cache)
    ids, start = chat_probe(tokenizer, 32)
    assert len(ids) == start + 32
    user = [{"role": "user", "content": "What is the sum of the first ten positive whole numbers? Is there a "
                                        "quick way to find it?"}]
    prompt = _ids(tokenizer.apply_chat_template(user, tokenize=True, add_generation_prompt=True))
    assert ids[:start] == prompt and tokenizer.decode(prompt).endswith("<|im_start|>assistant\n")
    assert PROBE_ANSWER.startswith(tokenizer.decode(ids[start:]))    # the answer's first 32 tokens
    # deterministic: the same ids every call and from a tokenizer loaded again (another process of the run)
    assert chat_probe(load_tokenizer(str(tiny_model_dir), sao_cache), 32) == (ids, start)
    # longer than the exchange: the whole conversation again, then cut
    whole = _ids(tokenizer.apply_chat_template(user + [{"role": "assistant", "content": PROBE_ANSWER}],
                                               tokenize=True))
    long_ids, long_start = chat_probe(tokenizer, len(whole) + 10)
    assert long_start == start and len(long_ids) == start + len(whole) + 10
    assert long_ids[:len(whole)] == whole and long_ids[len(whole):2 * len(whole)] == whole[:len(long_ids) - len(whole)]
    with pytest.raises(ValueError, match=">= 1"):
        chat_probe(tokenizer, 0)


def test_without_a_chat_template_the_probe_is_plain_text_scored_from_the_answer(tiny_model_dir, sao_cache):
    tokenizer = load_tokenizer(str(tiny_model_dir), sao_cache)
    tokenizer.chat_template = None
    ids, start = chat_probe(tokenizer, 16)
    assert len(ids) == start + 16
    assert tokenizer.decode(ids[:start]).startswith("User: What is the sum")
    assert tokenizer.decode(ids[:start]).rstrip().endswith("Assistant:")
    assert "Yes, there is a quick way"[:8] in tokenizer.decode(ids[start - 2:])


def test_the_learner_scores_the_chat_probe_and_the_check_names_a_service_that_differs(tmp_path, sao_cache):
    learner = _learner(tmp_path, sao_cache)
    probe = learner.probe()
    ids, start = chat_probe(learner.tokenizer, 32)
    assert (probe.token_ids, probe.start, probe.version) == (ids, start, 0) and len(probe.logprobs) == 32
    assert probe.tolerance == RLConfig.delivery_tolerance == learner.config.delivery_tolerance
    mine = learner_logprobs(learner.policy, ids, start, torch.autocast("cpu", enabled=False), torch.device("cpu"))
    assert probe.logprobs == pytest.approx(mine, abs=1e-6)
    assert _learner(tmp_path, sao_cache, name="off", delivery_check_tokens=0).probe() is None

    answer = {"version": 0, "logprobs": [x + 0.01 for x in probe.logprobs]}
    assert compare(answer, probe, "http://a:1")["mean"] == pytest.approx(0.01)
    off = [x + (probe.tolerance * 1.5 if i % 2 else 0.0) for i, x in enumerate(probe.logprobs)]   # mean 0.75 tol
    assert compare({"version": 0, "logprobs": off}, probe, "http://a:1")["max"] == pytest.approx(probe.tolerance * 1.5)
    far = [x - 3 * probe.tolerance for x in probe.logprobs]
    with pytest.raises(LearnerError, match=r"service http://b:2 does not serve the learner's weights version 0"):
        compare({"version": 0, "logprobs": far}, probe, "http://b:2")
    with pytest.raises(LearnerError, match=r"rollout service http://b:2 scored the probe at version 1"):
        compare({"version": 1, "logprobs": probe.logprobs}, probe, "http://b:2")


def _bf16_engine_against_fp32(model_ref: str, cache) -> dict:
    """The float32 learner's chat probe ("probe") and, from a bf16 HF engine of the same model, its log-probs of
    it ("theirs"), the same once the middle layer's MLP down projection is zeroed ("corrupted": a planted fault),
    and the |engine - learner| per token on 33 random ids, the probe before ("random")."""
    from sao_core.learner.delivery import probe_tokens
    from sao_core.models import load_model_and_tokenizer
    from sao_core.rollout.engines.hf import HFEngine

    model, tokenizer = load_model_and_tokenizer(model_ref, cache)
    ids, start = chat_probe(tokenizer, 32)
    cpu, fp32 = torch.device("cpu"), torch.autocast("cpu", enabled=False)
    probe = Probe(ids, start, learner_logprobs(model.eval(), ids, start, fp32, cpu), 0,
                  RLConfig.delivery_tolerance)
    random_ids = probe_tokens(min(len(tokenizer), model.config.vocab_size), 33, 0)
    random_mine = learner_logprobs(model, random_ids, 1, fp32, cpu)
    del model

    async def go():
        engine = HFEngine(model_ref, str(cache), max_batch=2, dtype="bfloat16")
        try:
            assert engine.model.dtype == torch.bfloat16
            found = {"theirs": await engine.score(ids, start), "random": await engine.score(random_ids, 1)}
            layers = engine.model.model.layers

            def corrupt():
                with torch.no_grad():
                    layers[len(layers) // 2].mlp.down_proj.weight.zero_()

            await engine._in_engine_thread(corrupt)
            found["corrupted"] = await engine.score(ids, start)
            return found
        finally:
            await engine.close()

    found = asyncio.run(go())
    found["random"] = [abs(a - b) for a, b in zip(found["random"], random_mine, strict=True)]
    return {"probe": probe, **found}


def test_a_bf16_hf_engine_passes_the_check_of_a_float32_learner_on_the_embedded_model(tiny_model_dir, sao_cache):
    found = _bf16_engine_against_fp32(str(tiny_model_dir), sao_cache)
    probe = found["probe"]
    diff = compare({"version": 0, "logprobs": found["theirs"]}, probe, "http://bf16:1")
    assert 0 < diff["mean"] < probe.tolerance / 10, diff     # bf16 does differ; far inside the tolerance


@pytest.mark.slow
@pytest.mark.real_model
def test_a_bf16_hf_engine_passes_the_check_of_a_float32_learner_on_smollm2(tmp_path):
    """The false alarm of issue 37 (SmolLM2-135M, bf16 engine, fp32 learner): on the chat probe the check passes
    with a wide margin. (The random-id probe differed by 0.29 nats/token on an H200 and up to 0.33 on CPU.)"""
    pytest.importorskip("gguf")
    from sao_core.models import EMBEDDED_SMOLLM2, ModelLoadError, resolve_model

    try:
        resolve_model(EMBEDDED_SMOLLM2, tmp_path)
    except ModelLoadError as err:
        pytest.skip(str(err))
    found = _bf16_engine_against_fp32(EMBEDDED_SMOLLM2, tmp_path)
    probe = found["probe"]
    diff = compare({"version": 0, "logprobs": found["theirs"]}, probe, "http://bf16:1")
    assert diff["mean"] < probe.tolerance / 2, diff
    assert sum(found["random"]) / len(found["random"]) > diff["mean"]   # random ids: bf16 rounds unlikely tokens most
    with pytest.raises(LearnerError, match=r"rollout service http://bf16:1 does not serve the learner's weights"):
        compare({"version": 0, "logprobs": found["corrupted"]}, probe, "http://bf16:1")


def test_the_bench_runs(tmp_path, sao_cache, monkeypatch):
    """bench/delivery_probe.py on the embedded model, 2 pushes (the smoke run of the bench)."""
    import sys
    from pathlib import Path

    threads = torch.get_num_threads()
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    try:
        import delivery_probe

        out = tmp_path / "delivery_probe.json"
        assert delivery_probe.main(["--models", "tiny", "--pushes", "2", "--fault-every", "2", "--lora-lrs", "1e-3",
                                    "--lora-steps", "2", "--cache-dir", str(sao_cache), "--output", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())["models"]["tiny"]
    summary = result["summary"]
    assert {"stale_1", "correct/learner_fp32", "correct/learner_autocast_bf16", "never_updated",
            "another_base_random_init", "fp32_engine/learner_fp32", "lora_not_applied/lr0.001",
            "lora_applied/lr0.001"} <= set(summary)
    assert summary["correct/learner_fp32"]["chat"]["n"] == 2 and result["probes"]["chat"]["scored"] == 32
    assert summary["fp32_engine/learner_fp32"]["chat"]["max_max"] < 1e-4
    assert summary["another_base_random_init"]["chat"]["mean_min"] > 10 * summary["correct/learner_fp32"]["chat"][
        "mean_max"]
