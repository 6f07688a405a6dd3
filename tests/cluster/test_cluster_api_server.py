"""A Kubernetes API server on 127.0.0.1 that speaks the paths the TrainJob launcher uses, plus its own tests.

:class:`FakeKubeAPI` serves, over real HTTP, what the ``kubernetes`` python client sends:

- ``trainer.kubeflow.org/v1alpha1`` trainjobs and trainingruntimes (namespaced: POST, GET, DELETE,
  PATCH with a JSON merge patch) and clustertrainingruntimes (cluster-scoped: POST, GET). Every POST
  body is validated against the official CRD schema (``sao_core.cluster.schema``): a body that fails
  gets ``422 Invalid`` with the causes, like the API server; an existing name gets ``409 AlreadyExists``.
  Like Trainer's admission webhook, a TrainJob whose runtime does not exist is refused (422), and like
  Kueue's, a TrainJob with the ``kueue.x-k8s.io/queue-name`` label starts suspended (``spec.suspend``,
  condition ``Suspended``) until the test calls :meth:`admit`;
- ``kueue.x-k8s.io/v1beta2`` localqueues (GET);
- ``/api/v1`` pods (list with a label selector) and pod logs (``timestamps``, ``sinceSeconds``,
  ``tailLines``, ``container``; 400 while the container waits).

Deleting a TrainJob deletes the runtimes it owns (garbage collection). The test drives the rest:
conditions, jobsStatus, pods and their logs. ``calls`` records (verb, resource) of every request, and
``forbidden`` makes chosen (verb, resource) pairs answer 403.
"""

from __future__ import annotations

import base64
import copy
import datetime as dt
import json
import threading
import time
import uuid
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from fake_http import FakeServer, Request  # noqa: E402  (tests/fake_http.py: the stand-in servers' home)

from sao_core.cluster import manifests, schema

TRAINER = "/apis/trainer.kubeflow.org/v1alpha1"
KINDS = {"trainjobs": "TrainJob", "trainingruntimes": "TrainingRuntime",
         "clustertrainingruntimes": "ClusterTrainingRuntime"}


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _merge(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = _merge(out.get(key), value)
    return out


def _status(code: int, reason: str, message: str, details: dict | None = None) -> dict:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details or {}, "code": code}


