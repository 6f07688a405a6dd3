"""Live metrics where people look: TensorBoard event files (read back with TensorBoard's own event reader),
their upload to an s3:// output while the run runs, MLflow, and the learner's Prometheus endpoint scraped
during a real run; a sink that cannot work warns and the run goes on."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import struct
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from rl_data import tool_arith_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from sao_core import storage
from sao_core.data.prepare import PrepareConfig, prepare
from sao_core.data.synthetic import tool_arith_sft_rows
from sao_core.training import live
from sao_core.training.metrics_log import MetricsLog


def f32(value: float) -> float:
    """`value` as TensorBoard stores a scalar (float32)."""
    return struct.unpack("f", struct.pack("f", value))[0]


def events(log_dir: Path | str) -> dict[str, dict[int, float]]:
    """tag -> {step: value} of every scalar in the event files of `log_dir`, a folder or an s3:// prefix
    (TensorBoard's reader)."""
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def lines(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def assert_events_equal_lines(found: dict[str, dict[int, float]], records: list[dict]) -> None:
    """Every tag of every metrics line is in the event files at the line's step with the line's value, and
    nothing else is."""
    expected: dict[str, dict[int, float]] = {}
    for record in records:
        for tag, value in live.scalars(record).items():
            expected.setdefault(tag, {})[record["step"]] = f32(value)
    assert found == expected


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


@pytest.fixture(scope="module")
def sft_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("live-sft")
    raw = root / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(48, seed=11)))
    prepare(PrepareConfig(source=str(raw), kind="sft", output=str(root / "sft")))
    return str(root / "sft")


@pytest.fixture(scope="module")
def rl_data(tmp_path_factory):
    return tool_arith_rl(tmp_path_factory.mktemp("live-rl") / "rl", 200, seed=3)


def _sft(data, output, sao_cache, **kw):
    from sao_core.training.config import SFTConfig

    return SFTConfig(**{"data": data, "output": str(output), "steps": 3, "batch_size": 4, "max_tokens": 96,
                        "lr": 3e-3, "warmup_steps": 0, "cache_dir": str(sao_cache), **kw})


# --------------------------------------------------------------------------------------------- the tags
def test_one_mapping_from_a_metrics_line_to_tags():
    sft = live.scalars({"step": 3, "loss": 1.5, "lr": 1e-3, "grad_norm": 0.5, "tokens": 80.0, "seconds": 2.0,
                        "eval_accuracy": 0.25})
    assert sft == {"train/loss": 1.5, "train/lr": 1e-3, "train/grad_norm": 0.5, "train/tokens": 80.0,
                   "perf/seconds": 2.0, "eval/accuracy": 0.25}
    rl = live.scalars({"step": 2, "version": 1, "reward_mean": 0.5, "policy_kept": 0.9, "policy_masked_low": 0.1,
                       "critic_loss": 0.2, "entropy": 1.1, "staleness": {"0": 6, "2": 2}, "replayed": True,
                       "dropped_by_reason": {"stale": 3}, "dropped_total": 3, "learner_wait_s": 1.0, "update_s": 3.0,
                       "generator_idle_share": 0.4, "trained_tokens_mean": None, "eval_sampled": {"reward": 0.3}})
    assert rl == {"rl/version": 1.0, "rl/reward_mean": 0.5, "rl/policy_kept": 0.9, "rl/policy_masked_low": 0.1,
                  "train/critic_loss": 0.2, "train/entropy": 1.1, "rl/staleness/0": 6.0, "rl/staleness/2": 2.0,
                  "rl/staleness_mean": 0.5, "rl/staleness_max": 2.0, "rl/dropped_by_reason/stale": 3.0,
                  "rl/dropped_total": 3.0, "perf/learner_wait_s": 1.0, "perf/update_s": 3.0,
                  "perf/learner_wait_share": 0.25, "perf/generator_idle_share": 0.4, "eval/sampled/reward": 0.3}


