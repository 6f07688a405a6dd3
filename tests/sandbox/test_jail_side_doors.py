"""Issue 38, part 4: the SWE jail has no side doors. One test per class of door the review found:

- a dataset row's ``repo_path`` that names a host repository outside the operator's repository root
  (`repo_source`) is refused, by the resolver and through every entry that reads rows (the `swe`
  environment, the evaluator's grader, ``evaluate`` on a prepared folder), before anything is read;
- a host Unix socket (mode 0777) under /tmp, /var/tmp or /run/user cannot be connected to from the jail;
- /dev/shm holds at most `SandboxLimits.shm_bytes` and bwrap's /dev tmpfs is read-only (300 MB fail);
- the work dir holds at most `SandboxLimits.workdir_bytes` (one big file, many small ones, a slow writer).

The jail tests run real commands in real bwrap jails and skip only where bwrap is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from sao_core.envs.base import Task
from sao_core.envs.swe import SWEEnv, SWEInstance, task_from_swe_record
from sao_core.sandbox.base import SandboxError, SandboxLimits

HAVE_BWRAP = shutil.which("bwrap") is not None
BWRAP_HINT = "bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap"
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason=BWRAP_HINT)

SECRET = "sao-secret-" + uuid.uuid4().hex
MiB = 1024 * 1024


def _git(repo: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@t"}
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True,
                          env=env).stdout


def _make_repo(path: Path, files: dict[str, str]) -> str:
    """A git repository at `path` with `files` committed; returns the commit."""
    path.mkdir(parents=True)
    for name, text in files.items():
        (path / name).write_text(text)
    _git(path, "init", "-q", "-b", "main")
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "base")
    return _git(path, "rev-parse", "HEAD").strip()


@pytest.fixture
def layout(tmp_path):
    """(repos root with the mirror ``acme__lib``, a root-only 0700 repository outside it holding SECRET,
    its commit)."""
    root = tmp_path / "repos"
    _make_repo(root / "acme__lib", {"lib.py": "X = 1\n"})
    secret = tmp_path / "private" / "secret_repo"
    sha = _make_repo(secret, {"secret.txt": SECRET + "\n"})
    os.chmod(secret.parent, 0o700)
    os.chmod(secret, 0o700)
    return root, secret, sha


def _record(sha: str, **extra) -> dict:
    return {"id": "acme__secret-1", "repo": "acme/secret", "base_commit": sha, "problem_statement": "p",
            "gold_patch": "", "test_patch": "", "fail_to_pass": ["t.py::a"], "pass_to_pass": [],
            "version": "1.0", **extra}


def _instance(repo_source, **metadata) -> SWEInstance:
    return SWEInstance.from_task(Task(id="row-7", env="swe", prompt=[], tests=["t.py::a"],
                                      metadata={"repo": "acme/lib", **metadata}), repo_source)


# ------------------------------------------------------------------------------------ repo_path


def test_repo_path_outside_the_root_is_refused(layout):
    """Only names inside the configured root are used; every way out is refused with the row and field named."""
    root, secret, _ = layout
    (root / "link_out").symlink_to(secret)
    (root / "acme__lib" / "evil").symlink_to(secret)            # a link inside a repository's own tree
    where = r"swe task row-7: field metadata\.repo_path"
    with pytest.raises(ValueError, match=where + r".*not inside the repository root"):
        _instance(str(root), repo_path=str(secret))                 # the review's row: an absolute host path
    for bad in ("../private/secret_repo", "acme__lib/../../private/secret_repo", f"{root}/../private/secret_repo"):
        with pytest.raises(ValueError, match=where + r".*'\.\.' may not appear"):
            _instance(str(root), repo_path=bad)
    for link in ("link_out", "acme__lib/evil", str(root / "link_out")):
        with pytest.raises(ValueError, match=where + r".*outside the repository root.*symlink"):
            _instance(str(root), repo_path=link)
    with pytest.raises(ValueError, match=where + r".*no repository root is configured"):
        _instance(None, repo_path=str(secret))                      # no root: rows may not name host paths
    with pytest.raises(ValueError, match=r"swe task row-7: repo_source='local'.*refused"):
        _instance("local", repo_path=str(secret))
    (root.parent / "x").mkdir()
    with pytest.raises(ValueError, match=r"field metadata\.repo='\.\./x'.*'\.\.' may not appear"):
        _instance(str(root), repo="../x")                           # the mirror lookup by `repo` stays inside too
    # legitimate: a name in the root, an absolute path inside it, the mirror of `repo`, the image
    lib = os.path.realpath(root / "acme__lib")
    assert _instance(str(root), repo_path="acme__lib").repo_path == lib
    assert _instance(str(root), repo_path=str(root / "acme__lib")).repo_path == lib
    assert _instance(str(root)).repo_path == lib
    assert _instance("image", repo_path=str(secret)).repo_path is None
    assert _instance(None).repo_path is None


def test_env_and_grader_refuse_a_row_repo_path_before_reading_it(layout):
    """Through the `swe` environment and the evaluator's grader: the root-only repository is never bundled;
    no sandbox is even made."""
    from sao_core.eval.graders import grade_swe_patch

    root, secret, sha = layout
    made = []

    def factory():
        made.append(1)
        raise AssertionError("a sandbox was made for a row whose repo_path is outside the root")

    task = task_from_swe_record(_record(sha, repo_path=str(secret)))
    env = SWEEnv(sandbox_factory=factory, repo_source=str(root))
    with pytest.raises(ValueError, match=r"swe task acme__secret-1: field metadata\.repo_path.*not inside"):
        env.reset(task)
    with pytest.raises(ValueError, match=r"swe task acme__secret-1: field metadata\.repo_path.*not inside"):
        grade_swe_patch(_record(sha, repo_path=str(secret)), "", {"repo_source": str(root)})
    with pytest.raises(ValueError, match=r"'\.\.' may not appear"):
        grade_swe_patch(_record(sha, repo_path="../private/secret_repo"), "", {"repo_source": str(root)})
    assert made == []


@needs_bwrap
def test_evaluate_on_a_prepared_folder_refuses_the_row(layout, tmp_path, tiny_model_dir):
    """`sao evaluate` end to end: a prepared swe_verified folder whose row names the root-only repository
    fails that sample with the reason, and the secret appears in no output."""
    from eval_fixtures import ScriptedEngine

    from sao_core.eval.config import EvalConfig, EvalError
    from sao_core.eval.run import evaluate, sample_seed
    from sao_core.models import load_tokenizer

    root, secret, sha = layout
    data = tmp_path / "prepared"
    data.mkdir()
    (data / "data.jsonl").write_text(json.dumps(_record(sha, repo_path=str(secret))) + "\n")
    (data / "stats.json").write_text(json.dumps({"kind": "swe_bench_verified", "status": "ok", "rows_read": 1}))
    leak = json.dumps({"name": "bash", "arguments": {"command": "cat secret.txt"}})
    script = {sample_seed(0, "swe_verified", "acme__secret-1", 0): [f"<tool_call>{leak}</tool_call>", "<submit/>"]}
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir, tmp_path), script)
    out = tmp_path / "run"
    config = EvalConfig(model="scripted-agent", output=str(out), benchmarks=["swe_verified"], k=1,
                        swe_verified_source=str(data), swe_repo_source=str(root), swe_max_turns=2,
                        max_new_tokens=256, max_total_tokens=4096, cache_dir=str(tmp_path))
    with pytest.raises(EvalError, match=r"all 1 samples failed.*metadata\.repo_path.*not inside the repository root"):
        evaluate(config, engine=engine)
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET not in path.read_text(errors="replace"), path


# ------------------------------------------------------------------------------------ host sockets


def _python(box) -> str:
    for cand in ("/usr/bin/python3", shutil.which("python3"), sys.executable):
        if cand and box.exec([cand, "-c", "print(1)"]).ok:
            return cand
    pytest.skip("no python interpreter is executable inside the sandbox")


def _socket_dirs() -> list[str]:
    """Host dirs a socket may sit in, as the review would pick them: /tmp, /var/tmp (world-writable, always
    there) and /run/user (where the host's session sockets live; only where we may create a dir there)."""
    dirs = [tempfile.mkdtemp(prefix="sao-sock-", dir="/tmp"), tempfile.mkdtemp(prefix="sao-sock-", dir="/var/tmp")]
    try:
        os.makedirs("/run/user", exist_ok=True)
        dirs.append(tempfile.mkdtemp(prefix="sao-sock-", dir="/run/user"))
    except OSError:
        pass                                                        # not root: /run/user is not ours to write
    for d in dirs:
        os.chmod(d, 0o777)
    return dirs


@needs_bwrap
def test_host_unix_sockets_are_unreachable():
    """A 0777 Unix socket served on the host under /tmp, /var/tmp and /run/user: the jail cannot connect to
    any; the control (the socket's dir shown through ro_paths) connects, so the probe itself works."""
    from sao_core.sandbox.local import LocalSandbox

    dirs = _socket_dirs()
    servers, accepted = [], []
    probe = ("import socket,sys\ns=socket.socket(socket.AF_UNIX)\ns.settimeout(3)\n"
             "try:\n    s.connect(sys.argv[1])\nexcept OSError as e:\n    print('blocked', type(e).__name__); sys.exit(7)\n"
             "print('connected')\n")
    try:
        for d in dirs:
            path = os.path.join(d, "svc.sock")
            srv = socket.socket(socket.AF_UNIX)
            srv.bind(path)
            os.chmod(path, 0o777)
            srv.listen(8)
            servers.append(srv)

            def accept(srv=srv):
                try:
                    while True:
                        accepted.append(srv.accept()[0])
                except OSError:
                    pass

            threading.Thread(target=accept, daemon=True).start()
        with LocalSandbox(SandboxLimits(wall_seconds=15)) as box:
            py = _python(box)
            for d in dirs:
                r = box.exec([py, "-c", probe, os.path.join(d, "svc.sock")])
                assert r.exit_code == 7 and "blocked" in r.stdout, (d, r)
            assert box.exec("ls -A /run /var/tmp").stdout.split() == ["/run:", "/var/tmp:"]   # empty, private
        assert accepted == []
        with LocalSandbox(SandboxLimits(wall_seconds=15), ro_paths=[dirs[1]]) as shown:   # control
            r = shown.exec([_python(shown), "-c", probe, os.path.join(dirs[1], "svc.sock")])
            assert r.ok and "connected" in r.stdout, r
        deadline = time.monotonic() + 3
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(accepted) == 1
    finally:
        for s in servers + accepted:
            s.close()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------------------------ /dev and /dev/shm


@needs_bwrap
def test_300_mb_do_not_fit_in_dev_shm_or_dev():
    """/dev/shm is a tmpfs of shm_bytes (64 MiB by default); bwrap's /dev tmpfs (unsized: half the host's
    RAM, outside RLIMIT_AS) is read-only. Small shared memory and the device nodes still work."""
    from sao_core.sandbox.local import LocalSandbox

    with LocalSandbox(SandboxLimits(wall_seconds=30, memory_mb=512)) as box:
        # RLIMIT_FSIZE (the work dir's limit) is not what stops the writes below
        assert getattr(box.limits, "workdir_bytes", 1 << 62) > 300 * MiB
        r = box.exec("head -c 300M /dev/zero > /dev/shm/big; echo rc=$?; du -sb /dev/shm/big | cut -f1")
        assert "rc=0" not in r.stdout and "No space left on device" in r.stderr, r
        assert int(r.stdout.split()[-1]) <= box.limits.shm_bytes, r
        r = box.exec("head -c 300M /dev/zero > /dev/big")
        assert r.exit_code != 0 and "Read-only file system" in r.stderr, r
        r = box.exec("rm -f /dev/shm/big; head -c 1M /dev/zero > /dev/shm/small && echo hi > /dev/null "
                     "&& head -c 4 /dev/urandom | wc -c")
        assert r.ok and r.stdout.strip() == "4", r
    with LocalSandbox(SandboxLimits(wall_seconds=30, shm_bytes=4 * MiB)) as small:
        r = small.exec("head -c 5M /dev/zero > /dev/shm/x")
        assert r.exit_code != 0 and "No space left on device" in r.stderr, r


# ------------------------------------------------------------------------------------ work dir


@needs_bwrap
def test_writing_beyond_the_work_dir_limit_fails():
    """With an 8 MiB work dir: one bigger file stops at the limit (RLIMIT_FSIZE), many smaller files that
    add up past it stop the command with a SandboxError, also mid-command (the watcher), and the
    host disk holds about the limit, not what the command asked for."""
    from sao_core.sandbox.local import DISK_POLL_SECONDS, LocalSandbox, disk_usage

    limit = 8 * MiB
    with LocalSandbox(SandboxLimits(wall_seconds=20, workdir_bytes=limit)) as box:
        assert box.exec("head -c 1M /dev/zero > ok && echo fine && rm ok").stdout == "fine\n"   # below it: fine
        try:    # the file stops at the limit; the tree then holds about the limit (over it by a block or not)
            r = box.exec("head -c 20M /dev/zero > big")
            assert r.exit_code != 0 and "File size limit exceeded" in r.stderr, r
        except SandboxError as err:
            assert "over its limit" in str(err)
        assert os.path.getsize(os.path.join(box.workdir, "big")) <= limit
        box.exec("rm -f big")
        with pytest.raises(SandboxError, match=rf"over its limit of {limit} bytes"):
            box.exec("for i in 1 2 3 4 5 6 7 8; do head -c 3M /dev/zero > f$i; done")
        box.exec("rm -f f*")
        started = time.monotonic()
        with pytest.raises(SandboxError, match="over its limit"):          # a slow writer is stopped early
            box.exec("for i in $(seq 100); do head -c 1M /dev/zero > s$i; sleep 0.1; done")
        assert time.monotonic() - started < 8, "the watcher did not stop the command before it finished"
        written = len([n for n in os.listdir(box.workdir) if n.startswith("s")])
        assert written < 100 and disk_usage(box.workdir) <= limit + (2 + 10 * DISK_POLL_SECONDS) * MiB
    with pytest.raises(ValueError, match="workdir_bytes"):
        LocalSandbox(SandboxLimits(workdir_bytes=0))


def test_evaluate_refuses_repo_source_local(tmp_path):
    """'local' (repositories wherever a row points) is refused before any work, naming the setting."""
    from sao_core.eval.config import EvalConfig, EvalError
    from sao_core.eval.run import _check_swe_settings

    config = EvalConfig(model="embedded:tiny", output=str(tmp_path / "out"), benchmarks=["swe_verified"],
                        swe_repo_source="local")
    with pytest.raises(EvalError, match="swe_repo_source 'local'.*rows cannot choose host paths"):
        _check_swe_settings(config)
