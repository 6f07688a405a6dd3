"""Run one episode: the engine samples action tokens, the environment answers, tokens accumulate.

Token-in/token-out: the model's tokens are appended exactly as sampled; only the prompt and the
environment's observations are tokenised, each rendered by the tokenizer's own chat template.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass

from sao_core.envs.base import Environment, Task
from sao_core.rollout.engines.base import Engine, SamplingParams
from sao_core.rollout.trajectory import Timings, Trajectory

_PLACEHOLDER = "\u2063sao-action\u2063"


@dataclass(frozen=True)
class EpisodeLimits:
    """Per-episode budget: tokens of the whole trajectory, seconds of wall time (0: unlimited)."""

    max_total_tokens: int = 4096
    max_new_tokens_per_turn: int = 256
    timeout_s: float = 0.0


def prompt_tokens(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of the episode's opening messages followed by the generation prompt."""
    rendered = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True)
    return list(rendered["input_ids"])


def observation_tokens(tokenizer, observation: str) -> list[int]:
    """Tokens that follow the model's end-of-turn token when the tool answers `observation`: the rest of
    the template after the assistant turn, the tool message, and the next generation prompt."""
    before = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PLACEHOLDER}]
    text = tokenizer.apply_chat_template(before + [{"role": "tool", "content": observation}], tokenize=False,
                                         add_generation_prompt=True)
    eos = tokenizer.eos_token
    start = text.index(eos, text.index(_PLACEHOLDER)) + len(eos)
    return list(tokenizer.encode(text[start:], add_special_tokens=False))


def action_text(tokenizer, token_ids: list[int]) -> str:
    """The text of a model turn for the environment: tool-call markers such as <tool_call> are special
    tokens in many tokenizers and must survive; only end-of-turn / padding markers are removed."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    for marker in {tokenizer.eos_token, tokenizer.pad_token, tokenizer.bos_token} - {None, ""}:
        text = text.replace(marker, "")
    return text


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of turn `turn` (0-based) of an episode sampled with `seed`: the seed itself for the
    first turn, 31 bits of sha256(seed/turn/t) after it (None stays None: the engine draws its own).

    A fixed seed on every turn would make each turn draw the same random numbers (the HF engine seeds a fresh
    generator per request, vLLM a per-request one), which correlates the turns of a multi-turn episode and is
    not sampling from the policy."""
    if seed is None or turn == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/turn/{turn}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


async def run_episode(task: Task, env: Environment, engine: Engine, tokenizer, params: SamplingParams,
                      limits: EpisodeLimits, queued_at: float | None = None, sample_index: int = 0,
                      trajectory_id: str | None = None, executor: Executor | None = None,
                      abandon_if: Callable[[int], bool] | None = None,
                      fragment_if: Callable[[int], bool] | None = None,
                      emit: Callable[[Trajectory], None] | None = None,
                      may_generate: Callable[[], bool] | None = None) -> Trajectory:
    """Play one episode to the end and return its trajectory (never raises for env or tool failures:
    they end the episode with finish_reason env_error / tool_error).

    The environment's reset / step / close run on `executor` (default: the event loop's default executor).
    Tool calls mostly wait (sandboxes, HTTP, sleeps), so callers running many episodes at once pass a pool
    with a thread per episode in flight: asyncio's default pool has only min(32, cores + 4) threads, which
    would cap the episodes in a tool call at once (6 on 2 cores) whatever the in-flight setting.

    A seeded `params` samples each turn with :func:`turn_seed` (reproducible, and a turn of its own).

    `abandon_if(oldest_version)` is asked before every turn after the first, with the policy version of the
    episode's oldest sampled token not yet emitted in a fragment; True ends the episode there with finish_reason
    "stale" (a learner with a staleness bound could no longer train it, so its remaining turns would be wasted
    generation).

    Fragments (admission "fragments", `rollout/admission.py`): `fragment_if(oldest_version)` is asked at the same
    place; True hands the turns finished since the last cut to `emit` as a fragment: a trajectory of every token
    so far (ending with the observation and the next generation prompt, so the critic can value the state at the
    cut) whose action mask, log-probs and versions cover only those turns (earlier turns are context), reward 0,
    finish_reason "fragment", id ``<id>-f<k>`` and ``metadata["fragment"] = k`` (0-based). The episode goes on;
    the trajectory it returns at the end covers the turns after the last cut, with ``metadata["fragment"]`` = the
    number of fragments emitted before it (absent when there were none).

    `may_generate()` (admission "fragments": the learner's backlog is below its cap) is asked before every turn;
    while it says no, the episode waits (every 20 ms), still cutting a fragment when one falls due, so that
    its untrained tokens do not age while it waits. The wait counts against the episode's timeout."""
    episode = _Episode(task=task, env=env, engine=engine, tokenizer=tokenizer, params=params, limits=limits,
                       queued_at=queued_at, sample_index=sample_index, trajectory_id=trajectory_id,
                       executor=executor, abandon_if=abandon_if, fragment_if=fragment_if, emit=emit,
                       may_generate=may_generate)
    return await episode.run()


