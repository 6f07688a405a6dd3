"""The TrainJob launcher against a Kubernetes API server on 127.0.0.1 (tests/cluster/test_cluster_api_server.py).

Each test drives the TrainJob's status the way Kueue and Kubeflow Trainer would (suspend / admit,
jobsStatus, Complete / Failed conditions, pods and their logs) and checks that every path ends as it
should: success returns the verified final checkpoint, failure raises with the reason and the log,
timeout and cancellation delete the TrainJob, a re-started launcher re-attaches. The "learner" is the
test publishing a checkpoint to a real S3 server on loopback (moto).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml
from test_cluster_api_server import FakeKubeAPI, api_for

from sao_core import storage
from sao_core.cluster import launcher, names
from sao_core.cluster.launcher import LaunchConfig

REPO = Path(__file__).resolve().parents[2]
NS = "team-a"


@pytest.fixture
def kube():
    server = FakeKubeAPI()
    yield server
    server.stop()


def config(**overrides) -> LaunchConfig:
    values = dict(image="reg/learner:1", rollout_image="reg/rollout:1", data="s3://data/rl", output="s3://runs/r1/sao",
                  run_id="r1", stage="sao", namespace=NS, poll_s=0.05, timeout_s=30.0, rl_options={"steps": 3},
                  pod_error_grace_s=30.0)
    values.update(overrides)
    return LaunchConfig(**values)


def publish_final_model(tmp_path: Path, output: str, step: int = 3, version: int = 3, critic: bool = True) -> str:
    """What the learner publishes at the end of a run (model, critic, learner checkpoint, summary.json)."""
    src = tmp_path / "model"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "model.safetensors").write_bytes(b"weights" * 10)
    storage.publish_checkpoint(src, storage.join(output, "model"), metadata={"method": "sao", "step": step,
                                                                             "version": version})
    if critic:
        storage.publish_checkpoint(src, storage.join(output, "critic"), metadata={"step": step})
    checkpoint = storage.join(output, "checkpoints", f"step-{step:06d}")
    storage.publish_checkpoint(src, checkpoint, metadata={"step": step})
    storage.write_text(storage.join(output, "summary.json"), json.dumps(
        {"method": "sao", "steps": step, "version": version, "reward_first": 0.2, "reward_last": 0.5,
         "checkpoint": checkpoint, "model": storage.join(output, "model")}))
    storage.write_text(storage.join(output, "metrics.jsonl"), "".join(
        json.dumps({"step": s, "reward_mean": 0.1 * s}) + "\n" for s in range(1, step + 1)))
    return checkpoint


def start(kube: FakeKubeAPI, cfg: LaunchConfig, cancel: threading.Event | None = None):
    """Run launch() in a thread; returns (future, printed lines)."""
    lines: list[str] = []
    pool = ThreadPoolExecutor(1)
    future = pool.submit(launcher.launch, cfg, api_for(kube), cancel, lines.append)
    pool.shutdown(wait=False)
    return future, lines


def created(kube: FakeKubeAPI, name: str) -> dict:
    kube.wait_for(lambda: ("trainjobs", NS, name) in kube.objects)
    return kube.get("trainjobs", name, NS)


def allowed_by_rbac() -> set[tuple[str, str]]:
    """(verb, resource) pairs deploy/rbac.yaml grants the launcher."""
    allowed = set()
    for doc in yaml.safe_load_all((REPO / "deploy" / "rbac.yaml").read_text()):
        if doc and doc["kind"] in ("Role", "ClusterRole"):
            for rule in doc["rules"]:
                allowed |= {(verb, res) for verb in rule["verbs"] for res in rule["resources"]}
    return allowed


def test_success_returns_the_verified_final_checkpoint(kube, moto_s3, tmp_path):
    kube.local_queues.add((NS, "team-a-gpu"))
    output = moto_s3.uri("runs/r1/sao")
    cfg = config(output=output, queue_name="team-a-gpu", rollout_replicas=3)
    future, lines = start(kube, cfg)
    name = names.trainjob_name("r1", "sao")
    job = created(kube, name)
    # one workload: the runtime with both jobs, the Kueue label on the TrainJob, suspended until admission
    kube.wait_for(lambda: kube.objects[("trainingruntimes", NS, name)]["metadata"].get("ownerReferences"))
    runtime = kube.get("trainingruntimes", name, NS)
    assert {j["name"]: j.get("replicas", 1) for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]} == \
        {"rollout": 3, "node": 1}
    assert runtime["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]  # goes with its TrainJob
    # the run's rollout token: a random Secret per run, owned by the TrainJob, read by learner and replicas
    kube.wait_for(lambda: kube.objects[("secrets", NS, f"{name}-rollout-token")]["metadata"].get("ownerReferences"))
    secret = kube.get("secrets", f"{name}-rollout-token", NS)
    assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert len(token) >= 32 and token not in json.dumps(job) and not any(token in line for line in lines)
    assert {"name": "SAO_ROLLOUT_TOKEN", "valueFrom": {"secretKeyRef": {"name": f"{name}-rollout-token",
                                                                        "key": "token"}}} in job["spec"]["trainer"]["env"]
    assert job["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "team-a-gpu"
    assert job["spec"]["suspend"] is True
    args = job["spec"]["trainer"]["args"]
    assert args[0] == "--" and "--services" not in args and args[args.index("--output") + 1] == output
    time.sleep(0.2)
    kube.admit(NS, name)
    kube.add_pod(NS, f"{name}-node-0-0-abcde", {names.JOBSET_NAME_LABEL: name, names.REPLICATED_JOB_LABEL: "node",
                                                names.JOB_INDEX_LABEL: "0"})
    kube.set_jobs_status(NS, name, [{"name": "rollout", "active": 3, "ready": 3}, {"name": "node", "active": 1}])
    kube.log(NS, f"{name}-node-0-0-abcde", "all 3 rollout replica(s) are healthy", "step 1 reward 0.2")
    kube.wait_for(lambda: any("step 1 reward 0.2" in line for line in lines))
    kube.log(NS, f"{name}-node-0-0-abcde", "step 3 reward 0.5")
    checkpoint = publish_final_model(tmp_path, output)
    kube.wait_for(lambda: any("step 3 reward 0.5" in line for line in lines))
    kube.set_condition(NS, name, "Complete", "True", "JobSetCompleted", "done")
    result = future.result(timeout=20)
    assert result.state == "Complete" and result.name == name and result.namespace == NS
    assert result.model_uri == storage.join(output, "model")
    assert result.sha256 == storage.checkpoint_digest(result.model_uri)
    assert (result.method, result.step, result.version) == ("sao", 3, 3)
    assert result.checkpoint_uri == checkpoint and result.critic_uri == storage.join(output, "critic")
    assert result.queued_seconds >= 0.2
    # every log line printed once, in order
    logged = [line for line in lines if line.startswith(f"[{name}-node-0-0-abcde]")]
    assert [line.split("] ", 1)[1] for line in logged] == ["all 3 rollout replica(s) are healthy", "step 1 reward 0.2",
                                                          "step 3 reward 0.5"]
    assert any("waiting for admission by Kueue queue team-a-gpu" in line for line in lines)
    assert any("jobs: rollout: active 3, ready 3; node: active 1" in line for line in lines)
    # finished: the TrainJob and its runtime are gone; every API call was one deploy/rbac.yaml grants
    assert kube.get("trainjobs", name, NS) is None and kube.get("trainingruntimes", name, NS) is None
    assert kube.get("secrets", f"{name}-rollout-token", NS) is None
    assert set(kube.calls) <= allowed_by_rbac(), set(kube.calls) - allowed_by_rbac()
    assert not kube.rejected


def test_failure_raises_with_the_reason_and_the_log_and_deletes(kube):
    future, lines = start(kube, config())
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    kube.add_pod(NS, f"{name}-node-0-0-x", {names.JOBSET_NAME_LABEL: name, names.REPLICATED_JOB_LABEL: "node",
                                            names.JOB_INDEX_LABEL: "0"})
    kube.log(NS, f"{name}-node-0-0-x", "Traceback (most recent call last):", "RuntimeError: NCCL timeout")
    kube.wait_for(lambda: any("NCCL timeout" in line for line in lines))
    kube.set_condition(NS, name, "Failed", "True", "FailedJobs", "jobset failed: node job failed")
    with pytest.raises(launcher.TrainJobFailed) as err:
        future.result(timeout=20)
    assert err.value.reason == "FailedJobs" and "node job failed" in str(err.value)
    assert "RuntimeError: NCCL timeout" in str(err.value)
    assert kube.get("trainjobs", name, NS) is None


def test_failure_keeps_the_trainjob_when_asked(kube):
    future, _ = start(kube, config(keep_trainjob=True))
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    kube.set_condition(NS, name, "Failed", "True", "DeadlineExceeded", "too slow")
    with pytest.raises(launcher.TrainJobFailed, match="DeadlineExceeded"):
        future.result(timeout=20)
    assert kube.get("trainjobs", name, NS) is not None


def test_timeout_deletes_the_trainjob_and_says_so(kube):
    future, lines = start(kube, config(timeout_s=0.6))
    name = names.trainjob_name("r1", "sao")
    job = created(kube, name)
    assert job["spec"]["activeDeadlineSeconds"] == 1  # the server-side backstop
    with pytest.raises(launcher.LaunchTimeout, match=r"did not finish within timeout_s=0.6 s .*deleted"):
        future.result(timeout=20)
    assert kube.get("trainjobs", name, NS) is None and kube.get("trainingruntimes", name, NS) is None
    assert any("deleted TrainJob" in line and "timeout" in line for line in lines)


def test_admission_timeout_when_kueue_never_admits(kube):
    kube.local_queues.add((NS, "q"))
    future, _ = start(kube, config(queue_name="q", admission_timeout_s=0.4))
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    with pytest.raises(launcher.LaunchTimeout, match="not admitted within admission_timeout_s=0.4"):
        future.result(timeout=20)
    assert kube.get("trainjobs", name, NS) is None


def test_cancellation_deletes_the_trainjob(kube):
    cancel = threading.Event()
    future, _ = start(kube, config(), cancel)
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    cancel.set()
    with pytest.raises(launcher.LaunchCancelled, match="deleted"):
        future.result(timeout=20)
    assert kube.get("trainjobs", name, NS) is None and kube.get("trainingruntimes", name, NS) is None


SIGTERM_SCRIPT = """
import sys
from sao_core.cluster.api import KubeAPI
from sao_core.cluster.launcher import LaunchCancelled, LaunchConfig, launch
config = LaunchConfig(image="reg/learner:1", rollout_image="reg/rollout:1", data="s3://d/rl", output="s3://runs/r2/sao",
                      run_id="r2", namespace="team-a", poll_s=0.05)
