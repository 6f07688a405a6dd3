"""Grading for the `swe` environment: apply patches, run tests, parse test logs, decide "resolved".

Pieces (each usable on its own; `sao_core.envs.swe.grade_patch` chains them):

- `RepoShell`: run bash in a sandbox *inside the repository* (its work dir, or an absolute
  `repo_dir` such as SWE-bench's ``/testbed``), move whole files in and out in base64 chunks (so
  the sandbox's output cap never cuts a patch or a test log).
- `apply_patch(sandbox, patch_text)`: write the patch under ``.git/sao/`` and try, in order,
  ``git apply --verbose``, ``git apply --verbose --reject`` and ``patch --batch --fuzz=5 -p1 -i``;
  a failed fallback is rolled back (work tree restored from a snapshot) before the next one runs.
- Log parsers, ``text -> {test_id: status}`` with statuses from `STATUSES`:
  `parse_pytest_log` (``-rA`` summary lines and ``-v`` lines, parametrised ids with spaces,
  ``" - "`` and brackets), `parse_django_log` (``runtests.py --verbosity 2``) and
  `parse_sympy_log` (``bin/test --verbose``). `LOG_PARSERS` names them.
- `grade(statuses, fail_to_pass, pass_to_pass) -> GradeReport`: resolved only when every
  FAIL_TO_PASS and PASS_TO_PASS test passed (PASSED or XFAIL); a test missing from the log failed.
  Ids are matched exactly first, then through aliases that reproduce how the SWE-bench data set
  spells some ids (cut at the first space; ``[/long/path/x]`` options as ``[/x]``;
  ``MouseButton.LEFT``/``RIGHT`` as ``1``/``3``; Python 3.11 unittest names ``t (m.C.t)`` as
  ``t (m.C)``).
- `RunnerSpec` / `runner_spec_for(repo)`: the test command, log parser and target derivation per
  repository. pytest everywhere except ``django/django`` (``tests/runtests.py``, module labels)
  and ``sympy/sympy`` (``bin/test``); tests run on the files the test patch touches, as the
  SWE-bench harness does.
"""

from __future__ import annotations

import base64
import re
import shlex
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sao_core.sandbox.base import ExecResult, Sandbox, SandboxError

__all__ = [
    "DEFAULT_TEST_COMMAND",
    "FAILING_STATUSES",
    "GradeReport",
    "LOG_PARSERS",
    "PASSING_STATUSES",
    "REPO_RUNNERS",
    "RepoShell",
    "STATUSES",
    "RunnerSpec",
    "apply_patch",
    "django_test_labels",
    "grade",
    "lookup_status",
    "parse_django_log",
    "parse_pytest_log",
    "parse_sympy_log",
    "parse_test_log",
    "patch_files",
    "run_tests",
    "runner_spec_for",
]

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")
PASSING_STATUSES = frozenset({"PASSED", "XFAIL"})      # as the SWE-bench harness counts them
FAILING_STATUSES = frozenset({"FAILED", "ERROR"})
MISSING = "MISSING"                                      # in reports: the test is not in the log

DEFAULT_TEST_COMMAND = "python -m pytest -rA -p no:cacheprovider"
SCRATCH = "sao"                                          # our files live in <git dir>/sao/

_ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]")


def _clean(line: str) -> str:
    return _ANSI.sub("", line).replace("\r", "").rstrip()


def _merge(statuses: dict[str, str], test_id: str, status: str) -> None:
    """Record a status; a failure (FAILED/ERROR) is never overwritten by a later non-failure, so a
    test that passed its call but errored in teardown stays ERROR whichever line comes first."""
    test_id = test_id.strip()
    if not test_id:
        return
    old = statuses.get(test_id)
    if old in FAILING_STATUSES and status not in FAILING_STATUSES:
        return
    statuses[test_id] = status


# ---------------------------------------------------------------------------------------- pytest

