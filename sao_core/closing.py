"""Cleaning up after a constructor or a set-up step that fails half-way."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol

__all__ = ["close_on_error"]


class Closable(Protocol):
    def close(self) -> None: ...


@contextmanager
def close_on_error(resource: Closable) -> Iterator[None]:
    """Run the block; when it raises anything (KeyboardInterrupt too), close `resource` and re-raise, so what
    the block had opened (a pod, a temporary folder, a sandbox) is not left behind."""
    try:
        yield
    except BaseException:
        resource.close()
        raise
