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

import hashlib
import json
import logging
import re
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from sao_core import storage
from sao_core.learner import journal
from sao_core.learner.batch import collate
from sao_core.learner.config import RLConfig
from sao_core.learner.errors import LearnerError
from sao_core.learner.health import turn_health
from sao_core.learner.lag import lag_record
from sao_core.learner.ledger import FRAGMENT_LOST, StreamLedger
from sao_core.learner.pending import FAILED_REASONS, Drop, Pending, position_of
from sao_core.learner.services import ServiceSet
from sao_core.learner.updates import Updater
from sao_core.reporting.training import write_training_report
from sao_core.rollout.auth import TokenError, new_token, resolve_token
from sao_core.rollout.manager import RolloutPlan
from sao_core.rollout.trajectory import Trajectory
from sao_core.training.checkpointing import (
    STATE_FILE,
    load_training_checkpoint,
    save_full_model,
    save_training_checkpoint,
    step_name,
)

__all__ = ["FAILED_REASONS", "LearnerError", "Pending", "ServiceSet", "train_rl"]
from sao_core.training.core import prepare_model
from sao_core.training.distributed import DistContext, all_reduce, broadcast_object, init_distributed
from sao_core.training.live import run_sinks
from sao_core.training.metrics_log import MetricsLog

log = logging.getLogger(__name__)


def _gather_batch(ctx: DistContext, fetch: Callable[[], list[Trajectory] | None]) -> list[Trajectory] | None:
    """Rank 0 runs `fetch` and shares its result with every rank. An error on rank 0 reaches the other
    ranks as a LearnerError instead of leaving them blocked in the broadcast."""
    if not ctx.distributed:
        return fetch()
    message: Any = None
    if ctx.is_main:
        try:
            message = ("ok", fetch())
        except BaseException as err:
            broadcast_object(("error", f"{type(err).__name__}: {err}"), ctx)
            raise
    kind, value = broadcast_object(message, ctx)
    if kind == "error":
        raise LearnerError(f"rank 0 stopped: {value}")
    return value


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