try:
    launch(config, api=KubeAPI.connect(api_server=sys.argv[1]))
except LaunchCancelled as err:
    print(err, file=sys.stderr)
    sys.exit(130)
"""


def test_sigterm_cancels_the_launch_and_deletes_the_trainjob(kube, tmp_path):
    """KFP cancels a run by terminating the launcher's pod: SIGTERM to the process must delete the TrainJob."""
    proc = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, kube.url], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    name = names.trainjob_name("r2", "sao")
    try:
        kube.wait_for(lambda: ("trainjobs", NS, name) in kube.objects, timeout_s=60)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, (out, err)
    assert "received signal 15: cancelling" in out and "deleted" in err
    assert kube.get("trainjobs", name, NS) is None and kube.get("trainingruntimes", name, NS) is None


def test_pod_stuck_on_a_missing_secret_fails_the_run(kube):
    future, lines = start(kube, config(pod_error_grace_s=0.3))
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    kube.add_pod(NS, f"{name}-rollout-0-0-x", {names.JOBSET_NAME_LABEL: name, names.REPLICATED_JOB_LABEL: "rollout",
                                               names.JOB_INDEX_LABEL: "0"}, container="rollout",
                 waiting=("CreateContainerConfigError", 'secret "sao-s3" not found'))
    with pytest.raises(launcher.LaunchError, match=r"CreateContainerConfigError.*secret \"sao-s3\" not found"):
        future.result(timeout=20)
    assert kube.get("trainjobs", name, NS) is None
    assert sum(line.startswith("pod ") and "CreateContainerConfigError" in line for line in lines) == 1  # once


