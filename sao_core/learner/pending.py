"""Trajectories the learner has taken and not yet trained: staleness, failure and group handling, the
batch each admission rule picks, and what must only be acknowledged (positions the ledger has settled)."""

from __future__ import annotations

import dataclasses
from collections import Counter, OrderedDict
from dataclasses import dataclass

from sao_core.learner.bias import LengthBias
from sao_core.learner.config import GROUP_METHODS, RLConfig
from sao_core.learner.ledger import SETTLED, TRAINED, StreamLedger
from sao_core.rollout.admission import AdmissionPolicy
from sao_core.rollout.trajectory import Trajectory

# Episodes that ended through no doing of the policy: an engine or environment error (both reported as
# env_error by the episode runner) or the episode's timeout. Their reward says nothing about the actions.
FAILED_REASONS = ("env_error", "timeout")
# The drop reason of a trajectory without a sampled token (e.g. a prompt that filled the token budget, so the
# episode ended at once as "length"): nothing to train, and the critic must not run over its prompt.
NO_ACTION_TOKENS = "no_action_tokens"


def position_of(t: Trajectory) -> int:
    return int(t.metadata.get("position", -1))


def attempt_of(t: Trajectory) -> int:
    return int(t.metadata.get("attempt", 0))


def stream_key(t: Trajectory) -> tuple[int, int, int, int]:
    """(stream position, sample index, attempt, piece): a trajectory's place in the run's fixed prompt stream."""
    return position_of(t), t.sample_index, attempt_of(t), t.fragment_index


def admitted_of(t: Trajectory) -> int:
    """The weights version when the service admitted the episode (its group's, for GRPO)."""
    return int(t.metadata.get("admitted_version", t.min_version))


@dataclass
class Drop:
    """A trajectory the learner will not train: `reason` is stale, env_error, timeout, no_action_tokens or group
    (a member of a group dropped for another member's reason). `requeue`: its position is rolled out once more."""

    trajectory: Trajectory
    service: int
    reason: str
    requeue: bool = False

    def record(self) -> dict:
        return {"id": self.trajectory.id, "position": position_of(self.trajectory),
                "sample_index": self.trajectory.sample_index, "attempt": attempt_of(self.trajectory),
                "reason": self.reason, "requeue": self.requeue}


