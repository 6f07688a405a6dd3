"""The `math_python` environment: math with a python tool, multi-turn, graded like `math`.

Each model turn is one of:

- one or more ``<tool_call>{"name": "python", "arguments": {"code": "..."}}</tool_call>`` (JSON, the
  form the chat template renders structured tool calls in; ``arguments`` may also be a JSON string):
  the code is written to a file in the episode's sandbox and run with ``python3 FILE`` under a
  per-call timeout. The observation is stdout then stderr (cut to `max_output_chars`), plus
  ``[exit status N]`` when non-zero or ``[timed out after T s]``; ``(no output)`` when empty. Invalid
  JSON, an unknown tool or missing code give an observation starting with ``error:``.
- text with a final ``\\boxed{...}`` (and no call): graded against ``task.answer`` with the math
  grader; reward 1/0, finish_reason "stop". Text with neither ends the episode with reward 0.

A sandbox failure (`SandboxError`, also from the factory) ends the episode with finish_reason
"tool_error". A turn that would call the tool when `max_turns` turns are used ends it with "length".
The sandbox is created by `sandbox_factory` on the episode's first call (an episode that answers
directly starts none) and closed by `close()`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from sao_core.envs.base import StepResult, Task
from sao_core.envs.grading import MathGrader, answer_region
from sao_core.envs.math_env import grade_final, with_system_prompt
from sao_core.envs.tool_calls import TOOL_CALL, format_exec_output, parse_tool_call
from sao_core.sandbox.base import ExecResult, Sandbox, SandboxError

NAME = "math_python"

#: The tool, as an OpenAI-style function spec (for chat templates that render a `tools` list).
PYTHON_TOOL = {
    "type": "function",
    "function": {
        "name": "python",
        "description": "Run a Python 3 program and return what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "The complete program to run."}},
            "required": ["code"],
        },
    },
}

DEFAULT_SYSTEM_PROMPT = (
    "You can run Python code: write "
    '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call> '
    "and you get back what it prints. Put the final answer in \\boxed{}."
)



def parse_python_call(body: str) -> tuple[str | None, str | None]:
    """``(code, None)`` for a valid python call body, else ``(None, error observation)``."""
    return parse_tool_call(body, "python", "code", "<program>")


def format_exec(result: ExecResult, timeout_s: float, max_chars: int) -> str:
    """The observation text of one run (status shown only when the program failed)."""
    return format_exec_output(result, timeout_s, max_chars, always_status=False)


class MathPythonEnv:
    """One math-with-python episode (see the module docstring)."""

    name = NAME
    tools = (PYTHON_TOOL,)

    def __init__(
        self,
        sandbox_factory: Callable[[], Sandbox],
        max_turns: int = 16,
        call_timeout_s: float = 10.0,
        max_output_chars: int = 4096,
        grader: MathGrader | None = None,
        grade_timeout_s: float | None = None,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        python: str = "python3",
    ):
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.sandbox_factory = sandbox_factory
        self.max_turns = max_turns
        self.call_timeout_s = call_timeout_s
        self.max_output_chars = max_output_chars
        self.grader = grader
        self.grade_timeout_s = grade_timeout_s
        self.system_prompt = system_prompt
        self.python = python
        self.sandbox: Sandbox | None = None
        self.task: Task | None = None
        self.turns = 0
        self.calls = 0
        self._done = False

    def reset(self, task: Task) -> list[dict]:
        self.close()
        self.task = task
        self.turns = self.calls = 0
        self._done = False
        return with_system_prompt(task.prompt, self.system_prompt)

    def step(self, action_text: str) -> StepResult:
        if self.task is None:
            raise RuntimeError("reset() must be called before step()")
        if self._done:
            raise RuntimeError("the episode is over")
        self.turns += 1
        calls = TOOL_CALL.findall(answer_region(action_text) or "")
        if not calls:
            self._done = True
            return grade_final(action_text, self.task, self.grader, self.grade_timeout_s,
                               turns=self.turns, calls=self.calls)
        if self.turns >= self.max_turns:
            return self._end("length", calls=len(calls))
        outputs = []
        tool_seconds = 0.0
        for body in calls:
            code, problem = parse_python_call(body.strip())
            if code is None:
                outputs.append(problem)
                continue
            started = time.monotonic()
            try:
                outputs.append(self._run(code))
            except (SandboxError, OSError) as exc:
                tool_seconds += time.monotonic() - started
                return self._end("tool_error", tool_seconds=tool_seconds, error=f"{type(exc).__name__}: {exc}")
            tool_seconds += time.monotonic() - started
        return StepResult(done=False, observation="\n".join(outputs), tool_seconds=tool_seconds,
                          info={"turn": self.turns, "calls": self.calls})

    def close(self) -> None:
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            sandbox.close()

    def _run(self, code: str) -> str:
        if self.sandbox is None:
            self.sandbox = self.sandbox_factory()
        self.calls += 1
        path = f"call_{self.calls:03d}.py"
        self.sandbox.write_file(path, code)
        result = self.sandbox.exec([self.python, path], timeout_s=self.call_timeout_s)
        return format_exec(result, self.call_timeout_s, self.max_output_chars)

    def _end(self, finish_reason: str, tool_seconds: float = 0.0, **info: Any) -> StepResult:
        self._done = True
        info.update(turns=self.turns, calls=self.calls)
        return StepResult(done=True, observation=None, reward=0.0, finish_reason=finish_reason,
                          tool_seconds=tool_seconds, info=info)
