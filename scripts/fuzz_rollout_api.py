"""Fuzz the rollout service's OpenAPI schema with schemathesis against a real service on 127.0.0.1.

    python scripts/fuzz_rollout_api.py [--max-examples 20] [--max-time 120] [--seed 1]

With a time budget (`--max-time`, the default) schemathesis repeats the fuzzing phase until the budget is
spent; with `--max-time 0` (and `--shutdown-max-time 0`) each run stops after its coverage cases and
`--max-examples` fuzzed cases per operation: a fixed number of cases, whatever the machine's load.

Starts the service (HF engine, the embedded model `embedded:tiny`) with a random bearer token, then runs
``st run --checks all`` over every operation, authenticated with that token (schemathesis' `ignored_auth`
check also sends each request without it and expects 401). ``POST /v1/shutdown`` is fuzzed last, in a run
of its own without the token (every call must be refused; one accepted would end the service). Exit code 0:
no server error, no schema violation, no failed check. The cost of valid /v1/generate and /v1/trajectories
requests is capped by scripts/schemathesis_hooks.py. The positive-data check accepts 400 besides its
defaults: the schema documents 400 for requests that are well formed but cannot be honoured (a dataset
that does not exist, weights that do not verify).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CONFIG = """\
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "403", "404", "409"]

[checks.negative_data_rejection]
expected-statuses = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422"]
"""


def _time_budget(seconds: int) -> list[str]:
    """`st run`'s time budget option: fuzzing repeats until `seconds` are spent; none for 0 (each operation gets
    its coverage cases and --max-examples fuzzed ones, then the run ends)."""
    return ["--max-time", str(seconds)] if seconds > 0 else []


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-examples", type=int, default=20, help="examples per operation and phase")
    parser.add_argument("--max-time", type=int, default=120,
                        help="time budget of the main run, seconds (0: none, stop after --max-examples)")
    parser.add_argument("--shutdown-max-time", type=int, default=20,
                        help="time budget of the shutdown run, seconds (0: none, stop after --max-examples)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cache-dir", default=os.environ.get("SAO_CACHE_DIR", ""))
    parser.add_argument("--report-dir", default="", help="keep schemathesis' JUnit report here")
    args = parser.parse_args(argv)

    from sao_core.rollout.auth import new_token
    from sao_core.rollout.server import RolloutServer, ServeConfig

    with tempfile.TemporaryDirectory(prefix="sao-fuzz-") as scratch:
        scratch_path = Path(scratch)
        cache = args.cache_dir or str(scratch_path / "cache")
        (scratch_path / "schemathesis.toml").write_text(CONFIG)
        token = new_token()
        config = ServeConfig(model="embedded:tiny", port=0, cache_dir=cache, max_batch=8,
                             allowed_weight_roots=[str(scratch_path / "weights")], max_body_bytes=1024 * 1024)
        server = RolloutServer(config, token=token).start(timeout_s=120)
        st = [str(Path(sys.executable).with_name("st")), "--config-file", str(scratch_path / "schemathesis.toml"),
              "run", f"{server.url}/openapi.json", "--checks", "all", "--max-examples", str(args.max_examples),
              "--seed", str(args.seed), "--workers", "1", "--request-timeout", "60", "--no-color",
              "--generation-deterministic", "--output-sanitize", "true"]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HERE / "schemathesis_hooks.py")}
        report = ["--report", "junit", "--report-dir", args.report_dir] if args.report_dir else []
        try:
            main_run = subprocess.run([*st, "--exclude-path", "/v1/shutdown", *_time_budget(args.max_time),
                                       "--header", f"Authorization: Bearer {token}", *report], env=env)
            shutdown_run = subprocess.run([*st, "--include-path", "/v1/shutdown",
                                           *_time_budget(args.shutdown_max_time),
                                           "--exclude-checks", "positive_data_acceptance"], env=env)
            alive = server._thread is not None and server._thread.is_alive()
        finally:
            server.stop()
    if not alive:
        print("the rollout service stopped during the fuzzing", file=sys.stderr)
    return 0 if main_run.returncode == 0 and shutdown_run.returncode == 0 and alive else 1


if __name__ == "__main__":
    sys.exit(main())
