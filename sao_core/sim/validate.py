"""How far to trust the simulator, two ways: (a) `predict_measured` feeds it the stage costs a
bench/async_vs_sync.py run measured (engine seconds per step and per encoded position, learner seconds per
step, weight-push seconds, service time per turn, token counts, the tail's distributions) and compares the
predicted with the measured trajectories/s of every learner arm; (b) `run_anchors` reconstructs published
async-vs-sync speed-ups (AReaL, verl fully async, ROLL Flash) from their stated settings plus our assumptions
(both kept in `ANCHORS`, chosen before simulating, not fitted). Rates in trajectories/s, times in seconds."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from sao_core.sim.model import SimConfig, SimError, Workload, engine_params, simulate


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y = a + b x; slope >= 0, intercept >= 0."""
    if len(points) == 1 or len({x for x, _ in points}) == 1:
        x, y = points[0]
        return 0.0, y / x if x else 0.0
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx)
    a = my - b * mx
    if a < 0:
        return 0.0, sum(x * y for x, y in points) / sum(x * x for x, _ in points)
    return a, b


def _fit_engine(arms: dict) -> tuple[str, float, float, float]:
    """(mode, step_overhead_s, step_per_row_s, step_per_position_s) from the engine activity of the arms:
    busy seconds = a x steps + c x encoded positions (HF engine: no KV cache, left padding), or, without
    position counts (vLLM), seconds per step = a + b x rows per step."""
    engines = [r["engine"] for r in arms.values() if r.get("engine", {}).get("steps")]
    if not engines:   # no step counts (the vLLM engine): a compute-bound engine, a fixed cost per sampled token
        engines = [r["engine"] for r in arms.values() if r.get("engine", {}).get("tokens")]
        return "kv", 0.0, sum(e["busy_s"] for e in engines) / sum(e["tokens"] for e in engines), 0.0
    if all(e.get("positions") for e in engines):
        # least squares through the origin in two variables
        sxx = sum(e["steps"] ** 2 for e in engines)
        syy = sum(e["positions"] ** 2 for e in engines)
        sxy = sum(e["steps"] * e["positions"] for e in engines)
        sxb = sum(e["steps"] * e["busy_s"] for e in engines)
        syb = sum(e["positions"] * e["busy_s"] for e in engines)
        det = sxx * syy - sxy * sxy
        a, c = ((syy * sxb - sxy * syb) / det, (sxx * syb - sxy * sxb) / det) if det else (0.0, 0.0)
        if a < 0 or c <= 0:   # degenerate: all cost per position
            a, c = 0.0, sum(e["busy_s"] for e in engines) / sum(e["positions"] for e in engines)
        return "recompute", a, 0.0, c
    a, b = _fit_line([(e["rows_per_step"], e["step_s"]) for e in engines])
    return "kv", a, b, 0.0



def _shape_from_trajectories(path: Path) -> dict:
    """Prompt tokens (intercept and per turn), observation tokens per tool call and action tokens per turn of
    recorded trajectories (a gen_only run's trajectories.jsonl)."""
    turns, prompts, obs, actions = [], [], [], []
    for line in Path(path).read_text().splitlines():
        t = json.loads(line)
        first = t["action_mask"].index(1) if 1 in t["action_mask"] else len(t["action_mask"])
        n = t["num_turns"]
        act = sum(t["action_mask"])
        turns.append(n)
        prompts.append(first)
        actions.append(act / max(1, n))
        if n > 1:
            obs.append((len(t["token_ids"]) - first - act) / (n - 1))
    p0, p1 = _fit_line(list(zip(turns, prompts, strict=True))) if len(set(turns)) > 1 else (statistics.mean(prompts), 0)
    return {"prompt_tokens": p0, "prompt_tokens_per_turn": p1,
            "observation_tokens_per_turn": statistics.mean(obs) if obs else 8.0,
            "action_tokens_per_turn": statistics.mean(actions)}



def _arm_profile(r: dict) -> dict:
    """What one measured learner arm says about its stages: service time per turn outside the engine and the
    tools (from the trajectories' timings), padded tokens of each trained batch, learner seconds per step."""
    batches = [json.loads(p.read_text())["trajectories"]
               for p in sorted((Path(r["run_dir"]) / "run" / "journal").glob("step-*.json"))]
    overhead = [max(0.0, (t["timings"]["finished"] - t["timings"]["started"]) - t["timings"]["generation_seconds"]
                    - t["timings"]["tool_seconds"]) / max(1, t["num_turns"]) for b in batches for t in b]
    padded = [len(b) * max(len(t["token_ids"]) for t in b) for b in batches]
    return {"turn_overhead_s": statistics.mean(overhead) if overhead else 0.0, "padded_tokens_per_step": padded}


