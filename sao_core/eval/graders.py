"""Graders of the three benchmarks; each returns a :class:`Verdict` saying who decided and why.

- **BeyondAIME** (`IntegerGrader`, grader ``exact_int``): the last ``\\boxed{}`` after any reasoning
  block (`sao_core.envs.grading.extract_boxed`) must hold an integer equal to the reference. Accepted
  integer spellings: an optional sign, digits with optional thousands separators (``1,000``,
  ``1{,}000``, ``1\\,000``, ``1 000``: groups of exactly three digits after the first, one kind of
  separator throughout; ``4 2`` or ``1,00`` is not an integer), surrounding ``$``, ``\\text{}``/``\\mathbf{}`` wrappers, a leading
  ``x =`` and a trailing full stop, and the surface forms shared with the exact rules
  (`sao_core.envs.exact_values.surface`: ``\\displaystyle``/``\\textstyle``, group braces ``{{123}}``, a
  trailing ``only``). Anything else is ``unparseable`` (wrong).
- **IMO-AnswerBench** (`ImoGrader`): rules first (grader ``rule``): the same text after light
  normalisation is a match; otherwise math-verify decides in a worker process with a timeout
  (`sao_core.envs.grading.MathGrader`). Rules *cannot settle* an answer when math-verify cannot parse
  it, times out or fails, or when the reference or the answer is worded in prose (``"all odd n"``,
  ``"1 if the triangle is isosceles, otherwise 2"``: math-verify ignores the words and would decide on
  the numbers alone) — except that prose against a formula may be settled by the exact rules' ``prose-set``
  rule (``"all positive integers"`` = ``\\mathbb{Z}^+``). Unsettled answers go to the optional LLM judge (grader ``llm_judge``, any
  OpenAI-compatible ``/chat/completions`` endpoint); with `judge_policy="rejected"` rule mismatches
  go to it too. Without a judge, an unsettled answer counts as wrong and is listed (``settled`` False).
- **SWE-Bench Verified** (`grade_swe_patch`, grader ``swe_tests``): apply the patch in a fresh
  sandbox (git apply, then fallbacks), reset and apply the instance's test patch, run its tests, parse
  the log; resolved only when every FAIL_TO_PASS and PASS_TO_PASS test passes
  (`sao_core.envs.swe.grade_patch`). `verdict_from_swe_report` turns a grade report into a Verdict.
"""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from sao_core.envs.exact import squeeze
from sao_core.envs.exact_values import surface
from sao_core.envs.grading import MathGrader
from sao_core.eval.judge import JUDGE_SYSTEM, JUDGE_USER, JudgeRuling, LLMJudge, parse_judge_reply

GRADERS = ("exact_int", "rule", "llm_judge", "swe_tests")


@dataclass
class Verdict:
    """The grade of one sample.

    `grade` is the outcome: math ``match``, ``mismatch``, ``no_answer``, ``unparseable``, ``unsettled``,
    ``timeout``, ``error``; SWE ``resolved``, ``unresolved``, ``empty_patch``, ``patch_does_not_apply``,
    ``test_patch_does_not_apply``, ``tests_timed_out``, ``no_submission``. `grader` is the grader that
    decided (one of :data:`GRADERS`; None when there was nothing to grade). `settled` is False when no grader could decide (the sample counts
    as wrong and is listed). `seconds` is the grading time.
    """

    correct: bool
    grade: str
    grader: str | None                     # None: nothing was graded (a timeout, no submission)
    answer: str | None = None
    detail: str = ""
    settled: bool = True
    seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------- BeyondAIME

_WRAPPERS = re.compile(r"^\\(?:text|textbf|mathbf|mathrm|boxed|displaystyle)\s*\{(?P<body>.*)\}$", re.S)
_INTEGER = re.compile(r"[+-]?\d+")
_SEPARATOR = re.compile(r",|\{,\}|\\,|\\ | ")
_SEPARATED = re.compile(r"[+-]?\d{1,3}(?:(?:,|\{,\}|\\,|\\ | )\d{3})+")
_ASSIGN = re.compile(r"^[A-Za-z](?:_\{?\w+\}?)?\s*=\s*")


