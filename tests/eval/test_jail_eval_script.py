"""Issue 39, part 5: a jail that shows a row's eval script only what a test run needs.

A SWE-bench row's ``eval_script`` comes from the data and runs in the local sandbox. The jail used to
bind the host root read-only, so the script could read whatever host permissions left open to the
sandbox user: a user's home (cloud credentials), the rollout service's token file, the eval's output
root, the host's /etc/passwd. Each test below plants a secret where such a file would be, world-readable
(so only the jail's view can stop the read, not permissions), and checks that the script cannot read it:

- through the sandbox directly (`LocalSandbox.exec`), one case per kind of secret;
- end to end: a harness row whose ``eval_script`` tries every secret is graded by `grade_patch`; the
  log (kept on request) holds none of them, and by default the report keeps no log at all;
- /etc/passwd and /etc/group inside are the synthetic ones (root and nobody), not the host's;
- the bind list (`LocalSandbox.jail_mounts`) names no host dir outside the toolchain, the minimal /etc,
  the interpreter's dirs, `ro_paths` and the work dir; the `python` option shows a virtualenv and puts
  it first on PATH, and refuses an interpreter whose prefix is a home dir.

Legitimate runs still pass: tests/eval/test_swe_eval_script.py (Django / sympy / pytest rows with the real
harness commands) and tests/sandbox/test_sandbox_local.py cover them. The tests pass as root (the sandbox runs
as uid 65534) and as an unprivileged user (a secret in that user's own files).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from sao_core.sandbox.base import SandboxError, SandboxLimits

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(
    not HAVE_BWRAP,
    reason="bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap")

#: Host dirs the jail replaces with private tmpfs mounts (a secret there proves nothing about the new list).
_HIDDEN = ("/tmp", "/var/tmp", "/run", "/dev/shm")


def _hidden(path: str) -> bool:
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + "/") for d in _HIDDEN)


def _writable_dir(path: str) -> bool:
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK) and not _hidden(path)


def _plant_base() -> str:
    """A host dir to plant secrets in: outside the dirs the jail always hid (/tmp, /var/tmp, /run), and
    traversable by everyone, so that under the old jail (host root read-only) the sandbox user could read
    a world-readable file there. The user's home when it is such a dir, else /home, /srv, /mnt, /opt."""
    home = os.path.expanduser("~")
    for base in (home, "/home", "/srv", "/mnt", "/opt", "/var/lib"):
        if _writable_dir(base) and os.stat(base).st_mode & 0o001 and os.path.realpath(base) != "/root":
            return base
    pytest.skip("no writable, world-traversable host dir outside /tmp, /var/tmp and /run to plant secrets in")


def _plant(path: Path, secret: str) -> None:
    """A world-readable secret file at `path` (parents world-traversable): only the jail can hide it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(secret + "\n")
    path.chmod(0o644)
    for parent in path.parents:
        if parent == Path(path.anchor) or not os.access(parent, os.W_OK) or str(parent) in ("/home", "/root"):
            break
        if os.stat(parent).st_uid == os.geteuid():
            parent.chmod(parent.stat().st_mode | 0o755)


class Secrets:
    """Planted secrets by kind: ``{kind: (path, secret)}``; removed by `cleanup`."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[str, str]] = {}
        self.dirs: list[str] = []

    def add(self, kind: str, path: Path) -> None:
        secret = f"sao-secret-{kind}-{uuid.uuid4().hex}"
        _plant(path, secret)
        self.files[kind] = (str(path), secret)

    def cleanup(self) -> None:
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def secrets(monkeypatch):
    """Secrets where a test run must not look: the user's $HOME (a cloud credentials file), the rollout
    service's token file (a mounted Secret, `$SAO_ROLLOUT_TOKEN_FILE`), the eval's output root, and
    /root when we are root and may write there."""
    found = Secrets()
    base = _plant_base()
    top = tempfile.mkdtemp(prefix=".sao-jail-", dir=base)
    os.chmod(top, 0o755)
    found.dirs.append(top)
    # $HOME: the real one when it is a writable dir the old jail showed, else a stand-in set as HOME
    home = os.path.expanduser("~")
    if not (_writable_dir(home) and os.path.realpath(home) != "/root" and os.stat(home).st_mode & 0o001):
        home = os.path.join(top, "home")
        os.makedirs(home, mode=0o755)
        monkeypatch.setenv("HOME", home)
    creds = Path(home) / f".sao-jail-{uuid.uuid4().hex[:8]}" / ".aws" / "credentials"
    found.dirs.append(str(creds.parent.parent))
    found.add("home", creds)
    # the rollout token: a mounted Kubernetes Secret (key "token"), named by $SAO_ROLLOUT_TOKEN_FILE
    token = Path(top) / "secrets" / "rollout-token" / "token"
    found.add("token_file", token)
    monkeypatch.setenv("SAO_ROLLOUT_TOKEN_FILE", str(token))
    monkeypatch.setenv("SAO_ROLLOUT_TOKEN", found.files["token_file"][1])     # the clean env drops it too
    # the eval's output root: samples and reports of a run
    found.add("output_root", Path(top) / "outputs" / "eval-run" / "samples.jsonl")
    # /root: only when we are root and may write there
    if os.geteuid() == 0 and os.access("/root", os.W_OK):
        rdir = tempfile.mkdtemp(prefix=".sao-jail-", dir="/root")
        os.chmod(rdir, 0o755)
        found.dirs.append(rdir)
        found.add("root", Path(rdir) / ".config" / "token")
    yield found
    found.cleanup()


