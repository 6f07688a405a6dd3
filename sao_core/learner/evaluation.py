"""Evaluation during training: held-out rewards at the current weights, asked of the rollout services.

Every `RLConfig.eval_every` learner steps (and at step 0 and the last step) rank 0 plays the held-out set
against the rollout services *while their training stream goes on* (nothing is paused or stopped): one
greedy answer (temperature 0) per prompt when `eval_greedy`, and `eval_samples` sampled answers
(temperature 1, no top-p / top-k, the training distribution) per prompt. The weights are the learner's
current version: evaluation runs after the push of that version and before the next step, and each
generation's version is checked.

How an answer is played and graded is not a copy of anything:

- **a prepared rl dataset** (`eval_data` a folder, ``data.jsonl`` or ``s3://`` prefix): each answer is a
  whole episode played by :func:`sao_core.rollout.episode.run_episode` (the function the rollout service
  trains with) in the row's own environment (`sao_core.envs.make_env`, with the run's `env_options`), and
  its reward is the environment's: multi-turn environments (``tool_arith`` with its calculator calls,
  ``math_python``) get every turn, each turn one ``POST /v1/generate`` (token ids in, token ids out), the
  tools running in the learner's process;
- **a benchmark** (`eval_data` one of ``swe_verified``, ``beyond_aime``, ``imo_answerbench``, with
  `eval_limit`): the evaluator itself, :func:`sao_core.eval.run.evaluate`, with its graders, is run with
  :class:`ServiceEngine` as its engine (outputs under ``OUTPUT/eval/step-NNNNNN/{greedy,sampled}``); the
  score is its avg@k.

Generation goes through :class:`ServiceEngine`, an engine (`sao_core.rollout.engines.base.Engine`) whose
``generate`` is the service's ``/v1/generate`` with the run's bearer token, round robin over the live
services (they hold the same weights). Sampled answers use fixed seeds per (run seed, prompt, sample), so
two evaluations of the same weights give the same answers and two evaluations of different weights differ
only by the weights (each turn of an episode has a seed of its own, derived from the episode's).

Metrics (added to that step's ``metrics.jsonl`` line; step 0 gets a line of its own):
``eval_greedy_reward``, ``eval_greedy_n``, ``eval_sampled_reward``, ``eval_sampled_n``, ``eval_prompts``,
``eval_failed`` (episodes ended by an engine, environment or tool error: they score 0), ``eval_s``. Each
rl-dataset evaluation also writes its episodes to ``OUTPUT/eval/step-NNNNNN.json``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from sao_core import storage
from sao_core.rollout.engines.base import EngineError, Generation, SamplingParams

log = logging.getLogger(__name__)

FAILED = ("env_error", "tool_error", "timeout")
EVAL_DIR = "eval"


class ServiceEngine:
    """An engine whose ``generate`` asks rollout services (``POST /v1/generate``, one prompt, n = 1).

    `urls`: the services (round robin per call; every one must hold the weights being evaluated);
    `token`: the run's bearer token; `tokenizer`: the model's (the evaluator reads ``engine.tokenizer``).
    Calls are blocking HTTP requests run in a thread pool of `concurrency` threads, so the engine works
    in any event loop (the evaluator starts its own) and up to `concurrency` requests reach the services
    at once, where they are batched with the training episodes.
    """

    context_length = None          # the service checks each prompt against its engine's context
    context_source = "the rollout service's engine"
    eos_token_ids: tuple[int, ...] = ()

    def __init__(self, urls: list[str], token: str | None, tokenizer: Any, concurrency: int = 32,
                 timeout_s: float = 600.0):
        if not urls:
            raise EngineError("no rollout service to evaluate on")
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._clients = [httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=timeout_s) for url in urls]
        self._pool = ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="sao-eval-http")
        self._next = 0
        self.tokenizer = tokenizer
        self.version = -1
        self.versions: set[int] = set()      # the weights versions that answered

    def _post(self, index: int, body: dict) -> dict:
        client = self._clients[index]
        try:
            response = client.post("/v1/generate", json=body)
        except httpx.TransportError as err:
            raise EngineError(f"rollout service {client.base_url} unreachable ({type(err).__name__}: {err})") from err
        if response.status_code >= 400:
            raise EngineError(f"rollout service {client.base_url}: /v1/generate -> {response.status_code}: "
                              f"{response.text[:500]}")
        return response.json()["results"][0][0]

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        body: dict[str, Any] = {"prompts": [list(prompt_ids)], "n": 1, "temperature": params.temperature,
                                "top_p": params.top_p, "top_k": params.top_k,
                                "max_new_tokens": params.max_new_tokens}
        if params.seed is not None:
            body["seed"] = int(params.seed) % (2**53)
        index = self._next
        self._next = (self._next + 1) % len(self._clients)
        started = time.monotonic()
        answer = await asyncio.get_running_loop().run_in_executor(self._pool, self._post, index, body)
        ids = list(answer["token_ids"])
        self.versions.add(int(answer["version"]))
        return Generation(token_ids=ids, logprobs=list(answer["logprobs"]), versions=[int(answer["version"])] * len(ids),
                          finish_reason=answer["finish_reason"], seconds=time.monotonic() - started)

    async def close(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False)
        for client in self._clients:
            client.close()


@dataclass
class EvalSet:
    """What evaluation plays: the tasks of a prepared rl dataset, or a benchmark's name."""

    source: str
    tasks: list | None = None         # rl dataset: sao_core.envs.Task
    benchmark: str | None = None

    @property
    def prompts(self) -> int | None:
        return len(self.tasks) if self.tasks is not None else None


