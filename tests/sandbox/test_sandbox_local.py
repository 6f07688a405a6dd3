"""LocalSandbox (bubblewrap): normal use, file access rules, and one test per escape attempt.

Every test runs real commands in a real bwrap jail; nothing is mocked. Only 127.0.0.1 is used.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
import uuid
from pathlib import Path

import pytest

from sao_core.sandbox import LocalSandbox, SandboxError, SandboxLimits
from sao_core.sandbox import local as local_mod

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None,
    reason="bubblewrap (bwrap) is not installed; install it with: apt-get update && apt-get install -y bubblewrap",
)


@pytest.fixture
def sb():
    box = LocalSandbox(SandboxLimits(wall_seconds=10, max_processes=32, memory_mb=512))
    yield box
    box.close()


def _python(box: LocalSandbox) -> str:
    """A python interpreter the sandbox user can execute (root's pyenv under /root is not)."""
    for cand in ("/usr/bin/python3", shutil.which("python3"), sys.executable):
        if cand and box.exec([cand, "-c", "print(1)"]).ok:
            return cand
    pytest.skip("no python interpreter is executable inside the sandbox")


def _procs_with(marker: str) -> list[int]:
    """PIDs on the host whose command line contains `marker`."""
    found = []
    needle = marker.encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:
            pass
    return found


def _wait_gone(marker: str, seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _procs_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ---------------------------------------------------------------------------------- normal use


def test_exec_string_list_exit_codes_and_stderr(sb):
    r = sb.exec("echo hello; echo oops >&2; exit 3")
    assert (r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated) == (3, "hello\n", "oops\n", False, False)
    assert not r.ok and r.seconds > 0
    r = sb.exec(["printf", "%s|", "a b", "c"])
    assert r.ok and r.stdout == "a b|c|"
    assert sb.exec("pwd").stdout.strip() == sb.workdir
    assert sb.exec(["sh", "-c", "exit 0"]).ok
    assert sb.exec(["definitely-not-a-command-xyz"]).exit_code in (126, 127)


def test_exec_stdin(sb):
    r = sb.exec("tr a-z A-Z", stdin="hello sandbox\n")
    assert r.ok and r.stdout == "HELLO SANDBOX\n"
    big = "x" * 1_000_000  # larger than a pipe buffer, and the command reads only part of it
    r = sb.exec("head -c 10", stdin=big)
    assert r.ok and r.stdout == "x" * 10


def test_environment_is_clean(monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "host-secret")
    box = LocalSandbox(env={"EXTRA": "1"})
    try:
        r = box.exec("env")
        assert "host-secret" not in r.stdout and "EXTRA=1" in r.stdout
        assert f"HOME={box.workdir}" in r.stdout
    finally:
        box.close()


def test_write_read_files_and_work_dir_shared_between_commands(sb):
    sb.write_file("a/b/c.txt", "hello")
    sb.write_file("bin.dat", bytes(range(256)))
    assert sb.read_file("a/b/c.txt") == b"hello"
    assert sb.read_file("bin.dat") == bytes(range(256))
    assert sb.exec("cat a/b/c.txt && echo more > a/made.txt && echo x > a/b/c.txt").ok
    assert sb.read_file("a/made.txt") == b"more\n"
    assert sb.read_file("a/b/c.txt") == b"x\n"
    sb.write_file("a/b/c.txt", "overwritten")  # a file the sandbox wrote can be overwritten
    assert sb.exec("cat a/b/c.txt").stdout == "overwritten"
    with pytest.raises(FileNotFoundError):
        sb.read_file("missing.txt")


@pytest.mark.parametrize("bad", ["/etc/passwd", "../x", "a/../../x", "..", "", ".", "a\0b"])
def test_path_escapes_refused(sb, bad):
    with pytest.raises(ValueError):
        sb.write_file(bad, "x")
    with pytest.raises(ValueError):
        sb.read_file(bad)


def test_symlinks_out_of_the_work_dir_refused(sb):
    assert sb.exec("ln -s /etc etc_link && ln -s /etc/passwd pw && ln -s .. up && mkfifo fifo").ok
    for path in ("etc_link/passwd", "pw", "up/x"):
        with pytest.raises(ValueError):
            sb.read_file(path)
    for path in ("etc_link/sao_escape", "pw", "up/sao_escape"):
        with pytest.raises(ValueError):
            sb.write_file(path, "x")
    assert not os.path.exists("/etc/sao_escape")
    assert not os.path.exists(os.path.join(os.path.dirname(sb.workdir), "sao_escape"))
    with pytest.raises(ValueError):  # a FIFO would block the host reader forever
        sb.read_file("fifo")
    # a symlink that stays inside the work dir is fine
    sb.write_file("real.txt", "inside")
    assert sb.exec("ln -s real.txt inner_link").ok
    assert sb.read_file("inner_link") == b"inside"


def test_close_removes_work_dir_and_is_idempotent():
    box = LocalSandbox()
    box.write_file("f.txt", "x")
    assert box.exec("mkdir -p d/e && touch d/e/f && chmod 000 d").ok
    workdir = box.workdir
    box.close()
    assert not os.path.exists(workdir)
    box.close()
    with pytest.raises(SandboxError):
        box.exec("true")


def test_missing_bwrap_gives_install_command(monkeypatch):
    real_which = shutil.which
    monkeypatch.setattr(local_mod.shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real_which(name))
    with pytest.raises(SandboxError, match="apt-get install -y bubblewrap"):
        LocalSandbox()


def test_bwrap_command_line(sb):
    argv = sb.bwrap_argv(["true"])
    for opt in ("--unshare-all", "--unshare-user", "--die-with-parent", "--new-session"):
        assert opt in argv
    assert "--share-net" not in argv
    # no host root: the toolchain read-only, the work dir writable, the empty root read-only at the end
    pairs = [argv[i + 1: i + 3] for i, a in enumerate(argv) if a == "--ro-bind"]
    assert ["/", "/"] not in pairs and ["/usr", "/usr"] in pairs
    assert not any(dest in ("/home", "/root", "/work", "/etc", "/etc/passwd") for src, dest in pairs
                   if src == dest)
    assert argv[argv.index("--bind") + 1: argv.index("--bind") + 3] == [sb.workdir, sb.workdir]
    assert argv[argv.index("--remount-ro", argv.index("--bind")): argv.index("--remount-ro", argv.index("--bind")) + 2] \
        == ["--remount-ro", "/"]
    assert argv[argv.index("--uid") + 1] == str(local_mod.SANDBOX_UID)
    assert argv[-1] == "true" and "--nproc=33" in argv and f"--as={512 * 1024 * 1024}" in argv
    assert f"--fsize={sb.limits.workdir_bytes}" in argv
    # /dev/shm sized, then /dev read-only; the host's socket and scratch dirs covered by private tmpfs mounts
    dev = argv.index("--dev")
    assert argv[dev: dev + 8] == ["--dev", "/dev", "--size", str(sb.limits.shm_bytes), "--tmpfs", "/dev/shm",
                                  "--remount-ro", "/dev"]
    tmpfs = {argv[i + 1] for i, a in enumerate(argv) if a == "--tmpfs"}
    assert {os.path.realpath(d) for d in local_mod.HIDDEN_HOST_DIRS if os.path.isdir(d)} <= tmpfs


# ---------------------------------------------------------------------------------- escape attempts


def test_network_is_unreachable():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]
    accepted = []

    def accept():
        try:
            while True:
                conn, _ = server.accept()
                accepted.append(conn)
        except OSError:
            pass

    threading.Thread(target=accept, daemon=True).start()
    code = (
        "import socket,sys\n"
        f"try:\n    socket.create_connection(('127.0.0.1', {port}), timeout=3)\n"
        "except OSError as e:\n    print('blocked', type(e).__name__); sys.exit(7)\n"
        "print('connected')\n"
    )
    box = LocalSandbox()
    open_box = LocalSandbox(SandboxLimits(network=True))
    try:
        py = _python(box)
        r = box.exec([py, "-c", code])
        assert r.exit_code == 7 and "blocked" in r.stdout, r
        interfaces = {line.split(":")[0].strip() for line in box.exec("cat /proc/net/dev").stdout.splitlines()[2:]}
        assert interfaces == {"lo"}  # a fresh network namespace: loopback only
        # control: the same code reaches the server when the network is allowed
        r = open_box.exec([_python(open_box), "-c", code])
        assert r.ok and "connected" in r.stdout, r
        assert len(accepted) == 1
    finally:
        box.close()
        open_box.close()
        server.close()


def test_writes_outside_the_work_dir_do_not_reach_the_host(sb):
    name = f"sao_escape_{uuid.uuid4().hex}"
    # a host directory that permissions would allow anyone to write: only the read-only mount stops it
    # (not under /tmp, /var/tmp or /run: the jail hides those behind private tmpfs mounts)
    open_dir = tempfile.mkdtemp(prefix=".sao-open-", dir=os.path.dirname(os.path.abspath(__file__)))
    os.chmod(open_dir, 0o777)
    try:
        for target in (f"/etc/{name}", f"{open_dir}/{name}", f"/tmp/{name}", f"/var/tmp/{name}", f"../{name}",
                       f"{Path.home()}/{name}"):
            sb.exec(f"echo pwned > {target}")
        r = sb.exec(f"echo pwned > /etc/{name}")
        assert r.exit_code != 0 and "Read-only file system" in r.stderr
        r = sb.exec(f"echo pwned > {open_dir}/{name}")
        # the jail does not show the host's tree at all: the dir is not there (and the root is read-only)
        assert r.exit_code != 0 and "No such file or directory" in r.stderr
        # /tmp and /var/tmp inside are private tmpfs mounts: the write works there but never lands on the host
        assert sb.exec(f"echo ok > /tmp/{name} && cat /tmp/{name}").stdout == "ok\n"
        assert sb.exec(f"echo ok > /var/tmp/{name} && cat /var/tmp/{name}").stdout == "ok\n"
        for target in (f"/etc/{name}", f"{open_dir}/{name}", f"/tmp/{name}", f"/var/tmp/{name}", f"{Path.home()}/{name}",
                       os.path.join(os.path.dirname(sb.workdir), name)):
            assert not os.path.exists(target), target
        assert not sb.exec("touch /usr/bin/sao_x").ok and not os.path.exists("/usr/bin/sao_x")
    finally:
        shutil.rmtree(open_dir, ignore_errors=True)


def test_fork_bomb_is_contained():
    marker = f"bomb_{uuid.uuid4().hex[:12]}"
    # a 2 s wall (4 s before): the script hits the process cap within milliseconds of starting; the rest of the
    # wall is the real bomb running until the kill
    box = LocalSandbox(SandboxLimits(wall_seconds=2, max_processes=16, memory_mb=256))
    try:
        py = _python(box)
        box.write_file(f"{marker}.py", (
            "import os, time\n"
            "n = 0\n"
            "try:\n"
            "    while True:\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(60); os._exit(0)\n"
            "        n += 1\n"
            "except OSError as e:\n"
            "    print('forks', n, e.errno, flush=True)\n"
            "while True:\n"            # then a real bomb: every process keeps forking
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        pass\n"
        ))
        start = time.monotonic()
        r = box.exec([py, f"{marker}.py"])
        elapsed = time.monotonic() - start
        assert r.timed_out and r.exit_code is None
        assert elapsed < 2 + 3
        words = r.stdout.split()
        assert words[0] == "forks" and int(words[1]) < 16 and int(words[2]) == 11  # EAGAIN at the cap
        assert _wait_gone(marker) == []
        # the host and the sandbox still work
        assert subprocess.run(["true"]).returncode == 0
        assert box.exec("echo alive").stdout == "alive\n"
    finally:
        box.close()


def test_process_limit_is_per_sandbox():
    """RLIMIT_NPROC is counted per user namespace: two sandboxes (same uid) do not share one budget."""
    boxes = [LocalSandbox(SandboxLimits(max_processes=12)) for _ in range(2)]
    try:
        cmd = "for i in $(seq 8); do sleep 1 & done; wait; echo done"
        results = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, boxes[i].exec(cmd))) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r.ok and r.stdout == "done\n" for r in results), results
        r = boxes[0].exec("for i in $(seq 20); do sleep 1 & done; wait")
        assert "Resource temporarily unavailable" in r.stdout + r.stderr
    finally:
        for b in boxes:
            b.close()


