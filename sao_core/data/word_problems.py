"""Generated arithmetic word problems with exact integer answers, as ``rl`` rows for the ``math`` environment.

A problem is a short templated English story about one person's things, one to `MAX_STEPS` arithmetic
operations long, ending in one question whose answer is a positive integer::

    Mia has 7 apples. She buys 5 more and gives 3 to Leo. How many apples does Mia have now?

The story starts either from a plain count (``Mia has 7 apples.``), from a product (``Mia has 4 boxes
with 6 apples in each.``, one multiplication) or from a quotient (``Mia puts 24 apples into 4 equal
piles and keeps one pile.``, one division); every later operation is an addition (``buys 5 more``) or a
subtraction (``gives 3 to Leo``). Every intermediate count stays >= 1, so the story never gives away
more than the person has.

Difficulty knobs: `max_operand` (each number the story states is in ``[1, max_operand]``; opening
counts, factors and divisors in ``[2, max_operand]``), `min_steps` / `max_steps` (operations per problem, drawn uniformly)
and `operations` (which of ``+ - * /`` may appear). Generation is seeded (`random.Random`): the same
arguments give the same problems, in the same order.

:func:`word_problem_rows` turns problems into rows of the prepared ``rl`` kind
(`sao_core.data.schemas.normalize_rl`: ``id, prompt, env="math", answer, metadata``); the prompt asks
for the final answer in ``\\boxed{}``, which the ``math`` environment grades (a plain integer in the
box is matched as identical text). :func:`prepare_word_problems` writes them through
`sao_core.data.prepare.prepare`, the same path as every other dataset.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sao_core.data.synthetic import arith_result

OPERATIONS = ("+", "-", "*", "/")
MAX_STEPS = 4
_MAX_MISSES = 5000

#: The instruction after every question.
INSTRUCTION = "Write the final answer in \\boxed{}."

#: A solved example shown before the question (a user turn and the assistant's reply) when rows are made with
#: ``example=True``: SmolLM2-135M-Instruct asked the bare question writes a long story and almost never a
#: filled box (0 of 32 correct, greedy); after this one short worked answer it writes ``a + b = c. The answer
#: is \\boxed{c}.`` (boxed 95 %, correct 50 % on one-step problems, greedy).
EXAMPLE = ({"role": "user", "content": "Tom has 4 pens. He buys 3 more and gives 2 to Ann. How many pens does Tom "
                                       "have now? " + INSTRUCTION},
           {"role": "assistant", "content": "4 + 3 - 2 = 5. The answer is \\boxed{5}."})

# (name, subject pronoun, object pronoun)
_PEOPLE = (("Mia", "She", "her"), ("Ava", "She", "her"), ("Emma", "She", "her"), ("Zoe", "She", "her"),
           ("Lily", "She", "her"), ("Sara", "She", "her"), ("Leo", "He", "him"), ("Noah", "He", "him"),
           ("Liam", "He", "him"), ("Omar", "He", "him"), ("Ben", "He", "him"), ("Tom", "He", "him"))
_ITEMS = ("apples", "marbles", "stickers", "pencils", "books", "shells", "cards", "stamps", "cookies", "toy cars")
_CONTAINERS = ("boxes", "bags", "baskets", "jars")
# Later operations as verb phrases after the subject pronoun ({n}: the number, {friend}: another person).
_ADD = ("buys {n} more", "finds {n} more", "gets {n} more from {friend}")
_SUB = ("gives {n} to {friend}", "loses {n}", "sells {n}")


@dataclass(frozen=True)
class WordProblem:
    """One problem: its text, its answer and how it was built.

    `start` is the opening count, `ops` the operations applied to it left to right as
    ``(operator, operand)``; a product or quotient opening is the first entry of `ops` (``("*", b)``:
    `start` groups of `b`; ``("/", b)``: `start` shared into `b` piles). `answer` is the result (an
    integer >= 1); `values` the count after each operation."""

    question: str
    answer: int
    start: int
    ops: tuple[tuple[str, int], ...]
    values: tuple[int, ...]
    template: dict[str, str] = field(default_factory=dict)

    @property
    def steps(self) -> int:
        return len(self.ops)


def _apply(value: int, op: str, operand: int) -> int:
    """`value op operand` for op in OPERATIONS; division must be exact."""
    if op == "/":
        if operand == 0 or value % operand:
            raise ValueError(f"{value} / {operand} is not an exact integer division")
        return value // operand
    if op not in OPERATIONS:
        raise ValueError(f"unknown operation {op!r}; expected one of {' '.join(OPERATIONS)}")
    return arith_result(value, op, operand)


def check_knobs(max_operand: int, min_steps: int, max_steps: int, operations: Iterable[str]) -> tuple[str, ...]:
    """Validate the difficulty knobs; returns the operations as a tuple. Raises ValueError saying which
    knob is wrong and why."""
    for name, value in (("max_operand", max_operand), ("min_steps", min_steps), ("max_steps", max_steps)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if max_operand < 2:
        raise ValueError(f"max_operand must be >= 2 (numbers are drawn from [1, max_operand]), got {max_operand}")
    if not 1 <= min_steps <= max_steps <= MAX_STEPS:
        raise ValueError(f"need 1 <= min_steps <= max_steps <= {MAX_STEPS}, got min_steps={min_steps}, "
                         f"max_steps={max_steps}")
    if isinstance(operations, str):
        operations = tuple(operations)
    ops = tuple(operations)
    unknown = sorted(set(ops) - set(OPERATIONS))
    if unknown or not ops:
        raise ValueError(f"operations must be a non-empty selection of {' '.join(OPERATIONS)}, got {ops!r}")
    additive = any(o in ops for o in "+-")
    if not additive and max_steps > 1:
        raise ValueError(f"max_steps={max_steps} needs '+' or '-' in operations: only the opening can be a "
                         "product or quotient, every later step adds or subtracts")
    if not additive and min_steps != 1:
        raise ValueError("operations without '+' or '-' allow only one-step problems (min_steps=max_steps=1)")
    return tuple(dict.fromkeys(ops))


def _draw(rng: random.Random, steps: int, max_operand: int, ops: tuple[str, ...]) -> WordProblem | None:
    """One attempt at a problem of exactly `steps` operations; None when the draw cannot be completed
    (e.g. subtraction only and the count is already 1)."""
    name, subject, _ = rng.choice(_PEOPLE)
    friend = rng.choice([p for p in _PEOPLE if p[0] != name])[0]
    items = rng.choice(_ITEMS)
    openings = (["plain"] if any(o in ops for o in "+-") else []) + \
        [kind for kind, op in (("product", "*"), ("quotient", "/")) if op in ops]
    opening = rng.choice(openings)
    applied: list[tuple[str, int]] = []
    values: list[int] = []
    if opening == "product":
        start, factor = rng.randint(2, max_operand), rng.randint(2, max_operand)
        container = rng.choice(_CONTAINERS)
        text = f"{name} has {start} {container} with {factor} {items} in each."
        applied.append(("*", factor))
        values.append(start * factor)
    elif opening == "quotient":
        piles, share = rng.randint(2, max_operand), rng.randint(1, max_operand)
        start = piles * share
        text = f"{name} puts {start} {items} into {piles} equal piles and keeps one pile."
        applied.append(("/", piles))
        values.append(share)
    else:
        start = rng.randint(2, max_operand)  # >= 2: "has 1 apples" reads wrong
        text = f"{name} has {start} {items}."
        values.append(start)
    clauses = []
    while len(applied) < steps:
        value = values[-1]
        choices = [o for o in "+-" if o in ops and (o == "+" or value >= 2)]
        if not choices:
            return None
        op = rng.choice(choices)
        operand = rng.randint(1, max_operand if op == "+" else min(max_operand, value - 1))
        phrase = rng.choice(_ADD if op == "+" else _SUB)
        clauses.append(phrase.format(n=operand, friend=friend))
        applied.append((op, operand))
        values.append(_apply(value, op, operand))
    if opening == "plain":
        values = values[1:]  # the opening count is `start`, not an operation's result
    if clauses:
        joined = clauses[0] if len(clauses) == 1 else ", ".join(clauses[:-1]) + " and " + clauses[-1]
        text += f" {subject} {joined}."
    text += f" How many {items} does {name} have now?"
    return WordProblem(question=text, answer=values[-1], start=start, ops=tuple(applied), values=tuple(values),
                       template={"name": name, "friend": friend, "items": items, "opening": opening})


def word_problems(count: int, seed: int = 0, max_operand: int = 20, min_steps: int = 1, max_steps: int = 2,
                  operations: Iterable[str] = ("+", "-"), exclude: Iterable[str] = ()) -> list[WordProblem]:
    """`count` distinct problems (no two with the same question, none whose question is in `exclude`),
    drawn with ``random.Random(seed)``. Raises ValueError for bad knobs, or when the knobs allow too few
    distinct problems to draw `count` of them."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"count must be an integer >= 0, got {count!r}")
    ops = check_knobs(max_operand, min_steps, max_steps, operations)
    rng = random.Random(seed)
    seen = set(exclude)
    out: list[WordProblem] = []
    misses = 0                      # draws in a row that gave no new problem
    while len(out) < count:
        if misses >= _MAX_MISSES:
            raise ValueError(f"drew only {len(out)} distinct problems of the {count} asked for ({_MAX_MISSES} draws in "
                             "a row gave no new one): the knobs (max_operand, steps, operations) allow too few "
                             "different problems")
        problem = _draw(rng, rng.randint(min_steps, max_steps), max_operand, ops)
        if problem is None or problem.question in seen:
            misses += 1
            continue
        misses = 0
        seen.add(problem.question)
        out.append(problem)
    return out