def predict_measured(measured: dict, calibrate_arms: bool = True) -> dict:
    """Simulate every learner arm of a bench/async_vs_sync.py result from the stage costs it measured, and
    compare the predicted with the measured trajectories/s.

    Inputs: the engine's cost per step and per encoded position (fitted to the engine's busy seconds, steps and
    positions over the tail's arms; with `calibrate_arms` scaled to each arm's own engine speed, which CPU
    contention changes from arm to arm), the learner's seconds per step (the train-only replay's seconds per
    padded token, scaled to the arm's own update seconds with `calibrate_arms`), weight-push seconds, the
    service's time per turn outside the engine and the tools, the tail's turn and tool-latency distribution,
    and the prompt / action / observation token counts of the gen_only run. The pipeline (barriers, overlap,
    admission, staleness drops) is the simulator's own."""
    if not isinstance(measured, dict) or not {"settings", "tails"} <= set(measured):
        raise SimError("not a bench/async_vs_sync.py result (expected the keys 'settings' and 'tails')")
    out = [row for tail in measured["tails"] for row in _predict_tail(measured["settings"], tail, calibrate_arms)]
    return {"calibrate_arms": calibrate_arms, "rows": out,
            "mean_abs_error": statistics.mean(abs(r["error"]) for r in out) if out else None,
            "mean_abs_error_e2e": statistics.mean(abs(r["error_e2e"]) for r in out) if out else None}


def _predict_tail(s: dict, tail: dict, calibrate_arms: bool) -> list[dict]:
    """The prediction rows of one tail's learner arms (none when its arms recorded no engine tokens);
    `s` is the result's settings."""
    arms = tail["arms"]
    if not any(r.get("engine", {}).get("tokens") for r in arms.values()):
        return []
    engine = _fit_engine(arms)
    gen = arms.get("gen_only")
    shape = {}
    if gen and (Path(gen["run_dir"]) / "trajectories.jsonl").exists():
        shape = _shape_from_trajectories(Path(gen["run_dir"]) / "trajectories.jsonl")
    train_fit = {}
    for method in ("sao", "grpo"):
        replay = arms.get(f"train_only_{method}")
        if replay and replay.get("padded_tokens_per_step"):
            train_fit[method] = _fit_line(list(zip(replay["padded_tokens_per_step"], replay["step_s"], strict=True)))
    rows = []
    for name, r in arms.items():
        fit = _learner_fit(s, name, r, train_fit)
        if fit is not None:
            rows.append(_predict_arm(s, tail, name, r, engine, shape, fit, calibrate_arms))
    return rows


def _learner_fit(s: dict, name: str, r: dict, train_fit: dict) -> tuple[float, float] | None:
    """The learner's (seconds per step, seconds per padded token) for a learner arm the simulator can model;
    None for the other arms."""
    method = r.get("method")
    if not method or name.startswith("train_only"):
        return None
    # The simulator models the window rule at the run's staleness bound only.
    if r.get("admission", "window") != "window" or r.get("max_staleness", s["max_staleness"]) != s["max_staleness"]:
        return None
    return train_fit.get("sao" if method == "sao" else "grpo")


def _arm_scales(r: dict, profile: dict, engine: tuple[str, float, float, float], fit: tuple[float, float],
                push: float) -> tuple[float, float]:
    """(engine_scale, learner_scale): the arm's measured engine busy seconds and update seconds (weight push
    excluded) over what the fitted costs predict for it."""
    mode, a, b, c = engine
    e = r["engine"]
    modelled = a * e["steps"] + (c * e.get("positions", 0) if mode == "recompute" else b * e["tokens"])
    engine_scale = e["busy_s"] / modelled if modelled > 0 else 1.0
    predicted_train = sum(fit[0] + fit[1] * x for x in profile["padded_tokens_per_step"])
    measured_train = sum(r["step_update_s"]) - push * len(r["step_update_s"])
    learner_scale = measured_train / predicted_train if predicted_train > 0 else 1.0
    return engine_scale, learner_scale


