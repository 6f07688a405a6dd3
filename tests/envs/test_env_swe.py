"""The `swe` environment and its grading, on a tiny local git repository in real bwrap sandboxes.

A small package with a bug (`clamp` ignores its upper bound) at a base commit; a later commit holds
the fix (the sandbox must not see it). The test patch adds `test_clamp_high` (FAIL_TO_PASS); the
existing tests are PASS_TO_PASS. pytest runs inside the sandbox with the system python and this
venv's pytest on PYTHONPATH (the venv's own interpreter lives under /root, which the sandbox user
cannot enter).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sao_core.envs import Task, make_env
from sao_core.envs.swe import (
    SUBMIT_SENTINEL,
    SWEEnv,
    SWEInstance,
    bundle_at_commit,
    grade_patch,
    parse_bash_call,
    swebench_image,
    task_from_swe_record,
)
from sao_core.envs.swe_grading import (
    apply_patch,
    django_test_labels,
    grade,
    parse_test_log,
    patch_files,
    runner_spec_for,
)
from sao_core.sandbox.base import SandboxLimits

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAVE_BWRAP,
    reason="bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap",
)

CALC = '''def add(a, b):
    return a + b


def clamp(x, lo, hi):
    """Clamp x into [lo, hi]."""
    return max(lo, x)
'''
CALC_FIXED = CALC.replace("return max(lo, x)", "return max(lo, min(x, hi))")
TESTS = '''from mypkg.calc import add, clamp


def test_add():
    assert add(2, 3) == 5


def test_clamp_low():
    assert clamp(-5, 0, 10) == 0
'''
TESTS_NEW = TESTS + '''

def test_clamp_high():
    assert clamp(50, 0, 10) == 10
'''
F2P = ["tests/test_calc.py::test_clamp_high"]
P2P = ["tests/test_calc.py::test_add", "tests/test_calc.py::test_clamp_low"]


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def _diff_for(repo: Path, path: str, new_text: str) -> str:
    """A git patch (against HEAD) that turns `path` into `new_text`; the work tree is left clean."""
    (repo / path).write_text(new_text)
    out = _git(repo, "diff")
    _git(repo, "checkout", "--", path)
    return out


@pytest.fixture(scope="module")
def swe_repo(tmp_path_factory):
    """(repo path, base sha, gold patch, test patch, fix-commit sha)."""
    repo = tmp_path_factory.mktemp("swe") / "repo"
    (repo / "mypkg").mkdir(parents=True)
    (repo / "tests").mkdir()
    (repo / "mypkg" / "__init__.py").write_text("")
    (repo / "mypkg" / "calc.py").write_text(CALC)
    (repo / "tests" / "test_calc.py").write_text(TESTS)
    (repo / ".gitignore").write_text("__pycache__/\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    gold = _diff_for(repo, "mypkg/calc.py", CALC_FIXED)
    test_patch = _diff_for(repo, "tests/test_calc.py", TESTS_NEW)
    (repo / "mypkg" / "calc.py").write_text(CALC_FIXED)   # the upstream fix, after the base commit
    _git(repo, "commit", "-q", "-am", "fix clamp")
    fix = _git(repo, "rev-parse", "HEAD").strip()
    return repo, base, gold, test_patch, fix


@pytest.fixture(scope="module")
def sandbox_python():
    """(python, env) with which `python -m pytest` works inside the sandbox, found once."""
    if not HAVE_BWRAP:
        pytest.skip("bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap")
    from sao_core.sandbox.local import LocalSandbox

    site = str(Path(pytest.__file__).resolve().parent.parent)
    env = {"PYTHONPATH": site, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    # The site-packages may sit under the host's /tmp (a fresh clone in CI), which the jail hides.
    with LocalSandbox(SandboxLimits(wall_seconds=20), env=env, ro_paths=[site]) as box:
        for cand in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
            if cand and box.exec([cand, "-c", "import pytest"]).ok:
                return cand, env, site
    pytest.fail(f"no python in the sandbox can import pytest from {site}")


@pytest.fixture
def factory(sandbox_python):
    from sao_core.sandbox.local import LocalSandbox

    _, env, site = sandbox_python
    made = []

    def make():
        box = LocalSandbox(SandboxLimits(wall_seconds=30, cpu_seconds=60, memory_mb=2048, max_processes=128),
                           env=env, ro_paths=[site])
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()


@pytest.fixture
def test_command(sandbox_python):
    return f"{sandbox_python[0]} -m pytest -rA -p no:cacheprovider"


@pytest.fixture
def repos_root(swe_repo) -> str:
    """The operator's repository root (`repo_source`) that holds the test repository: rows may only
    name repositories inside it."""
    return str(swe_repo[0].parent)


@pytest.fixture
def task(swe_repo):
    repo, base, gold, test_patch, _ = swe_repo
    record = {
        "id": "local__mypkg-1",
        "repo": "local/mypkg",
        "base_commit": base,
        "problem_statement": "clamp(x, lo, hi) ignores hi: clamp(50, 0, 10) returns 50, expected 10.",
        "gold_patch": gold,
        "test_patch": test_patch,
        "fail_to_pass": F2P,
        "pass_to_pass": P2P,
        "version": "0.1",
    }
    return task_from_swe_record(record, repo_path=str(repo))


# ------------------------------------------------------------------------------------ pure parts

REALISTIC_LOG = """\
============================= test session starts ==============================
platform linux -- Python 3.9.19, pytest-7.4.4, pluggy-1.5.0
rootdir: /testbed
collected 9 items

