"""scripts/run_tests.py (`make test`'s two phases): the serial phase collects only the files that mark a test
`serial`, and tests/conftest.py stops a run in which a serial test lies outside them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import run_tests  # noqa: E402

LEARNER = "tests/learner/test_learner.py"


def test_the_serial_phase_collects_the_files_that_mark_a_test_serial(tmp_path):
    assert LEARNER in run_tests.serial_test_files()
    (tmp_path / "tests" / "a").mkdir(parents=True)
    (tmp_path / "tests" / "a" / "test_x.py").write_text("import pytest\n\n@pytest.mark.serial\ndef test_x():\n    pass\n")
    (tmp_path / "tests" / "a" / "test_y.py").write_text("def test_y():\n    pass\n")
    (tmp_path / "tests" / "a" / "helper.py").write_text("# pytest.mark.serial in a helper is not a test file\n")
    (tmp_path / "tests" / "a" / "test_m.py").write_text("import pytest\n\npytestmark = [pytest.mark.serial]\n")
    (tmp_path / "tests" / "a" / "test_s.py").write_text('TEXT = "@pytest.mark.serial in a string"  # mark.serial\n')
    assert run_tests.serial_test_files(tmp_path) == ["tests/a/test_m.py", "tests/a/test_x.py"]
    assert "tests/project/test_run_tests.py" not in run_tests.serial_test_files()   # its marks are in strings


def _collect(serial_files: str) -> subprocess.CompletedProcess:
    env = {**os.environ, run_tests.SERIAL_FILES_ENV: serial_files}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--collect-only",
                           "-m", "serial", LEARNER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_a_serial_test_outside_the_listed_files_stops_the_run_by_name():
    missed = _collect("tests/other/test_z.py")
    assert missed.returncode == 4, missed.stdout + missed.stderr
    assert "test_rl_raises_the_reward[sao]" in missed.stdout + missed.stderr
    # The listed case is `make test` itself: its serial phase collects LEARNER with the list it computed.
