"""The discrete-event model of RL post-training on a cluster: synchronous GRPO (groups of G, a barrier per
batch) against asynchronous training (SAO: one rollout per prompt; async GRPO: groups) with a staleness bound.

Units: seconds of simulated time (`*_s`), tokens, tokens per second (`*_tokens_per_s*`), GPUs.

- Rollout engines (one per rollout GPU). An engine decodes its active sequences in steps: one token per
  sequence per step for up to `max_batch` sequences (round robin beyond that). `engine_mode="kv"` (vLLM, the
  HF engine with its KV cache): a step takes `step_overhead_s + step_per_row_s * rows`; set them directly or
  from `decode_tokens_per_s` (aggregate at `max_batch` rows) and `seq_tokens_per_s` (one sequence alone) with
  `engine_params`. `engine_mode="recompute"` (the HF engine with `kv_cache=False`: left padding, no cache): a
  step also costs `step_per_position_s` per encoded position, rows x the longest context among them, so long
  and mixed-length contexts slow every row. Episodes go to the least loaded engine.
- Episodes: turns of decoding (action tokens) separated by tool calls (seconds); parametric (turns
  min_turns + Geometric(p_more) <= max_turns, log-normal tool time plus a fixed service time per turn, action
  tokens per turn fixed or log-normal, prompt tokens growing with the turns) or empirical (the turns, tokens and
  tool seconds of recorded trajectories, drawn with replacement; `sao_core.sim.traces`). The G rollouts of one
  prompt share its number of turns (as with tool_arith's fixed_turns).
- Learner (on `train_gpus`): a step on B trajectories takes `train_step_overhead_s + tokens /
  (train_tokens_per_s_per_gpu * train_gpus)`, tokens padded to the longest trajectory of the batch (as the
  learner's right padding) unless `padded=False`; then `push_s` to publish and load the new weights.
- sync: B episodes (B/G prompts) in flight; the learner waits for all of them, trains and pushes while the
  engines idle; `colocated=True` makes every GPU generate, then every GPU train (the usual sync layout).
- async: up to `in_flight` episodes started and not yet trained (default (S + 1) B); the learner takes the
  first B finished (async GRPO: the first B/G complete groups), dropping those whose first token is more than
  `max_staleness` versions old; slots free when a batch has been trained (as the rollout service counts them).

`simulate` returns trajectories/s and per hour, trained tokens/s, busy and idle shares per role, rollout
utilisation (tokens decoded / engine capacity: a GPU decoding one sequence is busy but nearly idle), GPU-hours
per 1,000 trajectories, mean staleness (policy versions) and drops.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
import statistics
from dataclasses import asdict, dataclass, field


class SimError(ValueError):
    """A simulation cannot run with these inputs (bad settings, unreadable recorded trajectories, a stall)."""

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
    """Parametric episodes (used when `episodes` is empty): token counts in tokens, tool times in seconds."""

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
        """Turns of the next prompt (shared by its G rollouts); -1 for empirical episodes."""
        if self.episodes:
            return -1
        n = self.min_turns
        while n < self.max_turns and rng.random() >= self.turns_p_more:
            n += 1
        return n

    def draw(self, rng: random.Random, turns: int) -> Episode:
        """One episode of `turns` turns (empirical: a recorded one, drawn with replacement)."""
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
    """One simulated method on one cluster. Times in seconds, speeds in tokens per second."""

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
    # async: an episode whose start is more than max_staleness versions behind the weights ends before its next
    # turn (the rollout service's abandon bound, AdmissionPolicy.abandon_after, which the learner sets): it would be dropped anyway
    abandon_stale: bool = True
    trajectories: int = 1024                   # trained trajectories to simulate
    seed: int = 0

    @property
    def cap(self) -> int:
        """Episodes started and not yet trained, at most."""
        if self.in_flight:
            return self.in_flight
        return self.batch_size if self.method == "sync" else (self.max_staleness + 1) * self.batch_size

    def validate(self) -> None:
        """Raise SimError (a ValueError) naming the first setting the model cannot run with."""
        if self.method not in ("sync", "async"):
            raise SimError(f"method must be sync or async, got {self.method!r}")
        for name in ("batch_size", "group_size", "rollout_gpus", "train_gpus", "max_batch", "trajectories"):
            if getattr(self, name) < 1:
                raise SimError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_staleness < 0 or self.in_flight < 0:
            raise SimError("max_staleness and in_flight must be >= 0")
        if self.train_tokens_per_s_per_gpu <= 0:
            raise SimError(f"train_tokens_per_s_per_gpu must be > 0, got {self.train_tokens_per_s_per_gpu}")
        if min(self.step_overhead_s, self.step_per_row_s, self.step_per_position_s, self.train_step_overhead_s,
               self.push_s) < 0 or self.step_overhead_s + self.step_per_row_s + self.step_per_position_s <= 0:
            raise SimError("engine step costs and learner / push seconds must be >= 0, and a decode step must "
                           "cost some time")
        if self.batch_size % self.group_size:
            raise SimError("batch_size must be a multiple of group_size")
        if self.cap < self.batch_size:
            raise SimError("in_flight must be >= batch_size")
        if self.colocated and self.method != "sync":
            raise SimError("colocated applies to sync only")
        if self.engine_mode not in ("kv", "recompute"):
            raise SimError(f"engine_mode must be kv or recompute, got {self.engine_mode!r}")


def engine_params(decode_tokens_per_s: float, seq_tokens_per_s: float, max_batch: int) -> tuple[float, float]:
    """(step_overhead_s, step_per_row_s) in seconds from the aggregate rate at max_batch rows and one sequence's
    rate (both tokens/s)."""
    if decode_tokens_per_s <= 0 or seq_tokens_per_s <= 0 or max_batch < 1:
        raise SimError("decode_tokens_per_s and seq_tokens_per_s must be > 0 and max_batch >= 1")
    # 1 / seq = a + b ; max_batch / decode = a + b * max_batch
    one, full = 1.0 / seq_tokens_per_s, max_batch / decode_tokens_per_s
    if max_batch == 1:
        return one, 0.0
    b = max(0.0, (full - one) / (max_batch - 1))
    return max(0.0, one - b), b


class _Engine:
    """One rollout engine's state: KV mode (fluid service of the sequences in `heap`) or recompute mode."""

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
        """Tokens/s delivered to each active sequence (KV mode)."""
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
        # changes with the version, so one full scan per version, as the learner's drop_unusable at each take.
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
            raise SimError("simulation stalled (nothing in flight and nothing scheduled)")
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
            if cfg.abandon_stale and cfg.method == "async" and \
                    learner["engine_version"] - episodes[ident]["version"] > cfg.max_staleness:
                arrive(ident)           # ended early; stale for the learner too (its version is never behind)
                if cfg.group_size == 1:
                    drop([ident])
                try_learn()
                continue
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
            "decoded_tokens": sum(e.tokens for e in engines),      # all sampled tokens, dropped episodes' too
            "steady_trajectories_per_s": steady,
            "trajectories_per_s": learner["trained"] / wall, "trajectories_per_hour": learner["trained"] / wall * 3600,
            "tokens_per_s": learner["tokens"] / wall, "rollout_busy_share": gen_busy, "rollout_idle_share": rollout_idle,
            "train_busy_share": train_busy, "train_idle_share": train_idle,
            "learner_wait_share": learner["wait_s"] / wall,
            "gpu_hours_per_1000": gpus * wall / 3600 / learner["trained"] * 1000,
            "staleness_mean": statistics.mean(learner["staleness"]) if learner["staleness"] else 0.0,
            "dropped": learner["dropped"]}