def _probe(paths: list[str]) -> str:
    """A script that tries to print each path, then the jail's /etc/passwd, group and environment."""
    lines = [f"echo TRY {p}; cat {p} 2>&1" for p in paths]
    lines += ["echo PASSWD-BEGIN; cat /etc/passwd; echo PASSWD-END",
              "echo GROUP-BEGIN; cat /etc/group; echo GROUP-END", "env", "ls -A /"]
    return "\n".join(lines) + "\n"


def _between(text: str, begin: str, end: str) -> str:
    return text.split(begin + "\n", 1)[1].split(end, 1)[0]


# ------------------------------------------------------------------------------------ the sandbox itself

@needs_bwrap
@pytest.mark.parametrize("kind", ["home", "token_file", "output_root", "root"])
def test_script_cannot_read_planted_secret(secrets, kind):
    """One secret per kind, world-readable on the host: the sandbox's command cannot read it (the file is
    not in the jail at all); the control, a file in the work dir, reads."""
    from sao_core.sandbox.local import LocalSandbox

    if kind not in secrets.files:
        pytest.skip("/root case: runs only as root with a writable /root (this process is "
                    f"uid {os.geteuid()}, /root writable: {os.access('/root', os.W_OK)})")
    path, secret = secrets.files[kind]
    assert Path(path).read_text().strip() == secret           # the host reads it: the plant worked
    with LocalSandbox(SandboxLimits(wall_seconds=15)) as box:
        box.write_file("control.txt", "control-ok")
        r = box.exec(f"cat control.txt; echo; {_probe([path, os.path.dirname(path) + '/*'])}")
        assert "control-ok" in r.stdout, r
        assert secret not in r.stdout + r.stderr, (kind, path)
        assert "No such file or directory" in r.stdout, r
        assert not box.exec(["test", "-e", os.path.dirname(path)]).ok     # not even the dir is there


@needs_bwrap
def test_passwd_and_group_are_synthetic():
    """/etc/passwd and /etc/group in the jail hold root and nobody only, not the host's users; the
    command runs as nobody (uid 65534), whoever runs the sandbox."""
    from sao_core.sandbox import local as local_mod
    from sao_core.sandbox.local import LocalSandbox

    host = Path("/etc/passwd").read_text()
    with LocalSandbox(SandboxLimits(wall_seconds=15)) as box:
        r = box.exec(_probe([]) + "id -un; id -u")
    assert r.ok, r
    passwd = _between(r.stdout, "PASSWD-BEGIN", "PASSWD-END")
    assert passwd == local_mod.JAIL_PASSWD and passwd != host
    assert [line.split(":")[0] for line in passwd.splitlines()] == ["root", "nobody"]
    assert [line.split(":")[0] for line in _between(r.stdout, "GROUP-BEGIN", "GROUP-END").splitlines()] == \
        ["root", "nogroup"]
    assert r.stdout.split()[-2:] == ["nobody", str(local_mod.SANDBOX_UID)]


