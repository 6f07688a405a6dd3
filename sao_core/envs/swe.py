"""The `swe` environment: an agent fixes a GitHub issue with one ``bash`` tool; graded by tests.

Episode (one `SWEEnv` per episode, as every environment):

- `reset(task)` creates the episode's sandbox and puts the repository at the task's base commit
  in it, then returns ``[system, user]``: the system message describes the tool and the submit
  sentinel, the user message is the issue (the task's prompt when it has one, else the problem
  statement).
- Each model turn may hold tool calls, ``<tool_call>{"name": "bash", "arguments": {"command":
  "..."}}</tool_call>`` (JSON, as the chat template renders structured calls; ``arguments`` may be
  a JSON string; text inside ``<think>`` is ignored). Each command runs with ``bash -c`` in a new
  shell in the repository root under `command_timeout_s`; the observation is its output (stdout
  then stderr, cut in the middle past `max_output_chars`) and ``[exit code N]`` (or ``[timed out
  after T s]``). Bad JSON, an unknown tool or a missing command give an ``error: ...`` observation
  and the episode goes on; so does a turn with neither a call nor the sentinel.
- **Submit sentinel**: ``<submit/>`` in the model's text (outside tool calls), or a bash call whose
  command is just ``submit``. Calls in the same turn run first. The env then takes
  ``git add -A && git diff --cached --binary <base>`` of the repository as the model's patch and
  grades it in a **fresh** sandbox (`grade_patch`: apply the patch, reset the files the test patch
  touches, apply the test patch, run the FAIL_TO_PASS and PASS_TO_PASS tests, parse the log), so
  nothing the agent did outside its diff can influence the tests; `grade_in_place=True` instead
  resets the agent's own repository (``git reset --hard <base> && git clean -fd``) and grades there.
  Reward 1.0 if resolved, else 0.0; finish_reason "stop"; ``info`` holds the grade report
  (``grade``: test names and verdicts; the tests' log, ``test_log_tail``, only with
  ``keep_logs=True``, since a row's eval script decides what it prints), the patch (``patch``),
  ``failed_tests`` and ``resolved``.
- A turn with tool calls when `max_turns` turns are used ends the episode: finish_reason "length",
  reward 0 (no automatic submission). A `SandboxError` while running commands or grading ends it
  with "tool_error". A sandbox that cannot be created or prepared in `reset` raises there (the
  rollout records env_error).

Where the repository comes from (`repo_source`, set by the operator, never by a dataset row):

- `repo_source` a directory (the **repos root**): a local git repository in it, either the row's
  ``metadata["repo_path"]`` (a name relative to the root; an absolute path only when it lies in
  the root) or, without one, the mirror of ``repo`` (``<dir>/<owner>__<name>``,
  ``<dir>/<owner>/<name>`` or ``<dir>/<name>``). Either is resolved inside the root
  (`resolve_repo_path`): ``..``, absolute paths elsewhere and symlinks that lead out of it are
  refused with a ValueError naming the task and the field, so a row cannot make the host read
  (and bundle into the sandbox) a repository the operator did not put there. Its history up to
  ``base_commit`` (only that: later commits, which may hold the fix, are left out) is bundled on
  the host, written into the sandbox's work dir and checked out there (``git init`` + ``fetch`` of
  the bundle); no network anywhere. The repository is the sandbox's work dir.
- otherwise (``None`` or ``"image"``) the sandbox image holds it (production: a Kubernetes pod of
  the SWE-bench instance image, `swebench_image`), at ``task.metadata["repo_dir"]`` (default
  ``/testbed``); commands ``cd`` there, after `setup_command` (default: activate the image's
  ``testbed`` conda env when ``/opt/miniconda3`` exists). A row's ``repo_path`` is ignored with
  ``"image"`` and refused with ``None`` (there is no root to resolve it in).
- ``"local"`` (formerly: take ``repo_path`` from the rows as a host path) is refused: rows may not
  choose host paths; give the directory that holds the repositories instead.

Sandboxes: `sandbox_factory` is called with the task when it takes a required positional argument
(``factory(task)``, e.g. to pick the instance image), else without. By default (`sandbox_kind`
"local") each sandbox is a `LocalSandbox` (`sandbox_limits`, `sandbox_options`: ``root``, ``env``,
``ro_paths``, ``python``: the interpreter the tests use, shown in the jail with its prefix / venv);
``"kubernetes"`` makes a `KubernetesPodSandbox` of ``task.metadata["image"]`` or the SWE-bench
image (`image_template`), working in the repository dir (``sandbox_options``: namespace, ...).

What runs the tests (`GradeReport.test_command_source`, per sample):

- ``"harness"``: a task whose metadata carries the harness's ``eval_script`` (a swebench 5.x row,
  usually with ``image``, ``log_parser``, ``eval_type``) runs exactly the ``TestSpec.eval_script``
  that the harness's ``make_test_spec`` builds from it (`sao_core.envs.swebench_harness.harness_test_spec`):
  after the model's patch is applied, ``bash eval.sh`` in the repository (the script resets the
  test files, applies the test patch, prints the markers, runs the tests, records their exit
  status); ``get_eval_report`` grades its output with that ``TestSpec``. In the instance image
  (the repository at ``/testbed``, conda there) the script runs unchanged; for a repository copied
  into the sandbox (``repo_path``: the local sandbox) ``/testbed`` becomes the repository dir and
  the conda activation lines become no-ops (`sao_core.envs.swe_grading.adapt_eval_script`, the
  changes listed in ``eval_script_changes``). `test_command` and `log_parser` options are not
  used for such a task.
- ``"fallback"``: otherwise `test_command` (None: per repository, `runner_spec_for`: pytest ``-rA``
  for most, Django's ``tests/runtests.py`` and sympy's ``bin/test`` as in the SWE-bench harness) on
  the files the test patch touches, after we reset those files and apply the test patch; the
  official SWE-bench harness (PyPI ``swebench``) parses the log with the repository's parser and
  decides "resolved" (`sao_core.envs.swe_grading`, `sao_core.envs.swebench_harness`).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from sao_core.closing import close_on_error
from sao_core.envs.base import StepResult, Task
from sao_core.envs.episode import RESET_FIRST, Episode
from sao_core.envs.grading import answer_region
from sao_core.envs.swe_grading import (
    DEFAULT_TEST_COMMAND,
    HARNESS_REPO_DIR,
    GradeReport,
    RepoShell,
    RunnerSpec,
    adapt_eval_script,
    apply_patch,
    grade_harness_log,
    grade_test_log,
    patch_files,
    run_eval_script,
    run_tests,
    runner_spec_for,
    script_sha256,
)
from sao_core.envs.swebench_harness import HARNESS_ROW_FIELDS, HarnessSpec, harness_test_spec
from sao_core.envs.tool_calls import TOOL_CALL, CommandTool
from sao_core.sandbox.base import Sandbox, SandboxError, SandboxLimits

__all__ = [
    "BASH_TOOL",
    "DEFAULT_REPO_DIR",
    "DEFAULT_TEST_COMMAND",
    "NAME",
    "SUBMIT_SENTINEL",
    "SWEBENCH_SETUP",
    "SWEEnv",
    "SWEInstance",
    "default_sandbox_factory",
    "grade_patch",
    "harness_script_for",
    "parse_bash_call",
    "prepare_repository",
    "resolve_repo_path",
    "swebench_image",
    "task_from_swe_record",
]

NAME = "swe"
SUBMIT_SENTINEL = "<submit/>"
DEFAULT_REPO_DIR = "/testbed"
# SWE-bench instance images install the repository into a conda env named "testbed".
SWEBENCH_SETUP = "if [ -f /opt/miniconda3/bin/activate ]; then . /opt/miniconda3/bin/activate testbed; fi"
DEFAULT_IMAGE_TEMPLATE = "docker.io/swebench/sweb.eval.x86_64.{key}:latest"

#: The tool: a command run by bash in the repository root; a run's exit code is always shown.
BASH = CommandTool(name="bash", argument="command", placeholder="<shell command>",
                   description="Run a bash command in the repository root and return its output and exit code.",
                   argument_description="The command to run.", always_status=True)
#: The tool, as an OpenAI-style function spec (for chat templates that render a `tools` list).
BASH_TOOL = BASH.spec()
#: ``(command, None)`` for a valid bash call body, else ``(None, error observation)``.
parse_bash_call = BASH.parse

DEFAULT_SYSTEM_PROMPT = (
    "You are fixing an issue in a software repository, checked out at the issue's base commit in "
    "your working directory. You have one tool, bash; to run a command write\n"
    '<tool_call>{{"name": "bash", "arguments": {{"command": "grep -rn some_name ."}}}}</tool_call>\n'
    "and you get back its output and exit code. Each command runs in a new shell in the repository "
    "root (cd and variables do not carry over), without network access, and is stopped after "
    "{timeout:g} seconds. Edit files with shell tools (sed -i, cat <<'EOF' > file, python). Change "
    "the source code, not the tests. When the fix is complete, reply with " + SUBMIT_SENTINEL + " and "
    "no tool call: your changes (git diff) are then checked by running the repository's tests. You "
    "have at most {max_turns} turns."
)

_SUBMIT = re.compile(r"<submit\s*/?>", re.IGNORECASE)
_MAX_INFO_PATCH_CHARS = 200_000


# ------------------------------------------------------------------------------------------ tasks

def _string_list(value: Any, what: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{what} is not a JSON list of strings: {exc}") from None
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{what} must be a list of strings")
    return list(value)


@dataclass(frozen=True)
class SWEInstance:
    """What the environment needs from a task (see `SWEInstance.from_task`)."""

    id: str
    repo: str | None
    base_commit: str | None
    problem_statement: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    repo_path: str | None = None         # local git repository to copy in (None: the image has it)
    repo_dir: str = DEFAULT_REPO_DIR     # where the image holds it
    image: str | None = None
    test_command: str | None = None
    log_parser: str | None = None
    setup_command: str | None = None
    # the harness's TestSpec when the record carries its eval_script (None: our commands, the fallback)
    harness: HarnessSpec | None = field(default=None, compare=False, repr=False)
    fallback_reason: str | None = None

    @classmethod
    def from_task(cls, task: Task, repo_source: str | None = None) -> SWEInstance:
        """Read a task whose metadata is a prepared ``swe_bench_verified`` record (``repo,
        base_commit, problem_statement, test_patch, fail_to_pass, pass_to_pass``; SWE-bench's own
        ``FAIL_TO_PASS``/``PASS_TO_PASS`` JSON strings also work; ``task.tests`` stands in for
        FAIL_TO_PASS), plus optional ``repo_path`` (a repository inside `repo_source`: `resolve_repo_path`;
        refused without a repos root), ``repo_dir, image, test_command, log_parser,
        setup_command`` and the swebench 5.x columns ``eval_script, image, log_parser, eval_type,
        version`` (`harness`: `sao_core.envs.swebench_harness.harness_test_spec`; its ValueError
        for a script the harness could not grade propagates)."""
        md = dict(task.metadata or {})

        def get(*keys: str) -> Any:
            for key in keys:
                if md.get(key) is not None:
                    return md[key]
            return None

        f2p = _string_list(get("fail_to_pass", "FAIL_TO_PASS"), "fail_to_pass") or list(task.tests or [])
        if not f2p:
            raise ValueError(f"swe task {task.id}: no FAIL_TO_PASS tests to grade against")
        p2p = _string_list(get("pass_to_pass", "PASS_TO_PASS"), "pass_to_pass")
        problem = get("problem_statement")
        if problem is None:
            users = [m.get("content") for m in task.prompt if m.get("role") == "user"]
            problem = users[-1] if users else ""
        repo = get("repo")
        repo_path = _host_repo_path(str(task.id), repo_source, get("repo_path"), repo)
        row = {"instance_id": str(task.id), "repo": repo, "version": get("version"), "FAIL_TO_PASS": f2p,
               "PASS_TO_PASS": p2p, "image_assets": get("image_assets"),
               **{key: md.get(key) for key in HARNESS_ROW_FIELDS}}
        spec = harness_test_spec(row)
        return cls(
            id=str(task.id),
            repo=str(repo) if repo else None,
            base_commit=str(get("base_commit")) if get("base_commit") else None,
            problem_statement=str(problem or ""),
            test_patch=str(get("test_patch") or ""),
            fail_to_pass=tuple(f2p),
            pass_to_pass=tuple(p2p),
            repo_path=repo_path,
            repo_dir=str(get("repo_dir") or DEFAULT_REPO_DIR),
            image=get("image"),
            test_command=get("test_command"),
            log_parser=get("log_parser"),
            setup_command=get("setup_command"),
            harness=spec,
            fallback_reason=None if spec is not None else "the record has no eval_script (not a swebench 5.x row)",
        )

    @property
    def local(self) -> bool:
        return self.repo_path is not None


def _host_repo_path(task_id: str, repo_source: str | None, row_path: Any, repo: Any) -> str | None:
    """The host repository to bundle for a task, or None when the image holds it (see the module
    docstring). Only `repo_source` (operator configuration) names host directories; the row's
    ``repo_path`` (`row_path`) and ``repo`` only pick one inside it."""
    if repo_source == "image":
        return None
    if repo_source == "local":
        raise ValueError(
            f"swe task {task_id}: repo_source='local' would take host paths from the dataset rows "
            "(metadata.repo_path), which is refused; set repo_source to the directory that holds the "
            "repositories (a row's repo_path is then a name inside it)")
    if not repo_source:
        if row_path is None or row_path == "":
            return None
        raise ValueError(
            f"swe task {task_id}: field metadata.repo_path={row_path!r} is refused: no repository root is "
            "configured (repo_source), and dataset rows may not choose host paths; set repo_source to the "
            "directory that holds the repositories")
    if row_path is not None and row_path != "":
        return resolve_repo_path(repo_source, row_path, f"swe task {task_id}: field metadata.repo_path")
    return _mirror_path(repo_source, repo, task_id)


def resolve_repo_path(root: str, value: Any, what: str) -> str:
    """The real path of repository `value` inside the repos `root`, a directory.

    `value` is a name relative to `root` (``owner__name``, ``sub/dir``), or an absolute path that
    lies in it. Refused with a ValueError that starts with `what` (which row, which field): a
    non-string or empty value, NUL, ``..`` anywhere, an absolute path outside the root, a path
    whose symlinks resolve outside the root, the root itself, and a path that is not a directory."""
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if not isinstance(value, str) or not value or "\0" in value:
        raise ValueError(f"{what}: {value!r} is not a repository name")
    real_root = os.path.realpath(root)
    if not os.path.isdir(real_root):
        raise ValueError(f"{what}: the repository root (repo_source) {root!r} is not a directory")
    if ".." in value.split("/"):
        raise ValueError(f"{what}: {value!r} is refused: '..' may not appear (it must stay inside {root})")
    if os.path.isabs(value):
        lexical = os.path.normpath(value)
        if not (_inside(lexical, os.path.normpath(os.path.abspath(root))) or _inside(lexical, real_root)):
            raise ValueError(f"{what}: absolute path {value!r} is refused: it is not inside the repository "
                             f"root {root} (give a name relative to the root)")
        candidate = lexical
    else:
        candidate = os.path.join(real_root, value)
    real = os.path.realpath(candidate)
    if not _inside(real, real_root):
        raise ValueError(f"{what}: {value!r} is refused: it resolves to {real}, outside the repository root "
                         f"{root} (a symlink leads out of it)")
    if real == real_root:
        raise ValueError(f"{what}: {value!r} names the repository root itself, not a repository in it")
    if not os.path.isdir(real):
        raise ValueError(f"{what}: {value!r} is not a directory under the repository root {root}")
    return real


def _inside(path: str, directory: str) -> bool:
    """`path` is `directory` or below it (both absolute and normalised)."""
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _mirror_path(directory: str, repo: str | None, task_id: str) -> str:
    """The mirror of `repo` (``owner/name``) in the repos root `directory`, resolved inside it."""
    if not repo:
        raise ValueError(f"swe task {task_id}: repo_source is a directory but the task has no repo")
    repo = str(repo)
    owner, _, name = repo.partition("/")
    for candidate in (f"{owner}__{name}", os.path.join(owner, name), name or owner):
        if os.path.isdir(os.path.join(directory, candidate)):
            return resolve_repo_path(directory, candidate, f"swe task {task_id}: field metadata.repo={repo!r}")
    raise ValueError(f"swe task {task_id}: no local mirror of {repo} under {directory}")


def task_from_swe_record(
    record: Mapping[str, Any],
    *,
    repo_path: str | None = None,
    repo_dir: str | None = None,
    image: str | None = None,
) -> Task:
    """A `Task` for the ``swe`` env from a prepared ``swe_bench_verified`` record."""
    issue = str(record.get("problem_statement") or "")
    metadata = {k: v for k, v in record.items() if k != "id"}
    for key, value in (("repo_path", repo_path), ("repo_dir", repo_dir), ("image", image)):
        if value is not None:
            metadata[key] = value
    return Task(
        id=str(record["id"]),
        env=NAME,
        prompt=[{"role": "user", "content": issue}],
        tests=list(_string_list(record.get("fail_to_pass"), "fail_to_pass")) or None,
        metadata=metadata,
    )


def swebench_image(instance_id: str, template: str = DEFAULT_IMAGE_TEMPLATE) -> str:
    """The SWE-bench instance image of `instance_id` (Docker Hub spells ``__`` as ``_1776_``)."""
    return template.format(key=instance_id.lower().replace("__", "_1776_"), id=instance_id)


# ------------------------------------------------------------------------------------------ sandboxes

SandboxFactory = Callable[..., Sandbox]


def _call_factory(factory: SandboxFactory, task: Task) -> Sandbox:
    """``factory(task)`` when it has a required positional parameter, else ``factory()``."""
    try:
        params = inspect.signature(factory).parameters.values()
    except (TypeError, ValueError):
        return factory()
    wants_task = any(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty for p in params
    )
    return factory(task) if wants_task else factory()


def default_sandbox_factory(
    kind: str = "local",
    limits: SandboxLimits | Mapping[str, Any] | None = None,
    options: Mapping[str, Any] | None = None,
    image_template: str = DEFAULT_IMAGE_TEMPLATE,
) -> Callable[[Task], Sandbox]:
    """A ``factory(task)``: a `LocalSandbox` (kind "local"), or a `KubernetesPodSandbox` (kind
    "kubernetes") of the task's image (``metadata.image``, else the SWE-bench instance image)
    working in its repository dir (``metadata.repo_dir``, default /testbed) when the image holds
    the repository, or in an emptyDir when the task brings a ``repo_path``."""
    if isinstance(limits, Mapping):
        limits = SandboxLimits(**limits)
    chosen = limits if limits is not None else SandboxLimits()
    opts = dict(options or {})
    if kind == "local":
        from sao_core.sandbox.local import LocalSandbox

        return lambda task: LocalSandbox(chosen, **opts)
    if kind == "kubernetes":
        def make(task: Task) -> Sandbox:
            from sao_core.sandbox.kubernetes import KubernetesPodSandbox

            md = task.metadata or {}
            kw = dict(opts)
            image = kw.pop("image", None) or md.get("image") or swebench_image(task.id, image_template)
            if not md.get("repo_path"):
                kw.setdefault("workdir", str(md.get("repo_dir") or DEFAULT_REPO_DIR))
                kw.setdefault("mount_workdir", False)
            return KubernetesPodSandbox(image=image, limits=chosen, **kw)

        return make
    raise ValueError(f"unknown sandbox kind {kind!r}; expected 'local' or 'kubernetes'")


# ------------------------------------------------------------------------------------------ repository

def _host_git(args: list[str], cwd: str | None = None, timeout: float = 300) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=timeout,
                             env={**os.environ, "GIT_TERMINAL_PROMPT": "0"})
    except (OSError, subprocess.SubprocessError) as exc:
        raise SandboxError(f"git {' '.join(args[:2])} failed on the host: {exc}") from exc
    if out.returncode != 0:
        raise ValueError(f"git {' '.join(args)} failed: {out.stderr.strip()[:500]}")
    return out.stdout.strip()


def bundle_at_commit(repo_path: str, commit: str | None) -> tuple[bytes, str]:
    """``(bundle bytes, full sha)``: a git bundle of `repo_path`'s history up to `commit` (HEAD
    when None) with one branch, ``main``. Later commits are not in it. The repository is only read
    (a throw-away repository borrows its objects through ``objects/info/alternates``)."""
    repo_path = os.path.abspath(repo_path)
    sha = _host_git(["-C", repo_path, "rev-parse", "--verify", f"{commit or 'HEAD'}^{{commit}}"])
    common = _host_git(["-C", repo_path, "rev-parse", "--git-common-dir"])
    objects = os.path.join(common if os.path.isabs(common) else os.path.join(repo_path, common), "objects")
    with tempfile.TemporaryDirectory(prefix="sao-bundle-") as tmp:
        bare = os.path.join(tmp, "r.git")
        _host_git(["init", "-q", "--bare", bare])
        with open(os.path.join(bare, "objects", "info", "alternates"), "w") as f:
            f.write(os.path.realpath(objects) + "\n")
        _host_git(["-C", bare, "update-ref", "refs/heads/main", sha])
        path = os.path.join(tmp, "repo.bundle")
        _host_git(["-C", bare, "bundle", "create", "-q", path, "refs/heads/main"])
        with open(path, "rb") as f:
            return f.read(), sha


def prepare_repository(
    sandbox: Sandbox,
    instance: SWEInstance,
    setup_command: str | None = SWEBENCH_SETUP,
    timeout_s: float = 600,
) -> tuple[RepoShell, str]:
    """Put the repository at its base commit into `sandbox`; returns ``(shell, base sha)``.

    Local (`instance.repo_path`): bundle on the host, write it to ``.git/sao/repo.bundle`` in the
    sandbox work dir, check it out there as branch ``main``; commands get ``HOME=.git/sao/home``. Image: check that `repo_dir` is a git
    repository and check out the base commit if HEAD is elsewhere; `setup_command` runs before
    every command there. Failures raise `SandboxError`."""
    if instance.local:
        data, sha = bundle_at_commit(instance.repo_path, instance.base_commit)
        # HOME inside the git dir: caches and dotfiles that tools write do not land in the diff
        home = 'export HOME="$PWD/.git/sao/home"; [ -d .git ] && mkdir -p "$HOME"'
        shell = RepoShell(sandbox, None, "\n".join(filter(None, [home, setup_command])))
        init = shell.run("git init -q -b main . && git config user.email agent@sao.invalid && "
                         "git config user.name 'SAO agent'", timeout_s=timeout_s)
        if not init.ok:
            raise SandboxError(f"git init failed in the sandbox: {(init.stderr or init.stdout).strip()[:500]}")
        sandbox.write_file(".git/sao/repo.bundle", data)
        fetch = shell.run(
            'b="$(git rev-parse --git-dir)/sao/repo.bundle"; git fetch -q "$b" main && '
            'git reset -q --hard FETCH_HEAD && rm -f "$b" && git rev-parse HEAD',
            timeout_s=timeout_s,
        )
        head = fetch.stdout.strip().splitlines()[-1] if fetch.stdout.strip() else ""
        if not fetch.ok or head != sha:
            raise SandboxError(f"could not check out {sha[:12]} in the sandbox: "
                               f"{(fetch.stderr or fetch.stdout).strip()[:500]}")
        return shell, sha
    shell = RepoShell(sandbox, instance.repo_dir, setup_command)
    res = shell.run("git rev-parse HEAD", timeout_s=timeout_s)
    head = res.stdout.strip().splitlines()[-1] if res.ok and res.stdout.strip() else ""
    if not re.fullmatch(r"[0-9a-f]{40,64}", head):
        raise SandboxError(f"no git repository at {instance.repo_dir} in the sandbox: "
                           f"{(res.stderr or res.stdout).strip()[:500]}")
    base = instance.base_commit
    if base and not head.startswith(base):
        res = shell.run(f"git -c advice.detachedHead=false checkout -q -f {shlex.quote(base)} && git rev-parse HEAD",
                        timeout_s=timeout_s)
        if not res.ok:
            raise SandboxError(f"could not check out {base} in {instance.repo_dir}: "
                               f"{(res.stderr or res.stdout).strip()[:500]}")
        head = res.stdout.strip().splitlines()[-1]
    return shell, head


# ------------------------------------------------------------------------------------------ grading

def _reset_test_files(shell: RepoShell, base: str, test_patch: str, timeout_s: float) -> None:
    """Files the test patch touches go back to the base commit (a new one is removed), as the
    SWE-bench harness does, so the model's edits to them cannot matter."""
    lines = []
    for path, _deleted in patch_files(test_patch):
        q = shlex.quote(path)
        lines.append(f"if git cat-file -e {base}:{q} 2>/dev/null; then git checkout -q {base} -- {q}; "
                     f"else rm -f -- {q}; fi")
    if lines:
        res = shell.run("\n".join(lines), timeout_s=timeout_s)
        if not res.ok:
            raise SandboxError(f"could not reset the test files: {(res.stderr or res.stdout).strip()[:500]}")