def test_a_restarted_launcher_reattaches_to_its_trainjob(kube, moto_s3, tmp_path):
    output = moto_s3.uri("runs/r1/sao")
    first = threading.Event()
    future, _ = start(kube, config(output=output, keep_trainjob=True), first)
    name = names.trainjob_name("r1", "sao")
    uid = created(kube, name)["metadata"]["uid"]
    # the first launcher's pod dies without clean-up (simulated by stopping its thread quietly)
    kube.forbidden.add(("delete", "trainjobs"))
    first.set()
    with pytest.raises(launcher.LaunchCancelled):
        future.result(timeout=20)
    kube.forbidden.clear()
    assert kube.get("trainjobs", name, NS)["metadata"]["uid"] == uid
    future, lines = start(kube, config(output=output))
    kube.wait_for(lambda: any("re-attaching" in line for line in lines))
    publish_final_model(tmp_path, output, critic=False)
    kube.set_condition(NS, name, "Complete")
    result = future.result(timeout=20)
    assert result.state == "Complete" and result.critic_uri == ""
    assert [c for c in kube.calls if c == ("create", "trainjobs")] == [("create", "trainjobs")] * 2  # 2nd: 409


def test_a_foreign_trainjob_of_the_same_name_is_not_adopted(kube):
    kube.add_object({"apiVersion": "trainer.kubeflow.org/v1alpha1", "kind": "TrainingRuntime",
                     "metadata": {"name": "sao-sao-r1", "namespace": NS, "labels": {}}, "spec": {}})
    with pytest.raises(launcher.LaunchError, match="already exists and was not created by this run"):
        launcher.launch(config(), api=api_for(kube), say=lambda s: None)


