"""Kubernetes sandbox: one pod per sandbox (e.g. a SWE-bench image), commands run through `exec`.

The pod runs `sleep infinity` with `restartPolicy: Never`, CPU/memory requests and limits, no
service-account token, no service links, no privilege escalation, all capabilities dropped, the
RuntimeDefault seccomp profile, optional `runAsNonRoot`, an `activeDeadlineSeconds` backstop so a
leaked pod dies on its own, and labels (`app.kubernetes.io/managed-by=sao-kfp`,
`app.kubernetes.io/component=sandbox`) for bulk cleanup:
`kubectl delete pod -l app.kubernetes.io/managed-by=sao-kfp,app.kubernetes.io/component=sandbox`.

Each `exec` runs a small bash wrapper (`build_exec_argv`) inside the pod: `cd` to the work dir, per
command `ulimit -t` (cpu_seconds) and `ulimit -v` (memory_mb), `timeout -k 2 <wall>` around the
command (TERM to its process group, KILL 2 s later), stdin fed through `head -c <n>` (the websocket
exec protocol cannot half-close stdin), and stdout/stderr each cut to `output_bytes + 1` bytes inside
the pod (the rest is read and discarded there), so a flood never crosses the network. Files move as
base64 over stdin/stdout. The client also has its own deadline (`wall + exec_grace_s`).

Limits: the image must have bash and GNU coreutils (`timeout`, `head`, `base64`), as SWE-bench images
do. `limits.network=False` cannot be enforced from a pod spec: the pod gets the label
`sao-kfp/network=none`, and `network_policy_manifest()` is the NetworkPolicy (deny all ingress and
egress for that label) that a cluster admin applies once per namespace; it needs a CNI that enforces
NetworkPolicy. `max_processes` is not applied per command (RLIMIT_NPROC counts a uid across the
whole node and is ignored for root); use the kubelet's `podPidsLimit` against fork bombs. A
background process that keeps stdout open makes `exec` wait until the timeout.
"""

from __future__ import annotations

import base64
import json
import threading
import time
import uuid
from typing import Any

from sao_core.closing import close_on_error
from sao_core.sandbox.base import ExecResult, SandboxError, SandboxLimits
from sao_core.sandbox.local import check_relative_path

__all__ = [
    "KubernetesPodSandbox",
    "MANAGED_BY_LABELS",
    "NETWORK_LABEL",
    "build_exec_argv",
    "build_read_argv",
    "build_write_argv",
    "load_core_v1_api",
    "network_policy_manifest",
    "parse_exec_status",
    "pod_manifest",
]

CONTAINER_NAME = "sandbox"
MANAGED_BY_LABELS = {"app.kubernetes.io/managed-by": "sao-kfp", "app.kubernetes.io/component": "sandbox"}
SANDBOX_ID_LABEL = "sao-kfp/sandbox-id"
NETWORK_LABEL = "sao-kfp/network"
# Container waiting reasons that never resolve by themselves: fail at once instead of at the timeout.
FATAL_WAITING_REASONS = frozenset({"InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError"})
READ_MISSING_EXIT = 44  # build_read_argv's exit status for a missing file

# $1 cap  $2 timeout  $3 cpu seconds  $4 address space KiB  $5 stdin bytes (-1: none)  $6 work dir
_EXEC_SCRIPT = r"""cap=$1 t=$2 cpu=$3 mem=$4 nin=$5 wd=$6
shift 6
cd -- "$wd" || exit 125
ulimit -t "$cpu" 2>/dev/null
ulimit -v "$mem" 2>/dev/null
keep() { head -c "$cap"; cat >/dev/null; }
if [ "$nin" -ge 0 ]; then
  head -c "$nin" | timeout -k 2 "$t" "$@" 2> >(keep >&2) | keep
  rc=${PIPESTATUS[1]}
else
  timeout -k 2 "$t" "$@" </dev/null 2> >(keep >&2) | keep
  rc=${PIPESTATUS[0]}
fi
wait "$!" 2>/dev/null
exit "$rc"
"""

