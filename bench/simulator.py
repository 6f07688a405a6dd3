"""A discrete-event simulator of RL post-training on a cluster: synchronous GRPO (groups of G, a barrier per
batch) against asynchronous training (SAO: one rollout per prompt; async GRPO: groups) with a staleness bound.

Model
- Rollout engines (one per rollout GPU). An engine decodes its active sequences in steps: one token per
  sequence per step for up to `max_batch` sequences (round robin beyond that). `engine_mode="kv"` (vLLM, GPUs):
  a step takes `step_overhead_s + step_per_row_s * rows`; set them directly or from `decode_tokens_per_s`
  (aggregate at `max_batch` rows) and `seq_tokens_per_s` (one sequence alone). `engine_mode="recompute"` (the
  HF engine: no KV cache, left padding): a step also costs `step_per_position_s` per encoded position, rows x
  the longest context among them, so long and mixed-length contexts slow every row. Episodes go to the least
  loaded engine.
- Episodes: turns of decoding (action tokens) separated by tool calls (seconds); parametric (turns
  min_turns + Geometric(p_more) <= max_turns, log-normal tool time plus a fixed service time per turn, action
  tokens per turn fixed or log-normal, prompt tokens growing with the turns) or empirical (the turns, tokens and
  tool seconds of recorded trajectories, drawn with replacement). The G rollouts of one prompt share its number
  of turns (as with tool_arith's fixed_turns).
- Learner (on `train_gpus`): a step on B trajectories takes `train_step_overhead_s + tokens /
  (train_tokens_per_s_per_gpu * train_gpus)`, tokens padded to the longest trajectory of the batch (as the
  learner's right padding) unless `padded=False`; then `push_s` to publish and load the new weights.
- sync: B episodes (B/G prompts) in flight; the learner waits for all of them, trains and pushes while the
  engines idle; `colocated=True` makes every GPU generate, then every GPU train (the usual sync layout).
- async: up to `in_flight` episodes started and not yet trained (default (S + 1) B); the learner takes the
  first B finished (async GRPO: the first B/G complete groups), dropping those whose first token is more than
  `max_staleness` versions old; slots free when a batch has been trained (as the rollout service counts them).

Outputs: trajectories/s and per hour, trained tokens/s, busy and idle shares per role, rollout utilisation
(tokens decoded / engine capacity: a GPU decoding one sequence is busy but nearly idle), GPU-hours per 1,000
trajectories, mean staleness, drops. `predict_measured` feeds it the inputs measured by
bench/async_vs_sync.py (engine step times, training speed, push seconds, tail settings) and compares the
predicted with the measured trajectories/s; `anchors` reconstructs published async-vs-sync speed-ups
(AReaL, verl fully-async, ROLL Flash) from their stated settings and our assumptions (printed). Reproduce:

    .venv/bin/python bench/simulator.py anchors --output local_outputs/bench/simulator
    .venv/bin/python bench/simulator.py validate local_outputs/bench/async_vs_sync/async_vs_sync.json
    .venv/bin/python bench/simulator.py run --group-size 8 --rollout-gpus 48 --train-gpus 16 --colocated-sync
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import statistics
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass
class Episode:
    """One episode: `action_tokens[k]` decoded in turn k, then `tool_s[k]` seconds of tools (no tool after the
    last turn); `tokens` = all tokens of the finished trajectory (prompt, actions, observations)."""

    action_tokens: list[int]
    tool_s: list[float]
    tokens: int
    prompt_tokens: int = 0                   # the context before the first turn (recompute engines)

    def observation_tokens(self) -> float:
        """Tokens appended after each tool call (the rest of the trajectory, spread evenly)."""
        gaps = len(self.action_tokens) - 1
        return max(0.0, (self.tokens - self.prompt_tokens - sum(self.action_tokens)) / gaps) if gaps else 0.0


@dataclass
class Workload:
    """Parametric episodes (used when `episodes` is empty)."""

    turns_p_more: float = 0.2                  # turns = min_turns + Geometric(p_more), at most max_turns
    min_turns: int = 1
    max_turns: int = 31
    action_tokens_per_turn: float = 12.0
    action_tokens_sigma: float = 0.0           # log-normal spread of the tokens of one turn (0: constant)
    observation_tokens_per_turn: float = 8.0
    prompt_tokens: float = 30.0
    prompt_tokens_per_turn: float = 0.0          # prompts that grow with the task (tool_arith lists every operation)
    tool_median_s: float = 0.1
    tool_sigma: float = 1.2
    turn_overhead_s: float = 0.0                 # service time per turn outside the engine and the tools
    episodes: list[Episode] = field(default_factory=list)   # empirical: drawn with replacement

    def draw_turns(self, rng: random.Random) -> int:
        if self.episodes:
            return -1
        n = self.min_turns
        while n < self.max_turns and rng.random() >= self.turns_p_more:
            n += 1
        return n

    def draw(self, rng: random.Random, turns: int) -> Episode:
        if self.episodes:
            return rng.choice(self.episodes)
        tokens = [max(1, round(self.action_tokens_per_turn * (math.exp(rng.gauss(0, self.action_tokens_sigma))
                                                              if self.action_tokens_sigma else 1.0)))
                  for _ in range(turns)]
        tools = [self.turn_overhead_s + self.tool_median_s * (math.exp(rng.gauss(0, self.tool_sigma))
                                                              if self.tool_sigma else 1.0)
                 for _ in range(turns - 1)]
        prompt = round(self.prompt_tokens + self.prompt_tokens_per_turn * turns)
        total = round(prompt + sum(tokens) + self.observation_tokens_per_turn * (turns - 1))
        return Episode(tokens, tools, total, prompt)


@dataclass
class SimConfig:
    method: str = "async"                      # sync | async
    batch_size: int = 32                       # trajectories per learner step (B)
    group_size: int = 1                        # G: 1 for SAO; > 1 for GRPO (sync or async)
    max_staleness: int = 4
    in_flight: int = 0                         # 0: sync B, async (S + 1) B
    rollout_gpus: int = 1
    train_gpus: int = 1
    colocated: bool = False                    # sync only: all GPUs generate, then all GPUs train
    engine_mode: str = "kv"                    # kv: a step costs overhead + per-row; recompute: + per encoded position
    step_overhead_s: float = 0.02              # engine decode step: overhead + per-row cost
    step_per_row_s: float = 0.0001
    step_per_position_s: float = 0.0           # recompute (no KV cache, left padding): per row x padded width
    max_batch: int = 256
    train_tokens_per_s_per_gpu: float = 5000.0
    train_step_overhead_s: float = 0.0
    padded: bool = True
    push_s: float = 0.0
    trajectories: int = 1024                   # trained trajectories to simulate
    seed: int = 0

    @property
    def cap(self) -> int:
        if self.in_flight:
            return self.in_flight
        return self.batch_size if self.method == "sync" else (self.max_staleness + 1) * self.batch_size

    def validate(self) -> None:
        if self.method not in ("sync", "async"):
            raise ValueError(f"method must be sync or async, got {self.method!r}")
        if self.batch_size % self.group_size:
            raise ValueError("batch_size must be a multiple of group_size")
        if self.cap < self.batch_size:
            raise ValueError("in_flight must be >= batch_size")
        if self.colocated and self.method != "sync":
            raise ValueError("colocated applies to sync only")
        if self.engine_mode not in ("kv", "recompute"):
            raise ValueError(f"engine_mode must be kv or recompute, got {self.engine_mode!r}")


def engine_params(decode_tokens_per_s: float, seq_tokens_per_s: float, max_batch: int) -> tuple[float, float]:
    """(step_overhead_s, step_per_row_s) from the aggregate rate at max_batch rows and one sequence's rate."""
    # 1 / seq = a + b ; max_batch / decode = a + b * max_batch
    one, full = 1.0 / seq_tokens_per_s, max_batch / decode_tokens_per_s
    if max_batch == 1:
        return one, 0.0
    b = max(0.0, (full - one) / (max_batch - 1))
    return max(0.0, one - b), b


