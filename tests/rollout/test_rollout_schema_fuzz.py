"""The rollout service's OpenAPI schema fuzzed with schemathesis (`--checks all`, bounded examples, with the
run's bearer token) against a real service on 127.0.0.1 with the embedded model: scripts/fuzz_rollout_api.py.
No server error, no schema violation, no failed check."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_schemathesis_finds_no_server_error_and_no_schema_violation(sao_cache):
    pytest.importorskip("schemathesis")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, str(REPO / "scripts" / "fuzz_rollout_api.py"), "--max-examples", "3",
                          "--max-time", "18", "--shutdown-max-time", "6", "--cache-dir", str(sao_cache)],
                         env=env, capture_output=True, text=True, timeout=110)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    assert "Schema-violating" not in tail and "Server error" not in tail