tests/test_io.py::test_read[a b] PASSED                                  [ 11%]
tests/test_io.py::test_skip_me SKIPPED (needs network)                   [ 22%]
tests/test_io.py::TestC::test_m[x-1] PASSED                              [ 33%]

==================================== ERRORS ====================================
_________________________ ERROR at setup of test_conn __________________________
E   RuntimeError: no db
=================================== FAILURES ===================================
____________________________ test_parse[c - d] ______________________________
E       AssertionError: assert 'c - d' == 'c'
==================================== PASSES ====================================
=========================== short test summary info ============================
PASSED tests/test_io.py::test_read[a b]
PASSED tests/test_io.py::TestC::test_m[x-1]
PASSED tests/test_io.py::test_path[/tmp/pytest-of-root/pytest-0/data.csv]
PASSED tests/test_io.py::test_teardown
SKIPPED [1] tests/test_io.py:40: needs network
XFAIL tests/test_io.py::test_known - bug #12
ERROR tests/test_io.py::test_conn - RuntimeError: no db
ERROR tests/test_io.py::test_teardown - RuntimeError: teardown
FAILED tests/test_io.py::test_parse[c - d] - AssertionError: assert 'c - d' == 'c'
\x1b[31mFAILED\x1b[0m tests/test_io.py::test_color - assert 0
ERROR tests/test_broken.py - ImportError: cannot import name 'x'
===== 2 failed, 4 passed, 1 skipped, 1 xfailed, 3 errors in 0.52s =====
"""


def test_parse_test_log_is_the_harness_parser():
    """The parsers are swebench's: ids are cut at the first space (as the SWE-bench data set spells
    them), the last line of a test wins, a coloured status word is not read, -v lines are not read."""
    st = parse_test_log(REALISTIC_LOG)                                 # unknown repo: parse_log_pytest
    assert st["tests/test_io.py::test_read[a"] == "PASSED"
    assert st["tests/test_io.py::TestC::test_m[x-1]"] == "PASSED"
    assert st["tests/test_io.py::test_known"] == "XFAIL"
    assert st["tests/test_io.py::test_conn"] == "ERROR"
    assert st["tests/test_io.py::test_teardown"] == "ERROR"           # passed, then teardown error
    assert st["tests/test_io.py::test_parse[c"] == "FAILED"
    assert st["tests/test_broken.py"] == "ERROR"                       # collection error
    assert "tests/test_io.py::test_skip_me" not in st and "tests/test_io.py::test_color" not in st
    assert not any(k.startswith("[1]") for k in st)                    # -rA skip line has no id
    assert parse_test_log(REALISTIC_LOG, "pytest") == st
    # requests' parser (parse_log_pytest_options) names a long path option by its last part
    assert parse_test_log(REALISTIC_LOG, repo="psf/requests")["tests/test_io.py::test_path[/data.csv]"] == "PASSED"
    with pytest.raises(ValueError, match="unknown log parser"):
        parse_test_log("", "nope")


def test_grade_status_map_by_the_harness():
    st = parse_test_log(REALISTIC_LOG)
    report = grade(st, ["tests/test_io.py::test_read[a", "tests/test_io.py::test_known"],
                   ["tests/test_io.py::TestC::test_m[x-1]", "tests/test_io.py::test_nowhere"])
    assert not report.resolved and report.resolution == "RESOLVED_NO"
    assert (report.fail_to_pass_total, report.fail_to_pass_passed) == (2, 2)       # XFAIL passes
    assert (report.pass_to_pass_total, report.pass_to_pass_passed) == (2, 1)
    assert report.pass_to_pass_failed == ["tests/test_io.py::test_nowhere"]
    assert report.statuses["tests/test_io.py::test_nowhere"] == "MISSING"
    assert grade(st, ["tests/test_io.py::test_read[a"], []).resolved
    report = grade({"t::skip": "SKIPPED", "t::ok": "PASSED"}, ["t::ok"], ["t::skip"])
    assert report.resolved                                              # a skipped PASS_TO_PASS is kept
    report = grade({"t::skip": "SKIPPED"}, ["t::skip"], [])
    assert not report.resolved and report.failed_tests == ["t::skip"]   # a skipped FAIL_TO_PASS fails
    assert not grade({}, [], []).resolved                              # nothing ran
    assert json.dumps(report.to_dict())


def test_parse_django_and_sympy_logs():
    django = """\
test_basic (auth_tests.test_views.LoginTest) ... ok
test_fail (auth_tests.test_views.LoginTest) ... FAIL
test_err (auth_tests.test_views.LoginTest) ... ERROR
test_skip (auth_tests.test_views.LoginTest) ... skipped 'no db'
test_xf (auth_tests.test_views.LoginTest) ... expected failure
test_noisy (auth_tests.test_views.LoginTest) ... System check identified no issues (0 silenced).
ok
test_new (m.tests.T.test_new) ... ok
A docstring first line. ... ok
======================================================================
FAIL: test_fail (auth_tests.test_views.LoginTest)
"""
    st = parse_test_log(django, repo="django/django")
    assert st["test_basic (auth_tests.test_views.LoginTest)"] == "PASSED"
    assert st["test_fail (auth_tests.test_views.LoginTest)"] == "FAILED"
    assert st["test_err (auth_tests.test_views.LoginTest)"] == "ERROR"
    assert st["test_skip (auth_tests.test_views.LoginTest)"] == "SKIPPED"
    assert "test_xf (auth_tests.test_views.LoginTest)" not in st      # the harness reads no "expected failure"
    assert st["test_noisy (auth_tests.test_views.LoginTest)"] == "PASSED"
    assert st["A docstring first line."] == "PASSED"
    assert not grade(st, ["test_new (m.tests.T)"], []).resolved       # no Python 3.11 spelling alias
    assert django_test_labels(["tests/auth_tests/test_views.py", "tests/x/__init__.py", "docs/a.txt"]) == [
        "auth_tests.test_views", "x"]
    sympy = """\
sympy/core/tests/test_basic.py[3]
test_a ok
test_b F
test_c E
test_d f
________________________________ sympy/core/tests/test_basic.py:test_b ________________________________
"""
    st = parse_test_log(sympy, repo="sympy/sympy")
    assert st == {"test_a": "PASSED", "test_b": "FAILED", "test_c": "ERROR",
                  "sympy/core/tests/test_basic.py:test_b": "FAILED"}       # "f" (expected failure): not read
    assert runner_spec_for("django/django").parser == "parse_log_django"
    assert runner_spec_for("sympy/sympy").parser == "parse_log_sympy"
    assert runner_spec_for("sphinx-doc/sphinx").parser == "parse_log_sphinx"
    assert runner_spec_for("local/mypkg").parser == "parse_log_pytest"     # not a SWE-bench repository
    assert runner_spec_for("pallets/flask").command.startswith("python -m pytest -rA")


def test_tool_call_parsing_and_helpers():
    assert parse_bash_call('{"name": "bash", "arguments": {"command": "ls"}}') == ("ls", None)
    assert parse_bash_call('{"name": "bash", "arguments": "{\\"command\\": \\"pwd\\"}"}') == ("pwd", None)
    assert parse_bash_call('{"name": "bash", "arguments": {"command": "a\nb"}}')[0] == "a\nb"
    assert parse_bash_call("{nope")[1].startswith("error:")
    assert parse_bash_call('{"name": "python", "arguments": {"code": "1"}}')[1].startswith("error: unknown tool")
    assert parse_bash_call('{"name": "bash", "arguments": {}}')[1].startswith("error:")
    assert swebench_image("django__django-11099") == "docker.io/swebench/sweb.eval.x86_64.django_1776_django-11099:latest"
    patch = "diff --git a/x.py b/x.py\n--- a/x.py\n+++ b/x.py\ndiff --git a/y.py b/y.py\ndeleted file mode 100644\n"
    assert patch_files(patch) == [("x.py", False), ("y.py", True)]


def test_instance_from_raw_swebench_metadata():
    task = Task(id="o__r-1", env="swe", prompt=[{"role": "user", "content": "issue"}],
                metadata={"repo": "o/r", "base_commit": "abc", "test_patch": "",
                          "FAIL_TO_PASS": json.dumps(["t::a"]), "PASS_TO_PASS": "[]"})
    inst = SWEInstance.from_task(task)
    assert inst.fail_to_pass == ("t::a",) and inst.pass_to_pass == () and not inst.local
    assert inst.repo_dir == "/testbed" and inst.problem_statement == "issue"
    with pytest.raises(ValueError):
        SWEInstance.from_task(Task(id="x", env="swe", prompt=[], metadata={}))
    # without a repo_path the repository is in the instance image: a local sandbox cannot do that
    with pytest.raises(ValueError, match="sandbox_kind='kubernetes'"):
        SWEEnv().reset(task)
    assert SWEInstance.from_task(task, repo_source="image").repo_path is None


# ------------------------------------------------------------------------------------ in the sandbox

@needs_bwrap
def test_grade_patch_gold_empty_breaking_malformed(task, factory, test_command, swe_repo, repos_root):
    _, _, gold, _, _ = swe_repo
    report = grade_patch(task, gold, factory, test_command=test_command, repo_source=repos_root)
    assert report.resolved, report.to_dict()
    assert report.apply_method == "git apply" and report.test_patch_applied
    assert (report.fail_to_pass_passed, report.pass_to_pass_passed) == (1, 2)
    # a record without the harness's eval_script: our own command ran (the fallback), and the report says so
    assert (report.test_command_source, report.test_command) == ("fallback", f"{test_command} tests/test_calc.py")
    assert "no eval_script" in report.fallback_reason and report.eval_script_sha256 is None

    report = grade_patch(task, "", factory, test_command=test_command, repo_source=repos_root)
    assert not report.resolved and report.patch_empty and report.tests_run
    assert report.fail_to_pass_failed == F2P and report.pass_to_pass_failed == []

    broken_add = (
        "diff --git a/mypkg/calc.py b/mypkg/calc.py\n--- a/mypkg/calc.py\n+++ b/mypkg/calc.py\n"
        "@@ -1,7 +1,7 @@\n def add(a, b):\n-    return a + b\n+    return a - b\n \n \n def clamp(x, lo, hi):\n"
        '     """Clamp x into [lo, hi]."""\n-    return max(lo, x)\n+    return max(lo, min(x, hi))\n'
    )
    report = grade_patch(task, broken_add, factory, test_command=test_command, repo_source=repos_root)
    assert not report.resolved and report.patch_applied
    assert report.fail_to_pass_failed == [] and report.pass_to_pass_failed == ["tests/test_calc.py::test_add"]

    malformed = ("diff --git a/mypkg/calc.py b/mypkg/calc.py\n--- a/mypkg/calc.py\n+++ b/mypkg/calc.py\n"
                 "@@ -1,2 +1,2 @@\n-this line is not in the file\n+nor this one\n context\n")
    report = grade_patch(task, malformed, factory, test_command=test_command, repo_source=repos_root)
    assert not report.resolved and report.patch_applied is False and not report.tests_run
    assert report.error == "the patch does not apply" and report.test_command_source == "fallback"
    assert "git apply --verbose --reject" in report.apply_log and "patch --batch" in report.apply_log


@needs_bwrap
def test_apply_patch_fallbacks_and_rollback(task, factory, swe_repo, repos_root):
    from sao_core.envs.swe import prepare_repository

    repo, base, gold, _, fix = swe_repo
    box = factory()
    shell, sha = prepare_repository(box, SWEInstance.from_task(task, repos_root))
    assert sha == base
    # the sandbox has the history up to the base commit only: the upstream fix is not there
    log = shell.run("git log --all --format=%H").stdout.split()
    assert log == [base] and fix not in log
    # context that is slightly off: git apply refuses, patch --fuzz applies it
    fuzzy = gold.replace('     """Clamp x into [lo, hi]."""', '     """Clamp x into [lo; hi]."""')
    assert fuzzy != gold
    ok, method, out = apply_patch(shell, fuzzy)
    assert ok and method == "patch", out
    assert "min(x, hi)" in box.read_file("mypkg/calc.py").decode()
    shell.run("git checkout -q -- . && git clean -fdq")
    # one good file and one impossible hunk: every method fails and the tree is as before
    half = gold + ("diff --git a/tests/test_calc.py b/tests/test_calc.py\n--- a/tests/test_calc.py\n"
                   "+++ b/tests/test_calc.py\n@@ -1,2 +1,2 @@\n-no such line\n+x\n no such context\n")
    ok, method, out = apply_patch(shell, half)
    assert not ok and method is None
    status = shell.run("git status --porcelain").stdout
    assert status.strip() == "", status


@needs_bwrap
def test_episode_fix_and_submit(task, factory, test_command, repos_root):
    env = make_env("swe", sandbox_factory=factory, test_command=test_command, max_turns=10,
                   repo_source=repos_root)
    assert isinstance(env, SWEEnv)
    try:
        messages = env.reset(task)
        assert messages[0]["role"] == "system" and SUBMIT_SENTINEL in messages[0]["content"]
        assert '"name": "bash"' in messages[0]["content"]
        assert messages[-1]["role"] == "user" and "clamp(50, 0, 10)" in messages[-1]["content"]

        call = '<tool_call>{"name": "bash", "arguments": {"command": "cat mypkg/calc.py"}}</tool_call>'
        step = env.step("Let me look.\n" + call)
        assert not step.done and "return max(lo, x)" in step.observation and "[exit code 0]" in step.observation

        sed = json.dumps({"name": "bash", "arguments": {
            "command": "sed -i 's/return max(lo, x)/return max(lo, min(x, hi))/' mypkg/calc.py && git diff --stat"}})
        step = env.step(f"<think>fix it</think><tool_call>{sed}</tool_call>")
        assert not step.done and "calc.py" in step.observation

        step = env.step(f"Done. {SUBMIT_SENTINEL}")
        assert step.done and step.finish_reason == "stop" and step.reward == 1.0, step.info
        assert step.info["resolved"] and step.info["failed_tests"] == []
        assert "+    return max(lo, min(x, hi))" in step.info["patch"]
        assert step.info["grade"]["fail_to_pass_passed"] == 1
        assert env.sandbox is None            # the agent's sandbox is closed before grading
    finally:
        env.close()


@needs_bwrap
def test_episode_wrong_fix_errors_and_in_place_grading(task, factory, test_command, repos_root):
    env = SWEEnv(sandbox_factory=factory, test_command=test_command, max_turns=10, grade_in_place=True,
                 repo_source=repos_root)
    try:
        env.reset(task)
        step = env.step('<tool_call>{"name": "bash", "arguments": {"command": "ls" </tool_call>')
        assert not step.done and step.observation.startswith("error: the tool call is not valid JSON")
        step = env.step('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>')
        assert not step.done and step.observation.startswith("error: unknown tool")
        step = env.step("I am thinking out loud.")
        assert not step.done and step.observation.startswith("error: no tool call")
        step = env.step('<tool_call>{"name": "bash", "arguments": {"command": "exit 3"}}</tool_call>')
        assert not step.done and step.observation == "[exit code 3]"
        # a wrong fix (clamps to hi - 1), and the model also rewrites the tests: they are reset
        wrong = json.dumps({"name": "bash", "arguments": {"command":
            "sed -i 's/return max(lo, x)/return max(lo, min(x, hi - 1))/' mypkg/calc.py && "
            "echo 'def test_nothing(): pass' > tests/test_calc.py && mkdir -p ~/.cache && touch ~/.cache/junk"}})
        submit = json.dumps({"name": "bash", "arguments": {"command": "submit"}})
        step = env.step(f"<tool_call>{wrong}</tool_call><tool_call>{submit}</tool_call>")
        assert step.done and step.finish_reason == "stop" and step.reward == 0.0
        assert step.info["failed_tests"] == F2P
        assert "test_nothing" in step.info["patch"] and "junk" not in step.info["patch"]   # HOME is in .git
        with pytest.raises(RuntimeError):
            env.step("again")
    finally:
        env.close()


@needs_bwrap
def test_episode_max_turns_timeout_and_tool_error(task, factory, test_command, repos_root):
    env = SWEEnv(sandbox_factory=factory, test_command=test_command, max_turns=2, command_timeout_s=1,
                 repo_source=repos_root)
    try:
        env.reset(task)
        step = env.step('<tool_call>{"name": "bash", "arguments": {"command": "echo hi; sleep 20"}}</tool_call>')
        assert not step.done and step.observation.endswith("[timed out after 1 s]") and "hi" in step.observation
        step = env.step('<tool_call>{"name": "bash", "arguments": {"command": "true"}}</tool_call>')
        assert step.done and step.finish_reason == "length" and step.reward == 0.0
    finally:
        env.close()
    assert env.sandbox is None

    env = SWEEnv(sandbox_factory=factory, test_command=test_command, repo_source=repos_root)
    try:
        env.reset(task)
        env.sandbox.close()    # the sandbox dies under the episode
        step = env.step('<tool_call>{"name": "bash", "arguments": {"command": "ls"}}</tool_call>')
        assert step.done and step.finish_reason == "tool_error" and "SandboxError" in step.info["error"]
    finally:
        env.close()


def test_bundle_rejects_unknown_commit(swe_repo):
    repo, base, _, _, _ = swe_repo
    data, sha = bundle_at_commit(str(repo), base)
    assert sha == base and data.startswith(b"# v2 git bundle")
    with pytest.raises(ValueError):
        bundle_at_commit(str(repo), "0" * 40)


def test_repo_source_mirror_dir_and_kubernetes_factory(tmp_path, swe_repo, monkeypatch):
    from sao_core.envs.swe import default_sandbox_factory
    from sao_core.sandbox import kubernetes as kube

    repo = swe_repo[0]
    # a mirror inside the root may be a link to another place inside it; one that leads out is refused
    shutil.copytree(repo, tmp_path / "store" / "mypkg", symlinks=True)
    (tmp_path / "local__mypkg").symlink_to(tmp_path / "store" / "mypkg")
    task = Task(id="local__mypkg-2", env="swe", prompt=[], tests=F2P,
                metadata={"repo": "local/mypkg", "base_commit": swe_repo[1], "test_patch": ""})
    got = SWEInstance.from_task(task, repo_source=str(tmp_path)).repo_path
    assert got == os.path.realpath(tmp_path / "store" / "mypkg")
    (tmp_path / "local__mypkg").unlink()
    (tmp_path / "local__mypkg").symlink_to(repo)
    with pytest.raises(ValueError, match="metadata.repo='local/mypkg'.*outside the repository root"):
        SWEInstance.from_task(task, repo_source=str(tmp_path))
    with pytest.raises(ValueError, match="no local mirror"):
        SWEInstance.from_task(Task(id="a", env="swe", prompt=[], tests=F2P, metadata={"repo": "o/none"}),
                              repo_source=str(tmp_path))

    made = {}

    class FakePod:
        def __init__(self, image, limits, **kw):
            made.update(image=image, limits=limits, **kw)

    monkeypatch.setattr(kube, "KubernetesPodSandbox", FakePod)
    make = default_sandbox_factory("kubernetes", {"memory_mb": 8192}, {"namespace": "swe"})
    make(Task(id="django__django-11099", env="swe", prompt=[], metadata={}))
    assert made["image"] == swebench_image("django__django-11099")
    assert made["workdir"] == "/testbed" and made["mount_workdir"] is False
    assert made["namespace"] == "swe" and made["limits"].memory_mb == 8192


@needs_bwrap
def test_repo_shell_moves_files_past_the_output_cap(sandbox_python):
    from sao_core.envs.swe_grading import RepoShell
    from sao_core.sandbox.local import LocalSandbox

    payload = os.urandom(50_000)
    with LocalSandbox(SandboxLimits(wall_seconds=20, output_bytes=4096)) as box:
        shell = RepoShell(box)
        assert shell.run("git init -q .").ok
        shell.write_scratch("blob.bin", payload)
        data, cut = shell.read(shell.scratch("blob.bin"))
        assert data == payload and not cut
        data, cut = shell.read(shell.scratch("blob.bin"), max_bytes=10_000)
        assert data == payload[-10_000:] and cut
        assert shell.read(shell.scratch("missing")) == (b"", False)
