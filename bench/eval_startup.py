"""Evaluation start-up (issue 39, part 6): the math grader's time to first grade and seconds per answer / per
problem, before and after, side by side in one run.

- before: the grader of `--before-ref` (default HEAD): `spawn` workers, which run the parent's ``__main__``
  script again (its top-level imports: torch and transformers for a training or benchmark script), one pool per
  evaluation, started after the model has loaded;
- after: the same tree with this change's files (`--after-files`) copied over it from the working tree: workers
  are fresh interpreters importing the grading module and math-verify only, a closed grader leaves them to the
  next one of the process, and the evaluation starts them while the model loads.

Each measurement is a fresh child process (PYTHONPATH = the arm's tree) whose ``__main__`` is one of two driver
scripts: ``cli`` (top-level imports: `sao_core.cli`, what the ``sao`` console script imports) or ``script``
(top-level imports: torch and transformers, like the training and benchmark scripts). Two tasks:

- ``grading``: `--evals` graders in a row in one process (2 workers, warmed up as the evaluator warms them:
  two concurrent first grades); per grader the time to first grade (pool start-up, seconds) and the seconds
  per answer of `--answers` IMO-AnswerBench-style pairs (tests/data/eval/imo_equivalents.json, mode ``exact``
  as the IMO evaluation grades) through the pool, and the same answers graded in this process
  (``_grade_here``: the cost without a worker, what grading on a thread would cost);
- ``evaluate``: `--evals` held-out greedy evaluations in a row in one process (`sao_core.eval.evaluate`,
  `--model`, `--problems` IMO-AnswerBench problems, k = 1, `--max-new-tokens`); per evaluation the wall
  seconds, seconds per problem, the engine's start, the grader warm-up and the wait for the graders after the
  model had loaded (the start-up the evaluation pays).

Arms are interleaved (before, after, after, before, ...) over `--reps` repetitions; every record carries the
load average. Output: ``<output>/eval_startup.json`` (and the same file at `--results` when given).

    .venv/bin/python bench/eval_startup.py --output local_outputs/bench/eval_startup \\
        --results bench/results/eval_startup.json
    .venv/bin/python bench/eval_startup.py --reps 1 --answers 8 --problems 4 --tasks grading   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The grading stack as the working tree has it (the grader's protocol and the exact rules change together).
AFTER_FILES = ("sao_core/envs/grading.py", "sao_core/eval/run.py", "sao_core/eval/graders.py", "sao_core/envs/exact.py",
               "sao_core/envs/exact_forms.py", "sao_core/envs/exact_values.py")
PAIRS = ROOT / "tests" / "data" / "eval" / "imo_equivalents.json"

# The drivers: a child's __main__. Their top-level imports are what every `spawn` worker of the "before" arm
# imports again; the measurement code is imported under the main guard only.
DRIVERS = {
    "cli": "from sao_core.cli import main as _cli  # noqa: F401  (what the `sao` console script imports)\n",
    "script": "import torch  # noqa: F401  (a training or benchmark script's top)\nimport transformers  # noqa: F401\n",
}
DRIVER_BODY = textwrap.dedent("""
    if __name__ == "__main__":
        import sys
        sys.path.insert(0, {bench!r})
        import eval_startup
        eval_startup.child(sys.argv[1])
""")


# ------------------------------------------------------------------------------------------ child side

def _now() -> float:
    return time.monotonic()


def _warm_like_the_evaluator(grader, workers: int = 2) -> None:
    """The committed evaluator's warm-up (concurrent first grades), which both arms' graders support."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda _: grader.grade("0", "1"), range(workers)))


def _pairs(count: int) -> list[tuple[str, str]]:
    """`count` (answer, gold) pairs of IMO-AnswerBench-style equivalent forms (cycled when fewer)."""
    rows = json.loads(PAIRS.read_text())["equivalents"]
    return [(rows[i % len(rows)]["answer"], rows[i % len(rows)]["gold"]) for i in range(count)]


