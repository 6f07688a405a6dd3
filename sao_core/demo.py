"""The demos, on one CPU machine and the embedded default model (the top floor with `cli.py`: it drives a
pipeline).

`make demo` (``sao demo --pipeline``, `run_sao_rl_demo`): the whole ``sao_rl`` pipeline on the KFP local
runner, with SAO and its held-out evaluation during training. ``sao demo`` without ``--pipeline``
(`run_demo`): the plain SFT demo: build the embedded model, prepare an SFT data set of the synthetic tool task
and the bundled IMO-AnswerBench, fine-tune the model, publish a verified checkpoint, reload it and measure how
often it now calls the tool correctly on held-out problems.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.data.synthetic import tool_arith_problem, tool_arith_sft_rows

BUNDLED_IMO_ANSWERBENCH = Path(__file__).parent / "data" / "assets" / "imo_answerbench_v2.csv"


def tool_call_accuracy(model, tokenizer, problems: list[tuple[int, str, int]], max_new_tokens: int = 24) -> float:
    """Share of problems whose greedy first assistant turn is exactly ``<tool_call>calc A op B</tool_call>``."""
    import torch

    hits = 0
    for a, op, b in problems:
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"Compute {a} {op} {b}"}],
                                               add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.no_grad():
            out = model.generate(**prompt, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        text = tokenizer.decode(out[0, prompt["input_ids"].shape[1]:], skip_special_tokens=False)
        hits += text.split("<|im_end|>")[0].strip() == f"<tool_call>calc {a} {op} {b}</tool_call>"
    return hits / max(1, len(problems))


def held_out_problems(train_rows: int, count: int, train_seed: int = 1) -> list[tuple[int, str, int]]:
    """`count` tool_arith problems from another seed, none of them among the first `train_rows` SFT rows."""
    seen = {tuple(r["messages"][0]["content"].split()[1:]) for r in tool_arith_sft_rows(train_rows, seed=train_seed)}
    rng = random.Random(12345)
    held_out: list[tuple[int, str, int]] = []
    while len(held_out) < count:
        a, op, b = tool_arith_problem(rng)
        if (str(a), op, str(b)) not in seen:
            held_out.append((a, op, b))
    return held_out


def run_demo(output: str | Path, cache_dir: str | Path, steps: int = 300, train_rows: int = 2000,
             eval_problems: int = 50, progress: Callable[[int, dict], None] | None = None,
             say: Callable[[str], None] = print) -> dict:
    """Run the demo into `output` (a local directory); return its summary (also written as summary.json)."""
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.models import EMBEDDED_TINY, load_model_and_tokenizer, resolve_model
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    started = time.time()
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)

    model_dir = resolve_model(EMBEDDED_TINY, cache_dir).path
    say(f"[1/5] embedded model: {model_dir}")

    raw = out / "raw" / "tool_arith_sft.jsonl"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text("".join(json.dumps(row) + "\n" for row in tool_arith_sft_rows(train_rows, seed=1)))
    sft_data = prepare(PrepareConfig(source=str(raw), kind="sft", output=str(out / "prepared" / "tool_arith_sft"),
                                     tokenizer=model_dir, max_tokens=256))
    imo = prepare(PrepareConfig(source=str(BUNDLED_IMO_ANSWERBENCH), kind="imo_answerbench",
                                output=str(out / "prepared" / "imo_answerbench")))
    say(f"[2/5] prepared data: tool_arith sft {sft_data.rows_written} rows, IMO-AnswerBench {imo.rows_written} rows")

    held_out = held_out_problems(train_rows, eval_problems)
    base_model, tokenizer = load_model_and_tokenizer(EMBEDDED_TINY, cache_dir)
    before = tool_call_accuracy(base_model, tokenizer, held_out)

    say(f"[3/5] SFT for {steps} steps on {sft_data.rows_written} conversations")
    sft_dir = out / "sft"
    if sft_dir.exists():  # the demo starts over each time; a real run would pass resume=True instead
        shutil.rmtree(sft_dir)
    summary = train("sft", SFTConfig(data=str(out / "prepared" / "tool_arith_sft"), output=str(sft_dir),
                                     model=EMBEDDED_TINY, steps=steps, batch_size=16, lr=3e-3, warmup_steps=10,
                                     max_tokens=256, cache_dir=str(cache_dir)), progress=progress)
    say(f"[4/5] model exported and verified: {summary['model']} (resumable state: {summary['checkpoint']})")

    trained, tokenizer = load_model_and_tokenizer(summary["model"], cache_dir)
    after = tool_call_accuracy(trained, tokenizer, held_out)
    say(f"[5/5] held-out tool-call accuracy (greedy): {before:.2f} before SFT -> {after:.2f} after")

    result = {
        "output": str(out.resolve()),
        "model": model_dir,
        "prepared": {"tool_arith_sft": str(out / "prepared" / "tool_arith_sft"),
                     "imo_answerbench": str(out / "prepared" / "imo_answerbench")},
        "rows": {"tool_arith_sft": sft_data.rows_written, "imo_answerbench": imo.rows_written},
        "sft": {k: summary[k] for k in ("steps", "first_train_loss", "last_train_loss", "eval_loss_before",
                                        "eval_loss_after", "trained_tokens", "seconds")},
        "model_checkpoint": summary["model"],
        "model_verified": storage.is_complete_checkpoint(summary["model"]),
        "training_state": summary["checkpoint"],
        "held_out_tool_call_accuracy": {"before": before, "after": after, "problems": len(held_out)},
        "seconds": time.time() - started,
    }
    result["summary_file"] = str(out / "summary.json")
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


#: Seed of the demo's warm-start SFT rows: the rows and settings of the plain SFT demo (`sao_core.demo`).
WARM_SEED = 1
#: The demo's settings (calibration: README "The demo" and tests/kubeflow/test_pipelines_local.py): a warm start short
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
#: The least rise of the held-out sampled (T = 1) reward a `make demo` run must show (`demo_problems`; CI checks
#: it with scripts/check_demo.py). Calibration (docs/kubeflow.md "The demo"): seeds 0 / 1 / 2 rose +0.184,
#: +0.230, +0.207 (2 CPU cores, 2026-12-01; +0.161 from a fresh clone); 0.10 is about 3 standard deviations of
#: what a run that learnt nothing shows (256 answers at p = 0.17: 0.023 per evaluation, 0.033 for a difference).
DEMO_MARGIN = 0.10


def _jsonl(path: Path, rows) -> Path:
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
    started = time.time()
    out = Path(output).expanduser().resolve()
    for stale in ("inputs", "runs", "pipeline_root"):  # the demo starts over each time
        shutil.rmtree(out / stale, ignore_errors=True)
    warm, rl, held_data = _write_demo_inputs(out, warm_start_rows, held_out, say)
    from pipelines.sao_rl import sao_rl
    from sao_core.kfp.local import run_pipeline

    arguments = _demo_arguments(out, warm, rl, held_data, warm_start_steps=warm_start_steps, sao_steps=sao_steps,
                                batch_size=batch_size, policy_lr=policy_lr, eval_every=eval_every,
                                eval_samples=eval_samples, eval_limit=eval_limit, eval_k=eval_k, seed=seed)
    say(f"[2/3] running the sao_rl pipeline locally (KFP SubprocessRunner): prepare -> SFT {warm_start_steps} "
        f"steps -> SAO {sao_steps} steps of {batch_size}, held-out evaluation every {eval_every} -> evaluate "
        "-> report")
    pipeline_started = time.time()
    report_uri = run_pipeline(sao_rl, arguments, out / "pipeline_root", cache_dir=cache_dir, threads=threads)
    pipeline_seconds = time.time() - pipeline_started

    run = _only_run(out / "runs")
    sao_summary = json.loads((run / "sao" / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "sao" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = _reward_curve(rows)
    evaluations = [{k: r[k] for k in ("step", "eval_sampled_reward", "eval_greedy_reward") if k in r}
                   for r in rows if "eval_sampled_reward" in r]
    eval_summary = json.loads((run / "report" / "summary.json").read_text())
    held_result = _held_out_result(evaluations, held_out, eval_samples)
    say("[3/3] SAO held-out rewards by step (sampled T = 1 / greedy): "
        + ", ".join(f"{e['step']}: {e['eval_sampled_reward']:.2f} / {e.get('eval_greedy_reward', float('nan')):.2f}"
                    for e in evaluations)
        + "; mean batch reward (sampled) by steps: " + ", ".join(f"{c['steps']}: {c['reward']:.2f}" for c in curve))
    sft_model = str(run / "sft" / "model")
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


def _write_demo_inputs(out: Path, warm_start_rows: int, held_out: int, say) -> tuple[Path, Path, str]:
    """Write the warm-start SFT rows, the 2000 RL prompts and the held-out prompts under ``out/inputs`` and
    prepare the held-out set; return (warm-start file, RL file, prepared held-out folder)."""
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.envs.tool_arith import tool_arith_tasks

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
    return warm, rl, held_data


def _demo_arguments(out: Path, warm: Path, rl: Path, held_data: str, *, warm_start_steps: int, sao_steps: int,
                    batch_size: int, policy_lr: float, eval_every: int, eval_samples: int, eval_limit: int,
                    eval_k: int, seed: int) -> dict[str, Any]:
    """The sao_rl pipeline's arguments for the demo (HF engine, evaluation on the held-out prompts)."""
    from sao_core.models import EMBEDDED_TINY

    return dict(
        a0_rl_source=str(rl), a0_output_root=str(out / "runs"), a_base_model=EMBEDDED_TINY,
        a_warm_start_source=str(warm), b_warm_start_steps=warm_start_steps,
        b_warm_start_options={"lr": 3e-3, "batch_size": 16, "max_tokens": 256},
        b_steps=sao_steps, b_batch_size=batch_size, b_policy_lr=policy_lr, b_engine="hf",
        b_options={"critic_lr": 3e-4, "critic_warmup_steps": DEMO_CRITIC_WARMUP, "max_new_tokens_per_turn": 32,
                   "max_total_tokens": 160, "seed": seed, "eval_every": eval_every, "eval_data": held_data,
                   "eval_samples": eval_samples},
        c_eval_benchmarks=["imo_answerbench"], c_eval_k=eval_k, c_eval_limit=eval_limit, c_eval_sandbox="local",
        c_eval_options={"grader_workers": 1, "max_new_tokens": 64, "max_total_tokens": 512},
    )


