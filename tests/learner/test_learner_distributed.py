"""The learner under torchrun (FSDP2 over gloo, 2 processes): one data-parallel step equals the
single-process step on the same batch, and `sao train-rl` runs, checkpoints and resumes across world sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rl_data import tool_arith_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)

from sao_core import storage

WORKER = Path(__file__).parents[1] / "scripts" / "learner_step_worker.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _env(sao_cache) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "SAO_CACHE_DIR": str(sao_cache)}


@pytest.mark.slow
def test_two_rank_step_equals_the_single_process_step(tmp_path, tiny_model_dir, sao_cache):
    """Two learner steps of SAO (critic + DIS, whitened advantages) and GRPO+DIS on a fixed batch whose two
    halves hold 114 and 18 action tokens: grad norms, losses, DIS fractions and the updated weights agree
    with one process. A per-rank token mean averaged over ranks would give a different gradient."""
    for name, prefix in (("one", []), ("two", TORCHRUN)):
        cmd = [*(prefix or [sys.executable]), str(WORKER), tiny_model_dir, str(tmp_path / f"{name}.json"),
               str(tmp_path / f"{name}.pt")]
        done = subprocess.run(cmd, env=_env(sao_cache), capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
    one, two = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert set(one["metrics"]) == set(two["metrics"]) == {"sao/0", "sao/1", "grpo_dis/0", "grpo_dis/1"}
    for key, metrics in one["metrics"].items():
        assert metrics["policy_grad_norm"] > 0.5 and metrics["policy_kept"] > 0.5  # a real update happened
        for name, value in metrics.items():
            if name == "explained_variance":  # documented: token-weighted mean of per-rank values
                continue
            assert two["metrics"][key][name] == pytest.approx(value, rel=1e-4, abs=1e-6), (key, name)
    w1, w2 = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    for group in ("sao", "grpo_dis", "critic"):
        assert set(w1[group]) == set(w2[group])
        for name in w1[group]:
            torch.testing.assert_close(w2[group][name], w1[group][name], rtol=0, atol=2e-5)


@pytest.mark.slow
def test_torchrun_learner_runs_checkpoints_and_resumes(tmp_path, tiny_model_dir, sao_cache):
    """`sao train-rl` under torchrun with the colocated rollout service on rank 0, the policy a LoRA adapter
    (FSDP2 shards the wrapped model; each version is pushed as the adapter, gathered from the shards, and
    passes the delivery check): 4 SAO steps with a checkpoint at step 2, then a resume in one process to
    step 6 (checkpoints hold full tensors — the adapter's and the critic's — so they do not depend on the
    world size). No trajectory is trained twice; the exported model (merged) loads. The full-weight path
    under torchrun: test_trainer's FSDP2 run and the step equality above."""
    from transformers import AutoModelForCausalLM

    tool_arith_rl(tmp_path / "rl", 300, seed=3, p_more=1.0)
    out = tmp_path / "run"
    args = ["-m", "sao_core.cli", "--quiet", "--log-level", "WARNING", "train-rl", "--method", "sao",
            "--data", str(tmp_path / "rl"), "--output", str(out), "--model", tiny_model_dir, "--batch-size", "8",
            "--critic-warmup-steps", "1", "--checkpoint-every", "2", "--max-new-tokens-per-turn", "32",
            "--max-total-tokens", "160", "--policy-lr", "1e-3", "--critic-lr", "1e-3", "--lora-rank", "4",
            "--lora-target-modules", "all-linear"]

    def launch(prefix: list[str], *extra: str) -> dict:
        done = subprocess.run([*prefix, *args, *extra], env=_env(sao_cache), capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout[done.stdout.index("{"):])  # only rank 0 prints

    first = launch(TORCHRUN, "--steps", "4")
    assert first["world_size"] == 2 and first["steps"] == 4 and first["version"] == 3
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["world_size"] for m in metrics] == [2] * 4
    assert all(m["action_tokens"] > 0 for m in metrics) and metrics[0].get("critic_warmup") == 1.0
    pushed = [m for m in metrics if "delivery_logp_diff_mean" in m]
    assert pushed and all(m["delivery_logp_diff_mean"] < 1e-4 for m in pushed)
    assert (out / "weights" / "v000003" / "adapter_model.safetensors").exists()
    assert storage.read_manifest(str(out / "checkpoints" / "step-000002"))["metadata"]["adapter_only"] == ["policy"]
    assert storage.verify_checkpoint(str(out / "checkpoints" / "step-000002"))
    second = launch([sys.executable], "--steps", "6", "--resume")
    assert second["world_size"] == 1 and second["resumed_from"].endswith("step-000004")
    assert second["steps"] == 6 and second["version"] == 5
    ids = [i for step in range(1, 7)
           for i in json.loads((out / "journal" / f"step-{step:06d}.json").read_text())["ids"]]
    assert len(ids) == 48 and len(set(ids)) == 48
    model = AutoModelForCausalLM.from_pretrained(out / "model")
    assert storage.read_manifest(str(out / "model"))["metadata"]["version"] == 5
    assert model.config.vocab_size == 512