#: How much of the tests' log a report keeps when asked to (`keep_logs`), in characters (the end).
TEST_LOG_TAIL_CHARS = 20_000


def _test_log(log: str, keep_logs: bool) -> str:
    """The tests' log for `GradeReport.test_log_tail`: its last `TEST_LOG_TAIL_CHARS` characters
    with `keep_logs`, else nothing. The log is what a dataset row's eval script (or test command)
    printed, so the row decides what is in it; reports and trajectories are stored and shared, so
    by default they carry only the test names and verdicts."""
    return log[-TEST_LOG_TAIL_CHARS:] if keep_logs else ""


def grade_in_shell(
    shell: RepoShell,
    instance: SWEInstance,
    base: str,
    patch_text: str,
    spec: RunnerSpec,
    test_timeout_s: float = 600,
    step_timeout_s: float = 120,
    keep_logs: bool = False,
) -> GradeReport:
    """Grade `patch_text` in a repository that is clean at `base`: apply it, then run the tests,
    and let the SWE-bench harness grade the captured output.

    The report keeps the test names and verdicts; the tests' log (`GradeReport.test_log_tail`:
    what the row's eval script or test command printed) only with `keep_logs` (see `_test_log`).

    With the harness's ``TestSpec`` (`SWEInstance.harness`): run its eval script
    (`_run_harness_script`; `spec` is not used). Otherwise (the fallback): reset the test files,
    apply the test patch, run `spec`'s command; `grade_test_log` grades output and exit status."""
    started = time.monotonic()
    f2p, p2p = list(instance.fail_to_pass), list(instance.pass_to_pass)
    source = "harness" if instance.harness is not None else "fallback"
    provenance: dict[str, Any] = {"test_command_source": source, "fallback_reason": instance.fallback_reason,
                                  "harness_derived": list(instance.harness.derived) if instance.harness else []}

    def harness_grade(output: str = "", exit_code: int | None = None, timed_out: bool = False,
                      applied: bool = True) -> GradeReport:
        if instance.harness is not None:
            return grade_harness_log(output, instance.harness, timed_out=timed_out, patch_applied=applied)
        return grade_test_log(output, f2p, p2p, exit_code=exit_code, timed_out=timed_out, repo=instance.repo,
                              log_parser=spec.parser, instance_id=instance.id, patch_applied=applied)

    def finish(report: GradeReport, **fields: Any) -> GradeReport:
        report = replace(report, **provenance, **fields)
        report.seconds = time.monotonic() - started
        return report

    empty = not patch_text.strip()
    method, apply_log = None, ""
    if not empty:
        ok, method, apply_log = apply_patch(shell, patch_text, name="model.diff", timeout_s=step_timeout_s)
        if not ok:
            return finish(harness_grade(applied=False), patch_empty=False, patch_applied=False,
                          apply_log=apply_log[-20_000:], error="the patch does not apply")
    if instance.harness is not None:
        log, timed_out, command, script, changes = _run_harness_script(shell, instance, test_timeout_s, step_timeout_s)
        report = harness_grade(log, timed_out=timed_out)
        return finish(report, patch_empty=empty, patch_applied=None if empty else True, apply_method=method,
                      tests_run=True, test_command=command, eval_script_sha256=script_sha256(script),
                      eval_script_changes=changes, tests_timed_out=timed_out, apply_log=apply_log[-20_000:],
                      test_log_tail=_test_log(log, keep_logs), error="the tests timed out" if timed_out else None)
    _reset_test_files(shell, base, instance.test_patch, step_timeout_s)
    test_patch_ok: bool | None = None
    if instance.test_patch.strip():
        test_patch_ok, _, test_log = apply_patch(shell, instance.test_patch, name="test.diff",
                                                 timeout_s=step_timeout_s)
        if not test_patch_ok:
            return finish(harness_grade(applied=False), patch_empty=empty, patch_applied=None if empty else True,
                          apply_method=method, test_patch_applied=False, apply_log=test_log[-20_000:],
                          error="the test patch does not apply")
    targets = spec.target_list(instance.test_patch, [*f2p, *p2p])
    log, code, timed_out, command = run_tests(shell, spec, targets, timeout_s=test_timeout_s)
    report = harness_grade(log, code, timed_out)
    return finish(report, patch_empty=empty, patch_applied=None if empty else True, apply_method=method,
                  test_patch_applied=test_patch_ok, tests_run=True, test_command=command,
                  test_exit_code=code, tests_timed_out=timed_out, apply_log=apply_log[-20_000:],
                  test_log_tail=_test_log(log, keep_logs), error="the tests timed out" if timed_out else None)


