"""Benchmark metrics from graded samples: avg@k, unbiased pass@k, maj@k, breakdowns and counts.

Every problem has k sample slots. A slot without a final result (an infrastructure error that was not
retried) counts as a wrong answer, so scores are always over the whole evaluated data set
(SWE-bench's "resolved rate over all instances").

- ``avg@k`` = mean over problems of c/k (c correct samples of k) = the expected pass@1.
- ``pass@j`` (j = 1, 2, 4, ..., k) = mean over problems of the unbiased estimator
  1 - C(k - c, j) / C(k, j) (Chen et al., 2021), computed as a product so it stays exact for large k.
- ``maj@k`` (math) = share of problems whose most frequent answer among the k samples is correct.
  Answers are grouped by the grader's equivalence, not by their text: the answers the grader accepted
  form one group (they all equal the reference); every other answer joins the first group whose
  representative (its first answer) has the same normalised text (BeyondAIME: the same integer) or is
  equal to it by the `equivalent` function (IMO-AnswerBench: the exact rules, so ``\\frac{1}{3}`` and
  ``1/3`` are one wrong group), else it starts a new group. Samples without an answer do not vote;
  ties go to the group that appeared first (lowest sample index). Each distinct pair of answers is
  compared once per benchmark (cached), at most k·(k-1)/2 comparisons per problem.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sao_core.eval.graders import normalize_answer, parse_integer

#: Sample outcomes counted in a summary (see `outcome_counts`).
COUNTS = ("correct", "wrong", "empty", "unparseable", "unsettled", "timeout", "length", "error")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `n` samples of which `c` are correct: 1 - C(n-c, k)/C(n, k).

    Requires 0 <= c <= n and 1 <= k <= n. Computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i)."""
    for name, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"pass_at_k: {name} must be an integer, got {value!r}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: need 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k: need 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    product = 1.0
    for i in range(n - c + 1, n + 1):
        product *= 1.0 - k / i
    return 1.0 - product


