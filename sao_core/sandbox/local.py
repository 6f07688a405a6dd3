"""Local sandbox: every command runs in a fresh bubblewrap (`bwrap`) jail over a private work dir.

Isolation, per `exec` call (see `LocalSandbox.bwrap_argv` for the exact argument list):

- **File system**: the jail does NOT see the host root. It starts from an empty root and shows only
  what a test run needs (`LocalSandbox.jail_mounts` is the one list): the toolchain read-only
  (`TOOLCHAIN_DIRS`: /usr, /bin, /sbin, /lib, /lib32, /lib64, /libx32, where they exist; a link
  such as /bin -> usr/bin stays a link), a minimal /etc (`ETC_ENTRIES`: the dynamic linker's cache,
  certificates, time zone, name-service, git's and Python's system config; with
  `limits.network` also `NETWORK_ETC_ENTRIES`, resolv.conf and hosts), a SYNTHETIC /etc/passwd and
  /etc/group holding only root and nobody (`JAIL_PASSWD`, `JAIL_GROUP`) and, without network, a
  synthetic /etc/hosts that names only localhost (all three written into the sandbox's own private
  dir, not the host's), the interpreter the sandbox is asked to use (`python=`: its virtualenv, its
  base prefix or conda env, read-only, its bin dir first on PATH), the caller's `ro_paths`
  (read-only), and the work dir (writable, private to this sandbox, the current directory and
  `$HOME`). Nothing of /home, /root, /work, /srv, /mnt, /media, /opt (unless the interpreter
  lives there: then only its prefix), /var or the rest of /etc is shown, so token files, cloud
  credentials, other users' files and project outputs are not there to read, whatever their
  permissions. The root itself is an empty tmpfs made read-only once set up. The command runs as
  uid/gid 65534 inside (`--uid`/`--gid`), the `nobody` of the synthetic /etc/passwd.
- **No side doors to host services**: /tmp, /var/tmp and /run (`HIDDEN_HOST_DIRS`, /var/run a link
  to /run) are empty private tmpfs mounts (/tmp sized to `memory_mb`, the others to
  `SMALL_TMPFS_BYTES`), so a host socket there (a database's, D-Bus's, a user's agent under
  /run/user) cannot be connected to even when its mode is 0777, and nothing written there reaches
  the host.
- **/dev**: bwrap's `--dev` tmpfs (unsized: half the host's RAM, outside RLIMIT_AS) is remounted
  read-only after set-up (device nodes still work), and `/dev/shm` is a private tmpfs of
  `limits.shm_bytes` bytes, so shared memory cannot grow past that.
- **Disk**: the work dir may use `limits.workdir_bytes` bytes (allocated blocks, summed over its
  tree; default 2 GiB). RLIMIT_FSIZE = that limit stops any single file at it; a watcher thread
  sums the tree every `DISK_POLL_SECONDS` (slower for big trees) while a command runs and once when
  it ends, kills the command past the limit and raises `SandboxError` (the work dir is left as it
  is; close the sandbox). Between two polls a command can overshoot by what it writes in that
  time. Host-side `write_file` is not counted until the next command.
- **Namespaces**: new user, PID, network, IPC, UTS and cgroup namespaces (`--unshare-all
  --unshare-user`); nested user namespaces are refused (`--disable-userns`, when bwrap supports it).
  Without `limits.network` the command sees only its own, empty loopback device: no host services
  (127.0.0.1 included) and no internet. `--die-with-parent` and `--new-session` are set.
- **Processes**: each command runs as PID 1's only child in its own PID namespace; when the command
  exits, or when the wall-clock timeout kills bwrap's process group with SIGKILL, the kernel kills
  every process left in that namespace (background jobs, `setsid`/`nohup` daemons included). No
  process outlives the `exec` call that started it; `close()` kills whatever is still running.
- **Resource limits** (`prlimit`, inside the jail, soft = hard): RLIMIT_CPU = `cpu_seconds`,
  RLIMIT_AS = `memory_mb` MiB, RLIMIT_NPROC = `max_processes` (+1 for bwrap's PID 1), RLIMIT_FSIZE =
  `workdir_bytes` bytes.
- **Fork bombs**: RLIMIT_NPROC is ignored for processes whose real uid is host root (the kernel
  exempts `INIT_USER` and CAP_SYS_ADMIN/CAP_SYS_RESOURCE), and `bwrap --unshare-user --uid N` run by
  root still maps the sandbox user to host root. So when this process is root, bwrap itself is
  started as the unprivileged uid/gid 65534 (`nobody`, via `subprocess` `user=`/`group=`, no
  `preexec_fn`) and the work directory is chowned to it; bwrap then creates an unprivileged user
  namespace. Since Linux 5.14 RLIMIT_NPROC is counted per (user namespace, uid), so the limit counts
  only this command's processes (not every process of uid 65534 on the host, nor those of other
  sandboxes) and a fork bomb stops at `max_processes`, then dies at the wall timeout. When this
  process is not root, bwrap runs under the caller's uid with the same effect.
- **Output**: stdout and stderr are read concurrently by two threads; each keeps at most
  `output_bytes` and reads-and-discards the rest (`truncated=True`), so memory stays bounded and the
  child never blocks on a full pipe.
- **Environment**: a clean environment (PATH, HOME, LANG, TMPDIR, TERM plus `env=`), so host
  secrets such as cloud credentials are not passed in. A string command runs under `bash -c`
  (not `-l`: Debian's /etc/profile would reset PATH and drop e.g. a virtualenv).

Limits (what this does NOT give you): it shares the host kernel (a kernel exploit escapes); what
`jail_mounts` shows (the toolchain, the /etc entries, the interpreter's dirs, `ro_paths`) is
readable, so do not list in `ro_paths` a dir that holds secrets or a host service's socket; the
work dir's limit is enforced by polling, not by a kernel quota; CPU is not shared fairly
(RLIMIT_CPU only bounds CPU seconds). It needs `bwrap` (Debian/Ubuntu: `apt-get update && apt-get
install -y bubblewrap`), `prlimit` (util-linux) and unprivileged user namespaces. When run as root,
the work directory's parents, the interpreter's dirs and `ro_paths` must be traversable by uid
65534 (the default temp dir is; root's own /root is not). Use the Kubernetes sandbox for untrusted
production workloads.
"""

