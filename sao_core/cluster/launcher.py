"""Launch a multi-node SAO run as one Kubeflow Trainer TrainJob, follow it to the end, and return its model.

:func:`launch` (the body of the KFP ``launch_trainjob`` component and of ``sao cluster launch``):

1. checks the settings (and builds the learner's RLConfig, so a bad option fails before anything is
   created), the Kueue LocalQueue and the runtime;
2. copies a local prepared dataset (a KFP artifact) to ``OUTPUT/data`` so every pod can read it;
3. creates the runtime (a per-run namespaced ``TrainingRuntime`` named after the TrainJob, unless
   ``cluster_runtime`` names an installed ``ClusterTrainingRuntime``) and the TrainJob, labelled with the
   Kueue queue: Kueue admits the rollout replicas and the learner nodes together as one workload;
4. polls the TrainJob every ``poll_s`` seconds: Kueue admission, per-job pod counts, pod problems
   (image pulls, missing secrets), and the log of the first learner pod, printed as it grows;
5. ends with the TrainJob's ``Complete`` condition (returns a :class:`LaunchResult` pointing at the
   verified final checkpoint ``OUTPUT/model``), its ``Failed`` condition (:class:`TrainJobFailed` with
   the reason and the last log lines), ``timeout_s`` (:class:`LaunchTimeout`), cancellation (the
   ``cancel`` event or SIGTERM, e.g. KFP cancelling the run: :class:`LaunchCancelled`) or a pod problem
   that outlives ``pod_error_grace_s``. Timeout, cancellation and pod problems always delete the
   TrainJob (and its per-run runtime); success and failure delete it unless ``keep_trainjob``.

A launcher that is started again with the same run id and stage (a KFP retry) re-attaches to the
running TrainJob instead of starting a second one. :func:`delete_trainjob` is the idempotent clean-up
for a pipeline's ExitHandler.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import logging
import math
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.cluster import manifests, names
from sao_core.cluster.api import ClusterError, ClusterUnreachable, KubeAPI
from sao_core.cluster.manifests import RuntimeSpec
from sao_core.cluster.names import ClusterConfigError
from sao_core.config import setting
from sao_core.learner.config import Method

log = logging.getLogger(__name__)

#: RLConfig fields the launcher sets itself (``rl_options`` may not name them).
RESERVED_RL_FIELDS = ("method", "data", "output", "model", "services", "resume", "cache_dir", "engine",
                      "metrics_port")   # the runtime's learner_metrics_port (its container port)
#: Container waiting reasons that do not resolve by themselves (fatal after ``pod_error_grace_s``).
FATAL_WAITING = frozenset({"CreateContainerConfigError", "CreateContainerError", "InvalidImageName",
                           "ErrImageNeverPull", "ErrImagePull", "ImagePullBackOff"})
TRAINJOB_LABEL = "sao-kfp/trainjob"


class LaunchError(RuntimeError):
    """The TrainJob could not be run to the end; the message says why and what to do."""


class TrainJobFailed(LaunchError):
    """The TrainJob reached its Failed condition (``reason`` is Trainer's / JobSet's)."""

    def __init__(self, message: str, reason: str = "", log_tail: list[str] | None = None):
        super().__init__(message)
        self.reason = reason
        self.log_tail = log_tail or []


class LaunchTimeout(LaunchError):
    """timeout_s (or admission_timeout_s) passed; the TrainJob was deleted."""


class LaunchCancelled(LaunchError):
    """Cancelled (cancel event or SIGTERM); the TrainJob was deleted."""


#: A setting of the trainjob section (every LaunchConfig field is one).
trainjob_setting = functools.partial(setting, section="trainjob")


@dataclass
class LaunchConfig(RuntimeSpec):
    """One multi-node RL run: what to train, where, and how long to wait. Times in seconds.

    The shape settings inherited from :class:`RuntimeSpec` (rollout replicas, GPUs, tensor / data
    parallel size, images) build the per-run runtime; with ``cluster_runtime`` the installed runtime's
    shape is used instead (the engine and its per-run options still come from here).
    """

    method: Method = trainjob_setting("sao", "RL method: sao, grpo (synchronous), grpo_async, grpo_dis or running_mean")
    data: str = trainjob_setting("", "prepared rl dataset: s3:// URI, or a local directory / file (copied to OUTPUT/data)")
    output: str = trainjob_setting("", "run directory, s3://bucket/prefix: every pod reads and writes it")
    rl_options: dict = trainjob_setting(factory=dict, help="other RLConfig fields (sao train-rl options), e.g. {\"steps\": 1000}")
    name: str = trainjob_setting("", "TrainJob name ('' = sao-<stage>-<run_id>)")
    run_id: str = trainjob_setting("", "pipeline run id: names the TrainJob; a relaunch with the same id re-attaches")
    stage: str = trainjob_setting("sao", "pipeline stage (part of the TrainJob name and labels)")
    namespace: str = trainjob_setting("", "'' = the launcher pod's namespace, else the kubeconfig context's, else default")
    cluster_runtime: str = trainjob_setting("", "'' = a per-run TrainingRuntime with this shape; else an installed ClusterTrainingRuntime (e.g. sao-rl)")
    queue_name: str = trainjob_setting("", "Kueue LocalQueue in the namespace (label kueue.x-k8s.io/queue-name; '' = no Kueue)")
    priority_class: str = trainjob_setting("", "Kueue WorkloadPriorityClass ('' = the queue's default)")
    service_account: str = trainjob_setting("", "service account of the TrainJob's pods ('' = the namespace's default)")
    node_selector: dict = trainjob_setting(factory=dict, help="Node labels the GPU pods require (a TrainJob: every pod), e.g. {\"nvidia.com/gpu.product\": \"NVIDIA-H100-80GB-HBM3\"}")
    tolerations: list = trainjob_setting(factory=list, help="Tolerations of the GPU pods (a TrainJob: every pod), e.g. [{\"key\": \"nvidia.com/gpu\", \"operator\": \"Exists\"}]")
    s3_secret_name: str = trainjob_setting("sao-s3", "Kubernetes Secret with the S3 credentials: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY (+ AWS_ENDPOINT_URL, AWS_DEFAULT_REGION)")
    s3_ambient_credentials: bool = trainjob_setting(False, "no secret: the pods get S3 access from their service account (IRSA, workload identity)")
    env: dict = trainjob_setting(factory=dict, help="extra environment of every container, e.g. {\"NCCL_DEBUG\": \"INFO\"}")
    timeout_s: float = trainjob_setting(7 * 24 * 3600.0, "whole run, queueing included; then the TrainJob is deleted",
                                        unit="seconds")
    admission_timeout_s: float = trainjob_setting(0.0, "longest wait for Kueue admission (0 = up to timeout_s)",
                                                  unit="seconds")
    pod_error_grace_s: float = trainjob_setting(300.0, "a pod stuck on an image pull or a missing secret this long fails the run",
                                                unit="seconds")
    poll_s: float = trainjob_setting(10.0, "seconds between status polls", unit="seconds")
    follow_logs: bool = trainjob_setting(True, "print the first learner pod's log as it grows")
    api_retry_s: float = trainjob_setting(300.0, "how long the API server may be unreachable during the run",
                                          unit="seconds")
    keep_trainjob: bool = trainjob_setting(False, "keep a completed or failed TrainJob (the ExitHandler step still deletes it)")
    wait: bool = trainjob_setting(True, "False: create the TrainJob and return at once")

    def __post_init__(self) -> None:
        if isinstance(self.tolerations, str):  # a JSON list given on the command line
            try:
                self.tolerations = json.loads(self.tolerations) if self.tolerations.strip() else []
            except ValueError as err:
                raise ClusterConfigError(f"tolerations is not a JSON list: {err}") from None

    def validate(self, require_rollout_image: bool = True) -> None:
        """Raise ClusterConfigError naming the first bad setting (without touching the cluster).

        The rollout image is required only for a per-run runtime (`require_rollout_image` is decided
        from ``cluster_runtime``; the parameter exists for RuntimeSpec's signature).
        """
        super().validate(require_rollout_image=not self.cluster_runtime)
        from sao_core.learner.config import RL_METHODS

        if self.method not in RL_METHODS:
            raise ClusterConfigError(f"method must be one of {', '.join(RL_METHODS)}, got {self.method!r}")
        if not isinstance(self.data, str) or not self.data.strip():
            raise ClusterConfigError("data is empty: give the prepared rl dataset (s3:// URI or a local path)")
        if not isinstance(self.output, str) or not storage.is_s3_uri(self.output):
            raise ClusterConfigError(f"output must be an s3://bucket/prefix, got {self.output!r}: the learner nodes and "
                                     "the rollout replicas run in different pods and share checkpoints and weights "
                                     "through it")
        if not isinstance(self.rl_options, dict):
            raise ClusterConfigError(f"rl_options must be a mapping of RLConfig field: value, got {self.rl_options!r}")
        reserved = sorted(set(self.flat_rl_options()) & set(RESERVED_RL_FIELDS))
        if reserved:
            raise ClusterConfigError(f"rl_options may not set {', '.join(reserved)}: the launcher sets them "
                                     "(services are the rollout replicas of the TrainJob)")
        if not self.s3_secret_name and not self.s3_ambient_credentials:
            raise ClusterConfigError(
                "s3_secret_name is empty: name the Kubernetes Secret holding AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (and AWS_ENDPOINT_URL for MinIO / SeaweedFS; see deploy/s3-secret.example.yaml), "
                "or set s3_ambient_credentials when the pods get S3 access from their service account")
        if self.s3_secret_name and not names.is_dns1123_subdomain(self.s3_secret_name):
            raise ClusterConfigError(f"s3_secret_name {self.s3_secret_name!r} is not a valid Secret name")
        names.check_queue_name(self.queue_name)
        if self.cluster_runtime and not names.is_dns1123_subdomain(self.cluster_runtime):
            raise ClusterConfigError(f"cluster_runtime {self.cluster_runtime!r} is not a valid runtime name")
        if self.namespace and not names.is_dns1123_label(self.namespace):
            raise ClusterConfigError(f"namespace {self.namespace!r} is not a valid namespace name")
        for key in ("timeout_s", "poll_s", "api_retry_s", "pod_error_grace_s"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ClusterConfigError(f"{key} must be > 0 seconds, got {value!r}")
        if isinstance(self.admission_timeout_s, bool) or not isinstance(self.admission_timeout_s, int | float) \
                or self.admission_timeout_s < 0:
            raise ClusterConfigError(f"admission_timeout_s must be >= 0 seconds, got {self.admission_timeout_s!r}")
        manifests.check_env(self.env)
        manifests.check_node_selector(self.node_selector)
        manifests.check_tolerations(self.tolerations)
        self.trainjob_name()
        rl = self.rl_config()
        chosen = self.engine_options.get("max_model_len") or self.max_model_len
        if self.engine == "vllm" and chosen and chosen < rl.max_total_tokens:
            raise ClusterConfigError(f"max_total_tokens {rl.max_total_tokens} (rl_options) exceeds the rollout engine's "
                                     f"context of {chosen} tokens (max_model_len); raise max_model_len (or leave it at "
                                     "0: the run's max_total_tokens) or lower max_total_tokens")

    def trainjob_name(self) -> str:
        name = self.name or names.trainjob_name(self.run_id, self.stage)
        names.check_trainjob_name(name, self.rollout_replicas, self.num_nodes)
        return name

    def flat_rl_options(self) -> dict[str, Any]:
        """`rl_options` with any of RLConfig's sections (``{"admission": {"max_staleness": 2}}``) read flat;
        ClusterConfigError naming a wrong section."""
        from sao_core.config import ConfigError, flatten_sections
        from sao_core.learner.config import RLConfig

        try:
            return flatten_sections(RLConfig, self.rl_options, "rl_options")
        except ConfigError as err:
            raise ClusterConfigError(str(err)) from None

    def rl_values(self) -> dict[str, Any]:
        return {**self.flat_rl_options(), "method": self.method, "data": self.data, "output": self.output,
                "model": self.model, "resume": True}

    def rl_config(self):
        """The learner's RLConfig (validated like `sao train-rl` would); ClusterConfigError on a bad option."""
        from sao_core.config import ConfigError, build_config
        from sao_core.learner.config import RLConfig

        try:
            return build_config(RLConfig, self.rl_values(), source="launch rl_options")
        except ConfigError as err:
            raise ClusterConfigError(str(err)) from None

    def context_tokens(self) -> int:
        """The replicas' max_model_len: `max_model_len` when set, else the run's max_total_tokens (the longest
        episode its plan asks for)."""
        return self.max_model_len or self.rl_config().max_total_tokens

    def run_engine_options(self) -> dict[str, Any]:
        """The replicas' per-run engine options; a run that publishes LoRA adapters gives vLLM its rank
        (`max_lora_rank`) unless `engine_options` set one."""
        options = super().run_engine_options()
        rank = self.rl_config().rollout_lora_rank()
        if self.engine == "vllm" and rank and "max_lora_rank" not in options:
            options["max_lora_rank"] = rank
        return options

    def runtime_spec(self) -> RuntimeSpec:
        return RuntimeSpec(**{f.name: getattr(self, f.name) for f in dataclasses.fields(RuntimeSpec)})


@dataclass
class LaunchResult:
    """What a finished (or, with wait=False, created) TrainJob produced."""

    name: str
    namespace: str
    state: str                                # Complete | Created
    model_uri: str = ""                       # OUTPUT/model: the final policy (Hugging Face safetensors, verified)
    sha256: str = ""                          # digest of its manifest.json (storage.checkpoint_digest)
    method: str = ""
    step: int = 0
    version: int | None = None
    checkpoint_uri: str = ""                  # newest resumable learner checkpoint
    critic_uri: str = ""                      # OUTPUT/critic ('' when the method has no critic)
    summary: dict = field(default_factory=dict)  # the learner's summary.json
    seconds: float = 0.0                      # wall time of the launch
    queued_seconds: float = 0.0               # time until Kueue admitted the workload

    def training_result(self) -> dict[str, Any]:
        """The learner's summary with the manifest's step / version: what a training component reports."""
        return {**self.summary, "model": self.model_uri, "checkpoint": self.checkpoint_uri,
                "critic": self.critic_uri or None, "steps": self.step, "version": self.version,
                "method": self.method, "launch_seconds": self.seconds, "queued_seconds": self.queued_seconds}


# ---------------------------------------------------------------------------------------- helpers
def stage_data(data: str, output: str) -> str:
    """The dataset as an s3:// URI: a local directory or file (e.g. a KFP artifact) is copied to ``OUTPUT/data``."""
    if storage.is_s3_uri(data):
        return data
    path = Path(data)
    dest = storage.join(output, "data")
    if path.is_dir():
        if not storage.upload_dir(path, dest):
            raise ClusterConfigError(f"data directory {path} is empty: give a prepared rl dataset")
        return dest
    if path.is_file():
        storage.upload_file(path, storage.join(dest, path.name))
        return storage.join(dest, path.name)
    raise ClusterConfigError(f"data {data!r} is neither an s3:// URI nor an existing local file or directory")


def final_model(output: str, name: str = "") -> dict[str, Any]:
    """Pointer fields of a finished run: the verified ``OUTPUT/model`` checkpoint, its manifest metadata
    (method, step, version), its digest, the learner checkpoint, the critic and ``summary.json``."""
    model_uri = storage.join(output, "model")
    if not storage.is_complete_checkpoint(model_uri):
        raise LaunchError(f"TrainJob {name} completed but {model_uri} holds no complete checkpoint (no _COMPLETE "
                          "marker): the learner did not publish its final model; see its log")
    manifest = storage.read_manifest(model_uri)
    meta = manifest.get("metadata") or {}
    summary: dict[str, Any] = {}
    summary_uri = storage.join(output, "summary.json")
    if storage.exists(summary_uri):
        try:
            summary = json.loads(storage.read_text(summary_uri))
        except ValueError:
            summary = {}
    critic_uri = storage.join(output, "critic")
    checkpoint = summary.get("checkpoint") or storage.latest_checkpoint(storage.join(output, "checkpoints")) or ""
    version = meta.get("version", summary.get("version"))
    return {"model_uri": model_uri, "sha256": storage.checkpoint_digest(model_uri),
            "method": str(meta.get("method", summary.get("method", ""))),
            "step": int(meta.get("step", summary.get("steps", 0)) or 0),
            "version": int(version) if version is not None else None,
            "checkpoint_uri": checkpoint,
            "critic_uri": critic_uri if storage.is_complete_checkpoint(critic_uri) else "",
            "summary": summary}


def _parse_ts(text: str) -> tuple[_dt.datetime, int] | None:
    """An RFC 3339 timestamp with up to nanoseconds -> (seconds, nanoseconds) for ordering."""
    try:
        head, _, frac = text.rstrip("Z").partition(".")
        base = _dt.datetime.strptime(head, "%Y-%m-%dT%H:%M:%S")
        digits = "".join(ch for ch in frac if ch.isdigit())
        return base, int((digits + "000000000")[:9])
    except ValueError:
        return None


class _LogFollower:
    """Prints new lines of the first learner pod's log (``node`` job 0, pod 0) on every poll."""

    def __init__(self, api: KubeAPI, namespace: str, say: Callable[[str], None], clock: Callable[[], float]):
        self.api, self.namespace, self.say, self.clock = api, namespace, say, clock
        self.pod = ""
        self.last: tuple | None = None
        self.at_last: set[str] = set()
        self.fetched_at = 0.0
        self.tail: deque[str] = deque(maxlen=40)

    def poll(self, pods: list[Any]) -> None:
        learner = [p for p in pods if (p.metadata.labels or {}).get(names.REPLICATED_JOB_LABEL) == names.NODE_JOB
                   and (p.metadata.labels or {}).get(names.JOB_INDEX_LABEL, "0") == "0"
                   and (p.metadata.annotations or {}).get("batch.kubernetes.io/job-completion-index", "0") == "0"]
        if not learner:
            return
        pod = max(learner, key=lambda p: str(p.metadata.creation_timestamp or ""))
        name = pod.metadata.name
        if name != self.pod:
            self.pod, self.last, self.at_last = name, None, set()
        now = self.clock()
        try:
            if self.last is None:
                text = self.api.read_log(self.namespace, name, names.NODE_CONTAINER, tail_lines=200)
            else:
                text = self.api.read_log(self.namespace, name, names.NODE_CONTAINER,
                                         since_seconds=math.ceil(now - self.fetched_at) + 10)
        except ClusterUnreachable:
            raise
        except ClusterError as err:
            if err.status in (400, 404):  # container not started yet / pod gone
                return
            raise
        self.fetched_at = now
        for line in text.splitlines():
            stamp, _, message = line.partition(" ")
            key = _parse_ts(stamp)
            if key is None:
                key, message = self.last, line
            if self.last is not None and key is not None:
                if key < self.last or (key == self.last and line in self.at_last):
                    continue
            if key is not None and key != self.last:
                self.last, self.at_last = key, set()
            self.at_last.add(line)
            self.tail.append(message)
            self.say(f"[{name}] {message}")


def _conditions(obj: dict) -> dict[str, dict]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}


