"""The KFP components' bodies, called as plain Python functions with real artifacts (the same code the
local runner and the cluster execute): data preparation, SFT with a Model pointer, argument checks and
their error messages, the rules for `options`, and the documentation KFP shows for every input."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
from pathlib import Path

import pytest
from kfp.dsl import HTML, Dataset, Markdown, Metrics, Model

from sao_core import storage
from sao_core.config import ConfigError
from sao_core.data.schemas import DataError
from sao_core.data.synthetic import tool_arith_sft_rows
from sao_core.kfp import artifacts, params

COMPONENTS = {
    "prepare_data": "prepare_data", "sft": "sft_train", "cpt": "cpt_train", "dpo": "dpo_train", "gkd": "gkd_train",
    "grpo": "grpo_train", "sao": "sao_train", "rollout_service": "rollout_service", "evaluate": "evaluate",
    "report": "report", "check_arguments": "check_post_training_arguments",
}


def _component(module: str):
    return getattr(importlib.import_module(f"components.{module}"), COMPONENTS[module])


@pytest.mark.parametrize("module", list(COMPONENTS))
def test_every_component_is_documented_and_uses_our_image(module):
    component = _component(module)
    mod = importlib.import_module(f"components.{module}")
    assert mod.__doc__ and len(mod.__doc__.strip()) > 80, "each component module has a README-style docstring"
    missing = [name for name, spec in component.component_spec.inputs.items() if not (spec.description or "").strip()]
    assert not missing, f"{module}: inputs without a description: {missing}"
    container = component.component_spec.implementation.container
    assert container.image.split("/")[-1].split(":")[0] in ("sao-kfp-cpu", "sao-kfp-cuda", "sao-kfp-vllm")
    assert "pip install" not in " ".join(container.command), "install_kfp_package=False: the image has kfp"


@pytest.fixture()
def sft_source(tmp_path) -> Path:
    raw = tmp_path / "raw.jsonl"
    rows = list(tool_arith_sft_rows(60, seed=1))
    rows.append({"messages": [{"role": "robot", "content": "hi"}]})  # one malformed row
    raw.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return raw


def test_prepare_data_fills_dataset_and_stats(tmp_path, sft_source):
    from components.prepare_data import prepare_data

    dataset, stats = Dataset(uri=str(tmp_path / "dataset")), Metrics(uri=str(tmp_path / "stats"))
    rows, version = prepare_data.python_func(source=str(sft_source), kind="sft", dataset=dataset, stats=stats)
    assert rows == 60 and version
    assert len((tmp_path / "dataset" / "data.jsonl").read_text().splitlines()) == 60
    assert dataset.metadata["rows"] == 60 and dataset.metadata["rows_rejected"] == 1
    assert dataset.metadata["kind"] == "sft" and dataset.metadata["dataset_version"] == version
    assert stats.metadata["rows_read"] == 61.0 and stats.metadata["rows_rejected"] == 1.0
    assert sum(v for k, v in stats.metadata.items() if k.startswith("rejected/")) == 1.0


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(kind="sfft"), DataError, "unknown data kind 'sfft'"),
    (dict(kind="sft", limit=-3), DataError, "limit must be a positive integer"),
    (dict(kind="sft", max_tokens=16), DataError, "needs the tokenizer|tokenizer is not"),
    (dict(kind="sft", max_reject_fraction=0.0), DataError, "reject"),
    (dict(kind="rl", max_reject_fraction=1.0), DataError, "no rows written: all 61 rows"),  # 0 rows: the task fails
    (dict(kind="sft", max_prompt_tokens=-1), DataError, "max_prompt_tokens must be a positive integer"),
])
def test_prepare_data_errors_read_like_the_cli(tmp_path, sft_source, kwargs, error, message):
    from components.prepare_data import prepare_data

    with pytest.raises(error, match=message):
        prepare_data.python_func(source=str(sft_source), dataset=Dataset(uri=str(tmp_path / "d")),
                                 stats=Metrics(uri=str(tmp_path / "s")), **kwargs)


def test_sft_component_trains_and_points_at_the_checkpoint(tmp_path, sft_source, sao_cache, monkeypatch):
    from components.prepare_data import prepare_data
    from components.sft import sft_train

    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    dataset = Dataset(uri=str(tmp_path / "dataset"))
    prepare_data.python_func(source=str(sft_source), kind="sft", dataset=dataset, stats=Metrics(uri=str(tmp_path / "s")))
    model, metrics, summary = (Model(uri=str(tmp_path / "model")), Metrics(uri=str(tmp_path / "metrics")),
                               Markdown(uri=str(tmp_path / "summary")))
    report = HTML(uri=str(tmp_path / "report"))
    model_uri, checkpoint_uri = sft_train.python_func(
        data=dataset, output_root=str(tmp_path / "runs"), model=model, metrics=metrics, summary=summary, steps=3,
        batch_size=4, lr=1e-3, max_tokens=128, options={"warmup_steps": 0, "log_every": 1}, run_id="run-1",
        report=report)
    assert model_uri == str(tmp_path / "runs" / "run-1" / "sft" / "model")
    assert checkpoint_uri.startswith(str(tmp_path / "runs" / "run-1" / "sft" / "checkpoints" / "step-000003"))
    pointer = json.loads(Path(model.path).read_text())
    assert pointer == dict(model.metadata)
    assert pointer["checkpoint_uri"] == model_uri and pointer["sha256"] == storage.checkpoint_digest(model_uri)
    assert pointer["method"] == "sft" and pointer["step"] == 3 and pointer["base_model"] == "embedded:tiny"
    assert not any(p.suffix == ".safetensors" for p in tmp_path.joinpath("model").parent.glob("model*"))
    assert metrics.metadata["steps"] == 3.0 and metrics.metadata["last_train_loss"] > 0
    page = Path(summary.path).read_text()
    assert page.startswith("# sft training") and "| steps | mean loss |" in page
    assert artifacts.read_model_pointer(model.path)["step"] == 3
    html = Path(report.path).read_text()   # the HTML artifact is the run's training report
    assert html == (tmp_path / "runs" / "run-1" / "sft" / "training_report.html").read_text()
    assert 'data-plot="loss"' in html and "<svg" in html

    # A changed checkpoint no longer matches its artifact.
    manifest = Path(model_uri) / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"files"', '"files" ', 1))
    with pytest.raises(ConfigError, match="changed since the artifact was written"):
        artifacts.read_model_pointer(model.path)

    # The same run id resumes from its own checkpoint instead of refusing or starting over.
    again = sft_train.python_func(
        data=dataset, output_root=str(tmp_path / "runs"), model=Model(uri=str(tmp_path / "m2")),
        metrics=Metrics(uri=str(tmp_path / "x2")), summary=Markdown(uri=str(tmp_path / "y2")), steps=3, batch_size=4,
        lr=1e-3, max_tokens=128, options={"warmup_steps": 0}, run_id="run-1", report=HTML(uri=str(tmp_path / "r2")))
    assert again[0] == model_uri


@pytest.mark.parametrize("options, message", [
    ({"lr": 0.1}, "lr is given both as a parameter"),
    ({"output": "/elsewhere"}, "output is given both"),
    ({"learning_rat": 0.1}, "unknown field\\(s\\) learning_rat"),
    ({"schedule": "triangle"}, "field 'schedule' must be one of"),
    ([1, 2], "options must be a mapping"),
])
def test_bad_training_options_are_refused_before_training(tmp_path, options, message):
    with pytest.raises(ConfigError, match=message):
        params.training_config("sft", data="d", output="o", model="m", steps=1, batch_size=1, lr=1e-4, max_tokens=8,
                               options=options)


def test_rl_component_defaults_are_the_config_defaults():
    """Pipelines pass SAO / GRPO settings in `options`; that works because a component parameter left at
    its default (= the RLConfig default) may be set from options."""
    from components.grpo import grpo_train
    from components.sao import sao_train
    from sao_core.learner.config import RLConfig

    defaults = {f.name: f.default for f in dataclasses.fields(RLConfig) if f.default is not dataclasses.MISSING}
    for component in (sao_train, grpo_train):
        signature = inspect.signature(component.python_func)
        for name in ("steps", "batch_size", "policy_lr", "critic_lr", "critic_updates", "critic_warmup_steps",
                     "max_staleness", "admission", "eps_low", "eps_high", "group_size"):
            if name in signature.parameters:
                assert signature.parameters[name].default == defaults[name], (component.name, name)


def test_rl_options_override_defaults_but_not_given_values():
    config = params.rl_config("sao", data="d", output="o", model="m", steps=5, batch_size=8, policy_lr=1e-4,
                              engine="hf", options={"critic_lr": 1e-3, "max_staleness": 2}, critic_lr=5e-6,
                              max_staleness=4)
    assert (config.critic_lr, config.max_staleness, config.policy_lr, config.resume) == (1e-3, 2, 1e-4, True)
    with pytest.raises(ConfigError, match="critic_lr is given both as a parameter \\(0.0001\\) and in options"):
        params.rl_config("sao", data="d", output="o", model="m", steps=5, batch_size=8, policy_lr=1e-4, engine="hf",
                         options={"critic_lr": 1e-3}, critic_lr=1e-4)
    with pytest.raises(ConfigError, match="engine must be one of hf, vllm"):
        params.rl_config("sao", data="d", output="o", model="m", steps=5, batch_size=8, policy_lr=1e-4, engine="trt")
    with pytest.raises(ConfigError, match="options.services is not supported"):
        params.rl_config("sao", data="d", output="o", model="m", steps=5, batch_size=8, policy_lr=1e-4, engine="hf",
                         options={"services": ["http://x"]})
    with pytest.raises(ConfigError, match="batch_size \\(6\\) must be a multiple of group_size \\(4\\)"):
        params.rl_config("grpo", data="d", output="o", model="m", steps=5, batch_size=6, policy_lr=1e-4, engine="hf",
                         group_size=4)


class _Stop(Exception):
    """Raised by the stand-in train_rl: the component built its config and called the learner."""


def test_rl_components_pass_admission_to_the_config(tmp_path, monkeypatch):
    """`admission` reaches RLConfig from sao_train and grpo_train (and from options, as post_training passes it);
    a value outside ADMISSION_RULES fails before any training with a message naming admission."""
    from components.grpo import grpo_train
    from components.sao import sao_train
    from sao_core.learner import loop
    from sao_core.learner.config import ADMISSION_RULES

    assert ADMISSION_RULES == ("window", "version_order", "requeue", "no_drop", "fragments")
    seen = []

    def fake_train_rl(config):
        seen.append(config)
        raise _Stop

    monkeypatch.setattr(loop, "train_rl", fake_train_rl)
    common = dict(data=Dataset(uri=str(tmp_path / "data")), output_root=str(tmp_path / "runs"), model=Model(uri="m"),
                  metrics=Metrics(uri="x"), summary=Markdown(uri="y"), report=HTML(uri="h"), engine="hf",
                  run_id="r")
    with pytest.raises(_Stop):
        sao_train.python_func(critic=Model(uri="c"), admission="version_order", **common)
    with pytest.raises(_Stop):
        grpo_train.python_func(method="grpo_async", admission="requeue", **common)
    with pytest.raises(_Stop):
        sao_train.python_func(critic=Model(uri="c"), options={"admission": "window"}, **common)
    with pytest.raises(_Stop):
        sao_train.python_func(critic=Model(uri="c"), **common)
    assert [(c.method, c.admission) for c in seen] == [("sao", "version_order"), ("grpo_async", "requeue"),
                                                       ("sao", "window"), ("sao", "no_drop")]   # the default
    allowed = "field 'admission' must be one of window, version_order, requeue, no_drop, fragments, got 'fifo'"
    with pytest.raises(ConfigError, match=f"^sao_train: {allowed}$"):
        sao_train.python_func(critic=Model(uri="c"), admission="fifo", **common)
    with pytest.raises(ConfigError, match=f"^grpo_async_train: {allowed}$"):
        grpo_train.python_func(method="grpo_async", admission="fifo", **common)
    with pytest.raises(ConfigError, match="admission is given both as a parameter \\('requeue'\\) and in options"):
        sao_train.python_func(critic=Model(uri="c"), admission="requeue", options={"admission": "window"}, **common)
    assert len(seen) == 4, "no training started for a bad admission"


def test_grpo_component_refuses_sao_and_unknown_methods(tmp_path):
    from components.grpo import grpo_train

    for method, message in (("sao", "SAO has its own component"), ("ppo", "must be one of grpo, grpo_async")):
        with pytest.raises(ConfigError, match=message):
            grpo_train.python_func(data=Dataset(uri=str(tmp_path)), output_root=str(tmp_path), model=Model(uri="m"),
                                   metrics=Metrics(uri="x"), summary=Markdown(uri="y"), report=HTML(uri="h"),
                                   method=method)


@pytest.mark.parametrize("method, kind", [("sft", "sft"), ("cpt", "cpt"), ("dpo", "dpo"), ("grpo", "rl"), ("sao", "rl")])
def test_check_returns_the_data_kind(method, kind):
    from components.check_arguments import check_post_training_arguments

    result = check_post_training_arguments.python_func(
        method=method, output_root="s3://bucket/runs", steps=10, batch_size=16, learning_rate=1e-5, max_tokens=256,
        engine="vllm", warm_start_source="", warm_start_steps=0, method_options={})
    assert result == (kind,)


@pytest.mark.parametrize("overrides, message", [
    (dict(method="ppo"), "unknown method 'ppo'; choose one of sft, cpt, dpo, gkd, grpo, sao"),
    (dict(method="gkd"), "teacher_model is required"),
    (dict(method="sao", method_options={"critic_lrr": 1}), "unknown field\\(s\\) critic_lrr"),
    (dict(method="sao", method_options={"eps_low": 2.0}), "eps_low"),
    (dict(method="sao", method_options={"admission": "fifo"}),
     "field 'admission' must be one of window, version_order, requeue, no_drop, fragments, got 'fifo'"),
    (dict(method="sao", steps=0), "steps must be >= 1"),
    (dict(method="sao", warm_start_steps=10), "needs warm_start_source"),
    (dict(method="sft", warm_start_steps=10, warm_start_source="x"), "applies to grpo and sao only"),
    (dict(method="sft", learning_rate=0.0), "lr must be > 0"),
    (dict(method="dpo", method_options={"beta": -1}), "beta must be > 0"),
    (dict(method="sao", output_root=""), "output_root is empty"),
    (dict(method="grpo", engine="trt"), "engine must be one of hf, vllm"),
])
def test_check_refuses_bad_arguments_with_the_field(overrides, message):
    values = dict(method="sft", output_root="/tmp/runs", steps=10, batch_size=16, learning_rate=1e-5, max_tokens=256,
                  engine="vllm", warm_start_source="", warm_start_steps=0, method_options={})
    values.update(overrides)
    with pytest.raises(ConfigError, match=message):
        params.check_post_training(**values)


def test_run_dir(tmp_path):
    assert artifacts.run_dir("s3://bucket/runs/", "abc", "sao") == "s3://bucket/runs/abc/sao"
    assert artifacts.run_dir(str(tmp_path), "abc", "sft") == str(tmp_path / "abc" / "sft")
    generated = artifacts.run_dir(str(tmp_path), "", "sft")
    assert generated.startswith(str(tmp_path)) and generated.endswith("/sft") and len(Path(generated).parent.name) > 15
    with pytest.raises(ConfigError, match="must not contain '/'"):
        artifacts.run_dir(str(tmp_path), "a/b", "sft")
    with pytest.raises(ConfigError, match="output_root is empty"):
        artifacts.run_dir("  ", "a", "sft")


def test_training_markdown_and_numbers():
    page = artifacts.training_markdown("t", {"steps": 4, "nested": {"a": 1}}, [
        {"step": i, "reward_mean": r} for i, r in enumerate([0.0, 1.0, 0.5, 0.5], 1)], "reward_mean", windows=2)
    assert "| 1-2 | 0.5000 |" in page and "| 3-4 | 0.5000 |" in page and '| nested | {"a": 1} |' in page

    class Sink:
        def __init__(self):
            self.logged = {}

        def log_metric(self, name, value):
            self.logged[name] = value

    sink = Sink()
    artifacts.log_numbers(sink, {"a": 1, "b": True, "c": float("nan"), "d": {"e": 2.5}, "f": "x", "g": None})
    assert sink.logged == {"a": 1.0, "d/e": 2.5}


def _summary(model, benchmark, started, finished, metric, samples_file):
    return {"schema": 1, "model": model, "engine": "hf", "config": {"k": 2, "benchmarks": [benchmark]},
            "benchmarks": {benchmark: {"problems": 1}}, "metrics": {f"{benchmark}/avg@2": metric},
            "started_at": started, "finished_at": finished, "seconds": 1.0, "samples_generated": 2,
            "samples_reused": 0, "files": {"samples": samples_file}}


def test_merge_summaries(tmp_path):
    from sao_core.kfp.evaluation import load_samples, merge_summaries

    samples = tmp_path / "samples.jsonl"
    samples.write_text('{"benchmark": "a", "id": 1}\n{"benchmark": "a", "id": 2}\n{"torn')
    a = _summary("m", "beyond_aime", "2026-01-01T00:00:00+00:00", "2026-01-01T00:01:00+00:00", 0.5, str(samples))
    b = _summary("m", "imo_answerbench", "2026-01-01T00:00:30+00:00", "2026-01-01T00:03:00+00:00", 0.25, str(samples))
    merged = merge_summaries([a, b], previous={"model": "old", "metrics": {"beyond_aime/avg@2": 0.25}},
                             previous_uri="s3://b/prev/summary.json")
    assert list(merged["benchmarks"]) == ["beyond_aime", "imo_answerbench"]
    assert merged["metrics"] == {"beyond_aime/avg@2": 0.5, "imo_answerbench/avg@2": 0.25}
    assert merged["seconds"] == 180.0 and merged["samples_generated"] == 4
    assert merged["config"]["benchmarks"] == ["beyond_aime", "imo_answerbench"]
    assert merged["comparison"]["metrics"] == {"beyond_aime/avg@2": {"current": 0.5, "previous": 0.25, "delta": 0.25}}
    assert len(load_samples(a)) == 2
    with pytest.raises(ConfigError, match="different models"):
        merge_summaries([a, {**b, "model": "other"}])
    with pytest.raises(ConfigError, match="appears in two evaluation runs"):
        merge_summaries([a, a])
    with pytest.raises(ConfigError, match="no evaluation summaries"):
        merge_summaries([])


def test_model_artifact_points_at_an_s3_checkpoint(tmp_path, sft_source, sao_cache, monkeypatch, moto_s3):
    """In a cluster output_root is an s3:// prefix: the weights stay there and the artifact is a pointer."""
    from components.prepare_data import prepare_data
    from components.sft import sft_train

    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    dataset = Dataset(uri=str(tmp_path / "dataset"))
    prepare_data.python_func(source=str(sft_source), kind="sft", dataset=dataset, stats=Metrics(uri=str(tmp_path / "s")))
    model = Model(uri=str(tmp_path / "model"))
    model_uri, _ = sft_train.python_func(
        data=dataset, output_root=moto_s3.uri("runs"), model=model, metrics=Metrics(uri=str(tmp_path / "m")),
        summary=Markdown(uri=str(tmp_path / "md")), steps=2, batch_size=4, lr=1e-3, max_tokens=128,
        options={"warmup_steps": 0}, run_id="kfp-run-7", report=HTML(uri=str(tmp_path / "report")))
    assert model_uri == moto_s3.uri("runs/kfp-run-7/sft/model")
    assert storage.is_complete_checkpoint(model_uri)
    assert model.metadata["checkpoint_uri"] == model_uri
    assert model.metadata["sha256"] == storage.checkpoint_digest(model_uri)
    assert Path(model.path).stat().st_size < 2000  # a pointer, not weights
    assert "| steps | mean loss |" in Path(tmp_path / "md").read_text()  # metrics.jsonl read back from S3
    assert storage.read_text(moto_s3.uri("runs/kfp-run-7/sft/training_report.html")) == \
        Path(tmp_path / "report").read_text()   # the report reached the s3:// run and the HTML artifact
    assert artifacts.read_model_pointer(model.path)["checkpoint_uri"] == model_uri
