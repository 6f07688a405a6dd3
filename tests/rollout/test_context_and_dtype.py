"""Engine defaults taken from the work they serve: the dtype rule (one function for both engines) and the
context rule (an engine's context covers the plans it serves; a run's budget fits the model's context)."""

from __future__ import annotations

import inspect
import json
import shutil
from pathlib import Path

import pytest
import torch

from sao_core import storage
from sao_core.models import check_model_context, context_length_of, model_context_length, resolve_dtype

# ------------------------------------------------------------------------------------------ dtype rule


@pytest.mark.parametrize("device, expected", [
    ("cpu", "float32"), (torch.device("cpu"), "float32"),
    ("cuda", "bfloat16"), ("cuda:1", "bfloat16"), (torch.device("cuda", 0), "bfloat16"),
    ("mps", "float32"),
])
def test_auto_dtype_is_bfloat16_on_cuda_and_float32_elsewhere(device, expected):
    assert resolve_dtype("auto", device) == expected


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
def test_explicit_dtype_is_honoured(dtype, device):
    assert resolve_dtype(dtype, device) == dtype


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unknown dtype 'float7'; use auto, float32, bfloat16, float16"):
        resolve_dtype("float7", "cpu")


def _bf16_checkpoint(src: str, dest: Path) -> str:
    """The embedded model saved in bfloat16 (its config.json says dtype bfloat16), with a manifest."""
    from sao_core.models import load_model, load_tokenizer

    load_model(src, dest.parent, "bfloat16").save_pretrained(dest)
    load_tokenizer(src, dest.parent).save_pretrained(dest)
    assert json.loads((dest / "config.json").read_text())["dtype"] == "bfloat16"
    storage.seal_checkpoint(dest)
    return str(dest)


def test_hf_engine_defaults_to_auto_float32_on_cpu_and_honours_explicit_dtypes(tiny_model_dir, tmp_path):
    import asyncio

    from sao_core.rollout.engines import EngineError
    from sao_core.rollout.engines.hf import HFEngine

    assert inspect.signature(HFEngine).parameters["dtype"].default == "auto"
    bf16_dir = _bf16_checkpoint(tiny_model_dir, tmp_path / "bf16")
    for model, dtype, expected in ((tiny_model_dir, "auto", torch.float32), (bf16_dir, "auto", torch.float32),
                                   (tiny_model_dir, "bfloat16", torch.bfloat16)):
        engine = HFEngine(model, str(tmp_path), max_batch=2, dtype=dtype)
        try:
            assert engine.model.dtype == expected and engine.stats()["dtype"] == str(expected).removeprefix("torch.")
        finally:
            asyncio.run(engine.close())
    with pytest.raises(EngineError, match="unknown dtype 'float7'"):
        HFEngine(tiny_model_dir, str(tmp_path), dtype="float7")


def test_vllm_engine_defaults_are_auto_and_the_models_context():
    from sao_core.rollout.engines.vllm import VLLMEngine

    params = inspect.signature(VLLMEngine).parameters
    assert params["dtype"].default == "auto" and params["max_model_len"].default == 0


# ------------------------------------------------------------------------------------------ model context


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 4096}, 4096),
    ({"n_positions": 1024}, 1024),                                           # GPT-2
    ({"max_position_embeddings": 8192, "seq_length": 2048}, 2048),           # the smallest stated length
    ({"text_config": {"max_position_embeddings": 32768}}, 32768),            # multimodal
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}, 16384),
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, 131072),
    ({"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, 8192),
    ({"hidden_size": 128}, None),
])
def test_context_length_of_a_config(config, expected):
    assert context_length_of(config) == expected


def _small_context_model(tiny_model_dir: str, dest: Path, positions: int) -> str:
    """The embedded model's files with max_position_embeddings = `positions` (no manifest: edited on purpose)."""
    dest.mkdir(parents=True)
    for f in Path(tiny_model_dir).iterdir():
        if f.is_file() and f.name not in ("manifest.json", "_COMPLETE"):
            shutil.copy(f, dest / f.name)
    config = json.loads((dest / "config.json").read_text())
    config["max_position_embeddings"] = positions
    (dest / "config.json").write_text(json.dumps(config))
    return str(dest)