def _is_true(conditions: dict[str, dict], kind: str) -> bool:
    return conditions.get(kind, {}).get("status") == "True"


def _jobs_line(obj: dict) -> str:
    parts = []
    for job in (obj.get("status") or {}).get("jobsStatus") or []:
        counts = [f"{k} {job.get(k)}" for k in ("active", "ready", "succeeded", "failed", "suspended") if job.get(k)]
        parts.append(f"{job.get('name')}: {', '.join(counts) or 'no pods'}")
    return "; ".join(parts)


def _pod_problems(pods: list[Any]) -> dict[tuple[str, str], str]:
    """{(pod, reason): message} of containers stuck waiting, and pods the scheduler cannot place."""
    problems: dict[tuple[str, str], str] = {}
    for pod in pods:
        status = pod.status
        if status is None:
            continue
        for cs in list(status.init_container_statuses or []) + list(status.container_statuses or []):
            waiting = cs.state.waiting if cs.state is not None else None
            if waiting is not None and waiting.reason and waiting.reason not in ("ContainerCreating", "PodInitializing"):
                problems[(pod.metadata.name, waiting.reason)] = waiting.message or ""
        for cond in status.conditions or []:
            if cond.type == "PodScheduled" and cond.status == "False" and cond.reason == "Unschedulable":
                problems[(pod.metadata.name, "Unschedulable")] = cond.message or ""
    return problems


