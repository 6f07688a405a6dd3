"""SWE-bench verdicts equal the official harness's on synthetic logs of every parser family of the
Verified set (pytest, pytest with options, pytest v2, django, sympy, matplotlib, seaborn, and the
fallback for a repository the harness does not know).

The reference is the harness itself: ``swebench.harness.grading.get_eval_report`` on a
``test_output.txt`` written here the way the harness's eval script writes it (``set -x`` traces,
start / end markers, the ``>>>>> Test Exit Code`` line), with the repository's parser from
``MAP_REPO_TO_PARSER_PY``; a timed-out run is not resolved because the harness's ``run_instance``
stops at the timeout before grading. Our side is the evaluator's path: `grade_test_log` on the raw
test output and exit status (as `grade_in_shell` calls it), then `verdict_from_swe_report`.

The cases named in issue #18 where the old hand-written grader disagreed also carry the expected
verdict explicitly (crash after PASSED lines, INTERNALERROR, non-zero exit, timeout, Django skipped /
expected failure / Python 3.11 names, sympy ``f``, a name repeated across files, ANSI colours).
"""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from sao_core.envs.swe_grading import grade_test_log, parse_test_log, runner_spec_for
from sao_core.envs.swebench_harness import (
    SWEBENCH_PIN,
    harness,
    harness_log,
    harness_test_spec,
    parser_for,
    swebench_version,
)
from sao_core.eval.graders import verdict_from_swe_report

H = harness()
ROOT = Path(__file__).resolve().parents[2]

PYTEST_REPOS = ["pytest-dev/pytest", "pydata/xarray", "pallets/flask", "psf/requests", "pylint-dev/pylint",
                "astropy/astropy", "scikit-learn/scikit-learn", "sphinx-doc/sphinx", "matplotlib/matplotlib",
                "mwaskom/seaborn", "local/mypkg"]


# ------------------------------------------------------------------------------------ the reference

def reference_resolved(tmp_path: Path, repo: str, output: str, exit_code: int | None, timed_out: bool,
                       f2p: list[str], p2p: list[str]) -> bool:
    """The harness's own verdict on the run, graded as ``swebench.harness.run_evaluation`` does."""
    if timed_out:
        return False              # run_instance raises EvaluationError at the timeout: no report, not resolved
    c = H.constants
    fn = H.python_parsers.MAP_REPO_TO_PARSER_PY.get(repo, H.log_parsers.PARSER_REGISTRY["parse_log_pytest"])
    name = next(n for n, f in H.log_parsers.PARSER_REGISTRY.items() if f is fn)
    spec = H.TestSpec(instance_id="ref", image="", eval_script_list=[], repo=repo, version="", FAIL_TO_PASS=f2p,
                      PASS_TO_PASS=p2p, log_parser=name, eval_type=c.EvalType.PASS_AND_FAIL.value)
    lines = ["+ cd /testbed", "+ git apply -v - <<'EOF_114329324912'", "Checking patch tests/x.py...",
             f"+ : '{c.START_TEST_OUTPUT}'", c.START_TEST_OUTPUT, "+ pytest -rA tests/x.py", output.rstrip("\n"),
             f"+ {c.TEST_EXIT_CODE_VAR}={exit_code if exit_code is not None else ''}", f"+ : '{c.END_TEST_OUTPUT}'",
             c.END_TEST_OUTPUT]
    if exit_code is not None:
        lines.append(f"{c.TEST_EXIT_CODE}: {exit_code}")
    lines.append("+ git checkout abc123 tests/x.py")
    path = tmp_path / c.LOG_TEST_OUTPUT
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    pred = {"instance_id": "ref", "model_name_or_path": "ref", "model_patch": "diff --git a/x b/x\n"}
    return bool(H.grading.get_eval_report(spec, pred, str(path), include_tests_status=True)["ref"]["resolved"])


def ours(repo: str, output: str, exit_code: int | None, timed_out: bool, f2p: list[str], p2p: list[str]) -> bool:
    report = grade_test_log(output, f2p, p2p, exit_code=exit_code, timed_out=timed_out, repo=repo,
                            log_parser=runner_spec_for(repo).parser, instance_id="ours")
    verdict = verdict_from_swe_report({**report.to_dict(), "patch_empty": False, "patch_applied": True,
                                       "test_patch_applied": True, "tests_run": True})
    assert verdict.correct == report.resolved
    return verdict.correct


# ------------------------------------------------------------------------------------ log formats

