"""The one Python source of the multi-node SAO manifests: the ``sao-rl`` (Cluster)TrainingRuntime and TrainJobs.

One TrainJob on this runtime is one JobSet with two replicated jobs, admitted by Kueue as one workload:

- ``rollout``: ``rollout_replicas`` Jobs of one pod each, ``sao cluster rollout`` (the rollout service with
  the vLLM engine) on ``rollout_gpus`` GPUs, restarted in place on failure (``restartPolicy: OnFailure``,
  so the pod keeps its DNS name ``<trainjob>-rollout-<i>-0.<trainjob>``);
- ``node`` (Kubeflow Trainer's trainer job, ancestor label ``trainer``): ``num_nodes`` pods of
  ``sao cluster learner``, which waits for every replica's ``/healthz``, runs ``torchrun -m sao_core.cli
  train-rl ... --services <replica URLs>`` (Trainer sets torchrun's ``PET_*`` variables) and, on node
  rank 0, shuts the replicas down when training ends; ``successPolicy`` is "all ``node`` jobs
  succeeded", so the JobSet (and the TrainJob) completes when the learner does.

Settings owned by the runtime (the *shape*: replica count, GPUs per replica, tensor / data parallel
size, images) cannot be changed by a TrainJob: Trainer's ``runtimePatches`` may only change container
``env``, node selectors, tolerations and a few pod fields. A TrainJob changes the learner through
``spec.trainer`` (image, command, args, env, nodes, resources per node) and the rollout replicas
through environment variables (model, engine, per-run engine options) patched into the ``rollout``
container. For a per-run shape, :func:`runtime_manifest` renders a namespaced ``TrainingRuntime`` that
the launcher creates next to the TrainJob (see :mod:`sao_core.cluster.launcher`).

Units: GPU counts are whole devices of ``accelerator``; ``*_cpu`` / ``*_memory`` / ``shm_size`` are
Kubernetes quantities (``"8"``, ``"64Gi"``); times are seconds.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from sao_core.cluster import names
from sao_core.cluster.names import ClusterConfigError
from sao_core.config import setting

API_VERSION = "trainer.kubeflow.org/v1alpha1"
GROUP = "trainer.kubeflow.org"
PATCH_MANAGER = "sao-kfp/launcher"       # runtimePatches entry owned by this project
CACHE_DIR = "/var/cache/sao"             # models and checkpoints downloaded by the pods (emptyDir)
ENGINES = ("vllm", "hf")
DTYPES = ("auto", "bfloat16", "float16", "float32")
#: S3 secret key -> required? (the same keys as the single-pod pipelines use)
S3_SECRET_KEYS = {"AWS_ACCESS_KEY_ID": True, "AWS_SECRET_ACCESS_KEY": True, "AWS_ENDPOINT_URL": False,
                  "AWS_DEFAULT_REGION": False}
#: engine options the runtime's shape owns (a run may not override them)
SHAPE_ENGINE_KEYS = ("tensor_parallel_size", "data_parallel_size")
_RESERVED_ENV = {names.ENV_TRAINJOB, names.ENV_REPLICAS, names.ENV_PORT, names.ENV_URLS, names.ENV_MODEL,
                 names.ENV_ENGINE, names.ENV_ENGINE_OPTIONS, "SAO_ROLLOUT_RUN_OPTIONS", names.ENV_CACHE,
                 names.ENV_SERVICE_WAIT, *S3_SECRET_KEYS, "SAO_ROLLOUT_TOKEN", "SAO_ROLLOUT_TOKEN_FILE",
                 "SAO_ROLLOUT_WEIGHT_ROOTS"}
ENV_RUN_OPTIONS = "SAO_ROLLOUT_RUN_OPTIONS"
#: the run's rollout token (sao_core.rollout.auth), from the per-run Secret, in the learner and the replicas
ENV_ROLLOUT_TOKEN = "SAO_ROLLOUT_TOKEN"
#: the key of the token in that Secret
TOKEN_SECRET_KEY = "token"
#: where the replicas load weights from (comma-separated; the run's <output>/weights)
ENV_WEIGHT_ROOTS = "SAO_ROLLOUT_WEIGHT_ROOTS"
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")


def _int(name: str, value: Any, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ClusterConfigError(f"{name} must be an integer {bound}, got {value!r}")


def _quantity(name: str, value: str, allow_empty: bool = True) -> None:
    if (value == "" and allow_empty) or (isinstance(value, str) and _QUANTITY.match(value)):
        return
    raise ClusterConfigError(f"{name} {value!r} is not a Kubernetes quantity such as '8', '500m' or '64Gi'")


#: A setting of the runtime section (every RuntimeSpec field is one).
runtime_setting = functools.partial(setting, section="runtime")


@dataclass
class RuntimeSpec:
    """Shape and defaults of the sao-rl runtime (one rollout fleet + one torchrun learner)."""

    image: str = runtime_setting("", "learner image (CUDA torch + sao-kfp), e.g. ghcr.io/sao-kfp/sao-kfp-cuda:0.1.0")
    rollout_image: str = runtime_setting("", "rollout image (vLLM + sao-kfp), e.g. ghcr.io/sao-kfp/sao-kfp-vllm:0.1.0")
    num_nodes: int = runtime_setting(1, "learner nodes (pods of the node job); torchrun --nnodes")
    gpus_per_node: int = runtime_setting(1, "GPUs per learner node = torchrun processes per node (0: one CPU process)")
    node_cpu: str = runtime_setting("", "CPU request of each learner pod ('' = none)")
    node_memory: str = runtime_setting("", "memory request and limit of each learner pod ('' = none)")
    rollout_replicas: int = runtime_setting(2, "rollout service replicas (one pod and one Job each)")
    rollout_gpus: int = runtime_setting(1, "GPUs per rollout replica (vllm: tensor_parallel_size x data_parallel_size)")
    tensor_parallel_size: int = runtime_setting(1, "vLLM tensor-parallel size inside one replica")
    data_parallel_size: int = runtime_setting(1, "vLLM data-parallel engines inside one replica")
    rollout_port: int = runtime_setting(8000, "HTTP port of the rollout services")
    learner_metrics_port: int = runtime_setting(9400, "the learner's Prometheus /metrics port (node rank 0's pod); 0: off")
    rollout_cpu: str = runtime_setting("", "CPU request of each rollout pod ('' = none)")
    rollout_memory: str = runtime_setting("", "memory request and limit of each rollout pod ('' = none)")
    rollout_backoff_limit: int = runtime_setting(20, "container restarts of one replica before its Job (and the JobSet) fails")
    engine: Literal["vllm", "hf"] = runtime_setting("vllm", "Rollout engine: vllm (GPU) or hf (transformers; small models, CPU).")
    gpu_memory_utilization: float = runtime_setting(0.9, "vllm: share of each GPU's memory the engine may use (0, 1]")
    max_num_seqs: int = runtime_setting(256, "vllm: sequences scheduled concurrently per engine")
    enable_prefix_caching: bool = runtime_setting(True, "vllm: reuse the KV cache of shared prefixes (multi-turn episodes)")
    max_model_len: int = runtime_setting(0, "vllm: context in tokens (prompt + every turn); 0: a TrainJob's max_total_tokens (a runtime alone: the model's)")
    rollout_dtype: str = runtime_setting("bfloat16", "vllm weights and activations: auto, bfloat16, float16, float32")
    engine_options: dict = runtime_setting(factory=dict, help="other engine settings (vLLM AsyncEngineArgs names), e.g. {\"enforce_eager\": true}")
    model: str = runtime_setting("embedded:tiny", "default model of the rollout replicas (a TrainJob sets its own)")
    accelerator: str = runtime_setting("nvidia.com/gpu", "Kubernetes resource name of the GPUs, e.g. nvidia.com/gpu")
    shm_size: str = runtime_setting("16Gi", "/dev/shm of every pod (memory emptyDir; NCCL and vLLM workers need it)")
    max_restarts: int = runtime_setting(0, "JobSet restarts after a failed job (the learner resumes from its checkpoints)")
    service_wait_s: float = runtime_setting(1800.0, "how long the learner waits for every replica's /healthz (vLLM load time)",
                                            unit="seconds")

    def validate(self, require_rollout_image: bool = True) -> None:
        """Raise ClusterConfigError naming the first bad setting (`require_rollout_image`: the runtime is built here)."""
        _int("num_nodes", self.num_nodes, 1, 10_000)
        _int("gpus_per_node", self.gpus_per_node, 0, 1024)
        _int("rollout_replicas", self.rollout_replicas, 1, 10_000)
        _int("rollout_gpus", self.rollout_gpus, 0, 1024)
        _int("tensor_parallel_size", self.tensor_parallel_size, 1, 1024)
        _int("data_parallel_size", self.data_parallel_size, 1, 1024)
        _int("rollout_port", self.rollout_port, 1, 65535)
        _int("learner_metrics_port", self.learner_metrics_port, 0, 65535)
        _int("rollout_backoff_limit", self.rollout_backoff_limit, 0, 10_000)
        _int("max_num_seqs", self.max_num_seqs, 1)
        _int("max_model_len", self.max_model_len, 0)
        if 0 < self.max_model_len < 16:
            raise ClusterConfigError(f"max_model_len must be 0 (the run's max_total_tokens) or >= 16, got "
                                     f"{self.max_model_len}")
        _int("max_restarts", self.max_restarts, 0, 1000)
        if self.engine not in ENGINES:
            raise ClusterConfigError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        if self.engine == "vllm" and self.rollout_gpus and \
                self.rollout_gpus != self.tensor_parallel_size * self.data_parallel_size:
            raise ClusterConfigError(
                f"rollout_gpus ({self.rollout_gpus}) must equal tensor_parallel_size x data_parallel_size "
                f"({self.tensor_parallel_size} x {self.data_parallel_size}): vLLM uses exactly that many GPUs per replica")
        if isinstance(self.gpu_memory_utilization, bool) or not isinstance(self.gpu_memory_utilization, int | float) \
                or not 0 < self.gpu_memory_utilization <= 1:
            raise ClusterConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.rollout_dtype not in DTYPES:
            raise ClusterConfigError(f"rollout_dtype must be one of {', '.join(DTYPES)}, got {self.rollout_dtype!r}")
        if not isinstance(self.engine_options, dict):
            raise ClusterConfigError(f"engine_options must be a mapping, got {self.engine_options!r}")
        owned = sorted(set(self.engine_options) & set(SHAPE_ENGINE_KEYS))
        if owned:
            raise ClusterConfigError(f"engine_options may not set {', '.join(owned)}: use the settings of the same name "
                                     "(they shape the runtime's GPUs)")
        try:
            json.dumps(self.engine_options)
        except (TypeError, ValueError) as err:
            raise ClusterConfigError(f"engine_options must be JSON-serialisable: {err}") from None
        for name in ("node_cpu", "node_memory", "rollout_cpu", "rollout_memory"):
            _quantity(name, getattr(self, name))
        _quantity("shm_size", self.shm_size, allow_empty=False)
        if not _RESOURCE_NAME.match(self.accelerator or ""):
            raise ClusterConfigError(f"accelerator {self.accelerator!r} is not a Kubernetes resource name such as "
                                     "nvidia.com/gpu or amd.com/gpu")
        if not isinstance(self.service_wait_s, int | float) or isinstance(self.service_wait_s, bool) \
                or self.service_wait_s <= 0:
            raise ClusterConfigError(f"service_wait_s must be > 0 seconds, got {self.service_wait_s!r}")
        for name in ("image", "rollout_image") if require_rollout_image else ("image",):
            if not isinstance(getattr(self, name), str) or not getattr(self, name).strip():
                raise ClusterConfigError(f"{name} is empty: give the container image reference (see images/README.md; "
                                         "`sao cluster render-runtime` fills in the project's images)")

    # ------------------------------------------------------------------ derived values
    def shape_engine_options(self) -> dict[str, Any]:
        """Engine options the runtime bakes in (``SAO_ROLLOUT_ENGINE_OPTIONS``): the shape plus run defaults."""
        if self.engine != "vllm":
            return {}
        return {"tensor_parallel_size": self.tensor_parallel_size, "data_parallel_size": self.data_parallel_size,
                **self.run_engine_options()}

    def run_engine_options(self) -> dict[str, Any]:
        """Per-run engine options (``SAO_ROLLOUT_RUN_OPTIONS``): vLLM scaling settings plus ``engine_options``."""
        options: dict[str, Any] = {}
        if self.engine == "vllm":
            options = {"gpu_memory_utilization": float(self.gpu_memory_utilization), "max_num_seqs": self.max_num_seqs,
                       "enable_prefix_caching": bool(self.enable_prefix_caching)}
            if self.context_tokens():
                options["max_model_len"] = self.context_tokens()
            options["dtype"] = self.rollout_dtype
        options.update(self.engine_options)
        return options

    def context_tokens(self) -> int:
        """vLLM's max_model_len for the replicas: `max_model_len`, 0 (leave it to the model's context) when
        unset; a run (LaunchConfig) derives it from its max_total_tokens."""
        return self.max_model_len

    def processes_per_node(self) -> int:
        """torchrun processes per learner node: one per GPU, one when the nodes have no GPU."""
        return max(1, self.gpus_per_node)


def _env(name: str, value: Any) -> dict[str, Any]:
    return {"name": name, "value": value if isinstance(value, str) else json.dumps(value)}


def _resources(gpus: int, accelerator: str, cpu: str, memory: str) -> dict[str, Any]:
    limits: dict[str, Any] = {}
    requests: dict[str, Any] = {}
    if gpus:
        limits[accelerator] = str(gpus)
    if cpu:
        requests["cpu"] = cpu
    if memory:
        requests["memory"] = memory
        limits["memory"] = memory
    out: dict[str, Any] = {}
    if limits:
        out["limits"] = limits
    if requests:
        out["requests"] = requests
    return out


def _volumes(shm_size: str) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
               {"name": "cache", "emptyDir": {}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "cache", "mountPath": CACHE_DIR}]
    return volumes, mounts


def _common_env() -> list[dict[str, Any]]:
    return [_env(names.ENV_CACHE, CACHE_DIR), _env("PYTHONUNBUFFERED", "1"), _env("OMP_WAIT_POLICY", "PASSIVE")]


def learner_command() -> list[str]:
    """Command of the learner container (its arguments are ``-- <sao train-rl arguments>``)."""
    return ["sao", "--cache-dir", CACHE_DIR, "cluster", "learner"]


def rollout_command() -> list[str]:
    return ["sao", "--cache-dir", CACHE_DIR, "cluster", "rollout"]


def _rollout_container(spec: RuntimeSpec, mounts: list[dict]) -> dict[str, Any]:
    """The rollout replica's container: the engine serving the model on ``spec.rollout_port``."""
    env = [
        _env(names.ENV_MODEL, spec.model),
        _env(names.ENV_ENGINE, spec.engine),
        _env(names.ENV_PORT, str(spec.rollout_port)),
        _env(names.ENV_ENGINE_OPTIONS, spec.shape_engine_options()),
        _env(ENV_RUN_OPTIONS, {}),
        *_common_env(),
    ]
    container: dict[str, Any] = {
        "name": names.ROLLOUT_CONTAINER,
        "image": spec.rollout_image,
        "command": rollout_command(),
        "env": env,
        "ports": [{"name": "rollout", "containerPort": spec.rollout_port, "protocol": "TCP"}],
        # /healthz answers once the engine has loaded the model: the replica counts as ready from then on.
        "readinessProbe": {"httpGet": {"path": "/healthz", "port": spec.rollout_port}, "periodSeconds": 10,
                           "timeoutSeconds": 5, "failureThreshold": 3},
        "volumeMounts": mounts,
    }
    resources = _resources(spec.rollout_gpus, spec.accelerator, spec.rollout_cpu, spec.rollout_memory)
    if resources:
        container["resources"] = resources
    return container