def test_complete_without_a_published_model_is_an_error(kube, moto_s3):
    future, _ = start(kube, config(output=moto_s3.uri("runs/empty")))
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    kube.set_condition(NS, name, "Complete")
    with pytest.raises(launcher.LaunchError, match="holds no complete checkpoint"):
        future.result(timeout=20)


def test_cluster_runtime_mode_uses_the_installed_runtime(kube):
    golden = yaml.safe_load((REPO / "deploy" / "runtime" / "sao-rl.yaml").read_text())
    lines: list[str] = []
    with pytest.raises(Exception, match="ClusterTrainingRuntime 'sao-rl' is not installed"):
        launcher.launch(config(cluster_runtime="sao-rl", rollout_image=""), api=api_for(kube), say=lines.append)
    api_for(kube).create(golden)  # what `kubectl apply -f deploy/runtime/sao-rl.yaml` does
    result = launcher.launch(config(cluster_runtime="sao-rl", rollout_image="", wait=False), api=api_for(kube),
                             say=lines.append)
    job = kube.get("trainjobs", result.name, NS)
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "ClusterTrainingRuntime",
                                         "name": "sao-rl"}
    assert kube.get("trainingruntimes", result.name, NS) is None
    assert any("runtime sao-rl: 2 rollout replica(s) on port 8000" in line for line in lines)