def pytest_log(results: list[tuple[str, str]], tail: str = "", summary: bool = True) -> str:
    """pytest ``-rA`` output: ``-v``-style progress lines, then the short test summary."""
    lines = ["============================= test session starts ==============================",
             "platform linux -- Python 3.9.20, pytest-7.4.4, pluggy-1.5.0", "rootdir: /testbed",
             f"collected {len(results)} items", ""]
    for i, (tid, st) in enumerate(results):
        lines.append(f"{tid} {st} [{100 * (i + 1) // len(results):3d}%]")
    if tail:
        lines.append(tail)
    if summary:
        lines.append("=========================== short test summary info ============================")
        for tid, st in results:
            if st == "SKIPPED":
                lines.append(f"SKIPPED [1] {tid.split('::')[0]}:12: needs network")
            elif st == "FAILED":
                lines.append(f"FAILED {tid} - AssertionError: assert 1 == 2")
            elif st == "ERROR":
                lines.append(f"ERROR {tid} - RuntimeError: boom")
            elif st == "XFAIL":
                lines.append(f"XFAIL {tid} - reason: known bug")
            else:
                lines.append(f"{st} {tid}")
        lines.append("========================= 3 passed, 1 failed in 0.12s ==========================")
    return "\n".join(lines) + "\n"


_DJANGO = {"PASSED": "ok", "FAILED": "FAIL", "ERROR": "ERROR", "SKIPPED": "skipped 'no database'",
           "XFAIL": "expected failure"}


def django_log(results: list[tuple[str, str]], tail: str = "") -> str:
    lines = ["Testing against Django installed in '/testbed/django'", "Importing application auth_tests",
             "System check identified no issues (0 silenced)."]
    lines += [f"{tid} ... {_DJANGO[st]}" for tid, st in results]
    if tail:
        lines.append(tail)
    lines += ["", "=" * 70]
    for tid, st in results:
        if st in ("FAILED", "ERROR"):
            lines += [f"{'FAIL' if st == 'FAILED' else 'ERROR'}: {tid}", "-" * 70, "Traceback ...", ""]
    lines += ["-" * 70, f"Ran {len(results)} tests in 0.031s", ""]
    return "\n".join(lines) + "\n"


_SYMPY = {"PASSED": "ok", "FAILED": "F", "ERROR": "E", "SKIPPED": "s", "XFAIL": "f"}


def sympy_log(results: list[tuple[str, str]], tail: str = "", file: str = "sympy/core/tests/test_basic.py") -> str:
    lines = ["============================= test process starts ==============================",
             "executable:         /opt/miniconda3/envs/testbed/bin/python  (3.9.20-final-0) [CPython]",
             f"{file}[{len(results)}] "]
    lines += [f"{tid} {_SYMPY[st]}" for tid, st in results]
    if tail:
        lines.append(tail)
    for tid, st in results:
        if st in ("FAILED", "ERROR"):
            lines.append(f"{'_' * 20} {file}:{tid} {'_' * 20}")
    lines.append("============= tests finished: 3 passed, 1 failed, in 0.20 seconds ==============")
    return "\n".join(lines) + "\n"


def names(family: str) -> list[str]:
    if family == "django":
        return [f"test_{n} (auth_tests.test_views.LoginTest)" for n in "abcde"]
    if family == "sympy":
        return [f"test_{n}" for n in "abcde"]
    return [f"tests/test_core.py::test_{n}" for n in "abc"] + ["tests/test_core.py::TestK::test_d",
                                                              "tests/test_core.py::test_e[1-2]"]


def fmt(family: str, results: list[tuple[str, str]], tail: str = "", summary: bool = True) -> str:
    if family == "django":
        return django_log(results, tail)
    if family == "sympy":
        return sympy_log(results, tail)
    return pytest_log(results, tail, summary)


