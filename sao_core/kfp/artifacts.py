"""Helpers the component bodies use at run time to fill their KFP artifacts (no kfp import here).

Model artifacts do not carry weights. A trained model lives where the training run published it (a
verified checkpoint under ``output_root``: an ``s3://`` prefix in a cluster, a directory locally);
the Model artifact is a small JSON pointer to it, and the same fields are the artifact's metadata so
the KFP UI and lineage show them: ``checkpoint_uri``, ``sha256`` (digest of the checkpoint's
manifest, :func:`sao_core.storage.checkpoint_digest`), ``method``, ``step``, ``version`` (policy
version for RL), ``base_model``, ``run_dir``. Downstream steps take the checkpoint URI (a string
output of the training step) and verify it against the manifest when they load it.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import uuid
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.config import ConfigError, build_config, merge_options

#: Config fields a component always sets itself (``options`` may not name them).
_RESERVED = ("data", "output", "model", "cache_dir", "resume")


def quiet_http_logs() -> None:
    """Per-request INFO lines of the HTTP clients (the learner polls its rollout service many times a
    second) would drown a task's log; keep their warnings."""
    import logging

    for name in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(name).setLevel(logging.WARNING)


def cache_dir() -> str:
    """Models and downloads cache inside a component: $SAO_CACHE_DIR, else ~/.cache/sao."""
    return os.environ.get("SAO_CACHE_DIR") or str(Path.home() / ".cache" / "sao")


def run_dir(output_root: str, run_id: str, stage: str) -> str:
    """``OUTPUT_ROOT/RUN_ID/STAGE``: where one pipeline step writes its run.

    `run_id` is the pipeline run's id (``dsl.PIPELINE_JOB_ID_PLACEHOLDER``); empty for a component
    used on its own, when a UTC timestamp plus a random suffix is used instead.
    """
    if not isinstance(output_root, str) or not output_root.strip():
        raise ConfigError("output_root is empty: give an s3://bucket/prefix (in a cluster) or a local directory "
                          "where checkpoints and models are written")
    run = run_id.strip() if run_id else ""
    if not run:
        run = _dt.datetime.now(_dt.UTC).strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    if "/" in run or run in (".", ".."):
        raise ConfigError(f"run_id {run_id!r} must not contain '/'")
    root = output_root.strip()
    if not storage.is_s3_uri(root):
        root = str(Path(root).expanduser().resolve())
    return storage.join(root, run, stage)


def build(cls: type, explicit: dict[str, Any], options: dict | None, source: str):
    """Build config `cls` from a component's explicit parameters plus ``options`` (any other field).

    A component's parameter defaults are the config's defaults, so ``options`` may set a field whose
    parameter was left at its default (the pipelines pass method settings that way); a field given
    both ways with different values, or one of data / output / model / cache_dir / resume, is refused.
    Every error is a ConfigError naming the field, the same message the CLI gives.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return build_config(cls, merge_options(explicit, options, defaults, source, _RESERVED, config=cls), source=source)


def model_pointer(checkpoint_uri: str, method: str, step: int, version: int | None = None,
                  base_model: str = "", run: str = "", **extra: Any) -> dict[str, Any]:
    """The pointer (and metadata) of a Model artifact: the checkpoint's URI, digest and provenance."""
    pointer = {"checkpoint_uri": checkpoint_uri, "sha256": storage.checkpoint_digest(checkpoint_uri),
               "method": method, "step": int(step), "base_model": base_model, "run_dir": run}
    if version is not None:
        pointer["version"] = int(version)
    pointer.update({k: v for k, v in extra.items() if v is not None})
    return pointer


def fill_model(artifact, pointer: dict[str, Any]) -> None:
    """Write `pointer` as the artifact's file and metadata (KFP uploads only this small JSON file)."""
    path = Path(artifact.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(pointer, indent=2, sort_keys=True) + "\n")
    artifact.metadata.update(pointer)


def read_model_pointer(path: str) -> dict[str, Any]:
    """Read a Model artifact's pointer file and check its checkpoint still has the recorded digest."""
    try:
        pointer = json.loads(Path(path).read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"model artifact {path} is not a sao model pointer: {err}") from err
    if not isinstance(pointer, dict) or "checkpoint_uri" not in pointer or "sha256" not in pointer:
        raise ConfigError(f"model artifact {path} is not a sao model pointer (no checkpoint_uri / sha256)")
    digest = storage.checkpoint_digest(pointer["checkpoint_uri"])
    if digest != pointer["sha256"]:
        raise ConfigError(f"checkpoint {pointer['checkpoint_uri']} changed since the artifact was written "
                          f"(manifest sha256 {digest}, artifact says {pointer['sha256']})")
    return pointer


