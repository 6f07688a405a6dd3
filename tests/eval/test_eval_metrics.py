"""Evaluator metrics by hand: unbiased pass@k, avg@k, maj@k, breakdowns, counts, flat KFP metrics."""

from __future__ import annotations

from fractions import Fraction
from math import comb

import pytest

from sao_core.eval.metrics import (
    benchmark_metrics,
    compare,
    flat_metrics,
    majority_correct,
    metric_name,
    outcome,
    pass_at_k,
    pass_k_values,
)


@pytest.mark.parametrize("n,c,k,expected", [
    (5, 2, 1, 0.4),                    # pass@1 = c/n
    (5, 2, 2, 1 - 3 / 10),             # 1 - C(3,2)/C(5,2)
    (5, 2, 4, 1.0),                    # n - c = 3 < 4: every draw of 4 holds a correct one
    (10, 3, 4, 1 - 35 / 210),          # 1 - C(7,4)/C(10,4)
    (4, 0, 4, 0.0),                    # n = k, c = 0
    (4, 1, 4, 1.0),                    # n = k, c = 1
    (4, 4, 1, 1.0),
    (1, 0, 1, 0.0),
    (1, 1, 1, 1.0),
    (16, 0, 1, 0.0),                   # c = 0 for any k
    (16, 0, 16, 0.0),
    (8, 3, 2, 1 - comb(5, 2) / comb(8, 2)),   # 1 - 10/28
])
def test_pass_at_k_by_hand(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_is_exact_for_large_n():
    # C(n, k) overflows floats long before n = 2000; the product form stays exact to ~1e-12
    for n, c, k in ((200, 7, 100), (2000, 13, 1000), (1024, 1, 512), (1000, 999, 1)):
        exact = 1 - Fraction(comb(n - c, k), comb(n, k))
        assert pass_at_k(n, c, k) == pytest.approx(float(exact), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(4, 5, 1), (4, -1, 1), (4, 2, 0), (4, 2, 5), (0, 0, 1), (4.0, 2, 1), (4, True, 1)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_pass_k_values():
    assert pass_k_values(1) == [1]
    assert pass_k_values(2) == [1, 2]
    assert pass_k_values(4) == [1, 2, 4]
    assert pass_k_values(6) == [1, 2, 4, 6]
    assert pass_k_values(16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError):
        pass_k_values(0)


def _s(index, correct, answer, **kw):
    return {"sample": index, "correct": correct, "answer": answer, **kw}


def test_majority_vote():
    # the correct group (any spelling the grader accepted) against a wrong answer given twice
    assert not majority_correct([_s(0, True, "1/2"), _s(1, False, "5"), _s(2, False, "$5$")])
    assert majority_correct([_s(0, True, "1/2"), _s(1, True, "0.5"), _s(2, False, "5")])
    # ties go to the group seen first
    assert majority_correct([_s(0, True, "7"), _s(1, False, "5")])
    assert not majority_correct([_s(0, False, "5"), _s(1, True, "7")])
    # ... by sample index, not by list order: "5" (sample 0) wins the 2-2 tie
    assert not majority_correct([_s(1, True, "7"), _s(0, False, "5"), _s(2, True, "7"), _s(3, False, "5"),
                                 _s(4, False, None)])
    # samples without an answer do not vote
    assert majority_correct([_s(0, False, None), _s(1, False, ""), _s(2, True, "3")])
    assert not majority_correct([_s(0, False, None), _s(1, False, None)])
    assert not majority_correct([])
    # integer answers vote by value: "042" and "42" are one group
    assert not majority_correct([_s(0, True, "7"), _s(1, False, "042"), _s(2, False, "42")], integer=True)
    assert majority_correct([_s(0, True, "7"), _s(1, False, "042"), _s(2, False, "41")], integer=True)


def test_benchmark_metrics_by_hand():
    problems = [{"id": "a", "category": "Algebra"}, {"id": "b", "category": "Algebra"},
                {"id": "c", "category": "Geometry"}]
    samples = [
        {"id": "a", "sample": 0, "correct": True, "answer": "1", "grade": "match", "grader": "rule", "status": "graded", "tokens": 10},
        {"id": "a", "sample": 1, "correct": True, "answer": "1", "grade": "match", "grader": "llm_judge", "status": "graded", "tokens": 20},
        {"id": "b", "sample": 0, "correct": True, "answer": "2", "grade": "match", "grader": "rule", "status": "graded", "tokens": 30},
        {"id": "b", "sample": 1, "correct": False, "answer": "3", "grade": "mismatch", "grader": "rule", "status": "graded", "tokens": 40},
        {"id": "c", "sample": 0, "correct": False, "answer": None, "grade": "no_answer", "grader": "rule", "status": "graded",
         "finish_reason": "length", "tokens": 50},
        # an errored slot: a wrong answer in every score, counted as an error, not graded
        {"id": "c", "sample": 1, "correct": True, "answer": None, "grade": "error", "grader": None, "status": "error", "tokens": 0},
        # ignored: other problems, sample indices >= k
        {"id": "zzz", "sample": 0, "correct": True, "status": "graded"},
        {"id": "a", "sample": 2, "correct": False, "status": "graded"},
    ]
    m = benchmark_metrics(problems, samples, k=2, groups=("category",))
    assert m["problems"] == 3 and m["k"] == 2 and m["samples"] == 6
    # per problem c = 2, 1, 0 of k = 2
    assert m["scores"]["avg@2"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["scores"]["pass@1"] == pytest.approx((1 + 0.5 + 0) / 3)
    assert m["scores"]["pass@2"] == pytest.approx((1 + 1 + 0) / 3)
    # maj@2: a -> "1" twice (correct); b -> tie, correct "2" first; c -> no vote
    assert m["scores"]["maj@2"] == pytest.approx(2 / 3)
    assert m["counts"] == {"correct": 3, "wrong": 1, "empty": 0, "unparseable": 0, "unsettled": 0, "timeout": 0,
                           "length": 1, "error": 1, "missing": 0}
    assert m["graders"] == {"rule": 4, "llm_judge": 1}
    assert m["groups"]["category"]["Algebra"] == {"problems": 2, "avg@2": 0.75, "pass@1": 0.75, "pass@2": 1.0,
                                                  "maj@2": 1.0}
    assert m["groups"]["category"]["Geometry"]["avg@2"] == 0.0
    assert m["tokens"] == {"mean": 30.0, "median": 30.0, "max": 50}
    assert m["per_problem"] == {"a": {"correct": 2, "samples": 2}, "b": {"correct": 1, "samples": 2},
                                "c": {"correct": 0, "samples": 2}}

    # a slot without any sample counts as missing and wrong; the last record of a slot wins
    later = samples[:3] + [{**samples[3], "correct": True}]
    m2 = benchmark_metrics(problems, later, k=2, majority=False)
    assert m2["counts"]["missing"] == 2 and "maj@2" not in m2["scores"]
    assert m2["scores"]["avg@2"] == pytest.approx((1 + 1 + 0) / 3)
    with pytest.raises(ValueError):
        benchmark_metrics(problems, samples, k=0)


def test_outcome_buckets():
    assert outcome({"correct": True, "status": "graded"}) == "correct"
    assert outcome({"correct": True, "status": "error"}) == "error"
    assert outcome({"grade": "timeout", "status": "timeout", "timed_out": True}) == "timeout"
    assert outcome({"grade": "tests_timed_out", "status": "graded"}) == "timeout"
    assert outcome({"grade": "no_answer", "finish_reason": "stop"}) == "empty"
    assert outcome({"grade": "empty_patch", "finish_reason": "stop"}) == "empty"
    assert outcome({"grade": "no_answer", "finish_reason": "length"}) == "length"
    assert outcome({"grade": "unparseable"}) == "unparseable"
    assert outcome({"grade": "unsettled", "settled": False}) == "unsettled"
    assert outcome({"grade": "mismatch", "settled": True}) == "wrong"
    assert outcome({"grade": "patch_does_not_apply"}) == "wrong"


def test_flat_metrics_and_comparison():
    problems = [{"id": "x", "repo": "django/django"}, {"id": "y", "repo": "astropy/astropy"}]
    samples = [{"id": "x", "sample": 0, "correct": True, "status": "graded", "grader": "swe_tests", "tokens": 5},
               {"id": "y", "sample": 0, "correct": False, "status": "graded", "grade": "empty_patch",
                "finish_reason": "stop", "grader": "swe_tests", "tokens": 7}]
    swe = benchmark_metrics(problems, samples, k=1, groups=("repo",), majority=False)
    flat = flat_metrics({"swe_verified": swe})
    assert flat["swe_verified/avg@1"] == flat["swe_verified/resolved_rate"] == flat["swe_verified/pass@1"] == 0.5
    assert flat["swe_verified/empty_rate"] == 0.5 and flat["swe_verified/error_rate"] == 0.0
    assert flat["swe_verified/length_rate"] == 0.0
    assert flat["swe_verified/repo/django_django/avg@1"] == 1.0
    assert flat["swe_verified/repo/astropy_astropy/pass@1"] == 0.0
    assert flat["swe_verified/mean_tokens"] == 6.0
    assert all(isinstance(v, float) for v in flat.values())
    assert metric_name("imo_answerbench", "category", "Number theory", "avg@4") == "imo_answerbench/category/number_theory/avg@4"
    diff = compare({"a": 0.5, "b": 0.25, "c": 1.0}, {"a": 0.25, "b": 0.5, "d": 0.0})
    assert diff == {"a": {"current": 0.5, "previous": 0.25, "delta": 0.25},
                    "b": {"current": 0.25, "previous": 0.5, "delta": -0.25}}


def _same_value(a, b):
    """A stand-in for the grader's equivalence: answers equal as fractions."""
    from fractions import Fraction

    def value(text):
        text = text.replace("$", "").replace("\\frac{", "").replace("}{", "/").replace("}", "").strip()
        return Fraction(text)
    try:
        return value(a) == value(b)
    except (ValueError, ZeroDivisionError):
        return False


def test_majority_vote_groups_wrong_answers_by_equivalence():
    # issue 18: "\frac{1}{3}" and "1/3" are one wrong answer: 2 votes beat the correct singleton
    samples = [_s(0, True, "1/2"), _s(1, False, "\\frac{1}{3}"), _s(2, False, "1/3")]
    assert majority_correct(samples)                                  # by text: three groups of 1, correct first
    assert not majority_correct(samples, equivalent=_same_value)      # by equivalence: {1/3: 2} wins
    # ties by first appearance, with groups formed by equivalence
    samples = [_s(0, False, "2/6"), _s(1, True, "1/2"), _s(2, True, "0.5"), _s(3, False, "\\frac{1}{3}")]
    assert not majority_correct(samples, equivalent=_same_value)      # 2-2, the wrong group came first
    samples = [_s(0, True, "1/2"), _s(1, False, "2/6"), _s(2, True, "0.5"), _s(3, False, "\\frac{1}{3}")]
    assert majority_correct(samples, equivalent=_same_value)
    # an answer joins the first group whose representative it equals; unequal answers stay apart
    samples = [_s(0, True, "1/2"), _s(1, False, "1/3"), _s(2, False, "1/4"), _s(3, False, "2/8")]
    assert not majority_correct(samples, equivalent=_same_value)


def test_majority_equivalence_is_cached_per_pair():
    calls = []

    def counting(a, b):
        calls.append((a, b))
        return _same_value(a, b)

    problems = [{"id": str(i)} for i in range(20)]
    samples = [_s(j, False, ans, id=str(i), status="graded", grade="mismatch", grader="rule", settled=True)
               for i in range(20) for j, ans in enumerate(["1/3", "2/6", "1/4", "3/9"])]
    m = benchmark_metrics(problems, samples, k=4, equivalent=counting)
    assert m["scores"]["maj@4"] == 0.0
    # 4 answers per problem, the same 4 in every problem: at most C(4, 2) = 6 distinct comparisons
    assert len(calls) <= 6


def test_decided_counts_rules_judge_and_nobody():
    from sao_core.eval.report import render_report

    problems = [{"id": "a"}, {"id": "b"}]
    samples = [
        {"id": "a", "sample": 0, "correct": True, "grade": "match", "grader": "rule", "rule": "value", "status": "graded",
         "settled": True, "answer": "1"},
        {"id": "a", "sample": 1, "correct": False, "grade": "mismatch", "grader": "rule", "rule": "structure",
         "status": "graded", "settled": True, "answer": "2"},
        {"id": "a", "sample": 2, "correct": True, "grade": "match", "grader": "llm_judge", "status": "graded",
         "settled": True, "answer": "one"},
        {"id": "b", "sample": 0, "correct": False, "grade": "unsettled", "grader": "rule", "rule": "unparsed",
         "status": "graded", "settled": False, "answer": "n \\equiv 3"},
        {"id": "b", "sample": 1, "correct": False, "grade": "no_answer", "grader": "rule", "status": "graded",
         "settled": True, "answer": None},
        {"id": "b", "sample": 2, "correct": False, "grade": "error", "grader": None, "status": "error"},
    ]
    m = benchmark_metrics(problems, samples, k=3)
    assert m["decided"] == {"rule": 2, "judge": 1, "nobody": 1, "not_graded": 2,
                            "rules": {"value": 1, "structure": 1}}
    summary = {"model": "m", "benchmarks": {"imo_answerbench": {"title": "IMO", "grader": "math_rule", **m}}}
    html = render_report(summary, [dict(s, benchmark="imo_answerbench") for s in samples])
    assert 'class="decided"' in html and "rule: value" in html and "LLM judge" in html
    assert "nobody (unsettled: counted wrong, listed below)</td><td class=\"num\">1" in html
