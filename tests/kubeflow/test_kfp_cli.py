"""`sao kfp compile|upload|run|schedule|schedules` and `sao demo --pipeline` wiring: real commands
against the loopback KFP API server of test_kfp_client (held to the official API specification);
errors are one line on stderr with exit code 2."""

from __future__ import annotations

import json
import socket

import pytest
import yaml
from test_kfp_client import FakeKFP

from sao_core.cli import main


@pytest.fixture
def server():
    fake = FakeKFP()
    yield fake
    fake.close()
    assert not fake.violations, fake.violations


def _sao(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_compile_with_cluster_settings(tmp_path, capsys):
    """The cluster flags reach the package. One pipeline (sao_rl, which has every kind of step the flags touch):
    these settings are compiled by no other test, and post_training alone took 3-5 s more. That `sao kfp compile`
    without --pipeline compiles all three (this was test_compile_all_with_cluster_settings) is checked by
    test_kfp_docs::test_command_line_examples_run_as_written."""
    code, out, _ = _sao(capsys, "kfp", "compile", "--pipeline", "sao_rl", "--output-dir", str(tmp_path),
                        "--queue-name", "team-b", "--image-rollout", "reg.test/vllm:1", "--shm-size", "32Gi",
                        "--data-retries", "1")
    assert code == 0
    assert out.split() == [str(tmp_path / "sao_rl.yaml")]
    docs = list(yaml.safe_load_all((tmp_path / "sao_rl.yaml").read_text()))
    executors = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert all(e["podMetadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "team-b"} for e in executors.values())
    assert {m["sizeLimit"] for e in executors.values() for m in e.get("emptyDirMounts", [])} == {"32Gi"}
    images = {e["container"]["image"] for e in docs[0]["deploymentSpec"]["executors"].values()}
    assert "reg.test/vllm:1" in images
    retries = {t.get("retryPolicy", {}).get("maxRetryCount") for t in docs[0]["root"]["dag"]["tasks"].values()}
    assert 1 in retries
    params = docs[0]["root"]["inputDefinitions"]["parameters"]
    assert params["b_engine"]["literals"] == ["vllm", "hf"]


def test_compile_refuses_bad_settings_in_one_line(tmp_path, capsys):
    code, _, err = _sao(capsys, "kfp", "compile", "--output-dir", str(tmp_path), "--queue-name", "Team B")
    assert code == 2 and err.count("\n") == 1
    assert err.startswith("sao kfp: error: bad cluster setting: queue_name 'Team B' is not a valid Kubernetes label")


def test_upload_run_schedule_list_disable(server, capsys):
    code, out, _ = _sao(capsys, "kfp", "upload", "--host", server.url, "--pipeline", "evaluation", "--name",
                        "sao-evaluation")
    assert code == 0
    uploaded = json.loads(out)
    assert uploaded["new_pipeline"] is True
    code, out, _ = _sao(capsys, "kfp", "upload", "--host", server.url, "--pipeline", "evaluation", "--name",
                        "sao-evaluation", "--version", "v2")
    assert code == 0 and json.loads(out)["version_name"] == "v2" and json.loads(out)["new_pipeline"] is False

    code, out, _ = _sao(capsys, "kfp", "run", "--host", server.url, "--experiment", "evals", "--run-name", "r1",
                        "--pipeline-id", uploaded["pipeline_id"], "--version-id", uploaded["version_id"],
                        "--param", "a0_model=s3://b/m", "--param", "a0_output_root=s3://b/runs", "--param", "c_k=8",
                        "--param", 'c_benchmarks=["beyond_aime"]')
    assert code == 0, out
    body = server.of("RunService_CreateRun")[0]["body"]
    assert body["runtime_config"]["parameters"] == {"a0_model": "s3://b/m", "a0_output_root": "s3://b/runs", "c_k": 8,
                                                    "c_benchmarks": ["beyond_aime"]}
    assert json.loads(out)["run_id"] == body.get("run_id", json.loads(out)["run_id"])

    code, out, _ = _sao(capsys, "kfp", "schedule", "--host", server.url, "--experiment", "evals", "--name", "nightly",
                        "--cron", "0 0 2 * * *", "--pipeline", "evaluation", "--param", "a0_model=s3://b/m",
                        "--param", "a0_output_root=s3://b/runs", "--start-time", "2026-12-01T00:00:00+00:00")
    assert code == 0, out
    created = json.loads(out)
    body = server.of("RecurringRunService_CreateRecurringRun")[0]["body"]
    assert body["trigger"] == {"cron_schedule": {"cron": "0 0 2 * * *", "start_time": "2026-12-01T00:00:00Z"}}
    assert body["max_concurrency"] == 1 and body["no_catchup"] is True and body["mode"] == "ENABLE"

    code, out, _ = _sao(capsys, "kfp", "schedules", "list", "--host", server.url, "--experiment", "evals")
    assert code == 0 and [r["name"] for r in json.loads(out)] == ["nightly"]
    code, out, _ = _sao(capsys, "kfp", "schedules", "disable", created["recurring_run_id"], "--host", server.url)
    assert code == 0 and "disabled" in out
    code, out, _ = _sao(capsys, "kfp", "schedules", "list", "--host", server.url)
    assert json.loads(out)[0]["status"] == "DISABLED"


@pytest.mark.parametrize("argv, message", [
    (["--cron", "0 2 * * *"], "has 5 fields; KFP reads six fields with seconds first"),
    (["--cron", "0 0 2 * * *", "--max-concurrency", "0"], "max_concurrency must be an integer from 1 to 10"),
    (["--cron", "0 0 2 * * *", "--param", "kk=1"], "unknown pipeline parameter 'kk'"),
    (["--cron", "0 0 2 * * *", "--param", "c_k=x"], "needs a JSON value"),
    (["--cron", "0 0 2 * * *", "--param", "c_engine=trt"], "'c_engine' must be one of vllm, hf"),
    (["--cron", "0 0 2 * * *", "--start-time", "tomorrow"], "is not an ISO 8601 time"),
    (["--cron", "0 0 2 * * *", "--start-time", "2026-12-01T00:00:00"], "has no time zone"),
])
def test_schedule_errors_are_one_line_before_any_request(server, capsys, argv, message):
    code, _, err = _sao(capsys, "kfp", "schedule", "--host", server.url, "--experiment", "e", "--name", "n",
                        "--pipeline", "evaluation", "--param", "a0_model=m", "--param", "a0_output_root=r", *argv)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert err.startswith("sao kfp: error: ")
    assert server.requests == []


def test_unreachable_host_is_one_line(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, _, err = _sao(capsys, "kfp", "schedules", "list", "--host", f"http://127.0.0.1:{port}")
    assert code == 2 and err.count("\n") == 1
    assert f"cannot reach the KFP API at http://127.0.0.1:{port}" in err


def test_demo_pipeline_flag_is_wired(monkeypatch, capsys, tmp_path):
    import sao_core.demo as local

    seen = {}

    def fake_demo(output, cache_dir, **kwargs):  # the real one is covered by test_pipelines_local (slow)
        seen.update(output=output, **kwargs)
        return {"report": "R.html", "evaluation_summary": "S.json", "sao_metrics": "M.jsonl", "output": str(output),
                "summary_file": "summary.json", "pipeline_seconds": 1.0,
                "held_out": {"prompts": 128, "samples_per_prompt": 2, "steps": [0, 10, 20], "sampled_before": 0.25,
                             "sampled_after": 0.5, "greedy_before": 0.3, "greedy_after": 0.6}}

    monkeypatch.setattr(local, "run_sao_rl_demo", fake_demo)
    code, out, _ = _sao(capsys, "--threads", "1", "demo", "--pipeline", "--output", str(tmp_path), "--steps", "7")
    assert code == 0 and seen["warm_start_steps"] == 7 and seen["threads"] == 1
    assert "HTML report: R.html" in out and "Evaluation metrics: S.json" in out
    assert "Held-out sampled reward (T = 1, 128 prompts x 2 samples, evaluated during training at steps 0, 10, 20): " \
           "0.250 before SAO -> 0.500 after (greedy 0.300 -> 0.600)" in out
    seen.clear()
    code, out, _ = _sao(capsys, "demo", "--pipeline", "--output", str(tmp_path))
    assert code == 0 and "warm_start_steps" not in seen       # without --steps: the demo's own warm start
