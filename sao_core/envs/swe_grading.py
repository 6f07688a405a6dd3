"""Grading for the `swe` environment: apply patches, run tests, let the SWE-bench harness decide "resolved".

Pieces (each usable on its own; `sao_core.envs.swe.grade_patch` chains them):

- `RepoShell`: run bash in a sandbox *inside the repository* (its work dir, or an absolute
  `repo_dir` such as SWE-bench's ``/testbed``), move whole files in and out in base64 chunks (so
  the sandbox's output cap never cuts a patch or a test log).
- `apply_patch(sandbox, patch_text)`: write the patch under ``.git/sao/`` and try, in order,
  ``git apply --verbose``, ``git apply --verbose --reject`` and ``patch --batch --fuzz=5 -p1 -i``;
  a failed fallback is rolled back (work tree restored from a snapshot) before the next one runs.
- `run_tests`: run the test command, capture its output and exit status.
- `grade_test_log(output, fail_to_pass, pass_to_pass, exit_code=, timed_out=, repo=)`: the decision,
  made by the official ``swebench`` harness (`sao_core.envs.swebench_harness`): the output is
  written as the harness's ``test_output.txt`` (its markers, the exit status, a timeout marker) and
  ``swebench.harness.grading.get_eval_report`` grades it with the repository's parser from
  ``swebench.harness.log_parsers``. `parse_test_log` and `grade` expose the parsers and the
  report on a status map. No parsing or resolved rule of our own is left here.
- `RunnerSpec` / `runner_spec_for(repo)`: the test command, log parser and target derivation per
  repository. pytest everywhere except ``django/django`` (``tests/runtests.py``, module labels)
  and ``sympy/sympy`` (``bin/test``); tests run on the files the test patch touches, as the
  SWE-bench harness does. The parser is the harness's for the repository (``parse_log_pytest``
  for a repository it does not know). These are the **fallback**, for records without the
  harness's ``eval_script``.
- `run_eval_script` / `grade_harness_log`: for a swebench 5.x record, the harness's own
  ``TestSpec.eval_script`` runs (``bash eval.sh``, output and errors to one log, as the harness's
  ``/bin/bash /eval.sh``) and ``get_eval_report`` grades that log with the record's ``TestSpec``.
  `adapt_eval_script` is the only change made to the script, and only where the repository is not
  at the harness's ``/testbed`` (see there).
"""

from __future__ import annotations

import base64
import hashlib
import re
import shlex
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from sao_core.envs.swebench_harness import (
    HarnessReport,
    HarnessSpec,
    harness,
    parser_for,
    report_for_log,
    swebench_version,
    tests_report,
)
from sao_core.envs.swebench_harness import harness_log as harness_log
from sao_core.sandbox.base import ExecResult, Sandbox, SandboxError

__all__ = [
    "DEFAULT_TEST_COMMAND",
    "FAILING_STATUSES",
    "HARNESS_REPO_DIR",
    "GradeReport",
    "PASSING_STATUSES",
    "REPO_RUNNERS",
    "RepoShell",
    "STATUSES",
    "RunnerSpec",
    "adapt_eval_script",
    "apply_patch",
    "django_test_labels",
    "grade",
    "grade_harness_log",
    "grade_test_log",
    "harness_log",
    "parse_test_log",
    "patch_files",
    "run_eval_script",
    "run_tests",
    "runner_spec_for",
    "script_sha256",
]

STATUSES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL")   # swebench.harness.constants.TestStatus
PASSING_STATUSES = frozenset({"PASSED", "XFAIL"})      # as the SWE-bench harness counts them
FAILING_STATUSES = frozenset({"FAILED", "ERROR"})
MISSING = "MISSING"                                      # in reports: the test is not in the log

DEFAULT_TEST_COMMAND = "python -m pytest -rA -p no:cacheprovider"
SCRATCH = "sao"                                          # our files live in <git dir>/sao/


# ---------------------------------------------------------------------------------------- log parsers

def parse_test_log(text: str, parser: str | None = None, repo: str | None = None) -> dict[str, str]:
    """``{test: status}`` of a test log, by the SWE-bench harness's own parser: `parser` (a
    ``swebench`` ``PARSER_REGISTRY`` name, or ``pytest`` / ``django`` / ``sympy``), else the one the
    harness uses for `repo`, else its generic ``parse_log_pytest``."""
    h = harness()
    name = parser_for(repo, parser)
    spec = h.TestSpec(instance_id="", image="", eval_script_list=[], repo=repo or "", version="",
                      FAIL_TO_PASS=[], PASS_TO_PASS=[], log_parser=name)
    return dict(h.log_parsers.PARSER_REGISTRY[name](text, spec))


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


