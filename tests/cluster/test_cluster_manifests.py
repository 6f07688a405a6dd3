"""Generated sao-rl manifests: valid against the official Trainer CRDs, golden files up to date, clear errors."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from sao_core.cluster import golden, launcher, manifests, names, schema
from sao_core.cluster.names import ClusterConfigError

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def spec(**overrides) -> manifests.RuntimeSpec:
    return manifests.RuntimeSpec(**{"image": "reg/learner:1", "rollout_image": "reg/rollout:1", **overrides})


def launch_config(**overrides) -> launcher.LaunchConfig:
    values = dict(image="reg/learner:1", rollout_image="reg/rollout:1", data="s3://d/rl", output="s3://o/run/sao",
                  run_id="2b1f6c1e-8f0e-4a57-9d43-7d3c64a6f0aa", namespace="team-a")
    return launcher.LaunchConfig(**{**values, **overrides})


def test_golden_files_equal_the_generator_and_validate(monkeypatch):
    for var in ("SAO_IMAGE_REGISTRY", "SAO_IMAGE_TAG", "SAO_IMAGE_TRAIN", "SAO_IMAGE_ROLLOUT"):
        monkeypatch.setenv(var, "ignored.example/x")  # golden files never depend on the environment
    assert golden.check(DEPLOY) == [], "generated manifests are out of date: run `sao cluster render`"
    for rel in golden.golden_files():
        obj = yaml.safe_load((DEPLOY / rel).read_text())
        assert schema.validate(obj) == [], rel


def test_runtimes_and_trainjobs_of_many_shapes_validate():
    shapes = [dict(), dict(rollout_replicas=16, rollout_gpus=8, tensor_parallel_size=4, data_parallel_size=2,
                           num_nodes=8, gpus_per_node=8, node_cpu="96", node_memory="1800Gi", rollout_memory="400Gi"),
              dict(engine="hf", rollout_gpus=0, gpus_per_node=0, engine_options={"max_batch": 8}),
              dict(accelerator="amd.com/gpu", shm_size="64Gi", max_restarts=3, rollout_backoff_limit=0)]
    for shape in shapes:
        for namespace in (None, "team-a"):
            assert schema.validate(manifests.runtime_manifest(spec(**shape), namespace=namespace)) == [], shape
        cfg = launch_config(**shape, queue_name="team-a-gpu", priority_class="high",
                            node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
                            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                            env={"NCCL_DEBUG": "INFO", "NCCL_IB_HCA": "mlx5"}, service_account="sao-runner",
                            rl_options={"steps": 10, "env_options": {"math_python": {"timeout_s": 5}},
                                        "whiten_advantages": False})
        runtime, trainjob = launcher.render_launch(cfg, "team-a")
        assert schema.validate(runtime) == [] and schema.validate(trainjob) == [], shape
    _, ambient = launcher.render_launch(launch_config(s3_ambient_credentials=True, s3_secret_name=""), "team-a")
    # Ambient S3 credentials: the learner's only secret is the run's rollout token.
    assert schema.validate(ambient) == [] and [e["name"] for e in ambient["spec"]["trainer"]["env"]] == [
        "SAO_ROLLOUT_TOKEN"]


def _run_options(job) -> dict:
    patch = job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    env = {e["name"]: e.get("value") for e in patch["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    return json.loads(env[manifests.ENV_RUN_OPTIONS])


def test_the_replicas_context_is_the_runs_max_total_tokens_unless_set():
    runtime, job = launcher.render_launch(launch_config(rl_options={"max_total_tokens": 16384}), "team-a")
    assert _run_options(job)["max_model_len"] == 16384
    shape = runtime["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"][
        "containers"][0]["env"]
    assert "max_model_len" not in json.loads(next(e["value"] for e in shape if e["name"] == names.ENV_ENGINE_OPTIONS))
    _, job = launcher.render_launch(launch_config(max_model_len=32768, rl_options={"max_total_tokens": 16384}), "t")
    assert _run_options(job)["max_model_len"] == 32768
    _, job = launcher.render_launch(launch_config(engine="hf", rollout_gpus=0, rl_options={"max_total_tokens": 512}), "t")
    assert "max_model_len" not in _run_options(job)      # hf: the model's context
    assert "max_model_len" not in spec().run_engine_options()   # a runtime alone: the model's context
    with pytest.raises(ClusterConfigError, match=r"max_total_tokens 16384 \(rl_options\) exceeds the rollout engine's "
                                                 r"context of 8192 tokens \(max_model_len\)"):
        launch_config(max_model_len=8192, rl_options={"max_total_tokens": 16384}).validate()
    with pytest.raises(ClusterConfigError, match="max_model_len must be 0 .* or >= 16, got 8"):
        spec(max_model_len=8).validate()


def test_the_trainjob_carries_the_learner_the_rollout_settings_and_the_kueue_label(monkeypatch):
    monkeypatch.delenv("SAO_CACHE_DIR", raising=False)   # parsed below with this process's default cache dir
    cfg = launch_config(queue_name="team-a-gpu", num_nodes=4, gpus_per_node=8, rollout_replicas=8, rollout_gpus=2,
                        tensor_parallel_size=2, max_num_seqs=512, enable_prefix_caching=True, gpu_memory_utilization=0.85,
                        rl_options={"steps": 1000, "env_options": {"math": {}}, "freeze_critic_attention": True})
    runtime, job = launcher.render_launch(cfg, "team-a")
    name = job["metadata"]["name"]
    assert name == names.trainjob_name(cfg.run_id, "sao") and len(name) <= 40
    assert job["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "team-a-gpu"
    assert job["spec"]["runtimeRef"] == {"apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime", "name": name}
    trainer = job["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 8)
    assert trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"] == "8"
    assert trainer["command"] == ["sao", "--cache-dir", "/var/cache/sao", "cluster", "learner"]
    args = trainer["args"]
    assert args[:1] == ["--"] and "--resume" in args and "--freeze-critic-attention" in args
    assert json.loads(args[args.index("--env-options") + 1]) == {"math": {}}
    # the learner's arguments parse back into the same RLConfig with `sao train-rl`
    from sao_core.cli import build_parser, config_from_args
    from sao_core.learner.config import RLConfig

    parsed = config_from_args(RLConfig, build_parser(["train-rl"]).parse_args(["train-rl", *args[1:]]))
    assert parsed == cfg.rl_config()
    secrets = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in trainer["env"]}
    assert secrets["AWS_ACCESS_KEY_ID"] == {"name": "sao-s3", "key": "AWS_ACCESS_KEY_ID", "optional": False}
    assert secrets["AWS_ENDPOINT_URL"]["optional"] is True
    patches = {p["name"]: p for p in job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]
               ["replicatedJobs"]}
    rollout_env = {e["name"]: e for e in patches["rollout"]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert rollout_env["SAO_MODEL"]["value"] == cfg.model
    assert json.loads(rollout_env["SAO_ROLLOUT_RUN_OPTIONS"]["value"]) == {   # max_model_len: max_total_tokens
        "gpu_memory_utilization": 0.85, "max_num_seqs": 512, "enable_prefix_caching": True, "max_model_len": 4096,
        "dtype": "bfloat16"}
    assert "AWS_SECRET_ACCESS_KEY" in rollout_env
    jobs = {j["name"]: j for j in runtime["spec"]["template"]["spec"]["replicatedJobs"]}
    assert jobs["rollout"]["replicas"] == 8 and runtime["spec"]["template"]["spec"]["successPolicy"] == \
        {"operator": "All", "targetReplicatedJobs": ["node"]}
    container = jobs["rollout"]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "rollout"  # never "node": Trainer applies spec.trainer to containers named node
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    shape_env = {e["name"]: e.get("value") for e in container["env"]}
    assert json.loads(shape_env["SAO_ROLLOUT_ENGINE_OPTIONS"])["tensor_parallel_size"] == 2
    node_env = {e["name"]: e for e in jobs["node"]["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert node_env["SAO_ROLLOUT_REPLICAS"]["value"] == "8"
    assert node_env["SAO_TRAINJOB_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.labels['jobset.sigs.k8s.io/jobset-name']"
    assert jobs["node"]["template"]["metadata"]["labels"][names.ANCESTOR_LABEL] == "trainer"
    assert manifests.runtime_shape(runtime)["rollout_replicas"] == 8


def test_the_validator_catches_what_the_api_server_would_refuse():
    runtime = manifests.runtime_manifest(spec())
    bad = copy.deepcopy(runtime)
    bad["spec"]["mlPolicy"]["mpi"] = {"numProcPerNode": 1}                  # CEL: one ML policy only
    bad["spec"]["template"]["spec"]["replicatedJobs"][0]["replicas"] = "two"  # integer
    bad["spec"]["template"]["spec"]["replicatedJobs"].append(
        copy.deepcopy(bad["spec"]["template"]["spec"]["replicatedJobs"][0]))  # list-map key "name" twice
    bad["metadata"]["namespace"] = "team-a"                                 # cluster-scoped
    errors = "\n".join(schema.validate(bad))
    for needle in ("Only one of the policy", "'two' is not of type 'integer'", "Duplicate value: {'name': 'rollout'}",
                   "cluster-scoped object has no namespace"):
        assert needle in errors
    quantity = copy.deepcopy(runtime)
    containers = quantity["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    containers["containers"][0]["resources"]["limits"]["memory"] = 64            # int-or-string: an int is fine
    assert schema.validate(quantity) == []
    containers["containers"][0]["resources"]["limits"]["memory"] = ["64Gi"]
    assert any("memory" in e for e in schema.validate(quantity))
    unknown_rule = copy.deepcopy(runtime)
    unknown_rule["spec"]["mlPolicy"]["torch"]["envInjection"] = {"targets": [{"jobName": "rollout",
                                                                              "containerNames": ["node"]}]}
    assert any("containerNames must not include the main node container" in e for e in schema.validate(unknown_rule))


def test_unknown_cel_rules_are_reported_not_skipped(tmp_path):
    crd = yaml.safe_load((DEPLOY / "crds" / schema.CRD_FILES["TrainJob"]).read_text().split("---", 1)[1])
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["suspend"][
        "x-kubernetes-validations"] = [{"rule": "self == true || size(self) > 2", "message": "made up"}]
    for kind, file in schema.CRD_FILES.items():
        (tmp_path / file).write_text(yaml.safe_dump(crd) if kind == "TrainJob" else "")
    job = launcher.render_launch(launch_config(), "team-a")[1]
    job["spec"]["suspend"] = False
    assert any("CEL rule not evaluated" in e for e in schema.validate(job, crd_dir=tmp_path))


@pytest.mark.parametrize("overrides, message", [
    (dict(rollout_replicas=0), "rollout_replicas must be an integer in"),
    (dict(rollout_replicas=True), "rollout_replicas must be an integer"),
    (dict(num_nodes=-1), "num_nodes must be an integer"),
    (dict(rollout_gpus=4, tensor_parallel_size=2), r"rollout_gpus \(4\) must equal"),
    (dict(gpu_memory_utilization=1.5), r"gpu_memory_utilization must be in \(0, 1\]"),
    (dict(engine="sglang"), "engine must be one of vllm, hf"),
    (dict(engine_options={"tensor_parallel_size": 2}), "engine_options may not set tensor_parallel_size"),
    (dict(node_memory="lots"), "node_memory 'lots' is not a Kubernetes quantity"),
    (dict(accelerator="gpu!"), "not a Kubernetes resource name"),
    (dict(rollout_image=""), "rollout_image is empty"),
])
def test_bad_runtime_settings_name_the_setting(overrides, message):
    with pytest.raises(ClusterConfigError, match=message):
        manifests.runtime_manifest(spec(**overrides))


def test_names_and_dns():
    assert names.trainjob_name("2B1F6C1E-8f0e-4a57-9d43-7d3c64a6f0aa", "sao") == \
        names.trainjob_name("2B1F6C1E-8f0e-4a57-9d43-7d3c64a6f0aa", "sao")
    long = names.trainjob_name("2b1f6c1e-8f0e-4a57-9d43-7d3c64a6f0aa", "sao")
    assert len(long) <= 40 and names.is_dns_label(long)
    assert names.trainjob_name("r1", "SAO stage") == "sao-sao-stage-r1"
    assert names.rollout_urls("job", 2, 8000) == ["http://job-rollout-0-0.job:8000", "http://job-rollout-1-0.job:8000"]
    env = {"SAO_TRAINJOB_NAME": "sao-sao-r1", "SAO_ROLLOUT_REPLICAS": "3", "SAO_ROLLOUT_PORT": "9000"}
    assert names.rollout_urls_from_env(env)[2] == "http://sao-sao-r1-rollout-2-0.sao-sao-r1:9000"
    assert names.rollout_urls_from_env({"SAO_ROLLOUT_URLS": "http://a:1/, http://b:2"}) == ["http://a:1", "http://b:2"]
    with pytest.raises(ClusterConfigError, match="SAO_TRAINJOB_NAME is not set"):
        names.rollout_urls_from_env({})
    with pytest.raises(ClusterConfigError, match="must be integers"):
        names.rollout_urls_from_env({"SAO_TRAINJOB_NAME": "j", "SAO_ROLLOUT_REPLICAS": "many"})
    with pytest.raises(ClusterConfigError, match="rollout replicas must be an integer >= 1"):
        names.rollout_urls("j", 0, 8000)
    with pytest.raises(ClusterConfigError, match="too long"):
        names.check_trainjob_name("a" * 55, rollout_replicas=10)
    with pytest.raises(ClusterConfigError, match="RFC 1035"):
        names.check_trainjob_name("1abc")
    for bad in ("Team_A", "a" * 64, "-q"):
        with pytest.raises(ClusterConfigError, match="not a valid Kueue LocalQueue name"):
            names.check_queue_name(bad)
    names.check_queue_name("team-a.gpu")


def test_render_cli(tmp_path, capsys):
    from sao_core.cli import build_parser

    def main(argv: list[str]) -> int:  # `sao ...` without main()'s imports of torch (the same command function)
        args = build_parser(argv).parse_args(argv)
        return args.func(args)

    assert main(["cluster", "render", "--check", "--deploy-dir", str(DEPLOY)]) == 0
    assert main(["cluster", "render", "--deploy-dir", str(tmp_path)]) == 0
    assert golden.check(tmp_path) == []
    (tmp_path / "runtime" / "sao-rl.yaml").write_text("stale\n")
    assert main(["cluster", "render", "--check", "--deploy-dir", str(tmp_path)]) == 1
    capsys.readouterr()
    assert main(["cluster", "render-runtime", "--name", "sao-rl-8x2", "--rollout-replicas", "8", "--rollout-gpus", "2",
                 "--tensor-parallel-size", "2", "--image", "r/l:1", "--rollout-image", "r/v:1"]) == 0
    runtime = yaml.safe_load(capsys.readouterr().out)
    assert runtime["metadata"]["name"] == "sao-rl-8x2" and schema.validate(runtime) == []
    assert main(["cluster", "render-runtime", "--rollout-gpus", "3"]) == 2
    assert "rollout_gpus (3) must equal" in capsys.readouterr().err
    assert main(["cluster", "render-trainjob", "--data", "s3://d/rl", "--output", "s3://o/x", "--run-id", "r9",
                 "--queue-name", "q", "--image", "r/l:1", "--rollout-image", "r/v:1", "--rl-options", '{"steps": 7}',
                 "--tolerations", '[{"key": "nvidia.com/gpu", "operator": "Exists"}]']) == 0
    docs = list(yaml.safe_load_all(capsys.readouterr().out))
    assert [d["kind"] for d in docs] == ["TrainingRuntime", "TrainJob"] and all(schema.validate(d) == [] for d in docs)
    assert docs[1]["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][1][
        "template"]["spec"]["template"]["spec"]["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]
    assert "7" in docs[1]["spec"]["trainer"]["args"]
    assert main(["cluster", "launch", "--data", "s3://d/rl", "--output", "s3://o/x", "--run-id", "r9",
                 "--api-server", "http://127.0.0.1:9", "--image", "r/l:1", "--rollout-image", "r/v:1"]) == 2
    assert "cannot reach the Kubernetes API server at http://127.0.0.1:9" in capsys.readouterr().err


def test_deploy_manifests_parse_and_rbac_names_every_resource():
    rbac = list(yaml.safe_load_all((DEPLOY / "rbac.yaml").read_text()))
    kinds = [d["kind"] for d in rbac]
    assert kinds == ["Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"]
    queue = {d["kind"]: d for d in yaml.safe_load_all((DEPLOY / "kueue.yaml").read_text())}
    assert queue["LocalQueue"]["spec"]["clusterQueue"] == queue["ClusterQueue"]["metadata"]["name"]
    names.check_queue_name(queue["LocalQueue"]["metadata"]["name"])
    secret = yaml.safe_load((DEPLOY / "s3-secret.example.yaml").read_text())
    assert set(manifests.S3_SECRET_KEYS) == set(secret["stringData"])
    example = yaml.safe_load((DEPLOY / "examples" / "per-run-trainjob.yaml").read_text())
    assert example["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == queue["LocalQueue"]["metadata"]["name"]


def test_the_rollout_token_secret_is_wired_into_the_learner_and_every_replica():
    """One Secret per run (<trainjob>-rollout-token, key "token"): the learner and the rollout container read
    it as SAO_ROLLOUT_TOKEN; the replicas load weights only from the run's <output>/weights."""
    cfg = launch_config()
    _, trainjob = launcher.render_launch(cfg, "team-a")
    name = trainjob["metadata"]["name"]
    ref = {"secretKeyRef": {"name": f"{name}-rollout-token", "key": "token"}}
    learner_env = {e["name"]: e for e in trainjob["spec"]["trainer"]["env"]}
    assert learner_env["SAO_ROLLOUT_TOKEN"]["valueFrom"] == ref
    patch = trainjob["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    rollout_env = {e["name"]: e for e in patch["template"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert rollout_env["SAO_ROLLOUT_TOKEN"]["valueFrom"] == ref
    assert rollout_env["SAO_ROLLOUT_WEIGHT_ROOTS"]["value"] == cfg.output.rstrip("/") + "/weights"
    secret = manifests.token_secret_manifest(f"{name}-rollout-token", "team-a", "t" * 43)
    assert secret["kind"] == "Secret" and secret["stringData"] == {"token": "t" * 43}
    with pytest.raises(names.ClusterConfigError, match="SAO_ROLLOUT_TOKEN is set by the runtime"):
        manifests.check_env({"SAO_ROLLOUT_TOKEN": "x"})