# Scenario: (name, statuses of a, b, c, d, e, extra text, exit code, timed out, cut the summary).
# a, b are FAIL_TO_PASS; c, d PASS_TO_PASS; e is not listed.
SCENARIOS = [
    ("all pass", "PPPPP", "", 0, False, False),
    ("a FAIL_TO_PASS fails", "PFPPP", "", 1, False, False),
    ("a PASS_TO_PASS fails", "PPPFP", "", 1, False, False),
    ("a PASS_TO_PASS errors", "PPPEP", "", 1, False, False),
    ("an unlisted test fails", "PPPPF", "", 1, False, False),
    ("crash after PASSED lines", "PPPPP", "Fatal Python error: Segmentation fault\nSegmentation fault (core dumped)",
     139, False, False),
    ("INTERNALERROR", "PPPPP", "INTERNALERROR> Traceback (most recent call last):\nINTERNALERROR> KeyError: 'x'",
     3, False, False),
    ("non-zero exit, no failure", "PPPPP", "", 1, False, False),
    ("timed out", "PPPPP", "", None, True, False),
    ("timed out with a status", "PPPPP", "", 137, True, False),
    ("a PASS_TO_PASS skipped", "PPSPP", "", 0, False, False),
    ("a FAIL_TO_PASS skipped", "SPPPP", "", 0, False, False),
    ("a FAIL_TO_PASS xfail", "XPPPP", "", 0, False, False),
    ("a PASS_TO_PASS xfail", "PPXPP", "", 0, False, False),
    ("exit status unknown", "PPPPP", "", None, False, False),
    ("summary cut off", "PPPPP", "", None, False, True),
]
_CODE = {"P": "PASSED", "F": "FAILED", "E": "ERROR", "S": "SKIPPED", "X": "XFAIL"}
FAMILIES = [(repo, "pytest") for repo in PYTEST_REPOS] + [("django/django", "django"), ("sympy/sympy", "sympy")]


def scenario_case(repo: str, family: str, scenario: tuple) -> tuple[str, int | None, bool, list[str], list[str]]:
    _, codes, tail, exit_code, timed_out, cut = scenario
    tests = names(family)
    output = fmt(family, [(t, _CODE[c]) for t, c in zip(tests, codes, strict=True)], tail, summary=not cut)
    return output, exit_code, timed_out, tests[:2], tests[2:4]


@pytest.mark.parametrize("repo,family", FAMILIES, ids=[r for r, _ in FAMILIES])
def test_scenarios_agree_with_the_harness(tmp_path, repo, family):
    for scenario in SCENARIOS:
        output, code, timed_out, f2p, p2p = scenario_case(repo, family, scenario)
        want = reference_resolved(tmp_path, repo, output, code, timed_out, f2p, p2p)
        got = ours(repo, output, code, timed_out, f2p, p2p)
        assert got == want, (repo, scenario[0], got, want)
        # the runs the issue lists: never resolved, whatever the parser
        if scenario[0] in ("crash after PASSED lines", "INTERNALERROR", "non-zero exit, no failure", "timed out",
                           "timed out with a status", "a FAIL_TO_PASS fails", "a PASS_TO_PASS fails",
                           "a FAIL_TO_PASS skipped"):
            assert not got, (repo, scenario[0])
    clean = scenario_case(repo, family, SCENARIOS[0])
    assert ours(repo, *clean)                                   # the clean run is resolved in every family


# ------------------------------------------------------------------------------------ hand-written logs

