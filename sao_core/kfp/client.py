"""Talk to a Kubeflow Pipelines API server (v2beta1) through ``kfp.Client``: upload a pipeline or a new
version of it, start a run in an experiment, create / list / disable / enable recurring runs.

Everything that can be checked locally is checked before the first request: the host URL, the run
arguments against the pipeline's parameters (names, required ones, types, dropdown literals), the
cron schedule (six fields, seconds first: :mod:`sao_core.kfp.cron`) and the concurrency. The server
is probed with a short ``GET /apis/v2beta1/healthz`` first, so an unreachable or wrong host fails in
seconds with one clear line instead of the SDK's retries and tracebacks.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import ssl
import sys
import urllib.error
import urllib.request
import warnings
from pathlib import Path
from typing import Any

from sao_core.kfp.cron import CronError, validate_cron
from sao_core.kfp.sdk_speed import libyaml
from sao_core.kfp.spec import SpecError, root_parameters

HEALTHZ = "/apis/v2beta1/healthz"
MAX_CONCURRENCY = 10  # the API's allowed range is [1, 10]
_PY = {"STRING": (str,), "NUMBER_INTEGER": (int,), "NUMBER_DOUBLE": (int, float), "BOOLEAN": (bool,),
       "LIST": (list,), "STRUCT": (dict,)}


class KFPError(RuntimeError):
    """A KFP request cannot be made or failed; one line saying what and why."""


# ------------------------------------------------------------------------------------------ connect
def check_host(host: str) -> str:
    """The API base URL without a trailing slash; KFPError unless it is an http(s):// URL."""
    if not isinstance(host, str) or not host.strip().startswith(("http://", "https://")):
        raise KFPError(f"KFP host must be an http:// or https:// URL (e.g. http://localhost:8080), got {host!r}")
    return host.strip().rstrip("/")