def _predict_arm(s: dict, tail: dict, name: str, r: dict, engine: tuple[str, float, float, float], shape: dict,
                 fit: tuple[float, float], calibrate_arms: bool) -> dict:
    """Simulate one learner arm five times (seeds s["seed"] + 0..4); its row of predicted against measured
    trajectories/s, idle share and staleness, with the inputs used."""
    mode, a, b, c = engine
    t = tail["tail_settings"]
    method = r["method"]
    profile = _arm_profile(r)
    push = r.get("weight_push_s_mean", 0.0)
    engine_scale, learner_scale = _arm_scales(r, profile, engine, fit, push) if calibrate_arms else (1.0, 1.0)
    workload = Workload(turns_p_more=t["p_more"], min_turns=2, max_turns=t["max_ops"] + 1,
                        tool_median_s=t["latency_median_s"], tool_sigma=t["latency_sigma"],
                        turn_overhead_s=profile["turn_overhead_s"], **shape)
    group = s["group_size"] if method in ("grpo", "grpo_async") else 1
    slope = fit[1] * learner_scale
    cfg = SimConfig(method="sync" if method == "grpo" else "async", batch_size=s["batch_size"],
                    group_size=group, max_staleness=s["max_staleness"], in_flight=r["in_flight"],
                    engine_mode=mode, step_overhead_s=a * engine_scale, step_per_row_s=b * engine_scale,
                    step_per_position_s=c * engine_scale, max_batch=s["max_batch"],
                    train_tokens_per_s_per_gpu=1.0 / slope if slope else 1e12,
                    train_step_overhead_s=fit[0] * learner_scale, push_s=push,
                    trajectories=r["trajectories"], seed=s["seed"])
    runs = [simulate(SimConfig(**{**asdict(cfg), "seed": cfg.seed + k}), workload) for k in range(5)]
    predicted = statistics.mean(x["steady_trajectories_per_s"] for x in runs)
    measured_rate = r["steady"]["trajectories_per_s"] if "steady" in r else r["trajectories_per_s"]
    predicted_e2e = statistics.mean(x["trajectories_per_s"] for x in runs)
    return {"tail": tail["tail"], "arm": name, "measured": measured_rate,
            "predicted": predicted, "error": predicted / measured_rate - 1.0,
            "measured_e2e": r["trajectories_per_s"], "predicted_e2e": predicted_e2e,
            "error_e2e": predicted_e2e / r["trajectories_per_s"] - 1.0,
            "predicted_idle": statistics.mean(x["rollout_idle_share"] for x in runs),
            "measured_idle": r.get("generator_idle_share"),
            "predicted_staleness": statistics.mean(x["staleness_mean"] for x in runs),
            "measured_staleness": r.get("staleness_mean"),
            "inputs": {"engine_mode": mode, "step_overhead_s": cfg.step_overhead_s,
                       "step_per_row_s": cfg.step_per_row_s,
                       "step_per_position_s": cfg.step_per_position_s, "engine_scale": engine_scale,
                       "train_fit": fit, "learner_scale": learner_scale, "push_s": push,
                       "turn_overhead_s": profile["turn_overhead_s"], **shape}}


# Published anchors, reconstructed. "stated" is what the source says; everything in "assumed" is our reading or
# guess (model speeds, length distributions, batch and GPU splits), chosen before simulating, not fitted.
_GPU = {"decode_tokens_per_s": 4000, "seq_tokens_per_s": 35, "max_batch": 256}   # assumed: a 7B model on one GPU
#: assumed: the engine and training speeds of every anchor (a 7B model), 4 steps simulated
_SPEEDS = {"engine": _GPU, "train_tokens_per_s_per_gpu": 6000, "padded": False, "push_s": 10, "steps": 4}


def _same_gpus(rollout_gpus: int, train_gpus: int, prompts: int, group_size: int, max_staleness: int) -> dict:
    """An anchor's "sync" and "async" runs on the same GPUs (sync colocated on all of them, async split into
    `rollout_gpus` + `train_gpus`), `prompts` x `group_size` trajectories a step."""
    shared = {"rollout_gpus": rollout_gpus, "train_gpus": train_gpus, "batch_size": prompts * group_size,
              "group_size": group_size}
    return {"sync": {**shared, "colocated": True}, "async": {**shared, "max_staleness": max_staleness}}


def _reasoning(median_tokens: int, sigma: float, cap_tokens: int) -> dict:
    """The workload of single-turn reasoning RL: one log-normal response (median and cap in tokens), no tools."""
    return {"workload": {"turns_p_more": 1.0, "max_turns": 1, "action_tokens_per_turn": median_tokens,
                         "action_tokens_sigma": sigma, "prompt_tokens": 300, "tool_median_s": 0, "tool_sigma": 0},
            "cap_tokens": cap_tokens}