class FakeKubeAPI:
    """See the module docstring. ``url`` is ready after construction; call :meth:`stop`."""

    def __init__(self, kueue: bool = True):
        self.lock = threading.RLock()
        self.objects: dict[tuple[str, str, str], dict] = {}   # (plural, namespace or '', name) -> object
        self.pods: dict[tuple[str, str], dict] = {}           # (namespace, name) -> {"pod", "logs", "waiting"}
        self.local_queues: set[tuple[str, str]] = set()
        self.calls: list[tuple[str, str]] = []
        self.forbidden: set[tuple[str, str]] = set()
        self.kueue = kueue
        self.rejected: list[dict] = []                        # 422 bodies sent back
        self.stopped = False
        self._server = FakeServer(self._answer, keep_alive=True)
        self.httpd, self.url, self.thread = self._server.httpd, self._server.url, self._server.thread

    def stop(self) -> None:
        """Stop answering: new connections are refused and open keep-alive connections are dropped."""
        self.stopped = True
        self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------------ test controls
    def get(self, plural: str, name: str, namespace: str = "") -> dict | None:
        with self.lock:
            obj = self.objects.get((plural, namespace, name))
            return copy.deepcopy(obj) if obj else None

    def add_object(self, obj: dict) -> None:
        plural = next(p for p, k in KINDS.items() if k == obj["kind"])
        with self.lock:
            self.objects[(plural, obj["metadata"].get("namespace", ""), obj["metadata"]["name"])] = self._stored(obj)

    def set_condition(self, namespace: str, name: str, kind: str, status: str = "True", reason: str = "",
                      message: str = "") -> None:
        with self.lock:
            obj = self.objects[("trainjobs", namespace, name)]
            conditions = [c for c in obj.setdefault("status", {}).setdefault("conditions", []) if c["type"] != kind]
            conditions.append({"type": kind, "status": status, "reason": reason or kind, "message": message,
                               "lastTransitionTime": _now()})
            obj["status"]["conditions"] = conditions

    def set_jobs_status(self, namespace: str, name: str, jobs: list[dict]) -> None:
        with self.lock:
            self.objects[("trainjobs", namespace, name)].setdefault("status", {})["jobsStatus"] = jobs

    def admit(self, namespace: str, name: str) -> None:
        """What Kueue does on admission: unsuspend."""
        with self.lock:
            obj = self.objects[("trainjobs", namespace, name)]
            obj["spec"]["suspend"] = False
        self.set_condition(namespace, name, "Suspended", "False", "Resumed", "TrainJob is resumed")

    def add_pod(self, namespace: str, name: str, labels: dict[str, str], container: str = "node",
                waiting: tuple[str, str] | None = None) -> None:
        with self.lock:
            self.pods[(namespace, name)] = {"labels": dict(labels), "container": container, "waiting": waiting,
                                            "logs": [], "created": _now()}

    def set_waiting(self, namespace: str, name: str, waiting: tuple[str, str] | None) -> None:
        with self.lock:
            self.pods[(namespace, name)]["waiting"] = waiting

    def log(self, namespace: str, pod: str, *lines: str) -> None:
        with self.lock:
            for line in lines:
                stamp = dt.datetime.now(dt.UTC)
                self.pods[(namespace, pod)]["logs"].append((stamp, line))
                time.sleep(0.001)  # distinct timestamps, as a real log has

    def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self.lock:
                if predicate():
                    return
            time.sleep(0.01)
        raise AssertionError("condition not reached in time")

    # ------------------------------------------------------------------ server side
    def _stored(self, obj: dict) -> dict:
        stored = copy.deepcopy(obj)
        meta = stored.setdefault("metadata", {})
        meta.update({"uid": str(uuid.uuid4()), "creationTimestamp": _now(), "resourceVersion": "1", "generation": 1})
        return stored

    def _pod_json(self, namespace: str, name: str, entry: dict) -> dict:
        waiting = entry["waiting"]
        state = {"waiting": {"reason": waiting[0], "message": waiting[1]}} if waiting else \
            {"running": {"startedAt": entry["created"]}}
        return {"metadata": {"name": name, "namespace": namespace, "labels": entry["labels"],
                             "creationTimestamp": entry["created"],
                             "annotations": {"batch.kubernetes.io/job-completion-index": "0"}},
                "spec": {"containers": [{"name": entry["container"], "image": "img"}]},
                "status": {"phase": "Pending" if waiting else "Running",
                           "conditions": [{"type": "PodScheduled", "status": "True"}],
                           "containerStatuses": [{"name": entry["container"], "image": "img", "imageID": "",
                                                  "ready": not waiting, "restartCount": 0, "state": state}]}}

    def handle(self, method: str, raw_path: str, body: bytes) -> tuple[int, Any, str]:
        url = urlsplit(raw_path)
        query = {k: v[-1] for k, v in parse_qs(url.query).items()}
        parts = [p for p in url.path.split("/") if p]
        # --- core: pods and logs
        if parts[:2] == ["api", "v1"] and len(parts) >= 5 and parts[2] == "namespaces" and parts[4] == "pods":
            namespace = parts[3]
            if len(parts) == 5 and method == "GET":
                return self._guard("list", "pods") or self._list_pods(namespace, query.get("labelSelector", ""))
            if len(parts) == 7 and parts[6] == "log" and method == "GET":
                return self._guard("get", "pods/log") or self._read_log(namespace, parts[5], query)
            return 405, _status(405, "MethodNotAllowed", f"{method} {url.path}"), "application/json"
        # --- core: secrets (the launcher's per-run token Secret)
        if parts[:2] == ["api", "v1"] and len(parts) in (5, 6) and parts[2] == "namespaces" and parts[4] == "secrets":
            return self._secret(method, parts[3], parts[5] if len(parts) == 6 else "", body)
        # --- kueue
        if parts[:3] == ["apis", "kueue.x-k8s.io", "v1beta2"] and len(parts) == 7 and parts[5] == "localqueues":
            if guard := self._guard("get", "localqueues"):
                return guard
            if (parts[4], parts[6]) in self.local_queues:
                return 200, {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
                             "metadata": {"name": parts[6], "namespace": parts[4]}, "spec": {}}, "application/json"
            return 404, _status(404, "NotFound", f'localqueues.kueue.x-k8s.io "{parts[6]}" not found',
                                {"name": parts[6], "group": "kueue.x-k8s.io", "kind": "localqueues"}), "application/json"
        # --- trainer
        if parts[:3] != ["apis", "trainer.kubeflow.org", "v1alpha1"]:
            return 404, _status(404, "NotFound", "the server could not find the requested resource"), "application/json"
        rest = parts[3:]
        if rest and rest[0] == "namespaces" and len(rest) >= 3:
            namespace, plural, name = rest[1], rest[2], (rest[3] if len(rest) > 3 else "")
        else:
            namespace, plural, name = "", rest[0] if rest else "", (rest[1] if len(rest) > 1 else "")
        if plural not in KINDS or (plural == "clustertrainingruntimes") != (namespace == ""):
            return 404, _status(404, "NotFound", "the server could not find the requested resource"), "application/json"
        verb = {"POST": "create", "GET": "get", "DELETE": "delete", "PATCH": "patch"}.get(method, method.lower())
        if guard := self._guard(verb, plural):
            return guard
        with self.lock:
            if method == "POST" and not name:
                return self._create(plural, namespace, json.loads(body or b"{}"), query)
            key = (plural, namespace, name)
            if key not in self.objects:
                return 404, _status(404, "NotFound", f'{plural}.trainer.kubeflow.org "{name}" not found',
                                    {"name": name, "group": "trainer.kubeflow.org", "kind": plural}), "application/json"
            if method == "GET":
                return 200, self.objects[key], "application/json"
            if method == "DELETE":
                obj = self.objects.pop(key)
                uid = obj["metadata"]["uid"]
                for other in [k for k, o in self.objects.items()
                              if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences", []))]:
                    del self.objects[other]  # garbage collection of owned objects
                return 200, _status(200, "", "deleted") | {"status": "Success"}, "application/json"
            if method == "PATCH":
                self.objects[key] = _merge(self.objects[key], json.loads(body or b"{}"))
                return 200, self.objects[key], "application/json"
        return 405, _status(405, "MethodNotAllowed", method), "application/json"

    def _secret(self, method: str, namespace: str, name: str, body: bytes) -> tuple[int, Any, str]:
        verb = {"POST": "create", "GET": "get", "DELETE": "delete", "PATCH": "patch"}.get(method, method.lower())
        if guard := self._guard(verb, "secrets"):
            return guard
        with self.lock:
            if method == "POST" and not name:
                obj = json.loads(body or b"{}")
                name = obj["metadata"]["name"]
                if ("secrets", namespace, name) in self.objects:
                    return 409, _status(409, "AlreadyExists", f'secrets "{name}" already exists',
                                        {"name": name, "kind": "secrets"}), "application/json"
                stored = self._stored(obj)
                stored["data"] = {k: base64.b64encode(v.encode()).decode()
                                  for k, v in stored.pop("stringData", {}).items()}
                self.objects[("secrets", namespace, name)] = stored
                return 201, stored, "application/json"
            key = ("secrets", namespace, name)
            if key not in self.objects:
                return 404, _status(404, "NotFound", f'secrets "{name}" not found', {"name": name, "kind": "secrets"}), \
                    "application/json"
            if method == "GET":
                return 200, self.objects[key], "application/json"
            if method == "DELETE":
                del self.objects[key]
                return 200, _status(200, "", "deleted") | {"status": "Success"}, "application/json"
            if method == "PATCH":
                self.objects[key] = _merge(self.objects[key], json.loads(body or b"{}"))
                return 200, self.objects[key], "application/json"
        return 405, _status(405, "MethodNotAllowed", method), "application/json"

    def _guard(self, verb: str, resource: str) -> tuple[int, Any, str] | None:
        self.calls.append((verb, resource))
        if (verb, resource) in self.forbidden:
            return 403, _status(403, "Forbidden", f'{resource} is forbidden: User "system:serviceaccount:team-a:'
                                                  f'pipeline-runner" cannot {verb} resource "{resource}"'), \
                "application/json"
        return None

    def _create(self, plural: str, namespace: str, obj: dict, query: dict) -> tuple[int, Any, str]:
        kind = KINDS[plural]
        if obj.get("kind") != kind:
            return 400, _status(400, "BadRequest", f"expected kind {kind}, got {obj.get('kind')}"), "application/json"
        meta = obj.get("metadata") or {}
        if namespace and meta.get("namespace", namespace) != namespace:
            return 400, _status(400, "BadRequest", "the namespace of the provided object does not match the "
                                                   "namespace sent on the request"), "application/json"
        errors = schema.validate(obj)
        name = meta.get("name", "")
        if not errors and kind == "TrainJob":  # Trainer's validating webhook: the runtime must exist
            ref = obj["spec"]["runtimeRef"]
            ref_key = ("clustertrainingruntimes", "", ref["name"]) if ref.get("kind") == "ClusterTrainingRuntime" \
                else ("trainingruntimes", namespace, ref["name"])
            if ref_key not in self.objects:
                errors = [f"spec.runtimeRef: Invalid value: {ref}: specified trainingRuntime must be created before "
                          "the TrainJob is created"]
        if errors:
            status = _status(422, "Invalid", f'{kind}.trainer.kubeflow.org "{name}" is invalid: ' + "; ".join(errors),
                             {"name": name, "group": "trainer.kubeflow.org", "kind": kind,
                              "causes": [{"message": e} for e in errors]})
            self.rejected.append(status)
            return 422, status, "application/json"
        key = (plural, namespace, name)
        if key in self.objects:
            return 409, _status(409, "AlreadyExists", f'{plural}.trainer.kubeflow.org "{name}" already exists',
                                {"name": name, "group": "trainer.kubeflow.org", "kind": plural}), "application/json"
        stored = self._stored(obj)
        if kind == "TrainJob":
            stored["status"] = {"conditions": []}
            if self.kueue and manifests.names.KUEUE_QUEUE_LABEL in (meta.get("labels") or {}):
                stored["spec"]["suspend"] = True  # Kueue's webhook suspends it until admission
                stored["status"]["conditions"].append({"type": "Suspended", "status": "True", "reason": "Suspended",
                                                       "message": "TrainJob is suspended",
                                                       "lastTransitionTime": _now()})
        self.objects[key] = stored
        return 201, stored, "application/json"

    def _list_pods(self, namespace: str, selector: str) -> tuple[int, Any, str]:
        wanted = dict(item.split("=", 1) for item in selector.split(",") if item)
        with self.lock:
            items = [self._pod_json(ns, name, entry) for (ns, name), entry in self.pods.items()
                     if ns == namespace and all(entry["labels"].get(k) == v for k, v in wanted.items())]
        return 200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": items}, "application/json"

    def _read_log(self, namespace: str, pod: str, query: dict) -> tuple[int, Any, str]:
        with self.lock:
            entry = self.pods.get((namespace, pod))
            if entry is None:
                return 404, _status(404, "NotFound", f'pods "{pod}" not found', {"name": pod, "kind": "pods"}), \
                    "application/json"
            if query.get("container", entry["container"]) != entry["container"]:
                return 400, _status(400, "BadRequest", "container not valid for pod"), "application/json"
            if entry["waiting"]:
                return 400, _status(400, "BadRequest", f'container "{entry["container"]}" in pod "{pod}" is waiting '
                                                       f"to start: {entry['waiting'][0]}"), "application/json"
            lines = list(entry["logs"])
        if "sinceSeconds" in query:
            cutoff = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=int(query["sinceSeconds"]))
            lines = [x for x in lines if x[0] >= cutoff]
        if "tailLines" in query:
            lines = lines[-int(query["tailLines"]):] if int(query["tailLines"]) else []
        stamps = query.get("timestamps", "").lower() == "true"  # the python client sends "True"
        text = "".join((f"{s.strftime('%Y-%m-%dT%H:%M:%S.%fZ')} " if stamps else "") + line + "\n"
                       for s, line in lines)
        return 200, text, "text/plain"

    def _answer(self, request: Request):
        if self.stopped:  # a stopped server drops the kept-alive connection without an answer
            return None
        try:
            return self.handle(request.method, request.path, request.body)
        except Exception as err:  # a bug in the fake must be visible, not a hang
            return 500, _status(500, "InternalError", repr(err)), "application/json"


