"""The learning tests' computation (tests/learner/test_learner.py::test_rl_raises_the_reward) over many seeds: the
distribution of the reward rise, the dip rate and the turn-end health of every run (README "Learning that
holds").

One early-stopped SFT warm start (the test fixture's rows and settings), then per seed one RL run of the test's
steps (150 for both) of 32 (`--batch-size`) single-operation tool_arith episodes: the rise is the mean batch
reward of the last quarter of the steps minus the first quarter. A run is a *dip* when its rise is below `--dip-below`
(default 0.10) or when more than 10 % of a quarter's trajectories ended in a turn cut at the token cap (the
collapse mode of issue 25). Prints a line per run and a summary, writes
OUTPUT/learning_runs.json. Reproduce the README's figures with:

    .venv/bin/python bench/learning_runs.py --method sao --runs 20 --first-seed 100 --output local_outputs/bench/learning_sao
    .venv/bin/python bench/learning_runs.py --method grpo --runs 20 --first-seed 200 --output local_outputs/bench/learning_grpo

A run takes about as long as its test (in `.ci/run` on 2 cores: SAO 65 s alone, GRPO 52 s beside other tests);
several processes side by side share the cores (the README's runs went four at a time, 120-250 s each).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sao_core.data.synthetic import tool_arith_sft_rows  # noqa: E402
from sao_core.envs.tool_arith import tool_arith_tasks  # noqa: E402
from sao_core.learner.config import RLConfig  # noqa: E402
from sao_core.learner.loop import train_rl  # noqa: E402
from sao_core.training.config import SFTConfig  # noqa: E402
from sao_core.training.trainer import train  # noqa: E402

HEALTH = ("turn_cut_share", "tool_error_share", "policy_kept", "end_of_turn_logprob", "explained_variance")

# The learning tests' settings (tests/learner/test_learner.py::test_rl_raises_the_reward imports them from here, so the
# runs below measure exactly what the tests run). `margin`: the rise the test asserts (README "Learning that
# holds": at least 3 SD of a method that does not learn and below the smallest measured rise).
LEARNING_TEST: dict[str, dict] = {
    "sao": {"steps": 150, "group_size": 4, "policy_lr": 2e-4, "critic_lr": 3e-4, "critic_warmup_steps": 20,
            "schedule": "cosine", "min_lr_ratio": 0.1, "margin": 0.07},
    "grpo": {"steps": 150, "group_size": 8, "policy_lr": 3e-4, "critic_lr": 3e-4, "critic_warmup_steps": 5,
             "margin": 0.07},
}


def learning_config(method: str, data: str, model: str, output: str, cache_dir: str, seed: int = 0,
                    **changes) -> RLConfig:
    """The RL run of a learning test: batches of 32 single-operation tool_arith episodes (turns of at most 32
    tokens, 160 per episode) with `method`'s settings from LEARNING_TEST; `changes` override fields."""
    settings = {k: v for k, v in LEARNING_TEST[method].items() if k != "margin"}
    fields = dict(data=data, output=output, model=model, method=method, batch_size=32,
                  max_new_tokens_per_turn=32, max_total_tokens=160, seed=seed, cache_dir=cache_dir, **settings)
    return RLConfig(**{**fields, **changes})


def warm_start(root: Path, cache: Path, steps: int = 240) -> str:
    """The test fixture's early-stopped SFT model (240 steps: sampled reward about 0.25), trained once under
    `root`."""
    model = root / f"sft-{steps}" / "model"
    if not model.exists():
        (root / "sft-data").mkdir(parents=True, exist_ok=True)
        (root / "sft-data" / "data.jsonl").write_text(
            "".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(600, seed=5)))
        train("sft", SFTConfig(data=str(root / "sft-data"), output=str(root / f"sft-{steps}"), steps=steps,
                               batch_size=16, lr=3e-3, max_tokens=128, cache_dir=str(cache)))
    return str(model)


def rl_data(root: Path) -> str:
    """The learning test's RL prompts (2,000 single-operation tool_arith tasks, seed 3), prepared under `root`."""
    import _setup  # noqa: PLC0415  (sets the bench thread environment: only when the script runs, not on import)

    return _setup.write_rl_data(root / "rl", tool_arith_tasks(2000, seed=3, p_more=1.0))