def log_numbers(metrics_artifact, values: dict[str, Any], prefix: str = "") -> dict[str, float]:
    """Log every finite number of `values` (nested dicts flattened with '/') on a Metrics artifact."""
    logged: dict[str, float] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            logged.update(log_numbers(metrics_artifact, value, prefix=f"{name}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and value == value \
                and abs(value) != float("inf"):
            metrics_artifact.log_metric(name, float(value))
            logged[name] = float(value)
    return logged


def read_metrics_rows(run: str) -> list[dict[str, Any]]:
    """The rows of ``RUN/metrics.jsonl`` (local or s3://); [] when the run wrote none."""
    uri = storage.join(run, "metrics.jsonl")
    try:
        if not storage.exists(uri):
            return []
        text = storage.read_text(uri)
    except storage.StorageError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def training_markdown(title: str, summary: dict[str, Any], rows: list[dict[str, Any]], curve_key: str,
                      windows: int = 10) -> str:
    """A Markdown page for the KFP UI: the run's summary and its `curve_key` averaged over windows of steps."""
    lines = [f"# {title}", "", "| field | value |", "| --- | --- |"]
    for key, value in summary.items():
        if key == "evaluations":   # evaluation during training: a table of its own below
            continue
        if isinstance(value, dict | list):
            value = json.dumps(value)
        lines.append(f"| {key} | {_fmt(value) if value is not None else ''} |")
    evaluations = summary.get("evaluations") or []
    if evaluations:
        lines += ["", "## held-out evaluation during training", "",
                  "| step | version | sampled reward (T = 1) | greedy reward | prompts |", "| --- | --- | --- | --- | --- |"]
        for e in evaluations:
            cells = [e.get("step"), e.get("version"), e.get("eval_sampled_reward"), e.get("eval_greedy_reward"),
                     e.get("eval_prompts")]
            lines.append("| " + " | ".join("" if c is None else _fmt(c) for c in cells) + " |")
    points = [r for r in rows if isinstance(r.get(curve_key), (int, float))]
    if points:
        size = max(1, -(-len(points) // windows))
        lines += ["", f"## {curve_key} per window of {size} step(s)", "", f"| steps | mean {curve_key} |",
                  "| --- | --- |"]
        for start in range(0, len(points), size):
            chunk = points[start:start + size]
            mean = sum(r[curve_key] for r in chunk) / len(chunk)
            lines.append(f"| {chunk[0].get('step', start + 1)}-{chunk[-1].get('step', start + len(chunk))} | "
                         f"{mean:.4f} |")
    return "\n".join(lines) + "\n"


def write_text_artifact(artifact, text: str) -> str:
    """Write `text` as the artifact's file (Markdown / HTML pages); returns the path."""
    path = Path(artifact.path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def finish_training(result: dict[str, Any], method: str, base_model: str, run: str, model_artifact,
                    metrics_artifact, summary_artifact, curve_key: str, critic_artifact=None,
                    report_artifact=None) -> tuple[str, str]:
    """Fill a training step's artifacts from the run summary; returns (model URI, checkpoint URI).

    Model (and critic) artifacts become pointers to the published checkpoints; the Metrics artifact
    gets every number of the summary; the Markdown artifact shows the summary and the `curve_key`
    curve from the run's ``metrics.jsonl``; the HTML artifact is the run's training report (the one the
    run wrote at its end, else made now from its metrics).
    """
    version = result.get("version")
    fill_model(model_artifact, model_pointer(result["model"], method=method, step=result["steps"], version=version,
                                             base_model=base_model, run=run, training_state=result.get("checkpoint")))
    if critic_artifact is not None and result.get("critic"):
        fill_model(critic_artifact, model_pointer(result["critic"], method=f"{method}-critic", step=result["steps"],
                                                  version=version, base_model=base_model, run=run))
    log_numbers(metrics_artifact, {k: v for k, v in result.items() if k not in ("world_size",)})
    write_text_artifact(summary_artifact, training_markdown(f"{method} training: {run}", result,
                                                            read_metrics_rows(run), curve_key))
    if report_artifact is not None:
        write_text_artifact(report_artifact, training_report_html(run, result))
    return result["model"], result["checkpoint"]


def training_report_html(run: str, result: dict[str, Any]) -> str:
    """The run's ``training_report.html``; made from its metrics when the run did not write one (a run
    launched elsewhere), or a page saying why there is none."""
    from sao_core.reporting.training import TRAINING_REPORT, ReportError, build_training_report

    uri = storage.join(run, TRAINING_REPORT)
    try:
        if storage.exists(uri):
            return storage.read_text(uri)
        return build_training_report(run, summary=result)
    except (ReportError, storage.StorageError) as err:
        from html import escape

        return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Training report</title></head>'
                f"<body><h1>Training report</h1><p>No report for {escape(run)}: {escape(str(err))}</p></body></html>")