@pytest.fixture
def kube():
    server = FakeKubeAPI()
    yield server
    server.stop()


def api_for(server: FakeKubeAPI, namespace: str = "team-a"):
    from sao_core.cluster.api import KubeAPI

    api = KubeAPI.connect(api_server=server.url, timeout_s=5)
    api.default_namespace = namespace
    return api


# ---------------------------------------------------------------------------------------- the fake's own tests
def _runtime(name: str = "sao-rl") -> dict:
    spec = manifests.RuntimeSpec(image="reg/learner:1", rollout_image="reg/rollout:1")
    return manifests.runtime_manifest(spec, name=name)


def _trainjob(name: str = "sao-sao-run1", runtime: str = "sao-rl") -> dict:
    parts = manifests.TrainJobParts(
        name=name, namespace="team-a", runtime_name=runtime, runtime_kind="ClusterTrainingRuntime",
        image="reg/learner:1", learner_args=["--method", "sao"], num_nodes=1, gpus_per_node=1,
        accelerator="nvidia.com/gpu", node_cpu="", node_memory="", model="embedded:tiny", engine="vllm",
        run_engine_options={}, s3_secret_name="sao-s3")
    return manifests.trainjob_manifest(parts)


def test_fake_api_refuses_bodies_that_fail_the_crd_schema(kube):
    from sao_core.cluster.api import ClusterError

    api = api_for(kube)
    assert api.create(_runtime())["metadata"]["uid"]
    bad = _trainjob()
    bad["spec"]["trainer"]["numProcPerNode"] = "eight"         # integer field
    bad["spec"]["trainer"]["resourcesPerNode"] = {"limits": {"nvidia.com/gpu": "1"}, "bogus": True}  # unknown field
    with pytest.raises(ClusterError) as err:
        api.create(bad)
    assert err.value.status == 422 and err.value.reason == "Invalid"
    assert "numProcPerNode" in str(err.value) and "bogus" in str(err.value)
    assert kube.get("trainjobs", bad["metadata"]["name"], "team-a") is None
    named = _trainjob(name="Sao_Bad")                            # CEL rule on metadata.name
    with pytest.raises(ClusterError, match="RFC 1035"):
        api.create(named)
    good = _trainjob()
    assert api.create(good)["metadata"]["name"] == "sao-sao-run1"
    with pytest.raises(ClusterError) as err:
        api.create(good)
    assert err.value.status == 409


