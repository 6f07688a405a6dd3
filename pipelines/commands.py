"""What the ``sao kfp ...`` subcommands do, one function each (the CLI only parses arguments)."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sao_core import images
from sao_core.kfp import client as kfp_client
from sao_core.kfp.k8s import ClusterSettings

#: Compiled packages of this process, by (pipeline, settings, images): compiling is deterministic.
_COMPILED: dict[tuple[str, str, str], str] = {}


def compile_pipelines(names: list[str], output_dir: str | Path, settings: ClusterSettings | None = None) -> list[Path]:
    """Compile the named pipelines (post_training, sao_rl, evaluation) to ``OUTPUT_DIR/NAME.yaml``
    with their dropdown literals; every package is re-read and verified. Returns the paths."""
    import pipelines
    from sao_core.kfp.spec import compile_pipeline

    settings = settings or ClusterSettings()
    try:
        settings.validate()
    except ValueError as err:
        raise kfp_client.KFPError(f"bad cluster setting: {err}") from None
    unknown = [n for n in names if n not in pipelines.PIPELINES]
    if unknown:
        raise kfp_client.KFPError(f"unknown pipeline {unknown[0]!r}; choose from {', '.join(pipelines.PIPELINES)}")
    paths = []
    for name in names:
        path = Path(output_dir) / f"{name}.yaml"
        key = (name, json.dumps(dataclasses.asdict(settings), sort_keys=True), json.dumps(images.all_images()))
        if key in _COMPILED:  # same pipeline, settings and images in this process: the same package
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(_COMPILED[key])
        else:
            built = pipelines.build(name, settings)
            compile_pipeline(built.func, path, built.literals)
            _COMPILED[key] = path.read_text()
        paths.append(path)
    return paths


def _package_for(pipeline: str | None, package: str | None, settings: ClusterSettings | None,
                 scratch: Path) -> str | None:
    """A package path: the given file, or `pipeline` compiled into `scratch`."""
    if pipeline and package:
        raise kfp_client.KFPError("give --pipeline NAME or --package FILE, not both")
    if pipeline:
        return str(compile_pipelines([pipeline], scratch, settings)[0])
    return package


def token_from_env(variable: str | None) -> str | None:
    """The API token from environment variable `variable` (tokens never go on the command line)."""
    return os.environ.get(variable) if variable else None


def upload(host: str, name: str, pipeline: str | None = None, package: str | None = None,
           version_name: str | None = None, description: str | None = None, namespace: str | None = None,
           token: str | None = None, settings: ClusterSettings | None = None) -> dict[str, Any]:
    """Compile (if a pipeline name is given) and upload as a new pipeline or a new version."""
    with tempfile.TemporaryDirectory(prefix="sao-kfp-") as scratch:
        path = _package_for(pipeline, package, settings, Path(scratch))
        if not path:
            raise kfp_client.KFPError("give --pipeline NAME or --package FILE")
        api = kfp_client.connect(host, namespace=namespace, token=token)
        return kfp_client.upload(api, path, name, version_name=version_name, description=description)


@contextlib.contextmanager
def _checked_run(host: str, param_strings: list[str], pipeline: str | None, package: str | None,
                 pipeline_id: str | None, version_id: str | None, namespace: str | None, token: str | None,
                 settings: ClusterSettings | None) -> Iterator[tuple[str | None, dict[str, Any], Any]]:
    """(package path, arguments, client) for a run or a recurring run: the package compiled (or given) into a
    scratch folder that lives as long as the context, the arguments checked against it (against the uploaded
    version when there is no package) before the client connects."""
    with tempfile.TemporaryDirectory(prefix="sao-kfp-") as scratch:
        path = _package_for(pipeline, package, settings, Path(scratch))
        arguments = _arguments(path, param_strings)
        api = kfp_client.connect(host, namespace=namespace, token=token)
        if path is None and param_strings:
            arguments = _arguments_for_version(api, pipeline_id, version_id, param_strings)
        yield path, arguments, api


def run(host: str, experiment: str, run_name: str, param_strings: list[str], pipeline: str | None = None,
        package: str | None = None, pipeline_id: str | None = None, version_id: str | None = None,
        namespace: str | None = None, token: str | None = None, enable_caching: bool | None = None,
        settings: ClusterSettings | None = None) -> dict[str, Any]:
    """Start one run; arguments are checked against the pipeline before connecting."""
    with _checked_run(host, param_strings, pipeline, package, pipeline_id, version_id, namespace, token,
                      settings) as (path, arguments, api):
        return kfp_client.run(api, experiment, run_name, arguments, package_path=path, pipeline_id=pipeline_id,
                              version_id=version_id, namespace=namespace, enable_caching=enable_caching)


def schedule(host: str, experiment: str, name: str, cron: str, param_strings: list[str],
             pipeline: str | None = None, package: str | None = None, pipeline_id: str | None = None,
             version_id: str | None = None, max_concurrency: int = 1, catchup: bool = False,
             start_time: str | None = None, end_time: str | None = None, enabled: bool = True,
             namespace: str | None = None, token: str | None = None,
             settings: ClusterSettings | None = None) -> dict[str, Any]:
    """Create a recurring run; cron, concurrency, times and arguments are checked before connecting."""
    start, end = _when(start_time, "start time"), _when(end_time, "end time")
    kfp_client.check_schedule(cron, max_concurrency, start, end)
    with _checked_run(host, param_strings, pipeline, package, pipeline_id, version_id, namespace, token,
                      settings) as (path, arguments, api):
        return kfp_client.schedule(api, experiment, name, cron, arguments, package_path=path,
                                   pipeline_id=pipeline_id, version_id=version_id, max_concurrency=max_concurrency,
                                   no_catchup=not catchup, start_time=start, end_time=end, enabled=enabled,
                                   namespace=namespace)


def list_schedules(host: str, experiment: str | None = None, namespace: str | None = None,
                   token: str | None = None) -> list[dict[str, Any]]:
    """Every recurring run (of one experiment if given)."""
    api = kfp_client.connect(host, namespace=namespace, token=token)
    return kfp_client.list_recurring_runs(api, experiment, namespace=namespace)


def set_schedule_enabled(host: str, recurring_run_id: str, enabled: bool, namespace: str | None = None,
                         token: str | None = None) -> None:
    """Enable or disable one recurring run."""
    api = kfp_client.connect(host, namespace=namespace, token=token)
    kfp_client.set_recurring_run_enabled(api, recurring_run_id, enabled)


def _arguments(package: str | None, param_strings: list[str]) -> dict[str, Any]:
    if package is None:
        return {}
    parameters = kfp_client.parameters_of(package)
    return kfp_client.check_arguments(parameters, kfp_client.parse_argument_strings(parameters, param_strings))


def _arguments_for_version(api, pipeline_id, version_id, param_strings) -> dict[str, Any]:
    if not (pipeline_id and version_id):
        raise kfp_client.KFPError("give --pipeline NAME, --package FILE, or --pipeline-id and --version-id")
    version = kfp_client._call(f"reading pipeline version {version_id}", api.get_pipeline_version, pipeline_id,
                               version_id)
    parameters = kfp_client.parameters_from_spec(version.pipeline_spec)
    return kfp_client.parse_argument_strings(parameters, param_strings)


def _when(text: str | None, what: str) -> _dt.datetime | None:
    if not text:
        return None
    try:
        moment = _dt.datetime.fromisoformat(text)
    except ValueError:
        raise kfp_client.KFPError(f"{what} {text!r} is not an ISO 8601 time such as 2026-12-01T02:00:00+00:00") from None
    if moment.tzinfo is None:
        raise kfp_client.KFPError(f"{what} {text!r} has no time zone; add one, e.g. +00:00")
    return moment