def _only_run(runs_root: Path) -> Path:
    """The one run folder the pipeline wrote under `runs_root`."""
    from sao_core.kfp.local import LocalRunError

    runs = [p for p in runs_root.iterdir() if p.is_dir()]
    if len(runs) != 1:
        raise LocalRunError(f"expected one run folder under {runs_root}, found {len(runs)}")
    return runs[0]


def demo_problems(result: dict[str, Any], margin: float = DEMO_MARGIN) -> list[str]:
    """What a finished `make demo` run (`run_sao_rl_demo`'s result, or its summary.json) failed to show, one
    sentence each ([]: it showed everything): verified SFT and SAO models, every SAO step, the held-out
    evaluation at every `DEMO_EVAL_EVERY` steps over `DEMO_HELD_OUT` prompts, a start in [0.05, 0.4] (the short
    warm start leaves room to learn) and a rise of the held-out sampled reward of at least `margin`."""
    held = result["held_out"]
    checks = [
        (result["sft_model_verified"] and result["sao_model_verified"], "the SFT and SAO models verify"),
        (result["sao"]["steps"] == DEMO_SAO_STEPS, f"SAO ran {DEMO_SAO_STEPS} steps (ran {result['sao']['steps']})"),
        (held["steps"] == list(range(0, DEMO_SAO_STEPS + 1, DEMO_EVAL_EVERY)),
         f"the held-out evaluation ran every {DEMO_EVAL_EVERY} steps (at {held['steps']})"),
        (held["prompts"] == DEMO_HELD_OUT and held["samples_per_prompt"] == DEMO_EVAL_SAMPLES,
         f"{DEMO_HELD_OUT} held-out prompts x {DEMO_EVAL_SAMPLES} samples"),
        (0.05 <= held["sampled_before"] <= 0.4,
         f"the held-out sampled reward starts in [0.05, 0.4] (started at {held['sampled_before']:.3f})"),
        (held["sampled_after"] >= held["sampled_before"] + margin,
         f"the held-out sampled reward rises by at least {margin} "
         f"({held['sampled_before']:.3f} -> {held['sampled_after']:.3f})"),
    ]
    return [f"expected: {what}" for ok, what in checks if not ok]


def _reward_curve(rows: list[dict]) -> list[dict]:
    """The mean batch reward of the training steps in four windows (fewer when there are under four steps)."""
    steps = [r for r in rows if "reward_mean" in r]
    window = max(1, len(steps) // 4)
    return [{"steps": f"{chunk[0]['step']}-{chunk[-1]['step']}",
             "reward": round(sum(r["reward_mean"] for r in chunk) / len(chunk), 3)}
            for chunk in (steps[i:i + window] for i in range(0, len(steps), window))]


def _held_out_result(evaluations: list[dict], held_out: int, eval_samples: int) -> dict[str, Any]:
    """The held-out rewards at the first and last evaluation, with every evaluation by step."""
    before, after = evaluations[0], evaluations[-1]
    return {"prompts": held_out, "samples_per_prompt": eval_samples,
            "sampled_before": before["eval_sampled_reward"], "sampled_after": after["eval_sampled_reward"],
            "greedy_before": before.get("eval_greedy_reward"), "greedy_after": after.get("eval_greedy_reward"),
            "steps": [e["step"] for e in evaluations], "by_step": evaluations}
