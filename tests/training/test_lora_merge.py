"""`sao checkpoint merge` and the evaluator's `adapter`: a LoRA adapter (peft folder sealed with a manifest, as
a LoRA run publishes it) merged into its base model gives a published, verified full model whose logits are the
peft model's; the CLI prints the same JSON; bad adapters (no manifest, not an adapter, tampered, made for
another model, an output that would overwrite an input) stop with one clear line; an s3:// round trip (moto);
and an evaluation with `adapter` (HF engine; vLLM, slow) gives the merged model's own per-sample results,
recording the adapter, through `evaluate`, the KFP component, `sao evaluate --adapter` and the evaluation
pipeline's `a_adapter` (local runner), while a bad adapter stops it before any evaluation work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from lora_helpers import make_adapter

from sao_core import storage
from sao_core.models import EMBEDDED_TINY, TinyModelSpec, build_tiny_model, load_model
from sao_core.training.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
)
from sao_core.training.merge import MergeError, merge_checkpoint

ROOT = Path(__file__).resolve().parents[2]
BEYOND = Path(__file__).parents[1] / "data" / "eval" / "beyond_aime_sample.jsonl"
IDS = torch.tensor([[3, 17, 5, 42, 9, 11, 28, 7, 64, 2, 33, 19]])


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(IDS).logits[0].float()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, sao_cache, tiny_model_dir) -> dict:
    """sealed: an adapter of the embedded model with its manifest (what a LoRA run publishes); bare: the same
    files without one; other: a sealed adapter of a narrower tiny model; logits: the peft model's, the base's."""
    root = tmp_path_factory.mktemp("adapters")
    peft_model = make_adapter(tiny_model_dir, sao_cache, root / "sealed")
    storage.seal_checkpoint(root / "sealed", metadata={"kind": "lora_adapter", "base_model": EMBEDDED_TINY})
    (root / "bare").mkdir()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        shutil.copy(root / "sealed" / name, root / "bare" / name)
    narrow = build_tiny_model(root / "narrow-model", TinyModelSpec(hidden_size=64, intermediate_size=128,
                                                                   corpus_lines=300))
    make_adapter(narrow, sao_cache, root / "other")
    storage.seal_checkpoint(root / "other", metadata={"kind": "lora_adapter", "base_model": str(narrow)})
    return {"sealed": str(root / "sealed"), "bare": str(root / "bare"), "other": str(root / "other"),
            "logits": _logits(peft_model), "base_logits": _logits(load_model(str(tiny_model_dir), str(sao_cache)))}


def _check_merged(uri: str, cache, adapters: dict, adapter: str) -> dict:
    """The merged model at `uri` verifies, loads verified, computes the peft model's logits; its manifest."""
    manifest = storage.read_manifest(uri)
    if not storage.is_s3_uri(uri):
        storage.verify_checkpoint(uri)
    merged = load_model(uri, str(cache))           # verified against its manifest (no unverified flag)
    logits = _logits(merged)
    assert (logits - adapters["logits"]).abs().max().item() < 1e-5
    assert (adapters["logits"] - adapters["base_logits"]).abs().max().item() > 1e-3   # the adapter does change it
    assert not any("lora" in name for name in merged.state_dict())
    meta = manifest["metadata"]
    assert meta["kind"] == "model" and meta["base_model"] == EMBEDDED_TINY and meta["adapter"] == adapter
    return manifest


# ------------------------------------------------------------------------------------------ merging