# ---------------------------------------------------------------------------------------- grading

@dataclass
class GradeReport:
    """Outcome of grading one patch. `resolved` is the reward-bearing bit (the harness's
    ``RESOLVED_FULL``)."""

    resolved: bool
    fail_to_pass_total: int = 0
    fail_to_pass_passed: int = 0
    fail_to_pass_failed: list[str] = field(default_factory=list)
    pass_to_pass_total: int = 0
    pass_to_pass_passed: int = 0
    pass_to_pass_failed: list[str] = field(default_factory=list)
    statuses: dict[str, str] = field(default_factory=dict)   # status of every listed test (or MISSING)
    # the harness's decision
    resolution: str | None = None          # RESOLVED_FULL / RESOLVED_PARTIAL / RESOLVED_NO
    log_valid: bool | None = None          # the harness accepted the log as a test run (get_logs_eval)
    log_parser: str | None = None          # swebench PARSER_REGISTRY name
    harness: str | None = None             # "swebench <version>"
    infra_failure_reason: str | None = None
    # filled in by grade_patch
    patch_empty: bool | None = None
    patch_applied: bool | None = None
    apply_method: str | None = None
    test_patch_applied: bool | None = None
    tests_run: bool = False
    test_command: str | None = None        # the command line that ran (harness: "bash <eval.sh>")
    test_command_source: str | None = None  # "harness": the record's eval script; "fallback": our commands
    fallback_reason: str | None = None      # why a record got the fallback
    harness_derived: list[str] = field(default_factory=list)   # make_test_spec inputs the record lacked
    eval_script_sha256: str | None = None   # of the script that ran (after `adapt_eval_script`)
    eval_script_changes: list[str] = field(default_factory=list)   # what adapt_eval_script changed
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


def _from_harness(hr: HarnessReport, fail_to_pass: Sequence[str], pass_to_pass: Sequence[str]) -> GradeReport:
    f2p, p2p = list(fail_to_pass), list(pass_to_pass)
    if hr.log_valid:
        f2p_ok, p2p_ok = set(hr.fail_to_pass_success), set(hr.pass_to_pass_success)
    else:
        f2p_ok, p2p_ok = set(), set()          # no valid run: nothing was shown to pass
    return GradeReport(
        resolved=hr.resolved,
        fail_to_pass_total=len(f2p), fail_to_pass_passed=sum(t in f2p_ok for t in f2p),
        fail_to_pass_failed=[t for t in f2p if t not in f2p_ok],
        pass_to_pass_total=len(p2p), pass_to_pass_passed=sum(t in p2p_ok for t in p2p),
        pass_to_pass_failed=[t for t in p2p if t not in p2p_ok],
        statuses={t: hr.statuses.get(t, MISSING) for t in [*f2p, *p2p]},
        resolution=hr.resolution, log_valid=hr.log_valid, log_parser=hr.log_parser,
        harness=f"swebench {hr.version}", infra_failure_reason=hr.infra_failure_reason,
    )


def grade_test_log(
    test_output: str,
    fail_to_pass: Sequence[str],
    pass_to_pass: Sequence[str],
    *,
    exit_code: int | None,
    timed_out: bool = False,
    repo: str | None = None,
    log_parser: str | None = None,
    instance_id: str = "instance",
    version: str | None = None,
    patch_applied: bool = True,
) -> GradeReport:
    """Grade one test run by the SWE-bench harness: `test_output` (what the test command printed),
    its `exit_code` and whether it `timed_out` are written as the harness's ``test_output.txt``
    (`harness_log`) and the harness's ``get_eval_report`` decides (`report_for_log`).

    Resolved iff the harness says ``RESOLVED_FULL``: the log is a valid run (markers present, no
    timeout / patch-failure marker, results parsed or the suite visibly ran, and a non-zero exit
    status only together with a failed or errored test), every FAIL_TO_PASS test PASSED or XFAIL,
    and every PASS_TO_PASS test PASSED, XFAIL or SKIPPED. A listed test missing from the log failed.
    A test counted as passed by the harness is in neither failed list; when the log is not a valid
    run, every listed test is in its failed list."""
    log = harness_log(test_output, exit_code=exit_code, timed_out=timed_out, patch_applied=patch_applied)
    hr = report_for_log(log, fail_to_pass, pass_to_pass, repo=repo, log_parser=log_parser,
                        instance_id=instance_id, version=version, test_output=test_output)
    return _from_harness(hr, fail_to_pass, pass_to_pass)


