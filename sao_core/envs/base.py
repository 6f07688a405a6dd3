"""The environment protocol: reset from a task, step on the model's text output.

The rollout service owns tokens: it samples the action tokens, decodes them to text for `step`, and
tokenises only the observations it gets back (token-in/token-out; the model's tokens are never
re-tokenised). Environments therefore see and return text only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

FINISH_REASONS = ("stop", "length", "tool_error", "timeout", "env_error")


@dataclass
class Task:
    """One prepared RL row (see `sao prepare-data --kind rl` and the benchmark kinds)."""

    id: str
    env: str
    prompt: list[dict]                      # chat messages; the episode starts from them
    answer: str | None = None
    tests: list[str] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class StepResult:
    """What the environment says about one model turn.

    `observation` is the text of the tool result to show the model next (rendered as a `tool` message),
    or None when the episode is over. `reward` counts only when `done`.
    """

    done: bool
    observation: str | None = None
    reward: float = 0.0
    finish_reason: str | None = None        # one of FINISH_REASONS when done
    tool_seconds: float = 0.0               # time spent running tools in this step
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's environment. Create one per episode; `close` releases its sandbox."""

    name: str
    max_turns: int

    def reset(self, task: Task) -> list[dict]:
        """Return the initial chat messages of the episode (usually the task's prompt)."""
        ...

    def step(self, action_text: str) -> StepResult:
        """Grade or execute the model's latest turn (its decoded text, special tokens removed)."""
        ...

    def close(self) -> None: ...

    # Optional: ``grade_unfinished(action_text) -> bool | None``. Environments with a reference answer may say
    # whether a turn cut at the token cap (never passed to `step`, reward 0) already held the right answer; the
    # episode runner records it as ``cut_turn_correct`` for the learner's health metrics (learner/health.py).