_PYTEST_STATUS = "|".join(STATUSES)
_XDIST_PREFIX = re.compile(r"^\[gw\d+\]\s+(?:\[\s*\d+%\]\s+)?")
_SUMMARY = re.compile(rf"^(?P<st>{_PYTEST_STATUS})\s+(?P<rest>.+)$")
_VERBOSE = re.compile(
    rf"^(?P<id>\S.*?)\s+(?P<st>{_PYTEST_STATUS})(?:\s+\(.*\))?(?:\s+\[\s*\d+%\])?$"
)


def _looks_like_node(test_id: str) -> bool:
    head = test_id.split("::", 1)[0]
    return "::" in test_id or head.endswith(".py")


def _summary_id(status: str, rest: str) -> str | None:
    """The node id at the start of a ``-rA`` summary line's remainder (after the status word).

    Messages follow the id after ``" - "``, which may also occur inside a parametrised id, so the
    id is the shortest ``" - "``-prefix that closes its ``[...]``; without brackets, the first."""
    rest = rest.strip()
    if status == "SKIPPED" and rest.startswith("["):      # "SKIPPED [1] path:line: reason": no id
        return None
    pieces = rest.split(" - ")
    if len(pieces) == 1:
        candidate = rest
        # older pytest: "XPASS id reason" without " - "; ids without brackets have no spaces
        if status in ("XFAIL", "XPASS") and "[" not in candidate and " " in candidate:
            candidate = candidate.split()[0]
        return candidate
    for i in range(1, len(pieces) + 1):
        candidate = " - ".join(pieces[:i])
        if "[" not in candidate.split("::")[-1] or candidate.endswith("]"):
            return candidate
    return pieces[0]


def parse_pytest_log(text: str) -> dict[str, str]:
    """``{node_id: status}`` from a pytest log.

    Reads the short summary of ``-rA`` (``PASSED id``, ``FAILED id - msg``, ``ERROR id - msg``,
    ``XFAIL id - reason``, ``XPASS id - reason``) and verbose ``-v`` lines (``id PASSED [ 10%]``,
    ``id SKIPPED (reason)``), with pytest-xdist's ``[gw0] [ 10%]`` prefix and ANSI colours removed.
    ``-rA`` prints skips as ``SKIPPED [1] file:line: reason`` without an id, so a skipped test
    appears only with ``-v``. A collection error appears under the file's path. When a test has
    several lines (passed, then errored in teardown) a failure wins."""
    statuses: dict[str, str] = {}
    for raw in text.splitlines():
        line = _XDIST_PREFIX.sub("", _clean(raw))
        if not line:
            continue
        m = _SUMMARY.match(line)
        if m:
            test_id = _summary_id(m["st"], m["rest"])
            if test_id and _looks_like_node(test_id):
                _merge(statuses, test_id, m["st"])
            continue
        m = _VERBOSE.match(line)
        if m and _looks_like_node(m["id"]):
            _merge(statuses, m["id"], m["st"])
    return statuses


# ---------------------------------------------------------------------------------------- django

_DJANGO_RESULTS = {
    "ok": "PASSED",
    "OK": "PASSED",
    "FAIL": "FAILED",
    "ERROR": "ERROR",
    "expected failure": "XFAIL",
    "unexpected success": "FAILED",   # unittest counts it as a failure of the run
}
_DJANGO_LINE = re.compile(r"^(?P<id>.+?) \.\.\. ?(?P<rest>.*)$")
_DJANGO_HEADER = re.compile(r"^(?P<st>FAIL|ERROR): (?P<id>.+)$")
_DJANGO_LATE = re.compile(r"^(ok|FAIL|ERROR)\b")


def _django_result(rest: str) -> str | None:
    rest = rest.strip()
    if rest in _DJANGO_RESULTS:
        return _DJANGO_RESULTS[rest]
    if rest.startswith("skipped"):
        return "SKIPPED"
    return None


