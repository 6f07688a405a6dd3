"""`make test`: the suite in two phases on a fresh clone.

1. Every test not marked `serial`, spread over `--workers` pytest-xdist processes (a file's tests stay in
   one worker, so its module fixtures are built once).
2. The `serial` tests (SAO's reward-rising learning run: its asynchronous schedule depends on timing and a
   busy machine weakens how far the reward rises) alone, after phase 1. It collects only the files that mark a
   test serial (`serial_test_files`); tests/conftest.py stops a run where a serial test lies elsewhere.

`--select EXPR` (a pytest -m expression) narrows both phases: `make test` leaves the real-model tier out
(`not real_model`), `make test-real` runs only it. The same pytest arguments go to both phases, and both see one
folder ($SAO_TEST_SHARED_DIR) where a warm-start model trained once is read by every worker.
A phase that selects nothing (pytest exit 5) is fine when the
other one ran tests; the exit status is the first failing phase's, 5 when neither phase ran a test.
"""

from __future__ import annotations

import argparse
import io
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tokenize
from pathlib import Path

NO_TESTS = 5
#: the folder both phases share (tests/model_fixtures.py reads it)
SHARED_DIR_ENV = "SAO_TEST_SHARED_DIR"
#: the test files the serial phase collects, relative to the repository root, comma-separated; tests/conftest.py
#: refuses a run in which a `serial` test lies outside them (it would run in neither phase)
SERIAL_FILES_ENV = "SAO_SERIAL_TEST_FILES"
ROOT = Path(__file__).resolve().parent.parent


def _marks_serial(text: str) -> bool:
    """Whether Python source `text` uses `mark.serial` in its code (a decorator, a `pytestmark`, a
    `pytest.param(..., marks=...)`), not only inside a string or a comment (as tests/project/test_run_tests.py
    does)."""
    if "mark.serial" not in text:
        return False
    code = [t.string for t in tokenize.generate_tokens(io.StringIO(text).readline)
            if t.type in (tokenize.NAME, tokenize.OP)]
    return any(code[i:i + 3] == ["mark", ".", "serial"] for i in range(len(code) - 2))


def serial_test_files(root: Path = ROOT) -> list[str]:
    """The test files that mark a test `serial` in their code (`_marks_serial`), relative to `root`: the serial
    phase collects only these instead of the whole suite (~8 s of collection on 2 cores)."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").rglob("test_*.py")
                  if _marks_serial(p.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="2", help="pytest-xdist workers of phase 1 (a number, or auto)")
    parser.add_argument("--select", default="", help="a pytest -m expression both phases are narrowed to")
    parser.add_argument("pytest_args", nargs=argparse.REMAINDER, help="arguments for pytest (after --)")
    args = parser.parse_args(argv)
    extra = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    if args.workers != "auto" and not (args.workers.isdigit() and int(args.workers) >= 1):
        parser.error(f"--workers must be a positive number or auto, got {args.workers!r}")
    narrow = f" and ({args.select})" if args.select else ""
    # --no-loadscope-reorder: files go to the workers in collection order (tests/conftest.py puts the longest first)
    serial_files = serial_test_files()
    phases = [("parallel", ["-n", args.workers, "--dist", "loadfile", "--no-loadscope-reorder",
                            "-m", f"not serial{narrow}"]),
              ("serial", ["-m", f"serial{narrow}", *(str(ROOT / f) for f in serial_files)])]
    codes, seconds = [], []
    # One folder for the whole run, both phases: warm-start models one worker trained, the others read
    # (tests/model_fixtures.py sft_model); removed at the end unless the caller chose it.
    shared = os.environ.get(SHARED_DIR_ENV) or tempfile.mkdtemp(prefix="sao-test-shared-")
    env = {**os.environ, SHARED_DIR_ENV: shared, SERIAL_FILES_ENV: ",".join(serial_files)}
    try:
        for name, selection in phases:
            if name == "serial" and not serial_files:
                codes.append(NO_TESTS)
                seconds.append(0.0)
                continue
            began = time.monotonic()
            print(f"== tests, {name} phase: pytest {' '.join(selection + extra)}", flush=True)
            codes.append(subprocess.call([sys.executable, "-m", "pytest", *selection, *extra], env=env))
            seconds.append(time.monotonic() - began)
    finally:
        if SHARED_DIR_ENV not in os.environ:
            shutil.rmtree(shared, ignore_errors=True)
    print("== tests: " + ", ".join(f"{name} phase exit {code} in {s:.0f} s"
                                   for (name, _), code, s in zip(phases, codes, seconds, strict=True)), flush=True)
    failing = [c for c in codes if c not in (0, NO_TESTS)]
    if failing:
        return failing[0]
    return NO_TESTS if all(c == NO_TESTS for c in codes) else 0


if __name__ == "__main__":
    sys.exit(main())
