"""Names in a multi-node SAO TrainJob: object names, labels, and the DNS names of the rollout replicas.

A TrainJob becomes one JobSet of the same name. JobSet gives every pod a hostname
``<jobset>-<replicated job>-<job index>-<pod index>`` inside a headless Service named after the JobSet,
so inside the TrainJob's namespace rollout replica ``i`` (a Job of its own, one pod) is reachable as
``<trainjob>-rollout-<i>-0.<trainjob>`` and the first learner node as ``<trainjob>-node-0-0.<trainjob>``
(the torchrun master address Kubeflow Trainer sets). Every such hostname is one DNS label, so it must
stay within 63 characters; :func:`check_trainjob_name` enforces it for the replica counts of a run.

Environment variables the runtime sets in the containers (read by :mod:`sao_core.cluster.entry`):

- ``SAO_TRAINJOB_NAME``: the JobSet's name, from the pod label ``jobset.sigs.k8s.io/jobset-name``;
- ``SAO_ROLLOUT_REPLICAS``: number of rollout replicas; ``SAO_ROLLOUT_PORT``: their HTTP port;
- ``SAO_ROLLOUT_URLS``: comma-separated URLs that replace the DNS names (debugging, tests);
- ``SAO_SERVICE_WAIT_S``: how long the learner waits for every replica's ``/healthz`` (seconds);
- ``PET_NODE_RANK``: the learner node's rank (set by Trainer's torch plugin).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

ROLLOUT_JOB = "rollout"          # replicated job (and container) of the rollout replicas
NODE_JOB = "node"                # replicated job (and container) of the learner; Trainer's name for it
ROLLOUT_CONTAINER = "rollout"    # must not be "node": Trainer applies TrainJob.spec.trainer to containers named node
NODE_CONTAINER = "node"

ENV_TRAINJOB = "SAO_TRAINJOB_NAME"
ENV_REPLICAS = "SAO_ROLLOUT_REPLICAS"
ENV_PORT = "SAO_ROLLOUT_PORT"
ENV_URLS = "SAO_ROLLOUT_URLS"
ENV_SERVICE_WAIT = "SAO_SERVICE_WAIT_S"
ENV_LEARNER_METRICS_PORT = "SAO_LEARNER_METRICS_PORT"
ENV_NODE_RANK = "PET_NODE_RANK"
ENV_MODEL = "SAO_MODEL"
ENV_ENGINE = "SAO_ROLLOUT_ENGINE"
ENV_ENGINE_OPTIONS = "SAO_ROLLOUT_ENGINE_OPTIONS"
ENV_CACHE = "SAO_CACHE_DIR"

JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
ANCESTOR_LABEL = "trainer.kubeflow.org/trainjob-ancestor-step"
RUN_ID_LABEL = "sao-kfp/run-id"
STAGE_LABEL = "sao-kfp/stage"
ROLE_LABEL = "sao-kfp/role"
MANAGED_BY = {"app.kubernetes.io/managed-by": "sao-kfp", "app.kubernetes.io/part-of": "sao-kfp"}

_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")          # RFC 1035 label (TrainJob names)
_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")


class ClusterConfigError(ValueError):
    """A multi-node setting is wrong; the message names the setting and says what is allowed."""


def is_dns_label(value: str) -> bool:
    """True for an RFC 1035 label (lower-case letter first, then letters, digits, '-'; <= 63 chars)."""
    return isinstance(value, str) and len(value) <= 63 and bool(_DNS_LABEL.match(value))


def is_dns1123_label(value: str) -> bool:
    return isinstance(value, str) and len(value) <= 63 and bool(_DNS1123_LABEL.match(value))


def is_dns1123_subdomain(value: str) -> bool:
    """True for a DNS-1123 subdomain (names of namespaces' objects such as Secrets; <= 253 chars)."""
    return isinstance(value, str) and len(value) <= 253 and bool(_DNS1123_SUBDOMAIN.match(value))


def is_label_value(value: str) -> bool:
    """True for a Kubernetes label value (<= 63 chars, alphanumeric at both ends, '-', '_', '.' inside)."""
    return isinstance(value, str) and len(value) <= 63 and bool(_LABEL_VALUE.match(value))


def is_label_key(key: str) -> bool:
    """True for a label key: optional DNS-1123 subdomain prefix and '/', then a name of <= 63 chars."""
    if not isinstance(key, str) or not key:
        return False
    prefix, _, name = key.rpartition("/")
    if prefix and not is_dns1123_subdomain(prefix):
        return False
    return len(name) <= 63 and bool(_LABEL_NAME.match(name))


def check_label_value(what: str, value: str) -> None:
    if not is_label_value(value):
        raise ClusterConfigError(f"{what} {value!r} is not a valid Kubernetes label value (at most 63 characters: "
                                 "letters, digits, '-', '_', '.', starting and ending with a letter or digit)")


def check_queue_name(queue: str) -> None:
    """A Kueue LocalQueue name: empty (no Kueue) or a DNS-1123 subdomain that is also a label value."""
    if queue and not (is_label_value(queue) and is_dns1123_subdomain(queue)):
        raise ClusterConfigError(
            f"queue_name {queue!r} is not a valid Kueue LocalQueue name: it becomes the label "
            f"{KUEUE_QUEUE_LABEL} and must be lower-case letters, digits, '-' and '.', at most 63 characters, "
            "starting and ending with a letter or digit (list the queues with `kubectl get localqueues -n NS`)")


def _host_length(trainjob: str, job: str, job_index: int, pod_index: int = 0) -> int:
    return len(f"{trainjob}-{job}-{job_index}-{pod_index}")


def check_trainjob_name(name: str, rollout_replicas: int = 1, num_nodes: int = 1) -> None:
    """Raise ClusterConfigError unless `name` is a valid TrainJob name whose pod hostnames fit in 63 chars."""
    if not is_dns_label(name):
        raise ClusterConfigError(f"TrainJob name {name!r} must be an RFC 1035 label: lower-case letters, digits and "
                                 "'-', starting with a letter, ending with a letter or digit, at most 63 characters")
    longest = max(_host_length(name, ROLLOUT_JOB, max(rollout_replicas - 1, 0)),
                  _host_length(name, NODE_JOB, 0, max(num_nodes - 1, 0)))
    if longest > 63:
        raise ClusterConfigError(f"TrainJob name {name!r} is too long: its pod hostnames (e.g. "
                                 f"{rollout_host(name, max(rollout_replicas - 1, 0)).split('.')[0]}) would have "
                                 f"{longest} characters; DNS labels allow 63")


def clean(text: str, fallback: str) -> str:
    """`text` lower-cased with every run of other characters than [a-z0-9] turned into one '-'."""
    return re.sub(r"[^a-z0-9]+", "-", str(text).lower()).strip("-") or fallback


def trainjob_name(run_id: str, stage: str = "sao") -> str:
    """A deterministic TrainJob name for a pipeline run's stage (the ExitHandler's delete step uses it too).

    ``sao-<stage>-<run id, sanitised>``, cut to 40 characters with a hash of the full input at the end
    when it is longer, so pod hostnames stay within DNS limits for up to 10,000 replicas or nodes.
    """
    if not isinstance(run_id, str) or not run_id.strip():
        raise ClusterConfigError("run_id is empty: pass the pipeline run id (dsl.PIPELINE_JOB_ID_PLACEHOLDER) or "
                                 "an explicit TrainJob name")
    name = f"sao-{clean(stage, 'rl')}-{clean(run_id.strip(), 'run')}"
    if len(name) > 40:
        digest = hashlib.sha256(f"{run_id}\0{stage}".encode()).hexdigest()[:8]
        name = f"{name[:31].rstrip('-')}-{digest}"
    return name


def rollout_host(trainjob: str, index: int) -> str:
    """DNS name of rollout replica `index` inside the TrainJob's namespace: ``<tj>-rollout-<i>-0.<tj>``."""
    return f"{trainjob}-{ROLLOUT_JOB}-{index}-0.{trainjob}"


def rollout_urls(trainjob: str, replicas: int, port: int) -> list[str]:
    """``http://`` URLs of every rollout replica of a TrainJob (the learner's ``--services``)."""
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1:
        raise ClusterConfigError(f"rollout replicas must be an integer >= 1, got {replicas!r}")
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ClusterConfigError(f"rollout port must be an integer in [1, 65535], got {port!r}")
    return [f"http://{rollout_host(trainjob, i)}:{port}" for i in range(replicas)]


def rollout_urls_from_env(environ: Mapping[str, str]) -> list[str]:
    """The rollout replicas' URLs from a container's environment (see the module docstring).

    ``SAO_ROLLOUT_URLS`` wins when set; otherwise ``SAO_TRAINJOB_NAME``, ``SAO_ROLLOUT_REPLICAS`` and
    ``SAO_ROLLOUT_PORT`` (default 8000) give the JobSet DNS names.
    """
    explicit = environ.get(ENV_URLS, "").strip()
    if explicit:
        urls = [u.strip().rstrip("/") for u in explicit.split(",") if u.strip()]
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ClusterConfigError(f"{ENV_URLS}: every entry must be an http(s):// URL, got {', '.join(bad)}")
        return urls
    trainjob = environ.get(ENV_TRAINJOB, "").strip()
    if not trainjob:
        raise ClusterConfigError(f"{ENV_TRAINJOB} is not set: the runtime sets it from the pod label "
                                 f"{JOBSET_NAME_LABEL} (or set {ENV_URLS} to the rollout URLs)")
    raw_replicas = environ.get(ENV_REPLICAS, "").strip()
    raw_port = environ.get(ENV_PORT, "8000").strip() or "8000"
    try:
        replicas = int(raw_replicas)
        port = int(raw_port)
    except ValueError:
        raise ClusterConfigError(f"{ENV_REPLICAS}={raw_replicas!r} and {ENV_PORT}={raw_port!r} must be integers "
                                 "(the runtime sets both)") from None
    return rollout_urls(trainjob, replicas, port)
