"""`tool_arith`: a synthetic multi-turn tool task small enough for a CPU model to learn in minutes.

An episode: the user asks ``Compute A op B``; the assistant calls the calculator tool with
``<tool_call>calc A op B</tool_call>``; the tool answers; the assistant ends with ``\\boxed{N}``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

OPERATORS = ("+", "-", "*")


def arith_result(a: int, op: str, b: int) -> int:
    """Exact integer result of `a op b` for op in OPERATORS."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    raise ValueError(f"unknown operator {op!r}; expected one of {OPERATORS}")


def tool_arith_problem(rng: random.Random, max_operand: int = 99) -> tuple[int, str, int]:
    """Draw one problem (A, op, B) with 0 <= A, B <= max_operand."""
    return rng.randint(0, max_operand), rng.choice(OPERATORS), rng.randint(0, max_operand)


def tool_arith_sft_rows(count: int, seed: int = 0, max_operand: int = 99) -> Iterator[dict]:
    """Yield `count` SFT rows ``{"messages": [...]}`` of solved tool_arith episodes."""
    rng = random.Random(seed)
    for _ in range(count):
        a, op, b = tool_arith_problem(rng, max_operand)
        result = arith_result(a, op, b)
        yield {
            "messages": [
                {"role": "user", "content": f"Compute {a} {op} {b}"},
                {"role": "assistant", "content": f"<tool_call>calc {a} {op} {b}</tool_call>"},
                {"role": "tool", "content": str(result)},
                {"role": "assistant", "content": f"The answer is \\boxed{{{result}}}."},
            ]
        }
