"""Where an RL run stands, as typed values: the step, the weights version, the stream ledger and the whole-run
counters (what a checkpoint keeps and a resume gives back), and what a journal replay found.

The counters are the summary's (trained trajectories and tokens, drops by reason, re-queues, first and last
rewards): kept in every checkpoint and advanced by the replayed journal, so a resumed run's summary covers the
whole run. A checkpoint written before they were kept gives zeros (and `step × batch_size` trained
trajectories, since every step was one batch).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from sao_core.learner.ledger import StreamLedger
from sao_core.rollout.trajectory import Trajectory


@dataclass
class RunCounters:
    """The whole run's counters (before this process, from the checkpoint and the replay, and by it)."""

    trained_trajectories: int = 0
    trained_tokens: int = 0                       # action tokens
    dropped_by_reason: Counter = field(default_factory=Counter)
    requeued: int = 0
    first_rewards: list[float] = field(default_factory=list)   # the first 3 batches' episode rewards
    last_rewards: list[float] = field(default_factory=list)    # the last 3 batches' episode rewards

    def count_trained(self, trajectories: list[Trajectory], tokens: int, batch_size: int) -> None:
        """A trained batch of `tokens` action tokens; episodes' rewards are counted by their last piece."""
        self.trained_trajectories += len(trajectories)
        self.trained_tokens += tokens
        rewards = [t.reward for t in trajectories if not t.is_fragment]
        if len(self.first_rewards) < 3 * batch_size:
            self.first_rewards += rewards
        self.last_rewards = (self.last_rewards + rewards)[-3 * batch_size:]

    def count_drops(self, records: list[dict[str, Any]]) -> None:
        """Journaled drop records: a re-queued one counts as a re-queue, any other as a drop of its reason."""
        for r in records:
            if r.get("requeue"):
                self.requeued += 1
            else:
                self.dropped_by_reason[r["reason"]] += 1

    def to_state(self, more_dropped: Counter | None = None, more_requeued: int = 0) -> dict[str, Any]:
        """JSON-able counters, with drops and re-queues counted elsewhere (this process's `Pending`) added."""
        dropped = self.dropped_by_reason + (more_dropped or Counter())
        return {"trained_trajectories": self.trained_trajectories, "trained_tokens": self.trained_tokens,
                "dropped_by_reason": dict(dropped), "requeued": self.requeued + more_requeued,
                "first_rewards": list(self.first_rewards), "last_rewards": list(self.last_rewards)}

    @classmethod
    def from_state(cls, counters: dict[str, Any] | None) -> RunCounters:
        counters = counters or {}
        return cls(int(counters.get("trained_trajectories", 0)), int(counters.get("trained_tokens", 0)),
                   Counter({str(k): int(v) for k, v in counters.get("dropped_by_reason", {}).items()}),
                   int(counters.get("requeued", 0)), [float(x) for x in counters.get("first_rewards", [])],
                   [float(x) for x in counters.get("last_rewards", [])])


@dataclass
class RunState:
    """The learner's position in its run: `step` learner steps done, weights `version`, the stream `ledger`
    (which prompt-stream positions are trained, dropped or owed) and the whole-run `counters`."""

    step: int = 0
    version: int = 0
    ledger: StreamLedger = field(default_factory=StreamLedger)
    counters: RunCounters = field(default_factory=RunCounters)

    def settle_drops(self, records: list[dict[str, Any]]) -> None:
        """Settle the positions of journaled drops (a re-queued one stays owed), a group with its own reason."""
        by_position: dict[int, str] = {}
        for r in records:
            if not r.get("requeue") and by_position.get(r["position"], "group") == "group":
                by_position[r["position"]] = r["reason"]
        for position, reason in by_position.items():
            self.ledger.settle(position, reason)

    def to_checkpoint(self, method: str, extra: dict[str, Any], config: dict[str, Any],
                      more_dropped: Counter | None = None, more_requeued: int = 0) -> dict[str, Any]:
        """The learner state a checkpoint stores beside the tensors (`extra`: the updater's schedules and
        baseline; `config`: the run's settings, for the report)."""
        return {"method": method, "step": self.step, "version": self.version,
                "data_position": self.ledger.low_water_mark, "stream": self.ledger.to_state(), "extra": extra,
                "counters": self.counters.to_state(more_dropped, more_requeued), "config": config}

    @classmethod
    def from_checkpoint(cls, state: dict[str, Any], batch_size: int) -> RunState:
        """The run state of a checkpoint's learner state; ValueError when its stream ledger is malformed."""
        step, version = int(state["step"]), int(state["version"])
        counters = RunCounters.from_state(state.get("counters"))
        if "counters" not in state:   # a checkpoint from before the counters: every step is one batch
            counters.trained_trajectories = step * batch_size
        ledger = (StreamLedger.from_state(state["stream"]) if "stream" in state
                  else StreamLedger.from_position(state.get("data_position", 0)))
        return cls(step, version, ledger, counters)


@dataclass
class Replayed:
    """What a journal replay after a checkpoint found: `steps` replayed, the trajectory ids it trained and
    dropped (acknowledged again when the services reconnect), each replayed step's metrics line (marked
    ``"replayed": true``) and how many drop records follow the last replayed step."""

    steps: int = 0
    trained_ids: list[str] = field(default_factory=list)
    dropped_ids: list[str] = field(default_factory=list)
    records: list[dict[str, Any]] = field(default_factory=list)
    drop_records: int = 0
