"""SWE-bench rows in the swebench 5.x format (``eval_script``, ``image``, ``log_parser``, ``eval_type``) are
graded by running the harness's own eval script: ``make_test_spec`` builds the ``TestSpec`` and its
``eval_script`` is what the sandbox runs; ``get_eval_report`` grades the output. Rows without those fields
fall back to our own commands, named per sample.

Three self-made repositories stand in for a pytest, a Django and a sympy repository: the same test
commands as the real ones (``pytest -rA <file>``, ``./tests/runtests.py --verbosity 2 --settings=test_sqlite
--parallel 1 <labels>``, ``bin/test -C --verbose <file>``) and the output their harness parsers read, and
eval scripts in the shape the harness wrote them for those repositories (conda activation, ``cd /testbed``,
the test-file reset, the test patch in a here-document, the start / end markers). They run in real
bubblewrap sandboxes (the local sandbox: ``/testbed`` and conda adapted, see `adapt_eval_script`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sao_core.data.schemas import SWE_HARNESS_FIELDS
from sao_core.envs.swe import SWEInstance, grade_patch, harness_script_for, task_from_swe_record
from sao_core.envs.swe_grading import adapt_eval_script, grade_harness_log, script_sha256
from sao_core.envs.swebench_harness import HARNESS_ROW_FIELDS, HarnessSpec, harness, harness_test_spec
from sao_core.eval.graders import verdict_from_swe_report
from sao_core.sandbox.base import SandboxLimits

H = harness()
C = H.constants
HAVE_BWRAP = shutil.which("bwrap") is not None
BWRAP_HINT = "bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap"
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason=BWRAP_HINT)
HEREDOC = "EOF_114329324912"
_GIT_ENV = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t",
            "GIT_AUTHOR_DATE": "2026-01-01T00:00:00Z", "GIT_COMMITTER_DATE": "2026-01-01T00:00:00Z"}


def harness_eval_script(base: str, test_files: list[str], test_patch: str, test_cmd: str, pre: tuple[str, ...] = ()) -> str:
    """An eval script in the shape the harness generated for Python repositories (what 5.x rows carry)."""
    reset = f"git checkout {base} {' '.join(test_files)}"
    lines = ["#!/bin/bash", "set -uxo pipefail", "source /opt/miniconda3/bin/activate", "conda activate testbed",
             "cd /testbed", *pre, "git config --global --add safe.directory /testbed", "cd /testbed", "git status",
             "git show", f"git -c core.fileMode=false diff {base}", "source /opt/miniconda3/bin/activate",
             "conda activate testbed", reset, f"git apply -v - <<'{HEREDOC}'\n{test_patch}\n{HEREDOC}",
             f": '{C.START_TEST_OUTPUT}'", test_cmd, f": '{C.END_TEST_OUTPUT}'", reset]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ the repositories

OPS = '''def add(a, b):
    return a + b


def div(a, b):
    return a / b
'''
OPS_TESTS = '''from calc.ops import add, div


def test_add():
    assert add(2, 3) == 5


def test_div():
    assert div(6, 3) == 2
'''
TEXT = '''def capfirst(x):
    """Capitalize the first letter of a string."""
    return x[0].upper() + x[1:]
'''
TEXT_TESTS = '''import unittest

from mini.text import capfirst


class TextTests(unittest.TestCase):
    def test_capfirst(self):
        self.assertEqual(capfirst("hello"), "Hello")

    def test_capfirst_one(self):
        self.assertEqual(capfirst("h"), "H")
'''
RUNTESTS = '''#!/usr/bin/env python
"""Stand-in for Django's tests/runtests.py: its command line, unittest underneath, Django's verbosity-2 lines."""
import argparse
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


class Result(unittest.TextTestResult):
    def getDescription(self, test):
        return f"{test._testMethodName} ({type(test).__module__}.{type(test).__qualname__})"


parser = argparse.ArgumentParser()
parser.add_argument("labels", nargs="*")
parser.add_argument("--verbosity", type=int, default=1)
parser.add_argument("--settings")
parser.add_argument("--parallel", type=int, default=0)
args = parser.parse_args()
print(f"Testing against Django installed in '{os.path.dirname(HERE)}/django'", flush=True)
suite = unittest.defaultTestLoader.loadTestsFromNames(args.labels)
result = unittest.TextTestRunner(verbosity=args.verbosity, resultclass=Result).run(suite)
sys.exit(0 if result.wasSuccessful() else 1)
'''
NUMBERS = '''def igcd(a, b):
    """Greatest common divisor of two integers."""
    while b:
        a, b = b, a % b
    return a
'''
NUMBERS_TESTS = '''from sympy.core.numbers import igcd


def test_igcd():
    assert igcd(12, 18) == 6


def test_igcd_zero():
    assert igcd(0, 5) == 5
'''
BIN_TEST = '''#!/usr/bin/env python
"""Stand-in for sympy's bin/test: its command line and the report lines its parser reads."""
import importlib.util
import os
import sys
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
print("============================= test process starts ==============================")
passed, failed, failures = 0, 0, []
for path in [a for a in sys.argv[1:] if not a.startswith("-")]:
    spec = importlib.util.spec_from_file_location(path[:-3].replace("/", "."), os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tests = [n for n, f in vars(module).items() if n.startswith("test_") and callable(f)]
    print(f"{path}[{len(tests)}] ")
    for name in tests:
        try:
            getattr(module, name)()
        except Exception as exc:
            print(f"{name} {'F' if isinstance(exc, AssertionError) else 'E'}")
            failed += 1
            failures.append((path, name, traceback.format_exc()))
        else:
            print(f"{name} ok")
            passed += 1
for path, name, text in failures:
    print(f"{'_' * 20} {path}:{name} {'_' * 20}")
    print(text)
print(f"============= tests finished: {passed} passed, {failed} failed, in 0.01 seconds =============")
sys.exit(1 if failed else 0)
'''
DJANGO_LOCALE = ("sed -i '/en_US.UTF-8/s/^# //g' /etc/locale.gen", "locale-gen", "export LANG=en_US.UTF-8",
                 "export LANGUAGE=en_US:en", "export LC_ALL=en_US.UTF-8")


@dataclass
class Case:
    instance_id: str
    repo: str
    version: str
    log_parser: str
    files: dict[str, str]
    gold: dict[str, str]
    tests: dict[str, str]
    breaking: dict[str, str]
    test_cmd: str
    fail_to_pass: list[str]
    pass_to_pass: list[str]
    broken: list[str]                     # the PASS_TO_PASS tests the breaking patch breaks
    pre: tuple[str, ...] = ()
    executables: tuple[str, ...] = ()
    base: str = ""
    patches: dict[str, str] = field(default_factory=dict)

    def row(self, **over) -> dict:
        """The instance as a swebench 5.x row."""
        row = {"repo": self.repo, "instance_id": self.instance_id, "base_commit": self.base,
               "patch": self.patches["gold"], "test_patch": self.patches["test"],
               "problem_statement": f"fix {self.instance_id}", "hints_text": "", "created_at": "2026-01-01T00:00:00Z",
               "version": self.version, "FAIL_TO_PASS": json.dumps(self.fail_to_pass),
               "PASS_TO_PASS": json.dumps(self.pass_to_pass), "environment_setup_commit": self.base,
               "difficulty": "<15 min fix",
               "eval_script": harness_eval_script(self.base, sorted(self.tests), self.patches["test"], self.test_cmd,
                                                  self.pre),
               "image": f"swebench/sweb.eval.x86_64.{self.instance_id.replace('__', '_1776_')}:latest",
               "log_parser": self.log_parser, "eval_type": "pass_and_fail"}
        row.update(over)
        return row


def cases() -> list[Case]:
    return [
        Case("pytest-dev__pytest-9001", "pytest-dev/pytest", "7.4", "parse_log_pytest",
             files={"calc/__init__.py": "", "calc/ops.py": OPS, "testing/test_ops.py": OPS_TESTS},
             gold={"calc/ops.py": OPS.replace("    return a / b", "    if b == 0:\n        raise ValueError('zero')\n"
                                                                 "    return a / b")},
             # the comment checks that the here-document (the test patch) reaches git apply unchanged
             tests={"testing/test_ops.py": OPS_TESTS.replace("from calc", "import pytest\n\nfrom calc")
                    + "\n\n# the harness runs this in /testbed\ndef test_div_zero():\n"
                      "    with pytest.raises(ValueError):\n        div(1, 0)\n"},
             breaking={"calc/ops.py": OPS.replace("a + b", "a - b").replace(
                 "    return a / b", "    if b == 0:\n        raise ValueError('zero')\n    return a / b")},
             test_cmd="pytest -rA testing/test_ops.py",
             fail_to_pass=["testing/test_ops.py::test_div_zero"],
             pass_to_pass=["testing/test_ops.py::test_add", "testing/test_ops.py::test_div"],
             broken=["testing/test_ops.py::test_add"]),
        Case("django__django-15001", "django/django", "4.0", "parse_log_django",
             files={"mini/__init__.py": "", "mini/text.py": TEXT, "tests/runtests.py": RUNTESTS,
                    "tests/test_sqlite.py": "DATABASES = {}\n", "tests/utils_tests/__init__.py": "",
                    "tests/utils_tests/test_text.py": TEXT_TESTS},
             gold={"mini/text.py": TEXT.replace("    return x[0]", "    if not x:\n        return x\n    return x[0]")},
             tests={"tests/utils_tests/test_text.py": TEXT_TESTS
                    + '\n    def test_capfirst_empty(self):\n        self.assertEqual(capfirst(""), "")\n'},
             breaking={"mini/text.py": TEXT.replace("    return x[0].upper() + x[1:]",
                                                    "    if not x:\n        return x\n    return x[0].upper() + x[2:]")},
             test_cmd="./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1 utils_tests.test_text",
             fail_to_pass=["test_capfirst_empty (utils_tests.test_text.TextTests)"],
             pass_to_pass=["test_capfirst (utils_tests.test_text.TextTests)",
                           "test_capfirst_one (utils_tests.test_text.TextTests)"],
             broken=["test_capfirst (utils_tests.test_text.TextTests)"],
             pre=DJANGO_LOCALE, executables=("tests/runtests.py",)),
        Case("sympy__sympy-24001", "sympy/sympy", "1.12", "parse_log_sympy",
             files={"sympy/__init__.py": "", "sympy/core/__init__.py": "", "sympy/core/numbers.py": NUMBERS,
                    "sympy/core/tests/__init__.py": "", "sympy/core/tests/test_numbers.py": NUMBERS_TESTS,
                    "bin/test": BIN_TEST},
             gold={"sympy/core/numbers.py": NUMBERS.replace("    return a\n", "    return abs(a)\n")},
             tests={"sympy/core/tests/test_numbers.py": NUMBERS_TESTS
                    + "\n\ndef test_igcd_negative():\n    assert igcd(4, -6) == 2\n"},
             breaking={"sympy/core/numbers.py": NUMBERS.replace("    return a\n", "    return abs(a)\n").replace(
                 "    while b:", "    if not a:\n        return 0\n    while b:")},
             test_cmd="PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose "
                      "sympy/core/tests/test_numbers.py",
             fail_to_pass=["test_igcd_negative"], pass_to_pass=["test_igcd", "test_igcd_zero"],
             broken=["test_igcd_zero"], executables=("bin/test",)),
    ]


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env={**os.environ, **_GIT_ENV}).stdout


def _diff(repo: Path, changes: dict[str, str]) -> str:
    for path, text in changes.items():
        (repo / path).write_text(text)
    out = _git(repo, "diff")
    _git(repo, "checkout", "--", *changes)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """(mirrors dir, cases with base commits and patches); the fix lands after the base commit."""
    mirrors = tmp_path_factory.mktemp("swe5") / "mirrors"
    made = cases()
    for case in made:
        repo = mirrors / case.repo.replace("/", "__")
        for path, text in case.files.items():
            (repo / path).parent.mkdir(parents=True, exist_ok=True)
            (repo / path).write_text(text)
        for path in case.executables:
            (repo / path).chmod(0o755)
        (repo / ".gitignore").write_text("__pycache__/\n.pytest_cache/\n")
        _git(repo, "init", "-q", "-b", "main")
        _git(repo, "add", "-A")
        _git(repo, "commit", "-q", "-m", "base")
        case.base = _git(repo, "rev-parse", "HEAD").strip()
        case.patches = {"gold": _diff(repo, case.gold), "test": _diff(repo, case.tests),
                        "breaking": _diff(repo, case.breaking)}
        for path, text in case.gold.items():
            (repo / path).write_text(text)
        _git(repo, "commit", "-q", "-am", "upstream fix")
    return mirrors, made


@pytest.fixture(scope="module")
def sandbox_env():
    """(env, ro_paths) with which the eval scripts' ``python`` / ``pytest`` work in the local sandbox: a
    world-readable bin dir of two wrappers around a python that imports this venv's pytest."""
    if not HAVE_BWRAP:
        pytest.skip(BWRAP_HINT)
    from sao_core.sandbox.local import LocalSandbox

    site = str(Path(pytest.__file__).resolve().parent.parent)
    base_env = {"PYTHONPATH": site, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    python = None
    with LocalSandbox(SandboxLimits(wall_seconds=20), env=base_env, ro_paths=[site]) as box:
        for candidate in (sys.executable, "/usr/bin/python3", shutil.which("python3")):
            if candidate and box.exec([candidate, "-c", "import pytest"]).ok:
                python = candidate
                break
    if python is None:
        pytest.fail(f"no python in the sandbox can import pytest from {site}")
    bindir = tempfile.mkdtemp(prefix="sao-swe5-bin-", dir="/tmp")
    os.chmod(bindir, 0o755)
    for name, body in (("python", f'exec {python} "$@"'), ("pytest", f'exec {python} -m pytest "$@"')):
        path = os.path.join(bindir, name)
        Path(path).write_text(f"#!/bin/sh\n{body}\n")
        os.chmod(path, 0o755)
    env = {**base_env, "PATH": f"{bindir}:/usr/local/bin:/usr/bin:/bin"}
    yield env, [site, bindir]
    shutil.rmtree(bindir, ignore_errors=True)


@pytest.fixture
def kept(sandbox_env):
    """A sandbox factory whose sandboxes outlive `grade_patch` (to read the script that ran), and the list."""
    from sao_core.sandbox.local import LocalSandbox

    class KeptSandbox(LocalSandbox):
        def close(self) -> None:          # grade_patch closes it: keep it until the test is done
            pass

    env, ro_paths = sandbox_env
    made: list[KeptSandbox] = []

    def make():
        box = KeptSandbox(SandboxLimits(wall_seconds=60, cpu_seconds=120, memory_mb=2048, max_processes=128),
                          env=env, ro_paths=ro_paths)
        made.append(box)
        return box

    yield make, made
    for box in made:
        LocalSandbox.close(box)


def reference(spec, log: str, tmp: Path) -> dict:
    """The harness's own report on `log` (``get_eval_report`` with the row's TestSpec, as run_evaluation)."""
    path = tmp / C.LOG_TEST_OUTPUT
    path.write_text(log, encoding="utf-8")
    pred = {"instance_id": spec.instance_id, "model_name_or_path": "ref", "model_patch": "diff"}
    return H.grading.get_eval_report(spec, pred, str(path), include_tests_status=True)[spec.instance_id]


# ------------------------------------------------------------------------------------ pure parts

def test_make_test_spec_is_the_harness_own():
    """Our make_test_spec is the installed harness's function (same code, same TestSpec), loaded without
    importing swebench/harness/utils.py (which imports datasets and dotenv and calls load_dotenv)."""
    code = r'''
import json, sys
from sao_core.envs.swebench_harness import harness, _harness_package
ours = harness().utils
assert "swebench.harness.utils" not in sys.modules and "dotenv" not in sys.modules
import inspect, importlib
real = importlib.import_module("swebench.harness.utils")
row = {"instance_id": "a__b-1", "image": "img", "repo": "a/b", "version": "1.0", "FAIL_TO_PASS": json.dumps(["t1"]),
       "PASS_TO_PASS": ["t2"], "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail",
       "eval_script": "#!/bin/bash\nset -uxo pipefail\ncd /testbed\n: '>>>>> Start Test Output'\npytest -rA\n"
                      ": '>>>>> End Test Output'\ngit checkout x t.py\n", "image_assets": '{"test_patch": []}'}
assert ours.make_test_spec(row) == real.make_test_spec(row)
for name in ("parse_eval_script", "record_test_exit_code", "_parse_image_assets", "make_test_spec"):
    a, b = getattr(ours, name), getattr(real, name)
    assert inspect.getsource(a) == inspect.getsource(b), name     # the same code (the bytecode differs only in
    assert a.__code__.co_filename == b.__code__.co_filename, name  # how 3.11 loads an imported module's attribute)
print("same")
'''
    pytest.importorskip("dotenv")
    pytest.importorskip("datasets")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0 and out.stdout.strip() == "same", out.stderr[-3000:]


def test_docker_and_modal_are_never_imported():
    """Building a TestSpec, adapting and grading with the harness loads neither the container back ends nor
    the modules that import them (a fresh interpreter)."""
    code = r'''
import sys
from sao_core.envs import swe
from sao_core.envs.swe_grading import adapt_eval_script, grade_harness_log
from sao_core.envs.swebench_harness import harness_test_spec
script = "#!/bin/bash\nset -uxo pipefail\nsource /opt/miniconda3/bin/activate\ncd /testbed\n" \
         ": '>>>>> Start Test Output'\npytest -rA\n: '>>>>> End Test Output'\n"
spec = harness_test_spec({"instance_id": "a__b-1", "repo": "a/b", "FAIL_TO_PASS": ["t.py::a"], "PASS_TO_PASS": [],
                          "eval_script": script})
adapt_eval_script(spec.eval_script, "/work/repo", conda=False)
report = grade_harness_log(": '>>>>> Start Test Output'\nPASSED t.py::a\n: '>>>>> End Test Output'\n", spec)
assert report.resolved
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("docker", "modal", "dotenv", "ghapi", "git")
             or m in ("swebench.harness.utils", "swebench.harness.run_evaluation", "swebench.harness.docker_utils",
                      "swebench.harness.modal_eval"))