from __future__ import annotations

import errno
import glob
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import PurePosixPath

from sao_core.sandbox.base import ExecResult, SandboxError, SandboxLimits

__all__ = [
    "DISK_POLL_SECONDS",
    "ETC_ENTRIES",
    "HIDDEN_HOST_DIRS",
    "INSTALL_HINT",
    "JAIL_GROUP",
    "JAIL_HOSTS",
    "JAIL_PASSWD",
    "LocalSandbox",
    "SANDBOX_UID",
    "NETWORK_ETC_ENTRIES",
    "SMALL_TMPFS_BYTES",
    "TOOLCHAIN_DIRS",
    "check_relative_path",
    "disk_usage",
    "interpreter_dirs",
]

INSTALL_HINT = "apt-get update && apt-get install -y bubblewrap"
SANDBOX_UID = 65534  # `nobody`: the uid bwrap runs as when this process is root
_CHUNK = 1 << 16
_DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: Scratch dirs of the jail, each an empty private tmpfs: on the host, services and users put their
#: Unix sockets there (a socket on a read-only mount still accepts connections), and scratch files,
#: so none of the host's is shown (/var/run is a link to /run inside).
HIDDEN_HOST_DIRS = ("/tmp", "/var/tmp", "/run", "/var/run")
#: Size of the private tmpfs over each hidden dir other than /tmp, in bytes (a tmpfs is RAM that
#: RLIMIT_AS does not count, so it must be small).
SMALL_TMPFS_BYTES = 16 * 1024 * 1024
#: The host's toolchain, shown read-only where it exists: programs, shared libraries, the system
#: Python and its packages (/usr/local included). A top-level link (/bin -> usr/bin on merged-/usr
#: systems) is recreated as a link.
TOOLCHAIN_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
#: The /etc entries programs need, shown read-only where they exist (names, or globs, under /etc):
#: the dynamic linker's cache and config, `alternatives` (links into /usr), CA certificates, the
#: time zone, name-service and protocol tables, MIME types, git's and Python's system config. Of
#: /etc/ssl and /etc/pki only the public certificates and OpenSSL's config (not ssl/private). Not
#: passwd / group (synthetic, below), shadow, sudoers, ssh, pip.conf, npmrc and the like (they can
#: hold credentials) nor anything else of the host's /etc.
ETC_ENTRIES = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives",
    "ssl/certs", "ssl/openssl.cnf", "ca-certificates", "ca-certificates.conf",
    "pki/ca-trust", "pki/tls/certs", "pki/tls/cert.pem", "pki/tls/openssl.cnf", "crypto-policies",
    "localtime", "timezone", "nsswitch.conf", "protocols", "services", "mime.types",
    "gitconfig", "python3", "python3.*",
)
#: /etc entries shown only with `limits.network` (name resolution). Without network the jail gets
#: `JAIL_HOSTS` as /etc/hosts instead.
NETWORK_ETC_ENTRIES = ("resolv.conf", "hosts", "host.conf", "gai.conf")
#: The jail's /etc/passwd and /etc/group: root and nobody only (never the host's list of users).
JAIL_PASSWD = ("root:x:0:0:root:/root:/usr/sbin/nologin\n"
               f"nobody:x:{SANDBOX_UID}:{SANDBOX_UID}:nobody:/nonexistent:/usr/sbin/nologin\n")
JAIL_GROUP = f"root:x:0:\nnogroup:x:{SANDBOX_UID}:\n"
#: The jail's /etc/hosts without network: localhost only (tests that bind to "localhost" still resolve it).
JAIL_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
#: Dirs an interpreter's prefix may not be (showing one would show a home or a whole top-level tree).
_TOO_WIDE = frozenset({"/", "/home", "/root", "/work", "/srv", "/mnt", "/media", "/opt", "/var", "/etc",
                       "/tmp", "/run", "/usr", "/usr/local"})
