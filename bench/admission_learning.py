"""Does an admission rule change what SAO learns? The same SAO run under `window`, `version_order`, `no_drop` and
`fragments` (rollout/admission.py), several seeds each, with held-out greedy and sampled rewards on one fixed set
(README "Admission").

Task: the learning tests' (tool_arith with one calculator call, two turns; `--p-more` / `--max-ops` for longer
chains) with a log-normal tool latency (median 0.05 s, sigma 1.0), so episodes differ in time and the rules differ
in how old their tokens are and in what they drop. Warm start: the learning tests' early-stopped SFT, from which
SAO measurably learns in 150 steps (on chains of 1 + Geometric(0.5) <= 4 calls from async_vs_sync's warm start
the held-out reward stayed flat, 0.42-0.48, under every rule: no signal to compare). Each run: the learning test's SAO settings (bench/learning_runs.py
LEARNING_TEST: lr 2e-4 cosine, 20 critic warm-up steps) for `--steps` steps of B = 32, S = `--max-staleness`,
(S + 1)·B in flight, held-out evaluation (64 prompts of another seed, one greedy and one sampled answer each) at
steps 0, `--eval-every`, ... and the last. Per rule: the held-out rewards at the end (mean over seeds and its
standard error), the batch-reward rise, the token lag (p99, share beyond S) and the length ratio of what was
trained. Writes OUTPUT/admission_learning.json.

    .venv/bin/python bench/admission_learning.py --seeds 3 --output local_outputs/bench/admission_learning

Runs go `--parallel` at a time (default 2, one per core).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

RULES = ("window", "version_order", "no_drop", "fragments")


def _prepare(root: Path, args) -> tuple[str, str, str]:
    """(warm-start model, RL prompts, held-out prompts), made once under `root`."""
    import _setup

    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.envs.tool_arith import tool_arith_tasks
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    cache = _setup.default_cache_dir()
    model = root / f"sft-{args.sft_steps}-p{args.p_more}-{args.max_ops}" / "model"
    if args.model:
        model = Path(args.model)
    elif args.warm_start == "learning_test":
        from learning_runs import warm_start

        model = Path(warm_start(root, Path(cache)))
    elif args.warm_start == "bench":
        # async_vs_sync's warm start: 800 SFT steps on solved chains of 1 + Geometric(0.4) <= 8 calls (cached)
        model = Path(_setup.warm_start(Path(cache) / "bench-warm", sft_steps=800, seed=0, p_more=0.4,
                                       max_tokens=256))
    if not model.exists():
        data = root / "sft-data"
        data.mkdir(parents=True, exist_ok=True)
        (data / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(
            800, seed=5, p_more=args.p_more, max_ops=args.max_ops)))
        train("sft", SFTConfig(data=str(data), output=str(model.parent), steps=args.sft_steps, batch_size=16,
                               lr=3e-3, max_tokens=256, cache_dir=cache))
    rl = _setup.write_rl_data(root / "rl", tool_arith_tasks(4000, seed=3, p_more=args.p_more, max_ops=args.max_ops))
    held_out = _setup.write_rl_data(root / "held-out", tool_arith_tasks(64, seed=977, p_more=args.p_more,
                                                                         max_ops=args.max_ops))
    return str(model), rl, held_out


def one_run(rule: str, seed: int, model: str, data: str, held_out: str, out: str, args_dict: dict) -> dict:
    import _setup  # noqa: F401  (thread environment before torch)
    from learning_runs import first_and_last, learning_config

    from sao_core.learner.config import RLConfig  # noqa: F401
    from sao_core.learner.journal import audit
    from sao_core.learner.loop import train_rl

    args = argparse.Namespace(**args_dict)
    began = time.time()
    config = learning_config(
        "sao", data, model, out, _setup.default_cache_dir(), seed=seed, steps=args.steps, admission=rule,
        max_staleness=args.max_staleness, max_new_tokens_per_turn=32, max_total_tokens=args.max_total_tokens,
        eval_every=args.eval_every, eval_data=held_out, eval_samples=1, eval_greedy=True,
        env_options={"tool_arith": {"latency_median_s": 0.05, "latency_sigma": 1.0}})
    summary = train_rl(config)
    rows = [json.loads(x) for x in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    first, last = first_and_last([r for r in rows if "reward_mean" in r])
    evals = [r for r in rows if "eval_greedy_reward" in r]
    lags: dict[int, int] = {}
    for r in rows:
        for k, n in r.get("token_lag", {}).items():
            lags[int(k)] = lags.get(int(k), 0) + n
    total = sum(lags.values())
    ordered = sorted(lags)
    running, p99 = 0, 0
    for k in ordered:
        running += lags[k]
        if running >= 0.99 * total:
            p99 = k
            break
    trained = [r for r in rows if "trained_turns_mean" in r and r["trained_turns_mean"] is not None]
    report = audit(out)
    return {"rule": rule, "seed": seed, "seconds": round(time.time() - began, 1), "reward_first": round(first, 4),
            "reward_last": round(last, 4), "rise": round(last - first, 4),
            "eval": [{"step": r["step"], "greedy": r["eval_greedy_reward"], "sampled": r.get("eval_sampled_reward")}
                     for r in evals],
            "eval_greedy_last": evals[-1]["eval_greedy_reward"] if evals else None,
            "eval_sampled_last": evals[-1].get("eval_sampled_reward") if evals else None,
            "token_lag_p99": p99, "token_lag_max": max(ordered, default=0),
            "tokens_beyond_bound": sum(n for k, n in lags.items() if k > args.max_staleness) / max(total, 1),
            "dropped": summary["dropped"], "dropped_by_reason": summary["dropped_by_reason"],
            "trained_turns_mean": statistics.mean(r["trained_turns_mean"] for r in trained) if trained else None,
            "arrived_turns_mean": summary["length_bias"].get("arrived_turns_mean"),
            "fragments": sum(r.get("fragments", 0) for r in rows), "audit_ok": report["ok"]}


def _mean_se(values: list[float]) -> tuple[float, float]:
    mean = statistics.mean(values)
    se = statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0
    return round(mean, 4), round(se, 4)


def summarise(runs: list[dict]) -> dict:
    out = {}
    for rule in RULES:
        mine = [r for r in runs if r["rule"] == rule]
        if not mine:
            continue
        row = {"runs": len(mine)}
        for key in ("eval_greedy_last", "eval_sampled_last", "rise", "reward_last", "tokens_beyond_bound",
                    "trained_turns_mean"):
            values = [r[key] for r in mine if r[key] is not None]
            if values:
                row[key], row[key + "_se"] = _mean_se(values)
        row["token_lag_p99_max"] = max(r["token_lag_p99"] for r in mine)
        row["dropped"] = sum(r["dropped"] for r in mine)
        row["fragments"] = sum(r["fragments"] for r in mine)
        row["audit_ok"] = all(r["audit_ok"] for r in mine)
        out[rule] = row
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default=",".join(RULES))
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--first-seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--p-more", type=float, default=1.0, help="tasks: 1 + Geometric(p) calls (1.0: one call)")
    parser.add_argument("--max-ops", type=int, default=1)
    parser.add_argument("--max-total-tokens", type=int, default=512)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--sft-steps", type=int, default=240, help="with --warm-start own")
    parser.add_argument("--warm-start", default="learning_test", choices=["learning_test", "bench", "own"],
                        help="learning_test: the learning tests' early-stopped SFT (single calls; SAO rises about "
                             "+0.14 in 150 steps from it); bench: async_vs_sync's (800 SFT steps on 1 + "
                             "Geometric(0.4) <= 8 calls: no measurable learning in 150 steps, reward flat at 0.37-0.40); "
                             "own: --sft-steps on this task's distribution")
    parser.add_argument("--model", default="", help="start from this model instead")
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--output", default="local_outputs/bench/admission_learning")
    args = parser.parse_args(argv)
    rules = [r for r in args.rules.split(",") if r]
    bad = set(rules) - set(RULES)
    if bad:
        parser.error(f"unknown rules {sorted(bad)}; choose from {', '.join(RULES)}")
    root = Path(args.output).resolve()
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model, data, held_out = _prepare(root, args)
    print(f"{time.time() - started:6.0f}s warm start and data ready", flush=True)
    jobs = [(rule, seed) for seed in range(args.first_seed, args.first_seed + args.seeds) for rule in rules]
    runs = []
    # spawn: each run in a fresh interpreter (this one has torch and its threads loaded already)
    with ProcessPoolExecutor(max_workers=args.parallel, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(one_run, rule, seed, model, data, held_out, str(root / f"{rule}-s{seed}"),
                               vars(args)): (rule, seed) for rule, seed in jobs}
        for future in futures:
            r = future.result()
            runs.append(r)
            print(f"{time.time() - started:6.0f}s {r['rule']:14s} seed {r['seed']}: held-out greedy "
                  f"{r['eval_greedy_last']}, sampled {r['eval_sampled_last']}, rise {r['rise']:+.3f}, lag p99 "
                  f"{r['token_lag_p99']}, beyond S {r['tokens_beyond_bound']:.3f}, dropped {r['dropped']}, "
                  f"fragments {r['fragments']}, {r['seconds']:.0f} s", flush=True)
            (root / "admission_learning.json").write_text(json.dumps(
                {"settings": vars(args), "runs": runs, "summary": summarise(runs)}, indent=2) + "\n")
    summary = summarise(runs)
    (root / "admission_learning.json").write_text(json.dumps({"settings": vars(args), "runs": runs,
                                                              "summary": summary,
                                                              "seconds": round(time.time() - started)}, indent=2)
                                                  + "\n")
    for rule, row in summary.items():
        print(f"{rule:14s} held-out greedy {row.get('eval_greedy_last')} ± {row.get('eval_greedy_last_se')}, sampled "
              f"{row.get('eval_sampled_last')} ± {row.get('eval_sampled_last_se')}, rise {row.get('rise')} ± "
              f"{row.get('rise_se')}, beyond S {row.get('tokens_beyond_bound')}, dropped {row['dropped']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