def parse_integer(answer: str | None) -> int | None:
    """The integer written in `answer` (see the module docstring for the spellings), else None."""
    if answer is None:
        return None
    text = answer.strip()
    for _ in range(4):   # peel wrappers: $..$, \(..\), \text{..}, a trailing full stop
        before = text
        text = text.strip().rstrip(".").strip()
        if len(text) >= 2 and text[0] == "$" and text[-1] == "$":
            text = text.strip("$")
        if text.startswith("\\(") and text.endswith("\\)"):
            text = text[2:-2]
        text = surface(text)     # the shared surface forms: \displaystyle, {{123}}, "only" (exact_values)
        match = _WRAPPERS.match(text)
        if match:
            text = match["body"]
        text = _ASSIGN.sub("", text.strip())
        if text == before:
            break
    match = _SEPARATED.fullmatch(text)
    if match and len({sep for sep in _SEPARATOR.findall(text)}) == 1:
        return int(re.sub(r"\D", "", text)) * (-1 if text.startswith("-") else 1)
    if _INTEGER.fullmatch(text):
        return int(text)
    return None


class IntegerGrader:
    """BeyondAIME: integer exact match of the extracted answer (grader ``exact_int``)."""

    name = "exact_int"

    def grade(self, answer: str | None, gold: Any, problem: Mapping[str, Any] | None = None) -> Verdict:
        started = time.monotonic()
        if answer is None or not answer.strip():
            return Verdict(False, "no_answer", self.name, answer, "no final \\boxed{} answer")
        reference = int(gold)
        value = parse_integer(answer)
        if value is None:
            return Verdict(False, "unparseable", self.name, answer, "the answer is not an integer",
                           seconds=time.monotonic() - started)
        same = value == reference
        return Verdict(same, "match" if same else "mismatch", self.name, answer,
                       f"{value} {'==' if same else '!='} {reference}", seconds=time.monotonic() - started)


# --------------------------------------------------------------------------------------- IMO rules

_MATH_DELIMS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"))
_TEXT_CMD = re.compile(r"\\(?:text|textrm|textbf|mathrm|mbox|operatorname)\s*\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:!]|\\quad|\\qquad|~|\\left|\\right|\\displaystyle")
_COMMAND = re.compile(r"\\[A-Za-z]+")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}")


def normalize_answer(text: str) -> str:
    """A normal form for comparing answers as text: outer math delimiters, ``\\text{}`` wrappers,
    spacing commands, ``\\left``/``\\right``, ``\\dfrac``/``\\tfrac``, whitespace and a final full stop
    removed."""
    out = text.strip()
    for _ in range(3):
        before = out
        out = out.strip().rstrip(".").strip()
        for opening, closing in _MATH_DELIMS:
            if out.startswith(opening) and out.endswith(closing) and len(out) > len(opening) + len(closing):
                inner = out[len(opening):len(out) - len(closing)]
                if opening not in inner:          # "$a$ and $b$" is not one math span
                    out = inner
                    break
        if out == before:
            break
    out = _TEXT_CMD.sub(r"\1", out)
    out = out.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    out = _SPACING.sub("", out)
    return re.sub(r"\s+", "", out).rstrip(".")


_PROSE_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}(?![A-Za-z])")


def prose_key(text: str) -> str:
    """The comparison key of a prose answer: words of two or more letters outside ``$…$`` lower-cased
    (``All`` = ``all``), single letters and formulas kept as written (``N`` is not ``n``), then
    `squeeze` (`sao_core.envs.exact`)."""
    pieces = text.split("$")
    for i in range(0, len(pieces), 2):
        pieces[i] = _PROSE_WORD.sub(lambda m: m.group(0).casefold(), pieces[i])
    return squeeze("$".join(pieces))


def is_prose(text: str) -> bool:
    """True when `text` carries words (three or more letters outside LaTeX commands, other than ``and``),
    e.g. ``odd $n$`` or ``$f(x)=x$ for all $x$``: formula rules would judge it on its formulas alone."""
    return any(word.group(0).lower() not in ("and", "or") for word in _WORD.finditer(_COMMAND.sub(" ", text)))