# ---------------------------------------------------------------------------------------- launch
def render_launch(config: LaunchConfig, namespace: str, data_uri: str | None = None) -> tuple[dict | None, dict]:
    """(per-run TrainingRuntime or None, TrainJob) of `config` in `namespace`, as :func:`launch` creates them.

    `data_uri` replaces ``config.data`` (the staged s3:// copy of a local dataset).
    """
    config.validate()
    name = config.trainjob_name()
    per_run = not config.cluster_runtime
    labels = {TRAINJOB_LABEL: name, names.STAGE_LABEL: names.clean(config.stage, "rl")[:63].strip("-")}
    if config.run_id and names.is_label_value(config.run_id):
        labels[names.RUN_ID_LABEL] = config.run_id
    runtime = None
    if per_run:
        runtime = manifests.runtime_manifest(config.runtime_spec(), name=name, namespace=namespace,
                                             labels={TRAINJOB_LABEL: name})
    rl = config.rl_config()
    values = {key: getattr(rl, key) for key in config.rl_values()}
    values["data"] = data_uri or config.data
    parts = manifests.TrainJobParts(
        name=name, namespace=namespace,
        runtime_name=name if per_run else config.cluster_runtime,
        runtime_kind="TrainingRuntime" if per_run else "ClusterTrainingRuntime",
        image=config.image, learner_args=manifests.learner_args(values), num_nodes=config.num_nodes,
        gpus_per_node=config.gpus_per_node, accelerator=config.accelerator, node_cpu=config.node_cpu,
        node_memory=config.node_memory, model=config.model, engine=config.engine,
        run_engine_options=config.run_engine_options(),
        s3_secret_name="" if config.s3_ambient_credentials else config.s3_secret_name,
        env={k: str(v) for k, v in config.env.items()}, node_selector=dict(config.node_selector),
        tolerations=list(config.tolerations), service_account=config.service_account,
        queue_name=config.queue_name, priority_class=config.priority_class, labels=labels,
        active_deadline_s=config.timeout_s, token_secret_name=token_secret_name(name),
        weight_roots=[storage.join(config.output, "weights")])
    return runtime, manifests.trainjob_manifest(parts)