def test_merge_publishes_a_verified_model_with_the_peft_models_logits(adapters, sao_cache, tmp_path):
    out = tmp_path / "merged"
    result = merge_checkpoint(EMBEDDED_TINY, adapters["sealed"], str(out), str(sao_cache))
    assert result == {"model": str(out), "sha256": storage.checkpoint_digest(str(out)), "base_model": EMBEDDED_TINY,
                      "adapter": adapters["sealed"], "adapter_sha256": storage.checkpoint_digest(adapters["sealed"])}
    manifest = _check_merged(str(out), sao_cache, adapters, adapters["sealed"])
    assert manifest["metadata"]["adapter_sha256"] == result["adapter_sha256"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir()), "the scratch folder is gone"
    # merging again into the same output republishes it (same bytes: same digest)
    again = merge_checkpoint(EMBEDDED_TINY, adapters["sealed"], str(out), str(sao_cache), dtype="float32")
    storage.verify_checkpoint(out)
    assert again["adapter_sha256"] == result["adapter_sha256"]
    # bfloat16 weights on request
    half = merge_checkpoint(EMBEDDED_TINY, adapters["sealed"], str(tmp_path / "bf16"), str(sao_cache),
                            dtype="bfloat16")
    assert json.loads((Path(half["model"]) / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_merge_prints_the_result_and_the_model_loads(adapters, sao_cache, tmp_path):
    out = tmp_path / "cli-merged"
    done = subprocess.run([sys.executable, "-m", "sao_core.cli", "--quiet", "--cache-dir", str(sao_cache), "checkpoint",
                           "merge", "--base", EMBEDDED_TINY, "--adapter", adapters["sealed"], "--output", str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    assert printed == {"model": str(out), "sha256": storage.checkpoint_digest(str(out)), "base_model": EMBEDDED_TINY,
                       "adapter": adapters["sealed"], "adapter_sha256": storage.checkpoint_digest(adapters["sealed"])}
    _check_merged(str(out), sao_cache, adapters, adapters["sealed"])
    # The refusal of a folder without a manifest (exit 2, one line, no traceback, nothing written) was a second
    # `python -m sao_core.cli` process here (~5 s); test_an_adapter_folder_without_a_manifest_needs_unverified
    # now checks it by calling main(), all that such a process runs.


def test_an_adapter_folder_without_a_manifest_needs_unverified(adapters, sao_cache, tmp_path, capsys):
    """Refused as one line (exit 2, no traceback, nothing written) that names --unverified; with it, merged.
    (The refusal was also run as a second `python -m sao_core.cli` process in
    test_cli_merge_prints_the_result_and_the_model_loads; main() is all that process runs.)"""
    from sao_core.cli import main

    argv = ["--quiet", "--cache-dir", str(sao_cache), "checkpoint", "merge", "--base", EMBEDDED_TINY, "--adapter",
            adapters["bare"], "--output", str(tmp_path / "m")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in captured.err and captured.out == "", captured.err
    assert err[0].startswith(f"sao checkpoint: error: adapter folder {adapters['bare']} has no manifest.json")
    assert "has no manifest.json, so its files cannot be verified" in err[0] and "--unverified" in err[0]
    assert not (tmp_path / "m").exists()
    assert main([*argv, "--unverified"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["adapter_sha256"] is None
    manifest = _check_merged(str(tmp_path / "m"), sao_cache, adapters, adapters["bare"])
    assert manifest["metadata"]["adapter_sha256"] is None


def _tampered(adapters, tmp_path) -> Path:
    copy = tmp_path / "tampered"
    shutil.copytree(adapters["sealed"], copy)
    data = bytearray((copy / ADAPTER_WEIGHTS).read_bytes())
    data[-1] ^= 0x01                                         # one bit of the last weight
    (copy / ADAPTER_WEIGHTS).write_bytes(bytes(data))
    return copy


def _retargeted(adapters, tmp_path) -> Path:
    """The adapter with its config naming a module the base model lacks (sealed again: its manifest is fine)."""
    copy = tmp_path / "retargeted"
    shutil.copytree(adapters["sealed"], copy)
    config = json.loads((copy / ADAPTER_CONFIG).read_text())
    config["target_modules"] = ["w_gate"]
    (copy / ADAPTER_CONFIG).write_text(json.dumps(config))
    storage.seal_checkpoint(copy, metadata={"kind": "lora_adapter"})
    return copy


@pytest.mark.parametrize("case, message", [
    ("missing", r"adapter {path}: no such folder"),
    ("full_model", r"{path} is not a LoRA adapter: no adapter_config.json \(it is a full model folder"),
    ("tampered", r"adapter {path} failed verification: .*checkpoint file corrupt: {path}/adapter_model.safetensors"),
    ("other_shape", r"adapter {path} does not fit base model embedded:tiny \(the adapter names .*narrow-model.* as "
                    r"its base\): size mismatch for .*lora_A.*torch.Size\(\[4, 64\]\).*torch.Size\(\[4, 128\]\) "
                    r"\(and \d+ more\)$"),
    ("retargeted", r"adapter {path} does not fit base model embedded:tiny: Target modules \{{'w_gate'\}} not found"),
    ("output_is_adapter", r"output {path} overlaps the input"),
    ("output_holds_files", r"output {path} is a folder holding other files \(not a checkpoint\)"),
])
def test_bad_adapters_and_outputs_are_one_clear_line(case, message, adapters, sao_cache, tiny_model_dir, tmp_path,
                                                     capsys):
    from sao_core.cli import main

    adapter, output = adapters["sealed"], str(tmp_path / "out")
    if case == "missing":
        adapter = str(tmp_path / "no-such-adapter")
    elif case == "full_model":
        adapter = str(tiny_model_dir)
    elif case == "tampered":
        adapter = str(_tampered(adapters, tmp_path))
    elif case == "other_shape":
        adapter = adapters["other"]
    elif case == "retargeted":
        adapter = str(_retargeted(adapters, tmp_path))
    elif case == "output_is_adapter":
        output = adapter
    else:
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / "notes.txt").write_text("mine")
    named = output if case.startswith("output") else adapter
    code = main(["--quiet", "--cache-dir", str(sao_cache), "checkpoint", "merge", "--base", EMBEDDED_TINY,
                 "--adapter", adapter, "--output", output])
    err = capsys.readouterr().err.strip().splitlines()
    import re

    assert code == 2 and len(err) == 1, err
    assert re.fullmatch(r"sao checkpoint: error: " + message.format(path=re.escape(named)) + r"(.*)", err[0]), err[0]
    if case != "output_holds_files":
        assert not (tmp_path / "out").exists(), "nothing is published"
    else:
        assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no scratch folder is left"
    with pytest.raises(MergeError):
        merge_checkpoint(EMBEDDED_TINY, adapter, output, str(sao_cache))


def test_s3_round_trip(adapters, sao_cache, moto_s3):
    adapter_uri, merged_uri = moto_s3.uri("runs/r1/sao/weights/v000003"), moto_s3.uri("merged/r1")
    storage.publish_checkpoint(adapters["sealed"], adapter_uri, metadata={"kind": "lora_adapter",
                                                                           "base_model": EMBEDDED_TINY})
    result = merge_checkpoint(EMBEDDED_TINY, adapter_uri, merged_uri, str(sao_cache))
    assert result["model"] == merged_uri and result["sha256"] == storage.checkpoint_digest(merged_uri)
    assert result["adapter_sha256"] == storage.checkpoint_digest(adapter_uri)
    _check_merged(merged_uri, sao_cache, adapters, adapter_uri)
    assert not list((Path(sao_cache) / "scratch").glob("merge-*")), "the scratch folder is gone"
    # an incomplete adapter checkpoint (no _COMPLETE) is refused
    storage.delete_file(storage.join(adapter_uri, storage.COMPLETE_MARKER))
    with pytest.raises(MergeError, match=r"cannot fetch adapter s3://.*v000003: incomplete checkpoint"):
        merge_checkpoint(EMBEDDED_TINY, adapter_uri, moto_s3.uri("merged/r2"), str(sao_cache))


# ------------------------------------------------------------------------------------------ the evaluator

def _eval_config(output, sao_cache, **changes):
    from sao_core.eval import EvalConfig

    return EvalConfig(**{"model": EMBEDDED_TINY, "output": str(output), "benchmarks": ["beyond_aime"],
                         "beyond_aime_source": str(BEYOND), "k": 2, "limit": 3, "temperature": 1.0,
                         "max_new_tokens": 12, "max_total_tokens": 1024, "grader_workers": 1,
                         "cache_dir": str(sao_cache), **changes})


def _samples(folder: Path) -> list[dict]:
    rows = [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]
    keep = ("id", "sample", "response", "answer", "tokens", "finish_reason", "correct", "seed")
    return sorted(({k: r[k] for k in keep} for r in rows), key=lambda r: (r["id"], r["sample"]))


def test_evaluating_with_an_adapter_is_evaluating_the_merged_model(adapters, sao_cache, tmp_path):
    from sao_core.eval import evaluate

    merged = merge_checkpoint(EMBEDDED_TINY, adapters["sealed"], str(tmp_path / "merged"), str(sao_cache))
    direct = evaluate(_eval_config(tmp_path / "direct", sao_cache, model=merged["model"]))
    with_adapter = evaluate(_eval_config(tmp_path / "adapter", sao_cache, adapter=adapters["sealed"]))
    base = evaluate(_eval_config(tmp_path / "base", sao_cache))

    # sampled with the per-sample seeds: any difference in the weights would show in the tokens drawn
    samples = _samples(tmp_path / "adapter")
    assert len(samples) == 6 and samples == _samples(tmp_path / "direct")        # the merged model's own results
    differ = [a["response"] != b["response"] for a, b in zip(samples, _samples(tmp_path / "base"), strict=True)]
    assert sum(differ) >= 3, differ                                               # ... not the base model's
    assert with_adapter["metrics"] == direct["metrics"]
    digest = storage.checkpoint_digest(adapters["sealed"])
    assert (with_adapter["model"], with_adapter["adapter"], with_adapter["adapter_sha256"]) == (
        EMBEDDED_TINY, adapters["sealed"], digest)
    assert len(with_adapter["merged_model_sha256"]) == 64             # the scratch model's manifest digest
    assert (base["adapter"], base["adapter_sha256"]) == (None, None) and "merged_model_sha256" not in base
    saved = json.loads((tmp_path / "adapter" / "summary.json").read_text())
    assert (saved["adapter"], saved["adapter_sha256"]) == (adapters["sealed"], digest)
    run = json.loads((tmp_path / "adapter" / "run.json").read_text())
    assert (run["model"], run["adapter"], run["adapter_sha256"]) == (EMBEDDED_TINY, adapters["sealed"], digest)
    assert adapters["sealed"] in (tmp_path / "adapter" / "report.html").read_text()
    assert not list((Path(sao_cache) / "scratch").glob("eval-merged-*")), "the merged scratch model is removed"

    # a resumed run reuses the samples; another adapter (or none) in the same output is refused
    again = evaluate(_eval_config(tmp_path / "adapter", sao_cache, adapter=adapters["sealed"]))
    assert again["samples_reused"] == 6 and again["samples_generated"] == 0
    from sao_core.eval import EvalError

    with pytest.raises(EvalError, match=r"holds samples of a different run \(adapter: '.*sealed' there, None now"):
        evaluate(_eval_config(tmp_path / "adapter", sao_cache))


def test_a_bad_adapter_stops_the_evaluation_before_any_work(adapters, sao_cache, tiny_model_dir, tmp_path,
                                                             monkeypatch):
    from sao_core.eval import EvalError, evaluate
    from sao_core.eval import run as eval_run

    def no_data(*args, **kwargs):
        raise AssertionError("no benchmark may be loaded")

    monkeypatch.setattr(eval_run, "load_benchmark", no_data)
    for adapter, message in ((str(tmp_path / "nowhere"), r"cannot apply the adapter: adapter .*nowhere: no such folder"),
                             (adapters["bare"], r"cannot apply the adapter: adapter folder .*bare has no manifest"),
                             (str(tiny_model_dir), r"cannot apply the adapter: .* is not a LoRA adapter"),
                             (adapters["other"], r"cannot apply the adapter: adapter .*other does not fit base model")):
        with pytest.raises(EvalError, match=message):
            evaluate(_eval_config(tmp_path / "out", sao_cache, adapter=adapter))
        assert not (tmp_path / "out").exists(), "no output is written"
    with pytest.raises(EvalError, match="adapter must be a folder or s3:// URI"):
        evaluate(_eval_config(tmp_path / "out", sao_cache, adapter=None))
    assert not list((Path(sao_cache) / "scratch").glob("eval-merged-*"))


def test_the_evaluate_component_and_cli_take_the_adapter(adapters, sao_cache, tmp_path, monkeypatch, capsys):
    from kfp.dsl import HTML, Artifact, Metrics

    from components.evaluate import evaluate
    from sao_core.cli import build_parser

    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    summary = Artifact(uri=str(tmp_path / "summary.json"))
    metrics, report = Metrics(uri=str(tmp_path / "metrics")), HTML(uri=str(tmp_path / "report.html"))
    evaluate.python_func(model=EMBEDDED_TINY, adapter=adapters["sealed"], output_root=str(tmp_path / "runs"),
                         summary=summary, metrics=metrics, report=report, benchmarks="beyond_aime", k=1, limit=2,
                         engine="hf", max_new_tokens=8, max_total_tokens=1024,
                         options={"beyond_aime_source": str(BEYOND), "grader_workers": 1}, run_id="r1")
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["adapter"] == adapters["sealed"] and summary.metadata["adapter"] == adapters["sealed"]
    assert written["adapter_sha256"] == storage.checkpoint_digest(adapters["sealed"])

    with pytest.raises(SystemExit):
        build_parser(["evaluate", "--help"]).parse_args(["evaluate", "--help"])
    assert "--adapter ADAPTER" in capsys.readouterr().out


def test_merge_summaries_keeps_the_adapter_and_refuses_two():
    from sao_core.config import ConfigError
    from sao_core.kfp.evaluation import merge_summaries

    one = {"model": "m", "adapter": "s3://b/a", "adapter_sha256": "1", "benchmarks": {"beyond_aime": {}}}
    two = {"model": "m", "adapter": "s3://b/a", "adapter_sha256": "1", "benchmarks": {"imo_answerbench": {}}}
    merged = merge_summaries([one, two])
    assert (merged["adapter"], merged["adapter_sha256"]) == ("s3://b/a", "1")
    with pytest.raises(ConfigError, match="different LoRA adapters"):
        merge_summaries([one, {**two, "adapter_sha256": "2"}])
    with pytest.raises(ConfigError, match="different LoRA adapters"):
        merge_summaries([one, {**two, "adapter": None, "adapter_sha256": None}])


def test_the_evaluation_pipeline_passes_a_adapter_to_every_step(adapters, sao_cache, tmp_path):
    from pipelines.evaluation import evaluation
    from sao_core.kfp.local import run_pipeline

    report_uri = run_pipeline(evaluation, dict(
        a0_model=EMBEDDED_TINY, a_adapter=adapters["sealed"], a0_output_root=str(tmp_path / "runs"),
        c_benchmarks=["beyond_aime"], c_k=1, c_limit=2, c_engine="hf", c_max_new_tokens=8, c_max_total_tokens=256,
        c_sandbox="local", c_eval_options={"beyond_aime_source": str(BEYOND), "grader_workers": 1}),
        tmp_path / "root", cache_dir=sao_cache, threads=1)
    (run,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    step = json.loads((run / "eval-beyond_aime" / "summary.json").read_text())
    merged = json.loads((run / "report" / "summary.json").read_text())
    digest = storage.checkpoint_digest(adapters["sealed"])
    for summary in (step, merged):
        assert (summary["model"], summary["adapter"], summary["adapter_sha256"]) == (
            EMBEDDED_TINY, adapters["sealed"], digest)
    assert adapters["sealed"] in Path(report_uri).read_text()
