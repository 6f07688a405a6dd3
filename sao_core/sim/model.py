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

from sao_core.rollout.admission import DEFAULT_MAX_STALENESS


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
    max_staleness: int = DEFAULT_MAX_STALENESS   # S, in policy versions
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


@dataclass
class _Flight:
    """One started episode: the turn it is in, its engine, its prompt (its group) and the policy version that
    started it; recompute engines also track its context (tokens) and the tokens left in this turn."""

    episode: Episode
    engine: int
    prompt: int
    version: int
    turn: int = 0
    context: float = 0.0
    left: int = 0


@dataclass
class _Learner:
    """The learner's version and counters. Seconds in `*_s`; `staleness` holds one entry per trained
    trajectory (policy versions); `step_end` the time each step's weights were loaded."""

    version: int = 0                      # the learner's weights
    engine_version: int = 0               # the weights the engines run (behind while a push is under way)
    busy_until: float | None = None
    wait_s: float = 0.0
    trained: int = 0
    tokens: int = 0
    staleness: list[int] = field(default_factory=list)
    dropped: int = 0
    steps: int = 0
    train_s: float = 0.0
    push_s: float = 0.0
    step_end: list[float] = field(default_factory=list)


class _Simulation:
    """The event simulator. Engines decode continuously (KV mode: a fluid share of each engine per sequence) or
    in discrete steps (recompute mode: "kick" and "step" events); everything else is a timed event: "begin" (a
    turn's service time before decoding), "tool" (a tool call ends), "trained" (a learner step ends) and
    "pushed" (the new weights are loaded)."""

    def __init__(self, cfg: SimConfig, workload: Workload):
        self.cfg, self.workload = cfg, workload
        self.rng = random.Random(cfg.seed)
        self.recompute = cfg.engine_mode == "recompute"
        gpus_gen = cfg.rollout_gpus + (cfg.train_gpus if cfg.colocated else 0)
        self.engines = [_Engine(cfg.step_overhead_s, cfg.step_per_row_s, cfg.max_batch) for _ in range(gpus_gen)]
        self.train_gpus = cfg.train_gpus + (cfg.rollout_gpus if cfg.colocated else 0)
        self.now = 0.0
        self.timed: list[tuple[float, int, str, int]] = []    # (time, tiebreak, kind, id)
        self.counter = 0
        self.flights: dict[int, _Flight] = {}
        self.next_id = 0
        self.in_flight = 0                                     # started and not yet trained or dropped
        self.prompt = 0
        self.ready: dict[int, None] = {}                       # finished, not yet taken, in finishing order
        self.pending_by_prompt: dict[int, list[int]] = {}
        self.complete: dict[int, None] = {}                    # prompts whose G members are all pending, in order
        self.scanned_version = -1
        self.learner = _Learner()
        self.pending_batch: list[int] = []
        self.wait_since = 0.0
        self.paused = False                                    # sync: generation stops while the learner works
        self.finished_at: float | None = None
        self.handlers = {"kick": self.on_kick, "step": self.on_step, "begin": self.start_decode,
                         "tool": self.on_tool, "trained": self.on_trained, "pushed": self.on_pushed}

    def run(self) -> dict:
        """Admit the first episodes, then process events until enough trajectories are trained."""
        self.admit()
        while self.finished_at is None:
            self.next_event()
        return _metrics(self.cfg, self.engines, self.learner, self.finished_at)

    # --- time --------------------------------------------------------------------------------------------

    def schedule(self, t: float, kind: str, ident: int) -> None:
        """A timed event of `kind` for episode or engine `ident` at `t` seconds (ties: in scheduling order)."""
        self.counter += 1
        heapq.heappush(self.timed, (t, self.counter, kind, ident))

    def next_event(self) -> None:
        """Advance to the earliest decode completion or timed event and handle it."""
        best_t, best_engine = self.next_decode()
        t_timed = self.timed[0][0] if self.timed else math.inf
        t_next = min(best_t, t_timed)
        if t_next == math.inf:
            raise SimError("simulation stalled (nothing in flight and nothing scheduled)")
        self.advance_engines(t_next - self.now)
        self.now = t_next
        if best_t <= t_timed:
            _, eid = heapq.heappop(self.engines[best_engine].heap)
            self.finish_turn(eid)
            return
        _, _, kind, ident = heapq.heappop(self.timed)
        self.handlers[kind](ident)

    def next_decode(self) -> tuple[float, int]:
        """(time, engine index) of the next turn to finish decoding on a KV engine; (inf, -1) when none."""
        best_t, best_engine = math.inf, -1
        for i, engine in enumerate(self.engines):
            if engine.heap and not self.paused:
                rate = engine.rate()
                t = self.now + max(0.0, engine.heap[0][0] - engine.service) / rate
                if t < best_t:
                    best_t, best_engine = t, i
        return best_t, best_engine

    def advance_engines(self, dt: float) -> None:
        """Deliver `dt` seconds of decoding on every active KV engine."""
        for engine in self.engines:
            if engine.heap and not self.paused:
                rate = engine.rate()
                engine.service += rate * dt
                engine.busy_s += dt
                engine.tokens += rate * dt * len(engine.heap)

    # --- episodes ----------------------------------------------------------------------------------------

    def admit(self) -> None:
        """Start whole prompts (G episodes each) while the in-flight cap allows and generation is not paused."""
        g = self.cfg.group_size
        while self.in_flight + g <= self.cfg.cap and not self.paused:
            turns = self.workload.draw_turns(self.rng)
            for _ in range(g):
                episode = self.workload.draw(self.rng, turns)
                engine = min(range(len(self.engines)), key=lambda e: len(self.engines[e].heap))
                self.flights[self.next_id] = _Flight(episode, engine, self.prompt, self.learner.engine_version)
                if self.workload.turn_overhead_s > 0:
                    self.schedule(self.now + self.workload.turn_overhead_s, "begin", self.next_id)
                else:
                    self.start_decode(self.next_id)
                self.next_id += 1
            self.in_flight += g
            self.prompt += 1

    def start_decode(self, eid: int) -> None:
        """Hand the episode's current turn to its engine."""
        flight = self.flights[eid]
        engine = self.engines[flight.engine]
        if not self.recompute:
            heapq.heappush(engine.heap, (engine.service + flight.episode.action_tokens[flight.turn], eid))
            return
        if flight.turn == 0:
            flight.context = flight.episode.prompt_tokens
        else:
            flight.context += flight.episode.observation_tokens()
        flight.left = flight.episode.action_tokens[flight.turn]
        engine.active.append(eid)
        self.kick(flight.engine)

    def finish_turn(self, eid: int) -> None:
        """A turn is decoded: the episode ends after its last turn, else it calls its tool."""
        flight = self.flights[eid]
        if flight.turn == len(flight.episode.action_tokens) - 1:
            self.end_episode(eid, stale=self.is_stale(eid))
        else:
            self.schedule(self.now + flight.episode.tool_s[flight.turn], "tool", eid)

    def on_tool(self, eid: int) -> None:
        """A tool call returned: the next turn starts, unless the service abandons the episode as too stale."""
        cfg = self.cfg
        if cfg.abandon_stale and cfg.method == "async" and \
                self.learner.engine_version - self.flights[eid].version > cfg.max_staleness:
            self.end_episode(eid, stale=True)   # ended early; stale for the learner too (its version is never behind)
            return
        self.flights[eid].turn += 1
        self.start_decode(eid)

    def end_episode(self, eid: int, stale: bool) -> None:
        """The trajectory reaches the learner (dropped at once when stale and ungrouped)."""
        self.arrive(eid)
        if stale and self.cfg.group_size == 1:
            self.drop([eid])
        self.try_learn()

    # --- recompute engines -------------------------------------------------------------------------------

    def kick(self, index: int) -> None:
        """Start a step at this instant, after every arrival of the same instant (as the engine thread takes its
        whole inbox at the start of a step)."""
        engine = self.engines[index]
        if engine.stepping is None and not engine.kicked and not self.paused:
            engine.kicked = True
            self.schedule(self.now, "kick", index)

    def on_kick(self, index: int) -> None:
        """The engine takes its inbox: a step starts unless one is running or generation is paused."""
        self.engines[index].kicked = False
        if self.engines[index].stepping is None and not self.paused:
            self.start_step(index)

    def start_step(self, index: int) -> None:
        """Recompute engine (the HF engine): one step samples a token for each of up to max_batch sequences,
        re-encoding their left-padded contexts; the others wait their turn (round robin)."""
        cfg, engine = self.cfg, self.engines[index]
        batch = engine.active[:cfg.max_batch]
        if not batch:
            engine.stepping = None
            return
        engine.active = engine.active[cfg.max_batch:] + batch
        width = max(self.flights[e].context for e in batch)
        seconds = cfg.step_overhead_s + len(batch) * (cfg.step_per_row_s + cfg.step_per_position_s * width)
        engine.busy_s += seconds
        engine.tokens += len(batch)
        engine.stepping = batch
        self.schedule(self.now + seconds, "step", index)

    def on_step(self, index: int) -> None:
        """A recompute step ended: every row got one token; turns that are complete finish after the whole batch
        is updated."""
        engine = self.engines[index]
        batch, engine.stepping = engine.stepping, None
        done = []
        for eid in batch:
            flight = self.flights[eid]
            flight.context += 1
            flight.left -= 1
            if flight.left <= 0:
                engine.active.remove(eid)
                done.append(eid)
        for eid in done:
            self.finish_turn(eid)
        self.kick(index)

    # --- the learner's queue -----------------------------------------------------------------------------

    def is_stale(self, e: int) -> bool:
        """Async only: started more than max_staleness versions before the learner's weights."""
        return self.cfg.method == "async" and self.learner.version - self.flights[e].version > self.cfg.max_staleness

    def arrive(self, e: int) -> None:
        """A finished trajectory joins the learner's queue (and its group, complete once all G are in)."""
        self.ready[e] = None
        prompt_id = self.flights[e].prompt
        members = self.pending_by_prompt.setdefault(prompt_id, [])
        members.append(e)
        if len(members) == self.cfg.group_size:
            self.complete[prompt_id] = None

    def drop(self, eids: list[int]) -> None:
        """Discard queued trajectories (counted as dropped); their slots free."""
        for e in eids:
            del self.ready[e]
            prompt_id = self.flights[e].prompt
            members = self.pending_by_prompt.get(prompt_id)
            if members is not None and e in members:
                members.remove(e)
                self.complete.pop(prompt_id, None)
            del self.flights[e]
        self.learner.dropped += len(eids)
        self.release(len(eids))

    def release(self, n: int) -> None:
        """`n` slots free: admit new prompts into them."""
        self.in_flight -= n
        self.admit()

    def drop_stale(self) -> None:
        """Drop stale trajectories (all pending members of their group for grouped methods). Staleness only
        changes with the version, so one full scan per version, as the learner's drop_unusable at each take."""
        if self.cfg.method != "async" or self.scanned_version == self.learner.version:
            return
        self.scanned_version = self.learner.version
        stale = [e for e in self.ready if self.is_stale(e)]
        if self.cfg.group_size > 1:
            prompts = {self.flights[e].prompt for e in stale}
            stale = [e for p_ in prompts for e in self.pending_by_prompt.get(p_, [])]
        if stale:
            self.drop(stale)

    def take_batch(self) -> list[int] | None:
        """The next batch of trajectory ids (the first B finished; grouped: the first B/G complete groups), or
        None while there are not enough."""
        self.drop_stale()
        chosen = self.take_single() if self.cfg.group_size == 1 else self.take_groups()
        if chosen is None:
            return None
        for e in chosen:
            del self.ready[e]
        if self.cfg.group_size == 1:
            for e in chosen:
                self.pending_by_prompt.pop(self.flights[e].prompt, None)
        return chosen

    def take_single(self) -> list[int] | None:
        """SAO: the first B finished trajectories."""
        if len(self.ready) < self.cfg.batch_size:
            return None
        return list(itertools.islice(self.ready, self.cfg.batch_size))

    def take_groups(self) -> list[int] | None:
        """Grouped methods: every member of the first B/G complete groups."""
        cfg = self.cfg
        if len(self.complete) * cfg.group_size < cfg.batch_size:
            return None
        prompts = list(itertools.islice(self.complete, cfg.batch_size // cfg.group_size))
        chosen = [e for p_ in prompts for e in self.pending_by_prompt[p_]]
        for p_ in prompts:
            del self.complete[p_]
            del self.pending_by_prompt[p_]
        return chosen

    # --- the learner -------------------------------------------------------------------------------------

    def try_learn(self) -> None:
        """Start a learner step when the learner is free and a batch is ready (sync: generation pauses)."""
        cfg, learner = self.cfg, self.learner
        if learner.busy_until is not None:
            return
        chosen = self.take_batch()
        if chosen is None:
            return
        learner.wait_s += self.now - self.wait_since
        eps = [self.flights[e].episode for e in chosen]
        tokens = len(eps) * max(e.tokens for e in eps) if cfg.padded else sum(e.tokens for e in eps)
        train_s = cfg.train_step_overhead_s + tokens / (cfg.train_tokens_per_s_per_gpu * self.train_gpus)
        learner.staleness += [learner.version - self.flights[e].version for e in chosen]
        learner.train_s += train_s
        learner.push_s += cfg.push_s
        learner.busy_until = self.now + train_s + cfg.push_s
        self.pending_batch = chosen
        if cfg.method == "sync":
            self.paused = True
        self.schedule(self.now + train_s, "trained", 0)
        self.schedule(learner.busy_until, "pushed", 0)

    def on_trained(self, _: int) -> None:
        """The step is trained: the version advances and the batch's slots free (sync: admitted once resumed)."""
        batch, learner = self.pending_batch, self.learner
        learner.trained += len(batch)
        learner.tokens += sum(self.flights[e].episode.tokens for e in batch)
        learner.steps += 1
        learner.step_end.append(self.now + self.cfg.push_s)
        learner.version += 1
        for e in batch:
            del self.flights[e]
        if learner.trained >= self.cfg.trajectories:
            self.finished_at = self.now + self.cfg.push_s
        self.release(len(batch))

    def on_pushed(self, _: int) -> None:
        """The engines run the new weights; a paused (sync) generation resumes."""
        self.learner.engine_version = self.learner.version
        self.learner.busy_until = None
        self.wait_since = self.now
        if self.paused:
            self.paused = False
            self.admit()
            for index, engine in enumerate(self.engines):
                if self.recompute and engine.active:
                    self.kick(index)
        self.try_learn()


def _metrics(cfg: SimConfig, engines: list[_Engine], learner: _Learner, wall: float) -> dict:
    """The result of a finished simulation of `wall` seconds (see the module docstring for the keys)."""
    gen_busy = statistics.mean(e.busy_s for e in engines) / wall
    train_busy = (learner.train_s + learner.push_s) / wall
    gpus = cfg.rollout_gpus + cfg.train_gpus
    if cfg.colocated:  # every GPU does both jobs in turn
        rollout_idle = train_idle = 1.0 - gen_busy - train_busy
    else:
        rollout_idle, train_idle = 1.0 - gen_busy, 1.0 - train_busy
    ends, half = learner.step_end, learner.steps // 2
    steady = (cfg.batch_size * (len(ends) - half) / (ends[-1] - ends[half - 1])) if half >= 1 and \
        ends[-1] > ends[half - 1] else learner.trained / wall
    utilisation = None
    if cfg.engine_mode != "recompute":
        capacity = cfg.max_batch / (cfg.step_overhead_s + cfg.step_per_row_s * cfg.max_batch)   # tokens/s per engine
        utilisation = sum(e.tokens for e in engines) / (capacity * len(engines) * wall)
    return {"config": asdict(cfg), "wall_s": wall, "trained": learner.trained, "steps": learner.steps,
            "rollout_utilisation": utilisation,
            "decoded_tokens": sum(e.tokens for e in engines),      # all sampled tokens, dropped episodes' too
            "steady_trajectories_per_s": steady,
            "trajectories_per_s": learner.trained / wall, "trajectories_per_hour": learner.trained / wall * 3600,
            "tokens_per_s": learner.tokens / wall, "rollout_busy_share": gen_busy, "rollout_idle_share": rollout_idle,
            "train_busy_share": train_busy, "train_idle_share": train_idle,
            "learner_wait_share": learner.wait_s / wall,
            "gpu_hours_per_1000": gpus * wall / 3600 / learner.trained * 1000,
            "staleness_mean": statistics.mean(learner.staleness) if learner.staleness else 0.0,
            "dropped": learner.dropped}


def simulate(cfg: SimConfig, workload: Workload) -> dict:
    """Run the simulation until `cfg.trajectories` trajectories are trained; return the metrics."""
    cfg.validate()
    return _Simulation(cfg, workload).run()