def test_model_context_length_of_references(tiny_model_dir, sao_cache, tmp_path):
    assert model_context_length("embedded:tiny", sao_cache) == 4096
    assert model_context_length(tiny_model_dir, sao_cache) == 4096
    assert model_context_length(_small_context_model(tiny_model_dir, tmp_path / "m", 256), sao_cache) == 256
    assert model_context_length(str(tmp_path / "missing"), sao_cache) is None    # loading reports that one
    check_model_context("embedded:tiny", sao_cache, 4096)
    with pytest.raises(ValueError, match=r"max_total_tokens 4097 exceeds the context of model 'embedded:tiny': 4096 "
                                         r"tokens \(max_position_embeddings in its config.json\)"):
        check_model_context("embedded:tiny", sao_cache, 4097)


# ------------------------------------------------------------------------------------------ engine context


class _FakeEngine:
    version = 0
    tokenizer = None
    context_source = "max_model_len"

    def __init__(self, context_length):
        self.context_length = context_length


def test_manager_refuses_a_plan_above_the_engine_context_naming_both_numbers(tmp_path):
    from sao_core.rollout.manager import RolloutError, RolloutManager, RolloutPlan

    manager = RolloutManager(_FakeEngine(4096), None, str(tmp_path))
    with pytest.raises(RolloutError, match=r"^plan max_total_tokens 8192 exceeds the engine's context of 4096 tokens "
                                           r"\(max_model_len\); raise max_model_len or lower max_total_tokens$"):
        manager.start(RolloutPlan(dataset=str(tmp_path / "none"), max_total_tokens=8192))
    # within the context the plan gets past the check (and fails on the missing dataset instead)
    with pytest.raises(RolloutError, match="none"):
        manager.start(RolloutPlan(dataset=str(tmp_path / "none"), max_total_tokens=4096))


def test_hf_engine_context_is_the_models(tiny_model_dir, tmp_path):
    import asyncio

    from sao_core.rollout.engines import check_context
    from sao_core.rollout.engines.hf import HFEngine

    engine = HFEngine(_small_context_model(tiny_model_dir, tmp_path / "m", 256), str(tmp_path), max_batch=2,
                      unverified=True)   # a plain folder: --unverified
    try:
        assert engine.context_length == 256 and engine.stats()["context_length"] == 256
        check_context(engine, 256)
        with pytest.raises(ValueError, match=r"plan max_total_tokens 512 exceeds the engine's context of 256 tokens "
                                             r"\(the model's max_position_embeddings\); lower max_total_tokens"):
            check_context(engine, 512)
    finally:
        asyncio.run(engine.close())


# ------------------------------------------------------------------------------------------ runs


def _rl_config(tmp_path, **kw):
    from sao_core.learner.config import RLConfig

    return RLConfig(data=str(tmp_path / "no-data"), output=str(tmp_path / "out"), cache_dir=str(tmp_path / "cache"),
                    **kw)