def test_endless_loop_killed_at_wall_timeout(sb):
    start = time.monotonic()
    r = sb.exec("echo started; while :; do :; done", timeout_s=1)
    elapsed = time.monotonic() - start
    assert r.timed_out and r.exit_code is None and not r.ok
    assert r.stdout == "started\n"
    assert elapsed >= 1   # killed at its timeout, not before (an upper bound would fail on a loaded machine)


def test_huge_output_is_capped_without_buffering_it():
    box = LocalSandbox(SandboxLimits(output_bytes=4096))
    try:
        tracemalloc.start()
        try:
            r = box.exec("head -c 100000000 /dev/zero | tr '\\0' a & head -c 50000000 /dev/zero | tr '\\0' b >&2; wait")
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert r.ok and r.truncated
        assert r.stdout == "a" * 4096 and r.stderr == "b" * 4096
        assert peak < 8 * 1024 * 1024  # 150 MB went through; we kept a few KiB
        start = time.monotonic()
        r = box.exec("yes", timeout_s=0.75)  # endless output: drained until the wall timeout
        assert r.timed_out and r.truncated and len(r.stdout) == 4096
        assert time.monotonic() - start < 0.75 + 3
    finally:
        box.close()


def test_background_processes_do_not_survive(sb):
    marker = f"bg_{uuid.uuid4().hex[:12]}"
    start = time.monotonic()
    r = sb.exec(f"(exec -a {marker}_a sleep 300) & setsid nohup bash -c 'exec -a {marker}_b sleep 300' "
                ">/dev/null 2>&1 & echo started")
    assert r.ok and r.stdout == "started\n" and time.monotonic() - start < 5
    assert _wait_gone(marker) == []  # the PID namespace died with the command


