"""The rollout manager: runs episodes concurrently under admission control and hands finished
trajectories to learners with at-least-once delivery until they are acknowledged.

In flight means started and not yet acknowledged (running, ready or taken). Capping it at
(max_staleness + 1) × batch size bounds how stale a trajectory can get before the learner sees it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.rollout.engines.base import Engine, SamplingParams, check_context, check_training_sampling
from sao_core.rollout.episode import EpisodeLimits, run_episode
from sao_core.rollout.trajectory import Trajectory

log = logging.getLogger(__name__)


class RolloutError(ValueError):
    """A request the manager cannot honour; the message says why (HTTP 4xx)."""


class ConflictError(RolloutError):
    """The request conflicts with the current state (HTTP 409)."""


@dataclass
class RolloutPlan:
    """What to roll out. `rollouts_per_prompt` = 1 for SAO, G for GRPO groups (started together)."""

    dataset: str                                 # prepared rl dataset (directory, data.jsonl or s3://)
    rollouts_per_prompt: int = 1
    epochs: int = 1                              # 0: cycle until stopped
    shuffle: bool = True
    seed: int = 0
    limit: int | None = None                     # use only the first N prompts
    max_in_flight: int = 64                      # episodes started and not yet acknowledged
    env_concurrency: dict[str, int] = field(default_factory=dict)   # per-environment running caps
    env_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens_per_turn: int = 256
    max_total_tokens: int = 4096
    episode_timeout_s: float = 0.0
    # A learner's staleness bound: an episode whose first token is more than this many versions older than
    # the current weights can no longer be trained (the learner's version is never behind the service's),
    # so it ends before its next turn with finish_reason "stale" and is delivered for the learner to drop
    # (with its whole group), as it would have been at the end. None: episodes always run to the end.
    abandon_after_versions: int | None = None
    training: bool = True                        # training mode refuses non-default sampling
    # The prompt stream is one fixed sequence for a seed: position p = epoch × prompts + index in that
    # epoch's order. Services sharing a run take the positions p ≡ shard (mod num_shards); a plan
    # restarted for a resumed run skips the positions before start_position (already trained).
    start_position: int = 0
    shard: int = 0
    num_shards: int = 1

    def sampling(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                              max_new_tokens=self.max_new_tokens_per_turn)

    def validate(self) -> None:
        for name in ("rollouts_per_prompt", "max_in_flight", "max_new_tokens_per_turn", "max_total_tokens"):
            if getattr(self, name) < 1:
                raise RolloutError(f"plan.{name} must be >= 1, got {getattr(self, name)}")
        if self.epochs < 0:
            raise RolloutError(f"plan.epochs must be >= 0, got {self.epochs}")
        if self.limit is not None and self.limit < 1:
            raise RolloutError(f"plan.limit must be >= 1, got {self.limit}")
        if self.start_position < 0 or self.num_shards < 1 or not 0 <= self.shard < self.num_shards:
            raise RolloutError(f"plan needs start_position >= 0 and 0 <= shard < num_shards, got "
                               f"{self.start_position}, {self.shard}, {self.num_shards}")
        if self.abandon_after_versions is not None and self.abandon_after_versions < 0:
            raise RolloutError(f"plan.abandon_after_versions must be >= 0, got {self.abandon_after_versions}")
        if any(v < 1 for v in self.env_concurrency.values()):
            raise RolloutError("plan.env_concurrency values must be >= 1")
        try:
            self.sampling().validate()
            if self.training:
                check_training_sampling(self.sampling())
        except ValueError as err:
            raise RolloutError(str(err)) from err


@dataclass
class _Lease:
    consumer: str
    trajectory: Trajectory
    since: float


class RolloutManager:
    """Owns the engine, the plan's producer task, the outbox of finished trajectories and the leases."""

    def __init__(self, engine: Engine, tokenizer, cache_dir: str, lease_seconds: float = 600.0):
        self.engine = engine
        self.tokenizer = tokenizer
        self.cache_dir = cache_dir
        self.lease_seconds = lease_seconds
        self.plan: RolloutPlan | None = None
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
        self.counts: Counter = Counter()
        self.finish_reasons: Counter = Counter()
        self.tool_seconds: list[float] = []
        self.last_weight_load_seconds = 0.0
        self.started_at = time.time()
        self.plan_done = False
        self.listeners: list = []             # callables(trajectory) for metrics

    # ---------------------------------------------------------------- plan and episodes
    def start(self, plan: RolloutPlan) -> dict:
        """Start producing episodes for `plan` (one plan at a time). A plan whose `max_total_tokens` exceeds the
        engine's context is refused."""
        plan.validate()
        try:
            check_context(self.engine, plan.max_total_tokens)
        except ValueError as err:
            raise RolloutError(str(err)) from err
        if self._producer is not None and not self._producer.done():
            raise ConflictError("a rollout plan is already running; stop it first")
        if not self._accepting:
            raise ConflictError("the service is shutting down")
        from sao_core.envs import task_from_row
        from sao_core.training.trainer import TrainingError, load_prepared

        try:
            rows, kind, uri = load_prepared(plan.dataset)
        except TrainingError as err:
            raise RolloutError(str(err)) from err
        if kind is not None and kind != "rl":
            raise RolloutError(f"{uri} was prepared with --kind {kind}; rollouts need --kind rl")
        try:
            tasks = [task_from_row(row) for row in rows[: plan.limit]]
        except (KeyError, TypeError, ValueError) as err:
            raise RolloutError(f"{uri}: {err}") from err
        self.plan = plan
        self.plan_done = False
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
        rng = random.Random(plan.seed)
        epoch = 0
        while plan.epochs == 0 or epoch < plan.epochs:
            order = list(range(len(tasks)))
            if plan.shuffle:
                rng.shuffle(order)
            for offset, index in enumerate(order):
                position = epoch * len(tasks) + offset
                if position < plan.start_position or position % plan.num_shards != plan.shard:
                    continue
                for k in range(plan.rollouts_per_prompt):
                    while self._paused:
                        await asyncio.sleep(0.05)
                    queued = time.time()
                    await self._slots.acquire()
                    env_slot = self._env_slots.get(tasks[index].env)
                    if env_slot is not None:
                        await env_slot.acquire()
                    episode = asyncio.create_task(self._episode(plan, tasks[index], k, epoch, position, queued,
                                                                env_slot))
                    self._episodes.add(episode)
                    episode.add_done_callback(self._episodes.discard)
            epoch += 1
        await asyncio.gather(*list(self._episodes), return_exceptions=True)
        self.plan_done = True
        self._new_ready.set()

    async def _episode(self, plan, task, k, epoch, position, queued, env_slot) -> None:
        from sao_core.envs import make_env

        self.counts["started"] += 1
        try:
            try:
                env = make_env(task.env, **plan.env_options.get(task.env, {}))
            except Exception as err:
                log.warning("cannot create environment %s for %s: %s", task.env, task.id, err)
                self.counts["env_create_failed"] += 1
                self._slots.release()
                return
            limits = EpisodeLimits(plan.max_total_tokens, plan.max_new_tokens_per_turn, plan.episode_timeout_s)
            digest = hashlib.sha256(f"{plan.seed}/{epoch}/{task.id}/{k}".encode()).hexdigest()[:20]
            bound = plan.abandon_after_versions
            trajectory = await run_episode(task, env, self.engine, self.tokenizer, plan.sampling(), limits,
                                           queued_at=queued, sample_index=k, trajectory_id=f"{digest}-{k}",
                                           executor=self._env_pool,
                                           abandon_if=None if bound is None else
                                           lambda oldest: self.engine.version - oldest > bound)
            trajectory.metadata["epoch"] = epoch
            trajectory.metadata["position"] = position
        except asyncio.CancelledError:
            self.counts["dropped"] += 1
            self._slots.release()
            raise
        finally:
            if env_slot is not None:
                env_slot.release()
        self.counts["finished"] += 1
        self.finish_reasons[trajectory.finish_reason] += 1
        self.tool_seconds.append(trajectory.timings.tool_seconds)
        for listener in self.listeners:
            listener(trajectory)
        self._ready[trajectory.id] = trajectory
        self._new_ready.set()

    # ---------------------------------------------------------------- delivery
    async def take(self, consumer: str, max_items: int, wait_s: float) -> list[Trajectory]:
        """Up to `max_items` finished trajectories, oldest first, leased to `consumer`; waits up to
        `wait_s` seconds for the first one."""
        if max_items < 1:
            raise RolloutError("max must be >= 1")
        self._expire_leases()
        deadline = time.monotonic() + max(0.0, wait_s)
        while not self._ready and time.monotonic() < deadline and not (self.plan_done and not self._episodes):
            self._new_ready.clear()
            try:
                await asyncio.wait_for(self._new_ready.wait(), deadline - time.monotonic())
            except TimeoutError:
                break
        out = []
        while self._ready and len(out) < max_items:
            tid, trajectory = self._ready.popitem(last=False)
            self._leased[tid] = _Lease(consumer, trajectory, time.monotonic())
            out.append(trajectory)
        return out

    def ack(self, ids: list[str], dropped: list[str] | None = None) -> dict:
        """Acknowledge trajectories (trained, or `dropped` by the learner, e.g. too stale): they are
        never delivered again and free their admission slots. Unknown ids are reported, not fatal."""
        unknown = []
        for tid in list(ids) + list(dropped or []):
            lease = self._leased.pop(tid, None)
            if lease is None:
                if tid not in self._acked:
                    unknown.append(tid)
                continue
            self._acked.add(tid)
            self.counts["acknowledged"] += 1
            if self._slots is not None:
                self._slots.release()
        self.counts["dropped_by_learner"] += len(set(dropped or []) - set(unknown))
        return {"acknowledged": len(ids) + len(dropped or []) - len(unknown), "unknown": unknown}

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
    async def update_weights(self, version: int, uri: str, sha256: str) -> dict:
        """Load new weights: the checkpoint's manifest must hash to `sha256` and every file must match
        the manifest; otherwise nothing changes."""
        if version <= self.engine.version:
            raise ConflictError(f"version {version} is not newer than the current version {self.engine.version}")
        started = time.monotonic()
        try:
            actual = await asyncio.to_thread(storage.checkpoint_digest, uri)
        except storage.StorageError as err:
            raise RolloutError(f"cannot read the weights at {uri}: {err}") from err
        if actual != sha256:
            raise RolloutError(f"checksum mismatch for {uri}: its manifest hashes to {actual}, the request says "
                               f"{sha256}; the current weights (version {self.engine.version}) stay")
        try:
            local = await asyncio.to_thread(storage.fetch_checkpoint, uri, Path(self.cache_dir) / "weights")
            await self.engine.load_weights(str(local), version)
        except Exception as err:
            raise RolloutError(f"cannot load the weights at {uri}: {err}; the current weights (version "
                               f"{self.engine.version}) stay") from err
        self.last_weight_load_seconds = time.monotonic() - started
        return {"version": self.engine.version, "seconds": self.last_weight_load_seconds}

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

    def status(self) -> dict:
        running = len(self._episodes)
        return {
            "version": self.engine.version,
            "running": running,
            "ready": len(self._ready),
            "taken": len(self._leased),
            "in_flight": running + len(self._ready) + len(self._leased),
            "finished": self.counts["finished"],
            "acknowledged": self.counts["acknowledged"],
            "dropped": self.counts["dropped"] + self.counts["dropped_by_learner"],
            "cancelled": self.counts["dropped"],                  # episodes cut off by stop / shutdown
            "dropped_by_learner": self.counts["dropped_by_learner"],  # acknowledged as too stale
            "redelivered": self.counts["redelivered"],
            "finish_reasons": dict(self.finish_reasons),
            "paused": self._paused,
            "plan": asdict(self.plan) if self.plan else None,
            "plan_done": self.plan_done,
            "engine": self.engine.stats(),
        }
