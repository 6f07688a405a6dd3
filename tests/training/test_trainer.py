"""The shared trainer: every method learns, resume is exact, bad jobs stop before training, S3 output,
and real 2-process torchrun (FSDP2, gloo) runs, full weights and LoRA, that checkpoint, resume and export."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from run_helpers import StopRun, stop_at
from safetensors.torch import load_file

from sao_core import storage
from sao_core.data.prepare import PrepareConfig, prepare
from sao_core.data.synthetic import tool_arith_problem, tool_arith_sft_rows
from sao_core.models.tokenizer_corpus import corpus_lines
from sao_core.training.config import CPTConfig, DPOConfig, GKDConfig, SFTConfig
from sao_core.training.trainer import TrainingError, train


def _prepared(root: Path, kind: str, rows: list[dict]) -> str:
    raw = root / f"{kind}-raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = root / f"{kind}-prepared"
    prepare(PrepareConfig(source=str(raw), kind=kind, output=str(out)))
    return str(out)


def _dpo_rows(count: int) -> list[dict]:
    import random

    rng = random.Random(7)
    rows = []
    for _ in range(count):
        a, op, b = tool_arith_problem(rng)
        rows.append({"prompt": f"Compute {a} {op} {b}", "chosen": f"<tool_call>calc {a} {op} {b}</tool_call>",
                     "rejected": f"The answer is \\boxed{{{rng.randint(0, 99)}}}."})
    return rows


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("datasets")
    return {
        "sft": _prepared(root, "sft", list(tool_arith_sft_rows(160, seed=11))),
        "cpt": _prepared(root, "cpt", [{"text": line} for line in corpus_lines(seed=5, num_lines=120)]),
        "dpo": _prepared(root, "dpo", _dpo_rows(120)),
    }


@pytest.fixture(scope="module")
def teacher(datasets, tmp_path_factory, sao_cache):
    out = tmp_path_factory.mktemp("teacher") / "run"
    summary = train("sft", SFTConfig(data=datasets["sft"], output=str(out), steps=60, batch_size=16, lr=3e-3,
                                     max_tokens=128, cache_dir=str(sao_cache)))
    return summary["model"]


def _common(tmp_path, sao_cache, **kw):
    return {"output": str(tmp_path / "run"), "batch_size": 8, "max_tokens": 128, "cache_dir": str(sao_cache),
            "log_every": 1, **kw}


def test_sft_learns_and_exports(datasets, tmp_path, sao_cache):
    from sao_core.models import load_model

    seen = []
    s = train("sft", SFTConfig(data=datasets["sft"], steps=20, lr=3e-3, **_common(tmp_path, sao_cache)),
              progress=lambda step, m: seen.append(step))
    assert seen == list(range(1, 21))
    assert s["eval_loss_after"] < 0.6 * s["eval_loss_before"]
    assert storage.read_manifest(s["model"])["metadata"] == {"kind": "model", "method": "sft", "step": 20,
                                                              "base_model": "embedded:tiny"}
    assert load_model(s["model"], sao_cache).config.model_type == "llama"
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 21)) and {"loss", "lr", "grad_norm", "tokens"} <= lines[0].keys()


def test_cpt_learns(datasets, tmp_path, sao_cache):
    s = train("cpt", CPTConfig(data=datasets["cpt"], steps=15, lr=3e-3, **_common(tmp_path, sao_cache)))
    assert s["eval_loss_after"] < 0.8 * s["eval_loss_before"]


def test_dpo_learns_from_ln2(datasets, tmp_path, sao_cache):
    s = train("dpo", DPOConfig(data=datasets["dpo"], steps=12, lr=3e-3, beta=0.1, **_common(tmp_path, sao_cache)))
    # The policy starts equal to its reference: every margin is 0 and the loss is ln 2.
    assert s["eval_loss_before"] == pytest.approx(0.693147, abs=1e-4)
    assert s["eval_loss_after"] < 0.5


def test_gkd_learns_from_teacher(datasets, teacher, tmp_path, sao_cache):
    s = train("gkd", GKDConfig(data=datasets["sft"], teacher_model=teacher, steps=20, lr=3e-3,
                               on_policy_fraction=0.5, max_new_tokens=8, **_common(tmp_path, sao_cache)))
    assert s["eval_loss_after"] < 0.75 * s["eval_loss_before"]


def _weights(model_uri: str) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_uri) / "model.safetensors"))


def test_resume_is_exact(datasets, tmp_path, sao_cache):
    common = dict(data=datasets["sft"], steps=8, lr=3e-3, checkpoint_every=4, schedule="cosine", warmup_steps=2)
    straight = train("sft", SFTConfig(**common, **_common(tmp_path / "a", sao_cache)))

    class Killed(Exception):
        pass

    def die_at_5(step, metrics):    # after step 5's metrics line, one step past the checkpoint
        if step == 5:
            raise Killed

    config_b = SFTConfig(**common, **_common(tmp_path / "b", sao_cache))
    with pytest.raises(Killed):
        train("sft", config_b, progress=die_at_5)
    assert storage.latest_checkpoint(str(tmp_path / "b" / "run" / "checkpoints")).endswith("step-000004")
    config_b.resume = True
    resumed = train("sft", config_b)
    assert resumed["resumed_from"].endswith("step-000004")
    a, b = _weights(straight["model"]), _weights(resumed["model"])
    assert a.keys() == b.keys()
    for key in a:
        assert torch.allclose(a[key], b[key], atol=1e-6), key
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))      # step 5, trained again, has one line (the killed run's is gone)


def _no_training_happened(output: Path) -> bool:
    return not (output / "metrics.jsonl").exists()


@pytest.mark.parametrize("case", ["unknown_method", "missing_data", "wrong_kind", "gkd_without_teacher",
                                  "batch_not_divisible", "wrong_config_type"])
def test_bad_jobs_stop_before_training(case, datasets, tmp_path, sao_cache):
    common = _common(tmp_path, sao_cache)
    method, config, message = {
        "unknown_method": ("ppo", SFTConfig(data=datasets["sft"], **common), "unknown method 'ppo'"),
        "missing_data": ("sft", SFTConfig(data=str(tmp_path / "nope"), **common), "cannot read the dataset"),
        "wrong_kind": ("sft", SFTConfig(data=datasets["cpt"], **common),
                       "needs a dataset prepared with --kind sft.*--kind cpt"),
        "gkd_without_teacher": ("gkd", GKDConfig(data=datasets["sft"], **common), "teacher_model is required"),
        "batch_not_divisible": ("sft", SFTConfig(data=datasets["sft"], grad_accum=3, **common), "multiple of"),
        "wrong_config_type": ("dpo", SFTConfig(data=datasets["dpo"], **common), "takes a DPOConfig"),
    }[case]
    with pytest.raises(TrainingError, match=message):
        train(method, config)
    assert _no_training_happened(tmp_path / "run")


def test_corrupt_checkpoint_stops_resume_and_existing_run_is_protected(datasets, tmp_path, sao_cache):
    config = SFTConfig(data=datasets["sft"], steps=2, **_common(tmp_path, sao_cache))
    train("sft", config)
    with pytest.raises(TrainingError, match="already holds checkpoints"):
        train("sft", config)
    state = tmp_path / "run" / "checkpoints" / "step-000002" / "trainer_state.json"
    state.write_text(state.read_text().replace('"cursor"', '"cursur"'))
    metrics_before = (tmp_path / "run" / "metrics.jsonl").read_text()
    config.resume, config.steps = True, 4
    with pytest.raises(TrainingError, match="trainer_state.json"):
        train("sft", config)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics_before


def test_bad_row_is_named(tmp_path, sao_cache):
    data = tmp_path / "data"
    data.mkdir()
    (data / "data.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(TrainingError, match=r"data.jsonl: row 0: no assistant tokens"):
        train("sft", SFTConfig(data=str(data), **_common(tmp_path, sao_cache)))


def test_train_to_s3(moto_s3, datasets, tmp_path, sao_cache):
    from sao_core.models import load_model

    out = moto_s3.uri("runs/sft")
    s = train("sft", SFTConfig(data=datasets["sft"], output=out, steps=2, batch_size=4, cache_dir=str(sao_cache)))
    assert s["model"] == f"{out}/model"
    assert storage.latest_checkpoint(f"{out}/checkpoints") == f"{out}/checkpoints/step-000002"
    assert json.loads(storage.read_text(f"{out}/summary.json"))["steps"] == 2
    assert load_model(s["model"], tmp_path / "fresh-cache").config.vocab_size == 512


def test_s3_metrics_reach_the_output_while_training(moto_s3, datasets, sao_cache):
    out = moto_s3.uri("runs/live")
    seen: dict[int, list[int]] = {}

    def progress(step, metrics):
        seen[step] = [json.loads(x)["step"] for x in storage.read_text(f"{out}/metrics.jsonl").splitlines()]

    train("sft", SFTConfig(data=datasets["sft"], output=out, steps=4, batch_size=4, log_every=1,
                           cache_dir=str(sao_cache)), progress=progress)
    assert seen == {k: list(range(1, k + 1)) for k in range(1, 5)}


def test_a_failing_s3_training_run_leaves_its_metrics_lines(moto_s3, datasets, tmp_path, sao_cache,
                                                            fail_metrics_sync_once, caplog):
    """The run fails at step 3 right after the sync of step 3 failed (warned about): leaving the loop syncs,
    so the 3 lines are on S3. A resume from another machine (empty cache) keeps them."""
    out = moto_s3.uri("runs/fails")
    failed = fail_metrics_sync_once(3)
    caplog.set_level(logging.WARNING, logger="sao_core.training.metrics_log")

    config = SFTConfig(data=datasets["sft"], output=out, steps=5, batch_size=4, log_every=1, checkpoint_every=3,
                       cache_dir=str(sao_cache))
    with pytest.raises(StopRun):
        train("sft", config, progress=stop_at(3))
    assert failed == [f"{out}/metrics.jsonl"] and "could not update" in caplog.text

    def steps() -> list[int]:
        return [json.loads(x)["step"] for x in storage.read_text(f"{out}/metrics.jsonl").splitlines()]

    assert steps() == [1, 2, 3]
    config.resume, config.cache_dir = True, str(tmp_path / "other-machine")
    assert train("sft", config)["resumed_from"] == f"{out}/checkpoints/step-000003"
    assert steps() == [1, 2, 3, 4, 5]


#: runs several `sao` command lines in one process (one torchrun launch serves the full-weight and the LoRA run)
CLI_RUNS_WORKER = Path(__file__).parents[1] / "scripts" / "cli_runs_worker.py"


def _printed_summaries(stdout: str) -> list[dict]:
    """The JSON summaries `sao train` printed one after the other (only rank 0 prints)."""
    decoder, summaries, at = json.JSONDecoder(), [], stdout.find("{")
    while at != -1:
        summary, end = decoder.raw_decode(stdout, at)
        summaries.append(summary)
        at = stdout.find("{", end)
    return summaries


@pytest.mark.slow
def test_torchrun_two_processes_fsdp2(datasets, tmp_path, sao_cache, tiny_model_dir):
    """`sao train` under torchrun (2 processes, FSDP2 over gloo), full weights and LoRA: each run checkpoints
    (the full-weight run's DCP checkpoint holds one shard per rank), resumes under torchrun and exports. The
    LoRA run (only the adapter trains) exports the merged model under the base names: the adapted projections
    changed, every other weight is the base's bit for bit. Each launch runs both command lines in its two
    processes (tests/scripts/cli_runs_worker.py), one after the other; this also covers what
    test_lora.py's test_lora_under_torchrun_fsdp2_two_processes_checkpoints_resumes_and_exports did."""
    from transformers import AutoModelForCausalLM

    from sao_core.models import load_model

    env = {**os.environ, "OMP_NUM_THREADS": "1", "SAO_CACHE_DIR": str(sao_cache)}
    full, lora = tmp_path / "full", tmp_path / "lora"
    common = ["--quiet", "--log-level", "WARNING", "train", "--method", "sft", "--data", datasets["sft"],
              "--batch-size", "8", "--max-tokens", "128", "--checkpoint-every", "2"]
    full_args = [*common, "--output", str(full), "--lr", "3e-3"]
    lora_args = [*common, "--output", str(lora), "--lr", "1e-2", "--lora-rank", "4", "--lora-target-modules",
                 "q_proj,v_proj", "--model", str(tiny_model_dir)]

    def launch(*extra: str) -> list[dict]:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(CLI_RUNS_WORKER), *full_args, *extra, "---", *lora_args, *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return _printed_summaries(done.stdout)

    first_full, first_lora = launch("--steps", "4")
    assert first_full["world_size"] == 2 and first_full["steps"] == 4 and first_full["lora"] is None
    shards = sorted(p.name for p in (full / "checkpoints" / "step-000004" / "dcp").iterdir())
    assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert first_lora["world_size"] == 2 and first_lora["lora"]["rank"] == 4
    assert 0 < first_lora["lora"]["trainable_parameters"] < first_lora["lora"]["parameters"] / 10

    second_full, second_lora = launch("--steps", "6", "--resume")
    assert second_full["resumed_from"].endswith("step-000004") and second_full["steps"] == 6
    model = AutoModelForCausalLM.from_pretrained(full / "model")
    assert model.config.vocab_size == 512
    assert storage.read_manifest(str(full / "model"))["metadata"]["step"] == 6

    assert second_lora["resumed_from"].endswith("step-000004") and second_lora["steps"] == 6
    assert second_lora["last_train_loss"] < first_lora["first_train_loss"]
    base = load_model(str(tiny_model_dir), str(sao_cache)).state_dict()
    exported = load_model(str(lora / "model"), str(sao_cache)).state_dict()
    assert set(exported) == set(base)
    changed = {k for k in base if not torch.equal(base[k], exported[k])}
    assert changed and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in changed)


def test_grad_accum_and_checkpointing_match_plain_steps(datasets, tmp_path, sao_cache):
    # CPT blocks have equal token counts, so two micro-batches of 4 must give the loss and the gradient of
    # one batch of 8. The first step starts from the same weights, so its loss and gradient norm must
    # agree to float precision (the norm catches a wrong scaling that Adam would hide); later steps only
    # loosely, since Adam turns float noise in near-zero gradients into small weight differences.
    base = dict(data=datasets["cpt"], steps=4, lr=3e-3, max_tokens=32)

    def run(name, **kw):
        out = {**_common(tmp_path / name, sao_cache), "max_tokens": 32}
        train("cpt", CPTConfig(**base | out | kw))
        return [json.loads(x) for x in (tmp_path / name / "run" / "metrics.jsonl").read_text().splitlines()]

    plain = run("plain")
    for other in (run("accum", grad_accum=2), run("ckpt", gradient_checkpointing=True)):
        assert other[0]["loss"] == pytest.approx(plain[0]["loss"], rel=1e-6)
        assert other[0]["grad_norm"] == pytest.approx(plain[0]["grad_norm"], rel=1e-5)
        assert [r["loss"] for r in other] == pytest.approx([r["loss"] for r in plain], rel=2e-3)