def harness_script_for(instance: SWEInstance, repo_dir: str) -> tuple[str, list[str]]:
    """The eval script to run for `instance` (which has `SWEInstance.harness`) whose repository is
    at `repo_dir` in the sandbox, and what was changed (`adapt_eval_script`): in the image (no
    ``repo_path``) the harness's script with ``/testbed`` moved to `repo_dir` (unchanged when that
    is ``/testbed``); for a repository copied into the sandbox (``repo_path``) also without conda."""
    assert instance.harness is not None
    return adapt_eval_script(instance.harness.eval_script, repo_dir, conda=not instance.local)


def _run_harness_script(shell: RepoShell, instance: SWEInstance, test_timeout_s: float,
                        step_timeout_s: float) -> tuple[str, bool, str, str, list[str]]:
    """Run the harness's eval script in the repository: ``(log, timed_out, command, script, changes)``."""
    repo_dir = instance.repo_dir if not instance.local else ""
    if instance.local:     # the repository is the sandbox's work dir: its absolute path there
        res = shell.run("pwd -P", timeout_s=step_timeout_s)
        repo_dir = res.stdout.strip().splitlines()[-1] if res.ok and res.stdout.strip() else ""
        if not repo_dir.startswith("/"):
            raise SandboxError(f"could not find the repository's path in the sandbox: {(res.stderr or res.stdout)[:300]}")
    script, changes = harness_script_for(instance, repo_dir or HARNESS_REPO_DIR)
    log, _, timed_out, command = run_eval_script(shell, script, timeout_s=test_timeout_s)
    return log, timed_out, command, script, changes