def _child_grading(settings: dict) -> list[dict]:
    """`evals` graders in a row: start-up seconds, seconds per answer in the pool and in this process."""
    from sao_core.envs import grading

    pairs = _pairs(settings["answers"])
    records = []
    for index in range(settings["evals"]):
        grader = grading.MathGrader(max_workers=2, timeout_s=10.0)
        started = _now()
        _warm_like_the_evaluator(grader)
        first = _now() - started
        started = _now()
        correct = sum(grader.grade(a, g, mode="exact").correct for a, g in pairs)
        pool_s = _now() - started
        grader.close()
        import math_verify  # noqa: F401  (in this process too: the per-answer cost, not the import)

        import sao_core.envs.exact  # noqa: F401
        started = _now()
        for answer, gold in pairs:
            grading._grade_here(answer, gold, 10.0, "exact")
        here_s = _now() - started
        records.append({"index": index, "first_grade_s": first, "per_answer_s": pool_s / len(pairs),
                        "in_process_per_answer_s": here_s / len(pairs), "correct": correct, "answers": len(pairs),
                        "loadavg": os.getloadavg()[0]})
    return records


def _child_evaluate(settings: dict) -> list[dict]:
    """`evals` evaluations in a row: wall, engine start, grader warm-up and the wait for it, per problem."""
    from sao_core.eval import EvalConfig, evaluate
    from sao_core.eval import run as eval_run

    marks: dict[str, float] = {}

    def timed(name, function):
        def wrapper(*args, **kwargs):
            marks[name + "_start"] = _now()
            try:
                return function(*args, **kwargs)
            finally:
                marks[name + "_end"] = _now()
        return wrapper

    eval_run._make_engine = timed("engine", eval_run._make_engine)
    eval_run._Graders.warm_up = timed("warm", eval_run._Graders.warm_up)
    records = []
    for index in range(settings["evals"]):
        marks.clear()
        output = tempfile.mkdtemp(prefix="eval-startup-")
        config = EvalConfig(model=settings["model"], benchmarks=["imo_answerbench"], k=1, limit=settings["problems"],
                            temperature=0.0, max_new_tokens=settings["max_new_tokens"], max_total_tokens=2048,
                            output=output, resume=False, cache_dir=settings["cache_dir"])
        started = _now()
        summary = evaluate(config)
        wall = _now() - started
        shutil.rmtree(output, ignore_errors=True)
        records.append({"index": index, "wall_s": wall, "per_problem_s": wall / settings["problems"],
                        "engine_s": marks["engine_end"] - marks["engine_start"],
                        "warm_s": marks["warm_end"] - marks["warm_start"],
                        "grader_wait_s": max(0.0, marks["warm_end"] - marks["engine_end"]),
                        "samples": summary["samples_generated"],
                        "avg": summary["metrics"].get("imo_answerbench/avg@1"), "loadavg": os.getloadavg()[0]})
    return records


def child(settings_json: str) -> None:
    """Entry of a child process: run one task and print its records as one JSON line."""
    settings = json.loads(settings_json)
    import sao_core

    task = _child_grading if settings["task"] == "grading" else _child_evaluate
    records = task(settings)
    print("RESULT " + json.dumps({"sao_core": sao_core.__file__, "records": records}), flush=True)


# ------------------------------------------------------------------------------------------ parent side

def build_trees(work: Path, before_ref: str, after_files: list[str]) -> dict[str, Path]:
    """before: `git archive` of `before_ref`; after: a copy of it with `after_files` from the working tree."""
    before, after = work / "before", work / "after"
    before.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", before_ref], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive, check=True)
    shutil.copytree(before, after)
    for name in after_files:
        shutil.copy2(ROOT / name, after / name)
    return {"before": before, "after": after}


def write_drivers(work: Path) -> dict[str, Path]:
    drivers = {}
    for name, top in DRIVERS.items():
        path = work / f"main_{name}.py"
        path.write_text(top + DRIVER_BODY.format(bench=str(Path(__file__).resolve().parent)))
        drivers[name] = path
    return drivers