def parse_django_log(text: str) -> dict[str, str]:
    """``{test: status}`` from Django's ``tests/runtests.py --verbosity 2`` (unittest) output.

    Result lines are ``<test> ... ok|FAIL|ERROR|skipped '...'|expected failure|unexpected
    success``; ``<test>`` is ``test_x (module.Class)`` (Python 3.11+: ``test_x
    (module.Class.test_x)``) or the first line of the test's docstring. When the test prints
    something after ``...``, the result comes on a later line on its own; the last test still
    waiting takes it. ``FAIL: <test>`` / ``ERROR: <test>`` headers of the failure details count
    too."""
    statuses: dict[str, str] = {}
    pending: str | None = None
    for raw in text.splitlines():
        line = _clean(raw).strip()
        if not line:
            continue
        m = _DJANGO_HEADER.match(line)
        if m:
            _merge(statuses, m["id"], "FAILED" if m["st"] == "FAIL" else "ERROR")
            continue
        m = _DJANGO_LINE.match(line)
        if m:
            status = _django_result(m["rest"])
            if status is None:
                pending = m["id"]        # output (or nothing yet) after "...": the result comes later
            else:
                _merge(statuses, m["id"], status)
                pending = None
            continue
        if pending is not None:
            status = _django_result(line)
            if status is None:
                word = _DJANGO_LATE.match(line)
                status = _DJANGO_RESULTS[word.group(1)] if word else None
            if status is not None:
                _merge(statuses, pending, status)
                pending = None
    return statuses


def django_test_labels(files: Iterable[str]) -> list[str]:
    """``tests/auth_tests/test_views.py`` -> ``auth_tests.test_views`` (runtests.py labels)."""
    labels = []
    for path in files:
        if not path.endswith(".py") or not path.startswith("tests/"):
            continue
        label = path[len("tests/"):-len(".py")].replace("/", ".")
        if label.endswith(".__init__"):
            label = label[: -len(".__init__")]
        if label and label not in labels and label not in ("runtests", "test_sqlite"):
            labels.append(label)
    return labels


# ---------------------------------------------------------------------------------------- sympy

_SYMPY_LINE = re.compile(r"^(?P<id>test_\w+)\s+(?P<st>ok|F|E|f|s|X|w)(?:\s.*)?$")
_SYMPY_HEADER = re.compile(r"^_{3,} (?P<id>\S+\.py:\w+) _{3,}$")
_SYMPY_MAP = {"ok": "PASSED", "F": "FAILED", "E": "ERROR", "f": "XFAIL", "s": "SKIPPED", "X": "XPASS",
              "w": "SKIPPED"}


def parse_sympy_log(text: str) -> dict[str, str]:
    """``{test: status}`` from sympy's ``bin/test --verbose``: per-test lines ``test_name ok``
    (``F``, ``E``, ``f`` expected failure, ``s`` skipped, ``X`` unexpected pass) and failure
    headers ``____ sympy/x/tests/test_y.py:test_name ____`` (FAILED)."""
    statuses: dict[str, str] = {}
    for raw in text.splitlines():
        line = _clean(raw).strip()
        m = _SYMPY_HEADER.match(line)
        if m:
            _merge(statuses, m["id"], "FAILED")
            continue
        m = _SYMPY_LINE.match(line)
        if m:
            _merge(statuses, m["id"], _SYMPY_MAP[m["st"]])
    return statuses


LOG_PARSERS: dict[str, Callable[[str], dict[str, str]]] = {
    "pytest": parse_pytest_log,
    "django": parse_django_log,
    "sympy": parse_sympy_log,
}


def parse_test_log(text: str, parser: str = "pytest") -> dict[str, str]:
    """Parse `text` with the parser named `parser` (a key of `LOG_PARSERS`)."""
    try:
        fn = LOG_PARSERS[parser]
    except KeyError:
        raise ValueError(f"unknown log parser {parser!r}; expected one of: {', '.join(LOG_PARSERS)}") from None
    return fn(text)


# ---------------------------------------------------------------------------------------- grading

_PATH_OPTION = re.compile(r"^(?P<main>.*?)\[(?P<opt>.*)\]$")
_PY311_UNITTEST = re.compile(r"^(?P<name>\w+) \((?P<where>.+)\.(?P=name)\)$")


