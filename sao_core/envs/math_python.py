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

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

from sao_core.envs.base import StepResult, Task
from sao_core.envs.episode import Episode
from sao_core.envs.grading import MathGrader, answer_region
from sao_core.envs.math_env import grade_final, with_system_prompt
from sao_core.envs.tool_calls import TOOL_CALL, CommandTool
from sao_core.sandbox.base import Sandbox

NAME = "math_python"

#: The tool: the code is run as a file with ``python3``; a run's status is shown only when the program failed.
PYTHON = CommandTool(name="python", argument="code", placeholder="<program>",
                     description="Run a Python 3 program and return what it prints (stdout, then stderr).",
                     argument_description="The complete program to run.", always_status=False)
#: The tool, as an OpenAI-style function spec (for chat templates that render a `tools` list).
PYTHON_TOOL = PYTHON.spec()

DEFAULT_SYSTEM_PROMPT = (
    "You can run Python code: write "
    '<tool_call>{"name": "python", "arguments": {"code": "print(1 + 1)"}}</tool_call> '
    "and you get back what it prints. Put the final answer in \\boxed{}."
)


@dataclass(eq=False)   # eq=False: an episode is equal only to itself (and stays hashable)
class MathPythonEnv(Episode):
    """One math-with-python episode (see the module docstring)."""

    name: ClassVar[str] = NAME
    tools: ClassVar[tuple[dict, ...]] = (PYTHON_TOOL,)

    sandbox_factory: Callable[[], Sandbox]
    max_turns: int = 16
    call_timeout_s: float = 10.0
    max_output_chars: int = 4096
    grader: MathGrader | None = None
    grade_timeout_s: float | None = None
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    python: str = "python3"

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        super().__init__()
        self.sandbox: Sandbox | None = None

    def reset(self, task: Task) -> list[dict]:
        self.close()
        self._begin(task)
        return with_system_prompt(task.prompt, self.system_prompt)

    def step(self, action_text: str) -> StepResult:
        self._check_step()
        self.turns += 1
        calls = TOOL_CALL.findall(answer_region(action_text) or "")
        if not calls:
            self._done = True
            return grade_final(action_text, self.task, self.grader, self.grade_timeout_s,
                               turns=self.turns, calls=self.calls)
        if self.turns >= self.max_turns:
            return self._end("length", calls=len(calls))
        return self._run_tool_calls([PYTHON.parse(body.strip()) for body in calls], self._run)

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
        return PYTHON.observation(result, self.call_timeout_s, self.max_output_chars)