def _node_container(spec: RuntimeSpec, mounts: list[dict]) -> dict[str, Any]:
    """The learner node's container: torchrun of ``sao cluster learner``, told where the rollout replicas are."""
    env = [
        {"name": names.ENV_TRAINJOB, "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.labels['{names.JOBSET_NAME_LABEL}']"}}},
        _env(names.ENV_REPLICAS, str(spec.rollout_replicas)),
        _env(names.ENV_PORT, str(spec.rollout_port)),
        _env(names.ENV_SERVICE_WAIT, _seconds(spec.service_wait_s)),
        _env(names.ENV_LEARNER_METRICS_PORT, str(spec.learner_metrics_port)),
        *_common_env(),
    ]
    container: dict[str, Any] = {
        "name": names.NODE_CONTAINER,
        "image": spec.image,
        "command": learner_command(),
        "env": env,
        "volumeMounts": mounts,
    }
    if spec.learner_metrics_port:   # served by the learner's rank 0 (sao cluster learner adds --metrics-port)
        container["ports"] = [{"name": "metrics", "containerPort": spec.learner_metrics_port, "protocol": "TCP"}]
    resources = _resources(spec.gpus_per_node, spec.accelerator, spec.node_cpu, spec.node_memory)
    if resources:
        container["resources"] = resources
    return container


