"""The learner of an RL run in parts: the models and their updater, and the run state they stand at.

:class:`Learner` does the four things a step of the lossless protocol (``loop.py``) is made of, each on its own
so each can be tested without a rollout service: :meth:`Learner.step` trains on a batch and advances the run
state; :meth:`Learner.publish` writes the current weights as version ``vNNNNNN`` and hands them to a push
function (the services); :meth:`Learner.checkpoint` writes the resumable state (models, optimisers, schedules,
the run state); :meth:`Learner.resume` loads the newest checkpoint and :meth:`Learner.replay_journal` replays
the journal after it (the updates are deterministic, so the weights come back exactly), returning what was
replayed. Under torchrun every rank holds a Learner: the collective parts (training, gathering weights,
checkpoints) run on every rank; rank 0 reads the journal and writes storage.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.learner import journal
from sao_core.learner.batch import collate
from sao_core.learner.config import RLConfig
from sao_core.learner.delivery import Probe, chat_probe, learner_logprobs
from sao_core.learner.errors import LearnerError
from sao_core.learner.lag import lag_record
from sao_core.learner.pending import position_of
from sao_core.learner.state import Replayed, RunState
from sao_core.learner.updates import Updater
from sao_core.models.loading import ResolvedModel, pad_token_id
from sao_core.rollout.trajectory import Trajectory
from sao_core.training.checkpointing import (
    STATE_FILE,
    delete_checkpoints,
    load_training_checkpoint,
    prune_checkpoints,
    save_full_model,
    save_training_checkpoint,
    step_name,
)
from sao_core.training.distributed import DistContext, all_reduce, broadcast_object

log = logging.getLogger(__name__)

#: push(version, weights URI or None, digest, delivery probe or None, WeightUpdate or None): hands a version to
#: the rollout services, which must pass the probe (delivery.compare). With a WeightUpdate the weights travel in
#: memory (the digest is the update's); the URI is None then (no durable copy of that version yet).
Push = Callable[..., None]


def on_rank0(ctx: DistContext, fetch: Callable[[], Any]) -> Any:
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


def run_key(output: str) -> str:
    """A short name of a run, the same in every process of it: sha256 of its output, 12 hex digits."""
    import hashlib

    return hashlib.sha256(output.encode()).hexdigest()[:12]


def run_scratch(output: str, rank: int) -> Path:
    """The local scratch folder of this run's learner rank: ``$TMPDIR/sao-learner-<run key>-rank<N>`` (staged
    weights and checkpoints). Named by run, so a process of the same run that was killed left its folder here:
    it is swept (removed) now, before this process uses it; other runs' folders are left alone."""
    import tempfile

    scratch = Path(tempfile.gettempdir()) / f"sao-learner-{run_key(output)}-rank{rank}"
    if scratch.exists():
        log.info("removing %s, left by an earlier process of this run", scratch)
        shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    return scratch


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
    old = [name for name in names if (m := re.fullmatch(r"v(\d+)", name)) and int(m.group(1)) <= newest - keep]
    return delete_checkpoints([storage.join(weights_uri, name) for name in old], "weight version")


@dataclass
class StepResult:
    """One trained batch: its metrics (the updater's and the lag metrics), whether the policy changed (and so
    the version went up), the version it was trained at, its action tokens and its staleness histogram."""

    metrics: dict[str, Any]
    changed: bool
    trained_at_version: int
    tokens: int
    staleness: Counter