#: How often the work dir's disk use is summed while a command runs, in seconds (at least; a tree
#: that takes long to walk is walked less often, see `_DiskWatch`).
DISK_POLL_SECONDS = 0.5


def check_relative_path(path: str) -> PurePosixPath:
    """Validate a sandbox-relative path: relative, no `..`, no NUL. Raises ValueError otherwise."""
    if not isinstance(path, str | os.PathLike):
        raise ValueError(f"path must be a string, got {type(path).__name__}")
    text = os.fspath(path)
    if not text or "\0" in text:
        raise ValueError(f"invalid sandbox path {text!r}")
    p = PurePosixPath(text)
    if p.is_absolute():
        raise ValueError(f"sandbox paths are relative to the work directory, got absolute {text!r}")
    if ".." in p.parts:
        raise ValueError(f"sandbox path {text!r} escapes the work directory ('..')")
    if not p.parts or p.parts == (".",):
        raise ValueError(f"sandbox path {text!r} names the work directory itself, not a file")
    return p


def disk_usage(path: str) -> int:
    """Bytes the tree at `path` occupies on disk: allocated blocks (a sparse file counts what it
    holds), each inode once (hard links), symlinks not followed. A directory we may not read (the
    sandbox, running as our uid, can chmod 000 its own dirs) is made readable by its owner first;
    an entry that vanishes during the walk counts nothing."""
    total, seen = 0, set()
    stack = [path]
    while stack:
        current = stack.pop()
        for entry in _scan(current):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
            if stat.S_ISDIR(st.st_mode):
                stack.append(entry.path)
    return total


def _scan(directory: str) -> list[os.DirEntry]:
    """The entries of `directory`; one retry after `chmod u+rwx` when we are refused (our own uid's
    dir that the sandbox locked); [] when it is gone or still unreadable."""
    for attempt in range(2):
        try:
            with os.scandir(directory) as it:
                return list(it)
        except PermissionError:
            if attempt:
                return []
            try:
                os.chmod(directory, stat.S_IMODE(os.lstat(directory).st_mode) | stat.S_IRWXU)
            except OSError:
                return []
        except OSError:
            return []
    return []


class _DiskWatch:
    """While one command runs, sum the work dir's disk use now and then; past `limit` bytes, record
    the use and call `kill`. The pause between walks is `DISK_POLL_SECONDS`, or ten times the last
    walk's duration when that is longer, so a big tree costs at most ~10% of a core."""

    def __init__(self, workdir: str, limit: int, kill):
        self.workdir, self.limit, self.kill = workdir, limit, kill
        self.exceeded: int | None = None      # the use (bytes) that crossed the limit, if any
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pause = DISK_POLL_SECONDS
        while not self._stop.wait(pause):
            started = time.monotonic()
            if self.check():
                self.kill()
                return
            pause = max(DISK_POLL_SECONDS, 10 * (time.monotonic() - started))

    def check(self) -> bool:
        """Sum the tree once; True (and `exceeded` set) when it is over the limit."""
        used = disk_usage(self.workdir)
        if used > self.limit:
            self.exceeded = used
            return True
        return False

    def finish(self) -> int | None:
        """Stop polling, sum once more (the command is over), return the use past the limit or None."""
        self._stop.set()
        self.thread.join(timeout=60)
        if self.exceeded is None:
            self.check()
        return self.exceeded


