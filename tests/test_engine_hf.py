"""The HF engine's KV cache: exact log-probs, identical samples to re-encoding, prefix reuse across turns,
weight swaps mid-generation, unsupported architectures."""

from __future__ import annotations

import asyncio

import pytest
import torch

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
        params = SamplingParams(max_new_tokens=24)
        limits = EpisodeLimits(max_total_tokens=600, max_new_tokens_per_turn=24)
        runs = [run_episode(t, ToolArithEnv(fixed_turns=True, seed=i), engine, engine.tokenizer, params, limits,
                            sample_index=0) for i, t in enumerate(tasks)]
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
    # Same seeds, same weights: the same tokens, log-probs equal within float noise.
    for a, b in zip(cached, plain, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.rollout_logprobs, b.rollout_logprobs, strict=True)) < 1e-4
    model = load_model(str(warm_tool_model), sao_cache)
    assert _worst_logprob_error(model, cached) < 1e-4
    # Every turn after the first reused the previous turn's cache: the prefill encoded only the new
    # tokens (tool reply and turn header), far fewer than the positions re-encoding needs.
    later_turns = sum(t.num_turns - 1 for t in cached)
    assert stats["prefix_reused_tokens"] > 0 and later_turns > 0
    total = sum(len(t.token_ids) for t in cached)
    assert stats["positions_encoded"] <= total
    assert plain_stats["positions_encoded"] > 5 * stats["positions_encoded"]


def test_weight_swap_drops_the_old_cache(tiny_model_dir, sao_cache, tmp_path):
    """Tokens sampled after a swap carry the new version and the new model's log-prob given the full
    context: the keys / values of the old weights are not reused."""
    from sao_core.models import load_model

    new_dir = tmp_path / "v1"
    changed = load_model(str(tiny_model_dir), sao_cache)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    changed.save_pretrained(new_dir)
    from sao_core.models import load_tokenizer
    load_tokenizer(str(tiny_model_dir), sao_cache).save_pretrained(new_dir)

    async def go():
        engine = HFEngine(str(tiny_model_dir), str(sao_cache), seed=5)
        prompt = engine.tokenizer.encode("Compute 12 + 30 with the tool.")
        params = SamplingParams(max_new_tokens=60, stop_token_ids=(-1,))
        jobs = [asyncio.ensure_future(engine.generate(prompt, params)) for _ in range(3)]
        while engine.stats()["tokens_generated"] < 15:
            await asyncio.sleep(0.005)
        await engine.load_weights(str(new_dir), 1)
        out = await asyncio.gather(*jobs)
        await engine.close()
        return prompt, out

    prompt, generations = asyncio.run(go())
    old = load_model(str(tiny_model_dir), sao_cache)
    new = load_model(str(new_dir), sao_cache)
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
