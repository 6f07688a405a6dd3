"""Bookkeeping shared by the environments: the task, the turn and tool-call counts, the end of an episode, and
running the parsed tool calls of one turn in a sandbox."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sao_core.envs.base import StepResult, Task
from sao_core.sandbox.base import SandboxError

RESET_FIRST = "reset() must be called before step()"

#: A parsed tool call: ``(argument, None)`` when valid, ``(None, error observation)`` otherwise.
ParsedCall = tuple[str | None, str | None]


class Episode:
    """Base of the environments: `task`, `turns` (model turns stepped), `calls` (tool calls run) and whether
    the episode is over. A subclass calls `_begin` from `reset`, `_check_step` first in `step`, and `_end`
    for an episode that ends without a reward."""

    def __init__(self) -> None:
        self.task: Task | None = None
        self.turns = 0
        self.calls = 0
        self._done = False

    def _begin(self, task: Task) -> None:
        """Start an episode on `task`: counts at 0, not over."""
        self.task = task
        self.turns = self.calls = 0
        self._done = False

    def _check_step(self) -> None:
        """RuntimeError when `step` is called before `reset` or after the episode is over."""
        if self.task is None:
            raise RuntimeError(RESET_FIRST)
        if self._done:
            raise RuntimeError("the episode is over")

    def _counts(self) -> dict[str, Any]:
        """The counts every result of an ended episode carries in its ``info``."""
        return {"turns": self.turns, "calls": self.calls}

    def _end(self, finish_reason: str, tool_seconds: float = 0.0, reward: float = 0.0, **info: Any) -> StepResult:
        """End the episode: `reward` (default 0), `info` plus the counts; `tool_seconds` spent in this step."""
        self._done = True
        info.update(self._counts())
        return StepResult(done=True, observation=None, reward=reward, finish_reason=finish_reason,
                          tool_seconds=tool_seconds, info=info)

    def _run_tool_calls(self, calls: list[ParsedCall], run: Callable[[str], str]) -> StepResult:
        """Run each valid call with `run` (argument -> observation text; it counts `calls`) in order; an
        invalid call's observation is its error. The turn's result: the observations joined by newlines, or
        the end of the episode with finish_reason "tool_error" at the first `SandboxError` or `OSError`.
        `tool_seconds` is the time spent in `run`."""
        outputs: list[str] = []
        tool_seconds = 0.0
        for argument, problem in calls:
            if argument is None:
                outputs.append(problem or "error: invalid tool call")
                continue
            started = time.monotonic()
            try:
                outputs.append(run(argument))
            except (SandboxError, OSError) as exc:
                tool_seconds += time.monotonic() - started
                return self._end("tool_error", tool_seconds=tool_seconds, error=f"{type(exc).__name__}: {exc}")
            tool_seconds += time.monotonic() - started
        return StepResult(done=False, observation="\n".join(outputs), tool_seconds=tool_seconds,
                          info={"turn": self.turns, "calls": self.calls})
