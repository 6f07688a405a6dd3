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


def _jsonl(path: Path, rows) -> Path:
    import json

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_sao_rl_demo(output: str | Path, cache_dir: str | Path, *, warm_start_steps: int = 300,
                    warm_start_rows: int = 2000, sao_steps: int = 40, batch_size: int = 16, policy_lr: float = 1e-4,
                    eval_limit: int = 8,
                    eval_k: int = 2, held_out: int = 50, threads: int | None = None,
                    say=print) -> dict[str, Any]:
    """`make demo`: the ``sao_rl`` pipeline end to end on this machine, on the embedded tiny model.

    Inputs (written to ``OUTPUT/inputs``): the synthetic ``tool_arith`` task, as SFT conversations for
    the warm start (the rows and settings of the plain SFT demo) and as RL prompts for SAO; the
    evaluation uses the first `eval_limit` problems of the bundled IMO-AnswerBench (CC-BY-4.0, Google
    DeepMind). The pipeline runs every step as a subprocess (KFP local runner): prepare data -> SFT
    warm start -> SAO (HF engine, colocated rollout service) -> evaluation -> HTML report. Afterwards
    the greedy held-out tool-call accuracy of the base and the warm-started model is measured as in
    the plain demo. Returns the summary (also ``OUTPUT/summary.json``) with every path.
    """
    import json
    import shutil
    import time

    from sao_core import storage
    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.demo import held_out_problems, tool_call_accuracy
    from sao_core.envs.tool_arith import tool_arith_tasks
    from sao_core.models import EMBEDDED_TINY, load_model_and_tokenizer

    started = time.time()
    out = Path(output).expanduser().resolve()
    for stale in ("inputs", "runs", "pipeline_root"):  # the demo starts over each time
        shutil.rmtree(out / stale, ignore_errors=True)
    warm = _jsonl(out / "inputs" / "tool_arith_sft.jsonl", tool_arith_sft_rows(warm_start_rows, seed=WARM_SEED))
    rl = _jsonl(out / "inputs" / "tool_arith_rl.jsonl", (
        {"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer}
        for t in tool_arith_tasks(2000, seed=3, p_more=1.0)))
    say(f"[1/3] inputs: {warm} ({warm_start_rows} SFT conversations), {rl} (2000 RL prompts); "
        "evaluation: bundled IMO-AnswerBench")

    from pipelines.sao_rl import sao_rl

    arguments = dict(
        rl_source=str(rl), output_root=str(out / "runs"), base_model=EMBEDDED_TINY,
        warm_start_source=str(warm), warm_start_steps=warm_start_steps, warm_start_lr=3e-3,
        warm_start_batch_size=16, max_tokens=256, steps=sao_steps, batch_size=batch_size, policy_lr=policy_lr,
        critic_lr=3e-4, critic_warmup_steps=5, engine="hf",
        sao_options={"max_new_tokens_per_turn": 32, "max_total_tokens": 160},
        eval_benchmarks=["imo_answerbench"], eval_k=eval_k, eval_limit=eval_limit, eval_max_new_tokens=64,
        eval_max_total_tokens=512, eval_sandbox="local", eval_options={"grader_workers": 1},
    )
    say(f"[2/3] running the sao_rl pipeline locally (KFP SubprocessRunner): prepare -> SFT {warm_start_steps} "
        f"steps -> SAO {sao_steps} steps of {batch_size} -> evaluate -> report")
    pipeline_started = time.time()
    report_uri = run_pipeline(sao_rl, arguments, out / "pipeline_root", cache_dir=cache_dir, threads=threads)
    pipeline_seconds = time.time() - pipeline_started

    runs = [p for p in (out / "runs").iterdir() if p.is_dir()]
    if len(runs) != 1:
        raise LocalRunError(f"expected one run folder under {out / 'runs'}, found {len(runs)}")
    run = runs[0]
    sao_summary = json.loads((run / "sao" / "summary.json").read_text())
    steps = [json.loads(line) for line in (run / "sao" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    window = max(1, len(steps) // 4)
    curve = [{"steps": f"{chunk[0]['step']}-{chunk[-1]['step']}",
              "reward": round(sum(r["reward_mean"] for r in chunk) / len(chunk), 3)}
             for chunk in (steps[i:i + window] for i in range(0, len(steps), window))]
    eval_summary = json.loads((run / "report" / "summary.json").read_text())
    sft_model = str(run / "sft" / "model")

    problems = held_out_problems(warm_start_rows, held_out, train_seed=WARM_SEED)
    base, tokenizer = load_model_and_tokenizer(EMBEDDED_TINY, cache_dir)
    before = tool_call_accuracy(base, tokenizer, problems)
    tuned, tokenizer = load_model_and_tokenizer(sft_model, cache_dir)
    after = tool_call_accuracy(tuned, tokenizer, problems)
    say(f"[3/3] held-out tool-call accuracy (greedy): {before:.2f} base -> {after:.2f} after the warm-start SFT; "
        "SAO mean batch reward (sampled, T = 1) by steps: "
        + ", ".join(f"{c['steps']}: {c['reward']:.2f}" for c in curve))
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
        "sft_model": sft_model,
        "sft_model_verified": storage.is_complete_checkpoint(sft_model),
        "sao_model_verified": storage.is_complete_checkpoint(sao_summary["model"]),
        "held_out_tool_call_accuracy": {"before": before, "after": after, "problems": len(problems)},
        "pipeline_root": str(out / "pipeline_root"),
        "seconds": round(time.time() - started, 1),
    }
    result["summary_file"] = str(out / "summary.json")
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