class _Episode:
    """One episode in play: the tokens so far, one entry per token in `tokens`, `mask` (1: sampled by the
    model), `logprobs` (the sampler's, 0.0 for context) and `versions` (policy version, -1 for context), plus
    how it stands (`turns`, `finish`, `reward`, `info`) and the fragment cut (`cut`: tokens before this index
    went out in fragments; `fragments`: how many). Built and run by :func:`run_episode` only."""

    def __init__(self, *, task: Task, env: Environment, engine: Engine, tokenizer, params: SamplingParams,
                 limits: EpisodeLimits, queued_at: float | None, sample_index: int, trajectory_id: str | None,
                 executor: Executor | None, abandon_if: Callable[[int], bool] | None,
                 fragment_if: Callable[[int], bool] | None, emit: Callable[[Trajectory], None] | None,
                 may_generate: Callable[[], bool] | None):
        self.task, self.env, self.engine, self.tokenizer = task, env, engine, tokenizer
        self.params, self.limits = params, limits
        self.sample_index = sample_index
        self.executor = executor
        self.abandon_if, self.fragment_if, self.emit, self.may_generate = abandon_if, fragment_if, emit, may_generate
        self.loop = asyncio.get_running_loop()
        self.started = time.time()
        self.timings = Timings(queued=queued_at or self.started, started=self.started)
        self.deadline = self.started + limits.timeout_s if limits.timeout_s else None
        self.base_id = trajectory_id or uuid.uuid4().hex
        self.tokens: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.versions: list[int] = []
        self.reward, self.finish, self.turns, self.info = 0.0, "stop", 0, {}
        self.cut = 0
        self.fragments = 0

    async def run(self) -> Trajectory:
        """Play to the end, close the environment, and return the trajectory of the turns after the last cut."""
        try:
            await self._open()
            await self._play_turns()
        except _PromptTooLong:
            pass
        except Exception as err:
            if self.finish == "stop":
                self.finish, self.info = "env_error", {"error": f"{type(err).__name__}: {err}"}
        finally:
            await self._in_thread(_close_quietly, self.env)
        self.timings.finished = time.time()
        metadata = {"info": self.info} if self.info else {}
        if self.fragments:
            metadata["fragment"] = self.fragments
        return self._piece(self.cut, id=self.base_id, reward=float(self.reward), num_turns=self.turns,
                           finish_reason=self.finish, timings=self.timings, metadata=metadata)

    def _in_thread(self, fn, *args):
        return self.loop.run_in_executor(self.executor, fn, *args)

    def _past_deadline(self) -> bool:
        return self.deadline is not None and time.time() > self.deadline

    def _add(self, ids: list[int], action: bool, lps: list[float] | None = None, vs: list[int] | None = None):
        self.tokens.extend(ids)
        self.mask.extend([1 if action else 0] * len(ids))
        self.logprobs.extend(lps if lps is not None else [0.0] * len(ids))
        self.versions.extend(vs if vs is not None else [-1] * len(ids))

    def _piece(self, upto_cut: int, *, id: str, reward: float, num_turns: int, finish_reason: str,
               timings: Timings, metadata: dict) -> Trajectory:
        """The tokens so far with the action fields of those from `upto_cut` on only."""
        return Trajectory(
            prompt_id=self.task.id, env=self.task.env, token_ids=list(self.tokens),
            action_mask=[0] * upto_cut + self.mask[upto_cut:],
            rollout_logprobs=[0.0] * upto_cut + self.logprobs[upto_cut:],
            versions=[-1] * upto_cut + self.versions[upto_cut:], sample_index=self.sample_index,
            id=id, reward=reward, num_turns=num_turns, finish_reason=finish_reason, timings=timings,
            metadata=metadata)

    async def _open(self) -> None:
        """Reset the environment and add the opening prompt (raises _PromptTooLong when it leaves no room)."""
        messages = await self._in_thread(self.env.reset, self.task)
        opening = prompt_tokens(self.tokenizer, messages)
        if len(opening) >= self.limits.max_total_tokens:
            # No room for a single action token: a failed episode (the policy is not at fault), delivered
            # without its tokens so that nothing downstream encodes an over-long prompt.
            self.finish = "env_error"
            self.info = {"error": f"prompt too long: {len(opening)} tokens leave no room within max_total_tokens "
                                  f"{self.limits.max_total_tokens}", "prompt_tokens": len(opening)}
            raise _PromptTooLong
        self._add(opening, action=False)

    async def _play_turns(self) -> None:
        """Model turn, environment step, observation; until a limit, the environment or the staleness ends it."""
        while True:
            budget = self.limits.max_total_tokens - len(self.tokens)
            ending = self._ending_before_turn(budget) or await self._wait_until_may_generate()
            if ending is not None:
                self.finish = ending
                return
            if await self._play_turn(budget):
                return

    def _ending_before_turn(self, budget: int) -> str | None:
        """The finish reason when the episode must end before its next turn (cutting a fragment if one is due)."""
        if budget <= 0 or self.turns >= self.env.max_turns:
            return "length"
        if self._past_deadline():
            return "timeout"
        if self._check_cut():
            return "stale"
        return None

    async def _wait_until_may_generate(self) -> str | None:
        """Wait while `may_generate` says no; the finish reason when the episode went stale or timed out meanwhile."""
        if self.may_generate is None:
            return None
        while not self.may_generate() and not self._past_deadline() and self.finish != "stale":
            await asyncio.sleep(0.02)
            self._check_cut()
        if self.finish == "stale":
            return "stale"
        if self._past_deadline():
            return "timeout"
        return None

    def _check_cut(self) -> bool:
        """At a turn boundary: True when the episode must end as stale; emits a fragment when one is due."""
        if self.abandon_if is None and self.fragment_if is None:   # only then: the scan of the versions is per turn
            return False
        oldest = min((v for v in self.versions[self.cut:] if v >= 0), default=None)
        if oldest is None:
            return False
        if self.abandon_if is not None and self.abandon_if(oldest):
            self.finish = "stale"
            return True
        if self.fragment_if is not None and self.emit is not None and self.fragment_if(oldest):
            self._emit_fragment()
        return False

    def _emit_fragment(self) -> None:
        """Hand the turns since the last cut to `emit` (reward 0, finish_reason "fragment") and move the cut."""
        k = self.fragments
        metadata = {"fragment": k, "info": dict(self.info)} if self.info else {"fragment": k}
        self.emit(self._piece(self.cut, id=f"{self.base_id}-f{k}", reward=0.0, num_turns=self.turns,
                              finish_reason="fragment",
                              timings=Timings(queued=self.timings.queued, started=self.started, finished=time.time()),
                              metadata=metadata))
        self.fragments += 1
        self.cut = len(self.tokens)

    def _turn_params(self, budget: int) -> SamplingParams:
        """This turn's sampling: new tokens capped by the per-turn limit and the budget left; the turn's seed."""
        params = self.params
        max_new = min(params.max_new_tokens, self.limits.max_new_tokens_per_turn, budget)
        return SamplingParams(**{**params.__dict__, "max_new_tokens": max_new, "seed": turn_seed(params.seed, self.turns)})

    async def _play_turn(self, budget: int) -> bool:
        """Sample one model turn and answer it; True when the episode ended with it."""
        generation = await _with_deadline(self.engine.generate(self.tokens, self._turn_params(budget)), self.deadline)
        if generation is None:
            self.finish = "timeout"
            return True
        self.turns += 1
        self.timings.generation_seconds += generation.seconds
        self._add(generation.token_ids, action=True, lps=generation.logprobs, vs=generation.versions)
        text = action_text(self.tokenizer, generation.token_ids)
        if generation.finish_reason == "length":
            await self._end_cut_turn(text)
            return True
        return await self._step_env(text)

    async def _end_cut_turn(self, text: str) -> None:
        """End on a turn cut at the token cap: not graded (reward 0), but the environment may say whether the cut
        turn already held the right answer (a training-health metric, learner/health.py)."""
        self.finish = "length"
        self.info = {**self.info, "cut_turn": True}
        grade = getattr(self.env, "grade_unfinished", None)
        if grade is None:
            return
        try:
            correct = await self._in_thread(grade, text)
        except Exception:  # a metric only: never the episode's failure
            correct = None
        if isinstance(correct, bool):
            self.info["cut_turn_correct"] = correct

    async def _step_env(self, text: str) -> bool:
        """Hand the model's turn to the environment; True when that ended the episode, else add its observation."""
        try:
            step = await _with_deadline(self._in_thread(self.env.step, text), self.deadline)
        except Exception as err:  # an environment bug ends this episode only
            self.finish, self.info = "env_error", {"error": f"{type(err).__name__}: {err}"}
            return True
        if step is None:
            self.finish = "timeout"
            return True
        self.timings.tool_seconds += step.tool_seconds
        if step.done:
            self.reward, self.finish, self.info = step.reward, step.finish_reason or "stop", step.info
            return True
        self.info = dict(step.info)     # the latest step's (e.g. tool errors so far), kept if the episode is cut
        self._add(observation_tokens(self.tokenizer, step.observation or ""), action=False)
        return False


class _PromptTooLong(Exception):
    """The opening prompt alone fills the episode's token budget."""


async def _with_deadline(awaitable, deadline: float | None):
    if deadline is None:
        return await awaitable
    try:
        return await asyncio.wait_for(awaitable, max(0.0, deadline - time.time()))
    except TimeoutError:
        return None


def _close_quietly(env: Environment) -> None:
    try:
        env.close()
    except Exception:  # closing must never hide the episode's result
        pass