# (repo, test output, exit code, timed out, FAIL_TO_PASS, PASS_TO_PASS, expected verdict)
DJANGO_311 = """\
test_login (auth_tests.test_views.LoginTest.test_login) ... ok
test_logout (auth_tests.test_views.LoginTest.test_logout)
Logging out redirects to the login page. ... ok
"""
HAND = [
    # pytest: parametrised ids with spaces and brackets, as the data set spells them per parser
    ("pytest-dev/pytest", "PASSED testing/test_x.py::test_p[a b]\nPASSED testing/test_x.py::test_q[[1, 2]]\n", 0, False,
     ["testing/test_x.py::test_p[a"], ["testing/test_x.py::test_q[[1,"], True),
    ("pytest-dev/pytest", "PASSED testing/test_x.py::test_p[a b]\n", 0, False, ["testing/test_x.py::test_p[a b]"], [], False),
    ("sphinx-doc/sphinx", "PASSED tests/test_x.py::test_p[a b]\n", 0, False, ["tests/test_x.py::test_p[a b]"], [], True),
    ("pydata/xarray", "PASSED xarray/tests/test_a.py::test_r[1-2]\nFAILED xarray/tests/test_a.py::test_r[c - d] - assert\n",
     1, False, ["xarray/tests/test_a.py::test_r[1-2]"], ["xarray/tests/test_a.py::test_r[c"], False),
    # a truncated parametrised id in the data set (harness issue #290): prefix match
    ("astropy/astropy", "PASSED astropy/units/tests/test_format.py::test_ogip_grammar_fail[log(photon /cm2)]\n", 0, False,
     ["astropy/units/tests/test_format.py::test_ogip_grammar_fail[log(photon"], [], True),
    # requests / pylint: a long path option is listed by its last part
    ("psf/requests", "PASSED tests/test_requests.py::test_x[/tmp/pytest-of-root/pytest-0/f.txt]\n", 0, False,
     ["tests/test_requests.py::test_x[/f.txt]"], [], True),
    ("pylint-dev/pylint", "PASSED tests/test_func.py::test_functional[/testbed/tests/functional/u/unused.py]\n", 0,
     False, ["tests/test_func.py::test_functional[/unused.py]"], [], True),
    # matplotlib: MouseButton.LEFT is listed as 1
    ("matplotlib/matplotlib", "PASSED lib/matplotlib/tests/test_backend_bases.py::test_zoom[MouseButton.LEFT]\n", 0, False,
     ["lib/matplotlib/tests/test_backend_bases.py::test_zoom[1]"], [], True),
    # seaborn: -v lines only
    ("mwaskom/seaborn", "tests/test_core.py::test_a PASSED [ 50%]\ntests/test_core.py::test_b PASSED [100%]\n", 0, False,
     ["tests/test_core.py::test_a"], ["tests/test_core.py::test_b"], True),
    ("mwaskom/seaborn", "tests/test_core.py::test_a PASSED [ 50%]\nFAILED tests/test_core.py::test_b - x\n", 1, False,
     ["tests/test_core.py::test_a"], ["tests/test_core.py::test_b"], False),
    # ANSI colours (sphinx's tox output): the v2 parser strips "ESC[32m", not "ESC[1;32m"
    ("sphinx-doc/sphinx", "\x1b[32mPASSED\x1b[0m tests/test_build.py::test_a\n", 0, False, ["tests/test_build.py::test_a"],
     [], True),
    ("sphinx-doc/sphinx", "\x1b[1;32mPASSED\x1b[0m tests/test_build.py::test_a\n", 0, False,
     ["tests/test_build.py::test_a"], [], False),
    ("pytest-dev/pytest", "\x1b[32mPASSED\x1b[0m testing/test_a.py::test_a\n", 0, False, ["testing/test_a.py::test_a"], [],
     False),
    # django: skipped keeps a PASS_TO_PASS, expected failure / unexpected success are not read
    ("django/django", "test_a (m.tests.T) ... ok\ntest_s (m.tests.T) ... skipped 'no db'\n", 0, False,
     ["test_a (m.tests.T)"], ["test_s (m.tests.T)"], True),
    ("django/django", "test_a (m.tests.T) ... expected failure\n", 0, False, ["test_a (m.tests.T)"], [], False),
    ("django/django", "test_a (m.tests.T) ... ok\ntest_u (m.tests.T) ... unexpected success\n", 1, False,
     ["test_a (m.tests.T)"], [], False),
    ("django/django", "test_a (m.tests.T) ... ok\ntest_b (m.tests.T) ... FAIL\n\nFAIL: test_b (m.tests.T)\n", 1, False,
     ["test_a (m.tests.T)"], [], True),
    # django: output between "..." and "ok"
    ("django/django", "test_noisy (m.tests.T) ... Internal Server Error: /admin/\nok\n", 0, False,
     ["test_noisy (m.tests.T)"], [], True),
    # django on Python 3.11: "test (module.Class.test)" and the docstring line
    ("django/django", DJANGO_311, 0, False, ["test_login (auth_tests.test_views.LoginTest)"], [], False),
    ("django/django", DJANGO_311, 0, False, ["test_login (auth_tests.test_views.LoginTest.test_login)",
                                             "Logging out redirects to the login page."], [], True),
    # sympy: "f" (expected failure) is not read, a test name repeated across files: the last line wins
    ("sympy/sympy", "test_a ok\ntest_b f\n", 0, False, ["test_a"], ["test_b"], False),
    ("sympy/sympy", "sympy/a/tests/test_x.py[1] \ntest_dup F\nsympy/b/tests/test_y.py[1] \ntest_dup ok\n"
     "________ sympy/a/tests/test_x.py:test_dup ________\n", 1, False, ["test_dup"], [], True),
    ("sympy/sympy", "sympy/a/tests/test_x.py[1] \ntest_dup ok\nsympy/b/tests/test_y.py[1] \ntest_dup F\n", 1, False,
     ["test_dup"], [], False),
    ("sympy/sympy", "test_a ok\n", -11, False, ["test_a"], [], False),                    # killed by a signal
    # pytest: a test name repeated across files (ids carry the file: two tests); teardown error after a pass
    ("pydata/xarray", "PASSED xarray/tests/test_a.py::test_same\nFAILED xarray/tests/test_b.py::test_same - x\n", 1, False,
     ["xarray/tests/test_a.py::test_same"], [], True),
    ("pydata/xarray", "PASSED xarray/tests/test_a.py::test_t\nERROR xarray/tests/test_a.py::test_t - teardown\n", 1, False,
     ["xarray/tests/test_a.py::test_t"], [], False),
    # no tests collected / nothing printed
    ("pallets/flask", "collected 0 items\n\n============================ no tests ran in 0.01s ===\n", 5, False,
     ["tests/test_a.py::test_a"], [], False),
    ("pallets/flask", "", 0, False, ["tests/test_a.py::test_a"], [], False),
    ("local/mypkg", "PASSED tests/test_calc.py::test_add\n", 0, False, ["tests/test_calc.py::test_add"], [], True),
]