def _check_source(instance: SWEInstance, local_default: bool) -> None:
    if local_default and not instance.local:
        raise ValueError(
            f"swe task {instance.id} has no metadata.repo_path, so its repository must come from the "
            f"instance image ({instance.repo_dir}), which a local sandbox does not have: use "
            "sandbox_kind='kubernetes' (or a sandbox_factory that starts the image), or "
            "repo_source=<directory that holds the repositories (mirrors <owner>__<name>)>")


def _runner(instance: SWEInstance, test_command: str | None, log_parser: str | None) -> RunnerSpec:
    return runner_spec_for(instance.repo, instance.test_command or test_command,
                           instance.log_parser or log_parser)


def _setup_for(instance: SWEInstance, setup_command: str | None) -> str | None:
    if instance.local:
        return instance.setup_command
    return instance.setup_command if instance.setup_command is not None else setup_command


def grade_patch(
    task: Task,
    patch_text: str,
    sandbox_factory: SandboxFactory | None = None,
    *,
    test_command: str | None = None,
    log_parser: str | None = None,
    test_timeout_s: float = 600,
    repo_source: str | None = None,
    setup_command: str | None = SWEBENCH_SETUP,
    sandbox_limits: SandboxLimits | None = None,
    keep_logs: bool = False,
) -> GradeReport:
    """Grade a model-produced patch for a swe task in a fresh sandbox (`sandbox_factory`, called
    with the task if it takes it; default a `LocalSandbox`): prepare the repository at the base
    commit, apply the patch, reset the test files, apply the test patch, run the FAIL_TO_PASS and
    PASS_TO_PASS tests, parse the log. A patch that does not apply is not resolved (``error``
    says why). The tests' log is kept in the report only with `keep_logs`. `SandboxError`
    propagates."""
    instance = SWEInstance.from_task(task, repo_source)
    if sandbox_factory is None:
        _check_source(instance, True)
        sandbox_factory = default_sandbox_factory(
            "local", sandbox_limits or SandboxLimits(wall_seconds=120, cpu_seconds=int(test_timeout_s),
                                                     memory_mb=4096, max_processes=256))
    sandbox = _call_factory(sandbox_factory, task)
    try:
        shell, base = prepare_repository(sandbox, instance, _setup_for(instance, setup_command))
        return grade_in_shell(shell, instance, base, patch_text or "",
                              _runner(instance, test_command, log_parser), test_timeout_s, keep_logs=keep_logs)
    finally:
        sandbox.close()


