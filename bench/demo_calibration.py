"""Calibration of `make demo` (sao_core/demo.py DEMO_*): the demo's warm start and SAO run with its
evaluation during training, in this process instead of the KFP local runner (the same settings and code:
the pipeline's components call the same `train` and `train_rl`), for several SAO seeds from one warm start.

Caveat (measured 2026-12-01): its warm start is weaker than the pipeline's for the same number of steps
(held-out sampled reward 0.20 against 0.43 after 215 steps; this script writes the SFT rows as they are, the
pipeline prepares them with `prepare-data`), so the demo's settings were set by pipeline runs (README
"Running pipelines locally"); the script is for comparing SAO settings from one warm start.

Prints, per seed, the held-out sampled (T = 1) and greedy rewards at every evaluation and the seconds, and
writes OUTPUT/calibration.json. Reproduce (README "The demo"):

    .venv/bin/python bench/demo_calibration.py --seeds 0 1 2 --output local_outputs/bench/demo_calibration
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sao_core import demo as local  # noqa: E402  (the demo's settings)
from sao_core.data.prepare import PrepareConfig, prepare  # noqa: E402
from sao_core.data.synthetic import tool_arith_sft_rows  # noqa: E402
from sao_core.envs.tool_arith import tool_arith_tasks  # noqa: E402
from sao_core.learner.config import RLConfig  # noqa: E402
from sao_core.learner.loop import train_rl  # noqa: E402
from sao_core.training.config import SFTConfig  # noqa: E402
from sao_core.training.trainer import train  # noqa: E402


def _jsonl(path: Path, rows) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", default="local_outputs/bench/demo_calibration")
    parser.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "sao"))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--warm-start-steps", type=int, default=local.DEMO_WARM_START_STEPS)
    parser.add_argument("--warm-start-rows", type=int, default=local.DEMO_WARM_START_ROWS)
    parser.add_argument("--steps", type=int, default=local.DEMO_SAO_STEPS)
    parser.add_argument("--batch-size", type=int, default=local.DEMO_BATCH_SIZE)
    parser.add_argument("--policy-lr", type=float, default=local.DEMO_POLICY_LR)
    parser.add_argument("--held-out", type=int, default=local.DEMO_HELD_OUT)
    parser.add_argument("--eval-every", type=int, default=local.DEMO_EVAL_EVERY)
    parser.add_argument("--eval-samples", type=int, default=local.DEMO_EVAL_SAMPLES)
    parser.add_argument("--whiten", action="store_true", help="whiten advantages per batch (RLConfig)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    out = Path(args.output)
    shutil.rmtree(out, ignore_errors=True)
    warm_rows = list(tool_arith_sft_rows(args.warm_start_rows, seed=local.WARM_SEED))
    rl_tasks = tool_arith_tasks(2000, seed=local.RL_SEED, p_more=1.0)
    row = lambda t: {"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer}  # noqa: E731
    prepare(PrepareConfig(source=_jsonl(out / "raw" / "rl.jsonl", map(row, rl_tasks)), kind="rl",
                          output=str(out / "rl")))
    held = local.held_out_tasks(args.held_out, rl_tasks, warm_rows)
    prepare(PrepareConfig(source=_jsonl(out / "raw" / "held.jsonl", map(row, held)), kind="rl",
                          output=str(out / "held_out")))
    (out / "sft_data").mkdir(parents=True)
    (out / "sft_data" / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in warm_rows))
    began = time.time()
    warm = train("sft", SFTConfig(data=str(out / "sft_data"), output=str(out / "sft"), steps=args.warm_start_steps,
                                  batch_size=16, lr=3e-3, max_tokens=256, cache_dir=args.cache_dir))["model"]
    sft_seconds = time.time() - began
    print(f"warm start: {args.warm_start_steps} steps in {sft_seconds:.0f} s", flush=True)
    results = []
    for seed in args.seeds:
        began = time.time()
        summary = train_rl(RLConfig(
            data=str(out / "rl"), output=str(out / f"sao-{seed}"), model=warm, method="sao", steps=args.steps,
            batch_size=args.batch_size, policy_lr=args.policy_lr, critic_lr=3e-4,
            critic_warmup_steps=local.DEMO_CRITIC_WARMUP, engine="hf", max_new_tokens_per_turn=32,
            max_total_tokens=160, seed=seed, eval_every=args.eval_every, eval_data=str(out / "held_out"),
            eval_samples=args.eval_samples, whiten_advantages=args.whiten, cache_dir=args.cache_dir))
        history = summary["evaluations"]
        result = {"seed": seed, "seconds": round(time.time() - began, 1),
                  "sampled": [round(h["eval_sampled_reward"], 4) for h in history],
                  "greedy": [round(h.get("eval_greedy_reward", float("nan")), 4) for h in history],
                  "steps": [h["step"] for h in history], "eval_s": [round(h["eval_s"], 1) for h in history],
                  "reward_first": summary["reward_first"], "reward_last": summary["reward_last"]}
        result["rise"] = round(result["sampled"][-1] - result["sampled"][0], 4)
        results.append(result)
        print(json.dumps(result), flush=True)
    (out / "calibration.json").write_text(json.dumps({"args": vars(args), "sft_seconds": sft_seconds,
                                                      "runs": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
