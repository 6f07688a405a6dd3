"""The sandbox interface: where tool calls run. Implementations: `local` (bubblewrap jail) and
`kubernetes` (one pod per episode)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, lost its pod, ...); the episode ends as tool_error."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox. Times in seconds, sizes in bytes / MiB as named."""

    wall_seconds: float = 30.0          # default per-command wall-clock timeout
    cpu_seconds: int = 60               # RLIMIT_CPU per command
    memory_mb: int = 1024               # address-space limit per command
    max_processes: int = 64             # RLIMIT_NPROC inside the sandbox (fork bombs)
    output_bytes: int = 64 * 1024       # stdout and stderr are each cut to this many bytes
    network: bool = False               # True only where a task needs it (never by default)
    # Local sandbox only (a pod gets its disk and /dev/shm from the cluster):
    workdir_bytes: int = 2 * 1024**3    # disk the work dir may use, in bytes (also RLIMIT_FSIZE per file)
    shm_bytes: int = 64 * 1024**2       # size of the private /dev/shm tmpfs, in bytes


@dataclass
class ExecResult:
    """Outcome of one command. `exit_code` is None when the command was killed for the timeout."""

    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool = False
    truncated: bool = False             # some output was cut to `output_bytes`
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


class Sandbox(Protocol):
    """One isolated work directory. Paths given to file methods are relative to it."""

    def exec(self, command: str | list[str], timeout_s: float | None = None, stdin: str | None = None) -> ExecResult:
        """Run a command (a string runs under `bash -lc`) inside the work directory."""
        ...

    def write_file(self, path: str, data: str | bytes) -> None: ...

    def read_file(self, path: str) -> bytes: ...

    def close(self) -> None:
        """Kill everything still running and remove the sandbox's resources. Idempotent."""
        ...
