"""Validate manifests against the official Kubeflow Trainer CRDs (their ``openAPIV3Schema``), without a cluster.

The CRDs are vendored in ``deploy/crds/`` (kubeflow/trainer ``manifests/base/crds``, Apache-2.0). A CRD
schema is OpenAPI v3 with Kubernetes extensions; this module turns it into a JSON Schema that
``jsonschema`` checks, and checks the extensions itself, as the API server would on *create*:

- ``x-kubernetes-int-or-string``: the node accepts an integer or a string (``anyOf`` of both; a ``pattern``
  next to it applies to strings only, as in Kubernetes);
- ``nullable``: ``null`` is allowed as well;
- unknown fields: every object schema with ``properties`` and without ``x-kubernetes-preserve-unknown-fields``
  or ``additionalProperties`` gets ``additionalProperties: false``. The API server prunes unknown
  fields by default and rejects them with ``fieldValidation=Strict`` (what the launcher sends and what
  ``kubectl`` does by default), so here they are errors;
- ``x-kubernetes-list-type: map`` (items unique by ``x-kubernetes-list-map-keys``) and ``set`` (unique
  items) are checked;
- ``x-kubernetes-validations`` (CEL rules): transition rules (those using ``oldSelf``) do not apply on
  create and are skipped; every other rule met on a field present in the document must be one this
  module knows (:data:`KNOWN_RULES`, a Python translation of each rule) and is evaluated; a rule it does
  not know is reported as an error, so a new CRD version cannot pass unchecked;
- ``metadata`` (a bare ``object`` in CRD schemas): name, namespace, label and annotation syntax.

``format`` (int32, int64, date-time) and ``default`` are not checked or applied.
"""

from __future__ import annotations

import copy
import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from sao_core.cluster import names

#: Directory of the vendored CRDs in a source checkout.
CRD_DIR = Path(__file__).resolve().parents[2] / "deploy" / "crds"
CRD_FILES = {
    "TrainJob": "trainer.kubeflow.org_trainjobs.yaml",
    "TrainingRuntime": "trainer.kubeflow.org_trainingruntimes.yaml",
    "ClusterTrainingRuntime": "trainer.kubeflow.org_clustertrainingruntimes.yaml",
}


def _has(value: Any, key: str) -> bool:
    return isinstance(value, dict) and key in value


def _policies(mp: dict) -> int:
    return sum(1 for k in ("torch", "mpi", "jax", "xgboost", "flux") if k in mp)