ANCHORS = {
    "AReaL (math reasoning, async vs sync, same GPUs)": {
        "published": 2.77,
        "stated": "fully asynchronous RL vs synchronous RL with the same number of GPUs, up to 2.77x; long-tailed "
                  "response lengths of reasoning models; bounded staleness",
        "assumed": "7B model; responses log-normal, median 4k tokens, sigma 0.8, capped at 32k (one turn, no "
                   "tools); batch 512 prompts x 16; sync colocated on 64 GPUs; async 48 rollout + 16 training "
                   "GPUs, staleness 4; decode 35 tok/s per sequence, 4,000 tok/s per GPU at 256 rows; training "
                   "6,000 tok/s per GPU, no padding (packed); push 10 s",
        **_reasoning(median_tokens=4000, sigma=0.8, cap_tokens=32768),
        **_same_gpus(rollout_gpus=48, train_gpus=16, prompts=512, group_size=16, max_staleness=4),
        **_SPEEDS,
    },
    "verl fully async (Qwen2.5-7B, 128 GPUs)": {
        "published": 2.5,     # 2.35-2.67
        "stated": "Qwen2.5-7B on 128 GPUs, fully asynchronous trainer and rollouter (streaming, staleness-bounded, "
                  "partial rollouts) vs the colocated synchronous trainer: 2.35x-2.67x",
        "assumed": "DAPO-style math; responses log-normal, median 3k tokens, sigma 0.9, capped at 20k; batch 512 "
                   "prompts x 16; sync colocated on 128 GPUs; async 96 rollout + 32 training GPUs, staleness 1; "
                   "same engine and training speeds as above",
        **_reasoning(median_tokens=3000, sigma=0.9, cap_tokens=20480),
        **_same_gpus(rollout_gpus=96, train_gpus=32, prompts=512, group_size=16, max_staleness=1),
        **_SPEEDS,
    },
    "ROLL Flash (agentic, multi-turn)": {
        "published": 2.72,
        "stated": "agentic tasks with environment interaction, asynchronous vs synchronous with the same GPU "
                  "budget: up to 2.72x",
        "assumed": "turns 1 + Geometric(0.15) <= 30, 300 action tokens per turn (log-normal sigma 0.5), 400 "
                   "observation tokens per turn; environment seconds log-normal median 5 s, sigma 1.0; batch 128 "
                   "prompts x 8; sync colocated on 64 GPUs; async 32 rollout + 32 training GPUs, staleness 2; same "
                   "engine and training speeds as above",
        "workload": {"turns_p_more": 0.15, "max_turns": 30, "action_tokens_per_turn": 300, "action_tokens_sigma": 0.5,
                     "observation_tokens_per_turn": 400, "prompt_tokens": 1000, "tool_median_s": 5.0,
                     "tool_sigma": 1.0},
        **_same_gpus(rollout_gpus=32, train_gpus=32, prompts=128, group_size=8, max_staleness=2),
        **_SPEEDS,
    },
}


class _CappedWorkload(Workload):
    """Single-turn responses with a hard length cap in tokens (the max response length of reasoning RL)."""

    cap_tokens: int = 0

    def draw(self, rng, turns):
        episode = super().draw(rng, turns)
        if self.cap_tokens:
            episode.action_tokens = [min(t, self.cap_tokens) for t in episode.action_tokens]
            episode.tokens = round(self.prompt_tokens + sum(episode.action_tokens) +
                                   self.observation_tokens_per_turn * (len(episode.action_tokens) - 1))
        return episode


def run_anchors(seeds: int = 3, scale: int = 1) -> list[dict]:
    """Simulate every anchor (sync and async, `seeds` runs each). `scale` > 1 divides batch sizes and GPU
    counts by it (same load per GPU, faster; for tests)."""
    rows = []
    for name, spec in ANCHORS.items():
        workload = _CappedWorkload(**spec["workload"])
        workload.cap_tokens = spec.get("cap_tokens", 0)
        e = spec["engine"]
        a, b = engine_params(e["decode_tokens_per_s"], e["seq_tokens_per_s"], e["max_batch"])
        results = {}
        for method in ("sync", "async"):
            setting = dict(spec[method])
            for key in ("rollout_gpus", "train_gpus"):
                setting[key] = max(1, setting[key] // scale)
            setting["batch_size"] = max(setting["group_size"], setting["batch_size"] // scale)
            common = {"step_overhead_s": a, "step_per_row_s": b, "max_batch": e["max_batch"],
                      "train_tokens_per_s_per_gpu": spec["train_tokens_per_s_per_gpu"], "padded": spec["padded"],
                      "push_s": spec["push_s"], "trajectories": spec["steps"] * setting["batch_size"]}
            runs = [simulate(SimConfig(method=method, seed=k, **common, **setting), workload) for k in range(seeds)]
            results[method] = {key: statistics.mean(r[key] for r in runs) for key in
                               ("trajectories_per_s", "steady_trajectories_per_s", "rollout_idle_share",
                                "rollout_utilisation",
                                "train_idle_share", "gpu_hours_per_1000", "staleness_mean", "dropped")}
        speedup = results["async"]["steady_trajectories_per_s"] / results["sync"]["steady_trajectories_per_s"]
        rows.append({"anchor": name, "published": spec["published"], "predicted": speedup,
                     "predicted_e2e": results["async"]["trajectories_per_s"] / results["sync"]["trajectories_per_s"],
                     "error": speedup / spec["published"] - 1.0, "stated": spec["stated"],
                     "assumed": spec["assumed"], "sync": results["sync"], "async": results["async"]})
    return rows

