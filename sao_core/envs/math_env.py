"""The `math` environment: one turn; the last ``\\boxed{}`` of the answer is graded against the task.

(The module is `math_env`, not `math`: a submodule named `math` becomes the attribute
``sao_core.envs.math`` and would shadow the standard library's `math` inside the package's
``__init__``.)
"""

from __future__ import annotations

from sao_core.envs.base import StepResult, Task
from sao_core.envs.episode import Episode
from sao_core.envs.grading import MathGrader, default_grader, extract_boxed

NAME = "math"


class MathEnv(Episode):
    """Single-turn math: reward 1.0 when the final boxed answer equals ``task.answer``, else 0.0.

    `grader` defaults to the process-wide shared `MathGrader`; `grade_timeout_s` overrides its
    per-answer timeout. `system_prompt`, when given, is put first unless the prompt has a system
    message already. The grade is in ``info`` (``grade``, ``detail``, ``answer``).
    """

    name = NAME

    def __init__(
        self,
        max_turns: int = 1,
        grader: MathGrader | None = None,
        grade_timeout_s: float | None = None,
        system_prompt: str | None = None,
    ):
        super().__init__()
        self.max_turns = max_turns
        self.grader = grader
        self.grade_timeout_s = grade_timeout_s
        self.system_prompt = system_prompt

    def reset(self, task: Task) -> list[dict]:
        self._begin(task)
        return with_system_prompt(task.prompt, self.system_prompt)

    def step(self, action_text: str) -> StepResult:
        self._check_step()
        self._done = True
        return grade_final(action_text, self.task, self.grader, self.grade_timeout_s, turns=1)

    def close(self) -> None:
        self._done = True

    def grade_unfinished(self, action_text: str) -> bool | None:
        """Whether a turn cut at the token cap already held the right final answer (a health metric: the
        episode still ends with reward 0). None when the task has no reference answer."""
        if self.task is None or self.task.answer is None:
            return None
        answer = extract_boxed(action_text)
        if answer is None:
            return False
        return (self.grader or default_grader()).grade(answer, self.task.answer, self.grade_timeout_s).correct


def with_system_prompt(prompt: list[dict], system_prompt: str | None) -> list[dict]:
    """A copy of `prompt`, with `system_prompt` first unless it is None or the prompt has one."""
    messages = [dict(m) for m in prompt]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def grade_final(
    action_text: str,
    task: Task,
    grader: MathGrader | None,
    timeout_s: float | None,
    **info: object,
) -> StepResult:
    """End an episode on a final answer: reward 1/0 from the grader, finish_reason "stop"."""
    answer = extract_boxed(action_text)
    if task.answer is None:
        raise ValueError(f"task {task.id} has no reference answer")
    result = (grader or default_grader()).grade(answer, task.answer, timeout_s)
    return StepResult(
        done=True,
        observation=None,
        reward=1.0 if result.correct else 0.0,
        finish_reason="stop",
        info={"grade": result.reason, "detail": result.detail, "answer": answer,
              "grade_seconds": result.seconds, **info},
    )
