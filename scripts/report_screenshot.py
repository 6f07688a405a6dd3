"""Render the pipeline's final report (the evaluation with the training run embedded, as ``make demo`` ends)
and screenshot its first screen in headless Chromium (``--screenshot --window-size=1280,900``).

    .venv/bin/python scripts/report_screenshot.py                       # a synthetic demo-like run
    .venv/bin/python scripts/report_screenshot.py --run OUTPUT/runs/ID  # a real `make demo` run folder

The synthetic run looks like the demo's: SAO for 100 steps from the SFT warm start of ``embedded:tiny``,
held-out greedy and sampled rewards every 25 steps (with the constant ``eval_prompts`` 128 and friends),
health metrics, and an IMO-AnswerBench evaluation of 8 problems where the tiny model solves nothing. A real
run folder is read as the pipeline's report step reads it: ``report/summary.json`` (the merged evaluation
summary), each benchmark's ``samples.jsonl``, and the training run the evaluated model came from.

The report is written to ``--html`` (default: a temporary folder) and the PNG to ``--out`` (default
``docs/images/report_first_screen.png``). Needs Chromium (``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sao_core import storage  # noqa: E402
from sao_core.eval.report import write_report  # noqa: E402

DEFAULT_OUT = ROOT / "docs" / "images" / "report_first_screen.png"


def _checkpoint(run: Path, step: int, state: dict[str, Any]) -> None:
    """A sealed checkpoint holding `state` as its trainer_state.json (where the report reads the config)."""
    folder = run / "checkpoints" / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "trainer_state.json").write_text(json.dumps(state))
    storage.seal_checkpoint(folder, metadata={"step": step})


def synthetic_run(root: Path, steps: int = 100, every: int = 25) -> tuple[Path, dict[str, Any], list[dict[str, Any]]]:
    """(training run folder, evaluation summary, samples) of a demo-like pipeline run under `root`."""
    from sao_core.eval.metrics import benchmark_metrics

    rng = random.Random(0)
    sft = root / "sft"
    (sft / "model").mkdir(parents=True, exist_ok=True)
    _checkpoint(sft, 190, {"method": "sft", "config": {"method": "sft", "model": "embedded:tiny", "steps": 190}})
    sao = root / "sao"
    rows = []
    for step in range(1, steps + 1):
        row: dict[str, Any] = {
            "step": step, "version": step, "reward_mean": 0.12 + 0.15 * step / steps + rng.uniform(-0.05, 0.05),
            "policy_loss": rng.uniform(-0.1, 0.1), "critic_loss": 0.2 * math.exp(-step / 30) + rng.random() * 0.02,
            "explained_variance": min(0.9, step / 80) + rng.uniform(-0.1, 0.1), "entropy": 1.2 - step / 300,
            "policy_kept": rng.uniform(0.95, 1.0), "policy_masked_low": 0.01, "policy_masked_high": 0.0,
            "policy_ratio_mean": 1.0, "policy_lr": 1e-5, "critic_lr": 3e-4, "positions_owed": 0,
            "requeued_total": 0, "dropped_total": 0, "world_size": 1, "seconds": 1.1 * step,
            "tokens_per_s": rng.uniform(500, 700), "trajectories_per_s": rng.uniform(25, 35),
        }
        if step % every == 0 or step == 1:
            row.update(eval_prompts=128, eval_greedy_n=128, eval_sampled_n=256, eval_failed=0,
                       eval_greedy_reward=0.66 + rng.uniform(-0.02, 0.03),
                       eval_sampled_reward=0.19 + 0.15 * step / steps + rng.uniform(-0.01, 0.01),
                       eval_s=rng.uniform(7, 9))
        rows.append(row)
    sao.mkdir(parents=True, exist_ok=True)
    (sao / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    evaluations = [{k: r[k] for k in ("step", "eval_prompts", "eval_greedy_reward", "eval_sampled_reward", "eval_s")}
                   for r in rows if "eval_prompts" in r]
    summary = {"method": "sao", "steps": steps, "version": steps - 5, "dropped": 0, "dropped_by_reason": {},
               "length_bias": {"drop_rate_by_turns": {"1": 0.0, "2": 0.0, "3-4": 0.0}, "trained_turns_mean": 2.0013,
                               "dropped_by_turns": {}},
               "stream": {"low_water_mark": 3200, "frontier": 3200, "owed": 0, "outcomes": {"trained": 3200}},
               "reward_first": 0.125, "reward_last": 0.2708333333333333, "seconds": 111.4530234336853,
               "model": str(sao / "model"), "critic": str(sao / "critic"), "resumed_from": None, "lora": None,
               "evaluations": evaluations, "eval_prompts": 128}
    (sao / "summary.json").write_text(json.dumps(summary))
    (sao / "model").mkdir(exist_ok=True)
    _checkpoint(sao, steps, {"method": "sao", "config": {"method": "sao", "model": str(sft / "model"),
                                                         "steps": steps, "batch_size": 32, "policy_lr": 1e-5}})
    problems = [{"id": f"imo-bench-algebra-{i:03d}", "category": "Algebra"} for i in range(8)]
    samples = [{"benchmark": "imo_answerbench", "id": p["id"], "sample": j, "correct": False, "grade": "mismatch",
                "grader": "rule", "status": "graded", "settled": True, "answer": str(rng.randint(0, 9)),
                "tokens": rng.randint(20, 64), "groups": {"category": p["category"]}} for p in problems for j in range(2)]
    bench = dict(benchmark_metrics(problems, samples, k=2, groups=("category",)), title="IMO-AnswerBench",
                 grader="math_rule")
    evaluation = {"model": str(sao / "model"), "engine": "hf", "config": {"temperature": 1.0, "top_p": 1.0},
                  "benchmarks": {"imo_answerbench": bench}}
    return sao, evaluation, samples


def demo_run(run: Path) -> tuple[str | None, dict[str, Any], list[dict[str, Any]]]:
    """(training run, evaluation summary, samples) of a real pipeline run folder (``OUTPUT/runs/ID``)."""
    from sao_core.kfp.evaluation import training_run_of

    summary = json.loads((run / "report" / "summary.json").read_text())
    samples = []
    for files in (summary.get("files") or {}).values():
        path = Path(files.get("samples", "")) if isinstance(files, dict) else None
        if path and path.is_file():
            samples += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    model = summary.get("model")
    return (training_run_of(model) if model else None), summary, samples


def screenshot(page: Path, png: Path, width: int = 1280, height: int = 900) -> None:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        raise SystemExit("chromium is not installed (apt-get install -y chromium)")
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               "--hide-scrollbars", f"--user-data-dir={profile}", f"--screenshot={png}",
                               f"--window-size={width},{height}", page.as_uri()],
                              capture_output=True, text=True, timeout=120)
    if done.returncode != 0 or not png.is_file():
        raise SystemExit(f"chromium failed ({done.returncode}): {done.stderr[-2000:]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, help="a pipeline run folder (OUTPUT/runs/ID of `make demo`)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the PNG (default: %(default)s)")
    parser.add_argument("--html", type=Path, help="folder for report.html (default: a temporary one)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        if args.run:
            training, summary, samples = demo_run(args.run.resolve())
        else:
            run, summary, samples = synthetic_run(Path(tmp) / "runs" / "demo")
            training = str(run)
        folder = args.html or Path(tmp) / "report"
        page = Path(write_report(summary, samples, str(folder), training_run=training))
        screenshot(page, args.out)
        print(f"report: {page}\nscreenshot: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
