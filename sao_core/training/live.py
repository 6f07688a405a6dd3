"""Live views of a run's metrics: TensorBoard event files, MLflow, the learner's Prometheus endpoint.

Every metrics line a run writes (:meth:`MetricsLog.append <sao_core.training.metrics_log.MetricsLog.append>`)
also goes to the run's *sinks*; :meth:`MetricsLog.sync` syncs them too. The trainer (sft, cpt, dpo, gkd) and
the RL learner get them through :func:`run_sinks`, so both log the same way and at the same cadence (every
`log_every` steps and the last step, exactly the steps that have a line in ``metrics.jsonl``).

- :class:`TensorBoardSink`: event files (``torch.utils.tensorboard.SummaryWriter``) under
  ``<output>/tensorboard/``; for an ``s3://`` output they are written next to the local ``metrics.jsonl``
  copy and every changed event file is uploaded to ``<output>/tensorboard/`` at each sync, so a
  TensorBoard (or a Kubeflow ``Tensorboard`` resource) pointed at that prefix sees the run as it runs. A
  resumed run hides the events of the steps it trains again (``purge_step``).
- :class:`MLflowSink`: when ``$MLFLOW_TRACKING_URI`` is set: one MLflow run per output (params once,
  metrics per logged step, terminated FINISHED / FAILED); a resumed run logs into the run of the same output.
- :class:`PrometheusSink`: the learner's ``/metrics`` (its own registry) on ``metrics_port``, served under the
  rollout service's connection limits (header timeout, connection cap; :data:`METRICS_LIMITS
  <sao_core.http_limits.METRICS_LIMITS>`).

One function, :func:`scalars`, turns a metrics record into ``{tag: value}``; every sink logs those tags
(Prometheus picks a documented subset). A sink is an extra: one that cannot start or fails is logged as a
warning and dropped, and the run goes on (MetricsLog guards every call).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sao_core import storage

if TYPE_CHECKING:
    from sao_core.http_limits import HttpLimits, LimitedServer
    from sao_core.training.metrics_log import MetricsLog

log = logging.getLogger(__name__)

TENSORBOARD_DIR = "tensorboard"

#: record keys about time and throughput (tag group ``perf/``)
PERF_KEYS = frozenset({"seconds", "learner_wait_s", "learner_wait_share", "update_s", "weight_push_s",
                       "trajectories_per_s", "tokens_per_s", "generator_idle_share", "world_size"})
#: RL record keys about the stream of trajectories (tag group ``rl/``); the other RL keys (losses, learning
#: rates, gradient norms, entropy, log-prob gaps, critic) are ``train/``
RL_PREFIXES = ("reward", "policy_kept", "policy_masked", "policy_ratio", "version", "staleness", "dropped",
               "requeued", "positions_owed", "stream_", "arrived_", "trained_", "drop_rate_", "turn_cut",
               "end_of_turn", "tool_error", "token_lag", "tokens_beyond_bound", "fragment", "dis_kept_by_lag",
               "bootstrap_value")
_NOT_LOGGED = frozenset({"step", "replayed"})


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def tag_for(key: str, rl: bool) -> str:
    """The tag of a record key: ``eval/`` for ``eval_*``, ``perf/`` for times and throughput, ``rl/`` for the
    stream of an RL record (one with a policy ``version``), ``train/`` for the rest."""
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    if key in PERF_KEYS:
        return "perf/" + key
    if rl and key.startswith(RL_PREFIXES):
        return "rl/" + key
    return "train/" + key


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """``{tag: value}`` of one metrics line (without its ``step``), the one mapping every sink uses.

    Numbers become one tag each (:func:`tag_for`); a mapping of numbers one tag per entry
    (``rl/dropped_by_reason/stale``, ``rl/staleness/0``); other values (None, strings, booleans) are left out.
    Derived for RL lines: ``rl/staleness_mean`` and ``rl/staleness_max`` of the step's batch (from its
    ``staleness`` counts) and ``perf/learner_wait_share`` = learner_wait_s / (learner_wait_s + update_s),
    the share of the step the learner spent waiting for trajectories.
    """
    rl = "version" in record
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in _NOT_LOGGED:
            continue
        tag = tag_for(key, rl)
        if isinstance(value, dict):
            for sub, item in value.items():
                if _number(item):
                    out[f"{tag}/{sub}"] = float(item)
        elif _number(value):
            out[tag] = float(value)
    staleness = record.get("staleness")
    if rl and isinstance(staleness, dict) and staleness:
        counts = {int(k): float(v) for k, v in staleness.items()}
        total = sum(counts.values())
        if total:
            out["rl/staleness_mean"] = sum(k * n for k, n in counts.items()) / total
            out["rl/staleness_max"] = float(max(k for k, n in counts.items() if n))
    wait, update = record.get("learner_wait_s"), record.get("update_s")
    if rl and _number(wait) and _number(update) and wait + update > 0:
        out["perf/learner_wait_share"] = wait / (wait + update)
    return out


class Sink:
    """Where a run's metrics lines go besides ``metrics.jsonl``. MetricsLog calls `open` when its block is
    entered (rank 0 only), `write` for every line (with the line's step and :func:`scalars`), `sync` at
    every sync and `close` when the block is left (`failed`: an exception is leaving it). An exception from
    any of them makes MetricsLog warn, call `drop` and go on without the sink."""

    name = "sink"

    def open(self, metrics_log: MetricsLog) -> None:
        pass

    def write(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self, failed: bool) -> None:
        pass

    def drop(self) -> None:
        """Release what the sink holds after one of its calls failed (default: `close`, errors ignored)."""
        try:
            self.close(failed=True)
        except Exception:  # noqa: BLE001  (already being dropped with a warning)
            pass


class TensorBoardSink(Sink):
    """Scalars of every line in TensorBoard event files under ``<local run dir>/tensorboard``; for an s3://
    output each changed event file is uploaded to ``<output>/tensorboard/`` at every sync (a failed upload
    warns and is retried at the next sync)."""

    name = "TensorBoard"

    def __init__(self) -> None:
        self.writer = None
        self.local: Path | None = None
        self.remote: str | None = None
        self._sent: dict[Path, tuple[int, int]] = {}

    def open(self, metrics_log: MetricsLog) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:
            raise RuntimeError(f"TensorBoard event files need the tensorboard package (pip install "
                               f"'sao-kfp[train]'): {err}") from None
        self.local = metrics_log.path.parent / TENSORBOARD_DIR
        self.remote = storage.join(metrics_log.output_uri, TENSORBOARD_DIR) if metrics_log.remote else None
        logged = metrics_log.steps()
        if not metrics_log.resume:
            # A run started afresh replaces the event files of an earlier one, as it replaces metrics.jsonl.
            for old in self.local.glob("events.out.tfevents.*") if self.local.is_dir() else []:
                old.unlink()
            if self.remote is not None:
                storage.delete_dir(self.remote)
        # Resumed: the steps after the last kept line are trained and logged again; TensorBoard hides the
        # earlier process's events from that step on.
        purge = max(logged) + 1 if metrics_log.resume and logged else None
        self.writer = SummaryWriter(log_dir=str(self.local), purge_step=purge)

    def write(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)
        self.writer.flush()   # a local TensorBoard sees the step now

    def sync(self) -> None:
        if self.writer is not None:
            self.writer.flush()
        if self.remote is None or self.local is None or not self.local.is_dir():
            return
        for path in sorted(p for p in self.local.rglob("*") if p.is_file()):
            stat = path.stat()
            seen = (stat.st_size, stat.st_mtime_ns)
            if self._sent.get(path) == seen:
                continue
            uri = storage.join(self.remote, *path.relative_to(self.local).parts)
            try:
                storage.upload_file(path, uri)
            except storage.StorageError as err:
                log.warning("could not upload %s (the run goes on; the next sync tries again): %s", uri, err)
                return
            self._sent[path] = seen

    def close(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()
        self.sync()
        self.writer = None

    def drop(self) -> None:
        if self.writer is not None:
            try:
                self.writer.close()
            except Exception:  # noqa: BLE001
                pass
        self.writer = None


def run_name(output: str) -> str:
    """A run's name in MLflow: the last two parts of its output (``s3://b/runs/ab12/sao`` -> ``ab12/sao``)."""
    path = re.sub(r"^[A-Za-z][A-Za-z0-9+.-]*://", "", output).rstrip("/")
    parts = [p for p in path.split("/") if p]
    return "/".join(parts[-2:]) or output


def flat_params(config: Any) -> dict[str, str]:
    """A config dataclass as MLflow params: one string per field (mappings and lists as JSON), at most 500
    characters each."""
    values = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else dict(config)
    out = {}
    for key, value in sorted(values.items()):
        text = value if isinstance(value, str) else json.dumps(value, default=str, sort_keys=True)
        out[key] = text[:500]
    return out


def _mlflow_key(tag: str) -> str:
    """MLflow metric names take letters, digits, ``_ - . / `` and spaces: anything else becomes ``_``."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", tag)


_UNQUOTABLE = re.compile(r"""['"\\]""")


def _runs_of_output(client: Any, experiment_id: str, output: str) -> list:
    """The runs of the experiment tagged ``sao.output`` = `output`, newest first. MLflow's filter strings have
    no escapes (a quoted value is taken as is between its quotes, ``\\'`` included), so an output with a
    quote or a backslash is looked up with LIKE, those characters as ``_``, and compared exactly here."""
    order = ["attributes.start_time DESC"]
    if not _UNQUOTABLE.search(output):
        return client.search_runs([experiment_id], filter_string=f"tags.`sao.output` = '{output}'",
                                  order_by=order, max_results=1)
    pattern = _UNQUOTABLE.sub("_", output)
    runs = client.search_runs([experiment_id], filter_string=f"tags.`sao.output` LIKE '{pattern}'",
                              order_by=order, max_results=1000)
    return [run for run in runs if run.data.tags.get("sao.output") == output][:1]


class MLflowSink(Sink):
    """The run's metrics in MLflow at `tracking_uri` (experiment ``$MLFLOW_EXPERIMENT_NAME``, else ``sao``):
    one MLflow run per output, tagged ``sao.output`` (a resumed run logs into it again), params once,
    every line's tags as metrics at its step. An http(s) server that does not answer ``/health`` within
    5 s, or any failed call, makes MetricsLog warn once and go on without MLflow."""

    name = "MLflow"

    def __init__(self, tracking_uri: str, params: dict[str, str], method: str):
        self.tracking_uri = tracking_uri
        self.params = params
        self.method = method
        self.client = None
        self.run_id: str | None = None

    def open(self, metrics_log: MetricsLog) -> None:
        try:
            from mlflow.entities import Param
            from mlflow.tracking import MlflowClient
        except ImportError as err:
            raise RuntimeError(f"MLFLOW_TRACKING_URI is set but mlflow is not installed (pip install "
                               f"'sao-kfp[mlflow]'): {err}") from None
        if self.tracking_uri.startswith(("http://", "https://")):
            probe = self.tracking_uri.rstrip("/") + "/health"
            try:
                with urllib.request.urlopen(probe, timeout=5) as response:
                    response.read()
            except (urllib.error.URLError, OSError, ValueError) as err:
                raise RuntimeError(f"MLflow tracking server {self.tracking_uri} does not answer ({err})") from None
            # A live view must not hold training for minutes: fewer, shorter retries unless the user set them.
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
        output = metrics_log.output_uri
        client = MlflowClient(tracking_uri=self.tracking_uri)
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "sao"
        experiment = client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else client.create_experiment(name)
        existing = _runs_of_output(client, experiment_id, output) if metrics_log.resume else []
        if existing:
            self.run_id = existing[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=run_name(output),
                                    tags={"sao.output": output, "sao.method": self.method})
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in self.params.items()]
            for start in range(0, len(params), 100):   # MLflow takes at most 100 params per batch
                client.log_batch(self.run_id, params=params[start:start + 100])
        self.client = client
        log.info("MLflow: logging to run %s (%s) of experiment %r at %s", self.run_id, run_name(output), name,
                 self.tracking_uri)

    def write(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [Metric(_mlflow_key(tag), value, stamp, step) for tag, value in values.items()
                   if math.isfinite(value)]
        for start in range(0, len(metrics), 1000):     # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[start:start + 1000])

    def close(self, failed: bool) -> None:
        if self.client is not None and self.run_id is not None:
            self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
        self.client = None

    def drop(self) -> None:   # the server is what failed: do not call it again
        self.client = None


#: learner gauges (``sao_learner_<name>``) -> (the tag they show, help)
PROMETHEUS_GAUGES: dict[str, tuple[str, str]] = {
    "step": ("", "learner steps done"),
    "policy_version": ("rl/version", "policy version of the newest weights"),
    "reward_mean": ("rl/reward_mean", "mean reward of the step's batch"),
    "policy_kept": ("rl/policy_kept", "share of the batch's action tokens DIS (or the PPO clip) kept"),
    "staleness_mean": ("rl/staleness_mean", "mean staleness (versions) of the step's batch"),
    "staleness_max": ("rl/staleness_max", "largest staleness (versions) in the step's batch"),
    "dropped_trajectories": ("rl/dropped_total", "trajectories dropped over the run"),
    "requeued_trajectories": ("rl/requeued_total", "trajectories dropped and rolled out again over the run"),
    "learner_wait_share": ("perf/learner_wait_share", "share of the step spent waiting for trajectories"),
    "generator_idle_share": ("perf/generator_idle_share", "mean idle share of the rollout engines"),
    "learner_wait_seconds": ("perf/learner_wait_s", "seconds the step waited for its batch"),
    "update_seconds": ("perf/update_s", "seconds of the step's update, journal and weight push"),
    "weight_push_seconds": ("perf/weight_push_s", "seconds the step's weight push took"),
    "trajectories_per_second": ("perf/trajectories_per_s", "trajectories trained per second"),
    "tokens_per_second": ("perf/tokens_per_s", "action tokens trained per second"),
    "policy_loss": ("train/policy_loss", "policy loss of the step"),
    "critic_loss": ("train/critic_loss", "critic (value) loss of the step (sao)"),
    "entropy": ("train/entropy", "mean policy entropy on action tokens"),
    "turn_cut_share": ("rl/turn_cut_share", "share of the step's trajectories whose last turn was cut at a token cap"),
    "end_of_turn_logprob": ("rl/end_of_turn_logprob", "mean engine log-prob of the step's sampled end-of-turn tokens"),
    "token_lag_p99": ("rl/token_lag_p99", "99th percentile of the lag (versions) of the step's trained tokens"),
    "tokens_beyond_bound": ("rl/tokens_beyond_bound", "share of the step's trained tokens lagging more than max_staleness"),
}
#: labelled learner gauges -> (tag prefix, label, help)
PROMETHEUS_LABELLED: dict[str, tuple[str, str, str]] = {
    "dropped_by_reason": ("rl/dropped_by_reason/", "reason", "trajectories dropped over the run, by reason"),
    "batch_by_staleness": ("rl/staleness/", "staleness", "trajectories of the step's batch, by staleness"),
}


class PrometheusSink(Sink):
    """The learner's Prometheus endpoint: ``http://<host>:<port>/metrics`` (its own registry, text format)
    with the gauges of :data:`PROMETHEUS_GAUGES` and :data:`PROMETHEUS_LABELLED`, set from every metrics
    line (a gauge whose tag a line lacks keeps its value), and ``sao_learner_last_step_timestamp_seconds``.

    Served like the rollout service (`sao_core.http_limits.LimitedServer`), not by prometheus_client's
    own server: that one spent a thread on every connection and never timed a request head out, so anyone who
    reached the port could hold hundreds of threads with half-sent requests. Here a request head must arrive
    within `limits.header_timeout_s` seconds (else 408 and closed), idle connections close after
    `limits.keep_alive_s` seconds, above `limits.max_connections` open connections requests get 503, and the
    server is one thread however many connections are open."""

    name = "Prometheus"

    def __init__(self, port: int, host: str = "0.0.0.0", limits: HttpLimits | None = None):
        self.port, self.host = port, host
        self.limits = limits   # None: METRICS_LIMITS
        self.server: LimitedServer | None = None

    def open(self, metrics_log: MetricsLog) -> None:
        # Imported here: the HTTP stack (uvicorn, fastapi) is needed only by a run that serves metrics.
        from prometheus_client import CollectorRegistry, Gauge, make_asgi_app

        from sao_core.http_limits import METRICS_LIMITS, LimitedServer

        self.registry = CollectorRegistry()
        self.gauges = {name: Gauge(f"sao_learner_{name}", doc, registry=self.registry)
                       for name, (_, doc) in PROMETHEUS_GAUGES.items()}
        self.labelled = {name: Gauge(f"sao_learner_{name}", doc, [label], registry=self.registry)
                         for name, (_, label, doc) in PROMETHEUS_LABELLED.items()}
        self.stamp = Gauge("sao_learner_last_step_timestamp_seconds", "when the newest metrics line was written "
                           "(unix seconds)", registry=self.registry)
        self.server = LimitedServer(make_asgi_app(self.registry), self.host, self.port,
                                    self.limits or METRICS_LIMITS, name="learner-metrics").start()
        log.info("learner metrics: http://%s:%d/metrics", self.host, self.server.port)

    def write(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        self.gauges["step"].set(step)
        for name, (tag, _) in PROMETHEUS_GAUGES.items():
            if tag and tag in values:
                self.gauges[name].set(values[tag])
        for name, (prefix, label, _) in PROMETHEUS_LABELLED.items():
            found = {tag[len(prefix):]: v for tag, v in values.items() if tag.startswith(prefix)}
            if name == "batch_by_staleness":
                self.labelled[name].clear()   # this step's batch only
            for key, value in found.items():
                self.labelled[name].labels(**{label: key}).set(value)
        self.stamp.set_to_current_time()

    def close(self, failed: bool) -> None:
        if self.server is not None:
            self.server.stop()
        self.server = None


def run_sinks(config: Any, method: str) -> list[Sink]:
    """The sinks of a training run: TensorBoard always, MLflow when ``$MLFLOW_TRACKING_URI`` is set, the
    Prometheus endpoint when the config has a non-zero ``metrics_port`` (the RL learner)."""
    sinks: list[Sink] = [TensorBoardSink()]
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI", "").strip()
    if tracking_uri:
        sinks.append(MLflowSink(tracking_uri, {"method": method, **flat_params(config)}, method))
    port = int(getattr(config, "metrics_port", 0) or 0)
    if port:
        sinks.append(PrometheusSink(port))
    return sinks