def _replicated_job(name: str, job_labels: dict[str, str], pod_labels: dict[str, str], job_spec: dict[str, Any],
                    pod_spec: dict[str, Any], replicas: int | None = None) -> dict[str, Any]:
    """One JobSet replicated job: `job_spec` (parallelism, completions, ...) around a pod template; `replicas`
    None: the JobSet's default (one)."""
    job: dict[str, Any] = {"name": name}
    if replicas is not None:
        job["replicas"] = replicas
    job["template"] = {"metadata": {"labels": job_labels},
                       "spec": {**job_spec, "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec}}}
    return job


def _replicated_jobs(spec: RuntimeSpec) -> list[dict[str, Any]]:
    """The runtime's two replicated jobs: the rollout fleet (restarted on failure) and the learner nodes."""
    volumes, mounts = _volumes(spec.shm_size)
    rollout_labels = {names.ROLE_LABEL: "rollout"}
    node_labels = {names.ROLE_LABEL: "learner"}
    rollout = _replicated_job(
        names.ROLLOUT_JOB, rollout_labels, rollout_labels,
        {"parallelism": 1, "completions": 1, "completionMode": "Indexed", "backoffLimit": spec.rollout_backoff_limit},
        {"restartPolicy": "OnFailure", "containers": [_rollout_container(spec, mounts)], "volumes": volumes},
        replicas=spec.rollout_replicas)
    node = _replicated_job(
        names.NODE_JOB, {names.ANCESTOR_LABEL: "trainer", **node_labels}, node_labels,
        {"parallelism": spec.num_nodes, "completions": spec.num_nodes, "completionMode": "Indexed", "backoffLimit": 0},
        {"restartPolicy": "Never", "containers": [_node_container(spec, mounts)], "volumes": volumes})
    return [rollout, node]


def runtime_manifest(spec: RuntimeSpec, name: str = "sao-rl", namespace: str | None = None,
                     labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A ClusterTrainingRuntime (``namespace=None``) or a namespaced TrainingRuntime for `spec`.

    The rollout fleet and its GPUs are fixed here; the learner's nodes and resources are defaults a
    TrainJob overrides. Raises ClusterConfigError for bad settings.
    """
    spec.validate()
    if not names.is_dns1123_subdomain(name):
        raise ClusterConfigError(f"runtime name {name!r} must be a DNS-1123 subdomain (lower-case letters, digits, "
                                 "'-', '.')")
    manifest: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "ClusterTrainingRuntime" if namespace is None else "TrainingRuntime",
        "metadata": {"name": name, "labels": {"trainer.kubeflow.org/framework": "torch", **names.MANAGED_BY,
                                              **(labels or {})}},
        "spec": {
            "mlPolicy": {"numNodes": spec.num_nodes, "torch": {}},
            "template": {
                "metadata": {"labels": dict(names.MANAGED_BY)},
                "spec": {
                    "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
                    "successPolicy": {"operator": "All", "targetReplicatedJobs": [names.NODE_JOB]},
                    "failurePolicy": {"maxRestarts": spec.max_restarts},
                    "replicatedJobs": _replicated_jobs(spec),
                },
            },
        },
    }
    if namespace is not None:
        manifest["metadata"]["namespace"] = namespace
    return copy.deepcopy(manifest)


def _seconds(value: float) -> str:
    return str(int(math.ceil(value)))


def runtime_shape(runtime: dict[str, Any]) -> dict[str, Any]:
    """Read the shape of an installed sao-rl runtime: rollout replicas, GPUs, port, engine options.

    Raises ClusterConfigError when the runtime is not a sao-rl runtime (no ``rollout`` / ``node`` jobs).
    """
    name = runtime.get("metadata", {}).get("name", "?")
    jobs = {j.get("name"): j for j in runtime.get("spec", {}).get("template", {}).get("spec", {})
            .get("replicatedJobs", []) or []}
    if names.ROLLOUT_JOB not in jobs or names.NODE_JOB not in jobs:
        raise ClusterConfigError(f"runtime {name} is not a sao-rl runtime: it needs replicated jobs "
                                 f"'{names.ROLLOUT_JOB}' and '{names.NODE_JOB}', it has {', '.join(map(str, jobs))}")
    rollout = jobs[names.ROLLOUT_JOB]
    containers = rollout.get("template", {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
    container = next((c for c in containers if c.get("name") == names.ROLLOUT_CONTAINER), {})
    env = {e.get("name"): e.get("value") for e in container.get("env", []) if "value" in e}
    limits = container.get("resources", {}).get("limits", {})
    try:
        options = json.loads(env.get(names.ENV_ENGINE_OPTIONS) or "{}")
    except ValueError:
        options = {}
    return {"rollout_replicas": int(rollout.get("replicas", 1)), "rollout_port": int(env.get(names.ENV_PORT) or 8000),
            "rollout_gpus": {k: v for k, v in limits.items() if k not in ("cpu", "memory")},
            "engine": env.get(names.ENV_ENGINE, ""), "rollout_image": container.get("image", ""),
            "tensor_parallel_size": options.get("tensor_parallel_size"),
            "data_parallel_size": options.get("data_parallel_size")}


# ---------------------------------------------------------------------------------------- TrainJob
def s3_env(secret_name: str) -> list[dict[str, Any]]:
    """Environment variables taking the S3 credentials from `secret_name` (key = variable name).

    The access key id and secret key are required (a pod whose secret lacks them does not start:
    CreateContainerConfigError, which the launcher reports); endpoint and region are optional.
    """
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key, "optional": not required}}}
            for key, required in S3_SECRET_KEYS.items()]


def check_env(env: dict[str, str]) -> None:
    """Extra environment variables of both containers: valid names, string values, nothing reserved."""
    if not isinstance(env, dict):
        raise ClusterConfigError(f"env must be a mapping of NAME: value, got {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not _ENV_NAME.match(key):
            raise ClusterConfigError(f"env: {key!r} is not a valid environment variable name")
        if key in _RESERVED_ENV or key.startswith("PET_"):
            raise ClusterConfigError(f"env: {key} is set by the runtime or the launcher and may not be overridden")
        if not isinstance(value, str | int | float) or isinstance(value, bool):
            raise ClusterConfigError(f"env: the value of {key} must be a string or a number, got {value!r}")


def check_tolerations(tolerations: list) -> None:
    if not isinstance(tolerations, list):
        raise ClusterConfigError(f"tolerations must be a list of Kubernetes tolerations, got {tolerations!r}")
    allowed = {"key", "operator", "value", "effect", "tolerationSeconds"}
    for i, t in enumerate(tolerations):
        if not isinstance(t, dict) or not t or set(t) - allowed:
            raise ClusterConfigError(f"tolerations[{i}] must be a mapping with keys among {', '.join(sorted(allowed))}, "
                                     f"got {t!r}")
        if t.get("operator", "Equal") not in ("Equal", "Exists"):
            raise ClusterConfigError(f"tolerations[{i}].operator must be Equal or Exists, got {t.get('operator')!r}")
        if t.get("effect", "") not in ("", "NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ClusterConfigError(f"tolerations[{i}].effect must be NoSchedule, PreferNoSchedule or NoExecute, "
                                     f"got {t.get('effect')!r}")


def check_node_selector(selector: dict) -> None:
    if not isinstance(selector, dict):
        raise ClusterConfigError(f"node_selector must be a mapping of label: value, got {selector!r}")
    for key, value in selector.items():
        if not names.is_label_key(key) or not isinstance(value, str) or not names.is_label_value(value):
            raise ClusterConfigError(f"node_selector: {key!r}: {value!r} is not a valid node label and value")


@dataclass
class TrainJobParts:
    """Everything a TrainJob carries besides the runtime (built by the launcher from its config)."""

    name: str
    namespace: str
    runtime_name: str
    runtime_kind: str                      # ClusterTrainingRuntime | TrainingRuntime
    image: str                             # learner image
    learner_args: list[str]                # sao train-rl arguments (without --services)
    num_nodes: int
    gpus_per_node: int
    accelerator: str
    node_cpu: str
    node_memory: str
    model: str
    engine: str
    run_engine_options: dict[str, Any]
    s3_secret_name: str                    # '' = ambient credentials (service account)
    env: dict[str, str] = field(default_factory=dict)
    node_selector: dict[str, str] = field(default_factory=dict)
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    service_account: str = ""
    queue_name: str = ""
    priority_class: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    active_deadline_s: float = 0.0         # 0: none
    token_secret_name: str = ""            # Secret holding the run's rollout token (key "token"); '' = none
    weight_roots: list[str] = field(default_factory=list)   # the replicas' allowed_weight_roots


def token_env(secret_name: str) -> dict[str, Any]:
    """``SAO_ROLLOUT_TOKEN`` from key ``token`` of `secret_name` (required: a pod without it does not start)."""
    return {"name": ENV_ROLLOUT_TOKEN, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": TOKEN_SECRET_KEY}}}


def token_secret_manifest(name: str, namespace: str, token: str, labels: dict[str, str] | None = None
                          ) -> dict[str, Any]:
    """The per-run Secret with the rollout token (the launcher creates it; the TrainJob then owns it)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {**names.MANAGED_BY, "app.kubernetes.io/component": "sao-rl-token",
                                    **(labels or {})}},
            "stringData": {TOKEN_SECRET_KEY: token}}


def _check_trainjob_parts(parts: TrainJobParts) -> None:
    """Raise ClusterConfigError for the first setting of `parts` a TrainJob cannot carry."""
    names.check_queue_name(parts.queue_name)
    if parts.priority_class:
        names.check_label_value("priority_class", parts.priority_class)
    if parts.runtime_kind not in ("ClusterTrainingRuntime", "TrainingRuntime"):
        raise ClusterConfigError(f"runtime kind must be ClusterTrainingRuntime or TrainingRuntime, got "
                                 f"{parts.runtime_kind!r}")
    if parts.s3_secret_name and not names.is_dns1123_subdomain(parts.s3_secret_name):
        raise ClusterConfigError(f"s3_secret_name {parts.s3_secret_name!r} is not a valid Secret name (lower-case "
                                 "letters, digits, '-', '.')")
    if parts.token_secret_name and not names.is_dns1123_subdomain(parts.token_secret_name):
        raise ClusterConfigError(f"token_secret_name {parts.token_secret_name!r} is not a valid Secret name")
    if any("," in root for root in parts.weight_roots):
        raise ClusterConfigError(f"weight roots may not contain ',' ({parts.weight_roots!r})")
    if parts.service_account and not names.is_dns1123_subdomain(parts.service_account):
        raise ClusterConfigError(f"service_account {parts.service_account!r} is not a valid ServiceAccount name")
    check_env(parts.env)
    check_node_selector(parts.node_selector)
    check_tolerations(parts.tolerations)
    if len(parts.learner_args) + 1 > 128:   # + 1: the "--" before them
        raise ClusterConfigError(f"the learner gets {len(parts.learner_args) + 1} arguments; a TrainJob allows 128: "
                                 "move settings into fewer options")
    for key, value in parts.labels.items():
        if not names.is_label_key(key) or not names.is_label_value(value):
            raise ClusterConfigError(f"label {key!r}: {value!r} is not a valid Kubernetes label")


def _trainjob_labels(parts: TrainJobParts) -> dict[str, str]:
    """The TrainJob's labels: ours, the caller's, and Kueue's queue and priority class where set."""
    labels = {**names.MANAGED_BY, "app.kubernetes.io/component": "sao-rl", **parts.labels}
    if parts.queue_name:
        labels[names.KUEUE_QUEUE_LABEL] = parts.queue_name
    if parts.priority_class:
        labels[names.KUEUE_PRIORITY_LABEL] = parts.priority_class
    return labels


def _secret_env(parts: TrainJobParts) -> list[dict[str, Any]]:
    """Environment variables read from Secrets: the rollout token (if any), then the S3 credentials (if any)."""
    secret_env = s3_env(parts.s3_secret_name) if parts.s3_secret_name else []
    if parts.token_secret_name:
        secret_env = [token_env(parts.token_secret_name), *secret_env]
    return secret_env


def _trainer(parts: TrainJobParts, env: list[dict[str, Any]]) -> dict[str, Any]:
    """The TrainJob's ``trainer``: the learner's image, command, arguments, `env` and per-node shape."""
    trainer: dict[str, Any] = {
        "image": parts.image,
        "command": learner_command(),
        "args": ["--", *parts.learner_args],
        "env": env,
        "numNodes": parts.num_nodes,
        "numProcPerNode": max(1, parts.gpus_per_node),
    }
    resources = _resources(parts.gpus_per_node, parts.accelerator, parts.node_cpu, parts.node_memory)
    if resources:
        trainer["resourcesPerNode"] = resources
    if not trainer["env"]:
        del trainer["env"]
    return trainer


def _pod_patch(parts: TrainJobParts, containers: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The pod spec a runtime patch sets: `containers` and the run's scheduling settings (empty: nothing to set)."""
    spec: dict[str, Any] = {}
    if containers:
        spec["containers"] = containers
    if parts.node_selector:
        spec["nodeSelector"] = dict(parts.node_selector)
    if parts.tolerations:
        spec["tolerations"] = [dict(t) for t in parts.tolerations]
    if parts.service_account:
        spec["serviceAccountName"] = parts.service_account
    return spec


def _job_patches(parts: TrainJobParts, secret_env: list[dict[str, Any]],
                 user_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runtime patches of the replicated jobs: the rollout container's run settings and both jobs' pod settings."""
    rollout_env = [_env(names.ENV_MODEL, parts.model), _env(names.ENV_ENGINE, parts.engine),
                   _env(ENV_RUN_OPTIONS, parts.run_engine_options), *secret_env, *user_env]
    if parts.weight_roots:
        rollout_env.insert(3, _env(ENV_WEIGHT_ROOTS, ",".join(parts.weight_roots)))
    job_patches = []
    for job, containers in ((names.ROLLOUT_JOB, [{"name": names.ROLLOUT_CONTAINER, "env": rollout_env}]),
                            (names.NODE_JOB, None)):
        spec = _pod_patch(parts, containers)
        if spec:
            job_patches.append({"name": job, "template": {"spec": {"template": {"spec": spec}}}})
    return job_patches


def trainjob_manifest(parts: TrainJobParts) -> dict[str, Any]:
    """The TrainJob of one run (validated against the TrainJob CRD in the tests)."""
    _check_trainjob_parts(parts)
    user_env = [_env(k, str(v)) for k, v in sorted(parts.env.items())]
    secret_env = _secret_env(parts)
    manifest: dict[str, Any] = {
        "apiVersion": API_VERSION,
        "kind": "TrainJob",
        "metadata": {"name": parts.name, "namespace": parts.namespace, "labels": _trainjob_labels(parts)},
        "spec": {
            "runtimeRef": {"apiGroup": GROUP, "kind": parts.runtime_kind, "name": parts.runtime_name},
            "trainer": _trainer(parts, secret_env + user_env),
            "runtimePatches": [{"manager": PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": _job_patches(parts, secret_env, user_env)}}}}],
        },
    }
    if parts.active_deadline_s:
        manifest["spec"]["activeDeadlineSeconds"] = int(math.ceil(parts.active_deadline_s))
    return copy.deepcopy(manifest)  # no dict shared between places (YAML aliases, later edits)


def learner_args(values: dict[str, Any]) -> list[str]:
    """``sao train-rl`` arguments for RLConfig field values (the same flags ``sao train-rl --help`` lists).

    Booleans become ``--flag`` / ``--no-flag``, mappings JSON, tuples and lists comma-joined.
    """
    from sao_core.learner.config import RLConfig

    known = {f.name for f in dataclasses.fields(RLConfig)}
    args: list[str] = []
    for key in sorted(values):
        if key not in known:
            raise ClusterConfigError(f"{key!r} is not an RLConfig field")
        value = values[key]
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + key.replace("_", "-"))
        elif isinstance(value, dict):
            args += [flag, json.dumps(value, sort_keys=True)]
        elif isinstance(value, list | tuple):
            items = [str(v) for v in value]
            if any("," in v for v in items):
                raise ClusterConfigError(f"{key}: list items may not contain ',' ({items!r})")
            args += [flag, ",".join(items)]
        else:
            args += [flag, str(value)]
    return args