# ----------------------------------------------------------------------------------------- TensorBoard
def test_sft_writes_tensorboard_events_equal_to_its_metrics_lines(sft_data, tmp_path, sao_cache):
    from sao_core.training.trainer import train

    train("sft", _sft(sft_data, tmp_path / "run", sao_cache, steps=5, log_every=2))
    records = lines(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4, 5]           # every log_every steps and the last
    found = events(tmp_path / "run" / "tensorboard")
    assert {"train/loss", "train/lr", "train/grad_norm", "perf/seconds"} <= found.keys()
    assert found["train/loss"] == {r["step"]: f32(r["loss"]) for r in records}
    assert_events_equal_lines(found, records)


def test_s3_event_files_reach_the_output_while_training(moto_s3, sft_data, sao_cache, monkeypatch):
    """At step k the event file under <output>/tensorboard/ on S3 already holds step k, read by TensorBoard's
    own reader straight from s3:// (boto3, S3_ENDPOINT: what a Kubeflow Tensorboard pointed there runs)."""
    from sao_core.training.trainer import train

    monkeypatch.setenv("S3_ENDPOINT", moto_s3.endpoint_url)
    out = moto_s3.uri("runs/live")
    seen: dict[int, list[int]] = {}

    def progress(step, record):
        seen[step] = sorted(events(f"{out}/tensorboard").get("train/loss", {}))

    train("sft", _sft(sft_data, out, sao_cache, log_every=1), progress=progress)
    assert seen == {1: [1], 2: [1, 2], 3: [1, 2, 3]}
    assert_events_equal_lines(events(f"{out}/tensorboard"),
                              [json.loads(x) for x in storage.read_text(f"{out}/metrics.jsonl").splitlines()])


def test_a_resumed_log_hides_the_steps_logged_again_and_a_fresh_one_replaces_the_files(tmp_path):
    out = tmp_path / "run"
    with MetricsLog(str(out), out / "metrics.jsonl", resume=False, sinks=[live.TensorBoardSink()]) as metrics:
        for step in range(1, 5):
            metrics.append({"step": step, "loss": float(step)})
    # Killed after step 4, resumed from a checkpoint at step 2: steps 3 and 4 are trained (and logged) again.
    # (A later second: event files are read in name order, and their names start with the second they began.)
    time.sleep(1.02 - time.time() % 1)
    with MetricsLog(str(out), out / "metrics.jsonl", resume=True, keep_through=2,
                    sinks=[live.TensorBoardSink()]) as metrics:
        for step in (3, 4):
            metrics.append({"step": step, "loss": 10.0 * step})
    assert events(out / "tensorboard")["train/loss"] == {1: 1.0, 2: 2.0, 3: 30.0, 4: 40.0}
    with MetricsLog(str(out), out / "metrics.jsonl", resume=False, sinks=[live.TensorBoardSink()]) as metrics:
        metrics.append({"step": 1, "loss": 7.0})
    assert events(out / "tensorboard")["train/loss"] == {1: 7.0}
    assert len(list((out / "tensorboard").glob("events.out.tfevents.*"))) == 1


