"""The rollout manager: runs episodes concurrently under admission control and hands finished
trajectories to learners with at-least-once delivery until they are acknowledged.

In flight means started and not yet acknowledged (running, ready or taken). Capping it at
(max_staleness + 1) × batch size bounds how far generation runs ahead of training. The rollouts of one
prompt (a GRPO group) are admitted together, with one weights version. Every episode records the version
at its admission (`metadata["admitted_version"]`); `status()["oldest_unfinished_version"]` is the oldest
among the episodes still running or not yet taken, which the learner's `version_order` admission waits for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import random
import time
from collections import Counter, OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from sao_core import storage
from sao_core.rollout.admission import AdmissionPolicy
from sao_core.rollout.engines.base import Engine, EngineError, SamplingParams, check_context
from sao_core.rollout.episode import EpisodeLimits, run_episode
from sao_core.rollout.plan import RolloutError, RolloutPlan
from sao_core.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


class ConflictError(RolloutError):
    """The request conflicts with the current state (HTTP 409)."""


class ForbiddenError(RolloutError):
    """The request is authenticated but not allowed, e.g. weights outside the allowed roots (HTTP 403)."""


def stream_positions(plan: RolloutPlan, num_tasks: int):
    """(task index, epoch, position) of every position `plan` rolls out, in stream order: its shard's
    positions from start_position on, less skip_positions (endless when plan.epochs is 0)."""
    rng = random.Random(plan.seed)
    skip = set(plan.skip_positions)
    epoch = 0
    while plan.epochs == 0 or epoch < plan.epochs:
        order = list(range(num_tasks))
        if plan.shuffle:
            rng.shuffle(order)
        for offset, index in enumerate(order):
            position = epoch * num_tasks + offset
            if position < plan.start_position or position % plan.num_shards != plan.shard or position in skip:
                continue
            yield index, epoch, position
        epoch += 1


def episode_seed(plan_seed: int, position: int, sample_index: int, attempt: int) -> int:
    """The sampling seed of one training episode: 31 bits of sha256(plan seed / stream position / sample index /
    attempt). The episode's turns then sample with `turn_seed(episode_seed, turn)`, so which random numbers an
    episode draws depends on where it stands in the prompt stream, never on when it was admitted or which
    requests shared the engine with it (the engine's own counter seeded requests in arrival order before)."""
    digest = hashlib.sha256(f"{plan_seed}/{position}/{sample_index}/{attempt}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


#: scores admitted at once (running, or waiting for the weights lock); above it POST /v1/score answers 429. Scores
#: run one at a time, so a longer queue only holds memory and connections; the learner scores one probe per push.
MAX_QUEUED_SCORES = 32
#: seconds a refused score is told to wait (Retry-After): about one full-context score on a busy engine
SCORE_RETRY_AFTER_S = 1


class ScoreBusyError(RolloutError):
    """MAX_QUEUED_SCORES scores are already running or waiting (HTTP 429 with Retry-After)."""


class WeightsLock:
    """The weights lock: one holder at a time, either a weight update (`async with lock`, `acquire()`) or a score
    (`async with lock.for_score()`), and an update that waits goes before every score that waits.

    With a plain FIFO lock a weight push queued behind every score already waiting (48 full-context scores held
    one back 10.6 s); here it waits at most for the holder of the moment. Updates keep their order among
    themselves, and so do scores. The lock is handed straight to the next waiter on release, so no newcomer can
    take it in between."""

    def __init__(self) -> None:
        self._locked = False
        self._updates: deque[asyncio.Future] = deque()
        self._scores: deque[asyncio.Future] = deque()

    def locked(self) -> bool:
        return self._locked

    def waiting(self) -> dict:
        """{"updates": n, "scores": m}: the acquires waiting now."""
        return {"updates": sum(not w.done() for w in self._updates),
                "scores": sum(not w.done() for w in self._scores)}

    async def acquire(self) -> bool:
        """Take the lock for a weight update (ahead of any waiting score)."""
        return await self._acquire(self._updates)

    async def acquire_for_score(self) -> bool:
        """Take the lock for a score (behind any waiting update)."""
        return await self._acquire(self._scores)

    async def _acquire(self, queue: deque) -> bool:
        # Free means no one waits either: release() hands the lock on whenever someone does.
        if not self._locked:
            self._locked = True
            return True
        waiter = asyncio.get_running_loop().create_future()
        queue.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release()   # handed the lock in the instant of the cancel: pass it on
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
            raise
        return True

    def release(self) -> None:
        """Hand the lock to the first waiting update, else the first waiting score, else free it."""
        if not self._locked:
            raise RuntimeError("the weights lock is not held")
        for queue in (self._updates, self._scores):
            while queue:
                waiter = queue.popleft()
                if not waiter.done():      # a cancelled waiter is skipped
                    waiter.set_result(True)
                    return
        self._locked = False

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc) -> None:
        self.release()

    @contextlib.asynccontextmanager
    async def for_score(self):
        """`async with lock.for_score():` holds the lock for one score."""
        await self.acquire_for_score()
        try:
            yield
        finally:
            self.release()


@dataclass
class _Lease:
    consumer: str
    trajectory: Trajectory
    since: float


class RolloutManager:
    """Owns the engine, the plan's producer task, the outbox of finished trajectories and the leases."""

    def __init__(self, engine: Engine, tokenizer, cache_dir: str, lease_seconds: float = 600.0,
                 allowed_weight_roots: list[str] | None = None):
        self.engine = engine
        # Weights load only from inside these (local paths or s3:// prefixes); empty: no weight loads at all.
        self.allowed_weight_roots = list(allowed_weight_roots or [])
        self.weights_sha256: str | None = None   # manifest digest of the weights loaded last (None: the initial)
        # Updates and scores, one at a time; a waiting update goes before waiting scores (WeightsLock).
        self._weights_lock = WeightsLock()
        self.max_queued_scores = MAX_QUEUED_SCORES
        self.scores_queued = 0                   # scores running or waiting for the weights lock
        self.long_polls = 0                      # takes in progress (waiting for a trajectory, or about to)
        self.tokenizer = tokenizer
        self.cache_dir = cache_dir
        self.lease_seconds = lease_seconds
        self.plan: RolloutPlan | None = None
        self.policy: AdmissionPolicy | None = None   # the plan's admission policy (None: no learner bound)
        self._producer: asyncio.Task | None = None
        self._env_pool: ThreadPoolExecutor | None = None
        self._episodes: set[asyncio.Task] = set()
        self._ready: OrderedDict[str, Trajectory] = OrderedDict()
        self._leased: dict[str, _Lease] = {}
        self._acked: set[str] = set()
        self._new_ready = asyncio.Event()
        self._slots: asyncio.Semaphore | None = None
        self._env_slots: dict[str, asyncio.Semaphore] = {}
        self._paused = False
        self._accepting = True
        self._tasks: list = []
        self._retries: deque = deque()        # (task index, epoch, position, attempt) to roll out once more
        self._requeued: set[tuple[int, int]] = set()   # (position, attempt) already re-queued
        self._running_admitted: Counter = Counter()    # admission version -> episodes running
        self.counts: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        self.tool_seconds: list[float] = []
        self.last_weight_load_seconds = 0.0
        self.started_at = time.time()
        self.plan_done = False
        self.listeners: list = []             # callables(trajectory) for metrics

    # ---------------------------------------------------------------- plan and episodes
    def load_tasks(self, plan: RolloutPlan) -> list:
        """The plan's tasks, read from its dataset after the plan is checked (RolloutError naming what is wrong).
        Work in proportion to the dataset: the HTTP service runs it off the event loop (`asyncio.to_thread`)."""
        plan.validate()
        try:
            check_context(self.engine, plan.max_total_tokens)
        except ValueError as err:
            raise RolloutError(str(err)) from err
        from sao_core.data.prepared import open_prepared
        from sao_core.data.schemas import DataError
        from sao_core.envs import task_from_row

        try:
            prepared = open_prepared(plan.dataset)
        except DataError as err:
            raise RolloutError(str(err)) from err
        except (OSError, ValueError) as err:   # e.g. a path with a NUL byte (found by schemathesis)
            raise RolloutError(f"cannot read the dataset {plan.dataset!r}: {err}") from err
        rows, kind, uri = prepared.rows, prepared.kind, prepared.data_uri
        if kind is not None and kind != "rl":
            raise RolloutError(f"{uri} was prepared with --kind {kind}; rollouts need --kind rl")
        try:
            return [task_from_row(row) for row in rows[: plan.limit]]
        except (KeyError, TypeError, ValueError) as err:
            raise RolloutError(f"{uri}: {err}") from err

    def start(self, plan: RolloutPlan, tasks: list | None = None) -> dict:
        """Start producing episodes for `plan` (one plan at a time), with `tasks` from `load_tasks(plan)` (read
        here when not given). A plan whose `max_total_tokens` exceeds the engine's context is refused."""
        if self._producer is not None and not self._producer.done():
            raise ConflictError("a rollout plan is already running; stop it first")
        if not self._accepting:
            raise ConflictError("the service is shutting down")
        if tasks is None:
            tasks = self.load_tasks(plan)
        self.plan = plan
        self.policy = plan.policy()
        self.plan_done = False
        self._tasks = tasks
        self._retries.clear()
        self._requeued.clear()
        self._slots = asyncio.Semaphore(plan.max_in_flight)
        # One thread per episode in flight for environment calls (tool calls mostly wait); threads start lazily.
        if self._env_pool is not None:
            self._env_pool.shutdown(wait=False)
        self._env_pool = ThreadPoolExecutor(max_workers=plan.max_in_flight, thread_name_prefix="sao-env")
        self._env_slots = {name: asyncio.Semaphore(cap) for name, cap in plan.env_concurrency.items()}
        self._producer = asyncio.create_task(self._produce(plan, tasks))
        return {"prompts": len(tasks), "rollouts_per_prompt": plan.rollouts_per_prompt, "epochs": plan.epochs}

    async def stop(self) -> None:
        """Stop the plan: no new episodes; running ones are cancelled (counted as dropped)."""
        if self._producer is not None:
            self._producer.cancel()
        for task in list(self._episodes):
            task.cancel()
        await asyncio.gather(*self._episodes, return_exceptions=True)

    async def _produce(self, plan: RolloutPlan, tasks: list) -> None:
        stream = stream_positions(plan, len(tasks))
        exhausted = False
        while True:
            while self._paused:
                await asyncio.sleep(0.05)
            if exhausted and not self._retries:
                if not self._episodes:
                    break
                await asyncio.sleep(0.05)    # a re-queue may still come for a running episode
                continue
            queued = time.time()
            for _ in range(plan.rollouts_per_prompt):    # a group is admitted as a whole
                await self._slots.acquire()
            if self._retries:                               # re-queued positions go first
                index, epoch, position, attempt = self._retries.popleft()
            else:
                item = next(stream, None)
                if item is None:
                    exhausted = True
                    for _ in range(plan.rollouts_per_prompt):
                        self._slots.release()
                    continue
                (index, epoch, position), attempt = item, 0
            admitted = self.engine.version
            for k in range(plan.rollouts_per_prompt):
                env_slot = self._env_slots.get(tasks[index].env)
                if env_slot is not None:
                    await env_slot.acquire()
                episode = asyncio.create_task(self._episode(plan, tasks[index], k, epoch, position, queued,
                                                            env_slot, admitted, attempt, index))
                self._episodes.add(episode)
                episode.add_done_callback(self._episodes.discard)
        self.plan_done = True
        self._new_ready.set()

    async def _episode(self, plan, task, k, epoch, position, queued, env_slot, admitted, attempt, index) -> None:
        from sao_core.envs import make_env

        self.counts["started"] += 1
        self._running_admitted[admitted] += 1
        digest = hashlib.sha256(f"{plan.seed}/{epoch}/{task.id}/{k}".encode()).hexdigest()[:20]
        trajectory_id = f"{digest}-{k}" + (f"-r{attempt}" if attempt else "")
        try:
            try:
                env = make_env(task.env, **plan.env_options.get(task.env, {}))
            except Exception as err:
                # Delivered as a failed episode (no tokens), so the learner settles its position as env_error
                # instead of waiting for it forever.
                log.warning("cannot create environment %s for %s: %s", task.env, task.id, err)
                self.counts["env_create_failed"] += 1
                env = None
                trajectory = Trajectory(id=trajectory_id, prompt_id=task.id, env=task.env, token_ids=[],
                                        action_mask=[], rollout_logprobs=[], versions=[], reward=0.0, num_turns=0,
                                        finish_reason="env_error", sample_index=k,
                                        metadata={"info": {"error": f"cannot create the environment: {err}"}})
            limits = EpisodeLimits(plan.max_total_tokens, plan.max_new_tokens_per_turn, plan.episode_timeout_s)
            policy = self.policy
            params = SamplingParams(**{**plan.sampling().__dict__,
                                       "seed": episode_seed(plan.seed, position, k, attempt)})
            stamp = {"epoch": epoch, "position": position, "admitted_version": admitted, "attempt": attempt,
                     "task_index": index, "sampling_seed": params.seed}
            if env is not None:
                trajectory = await run_episode(task, env, self.engine, self.tokenizer, params, limits,
                                               queued_at=queued, sample_index=k, trajectory_id=trajectory_id,
                                               executor=self._env_pool,
                                               abandon_if=None if policy is None else
                                               lambda oldest: policy.abandon_due(oldest, self.engine.version),
                                               fragment_if=None if policy is None or not policy.fragments else
                                               lambda oldest: policy.fragment_due(oldest, self.engine.version),
                                               emit=lambda piece: self._emit(piece, stamp),
                                               may_generate=None if policy is None or policy.backlog_cap is None
                                               else lambda cap=policy.backlog_cap: self._backlog() < cap)
            trajectory.metadata.update(stamp)
        except asyncio.CancelledError:
            self.counts["dropped"] += 1
            self._slots.release()
            raise
        finally:
            self._running_admitted[admitted] -= 1
            if self._running_admitted[admitted] <= 0:
                del self._running_admitted[admitted]
            if env_slot is not None:
                env_slot.release()
        self.counts["finished"] += 1
        self.finish_reasons[trajectory.finish_reason] += 1
        self.tool_seconds.append(trajectory.timings.tool_seconds)
        for listener in self.listeners:
            listener(trajectory)
        # The done callback removes the task only on a later turn of the loop; a status read in between
        # counted the episode twice (running and ready), so in_flight could exceed max_in_flight.
        self._episodes.discard(asyncio.current_task())
        self._ready[trajectory.id] = trajectory
        self._new_ready.set()

    def _backlog(self) -> int:
        """Pieces ready or taken and not acknowledged: what the learner has yet to train."""
        return len(self._ready) + len(self._leased)

    def _emit(self, piece: Trajectory, stamp: dict) -> None:
        """A fragment of a running episode is ready (its slot stays taken until the episode's last piece)."""
        piece.metadata.update(stamp)
        self.counts["fragments"] += 1
        self._ready[piece.id] = piece
        self._new_ready.set()

    # ---------------------------------------------------------------- delivery
    async def take(self, consumer: str, max_items: int, wait_s: float) -> list[Trajectory]:
        """Up to `max_items` finished trajectories, oldest first, leased to `consumer`; waits up to
        `wait_s` seconds for the first one."""
        if max_items < 1:
            raise RolloutError("max must be >= 1")
        self._expire_leases()
        deadline = time.monotonic() + max(0.0, wait_s)
        self.long_polls += 1
        try:
            while not self._ready and time.monotonic() < deadline and not (self.plan_done and not self._episodes):
                self._new_ready.clear()
                try:
                    await asyncio.wait_for(self._new_ready.wait(), deadline - time.monotonic())
                except TimeoutError:
                    break
        finally:
            self.long_polls -= 1
        out = []
        while self._ready and len(out) < max_items:
            tid, trajectory = self._ready.popitem(last=False)
            self._leased[tid] = _Lease(consumer, trajectory, time.monotonic())
            out.append(trajectory)
        return out

    def ack(self, ids: list[str], dropped: list[str] | None = None, requeue: list[str] | None = None) -> dict:
        """Acknowledge trajectories (trained, or `dropped` by the learner, e.g. too stale): they are
        never delivered again and free their admission slots. Unknown ids are reported, not fatal.

        `requeue` (plan admission "requeue" only): dropped trajectories whose position is rolled out once
        more, with the weights of that moment, before the stream goes on (a whole group for GRPO: list every
        member). A position is re-queued at most once; a second request for it counts as a plain drop."""
        requeue = list(requeue or [])
        if requeue and (self.plan is None or self.plan.admission != "requeue"):
            raise RolloutError("requeue needs a plan with admission 'requeue'")
        unknown = []
        again: dict[int, Trajectory] = {}
        not_trained = set(dropped or []) | set(requeue)
        released_dropped = 0
        for tid in list(ids) + list(dropped or []) + requeue:
            lease = self._leased.pop(tid, None)
            if lease is None:
                if tid not in self._acked:
                    unknown.append(tid)
                continue
            self._acked.add(tid)
            self.counts["acknowledged"] += 1
            if lease.trajectory.is_fragment:   # the episode goes on and keeps its slot
                continue
            released_dropped += tid in not_trained
            if self._slots is not None:
                self._slots.release()
            if tid in requeue:
                meta = lease.trajectory.metadata
                if meta.get("attempt", 0) == 0 and "task_index" in meta:
                    again.setdefault(meta["position"], lease.trajectory)
        for position, trajectory in again.items():
            if (position, 1) not in self._requeued:
                self._requeued.add((position, 1))
                self._retries.append((trajectory.metadata["task_index"], trajectory.metadata["epoch"], position, 1))
                self.counts["requeued"] += 1
        # Only what this call released: an id acknowledged before (a learner re-sending after a crash) counts once.
        self.counts["dropped_by_learner"] += released_dropped
        return {"acknowledged": len(ids) + len(dropped or []) + len(requeue) - len(unknown), "unknown": unknown,
                "requeued": len(again)}

    def reconnect(self, consumer: str) -> int:
        """A consumer came back: everything it had taken but not acknowledged is delivered again first."""
        returned = [tid for tid, lease in self._leased.items() if lease.consumer == consumer]
        self._requeue(returned)
        return len(returned)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        self._requeue([tid for tid, lease in self._leased.items() if now - lease.since > self.lease_seconds])

    def _requeue(self, ids: list[str]) -> None:
        if not ids:
            return
        back = OrderedDict((tid, self._leased.pop(tid).trajectory) for tid in ids)
        back.update(self._ready)
        self._ready = back
        self.counts["redelivered"] += len(ids)
        self._new_ready.set()

    # ---------------------------------------------------------------- weights, pause, status
    async def update_weights(self, version: int, uri: str, sha256: str, resync: bool = False) -> dict:
        """Load new weights: `uri` must lie inside `allowed_weight_roots` (ForbiddenError), `version` must be
        the next one (current + 1) unless `resync` (a learner re-syncing a service, e.g. after its own
        resume: any version; the same version and digest again is a no-op) (ConflictError), the checkpoint's
        manifest must hash to `sha256` and every file must match the manifest; otherwise nothing changes."""
        from sao_core.rollout.auth import files_outside, resolve_within_roots

        if not self.allowed_weight_roots:
            raise ForbiddenError("this rollout service loads no weights: it was started without "
                                 "allowed_weight_roots (the run's output prefix, e.g. s3://bucket/run/weights)")

        def outside() -> ForbiddenError:
            return ForbiddenError(f"{uri} is outside the allowed weight roots ({', '.join(self.allowed_weight_roots)}); "
                                  f"the current weights (version {self.engine.version}) stay")

        if resolve_within_roots(uri, self.allowed_weight_roots) is None:   # fail fast, before the lock
            raise outside()
        async with self._weights_lock:   # one update at a time: the version check and the load are one step
            # The URI is read once more here, after the wait for the lock, and only its resolved form is used
            # from now on: a symlink swapped while this request waited cannot redirect the load.
            resolved = resolve_within_roots(uri, self.allowed_weight_roots)
            if resolved is None:
                raise outside()
            current = self.engine.version
            if self._check_next_version(version, sha256, resync):
                return {"version": current, "sha256": self.weights_sha256, "seconds": 0.0, "unchanged": True}
            started = time.monotonic()
            try:
                actual = await asyncio.to_thread(storage.checkpoint_digest, resolved)
            except storage.StorageError as err:
                raise RolloutError(f"cannot read the weights at {uri}: {err}") from err
            if actual != sha256:
                raise RolloutError(f"checksum mismatch for {uri}: its manifest hashes to {actual}, the request says "
                                   f"{sha256}; the current weights (version {current}) stay")
            if not storage.is_s3_uri(resolved):
                escaped = await asyncio.to_thread(files_outside, resolved, self.allowed_weight_roots)
                if escaped:
                    raise ForbiddenError(f"{uri}: {escaped[0]} is a link to a place outside the allowed weight roots; "
                                         f"the current weights (version {current}) stay")
            try:
                local = await asyncio.to_thread(storage.fetch_checkpoint, resolved, Path(self.cache_dir) / "weights")
                await self.engine.load_weights(str(local), version)
            except Exception as err:
                raise RolloutError(f"cannot load the weights at {uri}: {err}; the current weights (version "
                                   f"{self.engine.version}) stay") from err
            self.weights_sha256 = sha256
            self.last_weight_load_seconds = time.monotonic() - started
            return {"version": self.engine.version, "sha256": sha256, "seconds": self.last_weight_load_seconds}

    def _check_next_version(self, version: int, digest: str, resync: bool) -> bool:
        """True when the update is the weights already in use (a resync of the same version and digest: a
        no-op); ConflictError unless `version` is the next one (current + 1) or `resync`."""
        current = self.engine.version
        if resync and version == current and digest == self.weights_sha256:
            return True
        if not resync and version <= current:
            raise ConflictError(f"version {version} is not newer than the current version {current}; "
                                f"the service takes only version {current + 1} next (or a resync)")
        if not resync and version != current + 1:
            raise ConflictError(f"version {version} skips versions: the service is at version {current} and "
                                f"takes only version {current + 1} next (a learner re-syncing sends resync=true)")
        return False

    async def update_in_memory(self, update, resync: bool = False) -> dict:
        """Full weights or a LoRA adapter from a learner in this process (`sao_core.rollout.weights.WeightUpdate`):
        the same version rules as `update_weights`, under the same lock; the engine copies the tensors into its
        model and checks their digest (`HFEngine.update_in_memory`, `VLLMEngine.update_in_memory`). RolloutError
        when the engine cannot take weights this way or refuses them (the message says why)."""
        if not hasattr(self.engine, "update_in_memory"):
            raise RolloutError(f"the {type(self.engine).__name__} engine takes weights only from files")
        async with self._weights_lock:
            current = self.engine.version
            # The sender's digest is read only where it decides something (a resync of the current version):
            # reading it waits for the sender's hash, which otherwise runs while the engine copies.
            digest = update.digest if resync and update.version == current else None
            if self._check_next_version(update.version, digest, resync):
                return {"version": current, "sha256": self.weights_sha256, "seconds": 0.0, "unchanged": True}
            started = time.monotonic()
            try:
                received = await self.engine.update_in_memory(update)
            except EngineError as err:
                raise RolloutError(f"cannot take weights version {update.version} in memory: {err}") from err
            self.weights_sha256 = received
            self.last_weight_load_seconds = time.monotonic() - started
            return {"version": self.engine.version, "sha256": received, "seconds": self.last_weight_load_seconds}

    def weight_dtypes(self) -> dict:
        """name -> dtype of the engine's weights (what an in-memory update must be sent in)."""
        return self.engine.weight_dtypes()

    def weight_model(self):
        """The engine's live model, which in-memory updates are copied into (the weight channel checks a spec
        against it); RolloutError when the engine has no model in this process (the vLLM engine's is in vLLM's
        worker: it takes files, or in-memory updates from a learner in its own process) or carries a LoRA adapter."""
        model = getattr(self.engine, "model", None)
        if not hasattr(self.engine, "update_in_memory") or model is None:
            raise RolloutError(f"the {type(self.engine).__name__} engine takes no weights over the collective channel "
                               "(its model is not in this process): use the file transport")
        if getattr(self.engine, "lora_mode", None) is not None:
            raise RolloutError("this engine carries a LoRA adapter: in-memory full weights cannot replace it")
        return model

    async def score(self, token_ids: list[int], start: int) -> dict:
        """{"logprobs": of token_ids[start:], "version"}: scored under the weights lock, so the version is the
        one the log-probs were computed with. A weight update that arrives while scores wait goes before them
        (`WeightsLock`); ScoreBusyError when `max_queued_scores` scores are running or waiting already."""
        if self.scores_queued >= self.max_queued_scores:
            raise ScoreBusyError(f"score: {self.scores_queued} scores are running or waiting already (at most "
                                 f"{self.max_queued_scores}); retry in {SCORE_RETRY_AFTER_S} s")
        self.scores_queued += 1
        try:
            async with self._weights_lock.for_score():
                try:
                    logprobs = await self.engine.score(list(token_ids), start)
                except EngineError as err:
                    raise RolloutError(f"score: {err}") from err
                return {"logprobs": logprobs, "version": self.engine.version, "sha256": self.weights_sha256}
        finally:
            self.scores_queued -= 1

    async def pause(self) -> None:
        self._paused = True
        await self.engine.pause()

    async def resume(self) -> None:
        self._paused = False
        await self.engine.resume()

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admitting; let running episodes finish for up to `grace_s` seconds; cancel the rest."""
        self._accepting = False
        if self._producer is not None:
            self._producer.cancel()
        if self._episodes:
            await asyncio.wait(list(self._episodes), timeout=grace_s)
        await self.stop()
        if self._env_pool is not None:
            self._env_pool.shutdown(wait=False)
        await self.engine.close()

    def oldest_unfinished_version(self) -> int | None:
        """The oldest admission version among episodes running or finished but not yet taken (None: none)."""
        versions = list(self._running_admitted)
        versions += [t.metadata.get("admitted_version", t.min_version) for t in self._ready.values()]
        return min(versions, default=None)

    def status(self) -> dict:
        running = len(self._episodes)
        return {
            "version": self.engine.version,
            "weights_sha256": self.weights_sha256,
            "running": running,
            "ready": len(self._ready),
            "taken": len(self._leased),
            # Episodes: a fragment's episode is still running (or its last piece is counted), so pieces are not.
            "in_flight": running + sum(not t.is_fragment for t in self._ready.values())
            + sum(not lease.trajectory.is_fragment for lease in self._leased.values()),
            "fragments": self.counts["fragments"],
            "long_polls": self.long_polls,
            "finished": self.counts["finished"],
            "acknowledged": self.counts["acknowledged"],
            "dropped": self.counts["dropped"] + self.counts["dropped_by_learner"],
            "cancelled": self.counts["dropped"],                  # episodes cut off by stop / shutdown
            "dropped_by_learner": self.counts["dropped_by_learner"],  # acknowledged as too stale
            "redelivered": self.counts["redelivered"],
            "requeued": self.counts["requeued"],
            "oldest_unfinished_version": self.oldest_unfinished_version(),
            "finish_reasons": dict(self.finish_reasons),
            "paused": self._paused,
            "plan": asdict(self.plan) if self.plan else None,
            "plan_done": self.plan_done,
            "engine": self.engine.stats(),
        }
