"""The Kubernetes API calls of the launcher, through the official ``kubernetes`` python client.

:class:`KubeAPI` wraps exactly the calls the launcher makes (each one is granted by ``deploy/rbac.yaml``):

========================================  =========================================================
call                                       resource (verb)
========================================  =========================================================
create / get / delete a TrainJob           ``trainjobs.trainer.kubeflow.org`` (create, get, delete)
create / get / patch / delete a runtime    ``trainingruntimes.trainer.kubeflow.org`` (per-run runtimes)
read an installed runtime                  ``clustertrainingruntimes.trainer.kubeflow.org`` (get)
check a Kueue LocalQueue exists            ``localqueues.kueue.x-k8s.io`` (get)
find the TrainJob's pods, read logs        ``pods`` (list), ``pods/log`` (get)
========================================  =========================================================

Every failure becomes a :class:`ClusterError` whose message says what failed and what to do (RBAC,
missing CRDs, an unreachable API server). Creates use ``fieldValidation=Strict`` so a field the
server does not know is an error, not silently dropped.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

TRAINER = ("trainer.kubeflow.org", "v1alpha1")
KUEUE_VERSIONS = ("v1beta2", "v1beta1")
PLURALS = {"TrainJob": "trainjobs", "TrainingRuntime": "trainingruntimes",
           "ClusterTrainingRuntime": "clustertrainingruntimes"}
_SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


class ClusterError(RuntimeError):
    """A Kubernetes API call failed; ``status`` is the HTTP status (None: no answer)."""

    def __init__(self, message: str, status: int | None = None, reason: str = "", details: dict | None = None):
        super().__init__(message)
        self.status = status
        self.reason = reason
        self.details = details or {}  # the Status details: {"name", "kind", "group", "causes"} when given


class ClusterUnreachable(ClusterError):
    """The API server did not answer (connection refused, DNS, TLS, timeout)."""


def _status_message(err: Any) -> tuple[str, str, dict]:
    """(message, reason, details) of an ApiException's Status body."""
    body = getattr(err, "body", None)
    try:
        status = json.loads(body) if body else {}
    except (TypeError, ValueError):
        status = {}
    if not isinstance(status, dict):
        status = {}
    message = status.get("message") or str(body or getattr(err, "reason", "") or err).strip()
    return message, status.get("reason", "") or "", status.get("details") or {}