def grade_harness_log(log: str, spec: HarnessSpec, *, timed_out: bool = False, patch_applied: bool = True,
                      model_patch: str | None = "") -> GradeReport:
    """Grade the output of the harness's eval script (`run_eval_script`) with the record's
    ``TestSpec`` (`spec`), by the harness's ``get_eval_report``: `log` is taken as the harness's
    ``test_output.txt`` as it is. A timed-out run gets the harness's ``>>>>> Tests Timed Out``
    marker appended (the harness stops such a run without a report: never resolved); a patch that
    did not apply is graded on a log of the ``>>>>> Patch Apply Failed`` marker alone (the harness
    stops there too). The exit status is the one the script itself records (``>>>>> Test Exit
    Code: N``, `GradeReport.test_exit_code`)."""
    h = harness()
    c = h.constants
    ts = spec.test_spec
    if not patch_applied:
        log = c.APPLY_PATCH_FAIL + "\n"
    elif timed_out:
        log = log.rstrip("\n") + "\n" + c.TESTS_TIMEOUT + "\n"
    hr = report_for_log(log, ts.FAIL_TO_PASS, ts.PASS_TO_PASS, test_spec=ts, model_patch=model_patch)
    report = _from_harness(hr, ts.FAIL_TO_PASS, ts.PASS_TO_PASS)
    report.test_exit_code = h.grading.parse_test_exit_code(log)
    return report


