"""Versions of the libraries whose code decides the grades (recorded in ``run.json`` and the report).

`grader_versions()` is ``{distribution: version or None}`` (None: not installed) for every grading
library; `versions_for_grader(grader)` the subset a benchmark's grader (``BenchmarkSpec.grader``)
uses. A number graded by another version of these rules may be a different number.
"""

from __future__ import annotations

import importlib.metadata

__all__ = ["GRADER_LIBRARIES", "grader_versions", "versions_for_grader"]

#: The distributions each benchmark grader calls (names as on PyPI).
GRADER_LIBRARIES: dict[str, tuple[str, ...]] = {
    "swe_tests": ("swebench",),
    "math_rule": ("math-verify", "sympy", "latex2sympy2_extended"),
    "exact_int": (),
}


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def grader_versions() -> dict[str, str | None]:
    """``{distribution: version or None}`` of every grading library."""
    names = dict.fromkeys(name for libs in GRADER_LIBRARIES.values() for name in libs)
    return {name: _version(name) for name in names}


def versions_for_grader(grader: str | None) -> dict[str, str | None]:
    """The versions of the libraries `grader` uses (empty for one that uses none, or an unknown one)."""
    return {name: _version(name) for name in GRADER_LIBRARIES.get(grader or "", ())}