def test_fake_api_refuses_a_trainjob_whose_runtime_is_missing_and_answers_404(kube):
    from sao_core.cluster.api import ClusterError

    api = api_for(kube)
    with pytest.raises(ClusterError, match="must be created before the TrainJob"):
        api.create(_trainjob(runtime="not-installed"))
    assert api.get("TrainJob", "nope", "team-a") is None
    assert api.delete("TrainJob", "nope", "team-a") is False
    assert api.local_queue_exists("q", "team-a") is False
    kube.local_queues.add(("team-a", "q"))
    assert api.local_queue_exists("q", "team-a") is True


def test_unreachable_api_server_gives_one_clear_error():
    from sao_core.cluster.api import ClusterUnreachable, KubeAPI

    server = FakeKubeAPI()
    url = server.url
    server.stop()
    api = KubeAPI.connect(api_server=url, timeout_s=2)
    started = time.monotonic()
    with pytest.raises(ClusterUnreachable, match=f"cannot reach the Kubernetes API server at {url}"):
        api.get("TrainJob", "x", "team-a")
    assert time.monotonic() - started < 10


def test_forbidden_calls_name_the_rbac_fix(kube):
    from sao_core.cluster.api import ClusterError

    kube.forbidden.add(("create", "clustertrainingruntimes"))
    with pytest.raises(ClusterError, match="deploy/rbac.yaml") as err:
        api_for(kube).create(_runtime())
    assert err.value.status == 403