class ImoGrader:
    """IMO-AnswerBench: rules (grader ``rule``), then the optional LLM judge (see the module docstring).

    `math_grader` runs math-verify in worker processes; `timeout_s` is its time per answer. `judge`
    (an :class:`LLMJudge` or None) and `judge_policy` (``unsettled`` | ``rejected``) control the judge.
    """

    name = "rule"

    def __init__(self, math_grader: MathGrader, timeout_s: float | None = None, judge: LLMJudge | None = None,
                 judge_policy: str = "unsettled"):
        self.math_grader = math_grader
        self.timeout_s = timeout_s
        self.judge = judge
        self.judge_policy = judge_policy

    def rule(self, answer: str | None, gold: str, *, text_shortcut: bool = True, problem: str | None = None) -> Verdict:
        """The rules alone (`sao_core.envs.exact`). `text_shortcut=False` makes the exact rules decide even
        identical texts (used to measure what they settle by themselves). `problem` (the problem statement)
        lets the rules place named tuples in the problem's order and respect a variable's declared domain.
        The rule that decided is in ``extra["rule"]``."""
        context = {"problem_text": problem} if problem else {}     # a math grader without it still works
        started = time.monotonic()
        if answer is None or not answer.strip():
            return Verdict(False, "no_answer", self.name, answer, "no final \\boxed{} answer")
        if text_shortcut:
            if squeeze(answer) == squeeze(gold):
                return Verdict(True, "match", self.name, answer, "same text", seconds=time.monotonic() - started,
                               extra={"rule": "text"})
            if (is_prose(gold) or is_prose(answer)) and prose_key(answer) == prose_key(gold):
                return Verdict(True, "match", self.name, answer, "same words", seconds=time.monotonic() - started,
                               extra={"rule": "words"})
        prose = [name for name, text in (("reference", gold), ("answer", answer)) if is_prose(text)]
        if len(prose) == 1:   # prose against a formula: the exact rules' prose-set rule may settle it
            result = self.math_grader.grade(answer, gold, self.timeout_s, text_shortcut=text_shortcut, mode="exact",
                                            **context)
            if result.reason in ("match", "mismatch"):
                return Verdict(result.correct, result.reason, self.name, answer, result.detail,
                               seconds=time.monotonic() - started, extra={"rule": result.rule})
        if prose:
            return Verdict(False, "unsettled", self.name, answer,
                           f"the {' and the '.join(prose)} {'is' if len(prose) == 1 else 'are'} worded in prose: "
                           "rules cannot compare them", settled=False, seconds=time.monotonic() - started,
                           extra={"rule": "prose"})
        result = self.math_grader.grade(answer, gold, self.timeout_s, text_shortcut=text_shortcut, mode="exact",
                                        **context)
        settled = result.reason in ("match", "mismatch")
        grade = result.reason if result.reason in ("match", "mismatch", "timeout", "error") else "unsettled"
        return Verdict(result.correct, grade, self.name, answer, result.detail, settled=settled,
                       seconds=time.monotonic() - started, extra={"rule": result.rule or result.reason})

    def grade(self, answer: str | None, gold: str, problem: Mapping[str, Any] | None = None) -> Verdict:
        text = (problem or {}).get("problem")
        verdict = self.rule(answer, gold, problem=str(text) if text else None)
        wants_judge = (not verdict.settled) or (self.judge_policy == "rejected" and verdict.grade == "mismatch")
        if self.judge is None or not wants_judge or verdict.grade == "no_answer":
            return verdict
        started = time.monotonic()
        ruling = self.judge.judge(str((problem or {}).get("problem", "")), gold, answer or "")
        seconds = verdict.seconds + time.monotonic() - started
        extra = {"rule_grade": verdict.grade, "rule_detail": verdict.detail, "judge": ruling.to_dict()}
        if ruling.correct is None:   # the judge failed: the rules' outcome stands, marked as such
            return Verdict(False, verdict.grade, self.name, answer, f"{verdict.detail}; judge failed: {ruling.error}",
                           settled=verdict.settled, seconds=seconds, extra=extra)
        return Verdict(ruling.correct, "match" if ruling.correct else "mismatch", "llm_judge", answer,
                       ruling.verdict, seconds=seconds, extra=extra)


# --------------------------------------------------------------------------------------- LLM judge
# The judge itself (prompt, transports, cache, agreement) is sao_core/eval/judge.py; its names are re-exported.

__all__ = ["GRADERS", "IntegerGrader", "ImoGrader", "JUDGE_SYSTEM", "JUDGE_USER", "JudgeRuling", "LLMJudge",
           "Verdict", "grade_swe_patch", "parse_judge_reply", "verdict_from_swe_report"]


# --------------------------------------------------------------------------------------- SWE

