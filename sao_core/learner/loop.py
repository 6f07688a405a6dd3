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


def in_memory(config: RLConfig, server, learner: Learner) -> bool:
    """Whether the run hands its weights to `server` (the colocated service, None when there is none) in
    memory: `weight_transport` auto (or collective, which has no group to form with a service in this process),
    full weights (not a LoRA adapter) and an engine that can take them."""
    return (server is not None and config.weight_transport in ("auto", "collective") and not learner.publishes_adapter
            and server.takes_weights_in_memory())


def colocated_serve_config(config: RLConfig):
    """The ServeConfig of the rollout service a run starts in its own process (no `services` given):
    GPU split on one machine is `rollout_options={"gpu_memory_utilization": ...}` with the vllm engine.

    Context: a vllm engine gets `max_model_len = max_total_tokens` unless rollout_options set one (which must
    not be smaller). (`train_rl` checks the budget against the model's own context first.)"""
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
        options["max_model_len"] = config.max_total_tokens
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
        return _train(config, progress, ctx, scratch, started, latest, checkpoints_uri, token, eval_set)
    finally:  # every exit: a finished run, a failure while loading or resuming, an error in a step
        shutil.rmtree(scratch, ignore_errors=True)


def _train(config: RLConfig, progress: Callable[[int, dict], None] | None, ctx: DistContext, scratch: Path,
           started: float, latest: str | None, checkpoints_uri: str, token: str | None,
           eval_set: Any = None) -> dict[str, Any]:
    """The run itself, once the checks passed and `scratch` exists (`train_rl` removes it on every exit).
    `token`: the bearer token the services (or the colocated one) expect; `eval_set`: the held-out set of
    evaluation during training (`sao_core.learner.evaluation`), None when it is off."""
    learner = Learner.load(config, ctx, scratch)
    state = learner.state
    replayed = Replayed()
    if latest:
        state = learner.resume(latest)
    if config.resume:
        replayed = learner.replay_journal()
    drop_records = replayed.drop_records  # drop records written after the current step (their file index)

    consumer = "learner-" + run_key(config.output)
    server = None
    services: ServiceSet | None = None
    if ctx.is_main:
        urls = list(config.services)
        if not urls:
            from sao_core.rollout.server import RolloutServer

            server = RolloutServer(colocated_serve_config(config), token=token).start()
            urls = [server.url]
        admission = config.admission_policy(len(urls))
        plan = asdict(RolloutPlan(
            dataset=config.data, rollouts_per_prompt=config.rollouts_per_prompt, epochs=0, shuffle=True,
            seed=config.seed, env_options=config.env_options, max_new_tokens_per_turn=config.max_new_tokens_per_turn,
            max_total_tokens=config.max_total_tokens, training=True, max_in_flight=admission.max_in_flight,
            max_staleness=admission.max_staleness, admission=admission.rule, hard_staleness=admission.hard_staleness,
            batch_size=admission.batch_size))
        plans_sent = journal.count_plans(config.output)

        def plan_sent(index: int, num_shards: int, stream: dict) -> None:
            """Journal a plan a service accepted, with the ledger it came from (journal.audit checks them)."""
            nonlocal plans_sent
            journal.write_plan(config.output, plans_sent, state.step, index, num_shards, stream,
                               state.ledger.to_state())
            plans_sent += 1

        services = ServiceSet(urls, consumer, plan, config.service_retry_s,
                              plan_for=lambda index, n: state.ledger.plan_fields(index, n),
                              on_restart=lambda index: service_restarted(index, len(urls)), token=token,
                              on_plan=plan_sent, local={0: server} if in_memory(config, server, learner) else {},
                              channel=config.weight_transport == "collective" and server is None)

    def memory_dtypes() -> dict | None:
        """The engine dtypes of an in-memory transport (colocated service or collective channel), else None."""
        if services.local:
            return server.weight_dtypes()
        return services.channel_dtypes() if services.channel else None

    # Every rank must know: the weights are then gathered for the push instead of written to storage.
    dtypes = on_rank0(ctx, memory_dtypes)
    if dtypes is not None:
        learner.use_memory_transport(dtypes if ctx.is_main else {})

    def push(version: int, uri: str | None, digest: str, probe=None, update=None) -> None:
        services.push(version, uri, digest, probe, update)

    def checkpoint() -> str:
        return learner.checkpoint(pending.dropped_by_reason, pending.requeued)

    def dropped_by_reason() -> Counter:
        """Trajectories dropped over the whole run: before this process (checkpoint, replay) and by it."""
        return state.counters.dropped_by_reason + pending.dropped_by_reason

    evaluator = None
    if eval_set is not None and ctx.is_main:
        from sao_core.learner.evaluation import TrainingEvaluator

        evaluator = TrainingEvaluator(config, eval_set, learner.tokenizer, token)

    def evaluate_now() -> dict[str, Any]:
        """Held-out rewards at the current version from the live services (rank 0; their stream goes on)."""
        return evaluator.run(services.live_urls(), state.step, state.version)

    pending = Pending(config, state.ledger)
    metrics_path = scratch / "metrics.jsonl"  # s3:// outputs: MetricsLog copies it to <output>/metrics.jsonl
    if not storage.is_s3_uri(config.output):
        metrics_path = Path(config.output) / "metrics.jsonl"
    trained_trajectories = trained_tokens = 0      # by this process (its throughput)
    summary: dict[str, Any] | None = None
    waited = 0.0

    def record_drops(drops: list[Drop]) -> None:
        """Journal the drops, settle their positions, then acknowledge them (re-queued ones as such)."""
        nonlocal drop_records
        records = [d.record() for d in drops]
        journal.write_drops(config.output, state.step, drop_records, records)
        drop_records += 1
        state.settle_drops(records)
        gone: dict[int, list[str]] = {}
        again: dict[int, list[str]] = {}
        for d in drops:
            (again if d.requeue else gone).setdefault(d.service, []).append(d.trajectory.id)
        services.ack({}, gone, again)

    def service_restarted(index: int, num_shards: int) -> None:
        """Service `index` lost its plan: forget what it delivered untrained (its new plan rolls it out again),
        and settle its episodes that had fragments trained as FRAGMENT_LOST (journaled like any drop)."""
        nonlocal drop_records
        pending.forget_service(index)
        lost = state.ledger.partial(index, num_shards)
        if not lost:
            return
        records = [{"id": f"lost-{p}", "position": p, "sample_index": 0, "attempt": 0, "reason": FRAGMENT_LOST,
                    "requeue": False} for p in lost]
        journal.write_drops(config.output, state.step, drop_records, records)
        drop_records += 1
        state.settle_drops(records)
        pending.dropped_by_reason[FRAGMENT_LOST] += len(records)
        log.warning("rollout service %s restarted: %d episodes with trained fragments were lost; their positions "
                    "are settled as %s", services.clients[index].url if services else index, len(lost), FRAGMENT_LOST)

    def next_batch() -> list[tuple[Trajectory, int]]:
        nonlocal waited
        wait_began = time.monotonic()
        chosen = None
        order = pending.policy.order
        while chosen is None:
            drops = pending.drop_unusable(state.version)
            if drops:
                record_drops(drops)
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
        waited = time.monotonic() - wait_began
        if config.method == "grpo":
            services.pause()  # the synchronous baseline: generators wait while the learner works
        return chosen

    try:
        if state.version > 0:
            if services is not None:
                services.weights = None
            learner.publish(push)

        def connect() -> None:
            services.connect()
            # A crash between a journal write and its acknowledgement leaves those leases open on a service
            # that survived (and nothing to redeliver them to when no step is left); ids a service does not
            # hold, e.g. a new one's, are ignored by it.
            if replayed.trained_ids or replayed.dropped_ids:
                every = range(len(services.clients))
                services.ack({i: replayed.trained_ids for i in every}, {i: replayed.dropped_ids for i in every})

        on_rank0(ctx, connect)
        with MetricsLog(config.output, metrics_path, resume=config.resume, enabled=ctx.is_main,
                        sinks=run_sinks(config, config.method)) as metrics_log:
            # One line per step: the replayed steps the killed process had not logged yet, marked replayed.
            logged = metrics_log.steps() if ctx.is_main else set()
            for record in replayed.records:
                if record["step"] not in logged and (record["step"] % config.log_every == 0
                                                     or record["step"] == config.steps):
                    metrics_log.append(record)
            metrics_log.sync()
            if evaluator is not None and state.step == 0 and 0 not in logged:
                # The starting point of the held-out curves: a line of its own, before any training.
                metrics_log.append({"step": 0, "version": state.version, **evaluate_now(),
                                    "seconds": time.time() - started, "world_size": ctx.world_size})
                metrics_log.sync()
            while state.step < config.steps:
                chosen = on_rank0(ctx, next_batch)
                trajectories = [t for t, _ in chosen]
                step_began = time.monotonic()
                result = learner.step(trajectories)
                push_seconds = 0.0
                # Journaled before the push and the acknowledgement: a crash after this point replays the step.
                on_rank0(ctx, lambda trajectories=trajectories, step=state.step, version=result.trained_at_version:
                         journal.write_step(config.output, step, version, trajectories))
                drop_records = 0
                # Settled: a service that was unreachable when we acknowledged redelivers these; they are only acked.
                for t in trajectories:
                    if not t.is_fragment:
                        pending.bias.trained(t)
                if result.changed:
                    push_seconds = learner.publish(push)

                def ack(chosen=chosen) -> None:
                    # After the push: the slots these free admit episodes under the new weights (which the
                    # version_order guarantee counts on).
                    by_service: dict[int, list[str]] = {}
                    for t, index in chosen:
                        by_service.setdefault(index, []).append(t.id)
                    services.ack(by_service)

                on_rank0(ctx, ack)
                if ctx.is_main and config.method == "grpo":
                    services.resume()
                trained_trajectories += len(trajectories)
                trained_tokens += result.tokens
                elapsed = time.time() - started
                record = {"step": state.step, "version": state.version, **result.metrics,
                          **turn_health(trajectories, learner.end_of_turn_ids),
                          "staleness": {str(k): v for k, v in sorted(result.staleness.items())},
                          "dropped_total": sum(dropped_by_reason().values()),
                          "dropped_by_reason": dict(dropped_by_reason()),
                          "requeued_total": state.counters.requeued + pending.requeued,
                          "positions_owed": state.ledger.owed_count(),
                          "stream_low_water_mark": state.ledger.low_water_mark, **pending.bias.step_record(),
                          "learner_wait_s": waited,
                          "update_s": time.monotonic() - step_began, "weight_push_s": push_seconds,
                          **({"durable_wait_s": learner.durable_wait_s} if learner.memory_push else {}),
                          "trajectories_per_s": trained_trajectories / elapsed,
                          "tokens_per_s": trained_tokens / elapsed, "seconds": elapsed,
                          "world_size": ctx.world_size}
                if services is not None and services.delivery and push_seconds:   # the push's delivery check (rank 0)
                    record.update(delivery_logp_diff_mean=services.delivery["mean"],
                                  delivery_logp_diff_max=services.delivery["max"],
                                  delivery_check_s=learner.probe_s + services.delivery_seconds)
                evaluated = evaluator is not None and evaluator.due(state.step)
                if evaluated:   # after the push of the version, before the next step: the current weights
                    record.update(evaluate_now())
                if ctx.is_main and (state.step % config.log_every == 0 or state.step == config.steps or evaluated):
                    record["generator_idle_share"] = services.idle_share()
                    metrics_log.append(record)
                    metrics_log.sync()
                if ctx.is_main:   # every report_every steps (a failure only warns)
                    write_training_report(config.output, metrics=metrics_path, config=config, step=state.step,
                                          every=config.report_every)
                if config.checkpoint_every and state.step % config.checkpoint_every == 0 and \
                        state.step < config.steps:
                    checkpoint()
                if progress and ctx.is_main:
                    progress(state.step, record)
        last_checkpoint = checkpoint()
        model_uri, critic_uri = learner.save_final()
        learner.flush_durable()   # the last version's durable copy (written in the background) is complete
        if ctx.is_main:
            counters = state.counters
            summary = {
                "method": config.method, "steps": state.step, "version": state.version,
                "replayed_steps": replayed.steps,
                "trained_trajectories": counters.trained_trajectories, "trained_tokens": counters.trained_tokens,
                "dropped": sum(dropped_by_reason().values()), "dropped_by_reason": dict(dropped_by_reason()),
                "requeued": counters.requeued + pending.requeued,
                "admission": config.admission, "max_staleness": config.max_staleness,
                "length_bias": pending.bias.summary(),
                "stream": {"low_water_mark": state.ledger.low_water_mark, "frontier": state.ledger.frontier,
                           "owed": state.ledger.owed_count(), "outcomes": dict(state.ledger.outcomes)},
                "reward_first": sum(counters.first_rewards) / max(1, len(counters.first_rewards)),
                "reward_last": sum(counters.last_rewards) / max(1, len(counters.last_rewards)),
                "seconds": time.time() - started, "checkpoint": last_checkpoint, "model": model_uri,
                "critic": critic_uri, "resumed_from": latest, "world_size": ctx.world_size,
                "lora": learner.lora, "weights_published": "adapter" if learner.publishes_adapter else "full",
            }
            if evaluator is not None:   # from the metrics lines, so a resumed run's earlier evaluations count
                from sao_core.learner.evaluation import eval_summary

                summary.update(eval_summary(_read_rows(metrics_path)))
            if not storage.is_s3_uri(config.output):
                (Path(config.output) / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
            else:
                storage.write_text(storage.join(config.output, "summary.json"), json.dumps(summary, indent=2))
            write_training_report(config.output, metrics=metrics_path, config=config, summary=summary)
    finally:
        if learner.durable is not None and learner.durable._thread is not None:
            learner.durable._thread.join()   # a failing run still leaves no write running behind it
        if services is not None:
            services.stop(shutdown=config.shutdown_services)
        if server is not None:
            server.stop()
    return broadcast_object(summary, ctx)