@needs_bwrap
def test_jail_shows_only_the_bind_list(secrets):
    """The root holds only the toolchain, /dev, /proc, /etc, the scratch dirs and the work dir's top dir;
    every host path bound is in the toolchain, the minimal /etc, the sandbox's own dirs or `ro_paths`;
    $HOME is the private, writable work dir; the host's token variables are not in the environment."""
    from sao_core.sandbox import local as local_mod
    from sao_core.sandbox.local import LocalSandbox

    extra = tempfile.mkdtemp(prefix="sao-ro-")
    os.chmod(extra, 0o755)
    try:
        with LocalSandbox(SandboxLimits(wall_seconds=15), ro_paths=[extra]) as box:
            argv = box.jail_mounts()
            sources = [argv[i + 1] for i, a in enumerate(argv) if a in ("--ro-bind", "--bind")]
            allowed = [os.path.realpath(d) for d in local_mod.TOOLCHAIN_DIRS] + [
                box.workdir, box._etc_dir, os.path.realpath(extra)]
            for src in sources:
                ok = src.startswith("/etc/") or any(src == a or src.startswith(a + "/") for a in allowed)
                assert ok, f"{src} is bound but is not on the documented list"
                assert not src.startswith(("/home", "/root", "/work", "/srv", "/mnt", "/media", "/opt")), src
            assert "/etc/passwd" not in sources and "/etc/shadow" not in sources
            r = box.exec('ls -A /; echo "HOME=$HOME"; touch "$HOME/.rc" && echo home-writable; env')
            assert r.ok, r
            top = set(r.stdout.split("HOME=")[0].split())
            workdir_top = "/" + box.workdir.strip("/").split("/")[0]
            expected = {"usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "dev", "proc", "tmp", "var", "run",
                        "etc", workdir_top.lstrip("/"), extra.strip("/").split("/")[0]}
            assert top <= expected, top - expected
            assert f"HOME={box.workdir}" in r.stdout and "home-writable" in r.stdout
            assert "SAO_ROLLOUT_TOKEN" not in r.stdout
            assert secrets.files["token_file"][1] not in r.stdout
    finally:
        shutil.rmtree(extra, ignore_errors=True)


# ------------------------------------------------------------------------------------ the interpreter