def word_problem_rows(problems: Iterable[WordProblem], id_prefix: str = "wp", instruction: str = INSTRUCTION,
                      example: bool = True, system_prompt: str | None = None) -> list[dict[str, Any]]:
    """Raw ``rl`` rows (see `sao_core.data.schemas.normalize_rl`) for the ``math`` environment: the question
    and `instruction` as the last user message, after the solved `EXAMPLE` turn (``example=True``) and after
    `system_prompt` as a system message (when given); the answer as text; how the problem was built in
    ``metadata``. Ids are ``<id_prefix>-<index>``."""
    if not isinstance(instruction, str) or "\\boxed" not in instruction:
        raise ValueError("instruction must ask for the final answer in \\boxed{} (the math environment grades "
                         f"the last box), got {instruction!r}")
    rows = []
    for i, p in enumerate(problems):
        prompt = [dict(m) for m in EXAMPLE] if example else []
        prompt.append({"role": "user", "content": f"{p.question} {instruction}".strip()})
        if system_prompt:
            prompt.insert(0, {"role": "system", "content": system_prompt})
        rows.append({"id": f"{id_prefix}-{i:05d}", "prompt": prompt, "env": "math", "answer": str(p.answer),
                     "metadata": {"question": p.question, "start": p.start, "ops": [list(o) for o in p.ops],
                                  "values": list(p.values), "steps": p.steps, **p.template}})
    return rows


def prepare_word_problems(output: str | Path, rows: list[dict[str, Any]]):
    """Write `rows` as a prepared ``rl`` dataset in the folder `output` (``data.jsonl``, ``rejects.jsonl``,
    ``stats.json``) through `sao_core.data.prepare.prepare`; the raw rows are kept next to it as
    ``<output>.source.jsonl``. Returns the `PrepareStats`."""
    from sao_core.data.prepare import PrepareConfig, prepare

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    source = output.parent / f"{output.name}.source.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return prepare(PrepareConfig(source=str(source), kind="rl", output=str(output), max_reject_fraction=0.0))
