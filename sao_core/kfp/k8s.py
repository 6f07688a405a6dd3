"""Kubernetes settings of pipeline tasks (kfp-kubernetes), in one place.

Two kinds of settings:

- **run parameters** (:class:`ClusterParams`): what a user picks per run in the KFP UI or API and the
  SDK can take from a pipeline parameter: GPU count and accelerator type, node selector, tolerations,
  and the name of the Kubernetes secret holding the S3 credentials;
- **compile-time settings** (:class:`ClusterSettings`): what kfp 2.17 only accepts as constants
  (pod labels, volumes, timeouts, retry policies), chosen when the pipeline is compiled
  (``sao kfp compile --queue-name team-a ...``): the Kueue queue label, the ``/dev/shm`` size, time
  limits, retry counts.

Task roles: ``training`` (GPU, caching off, no retries: a rerun resumes from the run's checkpoints),
``evaluation`` (GPU, caching off, retries), ``data`` (CPU, cached, retries) and ``cpu`` (small steps:
argument checks, reports).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sao_core import images
from sao_core.kfp.sdk_speed import frame_caller_names

KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
#: secret key -> environment variable of the S3 credentials secret (keys missing in the secret are skipped).
DEFAULT_S3_SECRET_KEYS = {
    "AWS_ACCESS_KEY_ID": "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY": "AWS_SECRET_ACCESS_KEY",
    "AWS_ENDPOINT_URL": "AWS_ENDPOINT_URL",
    "AWS_DEFAULT_REGION": "AWS_DEFAULT_REGION",
}
ROLES = ("training", "evaluation", "data", "cpu")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$")
_DURATION = re.compile(r"^[0-9]+(\.[0-9]+)?s$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass
class ClusterSettings:
    """Compile-time Kubernetes settings of every task (kfp 2.17 cannot take these from run parameters)."""

    queue_name: str = ""                    # Kueue LocalQueue: pod label kueue.x-k8s.io/queue-name on every task ('' = none)
    s3_secret_keys: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_S3_SECRET_KEYS))  # secret key -> env var
    shm_size: str = "16Gi"                  # /dev/shm (memory emptyDir) of training and evaluation pods
    training_timeout_s: int = 7 * 24 * 3600  # active deadline of training pods
    evaluation_timeout_s: int = 2 * 24 * 3600
    data_timeout_s: int = 6 * 3600
    cpu_timeout_s: int = 3600
    data_retries: int = 3                   # retries of data preparation (network, object store hiccups)
    evaluation_retries: int = 2             # evaluation resumes from its graded samples on retry
    retry_backoff: str = "60s"              # first backoff between retries (doubles each time)
    images: dict[str, str] = field(default_factory=dict)  # kind (cpu|train|rollout) -> image reference override

    def validate(self) -> None:
        """Raise ValueError naming the first bad setting."""
        if self.queue_name and (len(self.queue_name) > 63 or not _LABEL_VALUE.match(self.queue_name)):
            raise ValueError(f"queue_name {self.queue_name!r} is not a valid Kubernetes label value (<= 63 "
                             "characters: letters, digits, '-', '_', '.', starting and ending alphanumeric)")
        if not _QUANTITY.match(self.shm_size):
            raise ValueError(f"shm_size {self.shm_size!r} is not a Kubernetes quantity such as 16Gi")
        for name in ("training_timeout_s", "evaluation_timeout_s", "data_timeout_s", "cpu_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of seconds >= 1, got {value!r}")
        for name in ("data_retries", "evaluation_retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 10:
                raise ValueError(f"{name} must be an integer in [0, 10], got {value!r}")
        if not _DURATION.match(self.retry_backoff):
            raise ValueError(f"retry_backoff {self.retry_backoff!r} must be a duration in seconds such as '60s'")
        if not self.s3_secret_keys or not all(isinstance(k, str) and k and isinstance(v, str) and v
                                              for k, v in self.s3_secret_keys.items()):
            raise ValueError("s3_secret_keys must map secret keys to environment variable names")
        unknown = sorted(set(self.images) - set(images.KINDS))
        if unknown:
            raise ValueError(f"images: unknown image kind(s) {', '.join(unknown)}; known: {', '.join(images.KINDS)}")

    def image(self, kind: str) -> str:
        """The image of `kind`: this settings' override, else :func:`sao_core.images.image`."""
        return self.images.get(kind) or images.image(kind)


@dataclass
class ClusterParams:
    """Run-parameter channels (or constants) of the per-run Kubernetes settings."""

    gpu_count: Any = 1                      # GPUs of training / evaluation pods (0: none)
    accelerator_type: Any = "nvidia.com/gpu"
    node_selector: Any = field(default_factory=dict)   # {label: value}
    tolerations: Any = field(default_factory=list)     # [Toleration]
    s3_secret_name: Any = "sao-s3"                     # secret with the S3 credentials (optional in the pod)


def apply(task, role: str, params: ClusterParams, settings: ClusterSettings, image_kind: str | None = None,
          gpu_count: Any = None):
    """Apply the settings of `role` to a pipeline task; returns the task.

    `gpu_count` overrides ``params.gpu_count`` (e.g. a separate evaluation GPU count).
    """
    if role not in ROLES:
        raise ValueError(f"unknown task role {role!r}; choose one of {', '.join(ROLES)}")
    with frame_caller_names():   # kfp's setters otherwise read the whole stack's source (sdk_speed)
        _apply(task, role, params, settings, image_kind, gpu_count)
    return task


def _apply(task, role: str, params: ClusterParams, settings: ClusterSettings, image_kind: str | None,
           gpu_count: Any) -> None:
    from kfp import kubernetes
    from kfp.dsl.pipeline_channel import PipelineChannel

    if image_kind is not None:
        task.set_container_image(settings.image(image_kind))
    kubernetes.use_secret_as_env(task, secret_name=params.s3_secret_name,
                                 secret_key_to_env=dict(settings.s3_secret_keys), optional=True)
    if settings.queue_name:
        kubernetes.add_pod_label(task, KUEUE_QUEUE_LABEL, settings.queue_name)
    if role in ("training", "evaluation"):
        count = params.gpu_count if gpu_count is None else gpu_count
        task.set_accelerator_type(params.accelerator_type)
        task.set_accelerator_limit(count)
        # kfp 2.17 does not record these two channels as task inputs, so a task inside dsl.If or
        # dsl.ParallelFor would reference a parameter its enclosing group never receives; register them.
        task.register_pipeline_channels([c for c in (params.accelerator_type, count) if isinstance(c, PipelineChannel)])
        kubernetes.add_node_selector_json(task, params.node_selector)
        kubernetes.add_toleration_json(task, params.tolerations)
        kubernetes.empty_dir_mount(task, volume_name="dshm", mount_path="/dev/shm", medium="Memory",
                                   size_limit=settings.shm_size)
        task.set_caching_options(False)
    if role == "training":
        kubernetes.set_timeout(task, settings.training_timeout_s)
    elif role == "evaluation":
        kubernetes.set_timeout(task, settings.evaluation_timeout_s)
        _retry(task, settings.evaluation_retries, settings.retry_backoff)
    elif role == "data":
        kubernetes.set_timeout(task, settings.data_timeout_s)
        _retry(task, settings.data_retries, settings.retry_backoff)
    else:
        kubernetes.set_timeout(task, settings.cpu_timeout_s)


def _retry(task, retries: int, backoff: str) -> None:
    if retries:
        task.set_retry(num_retries=retries, backoff_duration=backoff, backoff_factor=2.0)