def token_secret_name(trainjob: str) -> str:
    """The per-run Secret with the rollout token of TrainJob `trainjob` (created by the launcher)."""
    return f"{trainjob}-rollout-token"


class _Launch:
    def __init__(self, config: LaunchConfig, api: KubeAPI, cancel: threading.Event, say: Callable[[str], None],
                 clock: Callable[[], float]):
        self.config, self.api, self.cancel, self.say, self.clock = config, api, cancel, say, clock
        self.name = config.trainjob_name()
        self.namespace = config.namespace or api.default_namespace
        self.per_run_runtime = not config.cluster_runtime
        self.started = clock()

    # -------------------------------------------------------------- preparation
    def check_queue(self) -> None:
        queue = self.config.queue_name
        if not queue:
            return
        exists = self.api.local_queue_exists(queue, self.namespace)
        if exists is False:
            raise ClusterConfigError(f"Kueue LocalQueue {queue!r} does not exist in namespace {self.namespace} "
                                     f"(`kubectl get localqueues -n {self.namespace}` lists them; deploy/kueue.yaml "
                                     "creates one)")
        if exists is None:
            self.say(f"warning: cannot check that Kueue LocalQueue {queue} exists (no RBAC to read localqueues)")

    def check_cluster_runtime(self) -> None:
        name = self.config.cluster_runtime
        try:
            runtime = self.api.get("ClusterTrainingRuntime", name)
        except ClusterUnreachable:
            raise
        except ClusterError as err:
            if err.status == 403:
                self.say(f"warning: cannot read ClusterTrainingRuntime {name} (no RBAC); its shape is not checked")
                return
            raise
        if runtime is None:
            raise ClusterConfigError(f"ClusterTrainingRuntime {name!r} is not installed: `kubectl apply -f "
                                     "deploy/runtime/sao-rl.yaml` (or `sao cluster render-runtime --name NAME ... | "
                                     "kubectl apply -f -`), or leave cluster_runtime empty for a per-run runtime")
        shape = manifests.runtime_shape(runtime)
        self.say(f"runtime {name}: {shape['rollout_replicas']} rollout replica(s) on port {shape['rollout_port']}, "
                 f"{shape['rollout_gpus'] or 'no GPUs'} each, engine options tp={shape['tensor_parallel_size']} "
                 f"dp={shape['data_parallel_size']}")
        names.check_trainjob_name(self.name, shape["rollout_replicas"], self.config.num_nodes)

    def _ours(self, obj: dict) -> bool:
        labels = (obj.get("metadata") or {}).get("labels") or {}
        return labels.get(TRAINJOB_LABEL) == self.name and (
            not self.config.run_id or labels.get(names.RUN_ID_LABEL, self.config.run_id) == self.config.run_id)

    def _create_or_adopt(self, obj: dict, kind: str, api: str, delete_hint: str) -> tuple[dict, bool]:
        """Create `obj`, a `kind` named `self.name`; one of that name this run created before is adopted.
        Returns the object and whether it was created now. LaunchError when the Kubeflow Trainer API (`api`, as
        named in the message) is not installed, or when the existing object is not this run's (`delete_hint`
        follows "delete it" in that message)."""
        try:
            return self.api.create(obj), True
        except ClusterError as err:
            if err.status == 404:
                raise LaunchError(f"{err}: the Kubeflow Trainer API ({api}) is not installed in this cluster; "
                                  "install Kubeflow Trainer v2 (deploy/README.md)") from None
            if err.status != 409:
                raise
            existing = self.api.get(kind, self.name, self.namespace)
            if existing is None or not self._ours(existing):
                raise LaunchError(f"a {kind} {self.namespace}/{self.name} already exists and was not created by "
                                  f"this run; delete it{delete_hint} or choose another name") from None
            return existing, False

    def create(self, runtime: dict | None, trainjob: dict) -> dict:
        """Create the runtime and the TrainJob; an existing one of the same run is re-attached."""
        if runtime is not None:
            self._create_or_adopt(runtime, "TrainingRuntime", "trainer.kubeflow.org/v1alpha1", "")
        self.create_token_secret()
        created, new = self._create_or_adopt(trainjob, "TrainJob", "trainer.kubeflow.org/v1alpha1 trainjobs",
                                             " (`sao cluster delete NAME`)")
        if new:
            self.say(f"created TrainJob {self.namespace}/{self.name} (runtime "
                     f"{trainjob['spec']['runtimeRef']['kind']} {trainjob['spec']['runtimeRef']['name']}"
                     + (f", Kueue queue {self.config.queue_name}" if self.config.queue_name else "") + ")")
        else:
            self.say(f"re-attaching to the existing TrainJob {self.namespace}/{self.name} of this run")
        uid = (created.get("metadata") or {}).get("uid")
        if uid:  # the token Secret goes away with the TrainJob even if nobody deletes it
            try:
                self.api.patch("Secret", token_secret_name(self.name), self.namespace, {"metadata": {
                    "ownerReferences": [{"apiVersion": manifests.API_VERSION, "kind": "TrainJob", "name": self.name,
                                         "uid": uid}]}})
            except ClusterError as err:
                self.say(f"warning: could not make the TrainJob own its token Secret ({err}); it is deleted explicitly")
        if runtime is not None:
            if uid:  # the runtime goes away with the TrainJob even if nobody deletes it
                try:
                    self.api.patch("TrainingRuntime", self.name, self.namespace, {"metadata": {"ownerReferences": [{
                        "apiVersion": manifests.API_VERSION, "kind": "TrainJob", "name": self.name, "uid": uid}]}})
                except ClusterError as err:
                    self.say(f"warning: could not make the TrainJob own its runtime ({err}); it is deleted explicitly")
        return created

    def create_token_secret(self) -> None:
        """The run's rollout token (random, one per run) in a Secret the learner and the replicas read; a
        relaunch of the same run re-uses it."""
        from sao_core.rollout.auth import new_token

        name = token_secret_name(self.name)
        secret = manifests.token_secret_manifest(name, self.namespace, new_token(), labels={TRAINJOB_LABEL: self.name})
        try:
            self.api.create(secret)
            self.say(f"created Secret {self.namespace}/{name} (the run's rollout token)")
        except ClusterError as err:
            if err.status != 409:
                raise
            existing = self.api.get("Secret", name, self.namespace)
            if existing is None or not self._ours(existing):
                raise LaunchError(f"a Secret {self.namespace}/{name} already exists and was not created by this run; "
                                  "delete it or choose another name") from None

    # -------------------------------------------------------------- clean-up
    def delete(self, why: str) -> None:
        try:
            gone = delete_trainjob(self.name, self.namespace, api=self.api)
            self.say(f"deleted TrainJob {self.namespace}/{self.name} ({why})" if gone["trainjob"]
                     else f"TrainJob {self.namespace}/{self.name} was already gone ({why})")
        except ClusterError as err:
            self.say(f"warning: could not delete TrainJob {self.namespace}/{self.name}: {err}; delete it by hand: "
                     f"kubectl delete trainjob -n {self.namespace} {self.name}")

    # -------------------------------------------------------------- watch
    def watch(self) -> tuple[dict, float]:
        """Poll until Complete; returns (TrainJob, queued seconds)."""
        state = _WatchState(
            logs=_LogFollower(self.api, self.namespace, self.say, self.clock) if self.config.follow_logs else None)
        while True:
            self._stop_if_cancelled()
            now = self.clock()
            self._stop_if_late(now)
            read = self._read_trainjob(state, now)
            if read is None:  # the API server did not answer this time: ask again after a poll
                self.cancel.wait(self.config.poll_s)
                continue
            obj, pods = read
            conditions = _conditions(obj)
            if state.logs is not None:
                try:
                    state.logs.poll(pods)
                except ClusterError as err:
                    self.say(f"warning: cannot read the learner log: {err}")
            if _is_true(conditions, "Complete"):
                return obj, (state.admitted_at or now) - self.started
            if _is_true(conditions, "Failed"):
                self._fail(conditions["Failed"], state.logs)
            self._follow_admission(obj, conditions, state, now)
            line = _jobs_line(obj)
            if line and line != state.last_line:
                self.say(f"jobs: {line}")
                state.last_line = line
            self._check_pods(pods, state, now)
            self.cancel.wait(self.config.poll_s)

    def _stop_if_cancelled(self) -> None:
        """Delete the TrainJob and raise LaunchCancelled once `cancel` is set."""
        if self.cancel.is_set():
            self.delete("cancelled")
            raise LaunchCancelled(f"cancelled: TrainJob {self.namespace}/{self.name} deleted")

    def _stop_if_late(self, now: float) -> None:
        """Delete the TrainJob and raise LaunchTimeout past ``timeout_s`` after the launch (queueing included)."""
        if now - self.started > self.config.timeout_s:
            self.delete("timeout")
            raise LaunchTimeout(f"TrainJob {self.namespace}/{self.name} did not finish within timeout_s="
                                f"{self.config.timeout_s:g} s (queueing included); it was deleted. Its checkpoints "
                                f"stay under {self.config.output}: a new launch with the same output resumes from them")

    def _read_trainjob(self, state: _WatchState, now: float) -> tuple[dict, list[Any]] | None:
        """The TrainJob and its pods; None while the API server is unreachable or busy (5xx, 429) for at most
        ``api_retry_s`` (then LaunchError). LaunchError when the TrainJob is gone."""
        try:
            obj = self.api.get("TrainJob", self.name, self.namespace)
            pods = self.api.list_pods(self.namespace, f"{names.JOBSET_NAME_LABEL}={self.name}")
            state.unreachable_since = None
        except ClusterError as err:
            if not (isinstance(err, ClusterUnreachable) or (err.status or 0) >= 500 or err.status == 429):
                raise
            state.unreachable_since = state.unreachable_since if state.unreachable_since is not None else now
            if now - state.unreachable_since > self.config.api_retry_s:
                raise LaunchError(f"the Kubernetes API server did not answer for {self.config.api_retry_s:g} s while "
                                  f"following TrainJob {self.namespace}/{self.name} ({err}); the TrainJob may still "
                                  f"run: check it with kubectl get trainjob -n {self.namespace} {self.name}") from None
            self.say(f"warning: {err}; retrying")
            return None
        if obj is None:
            raise LaunchError(f"TrainJob {self.namespace}/{self.name} disappeared while running (deleted by someone "
                              "else, or its namespace was deleted)")
        return obj, pods

    def _fail(self, cond: dict, logs: _LogFollower | None) -> None:
        """Raise TrainJobFailed for the Failed condition `cond`, with the last learner log lines (the TrainJob is
        deleted first unless ``keep_trainjob``)."""
        tail = list(logs.tail) if logs is not None else []
        if not self.config.keep_trainjob:
            self.delete("failed")
        shown = "\n".join(f"  {line}" for line in tail[-20:])
        raise TrainJobFailed(f"TrainJob {self.namespace}/{self.name} failed: {cond.get('reason', '')}: "
                             f"{cond.get('message', '')}" + (f"\nlast learner log lines:\n{shown}" if shown else ""),
                             reason=cond.get("reason", ""), log_tail=tail)

    def _follow_admission(self, obj: dict, conditions: dict[str, dict], state: _WatchState, now: float) -> None:
        """Say once that the TrainJob waits for admission (LaunchTimeout past ``admission_timeout_s``), and when it
        starts running (noting when, for the queued seconds)."""
        config = self.config
        suspended = bool((obj.get("spec") or {}).get("suspend")) or _is_true(conditions, "Suspended")
        if suspended:
            if not state.waiting_said:
                queue = f"Kueue queue {config.queue_name}" if config.queue_name else "resume (spec.suspend)"
                self.say(f"waiting for admission by {queue}: rollout replicas and learner nodes are admitted "
                         "together")
                state.waiting_said = True
            if config.admission_timeout_s and now - self.started > config.admission_timeout_s:
                self.delete("not admitted in time")
                raise LaunchTimeout(f"TrainJob {self.namespace}/{self.name} was not admitted within "
                                    f"admission_timeout_s={config.admission_timeout_s:g} s; it was deleted. Check the "
                                    f"queue: kubectl get workloads -n {self.namespace}")
        elif state.admitted_at is None:
            state.admitted_at = now
            self.say(f"running (queued {now - self.started:.0f} s)")

    def _check_pods(self, pods: list[Any], state: _WatchState, now: float) -> None:
        """Say each new pod problem once; delete the TrainJob and raise LaunchError when a pod stays in a fatal
        waiting reason (FATAL_WAITING) longer than ``pod_error_grace_s``."""
        config = self.config
        problems = _pod_problems(pods)
        for key, message in problems.items():
            state.first_seen.setdefault(key, now)
            if key not in state.reported:
                self.say(f"pod {key[0]}: {key[1]}: {message}")
                state.reported.add(key)
            if key[1] in FATAL_WAITING and now - state.first_seen[key] > config.pod_error_grace_s:
                self.delete(f"pod {key[0]} stuck in {key[1]}")
                raise LaunchError(f"pod {key[0]} of TrainJob {self.namespace}/{self.name} has been stuck in "
                                  f"{key[1]} for over {config.pod_error_grace_s:g} s: {message}. Check the image "
                                  f"names and that the Secret {config.s3_secret_name!r} exists in "
                                  f"{self.namespace}; the TrainJob was deleted")
        for key in list(state.first_seen):
            if key not in problems:
                del state.first_seen[key]