def load_eval_set(config) -> EvalSet:
    """The held-out set of `config` (RLConfig); ValueError naming the problem (bad folder, wrong kind)."""
    from sao_core.data.prepared import open_prepared
    from sao_core.data.schemas import DataError
    from sao_core.envs import task_from_row
    from sao_core.eval.config import BENCHMARK_NAMES

    source = config.eval_data
    if source in BENCHMARK_NAMES:
        return EvalSet(source, benchmark=source)
    try:
        prepared = open_prepared(source)
    except DataError as err:
        raise ValueError(f"eval_data: {err}") from err
    if prepared.kind is not None and prepared.kind != "rl":
        raise ValueError(f"eval_data {prepared.data_uri} was prepared with --kind {prepared.kind}; evaluation during "
                         f"training needs --kind rl or a benchmark name ({', '.join(BENCHMARK_NAMES)})")
    rows = prepared.rows[: config.eval_limit or None]
    try:
        tasks = [task_from_row(row) for row in rows]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"eval_data {prepared.data_uri}: {err}") from err
    if not tasks:
        raise ValueError(f"eval_data {prepared.data_uri} holds no prompts")
    return EvalSet(source, tasks=tasks)


def _seed(run_seed: int, task_id: str, index: int) -> int:
    from sao_core.eval.run import sample_seed

    return sample_seed(run_seed, "training-eval", task_id, index)


async def play_rl(eval_set: EvalSet, engine: Any, tokenizer: Any, config) -> list[dict[str, Any]]:
    """Every greedy and sampled episode of an rl eval set on `engine`: one record each (``kind`` greedy |
    sampled, ``id``, ``sample``, ``reward``, ``finish_reason``, ``turns``, ``tokens``, ``versions``)."""
    from sao_core.envs import make_env
    from sao_core.rollout.episode import EpisodeLimits, run_episode

    limits = EpisodeLimits(config.max_total_tokens, config.max_new_tokens_per_turn, 0.0)
    jobs: list[tuple[Any, str, int, SamplingParams]] = []
    for task in eval_set.tasks:
        if config.eval_greedy:
            jobs.append((task, "greedy", 0, SamplingParams(temperature=0.0, max_new_tokens=config.max_new_tokens_per_turn)))
        for k in range(config.eval_samples):
            jobs.append((task, "sampled", k, SamplingParams(max_new_tokens=config.max_new_tokens_per_turn,
                                                            seed=_seed(config.seed, task.id, k))))
    slots = asyncio.Semaphore(max(1, config.eval_concurrency))
    env_pool = ThreadPoolExecutor(max_workers=max(1, config.eval_concurrency), thread_name_prefix="sao-eval-env")

    async def one(task, kind: str, k: int, params: SamplingParams) -> dict[str, Any]:
        async with slots:
            try:
                env = make_env(task.env, **config.env_options.get(task.env, {}))
            except Exception as err:   # counted as a failed episode (as the rollout service does)
                return {"kind": kind, "id": task.id, "sample": k, "reward": 0.0, "finish_reason": "env_error",
                        "turns": 0, "tokens": 0, "versions": [], "error": f"cannot create the environment: {err}"}
            t = await run_episode(task, env, engine, tokenizer, params, limits, sample_index=k,
                                  trajectory_id=f"eval/{kind}/{task.id}/{k}", executor=env_pool)
        record = {"kind": kind, "id": task.id, "sample": k, "reward": t.reward, "finish_reason": t.finish_reason,
                  "turns": t.num_turns, "tokens": t.num_action_tokens,
                  "versions": sorted({v for v in t.versions if v >= 0})}
        error = (t.metadata.get("info") or {}).get("error")
        if error:
            record["error"] = str(error)[:500]
        return record

    try:
        return list(await asyncio.gather(*(one(*job) for job in jobs)))
    finally:
        env_pool.shutdown(wait=False)


