"""The `tool_arith` environment: a calculator tool, one call per operation of a left-to-right chain.

The prompt is ``Compute A op B`` (one operation) or ``Compute A op1 B op2 C ... (left to right)``.
Each model turn is one of:

- ``<tool_call>calc X op Y</tool_call>``: the calculator runs (after a simulated, really slept,
  log-normal tool latency) and the observation is the result as text. The call must be the next
  operation of the chain, applied to the previous result; a malformed call or wrong operands give an
  observation starting with ``error:`` and the episode goes on. Several calls in one turn run in
  order; their observations are joined by newlines.
- text with ``\\boxed{N}`` (and no call): the episode ends, reward 1.0 if N is the true result.
- anything else: the episode ends with reward 0 (finish_reason "stop").

A turn that would call the tool when `max_turns` turns have been used ends the episode with reward 0
and finish_reason "length". Tasks without chain metadata (e.g. a prepared row ``Compute 3*4``) are
read from the prompt text; if that fails, any well-formed call is computed without checking its
operands, and only the boxed answer is graded against ``task.answer``.

Benchmark option ``fixed_turns=True`` (default off): a scripted tool that makes every episode of a task
with a chain last exactly ``num_ops + 1`` model turns (the length of the solved conversation, at most
`max_turns`), whatever the model writes, so that episode lengths follow the task set's distribution (the
long tail of ``tool_arith_tasks(p_more=...)``) and not the current policy's skill. Turn t before the last
is answered, after the tool latency (one draw per call, at least one), with the result of the chain's t-th
operation, right operands or not (so the conversation keeps the form the model was trained on instead of
derailing after an ``error:`` observation); wrong or malformed calls are only counted in ``info``. The
last turn ends the episode: reward 1.0 if it gives the right ``\\boxed{}`` answer (and no call).
"""

from __future__ import annotations

import math
import random
import re
import time
from typing import Any

from sao_core.data.synthetic import (
    OPERATORS,
    arith_result,
    parse_tool_arith_prompt,
    tool_arith_chain,
    tool_arith_messages,
    tool_arith_prompt,
    tool_arith_steps,
    tool_arith_value,
)
from sao_core.envs.base import StepResult, Task
from sao_core.envs.episode import Episode
from sao_core.envs.grading import answer_region, extract_boxed
from sao_core.envs.tool_calls import TOOL_CALL

NAME = "tool_arith"

_CALC = re.compile(r"^\s*calc\s+(-?\d+)\s*([-+*])\s*(-?\d+)\s*$")
_INT = re.compile(r"^\s*[+-]?\d+\s*$")


def tool_arith_tasks(
    count: int,
    seed: int,
    max_operand: int = 99,
    p_more: float = 0.2,
    max_ops: int = 30,
) -> list[Task]:
    """`count` tasks whose number of operations is ``1 + Geometric(p_more)`` capped at `max_ops`.

    The mean number of operations (and of calculator calls) is about ``1 / p_more``; ``p_more=1``
    gives only ``Compute A op B`` tasks. Same seed, same tasks. ``metadata``: ``start``, ``ops``
    (``[[op, operand], ...]``) and ``num_ops``.
    """
    rng = random.Random(seed)
    tasks = []
    for i in range(count):
        start, ops = tool_arith_chain(rng, max_operand, p_more, max_ops)
        tasks.append(
            Task(
                id=f"{NAME}-{seed}-{i}",
                env=NAME,
                prompt=[{"role": "user", "content": tool_arith_prompt(start, ops)}],
                answer=str(tool_arith_value(start, ops)),
                metadata={"start": start, "ops": [[op, operand] for op, operand in ops], "num_ops": len(ops)},
            )
        )
    return tasks


def tool_arith_solution(task: Task) -> list[dict]:
    """The solved conversation of a generated task (prompt, one call per operation, answer)."""
    start, ops = _chain_of(task)
    if ops is None:
        raise ValueError(f"task {task.id} has no tool_arith chain")
    return tool_arith_messages(start, ops)


def _chain_of(task: Task) -> tuple[int, list[tuple[str, int]] | None]:
    meta = task.metadata or {}
    if "start" in meta and "ops" in meta:
        try:
            ops = [(str(op), int(operand)) for op, operand in meta["ops"]]
            if all(op in OPERATORS for op, _ in ops) and ops:
                return int(meta["start"]), ops
        except (TypeError, ValueError):
            pass
    users = [m.get("content") or "" for m in task.prompt if m.get("role") == "user"]
    chain = parse_tool_arith_prompt(users[-1]) if users else None
    if chain is None:
        return 0, None
    return chain


def _same_answer(boxed: str, answer: str | None) -> bool:
    if answer is None:
        return False
    if _INT.match(boxed) and _INT.match(answer):
        return int(boxed) == int(answer)
    return boxed.strip() == answer.strip()