# ------------------------------------------------------------------------------------------ env

class SWEEnv(Episode):
    """One SWE episode (see the module docstring)."""

    name = NAME
    tools = (BASH_TOOL,)

    def __init__(
        self,
        sandbox_factory: SandboxFactory | None = None,
        max_turns: int = 40,
        command_timeout_s: float = 60,
        test_command: str | None = None,
        test_timeout_s: float = 600,
        repo_source: str | None = None,
        *,
        log_parser: str | None = None,
        sandbox_kind: str = "local",
        sandbox_limits: SandboxLimits | Mapping[str, Any] | None = None,
        sandbox_options: Mapping[str, Any] | None = None,
        image_template: str = DEFAULT_IMAGE_TEMPLATE,
        setup_command: str | None = SWEBENCH_SETUP,
        max_output_chars: int = 10_000,
        grade_in_place: bool = False,
        system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
        prepare_timeout_s: float = 600,
        keep_logs: bool = False,
    ):
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        super().__init__()
        self._local_default = sandbox_factory is None and sandbox_kind == "local"
        if sandbox_factory is None:
            if sandbox_limits is None:
                sandbox_limits = SandboxLimits(
                    wall_seconds=float(command_timeout_s),
                    cpu_seconds=int(max(command_timeout_s, test_timeout_s)),
                    memory_mb=4096,
                    max_processes=256,
                )
            sandbox_factory = default_sandbox_factory(sandbox_kind, sandbox_limits, sandbox_options, image_template)
        self.sandbox_factory = sandbox_factory
        self.max_turns = max_turns
        self.command_timeout_s = float(command_timeout_s)
        self.test_command = test_command
        self.test_timeout_s = float(test_timeout_s)
        self.repo_source = repo_source
        self.log_parser = log_parser
        self.setup_command = setup_command
        self.max_output_chars = max_output_chars
        self.grade_in_place = grade_in_place
        self.system_prompt = system_prompt
        self.prepare_timeout_s = prepare_timeout_s
        self.keep_logs = bool(keep_logs)   # the tests' log in info["grade"] (default: names and verdicts only)
        self.sandbox: Sandbox | None = None
        self.shell: RepoShell | None = None
        self.instance: SWEInstance | None = None
        self.base: str | None = None

    # -------------------------------------------------------------------- protocol

    def reset(self, task: Task) -> list[dict]:
        self.close()
        self.instance = SWEInstance.from_task(task, self.repo_source)
        _check_source(self.instance, self._local_default)
        self._begin(task)
        self.sandbox = _call_factory(self.sandbox_factory, task)
        with close_on_error(self):
            self.shell, self.base = prepare_repository(
                self.sandbox, self.instance, _setup_for(self.instance, self.setup_command), self.prepare_timeout_s)
        return self._messages(task)

    def step(self, action_text: str) -> StepResult:
        self._check_step()
        if self.shell is None:   # a reset that failed, or the grading sandbox has replaced the agent's
            raise RuntimeError(RESET_FIRST)
        self.turns += 1
        region = answer_region(action_text) or ""
        bodies = TOOL_CALL.findall(region)
        submit = bool(_SUBMIT.search(TOOL_CALL.sub("", region)))
        commands: list[tuple[str | None, str | None]] = []
        for body in bodies:
            command, problem = parse_bash_call(body.strip())
            if command is not None and command.strip() == "submit":
                submit = True
                continue
            commands.append((command, problem))
        if not commands and not submit:
            if self.turns >= self.max_turns:
                return self._end("length")
            return StepResult(done=False, observation=(
                'error: no tool call. Run a command with <tool_call>{"name": "bash", "arguments": '
                f'{{"command": "..."}}}}</tool_call>, or reply {SUBMIT_SENTINEL} when the fix is complete.'),
                info={"turn": self.turns, "calls": self.calls})
        if commands and not submit and self.turns >= self.max_turns:
            return self._end("length", calls=len(commands))
        result = self._run_tool_calls(commands, self._run_command)
        if submit and not result.done:
            return self._submit(result.tool_seconds)
        return result

    def close(self) -> None:
        sandbox, self.sandbox, self.shell = self.sandbox, None, None
        if sandbox is not None:
            sandbox.close()

    # -------------------------------------------------------------------- internals

    def _run_command(self, command: str) -> str:
        self.calls += 1
        result = self.shell.run(command, timeout_s=self.command_timeout_s)
        return BASH.observation(result, self.command_timeout_s, self.max_output_chars)

    def _messages(self, task: Task) -> list[dict]:
        messages = [dict(m) for m in task.prompt] if task.prompt else []
        if not any(m.get("role") == "user" for m in messages):
            messages.append({"role": "user", "content": self.instance.problem_statement})
        if self.system_prompt and not any(m.get("role") == "system" for m in messages):
            try:
                text = self.system_prompt.format(timeout=self.command_timeout_s, max_turns=self.max_turns)
            except (KeyError, IndexError, ValueError):   # a custom prompt with literal braces
                text = self.system_prompt
            messages.insert(0, {"role": "system", "content": text})
        return messages

    def model_patch(self) -> str:
        """The repository's changes against the base commit (new files included), as a patch."""
        assert self.shell is not None and self.base is not None
        res = self.shell.run(
            'd="$(git rev-parse --git-dir)/sao"; mkdir -p "$d" && git add -A . && '
            f'git diff --cached --binary {self.base} > "$d/model.diff"',
            timeout_s=self.prepare_timeout_s,
        )
        if not res.ok:
            raise SandboxError(f"could not take the diff: {(res.stderr or res.stdout).strip()[:500]}")
        data, _ = self.shell.read(self.shell.scratch("model.diff"), max_bytes=64 << 20)
        return data.decode("utf-8", "surrogateescape")

    def _submit(self, tool_seconds: float) -> StepResult:
        started = time.monotonic()
        instance = self.instance
        assert instance is not None and self.task is not None
        spec = _runner(instance, self.test_command, self.log_parser)
        patch = ""
        try:
            patch = self.model_patch()
            if self.grade_in_place:
                res = self.shell.run(f"git reset -q --hard {self.base} && git clean -fdq",
                                     timeout_s=self.prepare_timeout_s)
                if not res.ok:
                    raise SandboxError(f"could not reset the repository: {(res.stderr or res.stdout).strip()[:500]}")
                report = grade_in_shell(self.shell, instance, self.base, patch, spec, self.test_timeout_s,
                                        keep_logs=self.keep_logs)
            else:
                self.close()   # the agent's sandbox is done; grade in a fresh one
                sandbox = _call_factory(self.sandbox_factory, self.task)
                try:
                    shell, base = prepare_repository(sandbox, instance, _setup_for(instance, self.setup_command),
                                                     self.prepare_timeout_s)
                    report = grade_in_shell(shell, instance, base, patch, spec, self.test_timeout_s,
                                            keep_logs=self.keep_logs)
                finally:
                    sandbox.close()
        except (SandboxError, OSError) as exc:
            return self._end("tool_error", tool_seconds=tool_seconds + time.monotonic() - started,
                             error=f"{type(exc).__name__}: {exc}", patch=_cut(patch), submitted=True)
        return self._end("stop", tool_seconds=tool_seconds + time.monotonic() - started,
                         reward=1.0 if report.resolved else 0.0, resolved=report.resolved, grade=report.to_dict(),
                         patch=_cut(patch), failed_tests=report.failed_tests)


def _cut(patch: str) -> str:
    """The patch for ``info``: valid text (undecodable bytes replaced), cut past a limit."""
    patch = patch.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    if len(patch) <= _MAX_INFO_PATCH_CHARS:
        return patch
    return patch[:_MAX_INFO_PATCH_CHARS] + f"\n[... {len(patch) - _MAX_INFO_PATCH_CHARS} characters cut]"
