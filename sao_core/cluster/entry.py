"""The two programs a sao-rl TrainJob runs in its pods (``sao cluster rollout`` and ``sao cluster learner``).

Both read their settings from the container environment the runtime and the TrainJob set (see
:mod:`sao_core.cluster.names`); the CLI passes ``os.environ`` in.

- :func:`serve_rollout`: one rollout replica: the rollout service on ``0.0.0.0:$SAO_ROLLOUT_PORT``
  with ``$SAO_MODEL`` on ``$SAO_ROLLOUT_ENGINE``, engine options = the runtime's shape
  (``$SAO_ROLLOUT_ENGINE_OPTIONS``: tensor / data parallel size and defaults) updated with the run's
  (``$SAO_ROLLOUT_RUN_OPTIONS``, which may not change the shape). It runs until ``POST /v1/shutdown``.
- :func:`run_learner`: one learner node: waits until every replica answers ``/healthz`` (at most
  ``$SAO_SERVICE_WAIT_S`` seconds; it goes on with the healthy ones after that, and fails when none
  is), runs ``python -m torch.distributed.run -m sao_core.cli train-rl ARGS --services URLS`` (torchrun
  takes nodes, processes per node, node rank and master address from the ``PET_*`` variables Kubeflow
  Trainer sets), forwards SIGTERM / SIGINT to it, and on node rank 0 shuts every replica down
  afterwards (``POST /v1/shutdown``) so the rollout Jobs end and the JobSet can finish. With
  ``$SAO_LEARNER_METRICS_PORT`` (the runtime's ``learner_metrics_port``) it passes ``--metrics-port``, so the
  learner's rank 0 serves Prometheus metrics on the container port the runtime exposes.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from typing import Any

from sao_core.cluster import manifests, names
from sao_core.cluster.names import ClusterConfigError
from sao_core.jsontext import json_object


class EntryError(RuntimeError):
    """An in-pod entry point cannot go on (no healthy replica, bad environment)."""


def _json_env(environ: Mapping[str, str], key: str) -> dict[str, Any]:
    raw = environ.get(key, "").strip()
    if not raw:
        return {}
    try:
        return json_object(raw, key)
    except ValueError as err:
        raise ClusterConfigError(f"{err}: {raw[:200]!r}") from None


#: engine option (vLLM EngineArgs name) -> ServeConfig field of the rollout service's vLLM scaling settings
SERVE_FIELDS = {"tensor_parallel_size": "tensor_parallel_size", "data_parallel_size": "data_parallel_size",
                "gpu_memory_utilization": "gpu_memory_utilization", "max_num_seqs": "max_num_seqs",
                "max_model_len": "max_model_len", "enable_prefix_caching": "prefix_caching"}


def rollout_serve_config(environ: Mapping[str, str], cache_dir: str):
    """The ServeConfig of a rollout replica from its environment (see the module docstring).

    The vLLM scaling options become ServeConfig's own fields (tensor / data parallel size, memory share,
    max sequences, context length, prefix caching); anything else stays in ``engine_options``.
    """
    import dataclasses

    from sao_core.config import ConfigError, build_config
    from sao_core.rollout.server import ServeConfig

    shape = _json_env(environ, names.ENV_ENGINE_OPTIONS)
    run = _json_env(environ, manifests.ENV_RUN_OPTIONS)
    owned = sorted(set(run) & set(manifests.SHAPE_ENGINE_KEYS))
    if owned:
        raise ClusterConfigError(f"{manifests.ENV_RUN_OPTIONS} may not set {', '.join(owned)}: the runtime's shape owns "
                                 "them (its GPUs per replica are sized for them)")
    options = {**shape, **run}
    known = {f.name for f in dataclasses.fields(ServeConfig)}
    values: dict[str, Any] = {field: options.pop(key) for key, field in SERVE_FIELDS.items()
                              if key in options and field in known}
    values.update(model=environ.get(names.ENV_MODEL, "").strip() or "embedded:tiny",
                  engine=environ.get(names.ENV_ENGINE, "vllm").strip() or "vllm", host="0.0.0.0",
                  port=environ.get(names.ENV_PORT, "8000") or "8000", engine_options=options, cache_dir=cache_dir)
    roots = [r.strip() for r in environ.get(manifests.ENV_WEIGHT_ROOTS, "").split(",") if r.strip()]
    if roots:
        values["allowed_weight_roots"] = roots
    try:
        return build_config(ServeConfig, values, source="rollout replica environment")
    except ConfigError as err:
        raise ClusterConfigError(str(err)) from None


def serve_rollout(environ: Mapping[str, str], cache_dir: str, say: Callable[[str], None] = print) -> None:
    """Run one rollout replica in the foreground until it is shut down."""
    from sao_core.rollout.server import serve

    config = rollout_serve_config(environ, cache_dir)
    say(f"rollout replica: engine {config.engine}, model {config.model}, port {config.port}, engine options "
        f"{json.dumps(config.engine_options, sort_keys=True)}")
    serve(config)


def _healthy(url: str, timeout_s: float = 5.0) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_healthy(urls: list[str], wait_s: float, say: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 5.0) -> list[str]:
    """Wait until every URL answers ``GET /healthz``; after `wait_s` seconds return the healthy ones.

    Raises EntryError when none answered in time.
    """
    deadline = clock() + wait_s
    healthy: list[str] = []
    last_report = -1.0
    while True:
        healthy = [u for u in urls if _healthy(u)]
        if len(healthy) == len(urls):
            say(f"all {len(urls)} rollout replica(s) are healthy")
            return healthy
        now = clock()
        if now >= deadline:
            break
        if last_report < 0 or now - last_report >= 30:
            missing = [u for u in urls if u not in healthy]
            say(f"waiting for rollout replicas: {len(healthy)}/{len(urls)} healthy; not yet: {', '.join(missing)}")
            last_report = now
        time.sleep(max(0.0, min(poll_s, deadline - now)))
    if not healthy:
        raise EntryError(f"no rollout replica answered /healthz within {wait_s:g} s ({', '.join(urls)}); check the "
                         "rollout pods: kubectl logs -l jobset.sigs.k8s.io/replicatedjob-name=rollout")
    missing = [u for u in urls if u not in healthy]
    say(f"warning: going on with {len(healthy)}/{len(urls)} healthy replica(s); not answering: {', '.join(missing)} "
        "(the learner takes them in when they come up)")
    return urls


def shutdown_replicas(urls: list[str], grace_s: float = 30.0, say: Callable[[str], None] = print,
                      token: str | None = None) -> int:
    """``POST /v1/shutdown`` (with the run's bearer `token`) to every replica; returns how many accepted.
    Unreachable ones are skipped."""
    accepted = 0
    body = json.dumps({"grace_s": grace_s}).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    for url in urls:
        request = urllib.request.Request(f"{url}/v1/shutdown", data=body, method="POST", headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                accepted += int(response.status == 200)
        except (urllib.error.URLError, OSError) as err:
            say(f"rollout replica {url} did not take the shutdown ({err}); it may be gone already")
    say(f"shut down {accepted}/{len(urls)} rollout replica(s)")
    return accepted


def learner_argv(train_args: list[str], urls: list[str], cache_dir: str) -> list[str]:
    """The torchrun command line of one learner node."""
    return [sys.executable, "-m", "torch.distributed.run", "-m", "sao_core.cli", "--cache-dir", cache_dir, "--quiet",
            "train-rl", *train_args, "--services", ",".join(urls)]


def _run_forwarding(argv: list[str]) -> int:
    """Run `argv`, passing SIGTERM / SIGINT on to it; its exit code."""
    child = subprocess.Popen(argv)

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def run_learner(train_args: list[str], environ: Mapping[str, str], cache_dir: str,
                run: Callable[[list[str]], int] = _run_forwarding, say: Callable[[str], None] = print,
                clock: Callable[[], float] = time.monotonic, poll_s: float = 5.0) -> int:
    """One learner node (see the module docstring); returns the training's exit code."""
    args = list(train_args)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        raise ClusterConfigError("sao cluster learner needs the sao train-rl arguments after '--' (the TrainJob's "
                                 "spec.trainer.args)")
    if any(a == "--services" or a.startswith("--services=") for a in args):
        raise ClusterConfigError("the learner's arguments may not contain --services: the rollout replicas of the "
                                 "TrainJob are the services")
    urls = names.rollout_urls_from_env(environ)
    try:
        wait_s = float(environ.get(names.ENV_SERVICE_WAIT, "1800") or 1800)
        rank = int(environ.get(names.ENV_NODE_RANK, "0") or 0)
        metrics_port = int(environ.get(names.ENV_LEARNER_METRICS_PORT, "0") or 0)
    except ValueError:
        raise ClusterConfigError(f"{names.ENV_SERVICE_WAIT}, {names.ENV_NODE_RANK} and "
                                 f"{names.ENV_LEARNER_METRICS_PORT} must be numbers") from None
    if metrics_port and not any(a == "--metrics-port" or a.startswith("--metrics-port=") for a in args):
        args += ["--metrics-port", str(metrics_port)]   # the runtime's container port (rank 0 serves it)
    wait_healthy(urls, wait_s, say=say, clock=clock, poll_s=poll_s)
    argv = learner_argv(args, urls, cache_dir)
    say(f"learner node {rank}: {' '.join(argv[1:])}")
    code = run(argv)
    say(f"learner node {rank}: training exited with code {code}")
    if rank == 0:
        from sao_core.rollout.auth import TokenError, resolve_token

        try:
            token = resolve_token(environ=environ)
        except TokenError as err:
            say(f"warning: {err}; shutting the replicas down without a token")
            token = None
        shutdown_replicas(urls, say=say, token=token)
    return code