def verdict_from_swe_report(report: Mapping[str, Any], patch: str | None = None) -> Verdict:
    """A Verdict (grader ``swe_tests``) from a `GradeReport` dict (`sao_core.envs.swe_grading`).

    ``extra["test_command"]`` names what ran the tests: ``"harness"`` (the record's own eval script,
    through the harness's ``make_test_spec``) or ``"fallback"`` (our per-repository commands; the
    reason in ``extra["fallback_reason"]``)."""
    extra = {key: report.get(key) for key in (
        "fail_to_pass_total", "fail_to_pass_passed", "fail_to_pass_failed", "pass_to_pass_total",
        "pass_to_pass_passed", "pass_to_pass_failed", "apply_method", "patch_applied", "test_patch_applied",
        "tests_run", "test_exit_code", "tests_timed_out", "error", "resolution", "log_valid", "log_parser", "harness",
        "fallback_reason", "harness_derived", "eval_script_sha256", "eval_script_changes")}
    extra["test_command"] = report.get("test_command_source")
    seconds = float(report.get("seconds") or 0.0)
    failed = list(report.get("fail_to_pass_failed") or []) + list(report.get("pass_to_pass_failed") or [])
    if report.get("resolved"):
        return Verdict(True, "resolved", "swe_tests", None, "every FAIL_TO_PASS and PASS_TO_PASS test passed",
                       seconds=seconds, extra=extra)
    if report.get("patch_empty"):
        grade, detail = "empty_patch", "the patch is empty"
    elif report.get("patch_applied") is False:
        grade, detail = "patch_does_not_apply", report.get("error") or "the patch does not apply"
        tail = (report.get("apply_log") or "").strip().splitlines()[-3:]
        if tail:
            detail += ": " + " | ".join(tail)
    elif report.get("test_patch_applied") is False:
        grade, detail = "test_patch_does_not_apply", report.get("error") or "the test patch does not apply"
    elif report.get("tests_timed_out"):
        grade, detail = "tests_timed_out", report.get("error") or "the tests timed out"
    else:
        grade = "unresolved"
        detail = f"{len(failed)} listed test(s) did not pass: {', '.join(failed[:5])}" + (" ..." if len(failed) > 5 else "")
        if report.get("tests_run") and report.get("log_valid") is False:
            detail = (f"the SWE-bench harness found no valid test run in the log (exit status "
                      f"{report.get('test_exit_code')}; a crash, or no results)")
    return Verdict(False, grade, "swe_tests", None, detail, seconds=seconds, extra=extra)


def grade_swe_patch(record: Mapping[str, Any], patch: str, options: Mapping[str, Any] | None = None) -> Verdict:
    """Grade `patch` for a ``swe_bench_verified`` record in a fresh sandbox.

    `options` are the `SWEEnv` settings used for the benchmark (``sandbox_kind``, ``sandbox_limits``,
    ``sandbox_options``, ``repo_source``, ``test_command``, ``log_parser``, ``test_timeout_s``,
    ``setup_command``, ``keep_logs``; see :func:`sao_core.eval.run.swe_env_options`). The report keeps
    the tests' log only with ``keep_logs`` (default False: test names and verdicts). A record with the harness's
    ``eval_script`` (swebench 5.x) runs that script and ``test_command`` / ``log_parser`` do not apply
    (`sao_core.envs.swe.grade_in_shell`). `SandboxError` propagates.
    """
    from sao_core.envs.swe import SWEBENCH_SETUP, default_sandbox_factory, grade_patch, task_from_swe_record
    from sao_core.sandbox.base import SandboxLimits

    opts = dict(options or {})
    test_timeout_s = float(opts.get("test_timeout_s", 1800.0))
    limits = opts.get("sandbox_limits")
    if limits is None:
        limits = SandboxLimits(wall_seconds=float(opts.get("command_timeout_s", 60.0)),
                               cpu_seconds=int(test_timeout_s), memory_mb=4096, max_processes=256)
    factory = default_sandbox_factory(opts.get("sandbox_kind", "local"), limits, opts.get("sandbox_options"),
                                      **({"image_template": opts["image_template"]} if "image_template" in opts else {}))
    task = task_from_swe_record(record)
    report = grade_patch(task, patch or "", factory, test_command=opts.get("test_command"),
                         log_parser=opts.get("log_parser"), test_timeout_s=test_timeout_s,
                         repo_source=opts.get("repo_source"), setup_command=opts.get("setup_command", SWEBENCH_SETUP),
                         keep_logs=bool(opts.get("keep_logs", False)))
    return verdict_from_swe_report(report.to_dict(), patch)
