"""The HF engine's KV cache: exact log-probs, identical samples to re-encoding, prefix reuse across turns,
weight swaps mid-generation, unsupported architectures."""

from __future__ import annotations

import asyncio

import pytest
import torch

from sao_core import storage
from sao_core.envs.tool_arith import ToolArithEnv, tool_arith_tasks
from sao_core.objectives.common import token_logprobs
from sao_core.rollout.engines.base import EngineError, SamplingParams
from sao_core.rollout.engines.hf import HFEngine, _cache_shape
from sao_core.rollout.episode import EpisodeLimits, run_episode


def _episodes(model_dir, cache, count: int, **engine_options):
    """`count` fixed-turn tool_arith episodes (2-6 turns) run concurrently; (trajectories, engine stats)."""
    async def go():
        engine = HFEngine(str(model_dir), str(cache), seed=3, **engine_options)
        tasks = tool_arith_tasks(count, seed=11, p_more=0.4, max_ops=5)
        limits = EpisodeLimits(max_total_tokens=600, max_new_tokens_per_turn=24)
        # A seed per episode: engine-assigned seeds follow the order in which turns arrive, which the
        # environment threads make vary from run to run.
        runs = [run_episode(t, ToolArithEnv(fixed_turns=True, seed=i), engine, engine.tokenizer,
                            SamplingParams(max_new_tokens=24, seed=100 + i), limits, sample_index=0)
                for i, t in enumerate(tasks)]
        trajectories = await asyncio.gather(*runs)
        stats = engine.stats()
        await engine.close()
        return trajectories, stats
    return asyncio.run(go())


def _worst_logprob_error(model, trajectories) -> float:
    worst = 0.0
    for t in trajectories:
        ids = torch.tensor([t.token_ids])
        with torch.no_grad():
            recomputed = token_logprobs(model(input_ids=ids).logits, ids)[0]
        mask = torch.tensor(t.action_mask, dtype=torch.bool)
        worst = max(worst, float((recomputed[mask] - torch.tensor(t.rollout_logprobs)[mask]).abs().max()))
    return worst


def test_kv_cache_samples_what_reencoding_samples_and_reuses_turns(warm_tool_model, sao_cache):
    from sao_core.models import load_model

    cached, stats = _episodes(warm_tool_model, sao_cache, 12, max_batch=5)
    plain, plain_stats = _episodes(warm_tool_model, sao_cache, 12, max_batch=5, kv_cache=False)
    assert stats["kv_cache"] and not plain_stats["kv_cache"]
    assert max(t.num_turns for t in cached) >= 3
    # Same seeds, same weights: the same tokens, log-probs equal within float noise. (A draw within float
    # noise of a boundary of the cumulative distribution could pick the neighbouring token: one episode of
    # twelve may part ways, but not before its log-probs agreed.)
    parted = 0
    for a, b in zip(cached, plain, strict=True):
        same = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids, strict=False)) if x != y),
                    min(len(a.token_ids), len(b.token_ids)))
        parted += a.token_ids != b.token_ids
        assert max((abs(x - y) for x, y in zip(a.rollout_logprobs[:same], b.rollout_logprobs[:same], strict=True)),
                   default=0.0) < 1e-4
    assert parted <= 1
    model = load_model(str(warm_tool_model), sao_cache)
    assert _worst_logprob_error(model, cached) < 1e-4
    # Every turn after the first reused the previous turn's cache: the prefill encoded only the new
    # tokens (tool reply and turn header), far fewer than the positions re-encoding needs.
    later_turns = sum(t.num_turns - 1 for t in cached)
    assert stats["prefix_reused_tokens"] > 0 and later_turns > 0
    total = sum(len(t.token_ids) for t in cached)
    assert stats["positions_encoded"] <= total
    # The engine sampled exactly the tokens it delivered (a finished request never takes another step).
    assert stats["tokens_generated"] == sum(t.num_action_tokens for t in cached)
    assert plain_stats["positions_encoded"] > 5 * stats["positions_encoded"]


def _swap_mid_generation(model_dir, new_dir, cache, **engine_options):
    """Three requests; new weights (version 1) loaded after 15 sampled tokens. Returns (prompt, generations)."""
    async def go():
        engine = HFEngine(str(model_dir), str(cache), seed=5, **engine_options)
        prompt = engine.tokenizer.encode("Compute 12 + 30 with the tool.")
        params = SamplingParams(max_new_tokens=60, stop_token_ids=(-1,))
        jobs = [asyncio.ensure_future(engine.generate(prompt, params)) for _ in range(3)]
        while engine.stats()["tokens_generated"] < 15:
            await asyncio.sleep(0.005)
        await engine.load_weights(str(new_dir), 1)
        out = await asyncio.gather(*jobs)
        await engine.close()
        return prompt, out
    return asyncio.run(go())


@pytest.fixture(scope="module")
def changed_weights(tiny_model_dir, sao_cache, tmp_path_factory):
    from sao_core.models import load_model, load_tokenizer

    new_dir = tmp_path_factory.mktemp("v1")
    changed = load_model(str(tiny_model_dir), sao_cache)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p, generator=torch.Generator().manual_seed(0)) * 0.05)
    changed.save_pretrained(new_dir)
    load_tokenizer(str(tiny_model_dir), sao_cache).save_pretrained(new_dir)
    storage.seal_checkpoint(new_dir)   # a manifest, as the learner's published weights have
    return new_dir


