"""Length bias of what a run trains: drop rates by episode-length bucket and the mean length of trained
episodes against every episode that reached the learner.

Asynchronous training drops stale trajectories, and the stale ones are the long ones, so a run can end up
training mostly short episodes. These counters make that visible per step (`step_record`, counts since the
previous step) and over the run (`summary`). Lengths are turns (model turns of the episode) and tokens
(sampled tokens, the action mask). Buckets are powers of two: "1", "2", "3-4", "5-8", ...
"""

from __future__ import annotations

from collections import Counter
from typing import Any


def bucket(n: int) -> str:
    """The power-of-two bucket of a length: 0 -> "0", 1 -> "1", 2 -> "2", 3..4 -> "3-4", 5..8 -> "5-8"."""
    if n <= 2:
        return str(max(n, 0))
    high = 1 << (n - 1).bit_length()
    return f"{high // 2 + 1}-{high}"


def _bucket_key(label: str) -> int:
    return int(label.split("-")[0])


class LengthBias:
    """Counts of arrived / trained / dropped episodes per length bucket, and their summed lengths."""

    def __init__(self):
        self.run = self._empty()
        self.step = self._empty()

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"arrived": Counter(), "dropped": Counter(), "arrived_tokens": Counter(), "dropped_tokens": Counter(),
                "n_trained": 0, "trained_turns": 0, "trained_tokens": 0,
                "n_arrived": 0, "arrived_turns": 0, "arrived_tokens_sum": 0}

    def _add(self, trajectory, count_turns: str, count_tokens: str) -> None:
        for record in (self.run, self.step):
            record[count_turns][bucket(trajectory.num_turns)] += 1
            record[count_tokens][bucket(trajectory.num_action_tokens)] += 1

    def arrived(self, trajectory) -> None:
        """A trajectory reached the learner for the first time (trained or dropped later)."""
        self._add(trajectory, "arrived", "arrived_tokens")
        for record in (self.run, self.step):
            record["n_arrived"] += 1
            record["arrived_turns"] += trajectory.num_turns
            record["arrived_tokens_sum"] += trajectory.num_action_tokens

    def dropped(self, trajectory) -> None:
        self._add(trajectory, "dropped", "dropped_tokens")

    def trained(self, trajectory) -> None:
        for record in (self.run, self.step):
            record["n_trained"] += 1
            record["trained_turns"] += trajectory.num_turns
            record["trained_tokens"] += trajectory.num_action_tokens

    @staticmethod
    def _report(record: dict[str, Any]) -> dict[str, Any]:
        def rates(arrived: Counter, dropped: Counter) -> dict[str, float]:
            return {b: round(dropped[b] / arrived[b], 4) for b in sorted(arrived, key=_bucket_key)}

        def mean(total: int, n: int) -> float | None:
            return round(total / n, 4) if n else None

        return {"drop_rate_by_turns": rates(record["arrived"], record["dropped"]),
                "drop_rate_by_tokens": rates(record["arrived_tokens"], record["dropped_tokens"]),
                "trained_turns_mean": mean(record["trained_turns"], record["n_trained"]),
                "arrived_turns_mean": mean(record["arrived_turns"], record["n_arrived"]),
                "trained_tokens_mean": mean(record["trained_tokens"], record["n_trained"]),
                "arrived_tokens_mean": mean(record["arrived_tokens_sum"], record["n_arrived"])}

    def step_record(self) -> dict[str, Any]:
        """Counts since the previous call (for the step's metrics line); then starts a new step."""
        out = self._report(self.step)
        out["arrived_by_turns"] = dict(self.step["arrived"])
        out["dropped_by_turns"] = dict(self.step["dropped"])
        self.step = self._empty()
        return out

    def summary(self) -> dict[str, Any]:
        out = self._report(self.run)
        out["arrived_by_turns"] = {b: self.run["arrived"][b] for b in sorted(self.run["arrived"], key=_bucket_key)}
        out["dropped_by_turns"] = {b: self.run["dropped"][b] for b in sorted(self.run["dropped"], key=_bucket_key)}
        return out
