"""Sandboxes: where tool calls run.

- `LocalSandbox` (`local`): a bubblewrap jail per command over a private work dir; for development,
  tests and single-machine runs.
- `KubernetesPodSandbox` (`kubernetes`): one pod per sandbox (e.g. a SWE-bench image); for
  production. Its module (and the `kubernetes` client) is imported only when first used.

`make_sandbox("local" | "kubernetes", limits, **options)` builds either from configuration.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sao_core.sandbox.base import ExecResult, Sandbox, SandboxError, SandboxLimits
from sao_core.sandbox.local import LocalSandbox

if TYPE_CHECKING:  # pragma: no cover
    from sao_core.sandbox.kubernetes import KubernetesPodSandbox

__all__ = [
    "ExecResult",
    "KubernetesPodSandbox",
    "LocalSandbox",
    "SANDBOX_KINDS",
    "Sandbox",
    "SandboxError",
    "SandboxLimits",
    "make_sandbox",
]

SANDBOX_KINDS = ("local", "kubernetes")


def __getattr__(name: str) -> Any:
    if name == "KubernetesPodSandbox":
        from sao_core.sandbox.kubernetes import KubernetesPodSandbox

        return KubernetesPodSandbox
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def make_sandbox(kind: str, limits: SandboxLimits | None = None, **options: Any) -> Sandbox:
    """Build a sandbox of `kind` ("local" or "kubernetes"); `options` go to its constructor
    (local: `root`, `env`; kubernetes: `image` (required), `namespace`, `workdir`, ...)."""
    limits = limits if limits is not None else SandboxLimits()
    if kind == "local":
        return LocalSandbox(limits=limits, **options)
    if kind == "kubernetes":
        from sao_core.sandbox.kubernetes import KubernetesPodSandbox

        return KubernetesPodSandbox(limits=limits, **options)
    raise ValueError(f"unknown sandbox kind {kind!r}; expected one of: {', '.join(SANDBOX_KINDS)}")
