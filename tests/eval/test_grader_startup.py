"""The math grader's start-up is paid once per process (issue 39): its workers import neither the training
stack nor the parent's ``__main__`` script, and a second evaluation in the same process starts no new
worker processes. Deterministic: process ids and imported modules, no timings."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from sao_core.envs.grading import MathGrader, close_spare_workers, spare_worker_pids
from sao_core.eval import EvalConfig, evaluate

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")

# A parent script shaped like a training or benchmark script: the stack imported at its top. Under
# multiprocessing's spawn every worker ran this top again (as __mp_main__): the marker file would get one
# line per worker, and the workers would hold torch.
PARENT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    with open(sys.argv[1], "a") as marker:
        marker.write(f"{os.getpid()}\\n")
    import torch  # noqa: F401

    from sao_core.envs.grading import MathGrader

    if __name__ == "__main__":
        with MathGrader(max_workers=2, keep_warm=False) as grader:
            assert not grader.warm_up()
            assert grader.grade("\\\\frac{1}{2}", "0.5").correct
            print(json.dumps({str(pid): seen for pid, seen in grader.worker_modules(["torch", "transformers"]).items()}))
""")


def test_workers_do_not_import_the_parents_script_or_torch(tmp_path):
    script = tmp_path / "train_like.py"
    script.write_text(PARENT_SCRIPT)
    marker = tmp_path / "ran.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(script), str(marker)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    workers = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(workers) == 2
    for seen in workers.values():
        assert seen == {"torch": False, "transformers": False}
    assert len(marker.read_text().split()) == 1          # the script's top ran in the parent only


def test_workers_are_slim_even_when_this_process_holds_torch():
    import torch  # noqa: F401  (the parent holds the stack; the workers must not inherit or re-import it)

    with MathGrader(max_workers=1, keep_warm=False) as grader:
        assert grader.grade("2\\sqrt{2}", "\\sqrt{8}").correct
        (seen,) = grader.worker_modules(list(HEAVY) + ["math_verify", "sao_core.envs.exact"]).values()
    assert seen == {"torch": False, "transformers": False, "math_verify": True, "sao_core.envs.exact": True}


def test_closed_grader_hands_its_workers_to_the_next():
    close_spare_workers()
    with MathGrader(max_workers=2) as first:
        assert not first.warm_up()
        started = set(first.worker_pids())
        assert len(started) == 2 and first.stats["workers_started"] == 2
    assert set(spare_worker_pids()) == started
    with MathGrader(max_workers=2) as second:
        assert not second.warm_up()
        assert set(second.worker_pids()) == started
        assert (second.stats["workers_started"], second.stats["workers_reused"]) == (0, 2)
        assert second.grade("0.5", "\\frac{1}{2}").correct
    with MathGrader(max_workers=2, keep_warm=False) as third:   # keep_warm=False: closing stops them
        assert not third.warm_up()
        pids = third.worker_pids()
    assert set(pids) == started and spare_worker_pids() == []
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists()          # stopped and reaped


def _state(pid: int) -> str:
    """The process state letter from /proc (Z: a zombie, already ended)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_second_evaluation_starts_no_new_workers(tmp_path, sao_cache):
    close_spare_workers()
    base = dict(model="embedded:tiny", benchmarks=["imo_answerbench"], k=1, limit=2, max_new_tokens=8,
                max_total_tokens=1024, grader_workers=2, cache_dir=str(sao_cache))
    first = evaluate(EvalConfig(**base, output=str(tmp_path / "first")))
    after_first = set(spare_worker_pids())
    assert first["samples_generated"] == 2 and len(after_first) == 2
    second = evaluate(EvalConfig(**base, output=str(tmp_path / "second")))
    assert second["samples_generated"] == 2
    assert set(spare_worker_pids()) == after_first        # the same two processes graded both evaluations
    for pid in after_first:
        assert _state(pid) != "Z"