def _aliases(test_id: str) -> list[str]:
    """Other spellings of a parsed id under which data sets (SWE-bench) may list it."""
    out = []
    if any(ch.isspace() for ch in test_id):
        out.append(test_id.split()[0])                     # the harness splits lines on whitespace
    m = _PATH_OPTION.match(test_id)
    if m and m["opt"].startswith("/") and not m["opt"].startswith("//") and "*" not in m["opt"]:
        out.append(f"{m['main']}[/{m['opt'].split('/')[-1]}]")
    if "MouseButton." in test_id:
        out.append(test_id.replace("MouseButton.LEFT", "1").replace("MouseButton.RIGHT", "3"))
    m = _PY311_UNITTEST.match(test_id)
    if m:
        out.append(f"{m['name']} ({m['where']})")
    return [a for a in out if a and a != test_id]


def _alias_index(statuses: Mapping[str, str]) -> dict[str, str]:
    index: dict[str, str] = {}
    for test_id, status in statuses.items():      # log order: a later line wins, as in the harness
        for alias in _aliases(test_id):
            if alias not in statuses:
                index[alias] = status
    return index


def lookup_status(statuses: Mapping[str, str], test_id: str, aliases: Mapping[str, str] | None = None) -> str:
    """The status of `test_id` (exact id, else an alias, else ``"MISSING"``)."""
    if test_id in statuses:
        return statuses[test_id]
    index = aliases if aliases is not None else _alias_index(statuses)
    return index.get(test_id, index.get(test_id.strip(), MISSING))


@dataclass
class GradeReport:
    """Outcome of grading one patch. `resolved` is the reward-bearing bit."""

    resolved: bool
    fail_to_pass_total: int = 0
    fail_to_pass_passed: int = 0
    fail_to_pass_failed: list[str] = field(default_factory=list)
    pass_to_pass_total: int = 0
    pass_to_pass_passed: int = 0
    pass_to_pass_failed: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)   # status of every listed test (or MISSING)
    # filled in by grade_patch
    patch_empty: bool | None = None
    patch_applied: bool | None = None
    apply_method: str | None = None
    test_patch_applied: bool | None = None
    tests_run: bool = False
    test_command: str | None = None
    test_exit_code: int | None = None
    tests_timed_out: bool = False
    error: str | None = None
    apply_log: str = ""
    test_log_tail: str = ""
    seconds: float = 0.0

    @property
    def failed_tests(self) -> list[str]:
        """Every listed test that did not pass (FAIL_TO_PASS first)."""
        return [*self.fail_to_pass_failed, *self.pass_to_pass_failed]

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["failed_tests"] = self.failed_tests
        return out