def test_weight_swap_keeps_caches_and_records_the_sampling_probabilities(tiny_model_dir, sao_cache, changed_weights):
    """Default: caches survive a swap (as vLLM keeps in-flight KV). A token sampled after the swap carries the
    new version and the log-prob it was sampled with: the new weights over the old weights' keys / values of
    the positions encoded before the swap (reference: the old model encodes those positions, the new model
    continues from its cache)."""
    from sao_core.models import load_model

    prompt, generations = _swap_mid_generation(tiny_model_dir, changed_weights, sao_cache)
    old = load_model(str(tiny_model_dir), sao_cache)
    new = load_model(str(changed_weights), sao_cache)
    for g in generations:
        assert 0 in g.versions and 1 in g.versions and g.versions == sorted(g.versions)
        before = g.versions.count(0)
        # Encoded under the old weights: the prompt and the tokens fed before the swap (all but the last
        # token sampled before it, which the first step after the swap feeds).
        split = len(prompt) + before - 1
        ids = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            past = old(input_ids=ids[:, :split], use_cache=True).past_key_values
            logits = new(input_ids=ids[:, split:], past_key_values=past, use_cache=True,
                         position_ids=torch.arange(split, ids.shape[1]).unsqueeze(0)).logits
            lp_old = token_logprobs(old(input_ids=ids).logits, ids)[0, len(prompt):]
        # logits[:, i] predicts token split + i + 1.
        lp_new = torch.log_softmax(logits[0, :-1].float(), -1).gather(1, ids[0, split + 1:].unsqueeze(1)).squeeze(1)
        recorded = torch.tensor(g.logprobs)
        assert float((recorded[:before] - lp_old[:before]).abs().max()) < 1e-4
        assert float((recorded[before:] - lp_new).abs().max()) < 1e-4
        # ... which is not what the new weights give over the full context (the caches were kept).
        with torch.no_grad():
            full_new = token_logprobs(new(input_ids=ids).logits, ids)[0, len(prompt):]
        assert float((recorded[before:] - full_new[before:]).abs().max()) > 1e-3


def test_weight_swap_with_recompute_drops_the_old_cache(tiny_model_dir, sao_cache, changed_weights):
    """recompute_kv_on_update: tokens sampled after a swap carry the new model's log-prob given the full
    context: the keys / values of the old weights are not reused."""
    from sao_core.models import load_model

    prompt, generations = _swap_mid_generation(tiny_model_dir, changed_weights, sao_cache,
                                               recompute_kv_on_update=True)
    old = load_model(str(tiny_model_dir), sao_cache)
    new = load_model(str(changed_weights), sao_cache)
    for g in generations:
        assert 0 in g.versions and 1 in g.versions and g.versions == sorted(g.versions)
        ids = torch.tensor([prompt + g.token_ids])
        with torch.no_grad():
            lp_old = token_logprobs(old(input_ids=ids).logits, ids)[0, len(prompt):]
            lp_new = token_logprobs(new(input_ids=ids).logits, ids)[0, len(prompt):]
        expected = torch.where(torch.tensor(g.versions) == 1, lp_new, lp_old)
        assert float((expected - torch.tensor(g.logprobs)).abs().max()) < 1e-4


def test_more_requests_than_the_batch_and_cancellation(tiny_model_dir, sao_cache):
    async def go():
        engine = HFEngine(str(tiny_model_dir), str(sao_cache), max_batch=3, prefix_cache_entries=2)
        prompt = engine.tokenizer.encode("Compute 1 + 2")
        params = SamplingParams(max_new_tokens=8, stop_token_ids=(-1,))
        jobs = [asyncio.ensure_future(engine.generate(prompt[: 3 + i], params)) for i in range(7)]
        await asyncio.sleep(0.01)
        jobs[0].cancel()
        done = await asyncio.gather(*jobs[1:])
        stats = engine.stats()
        await engine.close()
        return done, stats

    done, stats = asyncio.run(go())
    assert len(done) == 6
    # The untrained model may sample its end-of-turn token early; otherwise a request runs to its budget.
    assert all(g.finish_reason == "length" and len(g.token_ids) == 8 or g.finish_reason == "stop" for g in done)
    assert stats["active"] == 0


def test_bad_engine_settings_and_unsupported_architectures(tiny_model_dir, sao_cache):
    with pytest.raises(EngineError, match="max_batch"):
        HFEngine(str(tiny_model_dir), str(sao_cache), max_batch=0)
    with pytest.raises(EngineError, match="prefix_cache_entries"):
        HFEngine(str(tiny_model_dir), str(sao_cache), prefix_cache_entries=-1)
    from transformers import LlamaConfig, MistralConfig

    class Holder:
        def __init__(self, config):
            self.config = config

    llama = _cache_shape(Holder(LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                            num_hidden_layers=3)))
    assert (llama.layers, llama.kv_heads, llama.head_dim) == (3, 2, 16)
    assert _cache_shape(Holder(MistralConfig(sliding_window=128))) is None


def test_kv_cache_with_eager_attention_matches_recomputation(warm_tool_model, sao_cache):
    """Models that do not use SDPA attention get the engine's mask as additive scores: log-probs still equal
    a recomputation."""
    from sao_core.models import load_model

    async def go():
        engine = HFEngine(str(warm_tool_model), str(sao_cache), seed=3, max_batch=4)
        engine.model.set_attn_implementation("eager")
        tasks = tool_arith_tasks(4, seed=13, p_more=0.5, max_ops=3)
        limits = EpisodeLimits(max_total_tokens=400, max_new_tokens_per_turn=24)
        runs = [run_episode(t, ToolArithEnv(fixed_turns=True, seed=i), engine, engine.tokenizer,
                            SamplingParams(max_new_tokens=24, seed=200 + i), limits) for i, t in enumerate(tasks)]
        trajectories = await asyncio.gather(*runs)
        await engine.close()
        return trajectories

    trajectories = asyncio.run(go())
    assert max(t.num_turns for t in trajectories) >= 2
    assert _worst_logprob_error(load_model(str(warm_tool_model), sao_cache), trajectories) < 1e-4
