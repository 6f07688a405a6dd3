"""A fork server for the short-lived learner processes of `crash_resume.py`: it imports the heavy modules once
(torch, transformers, sao_core: ~4 of the ~6 s of CPU a learner process spends before its first step), then
runs each command in a process forked from itself.

Each forked process is a process of its own: its own pid, environment, standard streams, exit status and
signals (a SIGKILL kills it and only it); it runs its script as `python script args` would, from `__main__`
through interpreter shutdown. Only its imports were done before the fork. The server has one thread and runs
one command at a time (it waits for each before it reads the next), so forking it is safe; its own environment
must carry the thread settings (OMP_NUM_THREADS, ...), which torch reads while it is imported.

    forks = ForkServer(env, preload=("torch", "sao_core.learner.loop"), work=folder)
    proc = forks.start([script, *args], env)          # `script` (a Python file) runs as __main__
    proc.poll(); proc.send_signal(signal.SIGKILL); proc.wait(); proc.stdout(); proc.stderr()
    forks.close()
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


class ForkedProcess:
    """One command the server runs: what `crash_resume` needs of `subprocess.Popen`. Its standard output and
    error go to the files `stdout_path` and `stderr_path`."""

    def __init__(self, pid: int, status: Path, stdout_path: Path, stderr_path: Path):
        self.pid = pid
        self.returncode: int | None = None
        self.stdout_path, self.stderr_path = stdout_path, stderr_path
        self._status = status

    def poll(self) -> int | None:
        """The exit status once the process has ended (negative: killed by that signal), else None."""
        if self.returncode is None and self._status.exists():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout_s: float | None = None) -> int:
        """The exit status, polled every 20 ms; subprocess.TimeoutExpired after `timeout_s` seconds."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout_s)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, signal_number: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def stdout(self) -> str:
        return self.stdout_path.read_text()

    def stderr(self) -> str:
        return self.stderr_path.read_text()


class ForkServer:
    """A Python process (this interpreter, environment `env`) that imports the modules `preload` and then forks
    one process per `start`; `work`: a folder for the processes' output and exit-status files."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...], work: Path):
        self.work = Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self._started = 0
        self.last: ForkedProcess | None = None       # the process started last
        self._server = subprocess.Popen([sys.executable, __file__, *preload], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)

    def start(self, argv: list[str], env: dict[str, str]) -> ForkedProcess:
        """Run the Python script `argv[0]` as `__main__`, with `sys.argv = argv` and the environment `env`, in a
        new forked process. Waits for the previous process to end (the server runs one at a time)."""
        self._started += 1
        stem = self.work / f"process-{self._started:03d}"
        request = {"argv": argv, "env": env, "stdout": f"{stem}.out", "stderr": f"{stem}.err",
                   "status": f"{stem}.status"}
        self._server.stdin.write(json.dumps(request) + "\n")
        self._server.stdin.flush()
        line = self._server.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited (code {self._server.wait()}) instead of starting {argv}")
        self.last = ForkedProcess(int(line), Path(request["status"]), Path(request["stdout"]),
                                   Path(request["stderr"]))
        return self.last

    def close(self) -> None:
        """End the server and its running process, if any (SIGKILL: a caller that wanted it has waited)."""
        if self.last is not None:
            self.last.kill()
        if self._server.poll() is None:
            self._server.stdin.close()
            self._server.wait()
            self._server.stdout.close()


def _serve(preload: list[str]) -> dict | None:
    """The server's loop: import `preload`, then fork a process per request. Returns the request in the forked
    process only; the server waits for that process, writes its exit status, then reads the next request."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        partial = Path(request["status"] + ".partial")
        partial.write_text(str(os.waitstatus_to_exitcode(status)))
        os.replace(partial, request["status"])
    return None


def _become(request: dict) -> None:
    """In the forked process: its environment and standard streams, then its script as `__main__`, whose exit
    (SystemExit, an exception, the end) ends the interpreter as in a process of its own."""
    import runpy
    import tempfile

    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None                  # $TMPDIR read anew (the learner's scratch folder lives there)
    write = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], write),
                            (2, request["stderr"], write)):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = list(request["argv"])
    sys.path[0] = str(Path(sys.argv[0]).resolve().parent)   # as `python script`: the script's folder first
    runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    forked = _serve(sys.argv[1:])
    if forked is None:
        sys.stdout.flush()
        os._exit(0)       # the server itself: nothing to clean up, and its interpreter shutdown took seconds
    _become(forked)