def test_bad_settings_fail_before_anything_is_created(kube):
    api = api_for(kube)
    cases = [
        (dict(queue_name="Team_A"), "not a valid Kueue LocalQueue name"),
        (dict(queue_name="missing-queue"), "LocalQueue 'missing-queue' does not exist in namespace team-a"),
        (dict(rollout_replicas=0), "rollout_replicas must be an integer in"),
        (dict(rollout_gpus=2, tensor_parallel_size=1), r"rollout_gpus \(2\) must equal tensor_parallel_size"),
        (dict(s3_secret_name=""), "s3_secret_name is empty"),
        (dict(output="/tmp/local"), "output must be an s3://"),
        (dict(rl_options={"services": ["http://x"]}), "rl_options may not set services"),
        (dict(rl_options={"stpes": 3}), "unknown field"),
        (dict(run_id=""), "run_id is empty"),
        (dict(name="x" * 60, rollout_replicas=100), "too long"),
        (dict(env={"PET_NNODES": "2"}), "may not be overridden"),
        (dict(tolerations=[{"key": "a", "operator": "Maybe"}]), "operator must be Equal or Exists"),
    ]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message):
            launcher.launch(config(**overrides), api=api, say=lambda s: None)
    assert not any(k[0] == "trainjobs" for k in kube.objects) and not kube.rejected


def test_kueue_not_installed_is_a_clear_error(kube):
    from sao_core.cluster.api import ClusterError

    orig = kube.handle

    def no_kueue(method, path, body):
        if "kueue.x-k8s.io" in path:
            return 404, {"kind": "Status", "status": "Failure", "code": 404, "reason": "NotFound",
                         "message": "the server could not find the requested resource", "details": {}}, "application/json"
        return orig(method, path, body)

    kube.handle = no_kueue
    with pytest.raises(ClusterError, match="Kueue is not installed"):
        launcher.launch(config(queue_name="q"), api=api_for(kube), say=lambda s: None)


def test_api_server_gone_during_the_run_is_reported(kube):
    future, lines = start(kube, config(api_retry_s=0.5, timeout_s=15))
    name = names.trainjob_name("r1", "sao")
    created(kube, name)
    kube.stop()
    with pytest.raises(launcher.LaunchError, match=r"did not answer for 0.5 s"):
        future.result(timeout=30)
    assert any("retrying" in line for line in lines)


def test_local_dataset_is_copied_to_the_run_directory(kube, moto_s3, tmp_path):
    data = tmp_path / "rl"
    data.mkdir()
    (data / "data.jsonl").write_text('{"prompt": "1+1", "answer": "2", "env": "math"}\n')
    output = moto_s3.uri("runs/r1/sao")
    result = launcher.launch(config(data=str(data), output=output, wait=False), api=api_for(kube), say=lambda s: None)
    args = kube.get("trainjobs", result.name, NS)["spec"]["trainer"]["args"]
    assert args[args.index("--data") + 1] == storage.join(output, "data")
    assert storage.read_text(storage.join(output, "data", "data.jsonl")).startswith('{"prompt"')


def test_delete_is_idempotent_and_can_keep_a_completed_trainjob(kube):
    api = api_for(kube)
    result = launcher.launch(config(wait=False), api=api, say=lambda s: None)
    assert launcher.delete_trainjob(result.name, NS, api=api) == \
        {"trainjob": True, "runtime": False, "kept": False, "state": "Running"}  # runtime went with its owner
    assert launcher.delete_trainjob(result.name, NS, api=api) == \
        {"trainjob": False, "runtime": False, "kept": False, "state": ""}
    result = launcher.launch(config(wait=False), api=api, say=lambda s: None)
    kube.set_condition(NS, result.name, "Complete")
    assert launcher.delete_trainjob(result.name, NS, api=api, keep_completed=True)["kept"] is True
    assert launcher.delete_trainjob(result.name, NS, api=api, wait_s=2)["trainjob"] is True
    assert kube.get("trainjobs", result.name, NS) is None