class Pending:
    """Taken, untrained trajectories in arrival order, and the counters of what was dropped."""

    def __init__(self, config: RLConfig, ledger: StreamLedger, policy: AdmissionPolicy | None = None):
        self.config = config
        self.policy = policy or config.admission_policy()
        self.ledger = ledger
        self.items: OrderedDict[str, tuple[Trajectory, int]] = OrderedDict()
        self.dropped_by_reason: Counter = Counter()     # trajectories dropped by this learner process
        self.requeued = 0                               # trajectories whose position was re-queued
        self.requeued_positions: set[int] = set()       # positions whose first attempt was re-queued
        self.dropped_positions: set[int] = set()        # positions dropped by this process (the ledger forgets
                                                        # outcomes below its mark)
        self.bias = LengthBias()
        self._seen: set[str] = set()

    @property
    def dropped(self) -> int:
        return sum(self.dropped_by_reason.values())

    def add(self, items: list[tuple[Trajectory, int]]) -> tuple[dict[int, list[str]], dict[int, list[str]]]:
        """Queue new arrivals. Returns (trained, dropped) ids by service that must only be acknowledged: their
        position is settled already (trained or dropped before a crash and redelivered, or the rest of a group
        that was dropped), or they are the late first attempt of a re-queued group. With
        `failed_episodes="train"` a failed episode is queued with the reward `failed_reward` instead of its own."""
        trained: dict[int, list[str]] = {}
        dropped: dict[int, list[str]] = {}
        for trajectory, index in items:
            position = position_of(trajectory)
            outcome = self.ledger.outcome(position) if position >= 0 else None
            late_attempt = position in self.requeued_positions and attempt_of(trajectory) == 0
            piece_done = (position >= 0 and outcome is None
                          and self.ledger.has_piece(position, trajectory.fragment_index))
            if piece_done or (outcome in (TRAINED, SETTLED) and position not in self.dropped_positions):
                trained.setdefault(index, []).append(trajectory.id)
                continue
            if outcome is not None or late_attempt:
                dropped.setdefault(index, []).append(trajectory.id)
                if trajectory.id not in self._seen:
                    self._seen.add(trajectory.id)
                    self.dropped_by_reason["group"] += 1
                continue
            if trajectory.finish_reason in FAILED_REASONS and self.config.failed_episodes == "train":
                trajectory = dataclasses.replace(trajectory, reward=self.config.failed_reward)
            if trajectory.id not in self._seen:
                self._seen.add(trajectory.id)
                if not trajectory.is_fragment:      # episodes, counted once: by their last piece
                    self.bias.arrived(trajectory)
            self.items.setdefault(trajectory.id, (trajectory, index))
        return trained, dropped

    def _reason(self, trajectory: Trajectory, version: int) -> str | None:
        """Why this trajectory must not be trained, or None."""
        if trajectory.finish_reason in FAILED_REASONS and (self.config.failed_episodes == "drop"
                                                            or trajectory.num_action_tokens == 0):
            return trajectory.finish_reason
        # "stale": ended early by the service for the same reason (its check uses the service's weights
        # version, never ahead of ours).
        if self.policy.too_stale(trajectory.staleness(version)) or trajectory.finish_reason == "stale":
            return "stale"
        if trajectory.num_action_tokens == 0:
            return NO_ACTION_TOKENS
        return None

    def drop_unusable(self, version: int) -> list[Drop]:
        """Remove the trajectories that must not be trained, whole groups for the group methods: older than
        max_staleness, ended early by the service as "stale", failed (unless `failed_episodes="train"`;
        a failed episode without a sampled token is dropped either way), or without a sampled token
        (no_action_tokens). With admission "requeue" a group
        dropped only for staleness on its first attempt is re-queued instead of settled."""
        reasons: dict[tuple, list[str]] = {}
        for t, _ in self.items.values():
            reason = self._reason(t, version)
            if reason:
                reasons.setdefault(self._group_key(t), []).append(reason)
        out: list[Drop] = []
        for tid in [tid for tid, (t, _) in self.items.items() if self._group_key(t) in reasons]:
            trajectory, index = self.items.pop(tid)
            own = self._reason(trajectory, version) or "group"
            requeue = (self.policy.requeues and attempt_of(trajectory) == 0
                       and set(reasons[self._group_key(trajectory)]) == {"stale"})
            out.append(Drop(trajectory, index, own, requeue))
            if not trajectory.is_fragment:
                self.bias.dropped(trajectory)
            if requeue:
                self.requeued += 1
                self.requeued_positions.add(position_of(trajectory))
            else:
                self.dropped_by_reason[own] += 1
                self.dropped_positions.add(position_of(trajectory))
        return out

    def _group_key(self, t: Trajectory) -> tuple:
        if self.config.method in GROUP_METHODS:
            return (position_of(t), attempt_of(t))
        return (t.id,)

    def forget_service(self, index: int) -> int:
        """A service lost its plan (restarted): what it delivered and we have not trained is owed again and
        will be rolled out anew by its new plan, so these copies go (nothing is acknowledged)."""
        gone = [tid for tid, (_, i) in self.items.items() if i == index]
        for tid in gone:
            del self.items[tid]
            self._seen.discard(tid)
        return len(gone)

    def batch(self, oldest_first: bool = False, admitted_at_most: int | None = None, oldest_token: bool = False
              ) -> list[tuple[Trajectory, int]] | None:
        """The next batch if one is complete: B trajectories, or B/G whole groups, chosen in arrival order, or with
        `oldest_first` by admission version, then stream position, or with `oldest_token` by the version of each
        piece's oldest untrained token, then stream position (admission fragments: the pieces nearest the bound
        first). With `admitted_at_most`, only episodes admitted at or before that version are candidates
        (admission version_order: nothing admitted after an episode still running). The rows are returned in
        stream order (`stream_key`)."""
        size = self.config.batch_size
        groups: OrderedDict[tuple, list[str]] = OrderedDict()
        for tid, (t, _) in self.items.items():
            groups.setdefault(self._group_key(t), []).append(tid)
        need = self.config.group_size if self.config.method in GROUP_METHODS else 1
        candidates = [ids for ids in groups.values() if len(ids) == need]

        def admitted(ids: list[str]) -> int:
            return min(admitted_of(self.items[tid][0]) for tid in ids)

        if admitted_at_most is not None:
            candidates = [ids for ids in candidates if admitted(ids) <= admitted_at_most]
        if oldest_first:
            # Within a version by stream position, not arrival: which episodes fill the batch does not depend
            # on which of them happened to finish first.
            candidates.sort(key=lambda ids: (admitted(ids), min(stream_key(self.items[tid][0]) for tid in ids)))
        if oldest_token:
            candidates.sort(key=lambda ids: (min(self.items[tid][0].min_version for tid in ids),
                                             min(stream_key(self.items[tid][0]) for tid in ids)))
        if len(candidates) * need < size:
            return None
        chosen = [tid for ids in candidates[: size // need] for tid in ids]
        # Rows in stream order, so that a batch's tensors (and the rounding of its sums) do not depend on arrival.
        return sorted((self.items.pop(tid) for tid in chosen), key=lambda item: stream_key(item[0]))