class KubeAPI:
    """The launcher's view of one Kubernetes API server (see the module docstring)."""

    def __init__(self, api_client: Any, default_namespace: str = "default", timeout_s: float = 30.0):
        from kubernetes import client

        self.api_client = api_client
        self.custom = client.CustomObjectsApi(api_client)
        self.core = client.CoreV1Api(api_client)
        self.default_namespace = default_namespace
        self.timeout = (min(10.0, timeout_s), timeout_s)  # (connect, read) seconds per request
        self.host = getattr(api_client.configuration, "host", "?")

    # ------------------------------------------------------------------ construction
    @classmethod
    def connect(cls, api_server: str = "", kubeconfig: str = "", context: str = "", token: str = "",
                timeout_s: float = 30.0, in_cluster: bool | None = None) -> KubeAPI:
        """Connect with, in order: an explicit ``api_server`` URL (plus optional bearer ``token``), the
        pod's service account (in a cluster), or a kubeconfig (``kubeconfig`` path, else $KUBECONFIG /
        ~/.kube/config, optional ``context``). Raises ClusterError when none is usable."""
        import os

        try:
            from kubernetes import client, config
        except ImportError as err:  # pragma: no cover - a core dependency
            raise ClusterError("the `kubernetes` python client is not installed: pip install kubernetes") from err
        cfg = client.Configuration()
        namespace = "default"
        if api_server:
            cfg.host = api_server.rstrip("/")
            if token:
                cfg.api_key = {"authorization": token}
                cfg.api_key_prefix = {"authorization": "Bearer"}
        else:
            errors = []
            loaded = False
            if in_cluster is not False and not kubeconfig:
                try:
                    config.load_incluster_config(client_configuration=cfg)
                    loaded = True
                    try:
                        namespace = _SA_NAMESPACE.read_text().strip() or namespace
                    except OSError:
                        pass
                except config.ConfigException as err:
                    errors.append(f"not in a cluster ({err})")
            # the client reads $KUBECONFIG once, at import; read it now so a changed value counts
            kubeconfig = kubeconfig or os.environ.get("KUBECONFIG", "")
            if not loaded and in_cluster is not True:
                try:
                    config.load_kube_config(config_file=kubeconfig or None, context=context or None,
                                            client_configuration=cfg)
                    loaded = True
                    _, active = config.list_kube_config_contexts(config_file=kubeconfig or None)
                    if context:
                        contexts, _ = config.list_kube_config_contexts(config_file=kubeconfig or None)
                        active = next((c for c in contexts if c.get("name") == context), active)
                    namespace = (active or {}).get("context", {}).get("namespace") or namespace
                except (config.ConfigException, OSError, TypeError, ValueError) as err:
                    errors.append(f"no usable kubeconfig ({err})")
            if not loaded:
                raise ClusterError("no Kubernetes API configuration: " + "; ".join(errors) +
                                   ". Run inside a pod with a service account, set KUBECONFIG, or pass api_server")
        cfg.retries = 1  # urllib3 retries per request; the launcher's watch loop retries on its own
        return cls(client.ApiClient(cfg), namespace, timeout_s)

    # ------------------------------------------------------------------ error translation
    def _call(self, what: str, fn, *args, **kwargs) -> Any:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError as Urllib3Error

        try:
            return fn(*args, _request_timeout=self.timeout, **kwargs)
        except ApiException as err:
            message, reason, details = _status_message(err)
            status = err.status
            if status in (401, 403):
                hint = ("the launcher's service account lacks RBAC for this call: apply deploy/rbac.yaml in the "
                        "namespace (see deploy/README.md)") if status == 403 else "the credentials were refused"
                raise ClusterError(f"{what}: {status} {reason or err.reason}: {message} ({hint})", status, reason,
                                   details) from None
            raise ClusterError(f"{what}: {status} {reason or err.reason}: {message}", status, reason, details) \
                from None
        except (Urllib3Error, OSError) as err:
            raise ClusterUnreachable(f"{what}: cannot reach the Kubernetes API server at {self.host}: "
                                     f"{type(err).__name__}: {err}") from None

    # ------------------------------------------------------------------ trainer objects
    def create(self, obj: dict) -> dict:
        """Create a TrainJob, a (Cluster)TrainingRuntime or a Secret; returns the stored object (a Secret's
        without its data)."""
        kind, name = obj["kind"], obj["metadata"]["name"]
        what = f"create {kind} {name}"
        if kind == "Secret":
            created = self._call(what, self.core.create_namespaced_secret, obj["metadata"]["namespace"], obj)
            return self._secret_meta(created)
        if kind == "ClusterTrainingRuntime":
            return self._call(what, self.custom.create_cluster_custom_object, *TRAINER, PLURALS[kind], obj,
                              field_validation="Strict")
        return self._call(what, self.custom.create_namespaced_custom_object, *TRAINER,
                          obj["metadata"]["namespace"], PLURALS[kind], obj, field_validation="Strict")

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict | None:
        """The object, or None when it does not exist."""
        try:
            if kind == "Secret":
                return self._secret_meta(self._call(f"get Secret {namespace}/{name}", self.core.read_namespaced_secret,
                                                    name, namespace))
            if kind == "ClusterTrainingRuntime":
                return self._call(f"get {kind} {name}", self.custom.get_cluster_custom_object, *TRAINER,
                                  PLURALS[kind], name)
            return self._call(f"get {kind} {namespace}/{name}", self.custom.get_namespaced_custom_object, *TRAINER,
                              namespace, PLURALS[kind], name)
        except ClusterError as err:
            if err.status == 404:
                return None
            raise

    def delete(self, kind: str, name: str, namespace: str) -> bool:
        """Delete (background propagation: the JobSet and pods follow). False when it was already gone."""
        from kubernetes import client

        try:
            if kind == "Secret":
                self._call(f"delete Secret {namespace}/{name}", self.core.delete_namespaced_secret, name, namespace)
                return True
            self._call(f"delete {kind} {namespace}/{name}", self.custom.delete_namespaced_custom_object, *TRAINER,
                       namespace, PLURALS[kind], name, body=client.V1DeleteOptions(propagation_policy="Background"))
            return True
        except ClusterError as err:
            if err.status == 404:
                return False
            raise

    def patch(self, kind: str, name: str, namespace: str, patch: dict) -> dict:
        """JSON merge patch of a namespaced trainer object (or a Secret's metadata)."""
        if kind == "Secret":
            return self._secret_meta(self._call(f"patch Secret {namespace}/{name}", self.core.patch_namespaced_secret,
                                                name, namespace, patch))
        return self._call(f"patch {kind} {namespace}/{name}", self.custom.patch_namespaced_custom_object, *TRAINER,
                          namespace, PLURALS[kind], name, patch)

    def _secret_meta(self, secret: Any) -> dict:
        """A Secret as a dict without its data (the token never leaves the API call)."""
        body = secret if isinstance(secret, dict) else self.api_client.sanitize_for_serialization(secret)
        return {k: v for k, v in (body or {}).items() if k not in ("data", "stringData")}

    # ------------------------------------------------------------------ Kueue
    def local_queue_exists(self, name: str, namespace: str) -> bool | None:
        """True / False whether the Kueue LocalQueue exists; None when that cannot be told (no RBAC).

        Raises ClusterError when Kueue's API is not installed at all.
        """
        missing_api = 0
        for version in KUEUE_VERSIONS:
            try:
                self._call(f"get LocalQueue {namespace}/{name}", self.custom.get_namespaced_custom_object,
                           "kueue.x-k8s.io", version, namespace, "localqueues", name)
                return True
            except ClusterUnreachable:
                raise
            except ClusterError as err:
                if err.status == 403:
                    log.warning("cannot check Kueue LocalQueue %s/%s: %s", namespace, name, err)
                    return None
                if err.status != 404:
                    raise
                if err.details.get("name"):  # the API exists, the object does not
                    return False
                missing_api += 1
        if missing_api == len(KUEUE_VERSIONS):
            raise ClusterError("queue_name is set but Kueue is not installed in this cluster (no localqueues."
                               "kueue.x-k8s.io API): install Kueue or leave queue_name empty", 404, "NotFound")
        return False

    # ------------------------------------------------------------------ pods and logs
    def list_pods(self, namespace: str, selector: str) -> list[Any]:
        result = self._call(f"list pods {selector} in {namespace}", self.core.list_namespaced_pod, namespace,
                            label_selector=selector)
        return list(result.items or [])

    def read_log(self, namespace: str, pod: str, container: str, since_seconds: int | None = None,
                 tail_lines: int | None = None) -> str:
        """The container's log with RFC 3339 timestamps (``since_seconds`` / ``tail_lines`` bound it)."""
        kwargs: dict[str, Any] = {"container": container, "timestamps": True}
        if since_seconds is not None:
            kwargs["since_seconds"] = max(1, int(since_seconds))
        if tail_lines is not None:
            kwargs["tail_lines"] = int(tail_lines)
        return self._call(f"read log of {namespace}/{pod}", self.core.read_namespaced_pod_log, pod, namespace,
                          **kwargs) or ""