def run_child(tree: Path, driver: Path, settings: dict, timeout_s: float) -> dict:
    """One child process on `tree` with `driver` as its __main__; its records plus the child's wall seconds."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _setup

    env = {**os.environ, **_setup.THREAD_ENV, "PYTHONPATH": str(tree)}
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(driver), json.dumps(settings)], capture_output=True, text=True,
                          env=env, cwd=str(tree), timeout=timeout_s)
    wall = time.monotonic() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"child failed ({done.returncode}): {done.stderr[-3000:]}")
    result = json.loads(lines[-1][len("RESULT "):])
    if not result["sao_core"].startswith(str(tree)):
        raise RuntimeError(f"child imported sao_core from {result['sao_core']}, not {tree}")
    return {"process_s": wall, "records": result["records"]}


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    """Medians per (task, main, arm, index of the grader / evaluation in its process)."""
    groups: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for record in run["records"]:
            key = f"{run['task']}/{run['main']}/{run['arm']}/#{record['index'] + 1}"
            for name, value in record.items():
                if name not in ("index",) and isinstance(value, (int, float)):
                    groups.setdefault(key, {}).setdefault(name, []).append(float(value))
            groups[key].setdefault("process_s", []).append(run["process_s"])
    return {key: {name: round(_median(values), 4) for name, values in fields.items()} | {"n": len(fields["process_s"])}
            for key, fields in sorted(groups.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="local_outputs/bench/eval_startup")
    parser.add_argument("--results", default=None, help="also write the JSON here (e.g. bench/results/eval_startup.json)")
    parser.add_argument("--before-ref", default="HEAD", help="git ref of the 'before' grader (the committed code)")
    parser.add_argument("--after-files", nargs="*", default=list(AFTER_FILES),
                        help="working-tree files copied over the before tree for the 'after' arm")
    parser.add_argument("--tasks", nargs="*", default=["grading", "evaluate"], choices=["grading", "evaluate"])
    parser.add_argument("--mains", nargs="*", default=list(DRIVERS), choices=list(DRIVERS))
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--evals", type=int, default=2, help="graders / evaluations in a row per process")
    parser.add_argument("--answers", type=int, default=64)
    parser.add_argument("--problems", type=int, default=64)
    parser.add_argument("--model", default="embedded:tiny")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--cache-dir", default=None, help="model cache (default: the shared sao cache)")
    parser.add_argument("--child-timeout-s", type=float, default=900.0)
    args = parser.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import _setup

    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    cache_dir = args.cache_dir or _setup.default_cache_dir()
    started = time.monotonic()
    load_before = os.getloadavg()
    runs = []
    with tempfile.TemporaryDirectory(prefix="eval-startup-") as tmp:
        work = Path(tmp)
        trees = build_trees(work, args.before_ref, args.after_files)
        drivers = write_drivers(work)
        for rep in range(args.reps):
            arms = ["before", "after"] if rep % 2 == 0 else ["after", "before"]
            for task in args.tasks:
                for main_name in args.mains:
                    for arm in arms:
                        settings = {"task": task, "evals": args.evals, "answers": args.answers,
                                    "problems": args.problems, "model": args.model,
                                    "max_new_tokens": args.max_new_tokens, "cache_dir": cache_dir}
                        result = run_child(trees[arm], drivers[main_name], settings, args.child_timeout_s)
                        run = {"rep": rep, "task": task, "main": main_name, "arm": arm, **result}
                        runs.append(run)
                        first = run["records"][0]
                        shown = {k: round(v, 3) for k, v in first.items() if k.endswith("_s")}
                        print(f"rep {rep} {task:8s} {main_name:6s} {arm:6s} process {result['process_s']:.1f} s  "
                              f"#1 {shown}", flush=True)
    summary = summarize(runs)
    payload = {"settings": vars(args) | {"cache_dir": cache_dir}, "conditions": {
        "start": load_before, "end": os.getloadavg(), "cpu_count": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "python": sys.version.split()[0]},
        "seconds": round(time.monotonic() - started, 1), "summary": summary, "runs": runs}
    text = json.dumps(payload, indent=1)
    (output / "eval_startup.json").write_text(text)
    if args.results:
        Path(args.results).write_text(text)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
