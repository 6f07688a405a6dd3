"""Glue between evaluation steps that ran in parallel (one per benchmark) and one report.

:func:`merge_summaries` joins the ``summary.json`` of several :func:`sao_core.eval.run.evaluate`
runs of the same model into one summary of the same shape (benchmarks, flat metrics, timing, the
comparison with a previous run), which :func:`sao_core.eval.report.write_report` renders.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from sao_core import storage
from sao_core.config import ConfigError


def _time(value: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def merge_summaries(summaries: list[dict[str, Any]], previous: dict[str, Any] | None = None,
                    previous_uri: str | None = None) -> dict[str, Any]:
    """One summary from the summaries of several evaluation runs of one model (disjoint benchmarks).

    Raises ConfigError if the runs evaluated different models (or adapters) or the same benchmark twice.
    """
    from sao_core.eval.metrics import compare

    if not summaries:
        raise ConfigError("no evaluation summaries to merge")
    models = sorted({str(s.get("model")) for s in summaries})
    if len(models) != 1:
        raise ConfigError(f"the evaluation runs evaluated different models ({', '.join(models)}); a report covers one")
    adapters = sorted({f"{s.get('adapter') or ''} {s.get('adapter_sha256') or ''}".strip() or "none"
                       for s in summaries})
    if len(adapters) != 1:
        raise ConfigError(f"the evaluation runs applied different LoRA adapters ({', '.join(adapters)}); a report "
                          "covers one model")
    benchmarks: dict[str, Any] = {}
    metrics: dict[str, float] = {}
    files: dict[str, Any] = {}
    for summary in summaries:
        for name, bench in summary.get("benchmarks", {}).items():
            if name in benchmarks:
                raise ConfigError(f"benchmark {name!r} appears in two evaluation runs; evaluate each benchmark once")
            benchmarks[name] = bench
            files[name] = summary.get("files", {})
        metrics.update(summary.get("metrics", {}))
    starts = [t for t in (_time(s.get("started_at")) for s in summaries) if t]
    ends = [t for t in (_time(s.get("finished_at")) for s in summaries) if t]
    config = dict(summaries[0].get("config", {}))
    config["benchmarks"] = list(benchmarks)
    merged = {
        "schema": summaries[0].get("schema"), "model": models[0], "adapter": summaries[0].get("adapter"),
        "adapter_sha256": summaries[0].get("adapter_sha256"), "engine": summaries[0].get("engine"),
        "config": config, "benchmarks": benchmarks, "metrics": metrics,
        "started_at": min(starts).isoformat(timespec="seconds") if starts else None,
        "finished_at": max(ends).isoformat(timespec="seconds") if ends else None,
        "seconds": (max(ends) - min(starts)).total_seconds() if starts and ends
        else max(float(s.get("seconds") or 0) for s in summaries),
        "samples_generated": sum(int(s.get("samples_generated") or 0) for s in summaries),
        "samples_reused": sum(int(s.get("samples_reused") or 0) for s in summaries),
        "files": files, "comparison": None,
    }
    if previous is not None:
        merged["comparison"] = {"model": previous.get("model"), "finished_at": previous.get("finished_at"),
                                "previous": previous_uri, "metrics": compare(metrics, previous.get("metrics", {}))}
    return merged


def load_samples(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-sample records of an evaluation run (its ``samples.jsonl``, local or s3://)."""
    uri = summary.get("files", {}).get("samples")
    if not uri:
        raise ConfigError(f"the summary of {summary.get('model')} names no samples file")
    text = storage.read_text(uri)
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line:
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a torn last line of an interrupted run
    return rows


def training_run_of(model_uri: str) -> str:
    """The run folder (or ``s3://`` prefix) that wrote `model_uri`: every training step of the pipelines
    publishes its model as ``<run>/model``, so the run is the model's parent (its metrics.jsonl and
    training report are there)."""
    return model_uri.rstrip("/").rsplit("/", 1)[0] if "/" in model_uri.rstrip("/") else "."