def _under(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _toolchain_real() -> list[str]:
    """The real paths of the `TOOLCHAIN_DIRS` that exist here (each once)."""
    found: list[str] = []
    for path in TOOLCHAIN_DIRS:
        if os.path.isdir(path):
            real = os.path.realpath(path)
            if real not in found:
                found.append(real)
    return found


def _show_host_path(path: str, shown_real: Sequence[str]) -> list[str]:
    """bwrap arguments that show the host's `path` read-only at the same place: a link whose target
    lies in `shown_real` (e.g. /bin -> usr/bin, /etc/localtime -> /usr/share/zoneinfo/...) is
    recreated as the same link, so programs that read the link (a time zone's name) see it;
    anything else is bound from its real path (the jail may not show where a link leads)."""
    real = os.path.realpath(path)
    if os.path.islink(path) and any(_under(real, d) for d in shown_real):
        return ["--symlink", os.readlink(path), path]
    return ["--ro-bind", real, path]


def _pyvenv_home(cfg: str) -> str | None:
    """The ``home`` key of a virtualenv's pyvenv.cfg: the bin dir of the Python it was made from."""
    try:
        with open(cfg, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep and key.strip() == "home" and value.strip():
                    return value.strip()
    except OSError:
        return None
    return None


def _user_homes() -> set[str]:
    """Home dirs of the host's users (and ours): an interpreter prefix may not be one of them."""
    homes = {os.path.realpath(os.path.expanduser("~"))}
    try:
        import pwd

        homes.update(os.path.realpath(e.pw_dir) for e in pwd.getpwall() if e.pw_dir)
    except (ImportError, OSError):  # pragma: no cover - no pwd module / no passwd
        pass
    return homes


def interpreter_dirs(python: str, search_path: str = _DEFAULT_PATH) -> tuple[str, list[str]]:
    """What the jail must show for the interpreter `python` (a path, or a name looked up on
    `search_path`) to run: ``(its bin dir, host dirs to show read-only)``.

    The dirs: a virtualenv (the dir above the bin dir holds pyvenv.cfg) and the base install it
    was made from (pyvenv.cfg's ``home`` is that install's bin dir); else the interpreter's own
    prefix (a conda env, a pyenv version, /opt/python/3.x), plus the conda package cache of an env
    under ``<conda>/envs/`` (its files may link there); and the prefix of the real executable the
    path links to. Dirs inside `TOOLCHAIN_DIRS` are left out (the jail shows those anyway). A
    prefix that is a user's home or a top-level dir (/, /home, /opt, ...) is refused with
    `SandboxError`: showing it would show everything in it."""
    exe = python if "/" in python else shutil.which(python, path=search_path)
    if not exe or not os.path.isfile(exe) or not os.access(exe, os.X_OK):
        raise SandboxError(f"python interpreter {python!r} not found (PATH {search_path})")
    exe = os.path.abspath(exe)
    bindir = os.path.dirname(exe)
    prefix = os.path.dirname(bindir)
    wanted = [prefix]
    home = _pyvenv_home(os.path.join(prefix, "pyvenv.cfg"))
    if home:  # a virtualenv: its base install's prefix too
        wanted.append(os.path.dirname(os.path.abspath(home).rstrip("/")))
    if os.path.isdir(os.path.join(prefix, "conda-meta")) and os.path.basename(os.path.dirname(prefix)) == "envs":
        pkgs = os.path.join(os.path.dirname(os.path.dirname(prefix)), "pkgs")
        if os.path.isdir(pkgs):
            wanted.append(pkgs)
    wanted.append(os.path.dirname(os.path.dirname(os.path.realpath(exe))))
    toolchain, homes = _toolchain_real(), _user_homes()
    dirs: list[str] = []
    for path in wanted:
        real = os.path.realpath(path)
        if any(_under(real, d) or _under(path, d) for d in (*toolchain, *TOOLCHAIN_DIRS)):
            continue
        if real in _TOO_WIDE or path in _TOO_WIDE or real in homes:
            raise SandboxError(f"python {python!r}: its prefix {path} is a home or top-level dir, which the "
                               "jail does not show whole; install the interpreter in a prefix of its own "
                               "(a virtualenv, a conda env) or pass the dirs it needs in ro_paths")
        if path not in dirs:
            dirs.append(path)
    return bindir, dirs


@lru_cache(maxsize=4)
def _bwrap_features(bwrap: str) -> frozenset[str]:
    """Options this bwrap build supports (older builds lack --disable-userns, --size, ...)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:  # pragma: no cover - broken install
        raise SandboxError(f"cannot run {bwrap} --help: {e}") from e
    text = out.stdout + out.stderr
    return frozenset(o for o in ("--disable-userns", "--size", "--json-status-fd", "--perms") if o in text)


class _Capture:
    """Drain one pipe in a thread, keeping at most `cap` bytes."""

    def __init__(self, fd: int, cap: int):
        self.fd, self.cap = fd, max(0, cap)
        self.buf = bytearray()
        self.truncated = False
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                try:
                    chunk = os.read(self.fd, _CHUNK)
                except InterruptedError:  # pragma: no cover
                    continue
                except OSError:
                    return
                if not chunk:
                    return
                room = self.cap - len(self.buf)
                if room > 0:
                    self.buf += chunk[:room]
                if len(chunk) > room:
                    self.truncated = True
        finally:
            try:
                os.close(self.fd)
            except OSError:
                pass

    def text(self) -> str:
        return bytes(self.buf).decode("utf-8", errors="replace")


def _command_argv(command: str | list[str]) -> list[str]:
    """The argv of a sandbox command: a string runs under `bash -c`; a list is the argv (ValueError when empty)."""
    if isinstance(command, str):
        return ["bash", "-c", command]
    argv = [os.fspath(a) for a in command]
    if not argv:
        raise ValueError("empty command")
    return argv


def _read_to_end(fd: int) -> bytes:
    """All bytes from `fd` until EOF; closes it."""
    data = b""
    try:
        while chunk := os.read(fd, _CHUNK):
            data += chunk
    finally:
        os.close(fd)
    return data


def _feed(fd: int, data: bytes) -> None:
    """Write stdin in a thread (a child that does not read must not block us), then close it."""
    try:
        view = memoryview(data)
        while view:
            n = os.write(fd, view[:_CHUNK])
            view = view[n:]
    except OSError:  # BrokenPipe: the command exited or closed stdin
        pass
    finally:
        try:
            os.close(fd)
        except OSError:
            pass


class LocalSandbox:
    """A bubblewrap jail over a private work directory (see the module docstring)."""

    def __init__(
        self,
        limits: SandboxLimits = SandboxLimits(),
        root: str | None = None,
        env: Mapping[str, str] | None = None,
        ro_paths: Sequence[str] = (),
        python: str | None = None,
    ):
        """`ro_paths`: host paths to show read-only inside the jail (the jail shows nothing of the
        host beyond `jail_mounts`' list; e.g. a virtualenv's site-packages or a tools dir).
        `python`: the interpreter commands should use (a path, or a name looked up on the jail's
        PATH; e.g. ``sys.executable``): its virtualenv / prefix / conda env is shown read-only
        (`interpreter_dirs`) and its bin dir goes first on PATH. None: only the toolchain's."""
        self.limits = limits
        for name in ("workdir_bytes", "shm_bytes"):
            if int(getattr(limits, name)) < 1:
                raise ValueError(f"SandboxLimits.{name} must be a positive number of bytes")
        self.ro_paths = [os.path.realpath(p) for p in ro_paths]
        missing = [p for p in self.ro_paths if not os.path.exists(p)]
        if missing:
            raise SandboxError(f"ro_paths do not exist on the host: {', '.join(missing)}")
        self._bwrap = shutil.which("bwrap")
        if self._bwrap is None:
            raise SandboxError(f"bubblewrap (bwrap) is not installed; install it with: {INSTALL_HINT}")
        self._prlimit = shutil.which("prlimit")
        if self._prlimit is None:
            raise SandboxError("prlimit (util-linux) is not installed; install it with: apt-get install -y util-linux")
        self._features = _bwrap_features(self._bwrap)
        self._as_root = os.geteuid() == 0
        self._toolchain = _toolchain_real()
        self._env = {
            "PATH": os.environ.get("PATH", _DEFAULT_PATH),
            "LANG": "C.UTF-8",
            "TMPDIR": "/tmp",
            "TERM": "dumb",
            **(env or {}),
        }
        self.python_dirs: list[str] = []
        if python is not None:
            bindir, self.python_dirs = interpreter_dirs(os.fspath(python), self._env["PATH"])
            if self._as_root:
                for path in self.python_dirs:
                    self._check_reachable(path, f"python {python!r}")
            # the interpreter asked for is the one `python` finds (what test commands call)
            self._env["PATH"] = bindir + ":" + self._env["PATH"]
        self._lock = threading.Lock()
        self._procs: set[subprocess.Popen] = set()
        self._closed = False
        self.workdir = os.path.realpath(tempfile.mkdtemp(prefix="sao-sandbox-", dir=root))
        self._etc_dir = ""
        try:
            if self._as_root:
                os.chown(self.workdir, SANDBOX_UID, SANDBOX_UID)
                self._check_traversable(self.workdir)
            self._etc_dir = self._write_jail_etc(os.path.dirname(self.workdir))
        except BaseException:
            shutil.rmtree(self.workdir, ignore_errors=True)
            raise
        self._env.setdefault("HOME", self.workdir)   # private and writable (the host's HOME is not shown)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _write_jail_etc(parent: str) -> str:
        """A private host dir (next to the work dir, outside it: the command cannot change it)
        holding the jail's synthetic /etc/passwd, /etc/group and /etc/hosts; returns its path."""
        path = os.path.realpath(tempfile.mkdtemp(prefix="sao-sandbox-etc-", dir=parent))
        try:
            os.chmod(path, 0o755)       # bwrap, as uid 65534 when we are root, binds from it
            for name, text in (("passwd", JAIL_PASSWD), ("group", JAIL_GROUP), ("hosts", JAIL_HOSTS)):
                with open(os.path.join(path, name), "w", encoding="utf-8") as f:
                    f.write(text)
                os.chmod(os.path.join(path, name), 0o644)
        except BaseException:
            shutil.rmtree(path, ignore_errors=True)
            raise
        return path

    @staticmethod
    def _check_reachable(path: str, what: str) -> None:
        """When we are root, bwrap runs as uid 65534 and can bind only what that uid can reach:
        refuse early (with the reason) a dir whose path it cannot traverse."""
        current = os.path.realpath(path)
        while True:
            st = os.stat(current)
            if not (st.st_mode & stat.S_IXOTH or st.st_uid == SANDBOX_UID):
                raise SandboxError(f"{what}: {current} is not traversable by uid {SANDBOX_UID}, which runs "
                                   "the sandbox when this process is root; install the interpreter where "
                                   "that uid can read it (e.g. a virtualenv made from /usr/bin/python3)")
            if current == "/":
                return
            current = os.path.dirname(current)

    @staticmethod
    def _check_traversable(workdir: str) -> None:
        parent = os.path.dirname(workdir)
        while True:
            st = os.stat(parent)
            if not (st.st_mode & stat.S_IXOTH or st.st_uid == SANDBOX_UID):
                raise SandboxError(
                    f"sandbox root: {parent} is not traversable by uid {SANDBOX_UID}, which runs the "
                    "sandbox when this process is root; choose a root whose parents are o+x "
                    "(e.g. the default temp dir)"
                )
            if parent == "/":
                return
            parent = os.path.dirname(parent)

    def bwrap_argv(self, argv: list[str], status_fd: int | None = None) -> list[str]:
        """The full command line for one sandboxed command (exposed for tests and documentation).

        `status_fd`: where bwrap writes its JSON status (child started / exit code), if supported."""
        lim = self.limits
        args = [self._bwrap, "--unshare-all", "--unshare-user"]
        if "--disable-userns" in self._features:
            args.append("--disable-userns")
        if lim.network:
            args.append("--share-net")
        # nobody inside, whoever runs bwrap: the synthetic /etc/passwd names it
        args += ["--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--die-with-parent", "--new-session"]
        args += self.jail_mounts()
        args += ["--chdir", self.workdir]
        if status_fd is not None and "--json-status-fd" in self._features:
            args += ["--json-status-fd", str(status_fd)]
        args += [
            "--", self._prlimit,
            f"--cpu={max(1, int(lim.cpu_seconds))}",
            f"--as={max(1, int(lim.memory_mb)) * 1024 * 1024}",
            f"--nproc={max(1, int(lim.max_processes)) + 1}",  # +1: bwrap's PID 1 in the sandbox
            f"--fsize={int(lim.workdir_bytes)}",  # no single file past the work dir's limit
            "--", *argv,
        ]
        return args

    def _sized_tmpfs(self, path: str, size_bytes: int) -> list[str]:
        """A private tmpfs at `path` of `size_bytes` bytes; where bwrap cannot size one (no --size),
        an empty read-only one, since an unsized tmpfs could take half the host's RAM."""
        if "--size" in self._features:
            return ["--size", str(int(size_bytes)), "--tmpfs", path]
        return ["--tmpfs", path, "--remount-ro", path]

    def _dev_args(self) -> list[str]:
        """A minimal /dev (bwrap's device nodes) that is read-only once set up, with a /dev/shm of
        `limits.shm_bytes`: bwrap's /dev tmpfs itself has no size (`--size` does not apply to it)."""
        return ["--dev", "/dev", *self._sized_tmpfs("/dev/shm", self.limits.shm_bytes), "--remount-ro", "/dev"]

    def jail_mounts(self) -> list[str]:
        """THE list of what the jail shows, as bwrap arguments, in mount order. Nothing else of the
        host is visible (the root is an empty tmpfs, read-only at the end):

        1. the toolchain, read-only: `TOOLCHAIN_DIRS` that exist (/usr, /bin, /sbin, /lib, /lib32,
           /lib64, /libx32; top-level links kept as links);
        2. /dev (bwrap's minimal device nodes, read-only, with a /dev/shm of `limits.shm_bytes`) and
           a new /proc (this PID namespace's);
        3. private scratch tmpfs mounts: /tmp (sized to `memory_mb`), /var/tmp and /run
           (`SMALL_TMPFS_BYTES`), /var/run a link to /run;
        4. a minimal /etc: the host's `ETC_ENTRIES` that exist (plus `NETWORK_ETC_ENTRIES` with
           `limits.network`), read-only, and the synthetic passwd, group (root and nobody) and,
           without network, hosts (localhost) from this sandbox's private dir;
        5. the interpreter's dirs (`python=`, `interpreter_dirs`), read-only;
        6. the caller's `ro_paths`, read-only (after the tmpfs mounts, so one under /tmp shows);
        7. the work dir, writable, at its own path (the command's cwd and `$HOME`).

        So /home, /root, /work, /srv, /mnt, /media, /opt, /var and the rest of /etc are absent:
        token files, credentials, project outputs and other users' files cannot be read."""
        args = self._toolchain_args()
        args += self._dev_args()
        args += ["--proc", "/proc"]
        args += self._scratch_args()
        args += self._etc_args()
        for path in self.python_dirs:
            args += ["--ro-bind", os.path.realpath(path), path]
        for path in self.ro_paths:
            args += ["--ro-bind", path, path]
        args += ["--bind", self.workdir, self.workdir]
        args += ["--remount-ro", "/"]   # the root tmpfs: no unsized RAM disk for the command to fill
        return args

    def _toolchain_args(self) -> list[str]:
        """The `TOOLCHAIN_DIRS` that exist, read-only (a link to another of them stays a link)."""
        args: list[str] = []
        for path in TOOLCHAIN_DIRS:
            if os.path.isdir(path):
                args += _show_host_path(path, self._toolchain)
        return args

    def _scratch_args(self) -> list[str]:
        """Empty private tmpfs mounts for /tmp (the command's scratch space, sized to `memory_mb`;
        unsized where bwrap lacks --size, as before), /var/tmp and /run (small); /var/run -> /run."""
        args: list[str] = []
        if "--size" in self._features:
            args += ["--size", str(max(16, self.limits.memory_mb) * 1024 * 1024)]
        args += ["--tmpfs", "/tmp"]
        for path in ("/var/tmp", "/run"):
            args += self._sized_tmpfs(path, SMALL_TMPFS_BYTES)
        return args + ["--symlink", "../run", "/var/run"]

    def _etc_args(self) -> list[str]:
        """The minimal /etc: host entries programs need (see `ETC_ENTRIES`, `NETWORK_ETC_ENTRIES`)
        and the synthetic passwd / group / hosts. A host entry that links into the toolchain is
        recreated as that link; one that links elsewhere (resolv.conf into /run) is bound from its
        target."""
        args = ["--perms", "0755", "--dir", "/etc"] if "--perms" in self._features else ["--dir", "/etc"]
        names = list(ETC_ENTRIES) + (list(NETWORK_ETC_ENTRIES) if self.limits.network else [])
        synthetic = ["passwd", "group"] + ([] if self.limits.network else ["hosts"])
        seen: set[str] = set()
        for pattern in names:
            for path in sorted(glob.glob(os.path.join("/etc", pattern))):
                if path in seen or os.path.relpath(path, "/etc") in synthetic or not os.path.exists(path):
                    continue   # a dangling link shows nothing
                seen.add(path)
                args += _show_host_path(path, self._toolchain)
        for name in synthetic:
            args += ["--ro-bind", os.path.join(self._etc_dir, name), f"/etc/{name}"]
        return args

    def _kill(self, proc: subprocess.Popen) -> None:
        """SIGKILL bwrap's process group; --die-with-parent then tears down the PID namespace."""
        with self._lock:
            if proc.returncode is None:  # not reaped yet, so the pgid cannot have been reused
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    # ------------------------------------------------------------------ Sandbox protocol

    def exec(self, command: str | list[str], timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """Run `command` (a string for bash, or an argv) in the jail with `stdin` as its input, for at most
        `timeout_s` seconds (default `limits.wall_seconds`). SandboxError when the jail could not run it."""
        if self._closed:
            raise SandboxError("sandbox is closed")
        argv = _command_argv(command)
        timeout = self.limits.wall_seconds if timeout_s is None else float(timeout_s)
        status_r = status_w = None
        if "--json-status-fd" in self._features:
            status_r, status_w = os.pipe()  # tells a failed jail set-up from a failing command
        full = self.bwrap_argv(argv, status_w)
        start = time.monotonic()
        proc = self._spawn(full, stdin is not None, status_r, status_w)
        out, err, feeder = self._capture(proc, stdin)
        timed_out, over = self._wait(proc, timeout)
        # The PID namespace is gone with bwrap, so every writer of the pipes is dead: EOF follows.
        for t in (out.thread, err.thread) + ((feeder,) if feeder else ()):
            t.join(timeout=10)
        seconds = time.monotonic() - start
        jail_status = _read_to_end(status_r) if status_r is not None else None
        stderr_text = err.text()
        code = self._exit_code(proc.returncode, timed_out, over, jail_status, stderr_text)
        return ExecResult(
            exit_code=code,
            stdout=out.text(),
            stderr=stderr_text,
            timed_out=timed_out,
            truncated=out.truncated or err.truncated,
            seconds=seconds,
        )

    def _spawn(self, full: list[str], with_stdin: bool, status_r: int | None, status_w: int | None):
        """Start bwrap (`full`) in a session of its own, as the sandbox user when running as root, and track it
        for close(). The write end of the status pipe is closed here either way (the child has its copy); the
        read end too when the start failed."""
        pass_fds: tuple[int, ...] = (status_w,) if status_w is not None else ()
        user_kw = {"user": SANDBOX_UID, "group": SANDBOX_UID, "extra_groups": []} if self._as_root else {}
        try:
            with self._lock:
                if self._closed:
                    raise SandboxError("sandbox is closed")
                proc = subprocess.Popen(
                    full,
                    stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=self._env,
                    cwd="/",
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=pass_fds,
                    **user_kw,
                )
                self._procs.add(proc)
        except BaseException as e:
            if status_r is not None:
                os.close(status_r)
            if isinstance(e, OSError):
                raise SandboxError(f"could not start bubblewrap: {e}") from e
            raise
        finally:
            if status_w is not None:
                os.close(status_w)  # the child has its copy; EOF comes when bwrap is gone
        return proc

    def _capture(self, proc: subprocess.Popen, stdin: str | None):
        """Threads that read the command's stdout and stderr (each capped at `limits.output_bytes`) and, with
        `stdin`, feed it: (out, err, feeder or None)."""
        # Popen's file objects are unbuffered wrappers; we read the raw fds ourselves.
        out = _Capture(os.dup(proc.stdout.fileno()), self.limits.output_bytes)
        err = _Capture(os.dup(proc.stderr.fileno()), self.limits.output_bytes)
        proc.stdout.close()
        proc.stderr.close()
        feeder = None
        if stdin is not None:
            feeder = threading.Thread(target=_feed, args=(os.dup(proc.stdin.fileno()), stdin.encode()), daemon=True)
            proc.stdin.close()
            feeder.start()
        return out, err, feeder

    def _wait(self, proc: subprocess.Popen, timeout: float) -> tuple[bool, int | None]:
        """Wait for bwrap at most `timeout` seconds (then kill it) while watching the work dir's size (killing it
        when over `limits.workdir_bytes`): (timed out, the work dir's bytes when over its limit else None)."""
        watch = _DiskWatch(self.workdir, int(self.limits.workdir_bytes), lambda: self._kill(proc))
        timed_out = False
        try:
            proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill(proc)
            proc.wait()
        except BaseException:  # e.g. KeyboardInterrupt: never leave the command running
            self._kill(proc)
            proc.wait()
            raise
        finally:
            with self._lock:
                self._procs.discard(proc)
            over = watch.finish()
        return timed_out, over

    def _exit_code(self, code: int | None, timed_out: bool, over: int | None, jail_status: bytes | None,
                   stderr_text: str) -> int | None:
        """The command's exit code (None when it timed out), or SandboxError when the jail, not the command,
        failed: the work dir over its limit, bwrap killed, or (`jail_status`: bwrap's JSON status output, None
        when bwrap cannot give it) the jail set-up failed."""
        if over is not None:
            raise SandboxError(f"the work directory uses {over} bytes, over its limit of "
                               f"{int(self.limits.workdir_bytes)} bytes (SandboxLimits.workdir_bytes); "
                               "the command was stopped")
        if timed_out:
            return None
        if code is not None and code < 0:
            # bwrap itself was killed by a signal: only close() (or someone outside) does that
            if self._closed:
                raise SandboxError("sandbox was closed while the command was running")
            raise SandboxError(f"bubblewrap was killed by signal {-code}")
        if jail_status is not None and b'"exit-code"' not in jail_status:
            # bwrap reports the exit code only once the command ran; otherwise the jail set-up failed
            raise SandboxError(f"bubblewrap failed to set up the sandbox (exit {code}): {stderr_text.strip()}")
        return code

    # -- files: host side, confined to the work dir with openat(O_NOFOLLOW) walks

    def _resolve(self, path: str) -> list[str]:
        """Components of `path` relative to the work dir after resolving symlinks; ValueError if outside."""
        rel = check_relative_path(path)
        real = os.path.realpath(os.path.join(self.workdir, *rel.parts))
        if os.path.commonpath([real, self.workdir]) != self.workdir or real == self.workdir:
            raise ValueError(f"sandbox path {path!r} resolves outside the work directory")
        return list(PurePosixPath(os.path.relpath(real, self.workdir)).parts)

    def _open_parent(self, parts: list[str], create: bool) -> int:
        fd = os.open(self.workdir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in parts[:-1]:
                if create:
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                        if self._as_root:
                            os.chown(name, SANDBOX_UID, SANDBOX_UID, dir_fd=fd, follow_symlinks=False)
                    except FileExistsError:
                        pass
                try:
                    nfd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ValueError(f"sandbox path component {name!r} is a symlink or not a directory") from e
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def write_file(self, path: str, data: str | bytes) -> None:
        if self._closed:
            raise SandboxError("sandbox is closed")
        payload = data.encode() if isinstance(data, str) else bytes(data)
        parts = self._resolve(path)
        dfd = self._open_parent(parts, create=True)
        try:
            try:
                fd = os.open(parts[-1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK,
                             0o644, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError(f"sandbox path {path!r} is a symlink") from e
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise ValueError(f"sandbox path {path!r} is not a regular file")
                if self._as_root:
                    os.fchown(fd, SANDBOX_UID, SANDBOX_UID)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def read_file(self, path: str) -> bytes:
        if self._closed:
            raise SandboxError("sandbox is closed")
        parts = self._resolve(path)
        dfd = self._open_parent(parts, create=False)
        try:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ValueError(f"sandbox path {path!r} is a symlink") from e
                raise
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO would block us forever
                    raise ValueError(f"sandbox path {path!r} is not a regular file")
                chunks = []
                while chunk := os.read(fd, 1 << 20):
                    chunks.append(chunk)
                return b"".join(chunks)
            finally:
                os.close(fd)
        finally:
            os.close(dfd)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            procs = list(self._procs)
        for proc in procs:
            self._kill(proc)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL is not ignorable
                pass
        _force_rmtree(self.workdir)
        if self._etc_dir:
            shutil.rmtree(self._etc_dir, ignore_errors=True)

    def __enter__(self) -> LocalSandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:  # best effort: never leave work dirs behind
        try:
            if not getattr(self, "_closed", True):
                self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return f"LocalSandbox(workdir={self.workdir!r}, closed={self._closed})"


def _force_rmtree(path: str) -> None:
    """rmtree that also removes what the sandbox made unwritable (chmod 000 dirs, as non-root)."""

    def on_error(func, p, exc):
        try:
            os.chmod(os.path.dirname(p), 0o700)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, 0o700)
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
        except OSError:
            pass

    if os.path.lexists(path):
        if sys.version_info >= (3, 12):
            shutil.rmtree(path, onexc=on_error)
        else:
            shutil.rmtree(path, onerror=on_error)