@dataclass
class _WatchState:
    """What :meth:`_Launch.watch` remembers between polls (times are the launcher clock's seconds)."""

    logs: _LogFollower | None = None                 # the learner log follower (None: follow_logs off)
    admitted_at: float | None = None                 # when the TrainJob was first seen running
    unreachable_since: float | None = None           # start of the current run of failed API reads
    last_line: str = ""                              # the last jobs line said
    waiting_said: bool = False                       # the "waiting for admission" line was said
    reported: set[tuple[str, str]] = field(default_factory=set)           # (pod, reason) problems already said
    first_seen: dict[tuple[str, str], float] = field(default_factory=dict)  # when each current problem appeared


def launch(config: LaunchConfig, api: KubeAPI | None = None, cancel: threading.Event | None = None,
           say: Callable[[str], None] | None = None, clock: Callable[[], float] = time.monotonic) -> LaunchResult:
    """Run `config` as a TrainJob to its end (see the module docstring); returns the final model's pointer.

    `api` defaults to :meth:`KubeAPI.connect` (in-cluster service account, else kubeconfig); `cancel`
    stops the watch (SIGTERM sets it when this runs in the main thread); `say` prints progress lines.
    Raises ClusterConfigError (bad settings, missing queue or runtime), ClusterError (API calls),
    TrainJobFailed, LaunchTimeout, LaunchCancelled or LaunchError.
    """
    say = say or (lambda text: print(text, flush=True))
    config.validate()
    api = api or KubeAPI.connect()
    cancel = cancel or threading.Event()
    run = _Launch(config, api, cancel, say, clock)
    if config.cluster_runtime:
        run.check_cluster_runtime()
    run.check_queue()
    data_uri = stage_data(config.data, config.output)
    if data_uri != config.data:
        say(f"copied the dataset {config.data} to {data_uri}")
    runtime, trainjob = render_launch(config, run.namespace, data_uri)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):  # KFP cancels a run by terminating its pods
            say(f"received signal {signum}: cancelling")
            cancel.set()

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        created = run.create(runtime, trainjob)
        if not config.wait:
            return LaunchResult(name=run.name, namespace=run.namespace, state="Created",
                                seconds=clock() - run.started, summary={"uid": created.get("metadata", {}).get("uid")})
        try:
            _, queued = run.watch()
        except KeyboardInterrupt:
            run.delete("interrupted")
            raise
        say(f"TrainJob {run.namespace}/{run.name} completed")
        fields = final_model(config.output, run.name)
        if not config.keep_trainjob:
            run.delete("completed")
        return LaunchResult(name=run.name, namespace=run.namespace, state="Complete", seconds=clock() - run.started,
                            queued_seconds=queued, **fields)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def delete_trainjob(name: str, namespace: str = "", api: KubeAPI | None = None, keep_completed: bool = False,
                    wait_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> dict[str, Any]:
    """Delete a TrainJob and its per-run TrainingRuntime; a missing one is fine (idempotent).

    For a pipeline's ExitHandler. ``keep_completed`` keeps a TrainJob whose Complete condition is
    True. ``wait_s`` > 0 waits that long for the TrainJob to be gone. Returns
    ``{"trainjob": deleted?, "runtime": deleted?, "kept": bool, "state": last condition or ""}``.
    """
    names.check_trainjob_name(name)
    api = api or KubeAPI.connect()
    namespace = namespace or api.default_namespace
    obj = api.get("TrainJob", name, namespace)
    state = ""
    if obj is not None:
        conditions = _conditions(obj)
        state = next((k for k in ("Complete", "Failed", "Suspended") if _is_true(conditions, k)), "Running")
        if keep_completed and state == "Complete":
            return {"trainjob": False, "runtime": False, "kept": True, "state": state}
    deleted = api.delete("TrainJob", name, namespace) if obj is not None else False
    runtime_deleted = False
    runtime = api.get("TrainingRuntime", name, namespace)
    if runtime is not None and ((runtime.get("metadata") or {}).get("labels") or {}).get(TRAINJOB_LABEL) == name:
        runtime_deleted = api.delete("TrainingRuntime", name, namespace)
    try:  # owned by the TrainJob (gone with it), unless making it the owner failed
        secret = api.get("Secret", token_secret_name(name), namespace)
        if secret is not None and ((secret.get("metadata") or {}).get("labels") or {}).get(TRAINJOB_LABEL) == name:
            api.delete("Secret", token_secret_name(name), namespace)
    except ClusterError as err:
        if err.status != 403:
            raise
    deadline = clock() + wait_s
    while wait_s > 0 and clock() < deadline and api.get("TrainJob", name, namespace) is not None:
        time.sleep(min(2.0, max(0.05, deadline - clock())))
    return {"trainjob": deleted, "runtime": runtime_deleted, "kept": False, "state": state}