class Learner:
    """The policy (and SAO's critic), their updater, and the run state they stand at (see the module)."""

    def __init__(self, config: RLConfig, ctx: DistContext, scratch: Path, policy, tokenizer, critic=None,
                 initial: ResolvedModel | None = None):
        """`policy` and `critic` already prepared by the training core (`prepare_model`); `scratch` a local
        folder for staged weights and checkpoints; `initial` the resolved initial model (the critic's config when
        it is saved)."""
        self.config, self.ctx, self.scratch = config, ctx, scratch
        self.policy, self.tokenizer, self.critic, self.initial = policy, tokenizer, critic, initial
        # The tokens that end a model turn (what the engines stop on): for the turn-end health metrics.
        self.end_of_turn_ids = tuple(t for t in {tokenizer.eos_token_id} if t is not None)
        self.updater = Updater(config, policy, critic, ctx, end_of_turn_ids=self.end_of_turn_ids)
        self.admission_policy = config.admission_policy()   # its bound S: the lag metrics of each step
        self.state = RunState()
        self.lora: dict | None = None   # the LoRA summary (rank, alpha, targets, parameters) when the policy has one
        # In-memory pushes (`use_memory_transport`): the engine's dtypes per weight name (rank 0), the background
        # writer of durable versions, and the seconds the last step's durable write cost the learner.
        self.memory_push = False
        self.engine_dtypes: dict = {}
        self.durable = None
        self.durable_wait_s = 0.0
        self.probe_s = 0.0              # seconds the learner's side of the last delivery probe took

    @classmethod
    def load(cls, config: RLConfig, ctx: DistContext, scratch: Path) -> Learner:
        """The initial policy (and, for SAO, a critic from the same weights), verified once and prepared by
        the training core (float32 master weights, activation checkpointing, FSDP2 under torchrun)."""
        from sao_core.models import load_model_and_tokenizer, resolve_model
        from sao_core.models.value import ValueModel
        from sao_core.training.core import prepare_model
        from sao_core.training.lora import apply_critic_lora, apply_lora_settings

        initial = resolve_model(config.model, config.cache_dir, config.unverified)
        policy, tokenizer = load_model_and_tokenizer(initial, config.cache_dir)
        critic = None
        if config.method == "sao":
            critic = ValueModel.from_reference(initial)
            if config.freeze_critic_attention:
                critic.freeze_attention()
            try:
                critic = apply_critic_lora(critic, config)
            except ValueError as err:
                raise LearnerError(f"critic_lora_rank: {err}") from err
        # With lora_rank the policy trains an adapter, published alone (or merged: lora_publish). SAO's critic
        # (another head on the same body) trains fully.
        try:
            policy, lora = apply_lora_settings(policy, config)
        except ValueError as err:
            raise LearnerError(str(err)) from err
        policy = prepare_model(policy, ctx, config.gradient_checkpointing)
        if critic is not None:
            critic = prepare_model(critic, ctx, config.gradient_checkpointing)
        learner = cls(config, ctx, scratch, policy, tokenizer, critic, initial)
        learner.lora = lora
        return learner

    # ------------------------------------------------------------------------------------------ step
    def step(self, trajectories: list[Trajectory], allow_empty_rows: bool = False) -> StepResult:
        """Train on one batch (every rank passes the same one) and advance the run state: the step, the
        version when the policy changed, the ledger (each trajectory's piece trained) and the counters.
        `allow_empty_rows`: a replayed batch may hold a trajectory without action tokens (journaled before
        the learner dropped those)."""
        state = self.state
        staleness = Counter(t.staleness(state.version) for t in trajectories)
        batch = collate(trajectories, pad_token_id(self.tokenizer))
        metrics, changed = self.updater.step(batch, state.step, allow_empty_rows=allow_empty_rows,
                                             version=state.version)
        metrics.update(lag_record(trajectories, state.version, self.admission_policy))
        tokens = int(batch.action_mask.sum())
        trained_at = state.version
        state.step += 1
        state.version += int(changed)
        for t in trajectories:
            state.ledger.train_piece(position_of(t), t.fragment_index, not t.is_fragment)
        state.counters.count_trained(trajectories, tokens, self.config.batch_size)
        return StepResult(metrics, changed, trained_at, tokens, staleness)

    # ------------------------------------------------------------------------------------------ publish
    @property
    def publishes_adapter(self) -> bool:
        return bool(self.config.lora_rank) and self.config.lora_publish == "adapter"

    def probe(self) -> Probe | None:
        """The delivery probe at the current weights (collective: every rank runs the forward); None when
        `delivery_check_tokens` is 0. The built-in chat exchange through the tokenizer's chat template, its
        first `delivery_check_tokens` assistant tokens scored (`delivery.chat_probe`: the same ids on every
        rank), under the learner's own autocast (the tolerance covers a bf16 engine: see `delivery`)."""
        from sao_core.training.core import autocast

        n = self.config.delivery_check_tokens
        if not n:
            return None
        try:
            ids, start = chat_probe(self.tokenizer, n)
        except ValueError as err:
            raise LearnerError(f"delivery check: cannot build the probe with this tokenizer: {err}; set "
                               "delivery_check_tokens 0 to run without the check") from err
        vocab = min(len(self.tokenizer), self.policy.config.vocab_size)
        if max(ids) >= vocab:
            raise LearnerError(f"delivery check: the probe's token id {max(ids)} is outside the policy's "
                               f"vocabulary of {vocab}; set delivery_check_tokens 0 to run without the check")
        logprobs = learner_logprobs(self.policy, ids, start, autocast(self.config.precision, self.ctx.device),
                                    self.ctx.device)
        return Probe(ids, start, logprobs, self.state.version, self.config.delivery_tolerance)

    def _stage_weights(self, staging: Path) -> bool:
        """Write the version to publish at `staging` (collective; True on the rank that wrote): the LoRA
        adapter alone (`lora_publish` adapter) or the full model (the adapter merged in)."""
        if not self.publishes_adapter:
            return save_full_model(self.policy, self.tokenizer, staging, self.ctx)
        from sao_core.training.lora import write_adapter

        adapter = self._memory_weights()
        if adapter is None:   # not rank 0
            return False
        shutil.rmtree(staging, ignore_errors=True)
        write_adapter(self.policy, adapter, staging)
        return True

    def use_memory_transport(self, engine_dtypes: dict) -> None:
        """Push the weights in memory from now on (every rank calls it; `engine_dtypes`, name -> dtype of the
        colocated engine's weights, matters on rank 0): full weights, or the LoRA adapter alone when the run
        publishes adapters. Durable versions (a full-weights folder, or an adapter folder) are written in the
        background every `publish_every` versions and at checkpoints (`learner/durable.py`)."""
        from sao_core.learner.durable import DurableWeights
        from sao_core.training.checkpointing import write_full_weights
        from sao_core.training.lora import is_lora, write_adapter

        self.memory_push, self.engine_dtypes = True, dict(engine_dtypes)
        if not self.ctx.is_main:
            return
        if self.publishes_adapter:
            def write(state: dict, staging: Path) -> None:
                write_adapter(self.policy, state, staging)
        else:
            base = self.policy.get_base_model() if is_lora(self.policy) else self.policy

            def write(state: dict, staging: Path) -> None:
                write_full_weights(base.config, state, self.tokenizer, staging)
        self.durable = DurableWeights(
            storage.join(self.config.output, "weights"), self.scratch / "durable", write=write,
            prune=lambda uri, newest: prune_weight_versions(uri, newest, self.config.keep_weight_versions))

    def _full_weights(self) -> dict | None:
        """The policy's full weights under the plain causal LM's names (a LoRA adapter merged in): the live
        parameters themselves in one process, gathered copies under torchrun (a collective; None off rank 0)."""
        from sao_core.training.lora import plain_state_dict

        if not self.ctx.distributed:
            return plain_state_dict(self.policy, lambda m: m.state_dict())
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = plain_state_dict(self.policy, lambda m: get_model_state_dict(m, options=options))
        return state if self.ctx.is_main else None

    def _memory_weights(self) -> dict | None:
        """What an in-memory push sends (a collective; None off rank 0): the LoRA adapter's weights under peft's
        file names when the run publishes adapters (the live parameters in one process), else the full weights
        (`_full_weights`)."""
        if not self.publishes_adapter:
            return self._full_weights()
        from sao_core.training.checkpointing import trainable_state_dict
        from sao_core.training.lora import adapter_state_dict

        adapter = adapter_state_dict(self.policy, trainable_state_dict)
        return adapter if self.ctx.is_main else None

    def _version_metadata(self) -> dict:
        """The manifest metadata of the current version's folder under ``<output>/weights``."""
        metadata = {"version": self.state.version, "step": self.state.step}
        if self.publishes_adapter:
            metadata.update(kind="lora_adapter", base_model=self.config.model)
        return metadata

    def make_durable(self, state: dict | None = None) -> float:
        """Write the current version to storage in the background unless it was already submitted (collective
        when `state` is not given: it gathers the weights). Returns the seconds the learner waited (snapshot and
        the previous write). In-memory pushes only; a no-op otherwise."""
        if not self.memory_push:
            return 0.0
        version = self.state.version
        if self.durable is not None and self.durable.last_version == version:
            return 0.0
        if state is None:
            state = self._memory_weights()
        if not self.ctx.is_main:
            return 0.0
        from sao_core.learner.durable import snapshot

        began = time.monotonic()
        copy = snapshot(state)
        self.durable.submit(version, copy, self._version_metadata())
        return time.monotonic() - began

    def flush_durable(self) -> None:
        """Wait for the durable write in progress; LearnerError when it failed (rank 0; no-op elsewhere)."""
        if self.durable is not None:
            self.durable.wait()

    def _publish_in_memory(self, push: Push | None, probe) -> None:
        """The memory path of `publish`: build the update (full weights in the engine's dtypes, or the LoRA
        adapter with its config), push it, and every `publish_every` versions hand a snapshot to the durable
        writer."""
        from sao_core.rollout.weights import WeightUpdate
        from sao_core.training.lora import adapter_config

        state = self._memory_weights()
        if not self.ctx.is_main:
            return
        version = self.state.version
        if self.publishes_adapter:
            update = WeightUpdate.adapter(version, state, adapter_config(self.policy))
        else:
            update = WeightUpdate.build(version, state, self.engine_dtypes)
        if push is not None:
            push(version, None, None, probe, update)   # the digest is read after the copy: it hashes meanwhile
        every = self.config.publish_every
        self.durable_wait_s = self.make_durable(state) if every and version % every == 0 else 0.0

    def publish(self, push: Push | None = None) -> float:
        """Gather the policy (collective); rank 0 publishes it as version `state.version` under
        ``<output>/weights/vNNNNNN`` (with `lora_rank` and `lora_publish` adapter: the adapter alone, which the
        services apply to their base model), calls `push(version, uri, sha256, probe)` (which returns once every
        live service verified, loaded it and passed the delivery probe) and then deletes the versions older than
        the newest `keep_weight_versions`. Returns the seconds it took (0 on the other ranks)."""
        began = time.monotonic()
        probe = self.probe()
        self.probe_s = time.monotonic() - began
        if self.memory_push:
            self._publish_in_memory(push, probe)
            return time.monotonic() - began if self.ctx.is_main else 0.0
        if not self._stage_weights(self.scratch / "weights"):
            return 0.0
        version, weights = self.state.version, storage.join(self.config.output, "weights")
        uri = storage.join(weights, f"v{version:06d}")
        storage.publish_checkpoint(self.scratch / "weights", uri, metadata=self._version_metadata())
        if push is not None:
            push(version, uri, storage.checkpoint_digest(uri), probe)
        seconds = time.monotonic() - began
        # push returned: every live service loaded `version`, and one that is down gets the newest weights
        # when it rejoins, so no service will ever load an older version: they can go.
        prune_weight_versions(weights, version, self.config.keep_weight_versions)
        return seconds

    # ------------------------------------------------------------------------------------------ checkpoint
    def checkpoint(self, more_dropped: Counter | None = None, more_requeued: int = 0) -> str:
        """Write and publish a resumable checkpoint of the learner at ``<output>/checkpoints/step-NNNNNN``
        (collective): models, optimisers, RNG, and the learner state (run state, schedules, baseline, config);
        then delete the checkpoints beyond the newest `keep_checkpoints` (pinned steps excepted).
        `more_dropped` / `more_requeued`: drops and re-queues this process counted outside the run state."""
        checkpoints = storage.join(self.config.output, "checkpoints")
        config = json.loads(json.dumps(asdict(self.config), default=list))
        self.make_durable()   # in-memory pushes: the checkpoint's version on storage too (in the background)
        learner_state = self.state.to_checkpoint(self.config.method, self.updater.extra_state(), config,
                                                 more_dropped, more_requeued)
        uri = save_training_checkpoint(self.scratch / "checkpoint", storage.join(checkpoints, step_name(self.state.step)),
                                       self.updater.checkpoint_parts(), learner_state, self.ctx)
        if self.ctx.is_main:   # only now, with a newer one complete, may older ones go (keep_checkpoints)
            prune_checkpoints(checkpoints, self.config.keep_checkpoints, self.config.pin_checkpoints)
        return uri

    # ------------------------------------------------------------------------------------------ resume
    def resume(self, checkpoint_uri: str) -> RunState:
        """Load a checkpoint of this run (collective): every rank reads its own verified copy (no shared
        filesystem needed) and all agree before loading. Returns (and keeps) the run state it holds."""
        local, error, learner_state = None, "", {}
        try:
            local = storage.fetch_checkpoint(checkpoint_uri, Path(self.config.cache_dir) / "s3")
            learner_state = json.loads((local / STATE_FILE).read_text())
        except (storage.StorageError, OSError, ValueError) as err:
            error = f"cannot resume from {checkpoint_uri}: {err}"
        (failed,) = all_reduce([float(bool(error))], self.ctx)
        if failed:
            raise LearnerError(error or f"cannot resume from {checkpoint_uri}: another rank could not read it")
        if learner_state.get("method") != self.config.method:
            raise LearnerError(f"{checkpoint_uri} belongs to a {learner_state.get('method')!r} run, "
                               f"not {self.config.method!r}")
        learner_state = load_training_checkpoint(local, self.updater.checkpoint_parts(), self.ctx)
        self.updater.load_extra_state(learner_state["extra"])
        try:
            self.state = RunState.from_checkpoint(learner_state, self.config.batch_size)
        except ValueError as err:
            raise LearnerError(f"{checkpoint_uri}: {err}") from err
        log.info("resumed from %s (step %d, version %d)", checkpoint_uri, self.state.step, self.state.version)
        return self.state

    def replay_journal(self) -> Replayed:
        """Replay the journal steps (and settle the drops) written after the state's step: each entry is
        checked against its sha256 first (a bad one stops the resume, naming the file and step)."""
        config, ctx, state = self.config, self.ctx, self.state
        replayed = Replayed()

        def read(fetch: Callable[[], Any]) -> Any:
            def checked() -> Any:
                try:
                    return fetch() if ctx.is_main else None
                except journal.JournalError as err:
                    raise LearnerError(f"cannot resume {config.output}: {err}") from err
            return on_rank0(ctx, checked)

        def replay_drops(after_step: int) -> None:
            records = read(lambda: journal.read_drops(config.output, after_step, config.unverified))
            for record in (records or []) if ctx.is_main else []:
                state.settle_drops(record)
                replayed.dropped_ids.extend(r["id"] for r in record if not r.get("requeue"))
                state.counters.count_drops(record)
            replayed.drop_records = len(records or [])

        replay_drops(state.step)
        while True:
            entry = read(lambda step=state.step: journal.read_step(config.output, step + 1, config.unverified))
            if entry is None:
                break
            try:
                batch = [Trajectory.from_dict(t) for t in entry["trajectories"]]
            except (KeyError, TypeError, ValueError) as err:
                raise LearnerError(f"cannot resume {config.output}: journal entry "
                                   f"{journal.step_uri(config.output, state.step + 1)} (step {state.step + 1}) holds "
                                   f"a malformed trajectory ({type(err).__name__}: {err})") from err
            replayed.trained_ids.extend(t.id for t in batch)
            result = self.step(batch, allow_empty_rows=True)
            replayed.steps += 1
            replayed.records.append({"step": state.step, "version": state.version, **result.metrics,
                                     "replayed": True,
                                     "staleness": {str(k): v for k, v in sorted(result.staleness.items())},
                                     "world_size": ctx.world_size})
            replay_drops(state.step)
        if replayed.steps:
            log.info("replayed %d journal steps; now at step %d, version %d", replayed.steps, state.step,
                     state.version)
        return replayed

    # ------------------------------------------------------------------------------------------ the end
    def save_final(self) -> tuple[str, str | None]:
        """Publish the trained policy at ``<output>/model`` and SAO's critic at ``<output>/critic``
        (collective); returns their URIs (critic None without one)."""
        config, state = self.config, self.state
        model_uri = storage.join(config.output, "model")
        if save_full_model(self.policy, self.tokenizer, self.scratch / "model", self.ctx):
            storage.publish_checkpoint(self.scratch / "model", model_uri,
                                       metadata={"method": config.method, "step": state.step,
                                                 "version": state.version})
        critic_uri = None
        if self.critic is not None:
            critic_uri = storage.join(config.output, "critic")
            if _save_critic(self.critic, self.initial, self.scratch / "critic", self.ctx, self.config):
                storage.publish_checkpoint(self.scratch / "critic", critic_uri, metadata={"step": state.step})
        return model_uri, critic_uri


def _save_critic(critic, initial: ResolvedModel, staging: Path, ctx: DistContext, config: RLConfig) -> bool:
    """Gather the critic (collective) and write it on rank 0 (a LoRA body merged); True on the rank that wrote."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from sao_core.training.lora import merged_critic

    full = get_model_state_dict(critic, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not ctx.is_main:
        return False
    shutil.rmtree(staging, ignore_errors=True)
    merged_critic(critic, full, initial, config).save_pretrained(staging)
    return True