def _save_critic(critic, initial_dir: str, staging: Path, ctx: DistContext) -> bool:
    """Gather the critic (collective) and write it on rank 0; True on the rank that wrote."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sao_core.models.value import ValueModel

    full = get_model_state_dict(critic, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return False
    shutil.rmtree(staging, ignore_errors=True)
    plain = ValueModel.from_pretrained(initial_dir)
    plain.load_state_dict(full, strict=True)
    plain.save_pretrained(staging)
    return True


def prune_weight_versions(weights_uri: str, newest: int, keep: int) -> list[str]:
    """Delete the published weight versions (``vNNNNNN`` under `weights_uri`) older than the newest `keep`,
    i.e. every version <= newest - keep, so leftovers from before a resume go too; returns the deleted URIs.

    Call only once `newest` is loaded by every live service. Versions above `newest` are left alone (after a
    resume the replayed version is never behind a published one; one that was would be overwritten by a later
    publish). A failure is logged as a warning and never fails the run; the next call tries again.
    """
    try:
        names = storage.list_dirs(weights_uri)
    except storage.StorageError as err:
        log.warning("could not list the old weight versions under %s: %s", weights_uri, err)
        return []
    deleted = []
    for name in names:
        match = re.fullmatch(r"v(\d+)", name)
        if match is None or int(match.group(1)) > newest - keep:
            continue
        uri = storage.join(weights_uri, name)
        try:
            storage.delete_checkpoint(uri)
        except storage.StorageError as err:
            log.warning("could not delete old weight version %s: %s", uri, err)
            continue
        deleted.append(uri)
    return deleted


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
    scratch = Path(tempfile.mkdtemp(prefix="sao-learner-"))
    try:
        return _train(config, progress, ctx, scratch, started, latest, checkpoints_uri, token, eval_set)
    finally:  # every exit: a finished run, a failure while loading or resuming, an error in a step
        shutil.rmtree(scratch, ignore_errors=True)


def _counters_from(state: dict[str, Any]) -> dict[str, Any]:
    """The whole-run counters a checkpoint carries (zero for a checkpoint written before they were kept)."""
    counters = state.get("counters") or {}
    return {"trained_trajectories": int(counters.get("trained_trajectories", 0)),
            "trained_tokens": int(counters.get("trained_tokens", 0)),
            "dropped_by_reason": Counter({str(k): int(v) for k, v in counters.get("dropped_by_reason", {}).items()}),
            "requeued": int(counters.get("requeued", 0)),
            "first_rewards": [float(x) for x in counters.get("first_rewards", [])],
            "last_rewards": [float(x) for x in counters.get("last_rewards", [])]}


def _train(config: RLConfig, progress: Callable[[int, dict], None] | None, ctx: DistContext, scratch: Path,
           started: float, latest: str | None, checkpoints_uri: str, token: str | None,
           eval_set: Any = None) -> dict[str, Any]:
    """The run itself, once the checks passed and `scratch` exists (`train_rl` removes it on every exit).
    `token`: the bearer token the services (or the colocated one) expect; `eval_set`: the held-out set of
    evaluation during training (`sao_core.learner.evaluation`), None when it is off."""
    from sao_core.models import load_model_and_tokenizer, resolve_model
    from sao_core.models.value import ValueModel

    initial = resolve_model(config.model, config.cache_dir, config.unverified)   # verified once
    policy, tokenizer = load_model_and_tokenizer(initial, config.cache_dir)
    initial_dir = initial.path
    critic = None
    if config.method == "sao":
        critic = ValueModel.from_pretrained(initial_dir)
        if config.freeze_critic_attention:
            critic.freeze_attention()
    # The training core's set-up for both models: float32 master weights, activation checkpointing, FSDP2.
    policy = prepare_model(policy, ctx, config.gradient_checkpointing)
    if critic is not None:
        critic = prepare_model(critic, ctx, config.gradient_checkpointing)
    # The tokens that end a model turn (what the engines stop on): for the turn-end health metrics.
    end_of_turn_ids = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
    updater = Updater(config, policy, critic, ctx, end_of_turn_ids=end_of_turn_ids)
    step, version = 0, 0
    ledger = StreamLedger()  # which prompt-stream positions are trained, dropped or owed (rank 0 keeps it)
    # Whole-run counters (the summary's): kept in every checkpoint, advanced by the replayed journal on resume.
    run = _counters_from({})
    if latest:
        # Every rank reads its own verified copy (no shared filesystem needed); all agree before loading.
        local, error = None, ""
        try:
            local = storage.fetch_checkpoint(latest, Path(config.cache_dir) / "s3")
            learner_state = json.loads((local / STATE_FILE).read_text())
        except (storage.StorageError, OSError, ValueError) as err:
            error = f"cannot resume from {latest}: {err}"
        (failed,) = all_reduce([float(bool(error))], ctx)
        if failed:
            raise LearnerError(error or f"cannot resume from {latest}: another rank could not read it")
        if learner_state.get("method") != config.method:
            raise LearnerError(f"{latest} belongs to a {learner_state.get('method')!r} run, not {config.method!r}")
        learner_state = load_training_checkpoint(local, updater.checkpoint_parts(), ctx)
        updater.load_extra_state(learner_state["extra"])
        step, version = learner_state["step"], learner_state["version"]
        run = _counters_from(learner_state)
        if "counters" not in learner_state:   # a checkpoint from before the counters: every step is one batch
            run["trained_trajectories"] = step * config.batch_size
        try:
            ledger = (StreamLedger.from_state(learner_state["stream"]) if "stream" in learner_state
                      else StreamLedger.from_position(learner_state.get("data_position", 0)))
        except ValueError as err:
            raise LearnerError(f"{latest}: {err}") from err
        log.info("resumed from %s (step %d, version %d)", latest, step, version)

    def count_trained(trajectories: list[Trajectory], tokens: int) -> None:
        run["trained_trajectories"] += len(trajectories)
        run["trained_tokens"] += tokens
        rewards = [t.reward for t in trajectories if not t.is_fragment]   # episodes' rewards (by their last piece)
        if len(run["first_rewards"]) < 3 * config.batch_size:
            run["first_rewards"] += rewards
        run["last_rewards"] = (run["last_rewards"] + rewards)[-3 * config.batch_size:]

    drop_records = 0  # drop records written after the current step (their file index)
    replayed_ids: list[str] = []      # trained or dropped in the replayed journal: acknowledged again on connect
    replayed_dropped: list[str] = []

    def read_journal(read: Callable[[], Any]) -> Any:
        """A checked journal read on rank 0, shared with every rank; a bad entry stops the resume."""
        def checked() -> Any:
            try:
                return read() if ctx.is_main else None
            except journal.JournalError as err:
                raise LearnerError(f"cannot resume {config.output}: {err}") from err
        return _gather_batch(ctx, checked)

    def replay_drops(after_step: int) -> None:
        nonlocal drop_records
        records = read_journal(lambda: journal.read_drops(config.output, after_step, config.unverified))
        for record in (records or []) if ctx.is_main else []:
            settle_drops(record)
            replayed_dropped.extend(r["id"] for r in record if not r.get("requeue"))
            for r in record:
                if r.get("requeue"):
                    run["requeued"] += 1
                else:
                    run["dropped_by_reason"][r["reason"]] += 1
        drop_records = len(records or [])

    def settle_drops(records: list[dict]) -> None:
        """Settle the positions of journaled drops (a re-queued one stays owed), a group with its own reason."""
        by_position: dict[int, str] = {}
        for r in records:
            if not r.get("requeue") and by_position.get(r["position"], "group") == "group":
                by_position[r["position"]] = r["reason"]
        for position, reason in by_position.items():
            ledger.settle(position, reason)

    # Replay journal steps written after the checkpoint (deterministic, so the weights come back exactly).
    replayed = 0
    replayed_records: list[dict[str, Any]] = []   # their metrics lines (written if the killed run had not)
    if config.resume:
        replay_drops(step)
    while config.resume:
        entry = read_journal(lambda step=step: journal.read_step(config.output, step + 1, config.unverified))
        if entry is None:
            break
        try:
            replay = [Trajectory.from_dict(t) for t in entry["trajectories"]]
        except (KeyError, TypeError, ValueError) as err:
            raise LearnerError(f"cannot resume {config.output}: journal entry {journal.step_uri(config.output, step + 1)}"
                               f" (step {step + 1}) holds a malformed trajectory ({type(err).__name__}: {err})") from err
        replayed_ids.extend(t.id for t in replay)
        for t in replay:
            ledger.train_piece(position_of(t), t.fragment_index, not t.is_fragment)
        batch = collate(replay, tokenizer.pad_token_id)
        # Replayed as it was trained (a journal written before the learner dropped them may hold a trajectory
        # without action tokens).
        metrics, changed = updater.step(batch, step, allow_empty_rows=True, version=version)
        metrics.update(lag_record(replay, version, config.max_staleness))
        staleness = Counter(t.staleness(version) for t in replay)
        step += 1
        version += int(changed)
        replayed += 1
        count_trained(replay, int(batch.action_mask.sum()))
        replayed_records.append({"step": step, "version": version, **metrics, "replayed": True,
                                 "staleness": {str(k): v for k, v in sorted(staleness.items())},
                                 "world_size": ctx.world_size})
        replay_drops(step)
    if replayed:
        log.info("replayed %d journal steps; now at step %d, version %d", replayed, step, version)

    consumer = "learner-" + hashlib.sha256(config.output.encode()).hexdigest()[:12]
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
        services = ServiceSet(urls, consumer, plan, config.service_retry_s,
                              plan_for=lambda index, n: ledger.plan_fields(index, n),
                              on_restart=lambda index: service_restarted(index, len(urls)), token=token)

    def publish_weights() -> float:
        """Gather the policy (collective); rank 0 publishes version `version` and pushes it to every service."""
        began = time.monotonic()
        if not save_full_model(policy, tokenizer, scratch / "weights", ctx):
            return 0.0
        uri = storage.join(config.output, "weights", f"v{version:06d}")
        storage.publish_checkpoint(scratch / "weights", uri, metadata={"version": version, "step": step})
        services.push(version, uri, storage.checkpoint_digest(uri))
        seconds = time.monotonic() - began
        # push returned: every live service verified the checksum of `version` and loaded it (a synchronous
        # POST /v1/weights), and a service that is down is given the newest weights (services.weights)
        # when it rejoins, so no service will ever load an older version: they can go.
        prune_weight_versions(storage.join(config.output, "weights"), version, config.keep_weight_versions)
        return seconds

    def checkpoint() -> str:
        """Resumable learner state in the training core's format (collective)."""
        return save_training_checkpoint(
            scratch / "checkpoint", storage.join(checkpoints_uri, step_name(step)), updater.checkpoint_parts(),
            {"method": config.method, "step": step, "version": version,
             "data_position": ledger.low_water_mark, "stream": ledger.to_state(),
             "extra": updater.extra_state(), "counters": run_counters(),
             "config": json.loads(json.dumps(asdict(config), default=list))}, ctx)

    def dropped_by_reason() -> Counter:
        """Trajectories dropped over the whole run: before this process (checkpoint, replay) and by it."""
        return run["dropped_by_reason"] + pending.dropped_by_reason

    def run_counters() -> dict[str, Any]:
        return {"trained_trajectories": run["trained_trajectories"], "trained_tokens": run["trained_tokens"],
                "dropped_by_reason": dict(dropped_by_reason()), "requeued": run["requeued"] + pending.requeued,
                "first_rewards": run["first_rewards"], "last_rewards": run["last_rewards"]}

    evaluator = None
    if eval_set is not None and ctx.is_main:
        from sao_core.learner.evaluation import TrainingEvaluator

        evaluator = TrainingEvaluator(config, eval_set, tokenizer, token)

    def evaluate_now() -> dict[str, Any]:
        """Held-out rewards at version `version` from the live services (rank 0; their stream goes on)."""
        urls = [services.clients[i].url for i in services.live]
        if not urls:
            services._wait_for_any()
            urls = [services.clients[i].url for i in services.live]
        return evaluator.run(urls, step, version)

    pending = Pending(config, ledger)
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
        journal.write_drops(config.output, step, drop_records, records)
        drop_records += 1
        settle_drops(records)
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
        lost = ledger.partial(index, num_shards)
        if not lost:
            return
        records = [{"id": f"lost-{p}", "position": p, "sample_index": 0, "attempt": 0, "reason": FRAGMENT_LOST,
                    "requeue": False} for p in lost]
        journal.write_drops(config.output, step, drop_records, records)
        drop_records += 1
        settle_drops(records)
        pending.dropped_by_reason[FRAGMENT_LOST] += len(records)
        log.warning("rollout service %s restarted: %d episodes with trained fragments were lost; their positions "
                    "are settled as %s", services.clients[index].url if services else index, len(lost), FRAGMENT_LOST)

    def next_batch() -> list[tuple[Trajectory, int]]:
        nonlocal waited
        wait_began = time.monotonic()
        chosen = None
        order = pending.policy.order
        while chosen is None:
            drops = pending.drop_unusable(version)
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
        if version > 0:
            if services is not None:
                services.weights = None
            publish_weights()
        def connect() -> None:
            services.connect()
            # A crash between a journal write and its acknowledgement leaves those leases open on a service
            # that survived (and nothing to redeliver them to when no step is left); ids a service does not
            # hold, e.g. a new one's, are ignored by it.
            if replayed_ids or replayed_dropped:
                every = range(len(services.clients))
                services.ack({i: replayed_ids for i in every}, {i: replayed_dropped for i in every})

        _gather_batch(ctx, connect)
        with MetricsLog(config.output, metrics_path, resume=config.resume, enabled=ctx.is_main,
                        sinks=run_sinks(config, config.method)) as metrics_log:
            # One line per step: the replayed steps the killed process had not logged yet, marked replayed.
            logged = metrics_log.steps() if ctx.is_main else set()
            for record in replayed_records:
                if record["step"] not in logged and (record["step"] % config.log_every == 0
                                                     or record["step"] == config.steps):
                    metrics_log.append(record)
            metrics_log.sync()
            if evaluator is not None and step == 0 and 0 not in logged:
                # The starting point of the held-out curves: a line of its own, before any training.
                metrics_log.append({"step": 0, "version": version, **evaluate_now(),
                                    "seconds": time.time() - started, "world_size": ctx.world_size})
                metrics_log.sync()
            while step < config.steps:
                chosen = _gather_batch(ctx, next_batch)
                trajectories = [t for t, _ in chosen]
                staleness = Counter(t.staleness(version) for t in trajectories)
                step_began = time.monotonic()
                batch = collate(trajectories, tokenizer.pad_token_id)
                metrics, changed = updater.step(batch, step, version=version)
                lags = lag_record(trajectories, version, config.max_staleness)
                step += 1
                push_seconds = 0.0

                _gather_batch(ctx, lambda trajectories=trajectories, step=step, version=version:
                              journal.write_step(config.output, step, version, trajectories))
                drop_records = 0
                # Settled: a service that was unreachable when we acknowledged redelivers these; they are only acked.
                for t in trajectories:
                    ledger.train_piece(position_of(t), t.fragment_index, not t.is_fragment)
                    if not t.is_fragment:
                        pending.bias.trained(t)
                if changed:
                    version += 1
                    push_seconds = publish_weights()

                def ack(chosen=chosen) -> None:
                    # After the push: the slots these free admit episodes under the new weights (which the
                    # version_order guarantee counts on).
                    by_service: dict[int, list[str]] = {}
                    for t, index in chosen:
                        by_service.setdefault(index, []).append(t.id)
                    services.ack(by_service)

                _gather_batch(ctx, ack)
                if ctx.is_main and config.method == "grpo":
                    services.resume()
                trained_trajectories += len(trajectories)
                trained_tokens += int(batch.action_mask.sum())
                count_trained(trajectories, int(batch.action_mask.sum()))
                elapsed = time.time() - started
                record = {"step": step, "version": version, **metrics, **lags,
                          **turn_health(trajectories, end_of_turn_ids),
                          "staleness": {str(k): v for k, v in sorted(staleness.items())},
                          "dropped_total": sum(dropped_by_reason().values()),
                          "dropped_by_reason": dict(dropped_by_reason()),
                          "requeued_total": run["requeued"] + pending.requeued, "positions_owed": ledger.owed_count(),
                          "stream_low_water_mark": ledger.low_water_mark, **pending.bias.step_record(),
                          "learner_wait_s": waited,
                          "update_s": time.monotonic() - step_began, "weight_push_s": push_seconds,
                          "trajectories_per_s": trained_trajectories / elapsed,
                          "tokens_per_s": trained_tokens / elapsed, "seconds": elapsed,
                          "world_size": ctx.world_size}
                evaluated = evaluator is not None and evaluator.due(step)
                if evaluated:   # after the push of `version`, before the next step: the current weights
                    record.update(evaluate_now())
                if ctx.is_main and (step % config.log_every == 0 or step == config.steps or evaluated):
                    record["generator_idle_share"] = services.idle_share()
                    metrics_log.append(record)
                    metrics_log.sync()
                if ctx.is_main:   # every report_every steps (a failure only warns)
                    write_training_report(config.output, metrics=metrics_path, config=config, step=step,
                                          every=config.report_every)
                if config.checkpoint_every and step % config.checkpoint_every == 0 and step < config.steps:
                    checkpoint()
                if progress and ctx.is_main:
                    progress(step, record)
        last_checkpoint = checkpoint()
        model_uri = storage.join(config.output, "model")
        if save_full_model(policy, tokenizer, scratch / "model", ctx):
            storage.publish_checkpoint(scratch / "model", model_uri,
                                       metadata={"method": config.method, "step": step, "version": version})
        critic_uri = None
        if critic is not None:
            critic_uri = storage.join(config.output, "critic")
            if _save_critic(critic, initial_dir, scratch / "critic", ctx):
                storage.publish_checkpoint(scratch / "critic", critic_uri, metadata={"step": step})
        if ctx.is_main:
            summary = {
                "method": config.method, "steps": step, "version": version, "replayed_steps": replayed,
                "trained_trajectories": run["trained_trajectories"], "trained_tokens": run["trained_tokens"],
                "dropped": sum(dropped_by_reason().values()), "dropped_by_reason": dict(dropped_by_reason()),
                "requeued": run["requeued"] + pending.requeued,
                "admission": config.admission, "max_staleness": config.max_staleness,
                "length_bias": pending.bias.summary(),
                "stream": {"low_water_mark": ledger.low_water_mark, "frontier": ledger.frontier,
                           "owed": ledger.owed_count(), "outcomes": dict(ledger.outcomes)},
                "reward_first": sum(run["first_rewards"]) / max(1, len(run["first_rewards"])),
                "reward_last": sum(run["last_rewards"]) / max(1, len(run["last_rewards"])),
                "seconds": time.time() - started, "checkpoint": last_checkpoint, "model": model_uri,
                "critic": critic_uri, "resumed_from": latest, "world_size": ctx.world_size,
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
        if services is not None:
            services.stop(shutdown=config.shutdown_services)
        if server is not None:
            server.stop()
    return broadcast_object(summary, ctx)
