"""Environments: the registry (`ENVIRONMENTS`, `make_env`) and `task_from_row` for prepared rl rows.

Environment modules are imported on demand, so importing this package is cheap (the math grader's
spawned workers import it too) and an environment whose module is missing or broken fails only
when it is asked for.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sao_core.envs.base import FINISH_REASONS, Environment, StepResult, Task

ENVIRONMENTS: tuple[str, ...] = ("math", "math_python", "swe", "tool_arith")

__all__ = ["ENVIRONMENTS", "FINISH_REASONS", "Environment", "StepResult", "Task", "make_env", "task_from_row"]


def make_env(name: str, **options: Any) -> Environment:
    """A new environment for one episode: `name` is one of ENVIRONMENTS; `options` go to its class.

    - ``math``: `MathEnv` (grader, grade_timeout_s, system_prompt).
    - ``math_python``: `MathPythonEnv` (sandbox_factory, max_turns, call_timeout_s, ...); without a
      `sandbox_factory`, each episode gets a `LocalSandbox` with `sandbox_limits` (default limits).
    - ``swe``: `SWEEnv` from `sao_core.envs.swe`.
    - ``tool_arith``: `ToolArithEnv` (max_turns, latency_median_s, latency_sigma, seed, fixed_turns).
    """
    if name == "math":
        from sao_core.envs.math_env import MathEnv

        return MathEnv(**options)
    if name == "math_python":
        from sao_core.envs.math_python import MathPythonEnv

        if options.get("sandbox_factory") is None:
            options["sandbox_factory"] = _local_sandbox_factory(options.pop("sandbox_limits", None))
        else:
            options.pop("sandbox_limits", None)
        return MathPythonEnv(**options)
    if name == "swe":
        from sao_core.envs.swe import SWEEnv

        return SWEEnv(**options)
    if name == "tool_arith":
        from sao_core.envs.tool_arith import ToolArithEnv

        return ToolArithEnv(**options)
    raise ValueError(f"unknown environment {name!r}; expected one of: {', '.join(ENVIRONMENTS)}")


def _local_sandbox_factory(limits: Any = None):
    from sao_core.sandbox.base import SandboxLimits
    from sao_core.sandbox.local import LocalSandbox

    chosen = limits if limits is not None else SandboxLimits()
    return lambda: LocalSandbox(chosen)


def task_from_row(row: Mapping[str, Any]) -> Task:
    """A Task from a prepared ``rl`` row (`sao_core.data.schemas.normalize_rl`: id, prompt, env,
    answer, tests, metadata). A string prompt becomes one user message; numbers in ``answer`` become
    text. Raises ValueError for a row without id, env or prompt, or with a malformed one."""
    if not isinstance(row, Mapping):
        raise ValueError(f"an rl row must be a mapping, got {type(row).__name__}")
    missing = [key for key in ("id", "env", "prompt") if row.get(key) is None]
    if missing:
        raise ValueError(f"rl row lacks {', '.join(missing)}")
    env = str(row["env"]).strip()
    prompt = row["prompt"]
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt or not all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) for m in prompt
    ):
        raise ValueError(f"rl row {row['id']!r}: prompt must be a non-empty list of chat messages")
    answer = row.get("answer")
    if answer is not None and not isinstance(answer, str):
        if isinstance(answer, bool):
            raise ValueError(f"rl row {row['id']!r}: answer must be text or a number")
        answer = str(answer)
    tests = row.get("tests")
    if tests is not None:
        if isinstance(tests, str) or not all(isinstance(t, str) for t in tests):
            raise ValueError(f"rl row {row['id']!r}: tests must be a list of strings")
        tests = list(tests)
    metadata = row.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise ValueError(f"rl row {row['id']!r}: metadata must be an object")
    return Task(
        id=str(row["id"]),
        env=env,
        prompt=[dict(m) for m in prompt],
        answer=answer,
        tests=tests,
        metadata=dict(metadata),
    )