class ToolArithEnv(Episode):
    """One tool_arith episode (see the module docstring). Latency: log-normal, `latency_median_s`
    median and `latency_sigma` log-space standard deviation, slept per call; 0 median = no sleep."""

    name = NAME

    def __init__(
        self,
        max_turns: int = 32,
        latency_median_s: float = 0.0,
        latency_sigma: float = 0.0,
        seed: int | None = None,
        fixed_turns: bool = False,
    ):
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        if latency_median_s < 0 or latency_sigma < 0:
            raise ValueError("latency_median_s and latency_sigma must be >= 0")
        super().__init__()
        self.max_turns = max_turns
        self.latency_median_s = latency_median_s
        self.latency_sigma = latency_sigma
        self.fixed_turns = bool(fixed_turns)
        self._rng = random.Random(seed)
        self.errors = 0
        self._steps: list[tuple[int, str, int, int]] | None = None
        self._next = 0
        self._target_turns: int | None = None     # fixed_turns: this episode's exact number of turns

    # -- protocol -----------------------------------------------------------------------------------

    def reset(self, task: Task) -> list[dict]:
        self._begin(task)
        self.errors = 0
        self._next = 0
        start, ops = _chain_of(task)
        self._steps = tool_arith_steps(start, ops) if ops is not None else None
        self._target_turns = min(len(ops) + 1, self.max_turns) if self.fixed_turns and ops is not None else None
        return [dict(m) for m in task.prompt]

    def step(self, action_text: str) -> StepResult:
        self._check_step()
        self.turns += 1
        region = answer_region(action_text) or ""
        calls = TOOL_CALL.findall(region)
        if self._target_turns is not None:
            return self._fixed_step(action_text, calls)
        if calls:
            if self.turns >= self.max_turns:
                return self._end("length", calls=len(calls))
            tool_seconds = 0.0
            outputs = []
            for call in calls:
                started = time.monotonic()
                self._sleep_latency()
                outputs.append(self._calc(call))
                tool_seconds += time.monotonic() - started
            return StepResult(
                done=False,
                observation="\n".join(outputs),
                tool_seconds=tool_seconds,
                info={"calls": len(calls), "errors": self.errors, "turn": self.turns},
            )
        return self._answer(action_text)

    def close(self) -> None:
        self._done = True

    def grade_unfinished(self, action_text: str) -> bool | None:
        """Whether a turn cut at the token cap already held the right ``\\boxed{}`` answer (a health metric:
        the episode still ends with reward 0). None when the task has no reference answer."""
        if self.task is None or self.task.answer is None:
            return None
        boxed = extract_boxed(action_text)
        return boxed is not None and _same_answer(boxed, self.task.answer)

    # -- helpers ------------------------------------------------------------------------------------

    def _counts(self) -> dict[str, Any]:
        return {**super()._counts(), "errors": self.errors}

    def _answer(self, action_text: str | None) -> StepResult:
        """End the episode on the final turn's text: reward 1 when its ``\\boxed{}`` answer is the task's."""
        boxed = None if action_text is None else extract_boxed(action_text)
        if boxed is None:
            return self._end("stop", outcome="no_answer")
        correct = _same_answer(boxed, self.task.answer)
        return self._end("stop", reward=1.0 if correct else 0.0, outcome="match" if correct else "mismatch",
                         answer=boxed)

    def _fixed_step(self, action_text: str, calls: list[str]) -> StepResult:
        """fixed_turns mode (see the module docstring): the episode ends after exactly `_target_turns` turns."""
        if self.turns >= self._target_turns:
            return self._answer(None if calls else action_text)
        started = time.monotonic()
        expected = self._steps[self.turns - 1]
        for call in calls:
            self.calls += 1
            match = _CALC.match(call)
            if match is None or (int(match.group(1)), match.group(2), int(match.group(3))) != expected[:3]:
                self.errors += 1
        for _ in range(max(1, len(calls))):
            self._sleep_latency()
        return StepResult(done=False, observation=str(expected[3]), tool_seconds=time.monotonic() - started,
                          info={"calls": len(calls), "errors": self.errors, "turn": self.turns})

    def _sleep_latency(self) -> None:
        if self.latency_median_s <= 0:
            return
        seconds = self.latency_median_s * math.exp(self._rng.gauss(0.0, self.latency_sigma)) \
            if self.latency_sigma > 0 else self.latency_median_s
        time.sleep(seconds)

    def _calc(self, call: str) -> str:
        self.calls += 1
        match = _CALC.match(call)
        if match is None:
            self.errors += 1
            return "error: malformed call; use <tool_call>calc X op Y</tool_call> with integers X, Y and op one of + - *"
        x, op, y = int(match.group(1)), match.group(2), int(match.group(3))
        if self._steps is not None:
            if self._next >= len(self._steps):
                self.errors += 1
                return "error: every operation is already done; give the final answer"
            ex, eop, ey, result = self._steps[self._next]
            if (x, op, y) != (ex, eop, ey):
                self.errors += 1
                return "error: wrong operands; apply the next operation to the previous result (left to right)"
            self._next += 1
            return str(result)
        return str(arith_result(x, op, y))