# $1 work dir  $2 path  $3 number of base64 bytes on stdin
_WRITE_SCRIPT = r"""cd -- "$1" || exit 125
case "$2" in */*) mkdir -p -- "${2%/*}" || exit 1 ;; esac
head -c "$3" | base64 -d > "$2"
"""

# $1 work dir  $2 path
_READ_SCRIPT = r"""cd -- "$1" || exit 125
[ -e "$2" ] || exit 44
[ -f "$2" ] || { echo "not a regular file: $2" >&2; exit 1; }
base64 -- "$2"
"""


def _seconds(value: float) -> str:
    return f"{max(0.001, float(value)):g}"


def build_exec_argv(
    command: str | list[str],
    *,
    workdir: str,
    timeout_s: float,
    limits: SandboxLimits,
    stdin_bytes: int | None = None,
) -> list[str]:
    """The argv that `exec` sends to the pod: the wrapper above around `command`.

    A string command runs under `bash -lc`; stdout and stderr are each cut to
    `limits.output_bytes + 1` bytes inside the pod (one extra byte tells the client it was cut)."""
    inner = ["bash", "-lc", command] if isinstance(command, str) else [str(a) for a in command]
    if not inner:
        raise ValueError("empty command")
    return [
        "bash", "-c", _EXEC_SCRIPT, "sao-exec",
        str(max(0, int(limits.output_bytes)) + 1),
        _seconds(timeout_s),
        str(max(1, int(limits.cpu_seconds))),
        str(max(1, int(limits.memory_mb)) * 1024),
        str(-1 if stdin_bytes is None else int(stdin_bytes)),
        workdir,
        *inner,
    ]


def build_write_argv(workdir: str, path: str, b64_bytes: int) -> list[str]:
    """argv that writes `b64_bytes` bytes of base64 from stdin, decoded, to `workdir/path`."""
    rel = check_relative_path(path).as_posix()
    return ["bash", "-c", _WRITE_SCRIPT, "sao-write", workdir, rel, str(int(b64_bytes))]


def build_read_argv(workdir: str, path: str) -> list[str]:
    """argv that prints `workdir/path` as base64 (exit 44 when it does not exist)."""
    rel = check_relative_path(path).as_posix()
    return ["bash", "-c", _READ_SCRIPT, "sao-read", workdir, rel]


def parse_exec_status(raw: bytes | str | None) -> int | None:
    """Exit code from the exec error channel (a v1 Status): 0 on Success, the ExitCode cause on a
    non-zero exit, None when nothing arrived. Any other failure (e.g. no bash in the image) is a
    SandboxError."""
    text = (raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw or "").strip()
    if not text:
        return None
    try:
        status = json.loads(text)
    except json.JSONDecodeError as e:
        raise SandboxError(f"unreadable exec status from the pod: {text[:200]!r}") from e
    if status.get("status") == "Success":
        return 0
    for cause in (status.get("details") or {}).get("causes") or []:
        if cause.get("reason") == "ExitCode":
            return int(cause.get("message"))
    raise SandboxError(f"exec in the pod failed: {status.get('reason')}: {status.get('message')}")