def probe(host: str, token: str | None = None, timeout_s: float = 10.0, verify_ssl: bool = True) -> dict[str, Any]:
    """``GET HOST/apis/v2beta1/healthz`` once; the parsed answer, or KFPError saying why it failed."""
    url = check_host(host) + HEALTHZ
    request = urllib.request.Request(url, headers={"Accept": "application/json"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = None if verify_ssl else ssl._create_unverified_context()  # noqa: S323 (user asked for it)
    try:
        with urllib.request.urlopen(request, timeout=timeout_s, context=context) as response:
            body = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        hint = " (check the token / credentials)" if err.code in (401, 403) else ""
        raise KFPError(f"KFP API at {host} answered HTTP {err.code} to {HEALTHZ}{hint}") from None
    except (urllib.error.URLError, TimeoutError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise KFPError(f"cannot reach the KFP API at {host}: {reason} (is the host right and the API reachable, "
                       "e.g. `kubectl port-forward -n kubeflow svc/ml-pipeline-ui 8080:80`?)") from None
    try:
        answer = json.loads(body)
    except ValueError:
        raise KFPError(f"{url} did not answer JSON: is {host} a Kubeflow Pipelines API?") from None
    if not isinstance(answer, dict):
        raise KFPError(f"{url} answered {answer!r}: is {host} a Kubeflow Pipelines API?")
    return answer


def connect(host: str, namespace: str | None = None, token: str | None = None, timeout_s: float = 10.0,
            verify_ssl: bool = True):
    """A ``kfp.Client`` for `host` after a successful health probe (KFPError otherwise)."""
    import kfp

    host = check_host(host)
    probe(host, token, timeout_s, verify_ssl)
    kwargs: dict[str, Any] = {"host": host, "existing_token": token, "verify_ssl": verify_ssl}
    if namespace:
        kwargs["namespace"] = namespace
    try:
        with warnings.catch_warnings():  # "This client only works with Kubeflow Pipeline v2.0.0-beta.2 and later"
            warnings.simplefilter("ignore", FutureWarning)
            return kfp.Client(**kwargs)
    except Exception as err:  # the SDK raises many types (ApiException, TimeoutError, ValueError)
        raise KFPError(f"cannot create a KFP client for {host}: {type(err).__name__}: {err}") from err


def _call(what: str, fn, *args, **kwargs):
    """Run one SDK call; any failure becomes a one-line KFPError naming the request. The SDK prints
    "Run details: URL" lines; they go to stderr so a command's stdout stays machine-readable. The SDK re-reads a
    package it uploads or runs with PyYAML's pure-Python loader (~1 s for post_training): libyaml's instead."""
    try:
        with contextlib.redirect_stdout(sys.stderr), libyaml():
            return fn(*args, **kwargs)
    except KFPError:
        raise
    except Exception as err:
        status = getattr(err, "status", None)
        body = getattr(err, "body", None)
        detail = ""
        if body:
            try:
                detail = json.loads(body).get("message") or str(body)
            except (ValueError, AttributeError):
                detail = str(body)
        reason = f"HTTP {status}: {detail or getattr(err, 'reason', '')}" if status else f"{type(err).__name__}: {err}"
        raise KFPError(f"{what} failed: {' '.join(str(reason).split())[:500]}") from err


# --------------------------------------------------------------------------------------- arguments
def parameters_of(package_path: str | Path) -> dict[str, dict[str, Any]]:
    """Root parameters of a compiled package (see :func:`sao_core.kfp.spec.root_parameters`)."""
    try:
        return root_parameters(package_path)
    except SpecError as err:
        raise KFPError(str(err)) from err


def parameters_from_spec(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Root parameters of a pipeline spec as the API returns it (plain, or wrapped with a platform spec)."""
    import tempfile

    import yaml

    inner = spec.get("pipeline_spec", spec) if isinstance(spec, dict) else None
    if not isinstance(inner, dict) or "root" not in inner:
        raise KFPError("the server returned no pipeline spec for this version; pass the compiled package instead")
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as handle:
        yaml.dump(inner, handle, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper))   # libyaml: ~10x faster
    try:
        return parameters_of(handle.name)
    finally:
        Path(handle.name).unlink(missing_ok=True)


def check_arguments(parameters: dict[str, dict[str, Any]], arguments: dict[str, Any]) -> dict[str, Any]:
    """Check run arguments against the pipeline's parameters; return them unchanged or raise KFPError.

    Unknown names, missing required parameters, wrong types and values outside a dropdown's
    literals are refused, each with the parameter's name.
    """
    unknown = sorted(set(arguments) - set(parameters))
    if unknown:
        raise KFPError(f"unknown pipeline parameter(s) {', '.join(unknown)}; the pipeline takes: "
                       f"{', '.join(sorted(parameters))}")
    missing = sorted(n for n, p in parameters.items() if not p["has_default"] and not p["optional"]
                     and n not in arguments)
    if missing:
        raise KFPError(f"missing required pipeline parameter(s): {', '.join(missing)}")
    for name, value in arguments.items():
        spec = parameters[name]
        kind = spec["type"]
        allowed = _PY.get(kind)
        if allowed is not None and (not isinstance(value, allowed) or (kind != "BOOLEAN" and isinstance(value, bool))):
            raise KFPError(f"pipeline parameter {name!r} must be {kind.lower().replace('number_', '')}, got {value!r}")
        if spec["literals"] and value not in spec["literals"]:
            raise KFPError(f"pipeline parameter {name!r} must be one of {', '.join(map(str, spec['literals']))}; "
                           f"got {value!r}")
    return arguments


def parse_argument_strings(parameters: dict[str, dict[str, Any]], items: list[str]) -> dict[str, Any]:
    """``["name=value", ...]`` from the command line -> typed arguments (JSON for lists, mappings, numbers)."""
    arguments: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip()
        if not sep or not name:
            raise KFPError(f"argument {item!r} must look like name=value")
        if name not in parameters:
            raise KFPError(f"unknown pipeline parameter {name!r}; the pipeline takes: {', '.join(sorted(parameters))}")
        kind = parameters[name]["type"]
        if kind == "STRING":
            arguments[name] = text
            continue
        if kind == "BOOLEAN" and text.lower() in ("true", "false"):
            arguments[name] = text.lower() == "true"
            continue
        try:
            arguments[name] = json.loads(text)
        except ValueError:
            raise KFPError(f"pipeline parameter {name!r} ({kind.lower()}) needs a JSON value, got {text!r}") from None
        if kind == "NUMBER_DOUBLE" and isinstance(arguments[name], int) and not isinstance(arguments[name], bool):
            arguments[name] = float(arguments[name])
    return arguments


def _package(path: str | Path) -> str:
    package = Path(path)
    if not package.is_file():
        raise KFPError(f"pipeline package {package} does not exist (compile it with `sao kfp compile`)")
    return str(package)


# ----------------------------------------------------------------------------------------- uploads
def package_description(package_path: str | Path) -> str | None:
    """The pipeline description compiled into a package (``pipelineInfo.description``), None without one."""
    import yaml

    try:
        with libyaml():
            first = next(iter(yaml.safe_load_all(Path(package_path).read_text())), None) or {}
    except (OSError, yaml.YAMLError):
        return None
    return (first.get("pipelineInfo") or {}).get("description") or None


def upload(client, package_path: str | Path, name: str, version_name: str | None = None,
           description: str | None = None) -> dict[str, Any]:
    """Upload a compiled package as pipeline `name`, or as a new version when `name` exists.

    `description` None: the package's own (``pipelineInfo.description``, e.g. sao_rl's list of its fields and
    option keys), which the KFP UI shows on the pipeline's page. Returns ``{"pipeline_id", "version_id",
    "version_name", "new_pipeline"}``.
    """
    package = _package(package_path)
    if not name or not name.strip():
        raise KFPError("a pipeline name is required")
    if description is None:
        description = package_description(package)
    pipeline_id = _call(f"looking up pipeline {name!r}", client.get_pipeline_id, name)
    if pipeline_id is None:
        pipeline = _call(f"uploading pipeline {name!r}", client.upload_pipeline, package, pipeline_name=name,
                         description=description)
        versions = _call("listing the new pipeline's versions", client.list_pipeline_versions,
                         pipeline.pipeline_id, page_size=1, sort_by="created_at desc")
        first = (versions.pipeline_versions or [None])[0]
        return {"pipeline_id": pipeline.pipeline_id, "version_id": getattr(first, "pipeline_version_id", None),
                "version_name": getattr(first, "display_name", None) or name, "new_pipeline": True}
    version_name = version_name or f"{name}-{_dt.datetime.now(_dt.UTC).strftime('%Y%m%d-%H%M%S')}"
    version = _call(f"uploading version {version_name!r} of pipeline {name!r}", client.upload_pipeline_version,
                    package, pipeline_version_name=version_name, pipeline_id=pipeline_id, description=description)
    return {"pipeline_id": pipeline_id, "version_id": version.pipeline_version_id, "version_name": version_name,
            "new_pipeline": False}


def _experiment_id(client, experiment: str, namespace: str | None) -> str:
    if not experiment or not experiment.strip():
        raise KFPError("an experiment name is required")
    found = _call(f"creating / finding experiment {experiment!r}", client.create_experiment, experiment,
                  namespace=namespace)
    return found.experiment_id


def _source(client, package_path, pipeline_id, version_id) -> tuple[dict[str, Any], dict[str, Any]]:
    """(SDK keyword arguments naming the pipeline, its parameters) for a package or an uploaded version."""
    if package_path:
        if pipeline_id or version_id:
            raise KFPError("give either a pipeline package or an uploaded pipeline id + version id, not both")
        package = _package(package_path)
        return {"pipeline_package_path": package}, parameters_of(package)
    if not (pipeline_id and version_id):
        raise KFPError("give a pipeline package, or both the pipeline id and the version id of an uploaded pipeline")
    version = _call(f"reading pipeline version {version_id}", client.get_pipeline_version, pipeline_id, version_id)
    return {"pipeline_id": pipeline_id, "version_id": version_id}, parameters_from_spec(version.pipeline_spec)


# -------------------------------------------------------------------------------------------- runs
def run(client, experiment: str, run_name: str, arguments: dict[str, Any] | None = None,
        package_path: str | Path | None = None, pipeline_id: str | None = None, version_id: str | None = None,
        namespace: str | None = None, enable_caching: bool | None = None,
        service_account: str | None = None) -> dict[str, Any]:
    """Start a run of a package (or an uploaded version) in `experiment`; returns ``{"run_id", "experiment_id"}``."""
    if not run_name or not run_name.strip():
        raise KFPError("a run name is required")
    source, parameters = _source(client, package_path, pipeline_id, version_id)
    arguments = check_arguments(parameters, dict(arguments or {}))
    experiment_id = _experiment_id(client, experiment, namespace)
    created = _call(f"creating run {run_name!r}", client.run_pipeline, experiment_id, run_name, params=arguments,
                    enable_caching=enable_caching, service_account=service_account, **source)
    return {"run_id": created.run_id, "experiment_id": experiment_id}


def schedule(client, experiment: str, name: str, cron: str, arguments: dict[str, Any] | None = None,
             package_path: str | Path | None = None, pipeline_id: str | None = None, version_id: str | None = None,
             max_concurrency: int = 1, no_catchup: bool = True, start_time: _dt.datetime | None = None,
             end_time: _dt.datetime | None = None, enabled: bool = True, description: str | None = None,
             namespace: str | None = None, enable_caching: bool | None = None,
             service_account: str | None = None) -> dict[str, Any]:
    """Create a recurring run on a six-field cron schedule (seconds first; see :mod:`sao_core.kfp.cron`).

    No catch-up by default (a paused or late scheduler starts only the latest missed run) and at most
    `max_concurrency` runs at once (1-10). Returns ``{"recurring_run_id", "experiment_id", "cron"}``.
    """
    cron = check_schedule(cron, max_concurrency, start_time, end_time)
    if not name or not name.strip():
        raise KFPError("a recurring run name is required")
    source, parameters = _source(client, package_path, pipeline_id, version_id)
    arguments = check_arguments(parameters, dict(arguments or {}))
    experiment_id = _experiment_id(client, experiment, namespace)
    created = _call(f"creating recurring run {name!r}", client.create_recurring_run, experiment_id, name,
                    description=description, cron_expression=cron, max_concurrency=max_concurrency,
                    no_catchup=no_catchup, params=arguments, enabled=enabled,
                    start_time=_rfc3339(start_time), end_time=_rfc3339(end_time),
                    enable_caching=enable_caching, service_account=service_account, **source)
    return {"recurring_run_id": created.recurring_run_id, "experiment_id": experiment_id, "cron": cron}


def check_schedule(cron: str, max_concurrency: int = 1, start_time: _dt.datetime | None = None,
                   end_time: _dt.datetime | None = None) -> str:
    """Check a recurring run's schedule settings locally; return the normalised cron or raise KFPError."""
    try:
        cron = validate_cron(cron)
    except CronError as err:
        raise KFPError(str(err)) from None
    if isinstance(max_concurrency, bool) or not isinstance(max_concurrency, int) \
            or not 1 <= max_concurrency <= MAX_CONCURRENCY:
        raise KFPError(f"max_concurrency must be an integer from 1 to {MAX_CONCURRENCY}, got {max_concurrency!r}")
    _rfc3339(start_time)
    _rfc3339(end_time)
    if start_time and end_time and end_time <= start_time:
        raise KFPError(f"end_time {end_time.isoformat()} is not after start_time {start_time.isoformat()}")
    return cron


def _rfc3339(moment: _dt.datetime | None) -> str | None:
    if moment is None:
        return None
    if moment.tzinfo is None:
        raise KFPError(f"{moment.isoformat()} has no time zone; give an aware datetime (e.g. ...+00:00)")
    return moment.astimezone(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def list_recurring_runs(client, experiment: str | None = None, namespace: str | None = None,
                        page_size: int = 100) -> list[dict[str, Any]]:
    """Every recurring run (of `experiment` if given): ``{"id", "name", "cron", "status", "max_concurrency",
    "no_catchup", "experiment_id", "pipeline_id", "version_id"}``, following all pages."""
    experiment_id = None
    if experiment:
        found = _call(f"reading experiment {experiment!r}", client.get_experiment, experiment_name=experiment,
                      namespace=namespace)
        experiment_id = found.experiment_id
    rows: list[dict[str, Any]] = []
    token = ""
    while True:
        page = _call("listing recurring runs", client.list_recurring_runs, page_token=token, page_size=page_size,
                     experiment_id=experiment_id, namespace=namespace)
        for item in page.recurring_runs or []:
            trigger = getattr(item, "trigger", None)
            cron = getattr(getattr(trigger, "cron_schedule", None), "cron", None)
            reference = getattr(item, "pipeline_version_reference", None)
            rows.append({"id": item.recurring_run_id, "name": item.display_name, "cron": cron,
                         "status": item.status, "mode": item.mode, "max_concurrency": item.max_concurrency,
                         "no_catchup": item.no_catchup, "experiment_id": item.experiment_id,
                         "pipeline_id": getattr(reference, "pipeline_id", None),
                         "version_id": getattr(reference, "pipeline_version_id", None)})
        token = page.next_page_token or ""
        if not token:
            return rows


def set_recurring_run_enabled(client, recurring_run_id: str, enabled: bool) -> None:
    """Enable or disable a recurring run (a disabled one starts no new runs)."""
    if not recurring_run_id:
        raise KFPError("a recurring run id is required")
    if enabled:
        _call(f"enabling recurring run {recurring_run_id}", client.enable_recurring_run, recurring_run_id)
    else:
        _call(f"disabling recurring run {recurring_run_id}", client.disable_recurring_run, recurring_run_id)