@pytest.mark.parametrize("case", HAND, ids=[f"{i}-{c[0]}" for i, c in enumerate(HAND)])
def test_hand_written_logs_agree_with_the_harness(tmp_path, case):
    repo, output, code, timed_out, f2p, p2p, expected = case
    want = reference_resolved(tmp_path, repo, output, code, timed_out, f2p, p2p)
    got = ours(repo, output, code, timed_out, f2p, p2p)
    assert (got, want) == (expected, expected)


# ------------------------------------------------------------------------------------ the glue itself

def test_harness_log_form_and_report_fields():
    c = H.constants
    text = harness_log("PASSED t.py::a\n", exit_code=1)
    assert text.splitlines() == [c.START_TEST_OUTPUT, "PASSED t.py::a", c.END_TEST_OUTPUT, f"{c.TEST_EXIT_CODE}: 1"]
    assert c.TESTS_TIMEOUT in harness_log("", exit_code=None, timed_out=True)
    assert harness_log("x", exit_code=0, patch_applied=False).strip() == c.APPLY_PATCH_FAIL
    report = grade_test_log("PASSED t.py::a\n", ["t.py::a"], [], exit_code=139, repo="pydata/xarray")
    assert not report.resolved and report.log_valid is False and report.resolution == "RESOLVED_NO"
    assert report.fail_to_pass_failed == ["t.py::a"] and report.statuses == {"t.py::a": "PASSED"}
    assert report.harness == f"swebench {swebench_version()}" and report.log_parser == "parse_log_xarray"
    verdict = verdict_from_swe_report({**report.to_dict(), "tests_run": True, "patch_applied": True})
    assert verdict.grade == "unresolved" and "no valid test run" in verdict.detail
    assert verdict.extra["harness"] == report.harness
    partial = grade_test_log("PASSED t.py::a\nFAILED t.py::b - x\n", ["t.py::a", "t.py::b"], [], exit_code=1)
    assert partial.resolution == "RESOLVED_PARTIAL" and not partial.resolved
    assert parse_test_log("PASSED t.py::a b\n", repo="sphinx-doc/sphinx") == {"t.py::a b": "PASSED"}


def test_parsers_come_from_the_harness_by_repository():
    registry = H.log_parsers.PARSER_REGISTRY
    for repo, fn in H.python_parsers.MAP_REPO_TO_PARSER_PY.items():
        assert registry[parser_for(repo)] is fn, repo
    assert parser_for("someone/else") == "parse_log_pytest"       # our fallback for unknown repositories
    assert parser_for("django/django", "pytest") == "parse_log_pytest"


def test_pinned_version_is_installed_and_heavy_deps_not_imported():
    import sys

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"swebench=={SWEBENCH_PIN}" in project["project"]["optional-dependencies"]["swebench"]
    assert swebench_version() == SWEBENCH_PIN == H.version
    for image in ("cpu", "cuda", "vllm"):
        assert f'--no-deps "swebench=={SWEBENCH_PIN}"' in (ROOT / "images" / f"{image}.Dockerfile").read_text()
    assert f"'swebench=={SWEBENCH_PIN}'" in (ROOT / "Makefile").read_text()
    harness_test_spec({"instance_id": "a__b-1", "repo": "a/b", "FAIL_TO_PASS": ["t"], "PASS_TO_PASS": [],
                       "eval_script": f": '{H.constants.START_TEST_OUTPUT}'\npytest\n: '{H.constants.END_TEST_OUTPUT}'"})
    loaded = {name.split(".")[0] for name in sys.modules}
    assert not loaded & {"modal", "ghapi", "git"}, loaded & {"modal", "ghapi", "git"}
    assert "swebench.harness.docker_utils" not in sys.modules and "swebench.harness.run_evaluation" not in sys.modules
    assert "swebench.harness.utils" not in sys.modules         # make_test_spec is compiled from it, not imported
    # docker too: in a fresh interpreter (this one may hold it from unrelated tests), see
    # tests/eval/test_swe_eval_script.py::test_docker_and_modal_are_never_imported
