"""Run pipelines on this machine with KFP's local runner (``kfp.local.SubprocessRunner``).

Each task runs as a subprocess of the current Python interpreter (``use_venv=False``), so the
components' ``sao_core`` imports resolve to this checkout's environment; Kubernetes settings are
ignored. Artifacts land under ``pipeline_root``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: Environment for the task subprocesses: offline hub, no spin-waiting OpenMP threads.
TASK_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_WAIT_POLICY": "PASSIVE",
            "TOKENIZERS_PARALLELISM": "false"}


class LocalRunError(RuntimeError):
    """A local pipeline run failed; the message names the failed task when KFP reports it."""


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_pipeline(pipeline, arguments: dict[str, Any], pipeline_root: str | Path, cache_dir: str | Path | None = None,
                 threads: int | None = None, env: dict[str, str] | None = None):
    """Run `pipeline` (a ``@dsl.pipeline`` function) locally with `arguments`; return its outputs.

    Returns the pipeline's output (a single value or a dict of named outputs; None when it has none).
    `cache_dir` becomes ``SAO_CACHE_DIR`` of the tasks (models cache); `threads` sets
    ``OMP_NUM_THREADS`` (torch threads) of each task. Raises :class:`LocalRunError` if a task fails.
    """
    from kfp import local

    root = Path(pipeline_root).expanduser().resolve()
    root.mkdir(parents=True, exist_ok=True)
    values = dict(TASK_ENV)
    if cache_dir is not None:
        values["SAO_CACHE_DIR"] = str(Path(cache_dir).expanduser().resolve())
    if threads:
        values["OMP_NUM_THREADS"] = str(threads)
    values.update(env or {})
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    with _environment(values), warnings.catch_warnings():
        # The local runner warns that our images' names do not contain "python"; it runs the tasks in this
        # interpreter, which has sao_core installed, exactly what the images hold.
        warnings.filterwarnings("ignore", message=".*non-Python base image.*", category=RuntimeWarning)
        try:
            task = pipeline(**arguments)
        except RuntimeError as err:
            raise LocalRunError(f"local run of {getattr(pipeline, 'name', pipeline)} failed: {err}") from err
    outputs = getattr(task, "outputs", None)
    if isinstance(outputs, dict) and set(outputs) == {"Output"}:
        return outputs["Output"]
    return outputs or None


#: Seed of the demo's warm-start SFT rows: the rows and settings of the plain SFT demo (`sao_core.demo`).
WARM_SEED = 1
#: The demo's settings (calibration: README "The demo" and tests/test_pipelines_local.py): a warm start short
#: enough that the held-out sampled reward starts near 0.25, then SAO with evaluation during training.
DEMO_WARM_START_STEPS = 190
DEMO_WARM_START_ROWS = 600
DEMO_SAO_STEPS = 100
DEMO_BATCH_SIZE = 32
DEMO_POLICY_LR = 2e-4
DEMO_CRITIC_WARMUP = 5
DEMO_HELD_OUT = 128
DEMO_EVAL_EVERY = 25
DEMO_EVAL_SAMPLES = 2


def _jsonl(path: Path, rows) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


#: Seed of the demo's RL prompts and of its held-out prompts (another seed; prompts of the RL set, or of the
#: warm-start rows, are left out of the held-out set).
RL_SEED = 3
HELD_OUT_SEED = 4


def held_out_tasks(count: int, rl_prompts, warm_rows) -> list:
    """`count` single-call tool_arith tasks of seed HELD_OUT_SEED, none of them an RL prompt or a warm-start row."""
    from sao_core.envs.tool_arith import tool_arith_tasks

    seen = {t.prompt[0]["content"] for t in rl_prompts} | {r["messages"][0]["content"] for r in warm_rows}
    chosen, draw = [], count
    while len(chosen) < count:
        chosen = [t for t in tool_arith_tasks(draw, seed=HELD_OUT_SEED, p_more=1.0)
                  if t.prompt[0]["content"] not in seen][:count]
        draw *= 2
    return chosen


def run_sao_rl_demo(output: str | Path, cache_dir: str | Path, *, warm_start_steps: int = DEMO_WARM_START_STEPS,
                    warm_start_rows: int = DEMO_WARM_START_ROWS, sao_steps: int = DEMO_SAO_STEPS,
                    batch_size: int = DEMO_BATCH_SIZE, policy_lr: float = DEMO_POLICY_LR,
                    held_out: int = DEMO_HELD_OUT, eval_every: int = DEMO_EVAL_EVERY,
                    eval_samples: int = DEMO_EVAL_SAMPLES, eval_limit: int = 8, eval_k: int = 2,
                    threads: int | None = None, seed: int = 0, say=print) -> dict[str, Any]:
    """`make demo`: the ``sao_rl`` pipeline end to end on this machine, on the embedded tiny model.

    Inputs (written to ``OUTPUT/inputs``): the synthetic ``tool_arith`` task (``Compute A op B`` with a
    calculator tool), as SFT conversations for a short warm start, as 2000 RL prompts for SAO, and as
    `held_out` other prompts for the evaluation during training (`RLConfig.eval_every`: the held-out greedy
    and sampled rewards at the current weights every `eval_every` steps, from step 0 to the end). The warm
    start is short on purpose: the held-out sampled (T = 1) reward starts near 0.25, where SAO has something
    to learn (README "The demo" has the measured figures). The benchmark path is shown on the first
    `eval_limit` problems of the bundled IMO-AnswerBench (CC-BY-4.0, Google DeepMind), which the tiny model
    cannot solve. The pipeline runs every step as a subprocess (KFP local runner): prepare data -> SFT warm
    start -> SAO (HF engine, colocated rollout service, evaluation during training) -> evaluation -> HTML
    report. `seed` is the SAO run's seed (RLConfig.seed). Returns the summary (also
    ``OUTPUT/summary.json``) with every path; ``held_out`` holds the before / after rewards.
    """
    import json
    import shutil
    import time

    from sao_core import storage
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.envs.tool_arith import tool_arith_tasks
    from sao_core.models import EMBEDDED_TINY

    started = time.time()
    out = Path(output).expanduser().resolve()
    for stale in ("inputs", "runs", "pipeline_root"):  # the demo starts over each time
        shutil.rmtree(out / stale, ignore_errors=True)
    warm_rows = list(tool_arith_sft_rows(warm_start_rows, seed=WARM_SEED))
    warm = _jsonl(out / "inputs" / "tool_arith_sft.jsonl", warm_rows)
    rl_tasks = tool_arith_tasks(2000, seed=RL_SEED, p_more=1.0)
    rl = _jsonl(out / "inputs" / "tool_arith_rl.jsonl", (
        {"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer} for t in rl_tasks))
    held = _jsonl(out / "inputs" / "tool_arith_held_out.jsonl", (
        {"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer}
        for t in held_out_tasks(held_out, rl_tasks, warm_rows)))
    held_data = str(out / "inputs" / "held_out")
    prepare(PrepareConfig(source=str(held), kind="rl", output=held_data))
    say(f"[1/3] inputs: {warm} ({warm_start_rows} SFT conversations), {rl} (2000 RL prompts), {held} "
        f"({held_out} held-out prompts); benchmark path: bundled IMO-AnswerBench")

    from pipelines.sao_rl import sao_rl

    arguments = dict(
        rl_source=str(rl), output_root=str(out / "runs"), base_model=EMBEDDED_TINY,
        warm_start_source=str(warm), warm_start_steps=warm_start_steps, warm_start_lr=3e-3,
        warm_start_batch_size=16, max_tokens=256, steps=sao_steps, batch_size=batch_size, policy_lr=policy_lr,
        critic_lr=3e-4, critic_warmup_steps=DEMO_CRITIC_WARMUP, engine="hf",
        sao_options={"max_new_tokens_per_turn": 32, "max_total_tokens": 160, "seed": seed,
                     "eval_every": eval_every, "eval_data": held_data, "eval_samples": eval_samples},
        eval_benchmarks=["imo_answerbench"], eval_k=eval_k, eval_limit=eval_limit, eval_max_new_tokens=64,
        eval_max_total_tokens=512, eval_sandbox="local", eval_options={"grader_workers": 1},
    )
    say(f"[2/3] running the sao_rl pipeline locally (KFP SubprocessRunner): prepare -> SFT {warm_start_steps} "
        f"steps -> SAO {sao_steps} steps of {batch_size}, held-out evaluation every {eval_every} -> evaluate "
        "-> report")
    pipeline_started = time.time()
    report_uri = run_pipeline(sao_rl, arguments, out / "pipeline_root", cache_dir=cache_dir, threads=threads)
    pipeline_seconds = time.time() - pipeline_started

    runs = [p for p in (out / "runs").iterdir() if p.is_dir()]
    if len(runs) != 1:
        raise LocalRunError(f"expected one run folder under {out / 'runs'}, found {len(runs)}")
    run = runs[0]
    sao_summary = json.loads((run / "sao" / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "sao" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "reward_mean" in r]
    window = max(1, len(steps) // 4)
    curve = [{"steps": f"{chunk[0]['step']}-{chunk[-1]['step']}",
              "reward": round(sum(r["reward_mean"] for r in chunk) / len(chunk), 3)}
             for chunk in (steps[i:i + window] for i in range(0, len(steps), window))]
    evaluations = [{k: r[k] for k in ("step", "eval_sampled_reward", "eval_greedy_reward") if k in r}
                   for r in rows if "eval_sampled_reward" in r]
    eval_summary = json.loads((run / "report" / "summary.json").read_text())
    sft_model = str(run / "sft" / "model")
    before, after = evaluations[0], evaluations[-1]
    held_result = {"prompts": held_out, "samples_per_prompt": eval_samples,
                   "sampled_before": before["eval_sampled_reward"], "sampled_after": after["eval_sampled_reward"],
                   "greedy_before": before.get("eval_greedy_reward"), "greedy_after": after.get("eval_greedy_reward"),
                   "steps": [e["step"] for e in evaluations], "by_step": evaluations}
    say("[3/3] SAO held-out rewards by step (sampled T = 1 / greedy): "
        + ", ".join(f"{e['step']}: {e['eval_sampled_reward']:.2f} / {e.get('eval_greedy_reward', float('nan')):.2f}"
                    for e in evaluations)
        + "; mean batch reward (sampled) by steps: " + ", ".join(f"{c['steps']}: {c['reward']:.2f}" for c in curve))
    result = {
        "output": str(out),
        "pipeline_seconds": round(pipeline_seconds, 1),
        "run_dir": str(run),
        "report": report_uri,
        "evaluation_summary": str(run / "report" / "summary.json"),
        "evaluation_metrics": eval_summary["metrics"],
        "sao_metrics": str(run / "sao" / "metrics.jsonl"),
        "sao": {k: sao_summary[k] for k in ("steps", "version", "reward_first", "reward_last", "dropped",
                                            "trained_trajectories", "seconds", "model", "checkpoint")},
        "sao_reward_by_steps": curve,
        "held_out": held_result,
        "sft_model": sft_model,
        "sft_model_verified": storage.is_complete_checkpoint(sft_model),
        "sao_model_verified": storage.is_complete_checkpoint(sao_summary["model"]),
        "pipeline_root": str(out / "pipeline_root"),
        "seconds": round(time.time() - started, 1),
    }
    result["summary_file"] = str(out / "summary.json")
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