def test_components_launch_and_delete(kube, moto_s3, tmp_path, monkeypatch):
    """The KFP components' bodies, with a kubeconfig that points at the loopback API server."""
    from kfp import dsl

    from components.delete_trainjob import delete_trainjob
    from components.launch_trainjob import launch_trainjob

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "loop",
        "clusters": [{"name": "loop", "cluster": {"server": kube.url}}],
        "contexts": [{"name": "loop", "context": {"cluster": "loop", "user": "u", "namespace": NS}}],
        "users": [{"name": "u", "user": {"token": "t"}}]}))
    monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    output_root = moto_s3.uri("pipelines")
    run_dir = storage.join(output_root, "run-7", "sao")
    data = tmp_path / "data"
    data.mkdir()
    (data / "data.jsonl").write_text("{}\n")
    arts = {n: cls(name=n, uri=str(tmp_path / "out" / n), metadata={})
            for n, cls in (("model", dsl.Model), ("critic", dsl.Model), ("metrics", dsl.Metrics),
                           ("summary", dsl.Markdown), ("report", dsl.HTML))}
    name = names.trainjob_name("run-7", "sao")

    seen: dict = {}

    def finish():
        kube.wait_for(lambda: ("trainjobs", NS, name) in kube.objects, timeout_s=30)
        seen["args"] = kube.get("trainjobs", name, NS)["spec"]["trainer"]["args"]
        publish_final_model(tmp_path, run_dir)
        kube.set_condition(NS, name, "Complete")

    helper = threading.Thread(target=finish)
    helper.start()
    outputs = launch_trainjob.python_func(
        data=dsl.Dataset(name="data", uri=str(data), metadata={}), output_root=output_root, run_id="run-7", steps=3,
        critic_lr=2e-5, eps_low=0.8, admission="version_order",
        rollout_replicas=2, gpus_per_node=4, learner_image="reg/learner:1", rollout_image="reg/rollout:1",
        launch_options={"poll_s": 0.05}, **arts)
    helper.join()
    assert outputs.model_uri == storage.join(run_dir, "model") and outputs.trainjob == f"{NS}/{name}"
    args = seen["args"]
    assert args[args.index("--critic-lr") + 1] == "2e-05" and args[args.index("--eps-low") + 1] == "0.8"
    assert args[args.index("--admission") + 1] == "version_order"  # the learner's sao train-rl argument
    pointer = json.loads(Path(arts["model"].path).read_text())
    assert pointer["sha256"] == storage.checkpoint_digest(outputs.model_uri) and pointer["step"] == 3
    assert arts["model"].metadata["version"] == 3 and arts["critic"].metadata["checkpoint_uri"].endswith("/critic")
    assert "reward_mean" in Path(arts["summary"].path).read_text()
    # The run wrote no training_report.html (a fake learner): the HTML artifact is made from its s3:// metrics.
    assert 'data-plot="reward"' in Path(arts["report"].path).read_text()
    # the ExitHandler step: derives the same name; idempotent
    kube.add_object({**kube.objects.get(("trainjobs", NS, name), {}), "apiVersion": "trainer.kubeflow.org/v1alpha1",
                     "kind": "TrainJob", "metadata": {"name": name, "namespace": NS}, "spec": {}})
    first = delete_trainjob.python_func(run_id="run-7", stage="sao", output_root=output_root, wait_s=0)
    again = delete_trainjob.python_func(run_id="run-7", stage="sao", wait_s=0)
    assert json.loads(first.result)["trainjob"] is True and first.model_uri == outputs.model_uri
    assert json.loads(again.result)["trainjob"] is False and json.loads(again.result)["name"] == name
    assert again.model_uri == ""
    with pytest.raises(launcher.LaunchError, match="left no complete model"):  # a failed run: the exit step fails
        delete_trainjob.python_func(run_id="run-8", stage="sao", output_root=output_root, wait_s=0)
