"""SAO stability run on the embedded tool task: SFT warm start, then N SAO steps (default 1000);
`--method` runs a baseline with the same settings instead (group size 8 for the GRPO methods).

Prints the reward curve (mean per window of steps), staleness, drops and the DIS mask fractions, and
writes everything to OUTPUT/stability.json. Not a test: a long run (about 2 s per step on 2 CPU cores
with batch 32). Reproduce with:

    .venv/bin/python bench/sao_stability.py --steps 1000 --output local_outputs/bench/stability
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sao_core.data.prepare import PrepareConfig, prepare  # noqa: E402
from sao_core.data.synthetic import tool_arith_sft_rows  # noqa: E402
from sao_core.envs.tool_arith import tool_arith_tasks  # noqa: E402
from sao_core.learner.config import RLConfig  # noqa: E402
from sao_core.learner.loop import train_rl  # noqa: E402
from sao_core.training.config import SFTConfig  # noqa: E402
from sao_core.training.trainer import train  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--method", default="sao", help="sao (default) or a baseline: grpo, grpo_async, grpo_dis, "
                                                       "running_mean")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--policy-lr", type=float, default=3e-4)
    parser.add_argument("--critic-lr", type=float, default=3e-4)
    parser.add_argument("--sft-steps", type=int, default=240, help="warm start; 240 gives sampled reward ~0.25")
    parser.add_argument("--window", type=int, default=50)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--admission", default=None, help="window | version_order | requeue [default: RLConfig's]")
    parser.add_argument("--output", default="local_outputs/bench/stability")
    args = parser.parse_args()

    out = Path(args.output)
    shutil.rmtree(out, ignore_errors=True)
    (out / "sft-data").mkdir(parents=True)
    (out / "sft-data" / "data.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(600, seed=5)))
    warm = train("sft", SFTConfig(data=str(out / "sft-data"), output=str(out / "sft"), steps=args.sft_steps,
                                  batch_size=16, lr=3e-3, max_tokens=128, seed=args.seed))["model"]
    tasks = tool_arith_tasks(2000, seed=3, p_more=1.0)
    (out / "rl.jsonl").write_text("".join(json.dumps({"id": t.id, "prompt": t.prompt, "env": t.env,
                                                      "answer": t.answer}) + "\n" for t in tasks))
    prepare(PrepareConfig(source=str(out / "rl.jsonl"), kind="rl", output=str(out / "rl")))
    started = time.time()
    summary = train_rl(RLConfig(data=str(out / "rl"), output=str(out / "sao"), method=args.method, model=warm,
                                steps=args.steps, batch_size=args.batch_size, policy_lr=args.policy_lr,
                                critic_lr=args.critic_lr, critic_warmup_steps=5, max_new_tokens_per_turn=32,
                                max_total_tokens=160, seed=args.seed, checkpoint_every=100,
                                **({"admission": args.admission} if args.admission else {})))
    rows = [json.loads(x) for x in (out / "sao" / "metrics.jsonl").read_text().splitlines()]
    curve = []
    for start in range(0, len(rows), args.window):
        chunk = rows[start:start + args.window]
        policy_rows = [r for r in chunk if "policy_kept" in r] or [{}]
        curve.append({
            "steps": f"{chunk[0]['step']}-{chunk[-1]['step']}",
            "reward": round(sum(r["reward_mean"] for r in chunk if "reward_mean" in r)
                            / max(1, sum("reward_mean" in r for r in chunk)), 3),
            "max_staleness": max(int(k) for r in chunk for k in r["staleness"]),
            "dis_kept": round(sum(r.get("policy_kept", 0) for r in policy_rows) / len(policy_rows), 4),
            "masked_low": round(sum(r.get("policy_masked_low", 0) for r in policy_rows) / len(policy_rows), 4),
            "masked_high": round(sum(r.get("policy_masked_high", 0) for r in policy_rows) / len(policy_rows), 4),
        })
    result = {"summary": summary, "curve": curve, "rl_seconds": time.time() - started, "args": vars(args)}
    (out / "stability.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'steps':>12} {'reward':>7} {'stale':>5} {'kept':>7} {'low':>7} {'high':>7}")
    for c in curve:
        print(f"{c['steps']:>12} {c['reward']:>7} {c['max_staleness']:>5} {c['dis_kept']:>7} {c['masked_low']:>7} "
              f"{c['masked_high']:>7}")
    print(f"admission {summary['admission']}, dropped {summary['dropped']} {summary['dropped_by_reason']}, "
          f"trained turns {summary['length_bias']['trained_turns_mean']} of {summary['length_bias']['arrived_turns_mean']}"
          f" arrived, {result['rl_seconds']:.0f} s; details in {out / 'stability.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