def grade(statuses: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> GradeReport:
    """Resolved iff every FAIL_TO_PASS and every PASS_TO_PASS test passed (PASSED or XFAIL).

    A test missing from `statuses` counts as failed; so does SKIPPED. With no FAIL_TO_PASS tests
    nothing can be checked, and the patch is not resolved."""
    index = _alias_index(statuses)
    listed: dict[str, str] = {}

    def check(tests: Sequence[str]) -> tuple[int, list[str]]:
        passed, failed = 0, []
        for test_id in tests:
            status = lookup_status(statuses, test_id, index)
            listed[test_id] = status
            if status in PASSING_STATUSES:
                passed += 1
            else:
                failed.append(test_id)
        return passed, failed

    f2p_passed, f2p_failed = check(list(fail_to_pass))
    p2p_passed, p2p_failed = check(list(pass_to_pass))
    return GradeReport(
        resolved=bool(fail_to_pass) and not f2p_failed and not p2p_failed,
        fail_to_pass_total=len(fail_to_pass),
        fail_to_pass_passed=f2p_passed,
        fail_to_pass_failed=f2p_failed,
        pass_to_pass_total=len(pass_to_pass),
        pass_to_pass_passed=p2p_passed,
        pass_to_pass_failed=p2p_failed,
        statuses=listed,
    )


# ---------------------------------------------------------------------------------------- sandbox side

# git refuses repositories owned by another uid ("dubious ownership") unless told otherwise; a
# SWE-bench image's /testbed is owned by root while a pod may run as someone else.
GIT_ENV = "export GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0=safe.directory GIT_CONFIG_VALUE_0='*'"
_BEGIN, _END = "__SAO_BEGIN__", "__SAO_END__"
_MIN_CHUNK = 192


class RepoShell:
    """Run bash inside the repository of a sandbox.

    `repo_dir` None: the repository is the sandbox's work directory (commands start there);
    otherwise an absolute path such as ``/testbed``. `setup` (e.g. activating a conda env) runs
    first in every command."""

    def __init__(self, sandbox: Sandbox, repo_dir: str | None = None, setup: str | None = None):
        self.sandbox = sandbox
        self.repo_dir = repo_dir
        self.setup = setup

    def script(self, command: str) -> str:
        parts = [GIT_ENV]
        if self.setup:
            parts.append(self.setup)
        if self.repo_dir:
            parts.append(f"cd -- {shlex.quote(self.repo_dir)} || exit 125")
        parts.append(command)
        return "\n".join(parts)

    def run(self, command: str, timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        return self.sandbox.exec(["bash", "-c", self.script(command)], timeout_s=timeout_s, stdin=stdin)

    def scratch(self, name: str) -> str:
        """Shell expression for a path in our scratch dir inside the git dir (not in any diff)."""
        return f'"$(git rev-parse --git-dir)/{SCRATCH}/{name}"'

    def write_scratch(self, name: str, data: bytes, timeout_s: float = 120) -> None:
        """Put `data` at ``<git dir>/sao/<name>`` (base64 over stdin: any bytes, any sandbox)."""
        encoded = base64.b64encode(data).decode("ascii")
        result = self.run(
            f'd="$(git rev-parse --git-dir)/{SCRATCH}" && mkdir -p "$d" && base64 -d > "$d/{name}"',
            timeout_s=timeout_s, stdin=encoded,
        )
        if not result.ok:
            raise SandboxError(f"could not write {name} into the sandbox repository: "
                               f"{(result.stderr or result.stdout).strip()[:500]}")

    def read(self, path_expr: str, max_bytes: int = 8 << 20, timeout_s: float = 120) -> tuple[bytes, bool]:
        """The bytes of the file at `path_expr` (a shell word, e.g. from `scratch`), in base64 chunks
        that fit the sandbox's output cap. Past `max_bytes` only the last `max_bytes` are returned
        (test summaries are at the end); the flag says so. A missing file reads as b""."""
        size_res = self.run(f"f={path_expr}; [ -f \"$f\" ] && wc -c < \"$f\" || echo -1", timeout_s=timeout_s)
        try:
            size = int(size_res.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise SandboxError(f"could not stat {path_expr} in the sandbox: {size_res.stderr.strip()[:300]}") from None
        if size < 0:
            return b"", False
        start = max(0, size - max_bytes)
        cap = int(getattr(getattr(self.sandbox, "limits", None), "output_bytes", 64 * 1024) or 64 * 1024)
        chunk = max(_MIN_CHUNK, ((cap - 64) * 3 // 4) // 3 * 3)     # base64 + markers fit the cap
        data = bytearray()
        offset = start
        while offset < size:
            n = min(chunk, size - offset)
            res = self.run(
                f"f={path_expr}; echo {_BEGIN}; tail -c +{offset + 1} \"$f\" | head -c {n} | base64 -w0; "
                f"echo; echo {_END}",
                timeout_s=timeout_s,
            )
            text = res.stdout
            if res.truncated or _END not in text:
                if chunk > _MIN_CHUNK and res.truncated:
                    chunk = max(_MIN_CHUNK, chunk // 2 // 3 * 3)
                    continue
                raise SandboxError(f"could not read {path_expr} from the sandbox: {res.stderr.strip()[:300]}")
            body = text.split(_BEGIN, 1)[-1].split(_END, 1)[0]
            piece = base64.b64decode("".join(body.split()))
            if not piece:
                break   # the file shrank under us
            data += piece
            offset += len(piece)
        return bytes(data), start > 0


def _log_of(result: ExecResult) -> str:
    out = result.stdout
    if result.stderr:
        out += ("" if not out or out.endswith("\n") else "\n") + result.stderr
    if result.timed_out:
        out += "\n[timed out]"
    return out


APPLY_METHODS = (
    ("git apply", "git apply --verbose {f}"),
    ("git apply --reject", "git apply --verbose --reject {f}"),
    ("patch", "patch --batch --fuzz=5 -p1 -i {f}"),
)

# Snapshot of the work tree (tracked and untracked, not ignored files) as a tree object, through a
# private index so that the repository's own index is untouched; and the way back to it.
_SNAPSHOT = (
    'export GIT_INDEX_FILE="$(git rev-parse --git-dir)/{s}/snapshot.index"; rm -f "$GIT_INDEX_FILE"; '
    "git add -A . >/dev/null 2>&1 && git write-tree"
)
_RESTORE = (
    'export GIT_INDEX_FILE="$(git rev-parse --git-dir)/{s}/restore.index"; rm -f "$GIT_INDEX_FILE"; '
    "git add -A . >/dev/null 2>&1; "
    "git diff-index --cached --name-only --diff-filter=A -z {tree} | xargs -0 -r rm -f --; "
    "git read-tree {tree} && git checkout-index -a -f"
)


def apply_patch(
    sandbox: Sandbox | RepoShell,
    patch_text: str | bytes,
    *,
    repo_dir: str | None = None,
    name: str = "patch.diff",
    timeout_s: float = 120,
) -> tuple[bool, str | None, str]:
    """Apply `patch_text` to the repository in `sandbox`: returns ``(ok, method, log)``.

    Tries ``git apply --verbose``, then ``git apply --verbose --reject``, then
    ``patch --batch --fuzz=5 -p1 -i``; `method` names the first that exited 0 (None when all
    failed). ``git apply`` is all-or-nothing; before the fallbacks (which can apply a patch
    partly) the work tree is snapshotted, and restored after each failed fallback, so a failure
    leaves the tree as it was (ignored files aside). `log` holds every attempt's output."""
    shell = sandbox if isinstance(sandbox, RepoShell) else RepoShell(sandbox, repo_dir)
    data = patch_text.encode("utf-8", "surrogateescape") if isinstance(patch_text, str) else bytes(patch_text)
    if not data.endswith(b"\n"):
        data += b"\n"        # git apply rejects a last hunk line without its newline ("corrupt patch")
    shell.write_scratch(name, data, timeout_s=timeout_s)
    path = shell.scratch(name)
    logs: list[str] = []
    snapshot: str | None = None
    for i, (method, template) in enumerate(APPLY_METHODS):
        if i == 1:
            snap = shell.run(_SNAPSHOT.format(s=SCRATCH), timeout_s=timeout_s)
            tree = snap.stdout.strip().splitlines()[-1] if snap.ok and snap.stdout.strip() else ""
            snapshot = tree if re.fullmatch(r"[0-9a-f]{40,64}", tree) else None
        result = shell.run(template.format(f=path), timeout_s=timeout_s)
        logs.append(f"$ {template.format(f='PATCH')}\n{_log_of(result).rstrip()}\n[exit {result.exit_code}]")
        if result.ok:
            return True, method, "\n".join(logs)
        if i >= 1 and snapshot is not None:
            restore = shell.run(_RESTORE.format(s=SCRATCH, tree=snapshot), timeout_s=timeout_s)
            if not restore.ok:
                logs.append(f"(restoring the work tree failed: {_log_of(restore).strip()[:500]})")
    return False, None, "\n".join(logs)


# ---------------------------------------------------------------------------------------- tests

_DIFF_HEADER = re.compile(r"^diff --git a/(?P<a>\S+) b/(?P<b>\S+)$")


def patch_files(patch_text: str) -> list[tuple[str, bool]]:
    """``[(path, deleted)]`` for each file a git patch touches (new side's path)."""
    files: list[tuple[str, bool]] = []
    current: str | None = None
    deleted = False
    for line in patch_text.splitlines():
        m = _DIFF_HEADER.match(line)
        if m:
            if current is not None:
                files.append((current, deleted))
            current, deleted = m["b"], False
        elif current is not None and (line.startswith("deleted file mode") or line == "+++ /dev/null"):
            deleted = True
    if current is not None:
        files.append((current, deleted))
    seen: dict[str, bool] = {}
    for path, gone in files:
        seen[path] = gone
    return list(seen.items())


@dataclass(frozen=True)
class RunnerSpec:
    """How one repository's tests run: `command` (targets appended, shell-quoted), the log
    `parser` (a `LOG_PARSERS` key) and how test-patch files become targets (`targets`)."""

    command: str = DEFAULT_TEST_COMMAND
    parser: str = "pytest"
    targets: str = "files"          # "files": the .py files; "django": runtests.py module labels

    def target_list(self, test_patch: str, tests: Sequence[str] = ()) -> list[str]:
        files = [p for p, deleted in patch_files(test_patch) if not deleted and p.endswith(".py")]
        if self.targets == "django":
            return django_test_labels(files)
        if not files:   # no test patch: fall back to the files named in pytest ids
            files = list(dict.fromkeys(t.split("::", 1)[0] for t in tests if "::" in t))
        return files


# What the SWE-bench harness runs in its images for the repositories that do not use pytest.
REPO_RUNNERS: dict[str, RunnerSpec] = {
    "django/django": RunnerSpec(
        command="LANG=en_US.UTF-8 LANGUAGE=en_US:en LC_ALL=en_US.UTF-8 "
                "./tests/runtests.py --verbosity 2 --settings=test_sqlite --parallel 1",
        parser="django", targets="django"),
    "sympy/sympy": RunnerSpec(
        command="PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose",
        parser="sympy"),
}


def runner_spec_for(repo: str | None, command: str | None = None, parser: str | None = None) -> RunnerSpec:
    """The `RunnerSpec` for `repo` (``owner/name``), with `command` / `parser` overriding it."""
    base = REPO_RUNNERS.get((repo or "").strip().lower(), RunnerSpec())
    return RunnerSpec(command=command or base.command, parser=parser or base.parser, targets=base.targets)


def run_tests(
    shell: RepoShell,
    spec: RunnerSpec,
    targets: Sequence[str],
    timeout_s: float = 600,
    max_log_bytes: int = 8 << 20,
) -> tuple[str, int | None, bool, str]:
    """Run the tests; returns ``(log, exit_code, timed_out, command)``. The log goes to a file in the
    scratch dir (so the sandbox's output cap does not cut it) and is read back in chunks."""
    command = " ".join([spec.command, *(shlex.quote(t) for t in targets)])
    log_path = shell.scratch("test.log")
    started = time.monotonic()
    result = shell.run(
        f'mkdir -p "$(git rev-parse --git-dir)/{SCRATCH}"; log={log_path}; '
        f'( {command} ) > "$log" 2>&1 </dev/null; rc=$?; echo "__SAO_RC__=$rc"',
        timeout_s=timeout_s,
    )
    exit_code: int | None = None
    m = re.search(r"__SAO_RC__=(\d+)", result.stdout)
    if m:
        exit_code = int(m.group(1))
    data, cut = shell.read(log_path, max_bytes=max_log_bytes)
    log = data.decode("utf-8", "replace")
    if cut:
        log = f"[log cut: only the last {max_log_bytes} bytes]\n" + log
    if result.timed_out:
        log += f"\n[tests timed out after {time.monotonic() - started:.0f} s]"
    return log, exit_code, result.timed_out, command