def summarize(records: list[dict[str, Any]], prompts: int) -> dict[str, Any]:
    """The ``eval_*`` metrics of played episodes (see the module docstring)."""
    out: dict[str, Any] = {"eval_prompts": prompts}
    for kind in ("greedy", "sampled"):
        rewards = [r["reward"] for r in records if r["kind"] == kind]
        if rewards:
            out[f"eval_{kind}_reward"] = sum(rewards) / len(rewards)
            out[f"eval_{kind}_n"] = len(rewards)
    out["eval_failed"] = sum(r["finish_reason"] in FAILED for r in records)
    return out


class TrainingEvaluator:
    """Evaluation during one run (rank 0): `run(urls, step, version)` returns the ``eval_*`` metrics."""

    def __init__(self, config, eval_set: EvalSet, tokenizer: Any, token: str | None):
        self.config = config
        self.eval_set = eval_set
        self.tokenizer = tokenizer
        self.token = token

    def due(self, step: int) -> bool:
        every = self.config.eval_every
        return bool(every) and (step % every == 0 or step == self.config.steps)

    def run(self, urls: list[str], step: int, version: int) -> dict[str, Any]:
        started = time.monotonic()
        engine = ServiceEngine(urls, self.token, self.tokenizer, concurrency=self.config.eval_concurrency)
        try:
            if self.eval_set.benchmark is not None:
                metrics = self._benchmark(engine, step, version)
            else:
                records = asyncio.run(play_rl(self.eval_set, engine, self.tokenizer, self.config))
                metrics = summarize(records, len(self.eval_set.tasks))
                detail = {"step": step, "version": version, "eval_data": self.eval_set.source, **metrics,
                          "episodes": records}
                storage.write_text(storage.join(self.config.output, EVAL_DIR, f"step-{step:06d}.json"),
                                   json.dumps(detail) + "\n")
        finally:
            engine.shutdown()
        other = sorted(engine.versions - {version})
        if other:   # the learner pushes nothing while it evaluates: a service answering another version is wrong
            log.warning("evaluation at step %d: rollout services answered with weights versions %s besides %d",
                        step, other, version)
            metrics["eval_other_versions"] = len(other)
        metrics["eval_s"] = time.monotonic() - started
        log.info("evaluation at step %d (version %d): %s", step, version,
                 ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.endswith("_reward")))
        return metrics

    def _benchmark(self, engine: ServiceEngine, step: int, version: int) -> dict[str, Any]:
        from sao_core.eval.config import EvalConfig
        from sao_core.eval.run import evaluate

        config = self.config
        name = self.eval_set.benchmark
        base = {"model": f"{config.output} (weights version {version})", "benchmarks": [name],
                "limit": config.eval_limit or None, "max_new_tokens": config.max_new_tokens_per_turn,
                "max_total_tokens": config.max_total_tokens, "seed": config.seed,
                "concurrency": config.eval_concurrency, "grader_workers": 1, "cache_dir": config.cache_dir,
                "resume": False, **config.eval_options}
        metrics: dict[str, Any] = {}
        runs = ([("greedy", 1, 0.0)] if config.eval_greedy else []) + \
            ([("sampled", config.eval_samples, 1.0)] if config.eval_samples else [])
        for kind, k, temperature in runs:
            output = storage.join(config.output, EVAL_DIR, f"step-{step:06d}", kind)
            summary = evaluate(EvalConfig(**{**base, "output": output, "k": k, "temperature": temperature,
                                             "top_p": 1.0, "top_k": 0}), engine=engine)
            bench = summary["benchmarks"][name]
            metrics[f"eval_{kind}_reward"] = float(bench["scores"][f"avg@{k}"])
            metrics[f"eval_{kind}_n"] = int(bench["samples"])
            metrics["eval_prompts"] = int(bench["problems"])
            metrics["eval_failed"] = metrics.get("eval_failed", 0) + int(bench["counts"].get("error", 0)) \
                + int(bench["counts"].get("timeout", 0))
        return metrics


def eval_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary's evaluation fields from the run's metrics lines: first and last held-out rewards and the
    history (step, version, eval_* values) of every evaluation."""
    history = [{k: v for k, v in r.items() if k in ("step", "version") or k.startswith("eval_")}
               for r in rows if any(k in r for k in ("eval_greedy_reward", "eval_sampled_reward"))]
    out: dict[str, Any] = {"evaluations": history}
    if history:
        for kind in ("greedy", "sampled"):
            key = f"eval_{kind}_reward"
            values = [(h["step"], h[key]) for h in history if key in h]
            if values:
                out[f"{key}_first"] = values[0][1]
                out[f"{key}_last"] = values[-1][1]
        out["eval_prompts"] = history[-1].get("eval_prompts")
    return out