def grade(statuses: Mapping[str, str], fail_to_pass: Sequence[str], pass_to_pass: Sequence[str],
          repo: str | None = None) -> GradeReport:
    """Grade a status map by the harness's ``get_eval_tests_report`` / ``get_resolution_status``
    (no log, so none of the log-validity checks of `grade_test_log`; an empty map is not a valid
    run and is never resolved)."""
    report, resolution = tests_report(statuses, fail_to_pass, pass_to_pass, repo)
    hr = HarnessReport(
        resolved=bool(statuses) and resolution == "RESOLVED_FULL", resolution=resolution, log_valid=bool(statuses),
        log_parser=None, eval_type="", statuses=dict(statuses), version=swebench_version(),
        fail_to_pass_success=report["FAIL_TO_PASS"]["success"], fail_to_pass_failure=report["FAIL_TO_PASS"]["failure"],
        pass_to_pass_success=report["PASS_TO_PASS"]["success"], pass_to_pass_failure=report["PASS_TO_PASS"]["failure"])
    out = _from_harness(hr, fail_to_pass, pass_to_pass)
    out.log_parser = None
    return out


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
    `parser` (a ``swebench`` ``PARSER_REGISTRY`` name; None: the harness's parser for the
    repository) and how test-patch files become targets (`targets`)."""

    command: str = DEFAULT_TEST_COMMAND
    parser: str | None = None
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
        targets="django"),
    "sympy/sympy": RunnerSpec(
        command="PYTHONWARNINGS='ignore::UserWarning,ignore::SyntaxWarning' bin/test -C --verbose"),
}


def runner_spec_for(repo: str | None, command: str | None = None, parser: str | None = None) -> RunnerSpec:
    """The `RunnerSpec` for `repo` (``owner/name``), with `command` / `parser` overriding it; the
    parser is resolved to a ``PARSER_REGISTRY`` name (`sao_core.envs.swebench_harness.parser_for`)."""
    base = REPO_RUNNERS.get((repo or "").strip().lower(), RunnerSpec())
    return RunnerSpec(command=command or base.command, parser=parser_for(repo, parser or base.parser),
                      targets=base.targets)


def _run_to_log(shell: RepoShell, command: str, name: str, timeout_s: float,
                max_log_bytes: int) -> tuple[str, int | None, bool]:
    """Run `command` in `shell` with stdout and stderr into one file, ``<git dir>/sao/<name>`` (so the
    sandbox's output cap does not cut it), read back in chunks; returns ``(log, exit status, timed
    out)``. Past `max_log_bytes` only the tail is kept (a first line says so)."""
    log_path = shell.scratch(name)
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
    return log, exit_code, result.timed_out


def run_tests(
    shell: RepoShell,
    spec: RunnerSpec,
    targets: Sequence[str],
    timeout_s: float = 600,
    max_log_bytes: int = 8 << 20,
) -> tuple[str, int | None, bool, str]:
    """Run the tests (the fallback: our own command); returns ``(log, exit_code, timed_out, command)``.
    The log goes to a file in the scratch dir (so the sandbox's output cap does not cut it) and is
    read back in chunks."""
    command = " ".join([spec.command, *(shlex.quote(t) for t in targets)])
    log, exit_code, timed_out = _run_to_log(shell, command, "test.log", timeout_s, max_log_bytes)
    return log, exit_code, timed_out, command


# ---------------------------------------------------------------------------------------- the harness's eval script

#: Where the harness's images hold the repository, and its eval scripts ``cd``.
HARNESS_REPO_DIR = "/testbed"
# a line that activates the images' conda env: "source /opt/miniconda3/bin/activate [env]", ". <same>",
# "conda activate <env>" / "conda deactivate"
_CONDA_LINE = re.compile(r"^\s*(?:(?:source|\.)\s+/opt/miniconda3/bin/activate(?:\s+\S+)?"
                         r"|conda\s+(?:activate\s+\S+|deactivate))\s*;?\s*$")
_HEREDOC = re.compile(r"(?<!<)<<(-?)\s*(['\"]?)([A-Za-z_][A-Za-z0-9_]*)\2")
_TESTBED = re.compile(r"(?<![A-Za-z0-9_.-])/testbed(?![A-Za-z0-9_.-])")
_SAFE_DIR = re.compile(r"/[A-Za-z0-9_./-]*")


def adapt_eval_script(script: str, repo_dir: str = HARNESS_REPO_DIR, *, conda: bool = True) -> tuple[str, list[str]]:
    """The harness's eval `script` for a repository at `repo_dir` (absolute) and, with `conda` False,
    for a machine without the images' conda; returns ``(script, changes)``, one line of `changes`
    per changed line (``line N: 'old' -> 'new'``).

    Exactly two substitutions, on the script's command lines only (the bodies of here-documents,
    e.g. the test patch the script applies with ``git apply -v - <<'EOF...'``, are never changed):

    - the path ``/testbed`` (as a whole path component) becomes `repo_dir`, when `repo_dir` is
      not ``/testbed``;
    - with `conda` False, each line that only activates the conda env
      (``source /opt/miniconda3/bin/activate [env]``, ``. /opt/miniconda3/bin/activate``,
      ``conda activate <env>``, ``conda deactivate``) becomes the no-op
      ``: 'sao: no conda: <the line>'`` (under the script's ``set -x`` it still shows in the log).

    With ``repo_dir="/testbed"`` and `conda` True (the instance image) the script is returned
    unchanged. Everything else (``set -uxo pipefail``, the test-file reset, the test patch, the
    markers, the test command, the exit-status line) is the harness's. Raises ValueError for a
    `repo_dir` that is not a plain absolute path (``/`` then letters, digits, ``_ . - /``)."""
    if not _SAFE_DIR.fullmatch(repo_dir or ""):
        raise ValueError(f"cannot put {repo_dir!r} into the harness's eval script: not a plain absolute path")
    repo_dir = repo_dir.rstrip("/") or "/"
    move = repo_dir != HARNESS_REPO_DIR
    lines, changes = script.split("\n"), []
    out: list[str] = []
    delimiter: tuple[str, bool] | None = None
    for number, line in enumerate(lines, 1):
        if delimiter is not None:                     # inside a here-document: as it is
            out.append(line)
            word, tabs = delimiter
            if (line.lstrip("\t") if tabs else line) == word:
                delimiter = None
            continue
        new = line
        if not conda and _CONDA_LINE.match(line):
            new = ": " + shlex.quote(f"sao: no conda: {line.strip()}")
        elif move:
            new = _TESTBED.sub(lambda _m: repo_dir, line)
        if new != line:
            changes.append(f"line {number}: {line.strip()!r} -> {new.strip()!r}")
        out.append(new)
        heredoc = _HEREDOC.search(line)
        if heredoc:
            delimiter = (heredoc.group(3), heredoc.group(1) == "-")
    return "\n".join(out), changes


def run_eval_script(
    shell: RepoShell,
    script: str,
    timeout_s: float = 1800,
    max_log_bytes: int = 8 << 20,
) -> tuple[str, int | None, bool, str]:
    """Run an eval script (the harness's ``TestSpec.eval_script``, as `adapt_eval_script` left it) as
    the harness does (``/bin/bash /eval.sh``, stdout and stderr into one log): written to
    ``<git dir>/sao/eval.sh`` and run with ``bash`` from the repository dir; returns ``(log, bash's
    exit status, timed_out, command)``. The log is the harness's ``test_output.txt``; the test
    command's own exit status is in it (``>>>>> Test Exit Code: N``), bash's is that of the
    script's last command."""
    shell.write_scratch("eval.sh", script.encode("utf-8", "surrogateescape"))
    command = 'bash "$(git rev-parse --git-dir)/sao/eval.sh"'
    log, exit_code, timed_out = _run_to_log(shell, command, "test_output.txt", timeout_s, max_log_bytes)
    return log, exit_code, timed_out, command


def script_sha256(script: str) -> str:
    """sha256 (hex) of a script's UTF-8 bytes, as `GradeReport.eval_script_sha256` records it."""
    return hashlib.sha256(script.encode("utf-8", "surrogateescape")).hexdigest()