@needs_bwrap
def test_python_option_shows_a_virtualenv_and_nothing_beside_it(secrets):
    """`python=` a virtualenv's interpreter (made from /usr/bin/python3, outside the toolchain): the jail
    shows the venv read-only and puts its bin dir first on PATH (`python` is it); a file next to the
    venv stays hidden."""
    from sao_core.sandbox.local import LocalSandbox, interpreter_dirs

    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no /usr/bin/python3 to make a virtualenv from")
    top = os.path.dirname(os.path.dirname(os.path.dirname(secrets.files["token_file"][0])))
    venv = os.path.join(top, "venv")
    made = subprocess.run(["/usr/bin/python3", "-m", "venv", "--without-pip", venv], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot make a virtualenv here: {made.stderr.strip()[-300:]}")
    subprocess.run(["chmod", "-R", "a+rX", venv], check=True)
    bindir, dirs = interpreter_dirs(os.path.join(venv, "bin", "python"))
    assert bindir == os.path.join(venv, "bin") and dirs == [venv]          # /usr (the base) is the toolchain
    with LocalSandbox(SandboxLimits(wall_seconds=15), python=os.path.join(venv, "bin", "python")) as box:
        r = box.exec("command -v python; python -c 'import sys; print(sys.prefix)'; echo x > "
                     f"{venv}/w 2>&1 || echo venv-read-only; cat {secrets.files['token_file'][0]} 2>&1")
    assert r.stdout.splitlines()[:2] == [os.path.join(venv, "bin", "python"), venv], r
    assert "venv-read-only" in r.stdout and secrets.files["token_file"][1] not in r.stdout


def test_python_option_refuses_a_prefix_that_is_a_home(tmp_path, monkeypatch):
    """An interpreter at <home>/bin/python would make its prefix the whole home dir: refused."""
    from sao_core.sandbox.local import interpreter_dirs

    home = tmp_path / "home"
    (home / "bin").mkdir(parents=True)
    os.symlink(shutil.which("python3") or "/usr/bin/python3", home / "bin" / "python3")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(SandboxError, match="home or top-level"):
        interpreter_dirs(str(home / "bin" / "python3"))


# ------------------------------------------------------------------------------------ a row's eval script

def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def _hostile_row(mirrors: Path, paths: list[str]) -> dict:
    """A swebench 5.x row (owner acme/widget) whose eval_script, in the harness's form, tries to print
    every secret between the harness's test-output markers, and a control file of the repository."""
    from sao_core.data.schemas import normalize_swe_bench_verified
    from sao_core.envs.swebench_harness import harness

    c = harness().constants
    repo = mirrors / "acme__widget"
    repo.mkdir(parents=True)
    (repo / "control.txt").write_text("control-ok\n")
    (repo / "test_w.py").write_text("def test_w():\n    assert True\n")
    _git(repo, "init", "-q", "-b", "main")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-q", "-m", "base")
    base = _git(repo, "rev-parse", "HEAD").strip()
    script = ("#!/bin/bash\nset -uxo pipefail\ncd /testbed\n"
              f": '{c.START_TEST_OUTPUT}'\necho \"CONTROL $(cat control.txt)\"\n" + _probe(paths)
              + f": '{c.END_TEST_OUTPUT}'\n")
    unused = "diff --git a/control.txt b/control.txt\n"      # the rows' patches: not used by this script
    row = {"repo": "acme/widget", "instance_id": "acme__widget-1", "base_commit": base, "patch": unused,
           "test_patch": unused, "problem_statement": "x", "FAIL_TO_PASS": json.dumps(["test_w.py::test_w"]),
           "PASS_TO_PASS": "[]", "version": "1.0", "eval_script": script, "log_parser": "parse_log_pytest",
           "eval_type": "pass_and_fail"}
    return normalize_swe_bench_verified(row)


@needs_bwrap
def test_row_eval_script_reads_no_secret_and_report_keeps_no_log(secrets, tmp_path):
    """A row's eval script that cats every planted secret and /etc/passwd, graded by `grade_patch` as the
    harness would run it: with ``keep_logs`` the log shows the control and none of the secrets, and its
    /etc/passwd is the synthetic one; by default the report (what trajectories and eval outputs store)
    keeps no log at all, only the test names and verdicts."""
    from sao_core.envs.swe import grade_patch, task_from_swe_record
    from sao_core.sandbox import local as local_mod
    from sao_core.sandbox.local import LocalSandbox

    mirrors = tmp_path / "mirrors"
    paths = [p for p, _ in secrets.files.values()]
    record = _hostile_row(mirrors, paths)
    task = task_from_swe_record(record, repo_path=str(mirrors / "acme__widget"))

    def factory():
        return LocalSandbox(SandboxLimits(wall_seconds=60, cpu_seconds=60, memory_mb=1024, max_processes=64))

    kept = grade_patch(task, "", factory, repo_source=str(mirrors), test_timeout_s=60, keep_logs=True)
    log = kept.test_log_tail
    assert kept.test_command_source == "harness" and "CONTROL control-ok" in log, log[-2000:]
    for kind, (path, secret) in secrets.files.items():
        assert f"TRY {path}" in log and secret not in log, (kind, log[-3000:])
    traced = _between(log.replace("echo PASSWD-BEGIN", ""), "PASSWD-BEGIN", "+ echo PASSWD-END")
    passwd = "".join(line + "\n" for line in traced.splitlines() if not line.startswith("+ "))  # set -x lines out
    assert passwd == local_mod.JAIL_PASSWD, traced
    assert not kept.resolved

    default = grade_patch(task, "", factory, repo_source=str(mirrors), test_timeout_s=60)
    assert default.test_log_tail == "" and not default.resolved
    assert default.fail_to_pass_failed == ["test_w.py::test_w"] and default.statuses
    stored = json.dumps(default.to_dict())
    assert "CONTROL" not in stored and "PASSWD-BEGIN" not in stored
    assert not any(secret in stored for _, secret in secrets.files.values())