def test_an_unwritable_tensorboard_dir_warns_and_the_lines_are_still_written(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    (out / "tensorboard").write_text("a file where the event files' folder should be")
    caplog.set_level(logging.WARNING, logger="sao_core.training.metrics_log")
    with MetricsLog(str(out), out / "metrics.jsonl", resume=False, sinks=[live.TensorBoardSink()]) as metrics:
        metrics.append({"step": 1, "loss": 1.0})
        metrics.append({"step": 2, "loss": 0.5})
        assert metrics.sinks == []
    assert [r["step"] for r in lines(out / "metrics.jsonl")] == [1, 2]
    assert caplog.text.count("TensorBoard: start failed, the run goes on without it") == 1


# ----------------------------------------------------------------------------------- learner (RL) run
def test_learner_events_and_prometheus_metrics_equal_its_metrics_lines(rl_data, tmp_path, sao_cache,
                                                                       tiny_model_dir):
    """A real 2-step SAO run with --metrics-port: /metrics, scraped right after each step's line is written,
    shows that line's values; the event files hold every line's tags; the endpoint is gone after the run."""
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl

    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    scraped: dict[int, tuple[dict, dict]] = {}

    def progress(step, record):
        scraped[step] = (scrape(url), dict(record))

    out = tmp_path / "run"
    train_rl(RLConfig(data=rl_data, output=str(out), model=tiny_model_dir, steps=2, batch_size=8,
                      critic_warmup_steps=1, policy_lr=3e-4, critic_lr=3e-4, max_new_tokens_per_turn=12,
                      max_total_tokens=80, cache_dir=str(sao_cache), metrics_port=port), progress=progress)
    records = lines(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for record in records:
        metrics, seen = scraped[record["step"]]
        assert seen == record
        values = live.scalars(record)

        def gauge(name, metrics=metrics, **labels):
            return metrics[(f"sao_learner_{name}", tuple(sorted(labels.items())))]

        assert gauge("step") == record["step"] and gauge("policy_version") == record["version"]
        assert gauge("reward_mean") == record["reward_mean"]
        assert gauge("staleness_mean") == values["rl/staleness_mean"]
        assert gauge("staleness_max") == values["rl/staleness_max"]
        for staleness, count in record["staleness"].items():
            assert gauge("batch_by_staleness", staleness=staleness) == count
        assert gauge("dropped_trajectories") == record["dropped_total"]
        for reason, count in record["dropped_by_reason"].items():
            assert gauge("dropped_by_reason", reason=reason) == count
        assert gauge("learner_wait_share") == record["learner_wait_s"] / (record["learner_wait_s"] + record["update_s"])
        assert gauge("generator_idle_share") == record["generator_idle_share"]
        assert gauge("weight_push_seconds") == record["weight_push_s"]
        assert gauge("critic_loss") == record["critic_loss"]
        assert gauge("last_step_timestamp_seconds") > 0
    assert "policy_kept" not in records[0]                   # step 1 only trains the critic (warm-up)
    assert scraped[2][0][("sao_learner_policy_kept", ())] == records[1]["policy_kept"]
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        scrape(url)
    found = events(out / "tensorboard")
    assert {"rl/reward_mean", "rl/version", "rl/policy_kept", "rl/staleness_mean", "train/critic_loss",
            "train/entropy", "perf/learner_wait_share", "perf/generator_idle_share", "perf/weight_push_s"} <= found.keys()
    assert_events_equal_lines(found, records)


def test_the_prometheus_endpoint_serves_labelled_gauges_and_a_taken_port_only_warns(tmp_path, caplog):
    port = free_port()
    sink = live.PrometheusSink(port, host="127.0.0.1")
    out = tmp_path / "run"
    record = {"step": 7, "version": 5, "reward_mean": 0.25, "staleness": {"0": 3, "1": 1},
              "dropped_by_reason": {"stale": 2, "env_error": 1}, "dropped_total": 3, "requeued_total": 1}
    with MetricsLog(str(out), out / "metrics.jsonl", resume=False, sinks=[sink]) as metrics:
        metrics.append(record)
        got = scrape(f"http://127.0.0.1:{port}/metrics")
        assert got[("sao_learner_dropped_by_reason", (("reason", "env_error"),))] == 1
        assert got[("sao_learner_dropped_by_reason", (("reason", "stale"),))] == 2
        assert got[("sao_learner_batch_by_staleness", (("staleness", "1"),))] == 1
        assert got[("sao_learner_requeued_trajectories", ())] == 1
        assert got[("sao_learner_staleness_mean", ())] == 0.25
        metrics.append({**record, "step": 8, "staleness": {"0": 4}})
        got = scrape(f"http://127.0.0.1:{port}/metrics")
        assert ("sao_learner_batch_by_staleness", (("staleness", "1"),)) not in got   # this step's batch only
        caplog.set_level(logging.WARNING, logger="sao_core.training.metrics_log")
        with MetricsLog(str(tmp_path / "other"), tmp_path / "other" / "metrics.jsonl", resume=False,
                        sinks=[live.PrometheusSink(port, host="127.0.0.1")]) as second:
            second.append(record)
        assert "Prometheus: start failed, the run goes on without it" in caplog.text


def test_the_metrics_port_is_off_by_default_and_checked(monkeypatch):
    from sao_core.learner.config import RLConfig

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    config = RLConfig(data="d", output="o")
    assert config.metrics_port == 0
    assert [type(s) for s in live.run_sinks(config, "sao")] == [live.TensorBoardSink]
    config.metrics_port = 70000
    with pytest.raises(ValueError, match="metrics_port must be 0 \\(off\\) or a TCP port"):
        config.validate()


def test_the_trainjob_learner_exposes_its_metrics_port():
    from sao_core.cluster import launcher, manifests, names
    from sao_core.cluster.names import ClusterConfigError

    spec = manifests.RuntimeSpec(image="reg/learner:1", rollout_image="reg/rollout:1")
    runtime = manifests.runtime_manifest(spec)
    node = runtime["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["spec"]["template"]["spec"][
        "containers"][0]
    assert node["ports"] == [{"name": "metrics", "containerPort": 9400, "protocol": "TCP"}]
    assert {"name": names.ENV_LEARNER_METRICS_PORT, "value": "9400"} in node["env"]
    off = manifests.runtime_manifest(manifests.RuntimeSpec(image="a", rollout_image="b", learner_metrics_port=0))
    assert "ports" not in off["spec"]["template"]["spec"]["replicatedJobs"][1]["template"]["spec"]["template"][
        "spec"]["containers"][0]
    config = launcher.LaunchConfig(image="a", rollout_image="b", data="s3://d/rl", output="s3://o/run", run_id="r1",
                                   rl_options={"metrics_port": 9000})
    with pytest.raises(ClusterConfigError, match="rl_options may not set metrics_port"):
        config.validate()


# ----------------------------------------------------------------------------------------------- MLflow
def test_an_unreachable_mlflow_server_warns_once_and_training_goes_on(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    from sao_core.training.config import SFTConfig

    sinks = live.run_sinks(SFTConfig(data="d", output=str(tmp_path / "run")), "sft")
    assert [s.name for s in sinks] == ["TensorBoard", "MLflow"]
    caplog.set_level(logging.WARNING, logger="sao_core.training.metrics_log")
    out = tmp_path / "run"
    with MetricsLog(str(out), out / "metrics.jsonl", resume=False, sinks=sinks) as metrics:
        for step in (1, 2, 3):
            metrics.append({"step": step, "loss": 1.0 / step})
            metrics.sync()
    assert caplog.text.count("MLflow: start failed, the run goes on without it") == 1
    assert [r["step"] for r in lines(out / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(events(out / "tensorboard")["train/loss"]) == [1, 2, 3]


#: A virtual environment with full mlflow (the tracking server): `make mlflow-server`. Not the project's
#: venv, whose mlflow-skinny is the client: full mlflow requires pyarrow < 26.
MLFLOW_SERVER_VENV = Path(os.environ.get("SAO_MLFLOW_SERVER_VENV")
                          or Path(__file__).resolve().parents[2] / ".venv-mlflow-server")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """``http://127.0.0.1:PORT`` of a real MLflow tracking server (sqlite backend, one worker) run from
    MLFLOW_SERVER_VENV for this module; skipped when that venv has no ``mlflow``."""
    command = MLFLOW_SERVER_VENV / "bin" / "mlflow"
    if not command.exists():
        pytest.skip(f"no MLflow tracking server: {command} is missing (make mlflow-server, or set "
                    f"SAO_MLFLOW_SERVER_VENV to a venv with mlflow)")
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = root / "server.log"
    # No background job runner (the server's huey consumer), nothing of this process's Python or MLflow setup.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "MLFLOW_", "VIRTUAL_ENV"))}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"
    with log_path.open("wb") as log_file:
        server = subprocess.Popen(
            [str(command), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
             "--default-artifact-root", str(root / "artifacts")],
            cwd=root, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(sig: int) -> None:
        try:
            os.killpg(server.pid, sig)   # the mlflow command and the uvicorn it starts
        except ProcessLookupError:
            pass

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                stop(signal.SIGKILL)
                tail = log_path.read_text(errors="replace")[-4000:]
                state = f"exited with {server.returncode}" if server.poll() is not None else "no /health in 60 s"
                pytest.fail(f"MLflow tracking server at {url} did not start ({state}); {log_path} ends:\n{tail}")
            time.sleep(0.25)
        yield url
    finally:   # killed outright: a throwaway server (its graceful stop took ~1.6 s and is nobody's claim)
        stop(signal.SIGKILL)
        server.wait(timeout=10)


@pytest.fixture(scope="module", params=["file-store", "server"])
def mlflow_uri(request, tmp_path_factory):
    """MLflow's own file store (real MLflow storage, read back with MlflowClient), and a real tracking server
    over HTTP (:func:`mlflow_server`; skipped without its venv)."""
    pytest.importorskip("mlflow", reason="mlflow is optional (pip install 'sao-kfp[mlflow]'; the dev extra has it)")
    if request.param == "server":
        return request.getfixturevalue("mlflow_server")
    return (tmp_path_factory.mktemp("mlflow") / "store").as_uri()


def test_mlflow_gets_the_params_once_and_every_lines_tags(mlflow_uri, sft_data, tmp_path, sao_cache, monkeypatch):
    from mlflow.tracking import MlflowClient

    from sao_core.training.trainer import train

    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sao-live-test")
    if mlflow_uri.startswith("file:"):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")   # MLflow 3 keeps its file store for those who ask
    out = tmp_path / "runs" / "r1" / "sft"
    train("sft", _sft(sft_data, out, sao_cache, log_every=1))
    records = lines(out / "metrics.jsonl")
    client = MlflowClient(tracking_uri=mlflow_uri)
    experiment = client.get_experiment_by_name("sao-live-test")
    (run,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`sao.output` = '{out}'")
    assert (run.info.run_name, run.info.status) == ("r1/sft", "FINISHED")
    assert run.data.tags["sao.method"] == "sft"
    assert (run.data.params["method"], run.data.params["lr"], run.data.params["steps"]) == ("sft", "0.003", "3")
    expected: dict[str, list[tuple[int, float]]] = {}
    for record in records:
        for tag, value in live.scalars(record).items():
            expected.setdefault(tag, []).append((record["step"], value))
    assert set(run.data.metrics) == set(expected)
    for tag, points in expected.items():
        history = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, tag))
        assert history == points, tag

    # A resumed run logs into the same MLflow run (found by its output).
    with MetricsLog(str(out), out / "metrics.jsonl", resume=True,
                    sinks=[live.MLflowSink(mlflow_uri, {}, "sft")]) as metrics:
        metrics.append({"step": 4, "loss": 0.125})
    (again,) = client.search_runs([experiment.experiment_id], filter_string=f"tags.`sao.output` = '{out}'")
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == [1, 2, 3, 4]


@pytest.mark.parametrize("name", ["it's", 'say "hi"', "back\\slash 'and' \"both\""])
def test_a_resumed_log_finds_the_mlflow_run_of_an_output_with_quotes(name, mlflow_uri, tmp_path, monkeypatch):
    """MLflow's filter strings have no escapes: the run of an output with a quote or a backslash is still found,
    and not the run of an output that differs from it just there."""
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "sao-quotes-test")
    if mlflow_uri.startswith("file:"):
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    out, near = tmp_path / name / "run", tmp_path / name.replace("'", "_").replace('"', "_") / "run"
    ids = {}
    for path, resume, step in ((out, False, 1), (near, False, 1), (out, True, 2)):
        sink = live.MLflowSink(mlflow_uri, {}, "sft")
        with MetricsLog(str(path), path / "metrics.jsonl", resume=resume, sinks=[sink]) as metrics:
            metrics.append({"step": step, "loss": 1.0 / step})
            assert metrics.sinks == [sink]
        ids.setdefault(path, set()).add(sink.run_id)
    assert len(ids[out]) == 1 and ids[out] != ids[near]
    history = MlflowClient(tracking_uri=mlflow_uri).get_metric_history(ids[out].pop(), "train/loss")
    assert sorted((m.step, m.value) for m in history) == [(1, 1.0), (2, 0.5)]