print(bad)
'''
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_harness_test_spec_from_rows():
    script = "#!/bin/bash\nset -uxo pipefail\ncd /testbed\n: '>>>>> Start Test Output'\npytest -rA t.py\n" \
             ": '>>>>> End Test Output'\ngit checkout abc t.py\n"
    row = {"instance_id": "x__y-1", "repo": "pydata/xarray", "version": "2022.06", "FAIL_TO_PASS": ["t.py::a"],
           "PASS_TO_PASS": json.dumps(["t.py::b"]), "eval_script": script, "image": "img:1",
           "log_parser": "parse_log_pytest", "eval_type": "pass_and_fail"}
    spec = harness_test_spec(row)
    assert isinstance(spec, HarnessSpec) and spec.derived == ()
    assert spec.test_spec == H.utils.make_test_spec(row)
    ts = spec.test_spec
    assert (ts.instance_id, ts.image, ts.log_parser, ts.FAIL_TO_PASS, ts.PASS_TO_PASS) == (
        "x__y-1", "img:1", "parse_log_pytest", ["t.py::a"], ["t.py::b"])
    # the harness's record_test_exit_code: the test command's $? is kept and printed after the end marker
    assert spec.eval_script.splitlines() == [
        "#!/bin/bash", "set -uxo pipefail", "cd /testbed", ": '>>>>> Start Test Output'", "pytest -rA t.py",
        f"{C.TEST_EXIT_CODE_VAR}=$?", ": '>>>>> End Test Output'", f'echo "{C.TEST_EXIT_CODE}: ${C.TEST_EXIT_CODE_VAR}"',
        "git checkout abc t.py"]
    # only eval_script given: the rest is derived, and named
    minimal = harness_test_spec({k: row[k] for k in ("instance_id", "repo", "FAIL_TO_PASS", "eval_script")})
    assert set(minimal.derived) == {"version", "image", "log_parser", "eval_type"}
    assert (minimal.test_spec.log_parser, minimal.test_spec.eval_type) == ("parse_log_xarray", "pass_and_fail")
    assert harness_test_spec({**row, "repo": "eslint/eslint", "eval_type": None}).test_spec.eval_type == "fail_only"
    assert harness_test_spec({**row, "log_parser": "django"}).test_spec.log_parser == "parse_log_django"
    # the loader keeps exactly these columns of a row (sao_core.data sits below sao_core.envs: its own copy)
    assert SWE_HARNESS_FIELDS == HARNESS_ROW_FIELDS == ("eval_script", "image", "log_parser", "eval_type")
    # no eval_script: the fallback
    assert harness_test_spec({**row, "eval_script": None}) is None
    assert harness_test_spec({**row, "eval_script": "  \n"}) is None
    # a script the harness could never grade, an unknown parser or eval type: clear errors
    with pytest.raises(ValueError, match="lacks the harness's marker.*End Test Output"):
        harness_test_spec({**row, "eval_script": script.replace(": '>>>>> End Test Output'\n", "")})
    with pytest.raises(ValueError, match="x__y-1: unknown log parser 'parse_log_nope'"):
        harness_test_spec({**row, "log_parser": "parse_log_nope"})
    with pytest.raises(ValueError, match="eval_type 'both' is none of"):
        harness_test_spec({**row, "eval_type": "both"})


SCRIPT = f"""#!/bin/bash
set -uxo pipefail
source /opt/miniconda3/bin/activate
conda activate testbed
cd /testbed
git config --global --add safe.directory /testbed
ls /testbed/sub /testbedding /x/testbed
git apply -v - <<'{HEREDOC}'
diff --git a/t.py b/t.py
+# cd /testbed
+conda activate testbed
{HEREDOC}
cat <<-END
\tsource /opt/miniconda3/bin/activate
\tEND
: '>>>>> Start Test Output'
pytest -rA t.py
: '>>>>> End Test Output'
"""


def test_adapt_eval_script_changes_only_testbed_and_conda():
    # the instance image: as it is
    assert adapt_eval_script(SCRIPT) == (SCRIPT, [])
    assert adapt_eval_script(SCRIPT, "/testbed/") == (SCRIPT, [])
    # a repository copied into the sandbox: /testbed moved, conda lines no-ops; here-documents untouched
    script, changes = adapt_eval_script(SCRIPT, "/tmp/sao-sandbox-1/w", conda=False)
    old, new = SCRIPT.split("\n"), script.split("\n")
    changed = [i for i, (a, b) in enumerate(zip(old, new, strict=True)) if a != b]
    assert [old[i] for i in changed] == [
        "source /opt/miniconda3/bin/activate", "conda activate testbed", "cd /testbed",
        "git config --global --add safe.directory /testbed", "ls /testbed/sub /testbedding /x/testbed"]
    assert [new[i] for i in changed] == [
        ": 'sao: no conda: source /opt/miniconda3/bin/activate'", ": 'sao: no conda: conda activate testbed'",
        "cd /tmp/sao-sandbox-1/w", "git config --global --add safe.directory /tmp/sao-sandbox-1/w",
        "ls /tmp/sao-sandbox-1/w/sub /testbedding /x/testbed"]
    assert changes == [f"line {i + 1}: {old[i]!r} -> {new[i]!r}" for i in changed]
    # the image with the repository elsewhere: only /testbed moves
    moved, _ = adapt_eval_script(SCRIPT, "/srv/repo")
    assert "conda activate testbed\ncd /srv/repo" in moved and "+# cd /testbed" in moved
    with pytest.raises(ValueError, match="not a plain absolute path"):
        adapt_eval_script(SCRIPT, "relative/dir")
    with pytest.raises(ValueError, match="not a plain absolute path"):
        adapt_eval_script(SCRIPT, "/a b")


def test_script_per_sandbox_and_grading_of_a_harness_log(tmp_path):
    row = {"id": "a__b-2", "repo": "a/b", "base_commit": "abc", "problem_statement": "p", "test_patch": "",
           "fail_to_pass": ["t.py::a"], "pass_to_pass": ["t.py::b"], "eval_script": SCRIPT, "image": "img"}
    image = SWEInstance.from_task(task_from_swe_record(row))
    assert image.harness is not None and image.fallback_reason is None and image.image == "img"
    assert harness_script_for(image, "/testbed") == (image.harness.eval_script, [])       # the pod: unchanged
    (tmp_path / "somewhere").mkdir()
    local = SWEInstance.from_task(task_from_swe_record(row, repo_path="somewhere"), repo_source=str(tmp_path))
    script, changes = harness_script_for(local, "/w/repo")
    assert script == adapt_eval_script(image.harness.eval_script, "/w/repo", conda=False)[0] and len(changes) == 5
    plain = SWEInstance.from_task(task_from_swe_record({k: v for k, v in row.items() if k != "eval_script"}))
    assert plain.harness is None and "no eval_script" in plain.fallback_reason
    with pytest.raises(ValueError, match="lacks the harness's marker"):
        SWEInstance.from_task(task_from_swe_record({**row, "eval_script": "#!/bin/bash\npytest\n"}))
    # grading the script's output: the harness's verdicts, the exit status it recorded
    spec = image.harness
    log = ("+ cd /testbed\n+ : '>>>>> Start Test Output'\n>>>>> Start Test Output\nPASSED t.py::a\nPASSED t.py::b\n"
           f"+ {C.TEST_EXIT_CODE_VAR}=0\n+ : '>>>>> End Test Output'\n{C.TEST_EXIT_CODE}: 0\n")
    ok = grade_harness_log(log, spec)
    assert ok.resolved and ok.log_valid and ok.test_exit_code == 0 and ok.log_parser == "parse_log_pytest"
    assert not grade_harness_log(log, spec, timed_out=True).resolved
    assert not grade_harness_log(log, spec, patch_applied=False).resolved
    crashed = grade_harness_log(log.replace(": 0", ": 139"), spec)
    assert not crashed.resolved and crashed.log_valid is False and crashed.test_exit_code == 139


# ------------------------------------------------------------------------------------ in the sandbox

@needs_bwrap
def test_harness_rows_run_their_eval_script(built, kept, tmp_path):
    """Gold, empty and breaking patches of the pytest, Django and sympy rows: the script the sandbox ran is
    the harness's TestSpec.eval_script with only the documented substitutions, and every verdict is the
    harness's on the same log."""
    mirrors, made = built
    make, boxes = kept
    jobs = [(case, kind) for case in made for kind in ("gold", "empty", "breaking")]

    def grade_one(job):
        case, kind = job
        task = task_from_swe_record({"id": case.instance_id, **_record(case)},
                                    repo_path=str(mirrors / case.repo.replace("/", "__")))
        box_holder = []

        def factory():
            box = make()
            box_holder.append(box)
            return box

        report = grade_patch(task, "" if kind == "empty" else case.patches[kind], factory,
                             test_command="exit 3", test_timeout_s=120, repo_source=str(mirrors),   # test_command: fallback only, not used
                             keep_logs=True)   # the assertions below read the log
        return report, box_holder[-1]

    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(grade_one, jobs))
    for (case, kind), (report, box) in zip(jobs, results, strict=True):
        where = (case.repo, kind)
        spec = harness_test_spec(case.row())
        assert report.test_command_source == "harness" and report.fallback_reason is None, where
        # the script that ran: the harness's eval script, /testbed -> the repository dir, conda lines no-ops
        ran = box.read_file(".git/sao/eval.sh").decode()
        expected, changes = adapt_eval_script(spec.eval_script, box.workdir, conda=False)
        assert ran == expected and report.eval_script_sha256 == script_sha256(ran), where
        assert report.eval_script_changes == changes and len(changes) == 7, where   # 4 conda, 3 /testbed lines
        assert all("conda" in c or "/testbed" in c for c in changes), where
        assert report.test_command == 'bash "$(git rev-parse --git-dir)/sao/eval.sh"'
        log = report.test_log_tail
        assert len(log) < 20_000 and f"+ : '{C.START_TEST_OUTPUT}'" in log and f"{C.TEST_EXIT_CODE}: " in log, where
        assert "+ git apply -v -" in log and "Applied patch" in log, where        # the script applied the test patch
        # the verdict is the harness's on the same log
        want = reference(spec.test_spec, log, tmp_path)
        assert report.resolved == want["resolved"], (where, log[-3000:])
        assert report.log_valid == want["patch_successfully_applied"], where
        status = want["tests_status"]
        assert report.fail_to_pass_failed == status["FAIL_TO_PASS"]["failure"], where
        assert report.pass_to_pass_failed == status["PASS_TO_PASS"]["failure"], where
        verdict = verdict_from_swe_report(report.to_dict())
        assert verdict.extra["test_command"] == "harness", where
        if kind == "gold":
            assert (report.resolved, verdict.grade, report.test_exit_code) == (True, "resolved", 0), (where, log[-3000:])
        elif kind == "empty":
            assert (report.resolved, verdict.grade) == (False, "empty_patch"), where
            assert report.fail_to_pass_failed == case.fail_to_pass and report.pass_to_pass_failed == [], where
        else:
            assert (report.resolved, verdict.grade) == (False, "unresolved"), where
            assert report.fail_to_pass_failed == [] and report.pass_to_pass_failed == case.broken, where
    # the test patch went through the here-document unchanged ("/testbed" in it stays) and its test ran
    report, pytest_box = results[0]
    assert "\n+# the harness runs this in /testbed\n" in pytest_box.read_file(".git/sao/eval.sh").decode()
    assert "PASSED testing/test_ops.py::test_div_zero" in report.test_log_tail


def _record(case: Case) -> dict:
    """The row as the loader prepares it (`normalize_swe_bench_verified`), without its id."""
    from sao_core.data.schemas import normalize_swe_bench_verified

    record = normalize_swe_bench_verified(case.row())
    record.pop("id")
    return record


@needs_bwrap
def test_evaluator_grades_5x_rows_with_their_script_and_names_the_fallback(built, sandbox_env, tmp_path):
    """Through the loader and the evaluator's grader: the 5.x rows keep their harness fields and are graded by
    their script (`test_command` harness); the same rows without them fall back, named, with the reason."""
    from sao_core.eval.benchmarks import get_benchmark, load_benchmark
    from sao_core.eval.graders import grade_swe_patch

    mirrors, made = built
    env, ro_paths = sandbox_env
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps(case.row()) + "\n" for case in made))
    bench = load_benchmark(get_benchmark("swe_verified"), str(rows))
    for record, case in zip(bench.records, made, strict=True):
        assert record["eval_script"] == case.row()["eval_script"] and record["log_parser"] == case.log_parser
        assert record["image"] == case.row()["image"] and record["eval_type"] == "pass_and_fail"
    options = {"sandbox_options": {"env": env, "ro_paths": ro_paths}, "repo_source": str(mirrors),
               "sandbox_limits": {"wall_seconds": 60, "cpu_seconds": 120, "memory_mb": 2048, "max_processes": 128},
               "test_timeout_s": 120}
    plain = [{k: v for k, v in r.items() if k not in ("eval_script", "image", "log_parser", "eval_type")}
             for r in bench.records[:1]]        # the pytest row without the harness fields: our pytest command
    fallback_options = {**options, "test_command": f"{env['PATH'].split(':')[0]}/python -m pytest -rA -p no:cacheprovider"}
    jobs = [(r, options) for r in bench.records] + [(r, fallback_options) for r in plain]
    with ThreadPoolExecutor(max_workers=2) as pool:
        verdicts = list(pool.map(lambda job: grade_swe_patch(job[0], job[0]["gold_patch"], job[1]), jobs))
    for verdict in verdicts[:3]:
        assert (verdict.correct, verdict.grade, verdict.extra["test_command"]) == (True, "resolved", "harness"), verdict
        assert verdict.extra["fallback_reason"] is None and verdict.extra["eval_script_sha256"]
    fallback = verdicts[3]
    assert (fallback.correct, fallback.extra["test_command"]) == (True, "fallback"), fallback
    assert "no eval_script" in fallback.extra["fallback_reason"] and fallback.extra["eval_script_sha256"] is None


@needs_bwrap
def test_agent_episode_on_a_5x_row_is_graded_by_its_script(built, kept):
    """The `swe` environment (RL and the evaluator's episodes) grades a submitted patch the same way."""
    from sao_core.envs.swe import SWEEnv

    mirrors, made = built
    make, _ = kept
    case = made[2]                                                      # the sympy row
    task = task_from_swe_record({"id": case.instance_id, **_record(case)},
                                repo_path=str(mirrors / case.repo.replace("/", "__")))
    env = SWEEnv(sandbox_factory=make, max_turns=3, test_command="exit 3", repo_source=str(mirrors),
                 keep_logs=True)                                        # the log is asserted on below
    env.reset(task)
    call = {"name": "bash", "arguments": {"command": "git apply <<'EOF'\n" + case.patches["gold"] + "EOF"}}
    step = env.step("<tool_call>" + json.dumps(call) + "</tool_call>")
    assert not step.done and "[exit code 0]" in step.observation
    step = env.step("Done. <submit/>")
    grade = step.info["grade"]
    assert step.done and step.reward == 1.0 and grade["resolved"], grade.get("test_log_tail", "")[-2000:]
    assert grade["test_command_source"] == "harness" and grade["log_parser"] == "parse_log_sympy"
    assert len(grade["eval_script_changes"]) == 7 and f"{C.TEST_EXIT_CODE}: 0" in grade["test_log_tail"]
