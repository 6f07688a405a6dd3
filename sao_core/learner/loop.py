"""The learner loop: take finished trajectories from rollout services, train, push weights.

Lossless protocol. A learner step (1) trains on a batch, (2) writes the batch to the journal
(``<output>/journal/step-NNNNNN.json``), (3) publishes and pushes the new weights, (4) acknowledges its
trajectories. Trajectories it drops are journaled too (``drop-NNNNNN-MMM.json``) before they are
acknowledged. A resumable checkpoint (models, optimisers, version, baseline state, the stream ledger) is
published every `checkpoint_every` steps. After a crash, `resume` loads the newest checkpoint and replays
the journal after it (the updates are deterministic, so the weights come back exactly). The stream ledger
(`ledger.py`) then knows every prompt-stream position that is trained or dropped; the others are owed: a
service whose plan survived hands back what was taken but not acknowledged on reconnect, and a plan that
is (re)started rolls out exactly the owed positions. No position is skipped and none is trained twice.

Integrity and bookkeeping on resume: each journal entry is checked against its sha256 before it is replayed
(a bad one stops the resume, naming the file and step: `journal`); a replayed step that has no metrics line
yet gets one, marked ``"replayed": true``; the summary's counters (trained, dropped, requeued, rewards) cover
the whole run: they are kept in every checkpoint and advanced by the replay. A trajectory without a sampled
token is dropped as ``no_action_tokens`` (`pending`) and never reaches the updater or the critic.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sao_core import storage
from sao_core.learner import journal
from sao_core.learner.config import RLConfig
from sao_core.learner.errors import LearnerError
from sao_core.learner.health import turn_health
from sao_core.learner.learner import Learner, on_rank0, prune_weight_versions, run_key, run_scratch
from sao_core.learner.ledger import FRAGMENT_LOST
from sao_core.learner.pending import FAILED_REASONS, Drop, Pending
from sao_core.learner.services import ServiceSet
from sao_core.learner.state import Replayed
from sao_core.reporting.training import write_training_report
from sao_core.rollout.auth import TokenError, new_token, resolve_token
from sao_core.rollout.manager import RolloutPlan
from sao_core.rollout.trajectory import Trajectory
from sao_core.training.distributed import DistContext, broadcast_object, init_distributed
from sao_core.training.live import run_sinks
from sao_core.training.metrics_log import MetricsLog

__all__ = ["FAILED_REASONS", "Learner", "LearnerError", "Pending", "ServiceSet", "prune_weight_versions", "train_rl"]

log = logging.getLogger(__name__)


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a metrics file (unreadable lines skipped)."""
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def in_memory(config: RLConfig, server) -> bool:
    """Whether the run hands its weights to `server` (the colocated service, None when there is none) in
    memory: `weight_transport` auto (or collective, which has no group to form with a service in this process)
    and an engine that can take them (the HF engine takes full weights and LoRA adapters alike; the learner
    sends what it publishes)."""
    return server is not None and config.weight_transport in ("auto", "collective") and server.takes_weights_in_memory()


#: tokens a colocated vLLM engine's context leaves for the delivery probe's chat prompt (before the scored
#: tokens): the built-in exchange through a chat template with a default system prompt is well under it
PROBE_CONTEXT = 256


def colocated_serve_config(config: RLConfig):
    """The ServeConfig of the rollout service a run starts in its own process (no `services` given):
    GPU split on one machine is `rollout_options={"gpu_memory_utilization": ...}` with the vllm engine.

    Context: a vllm engine gets `max_model_len = max(max_total_tokens, PROBE_CONTEXT + delivery_check_tokens)`
    unless rollout_options set one (which must not be smaller than max_total_tokens): the delivery probe is
    scored by the engine too, and its chat prompt plus scored tokens can be longer than a small episode budget.
    (`train_rl` checks the budget against the model's own context first.)"""
    from sao_core.config import ConfigError, build_config
    from sao_core.rollout.server import ServeConfig

    fixed = {"model": config.model, "engine": config.engine, "port": 0, "cache_dir": config.cache_dir,
             "max_batch": config.rollout_max_batch, "seed": config.seed, "unverified": config.unverified,
             "allowed_weight_roots": [storage.join(config.output, "weights")]}
    clash = sorted(set(fixed) & set(config.rollout_options))
    if clash:
        raise LearnerError(f"rollout_options cannot set {', '.join(clash)} (set by the run itself)")
    options = dict(config.rollout_options)
    if config.engine == "vllm" and not options.get("max_model_len") and \
            not (options.get("engine_options") or {}).get("max_model_len"):
        options["max_model_len"] = max(config.max_total_tokens, PROBE_CONTEXT + config.delivery_check_tokens)
    if config.engine == "vllm" and config.rollout_lora_rank():   # vLLM applies the pushed adapters per request
        options["engine_options"] = {"max_lora_rank": config.rollout_lora_rank(), **(options.get("engine_options") or {})}
    try:
        serve = build_config(ServeConfig, {**fixed, **options}, source="rollout_options")
        serve.validate()
    except (ConfigError, ValueError) as err:
        raise LearnerError(str(err)) from err
    engine_len = serve.engine_options.get("max_model_len") or serve.max_model_len
    if serve.engine == "vllm" and engine_len < config.max_total_tokens:
        raise LearnerError(f"max_total_tokens {config.max_total_tokens} exceeds the rollout engine's context of "
                           f"{engine_len} tokens (rollout_options max_model_len); raise max_model_len or lower "
                           "max_total_tokens")
    return serve


