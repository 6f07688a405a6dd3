"""MetricsLog: metrics.jsonl reaches a local or s3:// output while the run runs, and when it fails."""

from __future__ import annotations

import json
import logging

import pytest

from sao_core import storage
from sao_core.training.metrics_log import MetricsLog


class Boom(Exception):
    pass


def _steps(text: str) -> list[int]:
    return [json.loads(line)["step"] for line in text.splitlines()]


def test_local_output_is_the_file_itself(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    with MetricsLog(str(tmp_path / "run"), path, resume=False) as metrics:
        metrics.append({"step": 1})
        assert _steps(path.read_text()) == [1]        # flushed at once
        assert metrics.sync()                         # nothing to copy
    with MetricsLog(str(tmp_path / "run"), path, resume=True) as metrics:
        metrics.append({"step": 2})
    assert _steps(path.read_text()) == [1, 2]
    with MetricsLog(str(tmp_path / "run"), path, resume=False) as metrics:
        metrics.append({"step": 9})
    assert _steps(path.read_text()) == [9]


def test_s3_output_gets_the_lines_at_each_sync_and_at_exit(moto_s3, tmp_path):
    out, uri = moto_s3.uri("run"), moto_s3.uri("run/metrics.jsonl")
    with pytest.raises(Boom), MetricsLog(out, tmp_path / "a" / "metrics.jsonl", resume=False) as metrics:
        metrics.append({"step": 1})
        assert not storage.exists(uri)
        assert metrics.sync()
        assert _steps(storage.read_text(uri)) == [1]
        metrics.append({"step": 2})
        raise Boom
    assert _steps(storage.read_text(uri)) == [1, 2], "the exit synced although an exception left the block"


def test_s3_resume_keeps_earlier_lines_without_the_local_file(moto_s3, tmp_path):
    out, uri = moto_s3.uri("run"), moto_s3.uri("run/metrics.jsonl")
    with MetricsLog(out, tmp_path / "a" / "metrics.jsonl", resume=False) as metrics:
        metrics.append({"step": 1})
    with MetricsLog(out, tmp_path / "b" / "metrics.jsonl", resume=True) as metrics:  # a new pod: no local copy
        metrics.append({"step": 2})
    assert _steps(storage.read_text(uri)) == [1, 2]
    with MetricsLog(out, tmp_path / "b" / "metrics.jsonl", resume=False) as metrics:
        metrics.append({"step": 1})
    assert _steps(storage.read_text(uri)) == [1]


def test_a_failed_sync_warns_while_running_and_raises_at_a_normal_exit(moto_s3, tmp_path, fail_metrics_sync_once,
                                                                       caplog):
    out, uri = moto_s3.uri("run"), moto_s3.uri("run/metrics.jsonl")
    caplog.set_level(logging.WARNING, logger="sao_core.training.metrics_log")
    failed = fail_metrics_sync_once(1)
    with MetricsLog(out, tmp_path / "metrics.jsonl", resume=False) as metrics:
        metrics.append({"step": 1})
        assert not metrics.sync() and failed == [uri]
        assert "could not update" in caplog.text
        metrics.append({"step": 2})
    assert _steps(storage.read_text(uri)) == [1, 2]
    fail_metrics_sync_once(1)
    with pytest.raises(storage.StorageError, match="injected"), \
            MetricsLog(out, tmp_path / "metrics.jsonl", resume=False) as metrics:
        metrics.append({"step": 1})


def test_disabled_does_nothing(moto_s3, tmp_path):
    with MetricsLog(moto_s3.uri("run"), tmp_path / "metrics.jsonl", resume=False, enabled=False) as metrics:
        metrics.append({"step": 1})
        assert metrics.sync()
    assert not (tmp_path / "metrics.jsonl").exists() and not storage.exists(moto_s3.uri("run/metrics.jsonl"))
