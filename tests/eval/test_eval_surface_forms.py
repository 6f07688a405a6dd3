"""Issue 39, parts 2 and 4: function values in relations are labelled quantities, not products
(``\\tau(-1) \\le 0`` says τ(-1) ≤ 0, not τ ≥ 0), and surface forms are normalised once in the parser
(`sao_core.envs.exact_values.surface` / `clean`) for every benchmark: control spaces, style switches, group
braces, a trailing ``only``, degree words, percent signs, ellipsis commands, BeyondAIME boxed variants.

tests/data/eval/imo_function_and_surface_forms.json holds hand-written pairs with the expected grade: the
exact rules' (`compare`) for IMO-AnswerBench pairs, the integer grader's for BeyondAIME ones.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from sao_core.envs.exact import MATCH, compare, tokenize
from sao_core.envs.exact_values import applied_name, clean, relation_side, surface
from sao_core.envs.grading import extract_boxed
from sao_core.eval.graders import IntegerGrader, parse_integer

DATA = Path(__file__).parents[1] / "data" / "eval" / "imo_function_and_surface_forms.json"
PAIRS = json.loads(DATA.read_text())["pairs"]
IMO = [p for p in PAIRS if p.get("benchmark") != "beyond_aime"]
AIME = [p for p in PAIRS if p.get("benchmark") == "beyond_aime"]


def _id(pair: dict) -> str:
    return f"{pair['class']}:{pair['answer']}|{pair['gold']}"


def test_the_cases_cover_every_class_with_true_and_wrong_forms():
    assert len(PAIRS) >= 25
    classes = Counter(p["class"] for p in PAIRS)
    assert set(classes) >= {"function-value", "surface", "only", "degrees", "percent", "ellipsis", "beyond-aime"}
    for name in classes:
        grades = {p["expected"] for p in PAIRS if p["class"] == name}
        assert "match" in grades and grades & {"mismatch", "unparseable"}, (name, grades)


@pytest.mark.parametrize("pair", IMO, ids=_id)
def test_imo_pairs_get_the_expected_grade(pair):
    o = compare(pair["answer"], pair["gold"])
    assert o.grade == pair["expected"], (pair["note"], o)


@pytest.mark.parametrize("pair", AIME, ids=_id)
def test_beyond_aime_boxed_variants(pair):
    v = IntegerGrader().grade(extract_boxed(pair["answer"]), pair["gold"])
    assert v.grade == pair["expected"], (pair["note"], v)
    assert v.correct == (pair["expected"] == "match")


def test_the_rule_grader_accepts_the_true_forms_and_no_wrong_one(imo):
    accepted_wrong, missed = [], []
    for p in IMO:
        v = imo.rule(p["answer"], p["gold"])
        if v.correct and p["expected"] != MATCH:
            accepted_wrong.append((p["gold"], p["answer"], v.grade, v.detail))
        if not v.correct and p["expected"] == MATCH:
            missed.append((p["gold"], p["answer"], v.grade, v.detail))
    assert accepted_wrong == [] and missed == []


# ------------------------------------------------------------------------------------------ the normaliser

@pytest.mark.parametrize("text,expected", [
    ("\\displaystyle 123", "123"), ("\\textstyle\\frac{1}{2}", "\\frac{1}{2}"), ("{{123}}", "123"),
    ("{ {7} }", "7"), ("3 \\text{ only}", "3"), ("2, 5 only", "2, 5"), ("x = 4 \\text{only}.", "x = 4"),
    ("only", "only"),                                  # a lone word stays a word
    ("\\{1, 2\\}", "\\{1, 2\\}"),                      # set braces are not a group
    ("{a}^{2}", "{a}^{2}"),                            # the first brace does not close at the end
    ("{1}{2}", "{1}{2}"),
])
def test_surface(text, expected):
    assert surface(text) == expected


@pytest.mark.parametrize("text,expected", [
    ("Q(x)=2(x-1),\\ Q(x)=-2", "Q(x)=2(x-1), Q(x)=-2"),          # control space
    ("2\\;\\sqrt{2}", "2 \\sqrt{2}"), ("2\\!x", "2 x"), ("5,~7", "5, 7"), ("a \\, b", "a b"),
    ("\\{1,2,\\cdots,1235\\}", "\\{1,2,\\ldots,1235\\}"), ("1,\\dots,n", "1,\\ldots,n"), ("1,\\dotsc,n", "1,\\ldots,n"),
    ("1, 2, …, n", "1, 2, \\ldots, n"), ("x \\cdot y", "x * y"),     # \cdot is still a product
    ("72 \\text{ degrees}", "72^\\circ"), ("72 degree", "72^\\circ"), ("(a+b) degrees", "(a+b)^\\circ"),
    ("96%", "96\\%"), ("96\\%", "96\\%"),
    ("\\displaystyle{{3}}", "3"), ("$\\textstyle 3 \\text{ only}$.", "3"),
    ("a\\\\ b", "a\\\\ b"),                                           # a line break is not a control space
    ("\\dfrac{1}{2} \\neq x", "\\frac{1}{2} \\ne x"), ("x \\leqslant 1", "x \\leq 1"),
])
def test_clean(text, expected):
    assert clean(text) == expected


@pytest.mark.parametrize("text,name", [
    ("\\tau(-1)", "\\tau(-1)"), ("P(0)", "P(0)"), ("f_1(x)", "f_1(x)"), ("g_{ab}(2)", "g_{ab}(2)"),
    ("f(x+1)", "f(x+1)"),
    ("x(x-1)", None),          # the letter in its own argument: a product
    ("2(x-1)", None), ("f()", None), ("f(1)(2)", None), ("f(1)+1", None), ("\\pi(2)", None), ("f", None),
])
def test_applied_name(text, name):
    assert applied_name(tokenize(text)) == name


def test_a_relation_side_is_one_quantity_only_when_it_is_a_lone_application():
    import sympy

    assert relation_side(tokenize("\\tau(-1)")) == sympy.Symbol("\\tau(-1)")
    assert relation_side(tokenize("2(x-1)")) == 2 * sympy.Symbol("x") - 2
    assert relation_side(tokenize("P(2)+1")) == 2 * sympy.Symbol("P") + 1    # not lone: an expression, as before


@pytest.mark.parametrize("answer,value", [
    ("\\displaystyle 123", 123), ("{123}", 123), ("{{123}}", 123), ("\\displaystyle{123}", 123), ("$\\textstyle 7$", 7),
    ("{-5}", -5), ("{1{,}000}", 1000), ("12 \\text{ only}", 12),
    ("{4 2}", None), ("\\displaystyle 4\\,2", None), ("{12}{3}", None), ("only", None),
])
def test_parse_integer_reads_the_shared_surface_forms(answer, value):
    assert parse_integer(answer) == value