def pod_manifest(
    name: str,
    image: str,
    *,
    limits: SandboxLimits = SandboxLimits(),
    workdir: str = "/workspace",
    node_selector: dict[str, str] | None = None,
    tolerations: list[dict[str, Any]] | None = None,
    labels: dict[str, str] | None = None,
    service_account: str | None = None,
    run_as_non_root: bool = False,
    run_as_user: int | None = None,
    cpu: str = "1",
    ephemeral_storage: str | None = None,
    mount_workdir: bool = True,
    drop_capabilities: bool = True,
    max_lifetime_s: int | None = 6 * 3600,
    sandbox_id: str | None = None,
) -> dict[str, Any]:
    """The Pod (as a plain dict, the shape `kubectl apply` takes) for one sandbox.

    `mount_workdir`: an emptyDir at `workdir` (writable also as non-root); set False when the work
    dir comes with the image (SWE-bench's /testbed). `run_as_non_root` needs an image whose USER is
    not root, or `run_as_user`."""
    container_sc, pod_sc = _security_contexts(drop_capabilities, run_as_non_root, run_as_user)
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": image,
        "command": ["sleep", "infinity"],
        "workingDir": workdir,
        "resources": _resources(cpu, limits.memory_mb, ephemeral_storage),
        "securityContext": container_sc,
        "stdin": False,
        "tty": False,
    }
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "hostNetwork": False,
        "hostPID": False,
        "hostIPC": False,
        "terminationGracePeriodSeconds": 0,
        "containers": [container],
    }
    if pod_sc:
        spec["securityContext"] = pod_sc
    if mount_workdir:
        container["volumeMounts"] = [{"name": "workdir", "mountPath": workdir}]
        volume: dict[str, Any] = {"name": "workdir", "emptyDir": {}}
        if ephemeral_storage:
            volume["emptyDir"]["sizeLimit"] = ephemeral_storage
        spec["volumes"] = [volume]
    spec.update(_placement(service_account, node_selector, tolerations, max_lifetime_s))
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": _pod_labels(labels, limits.network, sandbox_id)},
        "spec": spec,
    }


def _resources(cpu: str, memory_mb: int, ephemeral_storage: str | None) -> dict[str, dict[str, str]]:
    """Equal requests and limits: `cpu` (Kubernetes quantity), `memory_mb` MiB, and the ephemeral storage if given."""
    memory = f"{max(1, int(memory_mb))}Mi"
    resources: dict[str, dict[str, str]] = {"requests": {"cpu": cpu, "memory": memory},
                                            "limits": {"cpu": cpu, "memory": memory}}
    if ephemeral_storage:
        resources["requests"]["ephemeral-storage"] = ephemeral_storage
        resources["limits"]["ephemeral-storage"] = ephemeral_storage
    return resources


def _pod_labels(labels: dict[str, str] | None, network: bool, sandbox_id: str | None) -> dict[str, str]:
    """The caller's labels plus the bulk-cleanup labels, the network label the NetworkPolicy selects, and the id."""
    all_labels = {
        **(labels or {}),
        **MANAGED_BY_LABELS,
        NETWORK_LABEL: "allowed" if network else "none",
    }
    if sandbox_id:
        all_labels[SANDBOX_ID_LABEL] = sandbox_id
    return all_labels


