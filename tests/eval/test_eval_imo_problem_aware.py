"""Problem-aware exact rules for IMO-AnswerBench (issue 39, parts 1 and 3): named tuples are placed in the
order the problem declares (``Find all triples $(n, x, y)$``), never matched by the answer's own order of
values; set comparisons and their witnesses stay inside the variable's declared domain (``positive
integers $n$``: 0 proves nothing).

- tests/data/eval/imo_named_and_domain_forms.json: hand-written (problem, gold, answer, expected) pairs,
  each one parametrized case of `compare(answer, gold, problem=...)`.
- unit tests of the two readers of the problem text (`declared_order`, `declared_domain`).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sao_core.envs.exact import MATCH, MISMATCH, UNSETTLED, compare
from sao_core.envs.exact_forms import Domain, declared_domain, declared_order

DATA = Path(__file__).parents[1] / "data" / "eval"
PAIRS = json.loads((DATA / "imo_named_and_domain_forms.json").read_text())["pairs"]
ISSUE = "Find all triples $(n,x,y)$ where $n\\ge 2$ is a positive integer and $x,y$ are rational numbers."


def test_the_pairs_cover_every_kind():
    kinds = Counter(p["category"] for p in PAIRS)
    expected = Counter(p["expected"] for p in PAIRS)
    assert len(PAIRS) >= 25 and min(kinds.values()) >= 3, kinds
    assert set(expected) == {MATCH, MISMATCH, UNSETTLED}, expected


@pytest.mark.parametrize("pair", PAIRS, ids=[f"{p['category']}: {p['answer']} for {p['gold']}" for p in PAIRS])
def test_hand_written_pair(pair):
    o = compare(pair["answer"], pair["gold"], problem=pair["problem"])
    assert o.grade == pair["expected"], (pair["why"], o)


def test_without_the_problem_a_named_answer_is_never_accepted_on_its_own_order():
    """The issue's failures: values matched in order although the names contradict the problem."""
    for answer, gold in [("(x,n,y)=(2,\\frac{1}{2},\\frac{9}{4})", "(2, \\frac12, \\frac94)"),
                         ("(a,p,b)=(3,2,5)", "(3,2,5)"), ("(c,b,a)=(2,251,252)", "(2,251,252)"),
                         ("(z,y,x)=(1,2,3)", "(1,2,3)")]:
        o = compare(answer, gold)
        assert (o.grade, o.rule) == (UNSETTLED, "named-tuple"), o
    o = compare("(x,n,y)=(2,\\frac{1}{2},\\frac{9}{4})", "(2, \\frac12, \\frac94)", problem=ISSUE)
    assert o.grade == MISMATCH, o
    o = compare("(x,n,y)=(\\frac{1}{2},2,\\frac{9}{4})", "(2, \\frac12, \\frac94)", problem=ISSUE)
    assert o.grade == MATCH, o


def test_an_unnamed_answer_against_a_named_reference_takes_the_problems_order():
    problem = "Find all ordered triples $(p, a, b)$ of a prime $p$ and positive integers $a, b$."
    assert compare("(3, 2, 5)", "(a,b,p)=(2,5,3)", problem=problem).grade == MATCH
    assert compare("(2, 5, 3)", "(a,b,p)=(2,5,3)", problem=problem).grade == MISMATCH
    assert compare("(2, 5, 3)", "(a,b,p)=(2,5,3)").grade == UNSETTLED


def test_the_grader_passes_the_problem_text(imo):
    answer, gold = "(x,n,y)=(2,\\frac{1}{2},\\frac{9}{4})", "(2, \\frac12, \\frac94)"
    v = imo.grade(answer, gold, {"problem": ISSUE})
    assert (v.correct, v.grade, v.extra["rule"]) == (False, "mismatch", "named-tuple"), v
    v = imo.grade("(x,n,y)=(\\frac{1}{2},2,\\frac{9}{4})", gold, {"problem": ISSUE})
    assert (v.correct, v.grade) == (True, "match"), v
    v = imo.rule(answer, gold)                      # no problem text: never accepted
    assert (v.correct, v.grade) == (False, "unsettled"), v
    v = imo.grade("n \\neq 2", "$n=1, n \\ge 3$", {"problem": "Find all positive integers $n$ such that ..."})
    assert (v.correct, v.grade) == (True, "match"), v


# ------------------------------------------------------------------------------------------ readers

@pytest.mark.parametrize("problem,names,order", [
    (ISSUE, ("x", "n", "y"), ("n", "x", "y")),
    ("Find all ordered pairs $(a,b)$ of integers", ("b", "a"), ("a", "b")),
    ("Find all triples (p, a, b) with p prime", ("a", "b", "p"), ("p", "a", "b")),
    ("Determine all $\\left(q, r, s\\right)$", ("s", "q", "r"), ("q", "r", "s")),
    ("pairs $(x_1, x_2)$ of reals", ("x_{2}", "x_1"), ("x_1", "x_2")),
    ("Let $f(x, y) = x - y$. Find all pairs $(y, x)$ with", ("x", "y"), ("y", "x")),   # f(x, y): arguments
    ("Find all pairs $(a, b)$ and triples $(a, b, c)$", ("c", "b", "a"), ("a", "b", "c")),  # the arity decides
    ("Find all triples $(u, v, w)$", ("a", "b", "c"), None),             # other names
    ("Let $f(x, y) = x - y$. Find all x and y.", ("x", "y"), None),     # only a function's arguments
    ("Solve it.", ("x", "y"), None),
    (None, ("x", "y"), None),
    ("Find all pairs $(a, a)$", ("a", "a"), None),                      # repeated names
])
def test_declared_order(problem, names, order):
    assert declared_order(problem, names) == order


@pytest.mark.parametrize("problem,var,domain", [
    ("Find all positive integers $n$ such that", "n", Domain("Z", 1)),
    ("Find all integers $n$ such that", "n", Domain("Z")),
    ("Find all nonnegative integers $k$", "k", Domain("Z", 0)),
    ("Find all natural numbers $n$", "n", Domain("Z", 1, zero_maybe=True)),
    ("Let $p$ be an odd prime.", "p", Domain("P", 3)),
    ("Find all primes $p$ and $q$ such that", "q", Domain("P", 2)),
    ("Find all pairs of positive integers $(a, b)$ with", "b", Domain("Z", 1)),
    ("Find all $n \\in \\mathbb{Z}^+$ with", "n", Domain("Z", 1)),
    ("Find all $n \\in \\mathbb N$ with", "n", Domain("Z", 1, zero_maybe=True)),
    ("Find all real numbers $x$ such that", "x", Domain("R")),
    ("Find all positive real $c$ such that", "c", Domain("R", 0, open_below=True)),
    (ISSUE, "n", Domain("Z", 2)),                                       # the type after it, and n >= 2
    ("Let $n \\geq 3$ be an integer.", "n", Domain("Z", 3)),
    ("positive integers $x, n, k$ with $x > n \\ge 2$", "x", Domain("Z", 1)),  # x > n: no number, no bound
    ("positive integers $x, n, k$ with $x > n \\ge 2$", "n", Domain("Z", 2)),
    ("For $1 \\le m \\le 100$ find all m", "m", Domain("", 1)),           # a bound only: the type unsaid
    ("Find all $n$ with $x^2 \\leq n$", "n", None),                     # x^2 is not a number
    ("Find all positive integers $n$", "m", None),                      # another variable
    ("Find all negative integers $n$", "n", None),                      # not a range from a least value
    ("Find all rational $x$", "x", None),
    (None, "n", None),
])
def test_declared_domain(problem, var, domain):
    assert declared_domain(problem, var) == domain