def test_colocated_vllm_service_gets_the_runs_context(tmp_path):
    from sao_core.learner.loop import PROBE_CONTEXT, LearnerError, colocated_serve_config

    assert colocated_serve_config(_rl_config(tmp_path, engine="vllm", max_total_tokens=1024)).max_model_len == 1024
    assert colocated_serve_config(_rl_config(tmp_path, engine="vllm")).max_model_len == 4096  # the default budget
    chosen = _rl_config(tmp_path, engine="vllm", max_total_tokens=1024, rollout_options={"max_model_len": 2048})
    assert colocated_serve_config(chosen).max_model_len == 2048
    assert colocated_serve_config(_rl_config(tmp_path, max_total_tokens=1024)).max_model_len == 0  # hf: the model's
    # a budget shorter than the delivery probe: the context still holds the probe (its prompt and scored tokens)
    small = _rl_config(tmp_path, engine="vllm", max_total_tokens=80, delivery_check_tokens=32)
    assert colocated_serve_config(small).max_model_len == PROBE_CONTEXT + 32
    short = _rl_config(tmp_path, engine="vllm", max_total_tokens=2048, rollout_options={"max_model_len": 1024})
    with pytest.raises(LearnerError, match=r"max_total_tokens 2048 exceeds the rollout engine's context of 1024 "
                                           r"tokens \(rollout_options max_model_len\)"):
        colocated_serve_config(short)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_train_rl_refuses_a_budget_above_the_models_context_before_any_engine(tmp_path, tiny_model_dir, engine,
                                                                             monkeypatch):
    from sao_core.learner.loop import LearnerError, train_rl
    from sao_core.rollout import server

    def no_engine(*args, **kwargs):
        raise AssertionError("no rollout service may start")

    monkeypatch.setattr(server.RolloutServer, "start", no_engine)
    model = _small_context_model(tiny_model_dir, tmp_path / "m", 256)
    with pytest.raises(LearnerError, match=rf"max_total_tokens 512 exceeds the context of model '{model}': 256 tokens "
                                           r"\(max_position_embeddings in its config.json\); lower max_total_tokens"):
        train_rl(_rl_config(tmp_path, model=model, engine=engine, max_total_tokens=512))
    with pytest.raises(LearnerError, match="max_total_tokens 8192 exceeds the context of model 'embedded:tiny': 4096"):
        train_rl(_rl_config(tmp_path, max_total_tokens=8192))
    # With external services (nothing listens there): refused before any model is loaded or service called.
    with pytest.raises(LearnerError, match="max_total_tokens 512 exceeds the context of model"):
        train_rl(_rl_config(tmp_path, model=model, engine=engine, max_total_tokens=512,
                            services=("http://127.0.0.1:9",)))


def _eval_config(tmp_path, **kw):
    from sao_core.eval.config import EvalConfig

    return EvalConfig(**{"model": "embedded:tiny", "output": str(tmp_path / "run"), "benchmarks": ["imo_answerbench"],
                         "k": 1, "limit": 1, "max_new_tokens": 8, "cache_dir": str(tmp_path / "cache"), **kw})


def test_evaluation_refuses_a_budget_above_the_context_before_any_engine(tmp_path, monkeypatch):
    from sao_core.eval.config import EvalError
    from sao_core.eval.run import evaluate
    from sao_core.rollout import engines

    def no_engine(*args, **kwargs):
        raise AssertionError("no engine may start")

    monkeypatch.setattr(engines, "make_engine", no_engine)
    for kind in ("hf", "vllm"):   # the default budget (32768) is above the embedded model's 4096
        with pytest.raises(EvalError, match=r"max_total_tokens 32768 exceeds the context of model 'embedded:tiny': "
                                            r"4096 tokens \(max_position_embeddings in its config.json\)"):
            evaluate(_eval_config(tmp_path, engine=kind))
    with pytest.raises(EvalError, match=r"max_total_tokens 2048 exceeds the engine's context of 1024 tokens "
                                        r"\(engine_options max_model_len\); raise max_model_len"):
        evaluate(_eval_config(tmp_path, engine="vllm", max_total_tokens=2048, engine_options={"max_model_len": 1024}))
    with pytest.raises(EvalError, match=r"max_total_tokens 2048 exceeds the engine's context of 1024 tokens "
                                        r"\(max_model_len\)"):
        evaluate(_eval_config(tmp_path, max_total_tokens=2048), engine=_FakeEngine(1024))
    assert not (tmp_path / "run").exists()   # refused before any output was written


def test_evaluators_vllm_engine_gets_max_model_len_from_the_budget(tmp_path, monkeypatch):
    from sao_core.eval.run import _make_engine
    from sao_core.rollout import engines

    monkeypatch.setattr(engines, "make_engine", lambda kind, model, cache, **options: options)
    assert _make_engine(_eval_config(tmp_path, engine="vllm", max_total_tokens=1024))["max_model_len"] == 1024
    chosen = _eval_config(tmp_path, engine="vllm", max_total_tokens=1024, engine_options={"max_model_len": 3000})
    assert _make_engine(chosen)["max_model_len"] == 3000
    assert "max_model_len" not in _make_engine(_eval_config(tmp_path, max_total_tokens=1024))   # hf: the model's

