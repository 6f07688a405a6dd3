"""Generated arithmetic word problems (sao_core.data.word_problems): seeded, correct, prepared as rl rows for the
math environment, clear errors for bad knobs."""

from __future__ import annotations

import json
import re

import pytest

from sao_core.data.schemas import normalize_rl
from sao_core.data.word_problems import (
    EXAMPLE,
    MAX_STEPS,
    prepare_word_problems,
    word_problem_rows,
    word_problems,
)
from sao_core.envs import make_env, task_from_row
from sao_core.envs.grading import MathGrader, extract_boxed

_NUMBER = re.compile(r"\d+")


def _solve(question: str) -> int:
    """An independent solver of the templates: reads the story's numbers and verbs, not the metadata."""
    first, _, rest = question.partition(". ")
    numbers = [int(n) for n in _NUMBER.findall(first)]
    if " boxes with " in first or " bags with " in first or " baskets with " in first or " jars with " in first:
        value = numbers[0] * numbers[1]
    elif " equal piles " in first:
        value = numbers[0] // numbers[1]
    else:
        value = numbers[0]
    story = ("" if rest.startswith("How many ") else rest.split(" How many ")[0]).rstrip(".")
    for clause in re.split(r", | and ", story) if story else []:
        n = int(_NUMBER.search(clause).group())
        if re.search(r"\b(buys|finds|gets)\b", clause):
            value += n
        elif re.search(r"\b(gives|loses|sells)\b", clause):
            value -= n
        else:
            raise AssertionError(f"unknown clause {clause!r} in {question!r}")
    return value


def test_same_seed_same_problems_other_seed_other_problems():
    a = word_problems(50, seed=7, max_operand=30, max_steps=3, operations="+-*/")
    b = word_problems(50, seed=7, max_operand=30, max_steps=3, operations="+-*/")
    c = word_problems(50, seed=8, max_operand=30, max_steps=3, operations="+-*/")
    assert a == b
    assert [p.question for p in a] != [p.question for p in c]
    assert word_problem_rows(a) == word_problem_rows(b)


@pytest.mark.parametrize("operations", ["+", "-", "+-", "*", "/", "+-*/", ("+", "*")])
def test_answers_are_correct_positive_integers(operations):
    max_steps = 1 if set(operations) <= {"*", "/"} else MAX_STEPS
    problems = word_problems(300, seed=1, max_operand=25, min_steps=1, max_steps=max_steps, operations=operations)
    for p in problems:
        assert p.answer == _solve(p.question), p.question
        assert isinstance(p.answer, int) and p.answer >= 1
        assert all(v >= 1 for v in p.values) and p.values[-1] == p.answer
        assert 1 <= p.steps <= max_steps
        assert {op for op, _ in p.ops} <= set(operations)
        stated = [int(n) for n in _NUMBER.findall(p.question)]
        assert all(1 <= n <= 25 for n in stated if n != p.start)   # the opening of a quotient is piles x share
    assert len({p.question for p in problems}) == len(problems)


def test_difficulty_knobs():
    one = word_problems(200, seed=2, max_operand=5, min_steps=1, max_steps=1)
    assert {p.steps for p in one} == {1}
    assert max(p.answer for p in one) <= 10
    many = word_problems(200, seed=2, max_operand=50, min_steps=2, max_steps=3)
    assert {p.steps for p in many} == {2, 3}
    assert max(p.answer for p in many) > 50


def test_exclude_keeps_sets_apart():
    held_out = word_problems(64, seed=1, max_operand=10, max_steps=1)
    train = word_problems(500, seed=2, max_operand=10, max_steps=1, exclude=[p.question for p in held_out])
    assert not {p.question for p in held_out} & {p.question for p in train}


def test_rows_validate_and_grade_in_the_math_env(tmp_path):
    problems = word_problems(40, seed=3, max_operand=12, max_steps=2, operations="+-*/")
    rows = word_problem_rows(problems, id_prefix="t")
    for row, p in zip(rows, problems, strict=True):
        record = normalize_rl(row, ("math",))
        assert record["env"] == "math" and record["answer"] == str(p.answer) and record["id"] == row["id"]
        assert record["prompt"][:2] == list(EXAMPLE) and "\\boxed{}" in record["prompt"][-1]["content"]
        assert record["metadata"]["question"] == p.question
    bare = word_problem_rows(problems[:1], example=False, system_prompt="Be brief.")[0]["prompt"]
    assert [m["role"] for m in bare] == ["system", "user"]

    stats = prepare_word_problems(tmp_path / "rl", rows)
    assert stats.rows_written == 40 and stats.rows_rejected == 0 and stats.duplicates == 0
    assert (tmp_path / "rl.source.jsonl").exists()
    prepared = [json.loads(x) for x in (tmp_path / "rl" / "data.jsonl").read_text().splitlines()]
    task = task_from_row(prepared[0])
    env = make_env(task.env)
    with MathGrader(max_workers=1) as grader:
        env.grader = grader
        env.reset(task)
        right = env.step(f"{problems[0].start} ... The answer is \\boxed{{{problems[0].answer}}}.")
        assert right.reward == 1.0 and right.info["grade"] == "match"
        env.reset(task)
        assert env.step(f"The answer is {problems[0].answer}.").reward == 0.0       # no box: not graded as right
        env.reset(task)
        assert env.step(f"\\boxed{{{problems[0].answer + 1}}}").reward == 0.0
    assert extract_boxed("5 + 3 = 8. The answer is \\boxed{8}.") == "8"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_operand": 1}, "max_operand must be >= 2"),
    ({"max_operand": 5.5}, "max_operand must be an integer"),
    ({"min_steps": 0}, "1 <= min_steps <= max_steps"),
    ({"min_steps": 3, "max_steps": 2}, "1 <= min_steps <= max_steps"),
    ({"max_steps": MAX_STEPS + 1}, "1 <= min_steps <= max_steps"),
    ({"operations": "+x"}, "operations must be a non-empty selection"),
    ({"operations": ""}, "operations must be a non-empty selection"),
    ({"operations": "*", "max_steps": 2}, "needs '+' or '-'"),
    ({"count": -1}, "count must be an integer >= 0"),
    ({"count": 5000, "max_operand": 2, "max_steps": 1, "operations": "+"}, "too few different problems"),
])
def test_bad_knobs_raise_clear_errors(kwargs, message):
    kwargs = {"count": 5, **kwargs}
    with pytest.raises(ValueError, match=re.escape(message)):
        word_problems(**kwargs)


def test_rows_need_a_boxed_instruction():
    with pytest.raises(ValueError, match="boxed"):
        word_problem_rows(word_problems(1), instruction="Answer briefly.")
