"""`tool_arith`: a synthetic multi-turn tool task small enough for a CPU model to learn in minutes.

An episode: the user asks ``Compute A op B``; the assistant calls the calculator tool with
``<tool_call>calc A op B</tool_call>``; the tool answers; the assistant ends with ``\\boxed{N}``.

Chains: ``Compute A op1 B op2 C ... (left to right)`` means ``((A op1 B) op2 C) ...``; the assistant
calls the calculator once per operation, each time on the previous result:
``calc A op1 B`` -> R1, ``calc R1 op2 C`` -> R2, ... and ends with ``\\boxed{R_last}``. The number of
operations is ``1 + Geometric(p_more)`` (long-tailed, mean ``1 / p_more``), capped at ``max_ops``.
One operation is exactly the ``Compute A op B`` form above.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator, Sequence

OPERATORS = ("+", "-", "*")

#: Appended to the prompt of chains with more than one operation (a 1-operation prompt has no suffix).
LEFT_TO_RIGHT = " (left to right)"


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


Chain = tuple[int, list[tuple[str, int]]]  # (start, [(op, operand), ...])


def tool_arith_num_ops(rng: random.Random, p_more: float = 0.2, max_ops: int = 30) -> int:
    """``1 + K`` with K ~ Geometric(p_more) (failures before the first success), capped at max_ops."""
    if not 0.0 < p_more <= 1.0:
        raise ValueError(f"p_more must be in (0, 1], got {p_more}")
    if max_ops < 1:
        raise ValueError(f"max_ops must be >= 1, got {max_ops}")
    n = 1
    while n < max_ops and rng.random() >= p_more:
        n += 1
    return n


def tool_arith_chain(
    rng: random.Random,
    max_operand: int = 99,
    p_more: float = 0.2,
    max_ops: int = 30,
    max_value: int | None = None,
) -> Chain:
    """Draw a chain ``(start, [(op, operand), ...])`` of ``1 + Geometric(p_more)`` operations.

    Operands are in ``[0, max_operand]``. Intermediate results stay within ``±max_value`` (default
    ``max_operand ** 2``, so the first operation is never constrained): an operator that would leave
    that range is not drawn (subtraction or addition always stays inside it).
    """
    limit = max_operand**2 if max_value is None else max_value
    if limit < max_operand:
        raise ValueError(f"max_value ({limit}) must be >= max_operand ({max_operand})")
    n = tool_arith_num_ops(rng, p_more, max_ops)
    a, op, b = tool_arith_problem(rng, max_operand)
    ops = [(op, b)]
    value = arith_result(a, op, b)
    for _ in range(n - 1):
        b = rng.randint(0, max_operand)
        allowed = [o for o in OPERATORS if abs(arith_result(value, o, b)) <= limit]
        op = rng.choice(allowed)
        ops.append((op, b))
        value = arith_result(value, op, b)
    return a, ops


def tool_arith_steps(start: int, ops: Sequence[tuple[str, int]]) -> list[tuple[int, str, int, int]]:
    """The calculator calls that solve a chain: ``[(x, op, y, x op y), ...]`` left to right."""
    steps = []
    value = start
    for op, operand in ops:
        result = arith_result(value, op, operand)
        steps.append((value, op, operand, result))
        value = result
    return steps


def tool_arith_value(start: int, ops: Sequence[tuple[str, int]]) -> int:
    """The left-to-right result of a chain."""
    value = start
    for op, operand in ops:
        value = arith_result(value, op, operand)
    return value


def tool_arith_prompt(start: int, ops: Sequence[tuple[str, int]]) -> str:
    """``Compute A op B`` for one operation; ``Compute A op B op C ... (left to right)`` for more."""
    text = "Compute " + " ".join([str(start)] + [f"{op} {operand}" for op, operand in ops])
    return text + (LEFT_TO_RIGHT if len(ops) > 1 else "")


_PROMPT = re.compile(r"^\s*Compute\s+(-?\d+)((?:\s*[-+*]\s*-?\d+)+)\s*(?:\(left to right\))?\s*$")
_PROMPT_OP = re.compile(r"([-+*])\s*(-?\d+)")


def parse_tool_arith_prompt(text: str) -> Chain | None:
    """Inverse of `tool_arith_prompt` (also accepts ``Compute 3*4``); None if `text` is not one."""
    match = _PROMPT.match(text)
    if match is None:
        return None
    ops = [(op, int(num)) for op, num in _PROMPT_OP.findall(match.group(2))]
    return int(match.group(1)), ops


def tool_arith_messages(start: int, ops: Sequence[tuple[str, int]]) -> list[dict]:
    """A solved conversation: the prompt, one calculator call and result per operation, the answer."""
    messages: list[dict] = [{"role": "user", "content": tool_arith_prompt(start, ops)}]
    result = start
    for x, op, y, result in tool_arith_steps(start, ops):
        messages.append({"role": "assistant", "content": f"<tool_call>calc {x} {op} {y}</tool_call>"})
        messages.append({"role": "tool", "content": str(result)})
    messages.append({"role": "assistant", "content": f"The answer is \\boxed{{{result}}}."})
    return messages


def tool_arith_sft_rows(
    count: int,
    seed: int = 0,
    max_operand: int = 99,
    p_more: float | None = None,
    max_ops: int = 30,
) -> Iterator[dict]:
    """Yield `count` SFT rows ``{"messages": [...]}`` of solved tool_arith episodes.

    By default (``p_more=None``) every row is a single ``Compute A op B`` problem with one calculator
    call (the same rows for the same seed as always). With `p_more` set, rows are chains of
    ``1 + Geometric(p_more)`` operations (at most `max_ops`), solved with one call per operation.
    """
    rng = random.Random(seed)
    for _ in range(count):
        if p_more is None:
            a, op, b = tool_arith_problem(rng, max_operand)
            yield {"messages": tool_arith_messages(a, [(op, b)])}
        else:
            start, ops = tool_arith_chain(rng, max_operand, p_more, max_ops)
            yield {"messages": tool_arith_messages(start, ops)}