def train_rl(config: RLConfig, progress: Callable[[int, dict], None] | None = None) -> dict[str, Any]:
    """Run RL (SAO or a baseline) until `config.steps` learner steps; return the summary.

    Under torchrun every rank calls this: rank 0 talks to the rollout services, writes the journal,
    checkpoints and metrics, and shares each batch; all ranks train their share of it (FSDP2) and take
    part in gathering the weights for each push. Every rank returns rank 0's summary.
    """
    from sao_core.data.prepared import open_prepared
    from sao_core.data.schemas import DataError

    try:
        config.validate()
    except ValueError as err:
        raise LearnerError(str(err)) from err
    from sao_core.models import check_model_context

    try:  # the services would refuse such a plan too, but only after the model is loaded
        check_model_context(config.model, config.cache_dir, config.max_total_tokens)
    except ValueError as err:
        raise LearnerError(str(err)) from err
    if not config.services:
        colocated_serve_config(config)  # bad rollout options fail before any model is loaded
        token = new_token()             # the colocated service's own, for this run only
    else:
        try:
            token = resolve_token(token_file=config.service_token_file)
        except TokenError as err:
            raise LearnerError(str(err)) from None
    ctx = init_distributed()
    if config.batch_size < ctx.world_size:
        raise LearnerError(f"batch_size {config.batch_size} is smaller than the {ctx.world_size} ranks; every "
                           "rank needs at least one trajectory per step")
    try:
        prepared = open_prepared(config.data)
    except DataError as err:
        raise LearnerError(str(err)) from err
    kind, data_uri = prepared.kind, prepared.data_uri
    if kind is not None and kind != "rl":
        raise LearnerError(f"{data_uri} was prepared with --kind {kind}; train-rl needs --kind rl")
    eval_set = None
    if config.eval_every:
        from sao_core.learner.evaluation import load_eval_set

        try:   # a bad held-out set fails before any model is loaded
            eval_set = load_eval_set(config)
        except ValueError as err:
            raise LearnerError(str(err)) from err
    checkpoints_uri = storage.join(config.output, "checkpoints")
    latest = storage.latest_checkpoint(checkpoints_uri)
    if latest and not config.resume:
        raise LearnerError(f"{config.output} already holds checkpoints (newest {latest}); pass resume=true to "
                           "continue that run, or choose another output")
    torch.manual_seed(config.seed)
    started = time.time()
    scratch = run_scratch(config.output, ctx.rank)   # a killed process's folder of this run is swept first
    try:
        return RLRun(config, progress, ctx, scratch, started, latest, token, eval_set).run()
    finally:  # every exit: a finished run, a failure while loading or resuming, an error in a step
        shutil.rmtree(scratch, ignore_errors=True)


