"""The trajectory record: one schema from the rollout service to the learner (JSON on the wire).

Token-aligned lists all have the length of `token_ids`: `action_mask[t]` is 1 where the model sampled
token t, `rollout_logprobs[t]` is the engine's log-prob of that sampled token (0 elsewhere), and
`versions[t]` is the policy version that sampled it (-1 on prompt and observation tokens). A trajectory
may span several versions when weights changed mid-episode.

Fragments (admission "fragments"): a long episode may reach the learner in pieces. Piece k carries every token
of the episode so far, with the action fields set only on the turns finished since piece k − 1 (the earlier ones
are context: action 0, log-prob 0, version −1) and ``metadata["fragment"] = k``. Every piece but the last has
finish_reason "fragment" and reward 0 (its value at the cut comes from the critic); the last one has the
episode's own finish_reason and reward. An episode that was never cut is one piece without the key.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from sao_core.envs.base import FINISH_REASONS as ENV_FINISH_REASONS

# An environment's reasons; "stale": the rollout service ended the episode early because a learner's staleness
# bound would have dropped it anyway (rollout/admission.py, `abandon_after`); "fragment": not an end but a cut,
# the finished turns of a running episode handed over for training (admission "fragments").
FRAGMENT = "fragment"
FINISH_REASONS = (*ENV_FINISH_REASONS, "stale", FRAGMENT)


class TrajectoryError(ValueError):
    """A trajectory record is malformed; the message names the field."""


@dataclass
class Timings:
    """Wall-clock stamps (Unix seconds) and durations (seconds) of one episode."""

    queued: float = 0.0
    started: float = 0.0
    finished: float = 0.0
    generation_seconds: float = 0.0
    tool_seconds: float = 0.0


@dataclass
class Trajectory:
    id: str
    prompt_id: str
    env: str
    token_ids: list[int]
    action_mask: list[int]
    rollout_logprobs: list[float]
    versions: list[int]
    reward: float
    num_turns: int
    finish_reason: str
    timings: Timings = field(default_factory=Timings)
    sample_index: int = 0                    # k-th rollout of this prompt in its plan (GRPO groups)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def fragment_index(self) -> int:
        """0-based index of this piece of its episode (0 for an episode delivered whole)."""
        return int(self.metadata.get("fragment", 0))

    @property
    def is_fragment(self) -> bool:
        """True for a piece that is not the episode's last (its advantages bootstrap from the critic)."""
        return self.finish_reason == FRAGMENT

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    @property
    def min_version(self) -> int:
        """Oldest policy version among the action tokens (-1 when there are none)."""
        vs = [v for v, m in zip(self.versions, self.action_mask, strict=True) if m]
        return min(vs) if vs else -1

    def staleness(self, current_version: int) -> int:
        """current version − oldest version that produced one of its tokens (0 when none)."""
        oldest = self.min_version
        return current_version - oldest if oldest >= 0 else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        """Parse and validate a record (e.g. from JSON); TrajectoryError names the bad field."""
        if not isinstance(data, dict):
            raise TrajectoryError(f"a trajectory must be a JSON object, got {type(data).__name__}")
        try:
            timings = Timings(**data.get("timings", {}))
        except TypeError as err:
            raise TrajectoryError(f"field 'timings': {err}") from None
        required = ("id", "prompt_id", "env", "token_ids", "action_mask", "rollout_logprobs", "versions", "reward",
                    "num_turns", "finish_reason")
        missing = [k for k in required if k not in data]
        if missing:
            raise TrajectoryError(f"missing field(s): {', '.join(missing)}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrajectoryError(f"unknown field(s): {', '.join(unknown)}")
        record = cls(**{**data, "timings": timings})
        record.validate()
        return record

    def validate(self) -> None:
        n = len(self.token_ids)
        for name in ("action_mask", "rollout_logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise TrajectoryError(f"field {name!r} has {len(getattr(self, name))} entries, token_ids has {n}")
        if any(m not in (0, 1) for m in self.action_mask):
            raise TrajectoryError("field 'action_mask' must hold only 0 and 1")
        if any(not isinstance(t, int) or t < 0 for t in self.token_ids):
            raise TrajectoryError("field 'token_ids' must hold non-negative integers")
        if any(not math.isfinite(lp) or lp > 1e-4 for lp in self.rollout_logprobs):
            raise TrajectoryError("field 'rollout_logprobs' must hold finite log-probabilities (<= 0)")
        if self.finish_reason not in FINISH_REASONS:
            raise TrajectoryError(f"field 'finish_reason' must be one of {', '.join(FINISH_REASONS)}, "
                                  f"got {self.finish_reason!r}")
        if not math.isfinite(self.reward):
            raise TrajectoryError("field 'reward' must be finite")
