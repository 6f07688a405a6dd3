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
    loop = asyncio.get_running_loop()

    def in_thread(fn, *args):
        return loop.run_in_executor(executor, fn, *args)
    started = time.time()
    timings = Timings(queued=queued_at or started, started=started)
    tokens: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []

    def add(ids, action, lps=None, vs=None):
        tokens.extend(ids)
        mask.extend([1 if action else 0] * len(ids))
        logprobs.extend(lps if lps is not None else [0.0] * len(ids))
        versions.extend(vs if vs is not None else [-1] * len(ids))

    reward, finish, turns, info = 0.0, "stop", 0, {}
    cut = 0            # tokens before this index were emitted in fragments (context for what follows)
    fragments = 0
    base_id = trajectory_id or uuid.uuid4().hex

    def check_cut() -> bool:
        """At a turn boundary: True when the episode must end as stale; emits a fragment when one is due."""
        nonlocal fragments, cut, finish
        if abandon_if is None and fragment_if is None:   # only then: the scan of the versions is per turn
            return False
        oldest = min((v for v in versions[cut:] if v >= 0), default=None)
        if oldest is None:
            return False
        if abandon_if is not None and abandon_if(oldest):
            finish = "stale"
            return True
        if fragment_if is not None and emit is not None and fragment_if(oldest):
            emit(piece(cut, id=f"{base_id}-f{fragments}", reward=0.0, num_turns=turns, finish_reason="fragment",
                       timings=Timings(queued=timings.queued, started=started, finished=time.time()),
                       metadata={"fragment": fragments, "info": dict(info)} if info else {"fragment": fragments}))
            fragments += 1
            cut = len(tokens)
        return False

    def piece(upto_cut: int, **fields) -> Trajectory:
        """The tokens so far with the action fields of those from `upto_cut` on only."""
        return Trajectory(
            prompt_id=task.id, env=task.env, token_ids=list(tokens),
            action_mask=[0] * upto_cut + mask[upto_cut:],
            rollout_logprobs=[0.0] * upto_cut + logprobs[upto_cut:],
            versions=[-1] * upto_cut + versions[upto_cut:], sample_index=sample_index, **fields)
    deadline = started + limits.timeout_s if limits.timeout_s else None
    try:
        messages = await in_thread(env.reset, task)
        opening = prompt_tokens(tokenizer, messages)
        if len(opening) >= limits.max_total_tokens:
            # No room for a single action token: a failed episode (the policy is not at fault), delivered
            # without its tokens so that nothing downstream encodes an over-long prompt.
            finish = "env_error"
            info = {"error": f"prompt too long: {len(opening)} tokens leave no room within max_total_tokens "
                             f"{limits.max_total_tokens}", "prompt_tokens": len(opening)}
            raise _PromptTooLong
        add(opening, action=False)
        while True:
            budget = limits.max_total_tokens - len(tokens)
            if budget <= 0 or turns >= env.max_turns:
                finish = "length"
                break
            if deadline and time.time() > deadline:
                finish = "timeout"
                break
            if check_cut():
                finish = "stale"
                break
            if may_generate is not None:
                while not may_generate() and not (deadline and time.time() > deadline) and finish != "stale":
                    await asyncio.sleep(0.02)
                    check_cut()
                if finish == "stale":
                    break
                if deadline and time.time() > deadline:
                    finish = "timeout"
                    break
            turn_params = SamplingParams(**{**params.__dict__,
                                            "max_new_tokens": min(params.max_new_tokens,
                                                                  limits.max_new_tokens_per_turn, budget),
                                            "seed": turn_seed(params.seed, turns)})
            generation = await _with_deadline(engine.generate(tokens, turn_params), deadline)
            if generation is None:
                finish = "timeout"
                break
            turns += 1
            timings.generation_seconds += generation.seconds
            add(generation.token_ids, action=True, lps=generation.logprobs, vs=generation.versions)
            text = action_text(tokenizer, generation.token_ids)
            if generation.finish_reason == "length":
                # Cut at the token cap: not graded (reward 0), but the environment may say whether the cut turn
                # already held the right answer (a training-health metric, learner/health.py).
                finish = "length"
                info = {**info, "cut_turn": True}
                grade = getattr(env, "grade_unfinished", None)
                if grade is not None:
                    try:
                        correct = await in_thread(grade, text)
                    except Exception:  # a metric only: never the episode's failure
                        correct = None
                    if isinstance(correct, bool):
                        info["cut_turn_correct"] = correct
                break
            try:
                step = await _with_deadline(in_thread(env.step, text), deadline)
            except Exception as err:  # an environment bug ends this episode only
                finish, info = "env_error", {"error": f"{type(err).__name__}: {err}"}
                break
            if step is None:
                finish = "timeout"
                break
            timings.tool_seconds += step.tool_seconds
            if step.done:
                reward, finish, info = step.reward, step.finish_reason or "stop", step.info
                break
            info = dict(step.info)     # the latest step's (e.g. tool errors so far), kept if the episode is cut
            add(observation_tokens(tokenizer, step.observation or ""), action=False)
    except _PromptTooLong:
        pass
    except Exception as err:
        if finish == "stop":
            finish, info = "env_error", {"error": f"{type(err).__name__}: {err}"}
    finally:
        await in_thread(_close_quietly, env)
    timings.finished = time.time()
    metadata = {"info": info} if info else {}
    if fragments:
        metadata["fragment"] = fragments
    return piece(cut, id=base_id, reward=float(reward), num_turns=turns, finish_reason=finish, timings=timings,
                 metadata=metadata)


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