def first_and_last(rows: list[dict]) -> tuple[float, float]:
    """Mean batch reward of the first and of the last quarter of the steps (37 of 150): what the learning tests
    compare."""
    quarter = max(1, len(rows) // 4)
    return (sum(r["reward_mean"] for r in rows[:quarter]) / quarter,
            sum(r["reward_mean"] for r in rows[-quarter:]) / quarter)


def quarters(rows: list[dict], key: str) -> list[float | None]:
    """Mean of `key` over each quarter of the steps (None where no step logged it)."""
    size = max(1, len(rows) // 4)
    out = []
    for start in range(0, size * 4, size):
        values = [r[key] for r in rows[start:start + size] if isinstance(r.get(key), int | float)]
        out.append(round(sum(values) / len(values), 4) if values else None)
    return out


def one_run(args, seed: int, model: str, data: str, cache: Path, out: Path) -> dict:
    started = time.time()
    config = learning_config(args.method, data, model, str(out), str(cache), seed=seed, steps=args.steps,
                             batch_size=args.batch_size, group_size=args.group_size, policy_lr=args.policy_lr,
                             critic_lr=args.critic_lr, critic_warmup_steps=args.critic_warmup, lora_rank=args.lora_rank,
                             critic_lora_rank=args.critic_lora_rank, lora_alpha=2.0 * max(args.lora_rank,
                                                                                          args.critic_lora_rank, 1),
                             lora_target_modules="all-linear" if args.lora_rank or args.critic_lora_rank else "")
    summary = train_rl(config)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    first, last = first_and_last(rows)
    health = {key: quarters(rows, key) for key in HEALTH}
    cut_peak = max((v for v in health["turn_cut_share"] if v is not None), default=0.0)
    rise = last - first
    return {"seed": seed, "first": round(first, 4), "last": round(last, 4), "rise": round(rise, 4),
            "dip": rise < args.dip_below or cut_peak > 0.10, "cut_peak_quarter": cut_peak, "quarters": health,
            "dropped": summary["dropped"], "max_staleness": max(int(k) for r in rows for k in r["staleness"]),
            "seconds": round(time.time() - started, 1), "load_average": os.getloadavg()}


def summarise(runs: list[dict], args) -> dict:
    rises = sorted(r["rise"] for r in runs)
    firsts = [r["first"] for r in runs]
    # A method that does not learn: two means of n rewards (a quarter of the steps, a batch each) at the starting
    # reward rate p differ by sqrt(2 p (1 - p) / n) (one SD).
    p = sum(firsts) / len(firsts)
    n = max(1, args.steps // 4) * args.batch_size
    noise_sd = math.sqrt(2 * p * (1 - p) / n)
    dips = sum(r["dip"] for r in runs)
    return {"runs": len(runs), "rise_mean": round(statistics.mean(rises), 4),
            "rise_sd": round(statistics.stdev(rises), 4) if len(rises) > 1 else 0.0,
            "rise_min": rises[0], "rise_max": rises[-1], "rises_sorted": rises, "dips": dips,
            # with no dip in n runs, the one-sided 95 % upper bound on the dip rate is about 3 / n
            "dip_rate_upper_95": round(3 / len(runs), 4) if dips == 0 else None,
            "no_learning_sd": round(noise_sd, 4), "three_sd_of_no_learning": round(3 * noise_sd, 4),
            "settings": {k: v for k, v in vars(args).items() if k != "output"}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="sao", help="sao (default) or grpo (the two learning tests)")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=None, help="default: the learning test's")
    parser.add_argument("--batch-size", type=int, default=32, help="episodes per step (the learning test's: 32)")
    parser.add_argument("--group-size", type=int, default=None, help="default: 4 for sao (unused), 8 for grpo")
    parser.add_argument("--policy-lr", type=float, default=None, help="default: the learning test's")
    parser.add_argument("--critic-lr", type=float, default=None, help="default: the learning test's")
    parser.add_argument("--critic-warmup", type=int, default=None, help="default: the learning test's")
    parser.add_argument("--sft-steps", type=int, default=240, help="the warm start's SFT steps (the test's: 240)")
    parser.add_argument("--lora-rank", type=int, default=0, help="the policy's LoRA rank (0: full; alpha 2 x rank, "
                                                                 "all linear layers)")
    parser.add_argument("--critic-lora-rank", type=int, default=0, help="SAO's critic body's LoRA rank (0: full)")
    parser.add_argument("--dip-below", type=float, default=0.10)
    parser.add_argument("--output", default="local_outputs/bench/learning_runs")
    args = parser.parse_args(argv)
    if args.method not in LEARNING_TEST:
        parser.error(f"--method must be one of {', '.join(LEARNING_TEST)}")
    # Torch's default threads, as in the tests (bench/_setup.py's one thread per process would measure another
    # schedule than the one the learning test runs).
    defaults = LEARNING_TEST[args.method]
    args.steps = args.steps or defaults["steps"]
    args.group_size = args.group_size or defaults["group_size"]
    args.policy_lr = args.policy_lr or defaults["policy_lr"]
    args.critic_lr = args.critic_lr or defaults["critic_lr"]
    args.critic_warmup = defaults["critic_warmup_steps"] if args.critic_warmup is None else args.critic_warmup
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    cache = out / "cache"
    model, data = warm_start(out, cache, args.sft_steps), rl_data(out)
    runs = []
    for seed in range(args.first_seed, args.first_seed + args.runs):
        run = one_run(args, seed, model, data, cache, out / f"seed-{seed}")
        runs.append(run)
        print(f"seed {seed:3d}: {run['first']:.3f} -> {run['last']:.3f} rise {run['rise']:+.3f} "
              f"cut share by quarter {run['quarters']['turn_cut_share']} {'DIP' if run['dip'] else ''} "
              f"({run['seconds']:.0f} s, load {run['load_average'][0]:.1f})", flush=True)
        (out / "learning_runs.json").write_text(json.dumps({"summary": summarise(runs, args), "runs": runs},
                                                            indent=2) + "\n")
    summary = summarise(runs, args)
    print(json.dumps({k: v for k, v in summary.items() if k != "settings"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