def pass_k_values(n: int) -> list[int]:
    """The j of the pass@j reported for n samples: 1, 2, 4, ... up to n, and n itself."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    values, j = [], 1
    while j <= n:
        values.append(j)
        j *= 2
    if values[-1] != n:
        values.append(n)
    return values


def answer_key(answer: str | None, integer: bool = False) -> str | None:
    """The voting key of an answer: its integer (BeyondAIME) or its normalised text; None: no vote."""
    if answer is None or not answer.strip():
        return None
    if integer:
        value = parse_integer(answer)
        return None if value is None else str(value)
    return normalize_answer(answer) or None


Equivalent = Callable[[str, str], bool]


def cached(equivalent: Equivalent) -> Equivalent:
    """`equivalent` with its answers compared once per unordered pair (results kept)."""
    memo: dict[tuple[str, str], bool] = {}

    def same(a: str, b: str) -> bool:
        key = (a, b) if a <= b else (b, a)
        if key not in memo:
            memo[key] = bool(equivalent(a, b))
        return memo[key]

    return same


def majority_correct(samples: Sequence[Mapping[str, Any]], integer: bool = False,
                     equivalent: Equivalent | None = None) -> bool:
    """maj@k for one problem: is the most frequent answer of `samples` (each ``answer``, ``correct``,
    ``sample``) correct? `equivalent(a, b)` says whether two answers are the same (the grader's
    equivalence); without it answers are grouped by `answer_key`. See the module docstring."""
    groups: list[list[Any]] = []          # [representative answer, key, votes, first sample]
    correct = [0, None]
    for sample in sorted(samples, key=lambda s: s.get("sample", 0)):
        index = int(sample.get("sample", 0))
        if sample.get("correct"):
            correct[0] += 1
            correct[1] = index if correct[1] is None else correct[1]
            continue
        key = answer_key(sample.get("answer"), integer)
        if key is None:
            continue
        answer = str(sample.get("answer"))
        for group in groups:
            if group[1] == key or (equivalent is not None and equivalent(answer, group[0])):
                group[2] += 1
                break
        else:
            groups.append([answer, key, 1, index])
    best_wrong = max(groups, key=lambda g: (g[2], -g[3]), default=None)
    if not correct[0]:
        return False
    if best_wrong is None:
        return True
    return (correct[0], -correct[1]) > (best_wrong[2], -best_wrong[3])


def outcome(sample: Mapping[str, Any]) -> str:
    """The one summary bucket of a sample (a name from :data:`COUNTS`)."""
    if sample.get("status") == "error":
        return "error"
    if sample.get("correct"):
        return "correct"
    if sample.get("timed_out") or sample.get("grade") in ("timeout", "tests_timed_out"):
        return "timeout"
    grade = sample.get("grade")
    if grade in ("no_answer", "empty_patch", "no_submission"):
        return "length" if sample.get("finish_reason") == "length" else "empty"
    if grade == "unparseable":
        return "unparseable"
    if grade == "unsettled" or sample.get("settled") is False:
        return "unsettled"
    return "wrong"


def decided_by(sample: Mapping[str, Any]) -> str:
    """Who decided a sample: ``rule``, ``judge``, ``nobody`` (unsettled) or ``not_graded``."""
    if sample.get("status") == "error" or not sample.get("grader"):
        return "not_graded"
    if sample.get("grade") in ("no_answer", "empty_patch", "no_submission"):
        return "not_graded"
    if sample.get("settled") is False:
        return "nobody"
    return "judge" if sample.get("grader") == "llm_judge" else "rule"


def _scores(per_problem: Mapping[str, list[Mapping[str, Any]]], k: int, majority: bool,
            integer: bool, equivalent: Equivalent | None = None) -> dict[str, float]:
    ids = list(per_problem)
    if not ids:
        return {}
    correct = {pid: sum(1 for s in per_problem[pid] if s.get("correct") and s.get("status") != "error")
               for pid in ids}
    scores = {f"avg@{k}": sum(correct[p] / k for p in ids) / len(ids)}
    for j in pass_k_values(k):
        scores[f"pass@{j}"] = sum(pass_at_k(k, correct[p], j) for p in ids) / len(ids)
    if majority:
        scores[f"maj@{k}"] = sum(
            majority_correct([s for s in per_problem[p] if s.get("status") != "error"], integer, equivalent)
            for p in ids
        ) / len(ids)
    return scores


def benchmark_metrics(
    problems: Sequence[Mapping[str, Any]],
    samples: Iterable[Mapping[str, Any]],
    k: int,
    groups: Sequence[str] = (),
    majority: bool = True,
    integer: bool = False,
    equivalent: Equivalent | None = None,
) -> dict[str, Any]:
    """Metrics of one benchmark.

    `problems`: the evaluated records (each with ``id`` and the `groups` fields); `samples`: sample
    records (``id``, ``sample`` in [0, k), ``correct``, ``answer``, ``grade``, ``grader``, ``status``,
    ``tokens`` ...; samples of other ids or indices are ignored, the last one of a slot wins). Returns
    ``{"problems", "k", "samples", "scores", "counts", "graders", "groups", "tokens", "per_problem"}``;
    scores are fractions in [0, 1], tokens are generated (action) tokens per sample. `equivalent`
    groups the maj@k votes (see the module docstring; cached here). ``decided`` counts who decided the
    graded samples: ``rule`` (per rule: ``{"rule": {name: n}}``), ``judge`` (the LLM judge), ``nobody``
    (unsettled: counted wrong and listed) and ``not_graded`` (no answer to grade, timeouts, errors).
    """
    if equivalent is not None:
        equivalent = cached(equivalent)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    ids = [str(p["id"]) for p in problems]
    wanted = set(ids)
    slots: dict[tuple[str, int], Mapping[str, Any]] = {}
    for sample in samples:
        pid, index = str(sample.get("id")), sample.get("sample")
        if pid in wanted and isinstance(index, int) and 0 <= index < k:
            slots[(pid, index)] = sample
    per_problem: dict[str, list[Mapping[str, Any]]] = {pid: [] for pid in ids}
    for (pid, _), sample in sorted(slots.items()):
        per_problem[pid].append(sample)
    counts = Counter({name: 0 for name in COUNTS})
    graders: Counter[str] = Counter()
    rules: Counter[str] = Counter()
    decided = {"rule": 0, "judge": 0, "nobody": 0, "not_graded": 0}
    for sample in slots.values():
        counts[outcome(sample)] += 1
        who = decided_by(sample)
        decided[who] += 1
        if who == "rule":
            rules[str(sample.get("rule") or sample.get("grader"))] += 1
        if sample.get("status") != "error" and sample.get("grader"):
            graders[str(sample["grader"])] += 1
    counts["missing"] = len(ids) * k - len(slots)
    tokens = [int(s.get("tokens") or 0) for s in slots.values() if s.get("status") != "error"]
    breakdown: dict[str, dict[str, dict[str, Any]]] = {}
    for group in groups:
        members: dict[str, list[str]] = defaultdict(list)
        for problem in problems:
            members[str(problem.get(group) or "(none)")].append(str(problem["id"]))
        breakdown[group] = {
            value: {"problems": len(pids),
                    **_scores({p: per_problem[p] for p in pids}, k, majority, integer, equivalent)}
            for value, pids in sorted(members.items())
        }
    return {
        "problems": len(ids),
        "k": k,
        "samples": len(slots),
        "scores": _scores(per_problem, k, majority, integer, equivalent),
        "counts": dict(counts),
        "decided": {**decided, "rules": dict(rules.most_common())},
        "graders": dict(graders.most_common()),
        "groups": breakdown,
        "tokens": {
            "mean": statistics.fmean(tokens) if tokens else 0.0,
            "median": float(statistics.median(tokens)) if tokens else 0.0,
            "max": max(tokens) if tokens else 0,
        },
        "per_problem": {
            pid: {"correct": sum(1 for s in per_problem[pid] if s.get("correct") and s.get("status") != "error"),
                  "samples": len(per_problem[pid])}
            for pid in ids
        },
    }


_METRIC_NAME = re.compile(r"[^a-z0-9@]+")


def metric_name(*parts: str) -> str:
    """A KFP-friendly metric name: parts lower-cased, runs of other characters as ``_``, joined by ``/``."""
    return "/".join(_METRIC_NAME.sub("_", part.lower()).strip("_") or "_" for part in parts)


def flat_metrics(benchmarks: Mapping[str, Mapping[str, Any]], group_levels: Mapping[str, str] | None = None) -> dict[str, float]:
    """Name -> float for a KFP ``Metrics`` artifact: ``<benchmark>/<score>`` for every score,
    ``<benchmark>/<group>/<value>/<score>`` for the first group level of each benchmark (IMO categories,
    SWE repositories; `group_levels` picks another), rates of empty / unparseable / unsettled /
    timed-out / cut-at-the-token-limit / errored samples and the mean tokens; SWE also gets ``swe_verified/resolved_rate``."""
    flat: dict[str, float] = {}
    for name, metrics in benchmarks.items():
        k = int(metrics["k"])
        for score, value in metrics["scores"].items():
            flat[metric_name(name, score)] = float(value)
        if name == "swe_verified" and f"avg@{k}" in metrics["scores"]:
            flat[metric_name(name, "resolved_rate")] = float(metrics["scores"][f"avg@{k}"])
        total = max(1, int(metrics["problems"]) * k)
        for bucket in ("empty", "unparseable", "unsettled", "timeout", "length", "error"):
            flat[metric_name(name, f"{bucket}_rate")] = metrics["counts"].get(bucket, 0) / total
        flat[metric_name(name, "mean_tokens")] = float(metrics["tokens"]["mean"])
        levels = list(metrics.get("groups", {}))
        level = (group_levels or {}).get(name) or (levels[0] if levels else None)
        for value, scores in metrics.get("groups", {}).get(level, {}).items() if level else ():
            for score in (f"avg@{k}", f"pass@{k}"):
                if score in scores:
                    flat[metric_name(name, level, value, score)] = float(scores[score])
    return {key: (0.0 if math.isnan(value) else value) for key, value in flat.items()}


def compare(current: Mapping[str, float], previous: Mapping[str, float]) -> dict[str, dict[str, float]]:
    """``{metric: {"current", "previous", "delta"}}`` for the metrics both runs have (delta = current -
    previous)."""
    out = {}
    for name in current:
        if name in previous:
            try:
                now, before = float(current[name]), float(previous[name])
            except (TypeError, ValueError):
                continue
            out[name] = {"current": now, "previous": before, "delta": now - before}
    return out