def _security_contexts(drop_capabilities: bool, run_as_non_root: bool,
                       run_as_user: int | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the container's securityContext, the pod's; empty when the image's user is kept)."""
    container_sc: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "privileged": False,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if drop_capabilities:
        container_sc["capabilities"] = {"drop": ["ALL"]}
    pod_sc: dict[str, Any] = {}
    if run_as_non_root:
        container_sc["runAsNonRoot"] = True
        pod_sc["runAsNonRoot"] = True
    if run_as_user is not None:
        container_sc["runAsUser"] = int(run_as_user)
        pod_sc["runAsUser"] = int(run_as_user)
        pod_sc["runAsGroup"] = int(run_as_user)
        pod_sc["fsGroup"] = int(run_as_user)
    return container_sc, pod_sc


def _placement(service_account: str | None, node_selector: dict[str, str] | None,
               tolerations: list[dict[str, Any]] | None, max_lifetime_s: int | None) -> dict[str, Any]:
    """The optional pod spec fields: service account, node selector, tolerations, lifetime backstop (seconds)."""
    spec: dict[str, Any] = {}
    if service_account:
        spec["serviceAccountName"] = service_account
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [dict(t) for t in tolerations]
    if max_lifetime_s:
        spec["activeDeadlineSeconds"] = int(max_lifetime_s)
    return spec


def network_policy_manifest(namespace: str = "default", name: str = "sao-sandbox-no-network") -> dict[str, Any]:
    """NetworkPolicy that cuts all ingress and egress of sandbox pods created with network=False.
    Apply once per namespace (`kubectl apply -f`); it needs a CNI that enforces NetworkPolicy."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(MANAGED_BY_LABELS)},
        "spec": {
            "podSelector": {"matchLabels": {**MANAGED_BY_LABELS, NETWORK_LABEL: "none"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [],
            "egress": [],
        },
    }


def load_core_v1_api() -> Any:
    """A CoreV1Api from the in-cluster service account, else from the kubeconfig."""
    try:
        from kubernetes import client, config
    except ImportError as e:  # pragma: no cover - kubernetes comes with kfp
        raise SandboxError("the `kubernetes` python client is not installed: pip install kubernetes") from e
    try:
        config.load_incluster_config()
    except Exception as in_cluster_error:
        try:
            config.load_kube_config()
        except Exception as kubeconfig_error:
            raise SandboxError(
                "no Kubernetes configuration: not running in a cluster "
                f"({in_cluster_error}) and no usable kubeconfig ({kubeconfig_error}); set KUBECONFIG, "
                "run inside a pod with a service account, or pass api=kubernetes.client.CoreV1Api(...)"
            ) from kubeconfig_error
    return client.CoreV1Api()


def _api_status(error: Exception) -> int | None:
    return getattr(error, "status", None)


def _get(obj: Any, *names: str) -> Any:
    """obj.a.b.c with None anywhere giving None (pod status objects are sparse)."""
    for n in names:
        if obj is None:
            return None
        obj = getattr(obj, n, None)
    return obj


class KubernetesPodSandbox:
    """One pod per sandbox; see the module docstring. Creating it creates the pod and waits until
    it runs (SandboxError with the pod's last state and event otherwise)."""

    def __init__(
        self,
        image: str,
        namespace: str = "default",
        limits: SandboxLimits = SandboxLimits(),
        api: Any = None,
        startup_timeout_s: float = 300,
        *,
        exec_grace_s: float = 30.0,
        poll_interval_s: float = 1.0,
        name_prefix: str = "sao-sbx",
        **pod_shape: Any,
    ):
        """`pod_shape`: the pod's shape, as `pod_manifest`'s keyword arguments (workdir, node_selector, tolerations,
        labels, service_account, run_as_non_root, run_as_user, cpu, ephemeral_storage, mount_workdir,
        drop_capabilities, max_lifetime_s: defined once there; an unknown one is a TypeError naming it). `api`: a
        CoreV1Api (default: from the cluster's or the kubeconfig's configuration). Times in seconds."""
        self.limits = limits
        self.namespace = namespace
        self.exec_grace_s = exec_grace_s
        self.sandbox_id = uuid.uuid4().hex[:12]
        self.name = f"{name_prefix}-{self.sandbox_id}"
        self.manifest = pod_manifest(self.name, image, limits=limits, sandbox_id=self.sandbox_id, **pod_shape)
        self.workdir = self.manifest["spec"]["containers"][0]["workingDir"]
        self.api = api if api is not None else load_core_v1_api()
        self._exec_lock = threading.Lock()
        self._exec_api: Any = None
        self._closed = False
        self._deleted = False
        try:
            self.api.create_namespaced_pod(namespace=namespace, body=self.manifest)
        except Exception as e:
            self._deleted = self._closed = True
            raise SandboxError(f"could not create sandbox pod {namespace}/{self.name}: {_describe_error(e)}") from e
        with close_on_error(self):
            self._wait_running(startup_timeout_s, poll_interval_s)

    # ------------------------------------------------------------------ startup

    def _wait_running(self, timeout_s: float, poll_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no status yet"
        while True:
            try:
                pod = self.api.read_namespaced_pod(name=self.name, namespace=self.namespace)
            except Exception as e:
                if _api_status(e) == 404:
                    raise SandboxError(f"sandbox pod {self.namespace}/{self.name} disappeared while starting") from e
                last = f"could not read the pod: {_describe_error(e)}"
            else:
                phase = _get(pod, "status", "phase")
                statuses = _get(pod, "status", "container_statuses") or []
                state = _get(statuses[0], "state") if statuses else None
                if phase == "Running" and _get(state, "running") is not None:
                    return
                waiting = _get(state, "waiting")
                terminated = _get(state, "terminated")
                last = f"phase={phase}"
                if waiting is not None:
                    last += f", container waiting: {_get(waiting, 'reason')}: {_get(waiting, 'message') or ''}".rstrip(": ")
                if terminated is not None:
                    last += f", container terminated: {_get(terminated, 'reason')} (exit {_get(terminated, 'exit_code')})"
                if _get(pod, "status", "reason"):
                    last += f", pod: {_get(pod, 'status', 'reason')}: {_get(pod, 'status', 'message') or ''}".rstrip(": ")
                if phase in ("Failed", "Succeeded") or _get(waiting, "reason") in FATAL_WAITING_REASONS:
                    raise SandboxError(f"sandbox pod {self.namespace}/{self.name} cannot start: {last}"
                                       f"{self._last_event()}")
            if time.monotonic() >= deadline:
                raise SandboxError(
                    f"sandbox pod {self.namespace}/{self.name} (image {self.manifest['spec']['containers'][0]['image']})"
                    f" was not running after {timeout_s:g}s: {last}{self._last_event()}"
                )
            time.sleep(max(0.0, min(poll_s, deadline - time.monotonic())))

    def _last_event(self) -> str:
        """'; last event: Reason: message' for the pod, best effort (RBAC may not allow events)."""
        try:
            events = self.api.list_namespaced_event(
                namespace=self.namespace, field_selector=f"involvedObject.name={self.name}"
            )
        except Exception:
            return ""
        items = list(_get(events, "items") or [])
        if not items:
            return ""

        def when(ev: Any) -> float:
            for attr in ("last_timestamp", "event_time", "first_timestamp"):
                t = getattr(ev, attr, None)
                if t is not None:
                    return t.timestamp()
            return 0.0

        ev = max(enumerate(items), key=lambda pair: (when(pair[1]), pair[0]))[1]
        return f"; last event: {_get(ev, 'reason')}: {_get(ev, 'message')}"

    # ------------------------------------------------------------------ exec transport

    def _stream_api(self) -> Any:
        """A CoreV1Api on its own ApiClient: `kubernetes.stream.stream` swaps the client's request
        method during a call, which must not leak into other users of `self.api`."""
        if self._exec_api is None:
            api_client = getattr(self.api, "api_client", None)
            if api_client is None:
                self._exec_api = self.api
            else:
                from kubernetes import client

                self._exec_api = client.CoreV1Api(client.ApiClient(api_client.configuration))
        return self._exec_api

    def _run(self, argv: list[str], stdin: bytes | None, deadline_s: float) -> tuple[int | None, bytes, bytes, bool]:
        """Run argv in the pod: (exit code, stdout, stderr, client deadline hit)."""
        from kubernetes.stream import stream

        if self._closed:
            raise SandboxError("sandbox is closed")
        with self._exec_lock:
            try:
                resp = stream(
                    self._stream_api().connect_get_namespaced_pod_exec,
                    self.name,
                    self.namespace,
                    container=CONTAINER_NAME,
                    command=argv,
                    stdin=stdin is not None,
                    stdout=True,
                    stderr=True,
                    tty=False,
                    binary=True,
                    _preload_content=False,
                )
            except Exception as e:
                raise SandboxError(f"exec in sandbox pod {self.namespace}/{self.name} failed: {_describe_error(e)}") from e
            try:
                if stdin:
                    view = memoryview(stdin)
                    for i in range(0, len(view), 1 << 16):
                        resp.write_stdin(bytes(view[i:i + (1 << 16)]))
                end = time.monotonic() + deadline_s
                while resp.is_open() and time.monotonic() < end:
                    resp.update(timeout=min(1.0, max(0.0, end - time.monotonic())))
                client_timeout = resp.is_open()
                out, err, status = (_as_bytes(resp.read_channel(ch)) for ch in (1, 2, 3))
            except SandboxError:
                raise
            except Exception as e:
                raise SandboxError(f"exec in sandbox pod {self.namespace}/{self.name} failed: {_describe_error(e)}") from e
            finally:
                try:
                    resp.close()
                except Exception:
                    pass
        code = None if client_timeout else parse_exec_status(status)
        if code is None and not client_timeout:
            raise SandboxError(f"exec in sandbox pod {self.namespace}/{self.name} ended without an exit status")
        return code, out, err, client_timeout

    # ------------------------------------------------------------------ Sandbox protocol

    def exec(self, command: str | list[str], timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        timeout = self.limits.wall_seconds if timeout_s is None else float(timeout_s)
        data = stdin.encode() if stdin is not None else None
        argv = build_exec_argv(command, workdir=self.workdir, timeout_s=timeout, limits=self.limits,
                               stdin_bytes=None if data is None else len(data))
        start = time.monotonic()
        code, out, err, client_timeout = self._run(argv, data, timeout + self.exec_grace_s)
        seconds = time.monotonic() - start
        timed_out = client_timeout or (code in (124, 137) and seconds >= timeout)
        cap = max(0, int(self.limits.output_bytes))
        return ExecResult(
            exit_code=None if timed_out else code,
            stdout=out[:cap].decode("utf-8", "replace"),
            stderr=err[:cap].decode("utf-8", "replace"),
            timed_out=timed_out,
            truncated=len(out) > cap or len(err) > cap,
            seconds=seconds,
        )

    def _file_timeout(self) -> float:
        return max(60.0, self.limits.wall_seconds)

    def write_file(self, path: str, data: str | bytes) -> None:
        payload = base64.b64encode(data.encode() if isinstance(data, str) else bytes(data))
        argv = build_write_argv(self.workdir, path, len(payload))
        code, _, err, client_timeout = self._run(argv, payload, self._file_timeout())
        if client_timeout or code != 0:
            raise OSError(f"writing {path!r} in sandbox pod {self.name} failed (exit {code}): "
                          f"{err.decode('utf-8', 'replace').strip()}")

    def read_file(self, path: str) -> bytes:
        argv = build_read_argv(self.workdir, path)
        code, out, err, client_timeout = self._run(argv, None, self._file_timeout())
        if code == READ_MISSING_EXIT:
            raise FileNotFoundError(f"{path!r} does not exist in sandbox pod {self.name}")
        if client_timeout or code != 0:
            raise OSError(f"reading {path!r} in sandbox pod {self.name} failed (exit {code}): "
                          f"{err.decode('utf-8', 'replace').strip()}")
        return base64.b64decode(out)

    def close(self) -> None:
        """Delete the pod now (grace 0). Idempotent; a pod that is already gone is fine."""
        self._closed = True
        if self._deleted:
            return
        try:
            self.api.delete_namespaced_pod(
                name=self.name, namespace=self.namespace, grace_period_seconds=0, propagation_policy="Background"
            )
        except Exception as e:
            if _api_status(e) != 404:
                raise SandboxError(f"could not delete sandbox pod {self.namespace}/{self.name}: {_describe_error(e)}") from e
        self._deleted = True

    def __enter__(self) -> KubernetesPodSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"KubernetesPodSandbox(pod={self.namespace}/{self.name}, closed={self._closed})"


def _as_bytes(data: Any) -> bytes:
    if not data:
        return b""
    return data if isinstance(data, bytes) else str(data).encode("utf-8")


def _describe_error(e: Exception) -> str:
    status, reason = getattr(e, "status", None), getattr(e, "reason", None)
    body = getattr(e, "body", None)
    if status is not None or reason is not None:
        message = ""
        if body:
            try:
                message = json.loads(body).get("message", "")
            except (ValueError, AttributeError, TypeError):
                message = str(body)[:300]
        return f"HTTP {status} {reason or ''} {message}".strip()
    return f"{type(e).__name__}: {e}"
