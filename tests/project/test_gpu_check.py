"""bench/gpu_check.py, the GPU check kit: its --smoke run (every phase on CPU, tiny model) writes the JSON the
GPU run writes, with every phase ok; it runs without the project's other dependencies (what the GPU machine
lacks); without CUDA and without --smoke it exits 2. The GPU run itself needs a CUDA machine."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"
PHASES = ("build", "engine", "learner", "learner_fsdp", "learner_lora", "learner_lora_critic", "sft", "sft_lora",
          "push")
TOP_KEYS = ("kit", "format", "smoke", "ok", "device", "python", "torch_version", "transformers_version",
            "model_loader", "config_name", "model", "precision", "engine_dtype", "activation_checkpointing",
            "peak_tflops", "settings", "phases", "mfu", "mfu_formula", "logp_diff_max", "logp_diff_mean",
            "batch_source", "errors", "total_seconds", "budget_s", "peft_version", "ratios")
PHASE_KEYS = ("ok", "skipped", "seconds", "tokens", "tokens_per_s", "peak_gpu_gb", "error", "wall_seconds")
# What the GPU machine does not have: the project's dependencies other than torch, transformers, safetensors,
# tokenizers, peft and its accelerate (top-level module names; the image's package list is in the device
# tool's KINDS.md). Blocked as `sys.modules[name] = None`, so that importing them fails
# and importlib.util.find_spec reports them missing (transformers' optional-package checks).
NOT_ON_THE_GPU_MACHINE = ("kfp", "kubernetes", "boto3", "botocore", "datasets", "pyarrow", "math_verify", "fastapi",
                          "uvicorn", "starlette", "prometheus_client", "httpx", "vllm", "gguf", "moto",
                          "jsonschema", "xxhash")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_WAIT_POLICY="PASSIVE", PYTHONPATH="")
    return env


def _check_smoke_report(report: dict) -> None:
    for key in TOP_KEYS:
        assert key in report, key
    assert report["smoke"] is True and report["ok"] is True and report["errors"] == {}
    assert report["precision"] == "float32" and report["engine_dtype"] == "float32"
    assert report["batch_source"] == "engine"
    settings = report["settings"]
    for name in PHASES:
        phase = report["phases"][name]
        for key in PHASE_KEYS:
            assert key in phase, (name, key)
        assert phase["ok"] is True and phase["skipped"] is False and phase["error"] is None, (name, phase)
    engine = report["phases"]["engine"]
    assert engine["tokens"] == settings["sequences"] * settings["new_tokens"] and engine["tokens_per_s"] > 0
    assert engine["finish_reasons"] == {"length": settings["sequences"]} and engine["kv_cache"] is True
    for name in ("learner", "learner_fsdp", "learner_lora", "learner_lora_critic"):
        phase = report["phases"][name]
        assert phase["tokens"] == settings["learner_sequences"] * settings["learner_seq_tokens"]
        assert phase["tokens_per_s"] > 0 and 0 < report["mfu"][name] == phase["mfu"] < 1
        assert phase["policy_changed"] is True and len(phase["step_seconds"]) == settings["learner_steps"]
        # the learner's own comparison with the rollout log-probs, before its first update
        assert phase["metrics"]["logp_diff_max"] < 1e-3
    assert report["phases"]["learner_fsdp"]["fsdp2"] == {"world_size": 1, "backend": "gloo"}
    # float32 engine vs float32 learner: the same numbers up to summation order (bf16 on the GPU: ~1e-2)
    assert math.isfinite(report["logp_diff_max"]) and 0 <= report["logp_diff_mean"] <= report["logp_diff_max"] < 1e-3
    assert report["model"]["model_type"] == "qwen3" and report["model"]["params"] > 0
    # LoRA (issue 29): the adapter is a small part of the model; the SFT steps lower the loss; every push is
    # delivered (the engine's probe log-probs equal the learner's) and the adapter is smaller than the model
    lora = report["phases"]["learner_lora"]["lora"]
    assert lora["rank"] == settings["lora_rank"] and 0 < lora["trainable_parameters"] < lora["parameters"] / 4
    for name in ("sft", "sft_lora"):
        phase = report["phases"][name]
        assert phase["tokens"] == settings["learner_sequences"] * settings["learner_seq_tokens"]
        assert phase["losses"][-1] < phase["losses"][0]
    assert report["phases"]["sft_lora"]["optimizer_state_elements"] < report["phases"]["sft"]["optimizer_state_elements"] / 4
    push = report["phases"]["push"]
    for mode in ("adapter", "adapter_again", "full", "memory"):
        assert push[mode]["probe_diff_mean"] < 1e-5 and push[mode]["bytes"] > 0, (mode, push[mode])
    ratios = report["ratios"]
    assert ratios["push_bytes_full_over_adapter"] > 5 and ratios["push_seconds_files_over_memory"] > 0
    assert {"step_seconds_learner_over_learner_lora", "step_seconds_sft_over_sft_lora",
            "step_seconds_learner_lora_over_learner_lora_critic"} <= set(ratios)
    assert report["phases"]["learner_lora_critic"]["critic_trainable_parameters"] > 0


def test_smoke_run_needs_only_torch_transformers_safetensors_tokenizers_and_writes_every_key(tmp_path):
    """One smoke run, in the GPU machine's environment (the packages it lacks made unimportable): every phase ok,
    every key written, the real loaders used, its model dir removed. (It was two runs, one without the packages
    blocked; this one covers both claims.)"""
    out = tmp_path / "gpu_check.json"
    code = ("import runpy, sys\n"
            f"for name in {NOT_ON_THE_GPU_MACHINE!r}:\n"
            "    sys.modules[name] = None\n"
            f"sys.argv = [{str(SCRIPT)!r}, '--smoke', '--out', {str(out)!r}, '--workdir', {str(tmp_path)!r}]\n"
            f"runpy.run_path({str(SCRIPT)!r}, run_name='__main__')\n")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=240)
    assert run.returncode == 0, run.stderr[-4000:]
    report = json.loads(out.read_text())
    _check_smoke_report(report)
    assert report["model_loader"] == "sao_core.models"      # the real loaders, without boto3 and the rest
    assert "learner_fsdp: ok" in run.stderr and "done in" in run.stderr
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("gpu_check-")]   # its model dir is removed


def _import_gpu_check(monkeypatch):
    """The script as a module (its main and helpers, in this process)."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    environ = dict(os.environ)
    try:
        import gpu_check
    finally:   # the script sets a few environment defaults at import
        os.environ.clear()
        os.environ.update(environ)
    return gpu_check


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_and_without_smoke_it_exits_2_with_a_message(tmp_path, monkeypatch, capsys):
    """Its main in this process (the script's `sys.exit(main())` makes the return its exit code; the command line
    itself runs in the smoke test above)."""
    out = tmp_path / "gpu_check.json"
    assert _import_gpu_check(monkeypatch).main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device" in err and "--smoke" in err
    assert json.loads(out.read_text())["ok"] is False


def test_model_flops_of_a_step(monkeypatch):
    gpu_check = _import_gpu_check(monkeypatch)
    shape = {"non_embedding_params": 1000, "layers": 2, "q_dim": 8, "vocab_size": 50, "hidden_size": 4}
    # per token forward: 2 * 1000 + 2 * 2 * 10 * 8 = 2320; output layer 2 * 50 * 4 = 400 on the 6 sampled tokens
    assert gpu_check.step_flops(shape, tokens=10, action_tokens=6, seq_len=10, critic_updates=2) == \
        3 * (10 * 2320 + 6 * 400) + 7 * 10 * 2320
