"""KubernetesPodSandbox without a cluster.

- `pod_manifest` / `network_policy_manifest` are checked field by field and round-tripped through the
  real `kubernetes` client models (a misspelt field would be dropped and fail the round trip).
- The pod lifecycle runs against `FakeCoreV1Api` below. No Kubernetes cluster exists on the test
  machines, so this small in-test fake of the CoreV1Api calls we use (create / read / delete pod,
  list events) is the one place a fake stands in; it returns and raises the real client's model and
  exception classes.
- `kubernetes.stream` (the exec websocket) is not faked: the argv that `exec` sends into the pod is
  built by pure functions, and those run here for real under local bash, as they would in the pod.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from sao_core.sandbox import SandboxError, SandboxLimits, make_sandbox
from sao_core.sandbox import kubernetes as k8s
from sao_core.sandbox.kubernetes import (
    KubernetesPodSandbox,
    build_exec_argv,
    build_read_argv,
    build_write_argv,
    network_policy_manifest,
    parse_exec_status,
    pod_manifest,
)

LIMITS = SandboxLimits(wall_seconds=20, cpu_seconds=30, memory_mb=2048, output_bytes=1000)


def _roundtrip(manifest: dict, kind: str) -> dict:
    api_client = client.ApiClient()
    model = api_client._ApiClient__deserialize(manifest, kind)  # the client's own model parser
    return api_client.sanitize_for_serialization(model)


# ---------------------------------------------------------------------------------- manifests


def test_pod_manifest_content():
    m = pod_manifest(
        "sao-sbx-abc", "ghcr.io/example/swe:1", limits=LIMITS, workdir="/workspace",
        node_selector={"pool": "sandbox"},
        tolerations=[{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}],
        labels={"episode": "e1"}, service_account="sandbox-sa", cpu="2", ephemeral_storage="5Gi",
        sandbox_id="abc",
    )
    assert m["apiVersion"] == "v1" and m["kind"] == "Pod"
    assert m["metadata"]["name"] == "sao-sbx-abc"
    labels = m["metadata"]["labels"]
    assert labels["episode"] == "e1" and labels["app.kubernetes.io/managed-by"] == "sao-kfp"
    assert labels["app.kubernetes.io/component"] == "sandbox" and labels["sao-kfp/sandbox-id"] == "abc"
    assert labels["sao-kfp/network"] == "none"
    spec = m["spec"]
    assert spec["restartPolicy"] == "Never"
    assert spec["automountServiceAccountToken"] is False and spec["enableServiceLinks"] is False
    assert spec["serviceAccountName"] == "sandbox-sa"
    assert spec["nodeSelector"] == {"pool": "sandbox"}
    assert spec["tolerations"] == [{"key": "sandbox", "operator": "Exists", "effect": "NoSchedule"}]
    assert spec["terminationGracePeriodSeconds"] == 0 and spec["activeDeadlineSeconds"] > 0
    assert not spec["hostNetwork"] and not spec["hostPID"] and not spec["hostIPC"]
    (c,) = spec["containers"]
    assert c["image"] == "ghcr.io/example/swe:1" and c["command"] == ["sleep", "infinity"]
    assert c["workingDir"] == "/workspace"
    assert c["resources"] == {
        "requests": {"cpu": "2", "memory": "2048Mi", "ephemeral-storage": "5Gi"},
        "limits": {"cpu": "2", "memory": "2048Mi", "ephemeral-storage": "5Gi"},
    }
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "runAsNonRoot" not in sc and "securityContext" not in spec  # default: the image's user
    assert c["volumeMounts"] == [{"name": "workdir", "mountPath": "/workspace"}]
    assert spec["volumes"] == [{"name": "workdir", "emptyDir": {"sizeLimit": "5Gi"}}]
    assert _roundtrip(m, "V1Pod") == m


def test_pod_manifest_options():
    m = pod_manifest("p", "img", limits=SandboxLimits(network=True), run_as_non_root=True, run_as_user=1000,
                     mount_workdir=False, drop_capabilities=False, max_lifetime_s=None, workdir="/testbed")
    spec, c = m["spec"], m["spec"]["containers"][0]
    assert c["securityContext"]["runAsNonRoot"] is True and c["securityContext"]["runAsUser"] == 1000
    assert spec["securityContext"] == {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000}
    assert "capabilities" not in c["securityContext"] and c["securityContext"]["allowPrivilegeEscalation"] is False
    assert "volumes" not in spec and "volumeMounts" not in c and c["workingDir"] == "/testbed"
    assert "activeDeadlineSeconds" not in spec and "serviceAccountName" not in spec
    assert "nodeSelector" not in spec and "tolerations" not in spec
    assert spec["automountServiceAccountToken"] is False
    assert m["metadata"]["labels"]["sao-kfp/network"] == "allowed"
    assert c["resources"]["limits"]["memory"] == "1024Mi"
    assert _roundtrip(m, "V1Pod") == m


def test_network_policy_manifest():
    np = network_policy_manifest("sandboxes")
    assert np["metadata"]["namespace"] == "sandboxes"
    assert np["spec"]["podSelector"]["matchLabels"]["sao-kfp/network"] == "none"
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    assert np["spec"]["ingress"] == [] and np["spec"]["egress"] == []
    assert _roundtrip(np, "V1NetworkPolicy") == np


# ---------------------------------------------------------------------------------- fake CoreV1Api


def _waiting(reason: str, message: str = "") -> client.V1ContainerState:
    return client.V1ContainerState(waiting=client.V1ContainerStateWaiting(reason=reason, message=message))


RUNNING = ("Running", client.V1ContainerState(running=client.V1ContainerStateRunning(started_at=datetime.now(UTC))))
CREATING = ("Pending", _waiting("ContainerCreating"))
IMAGE_BACKOFF = ("Pending", _waiting("ImagePullBackOff", 'Back-off pulling image "nope/missing:1"'))


class FakeCoreV1Api:
    """The CoreV1Api calls KubernetesPodSandbox makes (see the module docstring for why a fake).

    `script`: the (phase, container state) the pod reports on successive reads; the last repeats."""

    def __init__(self, script=(CREATING, RUNNING), events=(), delete_error: ApiException | None = None):
        self.script = list(script)
        self.events = list(events)
        self.delete_error = delete_error
        self.pods: dict[tuple[str, str], dict] = {}
        self.reads = 0
        self.deletes: list[tuple[str, str, dict]] = []

    def create_namespaced_pod(self, namespace, body, **kwargs):
        key = (namespace, body["metadata"]["name"])
        if key in self.pods:
            raise ApiException(status=409, reason="Conflict")
        self.pods[key] = body
        return _roundtrip(body, "V1Pod")

    def read_namespaced_pod(self, name, namespace, **kwargs):
        if (namespace, name) not in self.pods:
            raise ApiException(status=404, reason="Not Found")
        phase, state = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        body = self.pods[(namespace, name)]
        c = body["spec"]["containers"][0]
        status = client.V1ContainerStatus(name=c["name"], image=c["image"], image_id="", ready=phase == "Running",
                                          restart_count=0, state=state)
        return client.V1Pod(metadata=client.V1ObjectMeta(name=name, namespace=namespace),
                            status=client.V1PodStatus(phase=phase, container_statuses=[status]))

    def list_namespaced_event(self, namespace, field_selector=None, **kwargs):
        name = field_selector.split("=", 1)[1]
        t0 = datetime(2025, 1, 1, tzinfo=UTC)
        items = [
            client.CoreV1Event(metadata=client.V1ObjectMeta(name=f"{name}.{i}"),
                               involved_object=client.V1ObjectReference(kind="Pod", name=name, namespace=namespace),
                               reason=reason, message=message, last_timestamp=t0 + timedelta(seconds=i))
            for i, (reason, message) in enumerate(self.events)
        ]
        return client.CoreV1EventList(items=items)

    def delete_namespaced_pod(self, name, namespace, **kwargs):
        self.deletes.append((namespace, name, kwargs))
        if self.delete_error is not None:
            raise self.delete_error
        if self.pods.pop((namespace, name), None) is None:
            raise ApiException(status=404, reason="Not Found")


def _sandbox(api, **kw) -> KubernetesPodSandbox:
    kw.setdefault("poll_interval_s", 0.01)
    kw.setdefault("startup_timeout_s", 5)
    return KubernetesPodSandbox("ghcr.io/example/swe:1", namespace="sbx", limits=LIMITS, api=api, **kw)


def test_pod_created_and_waited_until_running_then_deleted_once():
    api = FakeCoreV1Api(script=(CREATING, CREATING, RUNNING))
    sb = _sandbox(api, labels={"episode": "e7"}, node_selector={"pool": "sandbox"})
    assert api.reads == 3  # two Pending reads, then Running
    ((ns, name),) = api.pods
    assert ns == "sbx" and name == sb.name and name.startswith("sao-sbx-")
    body = api.pods[(ns, name)]
    assert body == sb.manifest
    assert body["metadata"]["labels"]["episode"] == "e7"
    assert body["spec"]["nodeSelector"] == {"pool": "sandbox"}
    assert body["spec"]["containers"][0]["resources"]["limits"]["memory"] == "2048Mi"
    sb.close()
    assert api.pods == {} and len(api.deletes) == 1
    assert api.deletes[0][2]["grace_period_seconds"] == 0
    sb.close()  # idempotent: no second delete
    assert len(api.deletes) == 1
    with pytest.raises(SandboxError, match="closed"):
        sb.exec("true")


def test_the_pod_shape_options_are_pod_manifests_and_a_misspelt_one_is_refused_before_any_pod():
    api = FakeCoreV1Api(script=(RUNNING,))
    sb = _sandbox(api, workdir="/testbed", mount_workdir=False, cpu="2")
    assert sb.workdir == "/testbed" and sb.manifest["spec"]["containers"][0]["resources"]["limits"]["cpu"] == "2"
    assert "volumes" not in sb.manifest["spec"]
    sb.close()
    with pytest.raises(TypeError, match="node_selectors"):
        _sandbox(api, node_selectors={"pool": "sandbox"})
    assert api.pods == {}


def test_close_ignores_a_pod_that_is_already_gone():
    api = FakeCoreV1Api()
    sb = _sandbox(api)
    api.pods.clear()  # e.g. evicted, or deleted by a cleanup job
    sb.close()  # the 404 is ignored
    assert len(api.deletes) == 1


def test_close_reports_other_delete_errors_and_can_retry():
    api = FakeCoreV1Api(delete_error=ApiException(status=500, reason="Internal Server Error"))
    sb = _sandbox(api)
    with pytest.raises(SandboxError, match="500"):
        sb.close()
    api.delete_error = None
    sb.close()
    assert api.pods == {} and len(api.deletes) == 2


def test_startup_timeout_with_image_pull_backoff_is_clear():
    api = FakeCoreV1Api(
        script=(CREATING, IMAGE_BACKOFF),
        events=[("Scheduled", "assigned to node-1"), ("Failed", 'Failed to pull image "nope/missing:1": not found')],
    )
    start = time.monotonic()
    with pytest.raises(SandboxError) as info:
        _sandbox(api, startup_timeout_s=0.3)
    assert time.monotonic() - start >= 0.3   # waited for the startup timeout, then failed with the reason
    msg = str(info.value)
    assert "not running after 0.3s" in msg and "ImagePullBackOff" in msg and "nope/missing:1" in msg
    assert "last event: Failed: Failed to pull image" in msg
    assert api.pods == {} and len(api.deletes) == 1  # the failed pod is cleaned up


def test_unrecoverable_waiting_reason_fails_fast():
    api = FakeCoreV1Api(script=(("Pending", _waiting("CreateContainerConfigError",
                                                     "container has runAsNonRoot and image will run as root")),))
    start = time.monotonic()
    with pytest.raises(SandboxError, match="cannot start.*runAsNonRoot"):
        _sandbox(api, startup_timeout_s=30, run_as_non_root=True)
    assert time.monotonic() - start < 5 and api.pods == {}


def test_failed_pod_and_create_errors():
    terminated = client.V1ContainerState(terminated=client.V1ContainerStateTerminated(exit_code=1, reason="Error"))
    api = FakeCoreV1Api(script=(("Failed", terminated),))
    with pytest.raises(SandboxError, match="phase=Failed.*exit 1"):
        _sandbox(api)

    class Forbidden(FakeCoreV1Api):
        def create_namespaced_pod(self, namespace, body, **kwargs):
            raise ApiException(status=403, reason="Forbidden")

    with pytest.raises(SandboxError, match="could not create sandbox pod.*403"):
        _sandbox(Forbidden())


def test_missing_cluster_configuration_is_a_clear_error(monkeypatch, tmp_path):
    for var in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(SandboxError, match="no Kubernetes configuration"):
        KubernetesPodSandbox("img")


def test_make_sandbox_kinds():
    api = FakeCoreV1Api()
    sb = make_sandbox("kubernetes", LIMITS, image="img", api=api, poll_interval_s=0.01)
    assert isinstance(sb, KubernetesPodSandbox) and sb.limits is LIMITS
    sb.close()
    with pytest.raises(ValueError, match="local, kubernetes"):
        make_sandbox("docker")


def test_kubernetes_module_is_imported_lazily():
    code = ("import sys, sao_core.sandbox as s; assert 'sao_core.sandbox.kubernetes' not in sys.modules; "
            "s.KubernetesPodSandbox; assert 'sao_core.sandbox.kubernetes' in sys.modules")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------------- exec wrapper


def test_parse_exec_status():
    assert parse_exec_status(b'{"metadata":{},"status":"Success"}') == 0
    failure = ('{"metadata":{},"status":"Failure","message":"command terminated with non-zero exit code: '
               'error executing command [bash], exit code 3","reason":"NonZeroExitCode",'
               '"details":{"causes":[{"reason":"ExitCode","message":"3"}]}}')
    assert parse_exec_status(failure) == 3
    assert parse_exec_status(b"") is None and parse_exec_status(None) is None
    with pytest.raises(SandboxError, match="executable file not found"):
        parse_exec_status('{"status":"Failure","reason":"InternalError","message":"exec: \\"bash\\": '
                          'executable file not found in $PATH"}')


def test_exec_argv_shape():
    argv = build_exec_argv("echo hi", workdir="/workspace", timeout_s=7.5, limits=LIMITS)
    assert argv[:2] == ["bash", "-c"] and argv[3] == "sao-exec"
    assert argv[4:10] == ["1001", "7.5", "30", str(2048 * 1024), "-1", "/workspace"]
    assert argv[10:] == ["bash", "-lc", "echo hi"]
    assert "timeout -k 2" in argv[2]
    argv = build_exec_argv(["python", "-c", "print(1)"], workdir="/w", timeout_s=3, limits=LIMITS, stdin_bytes=12)
    assert argv[8] == "12" and argv[10:] == ["python", "-c", "print(1)"]
    with pytest.raises(ValueError):
        build_exec_argv([], workdir="/w", timeout_s=1, limits=LIMITS)
    for bad in ("/etc/passwd", "../x", ""):
        with pytest.raises(ValueError):
            build_write_argv("/w", bad, 4)
        with pytest.raises(ValueError):
            build_read_argv("/w", bad)


needs_tools = pytest.mark.skipif(not all(shutil.which(t) for t in ("bash", "timeout", "head", "base64")),
                                 reason="needs bash and GNU coreutils, as the pod image does")


def _run_local(argv, stdin: bytes | None = None, cwd=None):
    return subprocess.run(argv, input=stdin, capture_output=True, timeout=30, cwd=cwd)


@needs_tools
def test_exec_wrapper_runs_caps_and_times_out(tmp_path):
    limits = SandboxLimits(output_bytes=100, cpu_seconds=10, memory_mb=512)
    wd = str(tmp_path)

    def run(cmd, timeout_s=10.0, stdin=None):
        argv = build_exec_argv(cmd, workdir=wd, timeout_s=timeout_s, limits=limits,
                               stdin_bytes=None if stdin is None else len(stdin))
        return _run_local(argv, stdin)

    r = run(["bash", "-c", "pwd; echo err >&2; exit 3"])
    assert (r.returncode, r.stdout, r.stderr) == (3, f"{wd}\n".encode(), b"err\n")
    r = run(["bash", "-c", "head -c 5000000 /dev/zero; head -c 3000000 /dev/zero >&2; exit 4"])
    assert r.returncode == 4 and len(r.stdout) == 101 and len(r.stderr) == 101  # cap + 1 marks the cut
    start = time.monotonic()
    r = run(["bash", "-c", "yes"], timeout_s=1)
    assert r.returncode == 124 and len(r.stdout) == 101 and time.monotonic() - start < 4
    r = run(["bash", "-c", "trap '' TERM; while :; do :; done"], timeout_s=0.5)  # ignores TERM: KILL follows
    assert r.returncode == 137
    r = run(["cat"], stdin=b"exactly these bytes")  # no EOF needed on the exec stdin stream
    assert r.returncode == 0 and r.stdout == b"exactly these bytes"


@needs_tools
def test_exec_and_files_through_the_wrapper(tmp_path, monkeypatch):
    """KubernetesPodSandbox.exec/write_file/read_file end to end, with the pod's exec transport
    replaced by running the same argv locally (the websocket itself is not reproducible here)."""
    api = FakeCoreV1Api()
    sb = _sandbox(api, workdir=str(tmp_path))
    sb.limits = SandboxLimits(output_bytes=50, wall_seconds=10)

    def local_transport(argv, stdin, deadline_s):
        p = subprocess.run(argv, input=stdin, capture_output=True, timeout=deadline_s)
        return p.returncode, p.stdout, p.stderr, False

    monkeypatch.setattr(sb, "_run", local_transport)
    r = sb.exec(["bash", "-c", "echo hello; exit 2"])
    assert (r.exit_code, r.stdout, r.truncated, r.timed_out) == (2, "hello\n", False, False)
    r = sb.exec(["bash", "-c", "seq 1000"])
    assert r.ok and r.truncated and len(r.stdout) == 50
    r = sb.exec(["tr", "a-z", "A-Z"], stdin="shout")
    assert r.stdout == "SHOUT"
    r = sb.exec(["sleep", "5"], timeout_s=0.5)
    assert r.timed_out and r.exit_code is None
    payload = bytes(range(256)) * 300
    sb.write_file("deep/dir/blob.bin", payload)
    assert (tmp_path / "deep/dir/blob.bin").read_bytes() == payload
    assert sb.read_file("deep/dir/blob.bin") == payload
    with pytest.raises(FileNotFoundError):
        sb.read_file("missing")
    with pytest.raises(ValueError):
        sb.write_file("../escape", "x")
    assert not os.path.exists(tmp_path.parent / "escape")
    sb.close()


def test_exec_transport_uses_its_own_api_client():
    """stream() swaps ApiClient.request during a call; exec must not do that on the caller's client."""
    api = client.CoreV1Api(client.ApiClient(client.Configuration()))
    sb = KubernetesPodSandbox.__new__(KubernetesPodSandbox)
    sb.api, sb._exec_api = api, None
    stream_api = sb._stream_api()
    assert stream_api is not api and stream_api.api_client is not api.api_client
    assert stream_api.api_client.configuration is api.api_client.configuration
    assert k8s.CONTAINER_NAME == "sandbox"