class _Engine:
    def __init__(self, a: float, b: float, max_batch: int):
        self.a, self.b, self.max_batch = a, b, max_batch
        self.service = 0.0                     # tokens delivered so far to every sequence active throughout
        self.heap: list[tuple[float, int]] = []
        self.busy_s = 0.0
        self.tokens = 0.0
        self.active: list[int] = []            # recompute mode: decoding sequences in round-robin order
        self.stepping: list[int] | None = None
        self.kicked = False

    def rate(self) -> float:
        n = len(self.heap)
        if n == 0:
            return 0.0
        rows = min(n, self.max_batch)
        return rows / (n * (self.a + self.b * rows))


def simulate(cfg: SimConfig, workload: Workload) -> dict:
    """Run the simulation until `cfg.trajectories` trajectories are trained; return the metrics."""
    cfg.validate()
    rng = random.Random(cfg.seed)
    gpus_gen = cfg.rollout_gpus + (cfg.train_gpus if cfg.colocated else 0)
    engines = [_Engine(cfg.step_overhead_s, cfg.step_per_row_s, cfg.max_batch) for _ in range(gpus_gen)]
    train_gpus = cfg.train_gpus + (cfg.rollout_gpus if cfg.colocated else 0)
    now = 0.0
    timed: list[tuple[float, int, str, int]] = []   # (time, tiebreak, kind, id)
    counter = 0
    episodes: dict[int, dict] = {}
    next_id = 0
    in_flight = 0
    prompt = 0
    ready: dict[int, None] = {}                       # finished, not yet taken, in finishing order
    learner_busy_until = None
    learner = {"version": 0, "engine_version": 0, "busy_s": 0.0, "wait_s": 0.0, "trained": 0, "tokens": 0,
               "staleness": [], "dropped": 0, "steps": 0, "train_s": 0.0, "push_s": 0.0, "step_end": []}
    paused = False
    finished_at = None

    def schedule(t: float, kind: str, ident: int) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(timed, (t, counter, kind, ident))

    recompute = cfg.engine_mode == "recompute"

    def start_decode(eid: int) -> None:
        ep = episodes[eid]
        engine = engines[ep["engine"]]
        if not recompute:
            heapq.heappush(engine.heap, (engine.service + ep["episode"].action_tokens[ep["turn"]], eid))
            return
        if ep["turn"] == 0:
            ep["context"] = ep["episode"].prompt_tokens
        else:
            ep["context"] += ep["episode"].observation_tokens()
        ep["left"] = ep["episode"].action_tokens[ep["turn"]]
        engine.active.append(eid)
        kick(ep["engine"])

    def kick(index: int) -> None:
        """Start a step at this instant, after every arrival of the same instant (as the engine thread takes its
        whole inbox at the start of a step)."""
        engine = engines[index]
        if engine.stepping is None and not engine.kicked and not paused:
            engine.kicked = True
            schedule(now, "kick", index)

    def start_step(index: int) -> None:
        """Recompute engine (the HF engine): one step samples a token for each of up to max_batch sequences,
        re-encoding their left-padded contexts; the others wait their turn (round robin)."""
        engine = engines[index]
        batch = engine.active[:cfg.max_batch]
        if not batch:
            engine.stepping = None
            return
        engine.active = engine.active[cfg.max_batch:] + batch
        width = max(episodes[e]["context"] for e in batch)
        seconds = cfg.step_overhead_s + len(batch) * (cfg.step_per_row_s + cfg.step_per_position_s * width)
        engine.busy_s += seconds
        engine.tokens += len(batch)
        engine.stepping = batch
        schedule(now + seconds, "step", index)

    def finish_turn(eid: int) -> None:
        ep = episodes[eid]
        if ep["turn"] == len(ep["episode"].action_tokens) - 1:
            arrive(eid)
            if is_stale(eid) and cfg.group_size == 1:
                drop([eid])
            try_learn()
        else:
            schedule(now + ep["episode"].tool_s[ep["turn"]], "tool", eid)

    def admit() -> None:
        nonlocal in_flight, prompt, next_id
        g = cfg.group_size
        while in_flight + g <= cfg.cap and not paused:
            turns = workload.draw_turns(rng)
            for k in range(g):
                episode = workload.draw(rng, turns)
                engine = min(range(len(engines)), key=lambda e: len(engines[e].heap))
                episodes[next_id] = {"episode": episode, "turn": 0, "engine": engine, "prompt": prompt, "k": k,
                                     "version": learner["engine_version"], "started": now}
                if workload.turn_overhead_s > 0:
                    schedule(now + workload.turn_overhead_s, "begin", next_id)
                else:
                    start_decode(next_id)
                next_id += 1
            in_flight += g
            prompt += 1

    pending_by_prompt: dict[int, list[int]] = {}
    complete: dict[int, None] = {}                   # prompts whose G members are all pending, in order
    scanned_version = [-1]

    def is_stale(e: int) -> bool:
        return cfg.method == "async" and learner["version"] - episodes[e]["version"] > cfg.max_staleness

    def drop(eids: list[int]) -> None:
        for e in eids:
            del ready[e]
            prompt_id = episodes[e]["prompt"]
            members = pending_by_prompt.get(prompt_id)
            if members is not None and e in members:
                members.remove(e)
                complete.pop(prompt_id, None)
            del episodes[e]
        learner["dropped"] += len(eids)
        release(len(eids))

    def arrive(e: int) -> None:
        ready[e] = None
        prompt_id = episodes[e]["prompt"]
        members = pending_by_prompt.setdefault(prompt_id, [])
        members.append(e)
        if len(members) == cfg.group_size:
            complete[prompt_id] = None

    def take_batch() -> list[int] | None:
        # Drop stale trajectories first (all pending members of their group for grouped methods); staleness only
        # changes with the version, so one full scan per version, as the learner's drop_stale at each take.
        if cfg.method == "async" and scanned_version[0] != learner["version"]:
            scanned_version[0] = learner["version"]
            stale = [e for e in ready if is_stale(e)]
            if cfg.group_size > 1:
                prompts = {episodes[e]["prompt"] for e in stale}
                stale = [e for p_ in prompts for e in pending_by_prompt.get(p_, [])]
            if stale:
                drop(stale)
        if cfg.group_size == 1:
            if len(ready) < cfg.batch_size:
                return None
            chosen = list(itertools.islice(ready, cfg.batch_size))
        else:
            if len(complete) * cfg.group_size < cfg.batch_size:
                return None
            prompts = list(itertools.islice(complete, cfg.batch_size // cfg.group_size))
            chosen = [e for p_ in prompts for e in pending_by_prompt[p_]]
            for p_ in prompts:
                del complete[p_]
                del pending_by_prompt[p_]
        for e in chosen:
            del ready[e]
        if cfg.group_size == 1:
            for e in chosen:
                pending_by_prompt.pop(episodes[e]["prompt"], None)
        return chosen

    def release(n: int) -> None:
        nonlocal in_flight
        in_flight -= n
        admit()

    pending_batch: list[int] = []
    wait_since = 0.0

    def try_learn() -> None:
        nonlocal learner_busy_until, pending_batch, paused, wait_since
        if learner_busy_until is not None:
            return
        chosen = take_batch()
        if chosen is None:
            return
        learner["wait_s"] += now - wait_since
        eps = [episodes[e]["episode"] for e in chosen]
        tokens = len(eps) * max(e.tokens for e in eps) if cfg.padded else sum(e.tokens for e in eps)
        train_s = cfg.train_step_overhead_s + tokens / (cfg.train_tokens_per_s_per_gpu * train_gpus)
        learner["staleness"] += [learner["version"] - episodes[e]["version"] for e in chosen]
        learner["train_s"] += train_s
        learner["push_s"] += cfg.push_s
        learner_busy_until = now + train_s + cfg.push_s
        pending_batch = chosen
        if cfg.method == "sync":
            paused = True
        schedule(now + train_s, "trained", 0)
        schedule(learner_busy_until, "pushed", 0)

    admit()
    while finished_at is None:
        # next decode completion over the engines
        best_t, best_engine = math.inf, -1
        for i, engine in enumerate(engines):
            if engine.heap and not paused:
                rate = engine.rate()
                t = now + max(0.0, engine.heap[0][0] - engine.service) / rate
                if t < best_t:
                    best_t, best_engine = t, i
        t_timed = timed[0][0] if timed else math.inf
        t_next = min(best_t, t_timed)
        if t_next == math.inf:
            raise RuntimeError("simulation stalled (nothing in flight and nothing scheduled)")
        dt = t_next - now
        for engine in engines:
            if engine.heap and not paused:
                rate = engine.rate()
                engine.service += rate * dt
                engine.busy_s += dt
                engine.tokens += rate * dt * len(engine.heap)
        now = t_next
        if best_t <= t_timed:
            engine = engines[best_engine]
            _, eid = heapq.heappop(engine.heap)
            finish_turn(eid)
            continue
        _, _, kind, ident = heapq.heappop(timed)
        if kind == "kick":
            engines[ident].kicked = False
            if engines[ident].stepping is None and not paused:
                start_step(ident)
        elif kind == "step":
            engine = engines[ident]
            batch, engine.stepping = engine.stepping, None
            done = []
            for eid in batch:
                ep = episodes[eid]
                ep["context"] += 1
                ep["left"] -= 1
                if ep["left"] <= 0:
                    engine.active.remove(eid)
                    done.append(eid)
            for eid in done:          # after the whole batch is updated
                finish_turn(eid)
            kick(ident)
        elif kind == "begin":
            start_decode(ident)
        elif kind == "tool":
            episodes[ident]["turn"] += 1
            start_decode(ident)
        elif kind == "trained":
            batch = pending_batch
            learner["trained"] += len(batch)
            learner["tokens"] += sum(episodes[e]["episode"].tokens for e in batch)
            learner["steps"] += 1
            learner["step_end"].append(now + cfg.push_s)
            learner["version"] += 1
            for e in batch:
                del episodes[e]
            if learner["trained"] >= cfg.trajectories:
                finished_at = now + cfg.push_s
            release(len(batch))     # acknowledged: the slots free (sync: admitted once resumed)
        elif kind == "pushed":
            learner["engine_version"] = learner["version"]
            learner_busy_until = None
            wait_since = now
            if paused:
                paused = False
                admit()
                for index, engine in enumerate(engines):
                    if recompute and engine.active:
                        kick(index)
            try_learn()
    wall = finished_at
    gen_busy = statistics.mean(e.busy_s for e in engines) / wall
    train_busy = (learner["train_s"] + learner["push_s"]) / wall
    gpus = cfg.rollout_gpus + cfg.train_gpus
    if cfg.colocated:  # every GPU does both jobs in turn
        gen_share = statistics.mean(e.busy_s for e in engines) / wall
        rollout_idle = train_idle = 1.0 - gen_share - train_busy
    else:
        rollout_idle, train_idle = 1.0 - gen_busy, 1.0 - train_busy
    ends, half = learner["step_end"], learner["steps"] // 2
    steady = (cfg.batch_size * (len(ends) - half) / (ends[-1] - ends[half - 1])) if half >= 1 and \
        ends[-1] > ends[half - 1] else learner["trained"] / wall
    utilisation = None
    if not recompute:
        capacity = cfg.max_batch / (cfg.step_overhead_s + cfg.step_per_row_s * cfg.max_batch)   # tokens/s per engine
        utilisation = sum(e.tokens for e in engines) / (capacity * len(engines) * wall)
    return {"config": asdict(cfg), "wall_s": wall, "trained": learner["trained"], "steps": learner["steps"],
            "rollout_utilisation": utilisation,
            "steady_trajectories_per_s": steady,
            "trajectories_per_s": learner["trained"] / wall, "trajectories_per_hour": learner["trained"] / wall * 3600,
            "tokens_per_s": learner["tokens"] / wall, "rollout_busy_share": gen_busy, "rollout_idle_share": rollout_idle,
            "train_busy_share": train_busy, "train_idle_share": train_idle,
            "learner_wait_share": learner["wait_s"] / wall,
            "gpu_hours_per_1000": gpus * wall / 3600 / learner["trained"] * 1000,
            "staleness_mean": statistics.mean(learner["staleness"]) if learner["staleness"] else 0.0,
            "dropped": learner["dropped"]}


# ----------------------------------------------------------------------------------------- validation
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
    s = measured["settings"]
    out = []
    for tail in measured["tails"]:
        arms, t = tail["arms"], tail["tail_settings"]
        if not any(r.get("engine", {}).get("tokens") for r in arms.values()):
            continue
        mode, a, b, c = _fit_engine(arms)
        gen = arms.get("gen_only")
        shape = {}
        if gen and (Path(gen["run_dir"]) / "trajectories.jsonl").exists():
            shape = _shape_from_trajectories(Path(gen["run_dir"]) / "trajectories.jsonl")
        train_fit = {}
        for method in ("sao", "grpo"):
            replay = arms.get(f"train_only_{method}")
            if replay and replay.get("padded_tokens_per_step"):
                train_fit[method] = _fit_line(list(zip(replay["padded_tokens_per_step"], replay["step_s"],
                                                       strict=True)))
        for name, r in arms.items():
            method = r.get("method")
            if not method or name.startswith("train_only"):
                continue
            fit = train_fit.get("sao" if method == "sao" else "grpo")
            if fit is None:
                continue
            profile = _arm_profile(r)
            e = r["engine"]
            engine_scale = learner_scale = 1.0
            push = r.get("weight_push_s_mean", 0.0)
            if calibrate_arms:
                modelled = a * e["steps"] + (c * e.get("positions", 0) if mode == "recompute" else
                                             b * e["tokens"])
                engine_scale = e["busy_s"] / modelled if modelled > 0 else 1.0
                predicted_train = sum(fit[0] + fit[1] * x for x in profile["padded_tokens_per_step"])
                measured_train = sum(r["step_update_s"]) - push * len(r["step_update_s"])
                learner_scale = measured_train / predicted_train if predicted_train > 0 else 1.0
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
            out.append({"tail": tail["tail"], "arm": name, "measured": measured_rate,
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
                                   "turn_overhead_s": profile["turn_overhead_s"], **shape}})
    return {"calibrate_arms": calibrate_arms, "rows": out,
            "mean_abs_error": statistics.mean(abs(r["error"]) for r in out) if out else None,
            "mean_abs_error_e2e": statistics.mean(abs(r["error_e2e"]) for r in out) if out else None}


# Published anchors, reconstructed. "stated" is what the source says; everything in "assumed" is our reading or
# guess (model speeds, length distributions, batch and GPU splits), chosen before simulating, not fitted.
_GPU = {"decode_tokens_per_s": 4000, "seq_tokens_per_s": 35, "max_batch": 256}   # assumed: a 7B model on one GPU
ANCHORS = {
    "AReaL (math reasoning, async vs sync, same GPUs)": {
        "published": 2.77,
        "stated": "fully asynchronous RL vs synchronous RL with the same number of GPUs, up to 2.77x; long-tailed "
                  "response lengths of reasoning models; bounded staleness",
        "assumed": "7B model; responses log-normal, median 4k tokens, sigma 0.8, capped at 32k (one turn, no "
                   "tools); batch 512 prompts x 16; sync colocated on 64 GPUs; async 48 rollout + 16 training "
                   "GPUs, staleness 4; decode 35 tok/s per sequence, 4,000 tok/s per GPU at 256 rows; training "
                   "6,000 tok/s per GPU, no padding (packed); push 10 s",
        "workload": {"turns_p_more": 1.0, "max_turns": 1, "action_tokens_per_turn": 4000, "action_tokens_sigma": 0.8,
                     "prompt_tokens": 300, "tool_median_s": 0, "tool_sigma": 0},
        "cap_tokens": 32768,
        "sync": {"rollout_gpus": 48, "train_gpus": 16, "colocated": True, "batch_size": 8192, "group_size": 16},
        "async": {"rollout_gpus": 48, "train_gpus": 16, "batch_size": 8192, "group_size": 16, "max_staleness": 4},
        "engine": _GPU, "train_tokens_per_s_per_gpu": 6000, "padded": False, "push_s": 10, "steps": 4,
    },
    "verl fully async (Qwen2.5-7B, 128 GPUs)": {
        "published": 2.5,     # 2.35-2.67
        "stated": "Qwen2.5-7B on 128 GPUs, fully asynchronous trainer and rollouter (streaming, staleness-bounded, "
                  "partial rollouts) vs the colocated synchronous trainer: 2.35x-2.67x",
        "assumed": "DAPO-style math; responses log-normal, median 3k tokens, sigma 0.9, capped at 20k; batch 512 "
                   "prompts x 16; sync colocated on 128 GPUs; async 96 rollout + 32 training GPUs, staleness 1; "
                   "same engine and training speeds as above",
        "workload": {"turns_p_more": 1.0, "max_turns": 1, "action_tokens_per_turn": 3000, "action_tokens_sigma": 0.9,
                     "prompt_tokens": 300, "tool_median_s": 0, "tool_sigma": 0},
        "cap_tokens": 20480,
        "sync": {"rollout_gpus": 96, "train_gpus": 32, "colocated": True, "batch_size": 8192, "group_size": 16},
        "async": {"rollout_gpus": 96, "train_gpus": 32, "batch_size": 8192, "group_size": 16, "max_staleness": 1},
        "engine": _GPU, "train_tokens_per_s_per_gpu": 6000, "padded": False, "push_s": 10, "steps": 4,
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
        "sync": {"rollout_gpus": 32, "train_gpus": 32, "colocated": True, "batch_size": 1024, "group_size": 8},
        "async": {"rollout_gpus": 32, "train_gpus": 32, "batch_size": 1024, "group_size": 8, "max_staleness": 2},
        "engine": _GPU, "train_tokens_per_s_per_gpu": 6000, "padded": False, "push_s": 10, "steps": 4,
    },
}


class _CappedWorkload(Workload):
    """Single-turn responses with a hard length cap (the max response length of reasoning RL)."""

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


# ----------------------------------------------------------------------------------------- command line
def _print_result(r: dict) -> None:
    keys = ("trajectories_per_s", "steady_trajectories_per_s", "trajectories_per_hour", "tokens_per_s",
            "rollout_utilisation", "rollout_busy_share",
            "rollout_idle_share", "train_busy_share", "train_idle_share", "learner_wait_share", "gpu_hours_per_1000",
            "staleness_mean", "dropped", "wall_s")
    for k in keys:
        v = r[k]
        print(f"  {k:<24} {v:.4g}" if isinstance(v, float) else f"  {k:<24} {v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", help="simulate one setting (sync and async side by side)")
    for f in ("batch_size", "group_size", "max_staleness", "rollout_gpus", "train_gpus", "max_batch",
              "trajectories", "seed"):
        p.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(SimConfig, f))
    for f in ("train_tokens_per_s_per_gpu", "train_step_overhead_s", "push_s"):
        p.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(SimConfig, f))
    p.add_argument("--decode-tokens-per-s", type=float, default=4000.0, help="per rollout GPU at max batch")
    p.add_argument("--seq-tokens-per-s", type=float, default=35.0, help="one sequence alone")
    for f in ("turns_p_more", "action_tokens_per_turn", "action_tokens_sigma", "observation_tokens_per_turn",
              "prompt_tokens", "tool_median_s", "tool_sigma"):
        p.add_argument("--" + f.replace("_", "-"), type=float, default=getattr(Workload, f))
    p.add_argument("--max-turns", type=int, default=Workload.max_turns)
    p.add_argument("--episodes", help="recorded trajectories: a jsonl (e.g. gen_only/trajectories.jsonl of "
                                      "bench/async_vs_sync.py) or a learner journal directory; draw episodes from them")
    p.add_argument("--colocated-sync", action="store_true", help="sync baseline on all GPUs in turn")
    p.add_argument("--sao-in-flight", type=int, default=0, help="async in-flight cap [default (S + 1) B]")
    p.add_argument("--output")
    v = sub.add_parser("validate", help="predicted vs measured for a bench/async_vs_sync.py result")
    v.add_argument("results", help="async_vs_sync.json")
    v.add_argument("--output")
    a = sub.add_parser("anchors", help="published async-vs-sync speed-ups, reconstructed")
    a.add_argument("--output", default="local_outputs/bench/simulator")
    args = parser.parse_args(argv)
    out = Path(args.output) if getattr(args, "output", None) else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    import _setup

    if args.command == "run":
        a_, b_ = engine_params(args.decode_tokens_per_s, args.seq_tokens_per_s, args.max_batch)
        workload = Workload(turns_p_more=args.turns_p_more, max_turns=args.max_turns,
                            action_tokens_per_turn=args.action_tokens_per_turn,
                            action_tokens_sigma=args.action_tokens_sigma,
                            observation_tokens_per_turn=args.observation_tokens_per_turn,
                            prompt_tokens=args.prompt_tokens, tool_median_s=args.tool_median_s,
                            tool_sigma=args.tool_sigma, episodes=load_episodes(args.episodes) if args.episodes else [])
        common = {"batch_size": args.batch_size, "max_staleness": args.max_staleness, "rollout_gpus": args.rollout_gpus,
                  "train_gpus": args.train_gpus, "step_overhead_s": a_, "step_per_row_s": b_,
                  "max_batch": args.max_batch, "train_tokens_per_s_per_gpu": args.train_tokens_per_s_per_gpu,
                  "train_step_overhead_s": args.train_step_overhead_s, "push_s": args.push_s,
                  "trajectories": args.trajectories, "seed": args.seed}
        sync = simulate(SimConfig(method="sync", group_size=args.group_size, colocated=args.colocated_sync,
                                  **common), workload)
        sao = simulate(SimConfig(method="async", group_size=1, in_flight=args.sao_in_flight, **common), workload)
        print(f"sync GRPO (G={args.group_size}{', colocated' if args.colocated_sync else ''}):")
        _print_result(sync)
        print(f"SAO (S={args.max_staleness}, in flight {SimConfig(**common, in_flight=args.sao_in_flight).cap}):")
        _print_result(sao)
        print(f"SAO / sync = {sao['trajectories_per_s'] / sync['trajectories_per_s']:.2f}x")
        if out:
            (out / "simulate.json").write_text(json.dumps({"sync": sync, "sao": sao}, indent=2) + "\n")
        return 0
    if args.command == "validate":
        measured = json.loads(Path(args.results).read_text())
        result = predict_measured(measured)
        print(_setup.fmt_table(result["rows"], [("tail", "tail", ""), ("arm", "arm", ""),
                                                ("measured", "measured traj/s", ".3f"),
                                                ("predicted", "predicted traj/s", ".3f"), ("error", "error", "+.0%"),
                                                ("measured_e2e", "meas. e2e", ".3f"),
                                                ("predicted_e2e", "pred. e2e", ".3f"),
                                                ("error_e2e", "error e2e", "+.0%"),
                                                ("measured_idle", "gen idle meas.", ".2f"),
                                                ("predicted_idle", "gen idle pred.", ".2f")]))
        if result["mean_abs_error"] is not None:
            print(f"mean |error| {result['mean_abs_error']:.0%} steady state (second half of the steps), "
                  f"{result['mean_abs_error_e2e']:.0%} end to end")
        target = out or Path(args.results).parent
        (target / "simulator_validation.json").write_text(json.dumps(result, indent=2) + "\n")
        if result["rows"]:
            labels = [f"{r['tail']}: {r['arm']}" for r in result["rows"]]
            _setup.bar_chart_png(target / "simulator_validation.png", "simulator: predicted vs measured "
                                 "trajectories/s (bench/async_vs_sync.py)", labels,
                                 {"measured": [r["measured"] for r in result["rows"]],
                                  "predicted": [r["predicted"] for r in result["rows"]]})
        return 0
    rows = run_anchors()
    for r in rows:
        print(f"{r['anchor']}: published {r['published']:.2f}x, predicted {r['predicted']:.2f}x steady "
              f"({r['error']:+.0%}), {r['predicted_e2e']:.2f}x end to end; rollout utilisation sync "
              f"{r['sync']['rollout_utilisation']:.2f} async {r['async']['rollout_utilisation']:.2f}, GPU-h/1000 traj sync {r['sync']['gpu_hours_per_1000']:.2f} "
              f"async {r['async']['gpu_hours_per_1000']:.2f}\n  stated: {r['stated']}\n  assumed: {r['assumed']}")
    (out / "anchors.json").write_text(json.dumps(rows, indent=2) + "\n")
    _setup.bar_chart_png(out / "anchors.png", "async / sync speed-up: published vs simulated (reconstructed settings)",
                         [r["anchor"] for r in rows], {"published": [r["published"] for r in rows],
                                                       "simulated": [r["predicted"] for r in rows]}, unit="x")
    return 0


def load_episodes(path: str) -> list[Episode]:
    """Episodes of recorded trajectories (a jsonl of trajectories, e.g. gen_only/trajectories.jsonl, or a learner
    journal directory): action tokens per turn (runs of the action mask), prompt tokens, and tool seconds spread
    evenly over the turns that called a tool."""
    source = Path(path)
    if source.is_dir():
        records = [t for p_ in sorted(source.glob("step-*.json")) for t in json.loads(p_.read_text())["trajectories"]]
    else:
        records = [json.loads(line) for line in source.read_text().splitlines() if line.strip()]
    episodes = []
    for t in records:
        runs, current, previous = [], 0, 0
        for m in t["action_mask"]:
            if m:
                current += 1
            elif previous:
                runs.append(current)
                current = 0
            previous = m
        if current:
            runs.append(current)
        if not runs:
            continue
        tool = t.get("timings", {}).get("tool_seconds", 0.0)
        gaps = max(1, len(runs) - 1)
        episodes.append(Episode(runs, [tool / gaps] * (len(runs) - 1), len(t["token_ids"]),
                                prompt_tokens=t["action_mask"].index(1)))
    return episodes


if __name__ == "__main__":
    sys.exit(main())