class RLRun:
    """One RL run once `train_rl`'s checks passed and `scratch` exists (`train_rl` removes it on every exit):
    the learner, the rollout services (rank 0), the trajectories waiting for a batch, the journal and the
    metrics. Each method is one named step of the run; `run()` reads as the algorithm.

    `token`: the bearer token the services (or the colocated one) expect; `eval_set`: the held-out set of
    evaluation during training (`sao_core.learner.evaluation`), None when it is off; `latest`: the checkpoint to
    resume from (None: a new run)."""

    def __init__(self, config: RLConfig, progress: Callable[[int, dict], None] | None, ctx: DistContext,
                 scratch: Path, started: float, latest: str | None, token: str | None, eval_set: Any = None):
        self.config, self.progress, self.ctx = config, progress, ctx
        self.started, self.latest, self.token, self.eval_set = started, latest, token, eval_set
        self.policy = config.admission_policy()      # the run's admission rule and staleness bound S
        self.learner = Learner.load(config, ctx, scratch)
        self.replayed = Replayed()
        self.server = None                           # the colocated rollout service (rank 0, no `services`)
        self.services: ServiceSet | None = None      # rank 0 only
        self.evaluator = None
        self.pending: Pending | None = None
        self.drop_records = 0                        # drop records written after the current step (file index)
        self.plans_sent = 0
        self.waited = 0.0                            # seconds the last batch was waited for
        self.trained_trajectories = self.trained_tokens = 0   # by this process (its throughput)
        # s3:// outputs: MetricsLog copies the scratch file to <output>/metrics.jsonl
        self.metrics_path = scratch / "metrics.jsonl"
        if not storage.is_s3_uri(config.output):
            self.metrics_path = Path(config.output) / "metrics.jsonl"

    @property
    def state(self):
        """The learner's run state (step, version, stream ledger, counters)."""
        return self.learner.state

    # ------------------------------------------------------------------------------------------ the algorithm
    def run(self) -> dict[str, Any]:
        """Resume, start the services, then train `config.steps` learner steps and finish; every rank returns
        rank 0's summary."""
        self.resume()
        if self.ctx.is_main:
            self.start_services()
        self.choose_weight_transport()
        self.open_evaluator()
        self.pending = Pending(self.config, self.state.ledger)
        summary = None
        try:
            self.publish_resumed_weights()
            on_rank0(self.ctx, self.connect)
            with MetricsLog(self.config.output, self.metrics_path, resume=self.config.resume,
                            enabled=self.ctx.is_main, sinks=run_sinks(self.config, self.config.method)) as metrics_log:
                self.log_start(metrics_log)
                while self.state.step < self.config.steps:
                    record = self.train_step()
                    self.log_step(metrics_log, record)
                    self.checkpoint_if_due()
                    if self.progress and self.ctx.is_main:
                        self.progress(self.state.step, record)
            summary = self.finish()
        finally:
            self.close()
        return broadcast_object(summary, self.ctx)

    def train_step(self) -> dict[str, Any]:
        """One learner step: a batch, the update, the journal entry, the new weights pushed, the batch
        acknowledged; returns the step's metrics line."""
        chosen = on_rank0(self.ctx, self.next_batch)
        trajectories = [t for t, _ in chosen]
        step_began = time.monotonic()
        result = self.learner.step(trajectories)
        self.journal_step(trajectories, result.trained_at_version)
        push_seconds = self.learner.publish(self.push) if result.changed else 0.0
        on_rank0(self.ctx, lambda: self.acknowledge(chosen))
        if self.ctx.is_main and self.config.method == "grpo":
            self.services.resume()
        self.trained_trajectories += len(trajectories)
        self.trained_tokens += result.tokens
        return self.step_record(trajectories, result, step_began, push_seconds)

    # ------------------------------------------------------------------------------------------ setting up
    def resume(self) -> None:
        """Load the newest checkpoint (if any) and, on resume, replay the journal written after it."""
        if self.latest:
            self.learner.resume(self.latest)
        if self.config.resume:
            self.replayed = self.learner.replay_journal()
        self.drop_records = self.replayed.drop_records

    def start_services(self) -> None:
        """Rank 0: start the colocated service when no `services` are given, and connect to the services with
        the run's plan (its admission policy whole)."""
        config = self.config
        urls = list(config.services)
        if not urls:
            from sao_core.rollout.server import RolloutServer

            self.server = RolloutServer(colocated_serve_config(config), token=self.token).start()
            urls = [self.server.url]
        plan = RolloutPlan(dataset=config.data, rollouts_per_prompt=config.rollouts_per_prompt, epochs=0,
                           shuffle=True, seed=config.seed, env_options=config.env_options,
                           max_new_tokens_per_turn=config.max_new_tokens_per_turn,
                           max_total_tokens=config.max_total_tokens, training=True)
        plan = plan.with_policy(config.admission_policy(len(urls)))
        self.plans_sent = journal.count_plans(config.output)
        consumer = "learner-" + run_key(config.output)
        self.services = ServiceSet(
            urls, consumer, asdict(plan), config.service_retry_s,
            plan_for=lambda index, n: self.state.ledger.plan_fields(index, n),
            on_restart=lambda index: self.service_restarted(index, len(urls)), token=self.token,
            on_plan=self.plan_sent, local={0: self.server} if in_memory(config, self.server) else {},
            channel=config.weight_transport == "collective" and self.server is None)

    def plan_sent(self, index: int, num_shards: int, stream: dict) -> None:
        """Journal a plan a service accepted, with the ledger it came from (journal.audit checks them)."""
        journal.write_plan(self.config.output, self.plans_sent, self.state.step, index, num_shards, stream,
                           self.state.ledger.to_state())
        self.plans_sent += 1

    def choose_weight_transport(self) -> None:
        """Every rank must know whether the weights are gathered for an in-memory push (colocated service or
        collective channel) instead of written to storage."""
        def memory_dtypes() -> dict | None:
            if self.services.local:
                return self.server.weight_dtypes()
            return self.services.channel_dtypes() if self.services.channel else None

        dtypes = on_rank0(self.ctx, memory_dtypes)
        if dtypes is not None:
            self.learner.use_memory_transport(dtypes if self.ctx.is_main else {})

    def open_evaluator(self) -> None:
        """Rank 0: the evaluator of held-out rewards during training (when `eval_every` asks for it)."""
        if self.eval_set is not None and self.ctx.is_main:
            from sao_core.learner.evaluation import TrainingEvaluator

            self.evaluator = TrainingEvaluator(self.config, self.eval_set, self.learner.tokenizer, self.token)

    def publish_resumed_weights(self) -> None:
        """A resumed run publishes its version again, so every service (re)loads the weights it trains on."""
        if self.state.version > 0:
            if self.services is not None:
                self.services.weights = None
            self.learner.publish(self.push)

    def connect(self) -> None:
        """Rank 0: connect to the services and acknowledge what the replayed journal trained or dropped."""
        services = self.services
        services.connect()
        # A crash between a journal write and its acknowledgement leaves those leases open on a service
        # that survived (and nothing to redeliver them to when no step is left); ids a service does not
        # hold, e.g. a new one's, are ignored by it.
        if self.replayed.trained_ids or self.replayed.dropped_ids:
            every = range(len(services.clients))
            services.ack({i: self.replayed.trained_ids for i in every},
                         {i: self.replayed.dropped_ids for i in every})

    # ------------------------------------------------------------------------------------------ batches and drops
    def next_batch(self) -> list[tuple[Trajectory, int]]:
        """Rank 0: the next batch of (trajectory, service index), in the order the admission policy asks for;
        drops what cannot be trained and takes more from the services until a batch is ready."""
        pending, services, config = self.pending, self.services, self.config
        wait_began = time.monotonic()
        chosen = None
        order = pending.policy.order
        while chosen is None:
            drops = pending.drop_unusable(self.state.version)
            if drops:
                self.record_drops(drops)
            if order == "arrival":
                chosen = pending.batch()
            elif order == "oldest_token":
                chosen = pending.batch(oldest_token=True)
            elif len(pending.items) >= config.batch_size:
                # Nothing admitted after an episode that is still running: the oldest versions train first,
                # so no episode waits long enough to go stale (README "Admission").
                answered, oldest = services.oldest_unfinished_version()
                if answered:
                    chosen = pending.batch(oldest_first=True, admitted_at_most=oldest)
            if chosen is None:
                trained_ids, late = pending.add(services.take(config.batch_size, config.take_wait_s))
                services.ack(trained_ids, late)
        self.waited = time.monotonic() - wait_began
        if config.method == "grpo":
            services.pause()  # the synchronous baseline: generators wait while the learner works
        return chosen

    def record_drops(self, drops: list[Drop]) -> None:
        """Journal the drops, settle their positions, then acknowledge them (re-queued ones as such)."""
        records = [d.record() for d in drops]
        self.journal_drops(records)
        gone: dict[int, list[str]] = {}
        again: dict[int, list[str]] = {}
        for d in drops:
            (again if d.requeue else gone).setdefault(d.service, []).append(d.trajectory.id)
        self.services.ack({}, gone, again)

    def journal_drops(self, records: list[dict[str, Any]]) -> None:
        """Write a drop record after the current step and settle its positions."""
        journal.write_drops(self.config.output, self.state.step, self.drop_records, records)
        self.drop_records += 1
        self.state.settle_drops(records)

    def service_restarted(self, index: int, num_shards: int) -> None:
        """Service `index` lost its plan: forget what it delivered untrained (its new plan rolls it out again),
        and settle its episodes that had fragments trained as FRAGMENT_LOST (journaled like any drop)."""
        self.pending.forget_service(index)
        lost = self.state.ledger.partial(index, num_shards)
        if not lost:
            return
        records = [{"id": f"lost-{p}", "position": p, "sample_index": 0, "attempt": 0, "reason": FRAGMENT_LOST,
                    "requeue": False} for p in lost]
        self.journal_drops(records)
        self.pending.dropped_by_reason[FRAGMENT_LOST] += len(records)
        log.warning("rollout service %s restarted: %d episodes with trained fragments were lost; their positions "
                    "are settled as %s", self.services.clients[index].url if self.services else index, len(lost),
                    FRAGMENT_LOST)

    def dropped_by_reason(self) -> Counter:
        """Trajectories dropped over the whole run: before this process (checkpoint, replay) and by it."""
        return self.state.counters.dropped_by_reason + self.pending.dropped_by_reason

    # ------------------------------------------------------------------------------------------ after the update
    def journal_step(self, trajectories: list[Trajectory], version_before: int) -> None:
        """Journal the trained batch (before the push and the acknowledgement: a crash after this point replays
        the step) and count its episodes for the length-bias metrics."""
        step = self.state.step
        on_rank0(self.ctx, lambda: journal.write_step(self.config.output, step, version_before, trajectories))
        self.drop_records = 0
        # Settled: a service that was unreachable when we acknowledged redelivers these; they are only acked.
        for t in trajectories:
            if not t.is_fragment:
                self.pending.bias.trained(t)

    def push(self, version: int, uri: str | None, digest: str, probe=None, update=None) -> None:
        """Hand a published version to the services (`learner.Push`)."""
        self.services.push(version, uri, digest, probe, update)

    def acknowledge(self, chosen: list[tuple[Trajectory, int]]) -> None:
        """Rank 0, after the push: the slots these free admit episodes under the new weights (which the
        version_order guarantee counts on)."""
        by_service: dict[int, list[str]] = {}
        for t, index in chosen:
            by_service.setdefault(index, []).append(t.id)
        self.services.ack(by_service)

    def checkpoint(self) -> str:
        return self.learner.checkpoint(self.pending.dropped_by_reason, self.pending.requeued)

    def checkpoint_if_due(self) -> None:
        """A resumable checkpoint every `checkpoint_every` steps (the last one is written by `finish`)."""
        step, every = self.state.step, self.config.checkpoint_every
        if every and step % every == 0 and step < self.config.steps:
            self.checkpoint()

    # ------------------------------------------------------------------------------------------ metrics
    def evaluate_now(self) -> dict[str, Any]:
        """Held-out rewards at the current version from the live services (rank 0; their stream goes on)."""
        return self.evaluator.run(self.services.live_urls(), self.state.step, self.state.version)

    def log_start(self, metrics_log: MetricsLog) -> None:
        """One line per step: the replayed steps the killed process had not logged yet (marked replayed), and
        the held-out starting point of a new run."""
        logged = metrics_log.steps() if self.ctx.is_main else set()
        for record in self.replayed.records:
            if record["step"] not in logged and (record["step"] % self.config.log_every == 0
                                                 or record["step"] == self.config.steps):
                metrics_log.append(record)
        metrics_log.sync()
        if self.evaluator is not None and self.state.step == 0 and 0 not in logged:
            # The starting point of the held-out curves: a line of its own, before any training.
            metrics_log.append({"step": 0, "version": self.state.version, **self.evaluate_now(),
                                "seconds": time.time() - self.started, "world_size": self.ctx.world_size})
            metrics_log.sync()

    def step_record(self, trajectories: list[Trajectory], result, step_began: float,
                    push_seconds: float) -> dict[str, Any]:
        """The metrics line of the step just trained (`result`: its `StepResult`)."""
        state, elapsed = self.state, time.time() - self.started
        dropped = self.dropped_by_reason()
        record = {"step": state.step, "version": state.version, **result.metrics,
                  **turn_health(trajectories, self.learner.end_of_turn_ids),
                  "staleness": {str(k): v for k, v in sorted(result.staleness.items())},
                  "dropped_total": sum(dropped.values()), "dropped_by_reason": dict(dropped),
                  "requeued_total": state.counters.requeued + self.pending.requeued,
                  "positions_owed": state.ledger.owed_count(),
                  "stream_low_water_mark": state.ledger.low_water_mark, **self.pending.bias.step_record(),
                  "learner_wait_s": self.waited,
                  "update_s": time.monotonic() - step_began, "weight_push_s": push_seconds,
                  **({"durable_wait_s": self.learner.durable_wait_s} if self.learner.memory_push else {}),
                  "trajectories_per_s": self.trained_trajectories / elapsed,
                  "tokens_per_s": self.trained_tokens / elapsed, "seconds": elapsed,
                  "world_size": self.ctx.world_size}
        services = self.services
        if services is not None and services.delivery and push_seconds:   # the push's delivery check (rank 0)
            record.update(delivery_logp_diff_mean=services.delivery["mean"],
                          delivery_logp_diff_max=services.delivery["max"],
                          delivery_check_s=self.learner.probe_s + services.delivery_seconds)
        return record

    def log_step(self, metrics_log: MetricsLog, record: dict[str, Any]) -> None:
        """Evaluate when due (after the push of the version: the current weights), write the metrics line every
        `log_every` steps and the report every `report_every` (rank 0)."""
        step, config = self.state.step, self.config
        evaluated = self.evaluator is not None and self.evaluator.due(step)
        if evaluated:
            record.update(self.evaluate_now())
        if not self.ctx.is_main:
            return
        if step % config.log_every == 0 or step == config.steps or evaluated:
            record["generator_idle_share"] = self.services.idle_share()
            metrics_log.append(record)
            metrics_log.sync()
        # every report_every steps (a failure only warns)
        write_training_report(config.output, metrics=self.metrics_path, config=config, step=step,
                              every=config.report_every)

    # ------------------------------------------------------------------------------------------ the end
    def finish(self) -> dict[str, Any] | None:
        """The last checkpoint, the trained model (and critic), then rank 0's summary (written beside them)."""
        last_checkpoint = self.checkpoint()
        model_uri, critic_uri = self.learner.save_final()
        self.learner.flush_durable()   # the last version's durable copy (written in the background) is complete
        if not self.ctx.is_main:
            return None
        summary = self.summary(last_checkpoint, model_uri, critic_uri)
        if self.evaluator is not None:   # from the metrics lines, so a resumed run's earlier evaluations count
            from sao_core.learner.evaluation import eval_summary

            summary.update(eval_summary(_read_rows(self.metrics_path)))
        output = self.config.output
        if not storage.is_s3_uri(output):
            (Path(output) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        else:
            storage.write_text(storage.join(output, "summary.json"), json.dumps(summary, indent=2))
        write_training_report(output, metrics=self.metrics_path, config=self.config, summary=summary)
        return summary

    def summary(self, last_checkpoint: str, model_uri: str, critic_uri: str | None) -> dict[str, Any]:
        """The run's summary: counters over the whole run (before this process too), the stream ledger, the
        outputs."""
        state, counters, learner = self.state, self.state.counters, self.learner
        dropped = self.dropped_by_reason()
        return {
            "method": self.config.method, "steps": state.step, "version": state.version,
            "replayed_steps": self.replayed.steps,
            "trained_trajectories": counters.trained_trajectories, "trained_tokens": counters.trained_tokens,
            "dropped": sum(dropped.values()), "dropped_by_reason": dict(dropped),
            "requeued": counters.requeued + self.pending.requeued,
            "admission": self.policy.rule, "max_staleness": self.policy.max_staleness,
            "length_bias": self.pending.bias.summary(),
            "stream": {"low_water_mark": state.ledger.low_water_mark, "frontier": state.ledger.frontier,
                       "owed": state.ledger.owed_count(), "outcomes": dict(state.ledger.outcomes)},
            "reward_first": sum(counters.first_rewards) / max(1, len(counters.first_rewards)),
            "reward_last": sum(counters.last_rewards) / max(1, len(counters.last_rewards)),
            "seconds": time.time() - self.started, "checkpoint": last_checkpoint, "model": model_uri,
            "critic": critic_uri, "resumed_from": self.latest, "world_size": self.ctx.world_size,
            "lora": learner.lora, "weights_published": "adapter" if learner.publishes_adapter else "full",
        }

    def close(self) -> None:
        """On every exit: no durable write left running, the services stopped (or shut down), the colocated
        one stopped."""
        durable = self.learner.durable
        if durable is not None and durable._thread is not None:
            durable._thread.join()   # a failing run still leaves no write running behind it
        if self.services is not None:
            self.services.stop(shutdown=self.config.shutdown_services)
        if self.server is not None:
            self.server.stop()