def test_close_kills_a_running_command():
    marker = f"run_{uuid.uuid4().hex[:12]}"
    box = LocalSandbox()
    outcome = {}

    def run():
        try:
            outcome["result"] = box.exec(f"exec -a {marker} sleep 300", timeout_s=120)
        except SandboxError as e:
            outcome["error"] = e

    t = threading.Thread(target=run)
    t.start()
    deadline = time.monotonic() + 10
    while not any(_pid_is_sleep(p) for p in _procs_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    start = time.monotonic()
    box.close()
    t.join(timeout=10)
    assert not t.is_alive() and time.monotonic() - start < 5
    assert "error" in outcome and "closed" in str(outcome["error"])
    assert _wait_gone(marker) == []
    assert not os.path.exists(box.workdir)


def _pid_is_sleep(pid: int) -> bool:
    try:
        return os.readlink(f"/proc/{pid}/exe").endswith("sleep")
    except OSError:
        return False


def test_memory_limit(sb):
    box = LocalSandbox(SandboxLimits(memory_mb=256))
    try:
        py = _python(box)
        r = box.exec([py, "-c", "b = bytearray(4 * 1024**3); print('allocated')"])
        assert r.exit_code != 0 and "MemoryError" in r.stderr and "allocated" not in r.stdout
        r = box.exec([py, "-c", "b = bytearray(64 * 1024**2); print(len(b))"])  # within the limit
        assert r.ok and r.stdout == f"{64 * 1024**2}\n"
    finally:
        box.close()


def test_root_option_and_jail_setup_failure():
    parent = tempfile.mkdtemp(prefix="sao-root-")
    try:
        os.chmod(parent, 0o755)
        box = LocalSandbox(root=parent)
        assert os.path.dirname(box.workdir) == os.path.realpath(parent)
        assert box.exec("echo in > f && cat f").stdout == "in\n"
        shutil.rmtree(box.workdir)  # the jail can no longer be built: a SandboxError, not an exit code
        with pytest.raises(SandboxError, match="bubblewrap failed"):
            box.exec("true")
        box.close()
        if os.geteuid() == 0:  # the sandbox user must be able to reach the work dir
            os.chmod(parent, 0o700)
            with pytest.raises(SandboxError, match="not traversable"):
                LocalSandbox(root=parent)
            assert os.listdir(parent) == []  # nothing left behind
    finally:
        shutil.rmtree(parent, ignore_errors=True)


def test_make_sandbox_local():
    from sao_core.sandbox import make_sandbox

    box = make_sandbox("local", SandboxLimits(wall_seconds=3))
    try:
        assert isinstance(box, LocalSandbox) and box.limits.wall_seconds == 3
        assert box.exec("echo ok").ok
    finally:
        box.close()


def test_ro_paths_show_hidden_host_paths_read_only(tmp_path):
    # The jail mounts a private /tmp, so host files under /tmp are invisible unless listed in ro_paths.
    host_dir = tempfile.mkdtemp(prefix="sao-ro-")
    os.chmod(host_dir, 0o755)
    with open(os.path.join(host_dir, "tool.txt"), "w") as f:
        f.write("visible")
    os.chmod(os.path.join(host_dir, "tool.txt"), 0o644)
    try:
        with LocalSandbox() as hidden:
            assert not hidden.exec(f"cat {host_dir}/tool.txt").ok
        with LocalSandbox(ro_paths=[host_dir]) as shown:
            assert shown.exec(f"cat {host_dir}/tool.txt").stdout == "visible"
            assert not shown.exec(f"echo x > {host_dir}/tool.txt").ok
        with open(os.path.join(host_dir, "tool.txt")) as f:
            assert f.read() == "visible"
        with pytest.raises(SandboxError, match="do not exist"):
            LocalSandbox(ro_paths=["/no/such/dir"])
    finally:
        shutil.rmtree(host_dir, ignore_errors=True)