#: CEL rule text -> Python predicate of ``self`` (the value at the rule's node).
KNOWN_RULES: dict[str, Callable[[Any], bool]] = {
    "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')":
        lambda s: bool(re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", s.get("metadata", {}).get("name", ""))),
    "size(self.metadata.name) <= 63": lambda s: len(s.get("metadata", {}).get("name", "")) <= 63,
    "self >= 1": lambda s: s >= 1,
    "self in ['trainer.kubeflow.org/trainjob-controller', 'kueue.x-k8s.io/multikueue']":
        lambda s: s in ("trainer.kubeflow.org/trainjob-controller", "kueue.x-k8s.io/multikueue"),
    "self == '' || self.matches('^[A-Za-z][A-Za-z0-9+.-]*://.+$')":
        lambda s: s == "" or bool(re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*://.+", s)),
    "[has(self.torch), has(self.mpi), has(self.jax), has(self.xgboost),has(self.flux)].filter(x, x).size() <= 1":
        lambda s: _policies(s) <= 1,
    "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && "
    "self.replicatedJobs.exists(x, has(x.dependsOn)))":
        lambda s: not (_has(s, "startupPolicy") and s["startupPolicy"].get("startupPolicyOrder") == "InOrder"
                       and any(_has(x, "dependsOn") for x in s.get("replicatedJobs", []))),
    "has(self.lastUpdatedTime)": lambda s: _has(s, "lastUpdatedTime"),
    "!self.exists(c, c == 'node')": lambda s: "node" not in s,
}


class SchemaUnavailable(RuntimeError):
    """jsonschema is not installed or the CRD files are missing."""


def _normalise(node: Any) -> Any:
    """OpenAPI v3 + Kubernetes extensions -> plain JSON Schema (see the module docstring)."""
    if isinstance(node, list):
        return [_normalise(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _normalise(v) for k, v in node.items()}
    if out.get("x-kubernetes-int-or-string") and "anyOf" not in out:
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        out.pop("type", None)
    if out.get("nullable") and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("type") == "object" and "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@functools.cache
def _load(kind: str, crd_dir: str) -> tuple[dict, Any]:
    try:
        import jsonschema
    except ImportError as err:  # dev extra
        raise SchemaUnavailable("manifest validation needs jsonschema: pip install 'sao-kfp[dev]'") from err
    path = Path(crd_dir) / CRD_FILES[kind]
    try:
        text = path.read_text()
    except OSError as err:
        raise SchemaUnavailable(f"CRD file {path} is missing ({err}); it ships in the source tree under "
                                "deploy/crds/") from err
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    docs = [d for d in yaml.load_all(text, Loader=loader) if d]
    crd = next(d for d in docs if d.get("kind") == "CustomResourceDefinition")
    version = next(v for v in crd["spec"]["versions"] if v.get("storage", v.get("served")))
    raw = version["schema"]["openAPIV3Schema"]
    validator_cls = jsonschema.validators.validator_for({"$schema": "http://json-schema.org/draft-07/schema#"})
    return raw, validator_cls(_normalise(copy.deepcopy(raw)))


def _path(parts: list) -> str:
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(root)"


def _walk(schema: dict, value: Any, path: list, errors: list[str]) -> None:
    """Kubernetes extensions jsonschema does not know: list types and CEL rules."""
    for rule in schema.get("x-kubernetes-validations", []) or []:
        text = rule.get("rule", "")
        if "oldSelf" in text:
            continue  # transition rule: only on update
        check = KNOWN_RULES.get(text)
        if check is None:
            errors.append(f"{_path(path)}: CEL rule not evaluated by this validator: {text}")
            continue
        try:
            ok = check(value)
        except (TypeError, AttributeError, KeyError):
            ok = False
        if not ok:
            errors.append(f"{_path(path)}: {rule.get('message') or 'failed rule'} (rule: {text})")
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, item in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                _walk(sub, item, path + [key], errors)
    elif isinstance(value, list):
        list_type = schema.get("x-kubernetes-list-type")
        if list_type == "map":
            keys = schema.get("x-kubernetes-list-map-keys") or []
            seen: set = set()
            for i, item in enumerate(value):
                ident = tuple(item.get(k) if isinstance(item, dict) else None for k in keys)
                if ident in seen:
                    errors.append(f"{_path(path + [i])}: Duplicate value: {dict(zip(keys, ident, strict=True))}")
                seen.add(ident)
        elif list_type == "set":
            seen_items: list = []
            for i, item in enumerate(value):
                if item in seen_items:
                    errors.append(f"{_path(path + [i])}: Duplicate value: {item!r}")
                seen_items.append(item)
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                _walk(items, item, path + [i], errors)


def _check_metadata(obj: dict, namespaced: bool, errors: list[str]) -> None:
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        errors.append("metadata: Required value")
        return
    name = meta.get("name")
    if not isinstance(name, str) or not names.is_dns1123_subdomain(name):
        errors.append(f"metadata.name: Invalid value {name!r}: must be a lowercase RFC 1123 subdomain")
    namespace = meta.get("namespace")
    if namespaced and namespace is not None and not names.is_dns1123_label(namespace):
        errors.append(f"metadata.namespace: Invalid value {namespace!r}")
    if not namespaced and namespace:
        errors.append(f"metadata.namespace: a cluster-scoped object has no namespace, got {namespace!r}")
    for key, value in (meta.get("labels") or {}).items():
        if not names.is_label_key(key):
            errors.append(f"metadata.labels: Invalid key {key!r}")
        if not isinstance(value, str) or not names.is_label_value(value):
            errors.append(f"metadata.labels.{key}: Invalid value {value!r}")
    for key, value in (meta.get("annotations") or {}).items():
        if not names.is_label_key(key) or not isinstance(value, str):
            errors.append(f"metadata.annotations: Invalid key or value {key!r}")
    unknown = sorted(set(meta) - {"name", "namespace", "labels", "annotations", "generateName", "ownerReferences",
                                  "finalizers", "uid", "resourceVersion", "creationTimestamp", "generation",
                                  "managedFields", "deletionTimestamp", "deletionGracePeriodSeconds"})
    if unknown:
        errors.append(f"metadata: unknown field(s) {', '.join(unknown)}")


def validate(obj: dict, crd_dir: str | Path | None = None) -> list[str]:
    """Every reason the API server would refuse to create `obj` (a TrainJob or a (Cluster)TrainingRuntime).

    Returns [] for a valid object. Raises SchemaUnavailable without jsonschema or the CRD files, and
    ValueError for an object of another apiVersion / kind.
    """
    kind = obj.get("kind") if isinstance(obj, dict) else None
    if kind not in CRD_FILES or obj.get("apiVersion") != "trainer.kubeflow.org/v1alpha1":
        raise ValueError(f"not a Kubeflow Trainer object (apiVersion trainer.kubeflow.org/v1alpha1, kind one of "
                         f"{', '.join(CRD_FILES)}): {obj.get('apiVersion') if isinstance(obj, dict) else obj!r} "
                         f"{kind!r}")
    raw, validator = _load(kind, str(crd_dir or CRD_DIR))
    errors = sorted(f"{_path(list(e.absolute_path))}: {e.message}" for e in validator.iter_errors(obj))
    _walk(raw, obj, [], errors)
    _check_metadata(obj, namespaced=kind != "ClusterTrainingRuntime", errors=errors)
    return errors
