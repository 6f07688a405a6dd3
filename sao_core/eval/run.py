"""The evaluation runner: k samples of every problem through a rollout engine and an environment,
graded, aggregated and reported.

Public entry point: :func:`evaluate` (the `sao evaluate` command and the KFP component call it).

How a sample is played: the benchmark's problem becomes an environment task (`math` for BeyondAIME
and IMO-AnswerBench, `swe` for SWE-Bench Verified), and :func:`sao_core.rollout.episode.run_episode`
plays it on the engine (``hf`` or ``vllm``, `sao_core.rollout.engines`) exactly as the rollout service
does for training. Math episodes are graded inside the `math` environment by the benchmark's grader
(`sao_core.eval.graders`); an answer cut off by the token limit is graded the same way from the text
that was generated. SWE episodes are graded by the `swe` environment when the agent submits (its patch
is tested in a fresh sandbox). Sampling seeds derive from (seed, benchmark, problem id, sample index),
so a resumed or repeated run samples the same way on the same engine.

Outputs (in `EvalConfig.output`, a folder or an ``s3://`` prefix):

- ``samples.jsonl``: one line per sample: ``benchmark, id, sample, status`` (graded | timeout |
  error), ``correct, grade, grader, settled, answer, detail, finish_reason, timed_out, tokens``
  (generated tokens), ``prompt_tokens, turns, seconds`` (wall time of the sample), ``generation_seconds,
  tool_seconds, grade_seconds, seed, groups`` (category, repository, ...), ``response`` (the end of the
  last model turn), SWE: ``patch``, ``tests`` (test counts) and ``harness`` (swebench version, log
  parser, resolution status, whether the log was a valid run, ``test_command``: ``harness`` when the
  record's own eval script ran, ``fallback`` for our commands), plus ``judge`` when the LLM judge ruled;
- ``summary.json``: per benchmark its data set record, scores, counts, graders (with the grading
  libraries' versions, ``library_versions``), breakdowns, token statistics and per-problem results, plus the flat metrics and the comparison with a previous run;
- ``metrics.json``: the flat ``name -> float`` metrics (KFP-ready, e.g. ``imo_answerbench/avg@4``);
- ``report.html``: the report (`sao_core.eval.report.write_report`);
- ``run.json``: the settings that make samples comparable (checked when resuming), and the versions of
  the grading libraries (``library_versions``: ``swebench``, ``math-verify``, ...; recorded only);
- ``datasets/<benchmark>/``: the normalised data (``data.jsonl``, ``rejects.jsonl``, ``stats.json``).

A LoRA adapter (`EvalConfig.adapter`, a peft folder with a manifest or an ``s3://`` checkpoint) is merged into
`model` once, before anything else, by `sao_core.training.merge.merge_checkpoint` into a scratch folder under
``cache_dir/scratch`` (removed at the end); that merged model is evaluated exactly as a full model is (``hf`` or
``vllm``). ``run.json`` and the summary record ``model`` (the base) and ``adapter`` with its manifest digest
(``adapter_sha256``).

Resuming: with `resume` (the default), samples already in ``samples.jsonl`` with status ``graded`` or
``timeout`` are kept and not generated again; ``error`` samples (a sandbox or engine failure) are
redone. A different model, sampling settings, prompt or data-set version in ``run.json`` stops the run
with an error instead of mixing samples.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.eval.benchmarks import LoadedBenchmark, get_benchmark, group_values, load_benchmark, task_for
from sao_core.eval.config import EvalConfig, EvalError
from sao_core.eval.graders import ImoGrader, IntegerGrader, LLMJudge, Verdict, verdict_from_swe_report
from sao_core.eval.metrics import benchmark_metrics, compare, flat_metrics
from sao_core.eval.summary import SUMMARY_FILE, load_summary
from sao_core.eval.versions import grader_versions, versions_for_grader

log = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
METRICS_FILE = "metrics.json"
REPORT_FILE = "report.html"
RUN_FILE = "run.json"
DATASETS_DIR = "datasets"
SUMMARY_SCHEMA = 1
_MAX_PATCH_CHARS = 100_000
_MAX_LISTED = 200

Progress = Callable[[int, int], None]


# ------------------------------------------------------------------------------------------ options

def swe_env_options(config: EvalConfig) -> dict[str, Any]:
    """Keyword arguments of the `swe` environment (`SWEEnv`) for this run: sandbox kind, turns,
    timeouts and repository source from the config, then ``config.env_options["swe"]`` on top."""
    options: dict[str, Any] = {
        "sandbox_kind": config.sandbox,
        "max_turns": config.swe_max_turns,
        "command_timeout_s": config.swe_command_timeout_s,
        "test_timeout_s": config.swe_test_timeout_s,
        "repo_source": config.swe_repo_source,
    }
    options.update(config.env_options.get("swe") or {})
    return options


def sample_seed(seed: int, benchmark: str, problem_id: str, index: int) -> int:
    """The sampling seed of one sample: 31 bits of sha256(seed/benchmark/id/index)."""
    digest = hashlib.sha256(f"{seed}/{benchmark}/{problem_id}/{index}".encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def run_settings(config: EvalConfig, loaded: list[LoadedBenchmark], adapter_sha256: str | None = None
                 ) -> dict[str, Any]:
    """What must be equal for samples of two runs to be mixed (stored in ``run.json``); `adapter_sha256`: the
    manifest digest of `config.adapter`."""
    prompt = f"{config.system_prompt or ''}\x00{config.math_prompt}"
    return {
        "model": config.model,
        "adapter": config.adapter or None,
        "adapter_sha256": adapter_sha256,
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
                     "max_new_tokens": config.max_new_tokens, "max_total_tokens": config.max_total_tokens,
                     "seed": config.seed},
        "prompt_sha256": hashlib.sha256(prompt.encode()).hexdigest(),
        "datasets": {b.spec.name: b.dataset.version for b in loaded},
        # the grading libraries' versions (swebench's harness, math-verify, ...): recorded, not checked on resume
        "library_versions": grader_versions(),
    }


# ------------------------------------------------------------------------------------------ output

class _Output:
    """The run directory: the folder itself, or a local staging folder uploaded to an s3:// prefix."""

    def __init__(self, uri: str):
        self.uri = uri
        self.s3 = storage.is_s3_uri(uri)
        if self.s3:
            storage.parse_s3_uri(uri)   # a malformed URI fails here, before any work
            self.local = Path(tempfile.mkdtemp(prefix="sao-eval-"))
        else:
            self.local = Path(uri).expanduser()
            if self.local.exists() and not self.local.is_dir():
                raise EvalError(f"output {uri} exists and is not a folder")
            try:
                self.local.mkdir(parents=True, exist_ok=True)
            except OSError as err:
                raise EvalError(f"cannot create the output folder {uri}: {err}") from err
        self._last_upload = time.monotonic()

    def uri_of(self, name: str) -> str:
        return storage.join(self.uri, name) if self.s3 else str(self.local / name)

    def fetch(self, name: str) -> None:
        """s3 output: copy `name` down when it exists there (a resumed run)."""
        if self.s3 and storage.exists(storage.join(self.uri, name)):
            storage.download_file(storage.join(self.uri, name), self.local / name)

    def upload(self, *names: str) -> None:
        if not self.s3:
            return
        for name in names:
            path = self.local / name
            if path.is_dir():
                storage.upload_dir(path, storage.join(self.uri, name))
            elif path.exists():
                storage.upload_file(path, storage.join(self.uri, name))
        self._last_upload = time.monotonic()

    def upload_due(self, every_s: float) -> bool:
        return self.s3 and every_s > 0 and time.monotonic() - self._last_upload >= every_s

    def close(self) -> None:
        if self.s3:
            shutil.rmtree(self.local, ignore_errors=True)


class _SampleStore:
    """``samples.jsonl``: read at start (the last line of a slot wins; a torn last line is skipped),
    appended to (and flushed) as samples finish."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[tuple[str, str, int], dict[str, Any]] = {}
        self.unreadable = 0
        text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                record = json.loads(line)
                key = (str(record["benchmark"]), str(record["id"]), int(record["sample"]))
            except (ValueError, KeyError, TypeError):
                self.unreadable += 1
                continue
            self.records[key] = record
        if self.unreadable or (text and not text.endswith("\n")):
            # a torn last line (an interrupted write) would swallow the next appended record: rewrite the
            # file with the readable records first
            log.warning("%s: dropped %d unreadable line(s) (an interrupted write?); those samples are redone",
                        path, self.unreadable)
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(json.dumps(r, ensure_ascii=False, default=str) + "\n"
                                   for r in self.records.values()), encoding="utf-8")
            os.replace(tmp, path)
        self._fh = open(path, "a", encoding="utf-8")  # noqa: SIM115  (closed in close())

    def done(self, key: tuple[str, str, int]) -> bool:
        record = self.records.get(key)
        return record is not None and record.get("status") != "error"

    def append(self, record: dict[str, Any]) -> None:
        self._fh.write(json.dumps(record, ensure_ascii=False, default=str) + "\n")
        self._fh.flush()
        self.records[(record["benchmark"], record["id"], record["sample"])] = record

    def of(self, benchmark: str) -> list[dict[str, Any]]:
        return [r for (b, _, _), r in self.records.items() if b == benchmark]

    def close(self) -> None:
        self._fh.close()


def _check_resume(output: _Output, settings: dict[str, Any], resume: bool) -> None:
    path = output.local / RUN_FILE
    if not resume:
        for name in (SAMPLES_FILE, RUN_FILE):
            (output.local / name).unlink(missing_ok=True)
        return
    samples = output.local / SAMPLES_FILE
    if not path.exists() or not samples.exists() or not samples.read_text(encoding="utf-8").strip():
        return                            # no samples yet (e.g. the last run stopped before any): nothing to mix
    try:
        before = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as err:
        raise EvalError(f"{output.uri_of(RUN_FILE)} is not JSON ({err}); remove it or set resume=false") from err
    problems = []
    for key in ("model", "sampling", "prompt_sha256", "adapter"):
        if before.get(key) != settings[key]:
            problems.append(f"{key}: {before.get(key)!r} there, {settings[key]!r} now")
    if settings["adapter"] and before.get("adapter_sha256") != settings["adapter_sha256"]:
        problems.append(f"adapter_sha256 (the adapter's files): {before.get('adapter_sha256')!r} there, "
                        f"{settings['adapter_sha256']!r} now")
    for name, version in settings["datasets"].items():
        old = (before.get("datasets") or {}).get(name)
        if old is not None and old != version:
            problems.append(f"{name} data set version: {old} there, {version} now")
    if problems:
        raise EvalError(f"output {output.uri} holds samples of a different run ({'; '.join(problems)}); use a new "
                        "output, or resume=false (--no-resume) to start over there")


# ------------------------------------------------------------------------------------------ grading glue

class _EpisodeGrader:
    """Given to the `math` environment as its grader: grades with the benchmark's grader and keeps the
    full Verdict (the environment only passes on correct / reason / detail)."""

    def __init__(self, grade: Callable[[str | None], Verdict]):
        self._grade = grade
        self.verdict: Verdict | None = None

    def grade(self, answer: str | None, gold: str, timeout_s: float | None = None) -> Any:
        from sao_core.envs.grading import GradeResult

        self.verdict = self._grade(answer)
        return GradeResult(self.verdict.correct, self.verdict.grade, self.verdict.detail, self.verdict.seconds)


class _Graders:
    """The graders of one run (math-verify workers and the judge are shared by all samples)."""

    def __init__(self, config: EvalConfig):
        from sao_core.envs.grading import MathGrader

        self.math = MathGrader(max_workers=config.grader_workers, timeout_s=config.grade_timeout_s)
        self.judge = None
        if config.judge_url and config.judge_model:
            key = os.environ.get(config.judge_api_key_env) if config.judge_api_key_env else None
            self.judge = LLMJudge(config.judge_url, config.judge_model, api_key=key, timeout_s=config.judge_timeout_s,
                                  concurrency=config.judge_concurrency, api=config.judge_api)
        self.imo = ImoGrader(self.math, config.grade_timeout_s, self.judge, config.judge_policy)
        self.integer = IntegerGrader()

    def warm_up(self, workers: int) -> None:
        """Have the math-verify workers started and ready now (a new one takes about a second: an interpreter
        and sympy's import; an earlier evaluation's, kept by this process, none), so the first samples'
        timings and timeouts do not pay for it."""
        for problem in self.math.warm_up(workers):
            log.warning("math grader worker: %s", problem)

    def for_benchmark(self, name: str):
        return self.integer if name == "beyond_aime" else self.imo

    def close(self) -> None:
        self.math.close()
        if self.judge is not None:
            self.judge.close()


# ------------------------------------------------------------------------------------------ one sample

def _last_turn(trajectory: Any) -> list[int]:
    """Token ids of the last model turn (the last run of action tokens)."""
    ids, mask = trajectory.token_ids, trajectory.action_mask
    end = len(mask)
    while end > 0 and not mask[end - 1]:
        end -= 1
    start = end
    while start > 0 and mask[start - 1]:
        start -= 1
    return ids[start:end]


def _cut_tail(text: str | None, limit: int) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return f"[... {len(text) - limit} characters cut]" + text[-limit:]


async def _play(config: EvalConfig, bench: LoadedBenchmark, record: dict[str, Any], index: int, engine: Any,
                tokenizer: Any, graders: _Graders, executor: ThreadPoolExecutor | None = None) -> dict[str, Any]:
    """Play and grade sample `index` of one problem; its samples.jsonl record."""
    from sao_core.rollout.engines import SamplingParams
    from sao_core.rollout.episode import EpisodeLimits, action_text, run_episode

    spec = bench.spec
    problem_id = str(record["id"])
    seed = sample_seed(config.seed, spec.name, problem_id, index)
    task = task_for(spec, record, config.math_prompt, config.system_prompt)
    env, recorder, grader = _sample_env(config, spec, record, graders)
    params = SamplingParams(temperature=config.temperature, top_p=config.top_p, top_k=config.top_k,
                            max_new_tokens=config.max_new_tokens, seed=seed)
    limits = EpisodeLimits(config.max_total_tokens, config.max_new_tokens, config.sample_timeout_s)
    started = time.monotonic()
    trajectory = await run_episode(task, env, engine, tokenizer, params, limits, sample_index=index,
                                   trajectory_id=f"{spec.name}/{problem_id}/{index}", executor=executor)
    finish = trajectory.finish_reason
    info = dict(trajectory.metadata.get("info") or {})
    response = action_text(tokenizer, _last_turn(trajectory))
    grade_started = time.monotonic()
    verdict, extra = await _sample_verdict(config, spec.env, record, finish, info, response, recorder, grader)
    status = "timeout" if finish == "timeout" else "error" if finish in ("env_error", "tool_error") else "graded"
    extra.update(_verdict_details(spec.env, verdict))
    prompt_tokens = next((i for i, m in enumerate(trajectory.action_mask) if m), len(trajectory.action_mask))
    return {
        "benchmark": spec.name,
        "id": problem_id,
        "sample": index,
        "status": status,
        "correct": bool(verdict.correct) and status == "graded",
        "grade": verdict.grade,
        "grader": verdict.grader,
        "settled": verdict.settled,
        "rule": verdict.extra.get("rule") if verdict.grader == "rule" else verdict.grader,
        "answer": verdict.answer,
        "detail": verdict.detail[:2000],
        "finish_reason": finish,
        "timed_out": finish == "timeout",
        "tokens": trajectory.num_action_tokens,
        "prompt_tokens": prompt_tokens,
        "turns": trajectory.num_turns,
        "seconds": round(time.monotonic() - started, 3),
        "generation_seconds": round(trajectory.timings.generation_seconds, 3),
        "tool_seconds": round(trajectory.timings.tool_seconds, 3),
        "grade_seconds": round(verdict.seconds or (time.monotonic() - grade_started), 3),
        "seed": seed,
        "groups": group_values(spec, record),
        "response": _cut_tail(response, config.response_chars),
        **extra,
    }


def _sample_env(config: EvalConfig, spec: Any, record: dict[str, Any],
                graders: _Graders) -> tuple[Any, _EpisodeGrader | None, Any]:
    """(environment, the recorder that keeps its verdict, the benchmark's grader) of one sample: a `math`
    environment grading with the benchmark's grader, else a `swe` one (no recorder, no grader)."""
    from sao_core.envs import make_env

    if spec.env != "math":
        return make_env("swe", **swe_env_options(config)), None, None
    grader = graders.for_benchmark(spec.name)
    recorder = _EpisodeGrader(lambda answer: grader.grade(answer, record["answer"], record))
    env = make_env("math", **{**(config.env_options.get("math") or {}), "grader": recorder,
                              "grade_timeout_s": config.grade_timeout_s})
    return env, recorder, grader


async def _sample_verdict(config: EvalConfig, env: str, record: dict[str, Any], finish: str, info: dict[str, Any],
                          response: str, recorder: _EpisodeGrader | None,
                          grader: Any) -> tuple[Verdict, dict[str, Any]]:
    """The verdict on a played sample, and the record's extra fields it brings (a SWE sample's patch)."""
    from sao_core.envs.grading import extract_boxed

    if finish == "timeout":
        return Verdict(False, "timeout", None, extract_boxed(response) if env == "math" else None,
                       f"the sample took longer than sample_timeout_s = {config.sample_timeout_s:g} s"), {}
    if finish in ("env_error", "tool_error"):
        return Verdict(False, "error", None, None, str(info.get("error") or finish)), {}
    if env == "math":
        verdict = recorder.verdict if recorder is not None and recorder.verdict is not None else None
        if verdict is None:   # cut off by the token limit: grade what was written
            verdict = await asyncio.to_thread(grader.grade, extract_boxed(response), record["answer"], record)
        return verdict, {}
    if isinstance(info.get("grade"), dict):
        return (verdict_from_swe_report(info["grade"], info.get("patch")),
                {"patch": _cut_tail(info.get("patch"), _MAX_PATCH_CHARS)})
    return Verdict(False, "no_submission", None, None,
                   f"the agent did not submit a patch (episode ended: {finish})"), {}


def _verdict_details(env: str, verdict: Verdict) -> dict[str, Any]:
    """What the record shows of the grader's workings: a SWE sample's test counts and harness, a judge's
    opinion next to the rules' grade."""
    details: dict[str, Any] = {}
    if env == "swe":
        details["tests"] = {k: v for k, v in verdict.extra.items() if k.endswith(("_total", "_passed", "_failed"))}
        if verdict.extra.get("harness"):     # what the SWE-bench harness decided, and which one
            details["harness"] = {k: verdict.extra.get(k) for k in ("harness", "log_parser", "resolution",
                                                                     "log_valid", "test_command")}
    if "judge" in verdict.extra:
        details["judge"] = verdict.extra["judge"]
        details["rule_grade"] = verdict.extra.get("rule_grade")
    return details


def _failed_sample(config: EvalConfig, bench: LoadedBenchmark, record: dict[str, Any], index: int,
                   detail: str) -> dict[str, Any]:
    """The record of a sample that could not be played at all (status ``error``: redone on resume)."""
    problem_id = str(record["id"])
    return {"benchmark": bench.spec.name, "id": problem_id, "sample": index, "status": "error", "correct": False,
            "grade": "error", "grader": None, "settled": True, "answer": None, "detail": detail[:2000],
            "finish_reason": "env_error", "timed_out": False, "tokens": 0, "prompt_tokens": 0, "turns": 0,
            "seconds": 0.0, "generation_seconds": 0.0, "tool_seconds": 0.0, "grade_seconds": 0.0,
            "seed": sample_seed(config.seed, bench.spec.name, problem_id, index),
            "groups": group_values(bench.spec, record), "response": None}


# ------------------------------------------------------------------------------------------ the run

def _make_engine(config: EvalConfig, model: str | None = None) -> Any:
    """The engine of `config` on `model` (default: config.model; the merged model of an adapter run)."""
    from sao_core.models import ModelLoadError
    from sao_core.rollout.engines import EngineError, make_engine

    options = dict(config.engine_options)
    options.setdefault("seed", config.seed)
    options["unverified"] = config.unverified or bool(options.get("unverified"))
    if config.engine == "vllm" and not options.get("max_model_len"):
        options["max_model_len"] = config.max_total_tokens   # the context the run needs (checked by _check_context)
    try:
        return make_engine(config.engine, model or config.model, config.cache_dir, **options)
    except ModelLoadError as err:
        raise EvalError(f"cannot load the model: {err}") from err
    except EngineError as err:
        raise EvalError(f"cannot start the {config.engine} engine for model {config.model!r}: {err}") from err
    except TypeError as err:
        raise EvalError(f"engine_options {config.engine_options!r} do not fit the {config.engine} engine: {err}") from err


async def _generate(config: EvalConfig, loaded: list[LoadedBenchmark], todo: list[tuple[int, dict, int]],
                    store: _SampleStore, output: _Output, progress: Progress | None, total: int,
                    done_before: int, given_engine: Any = None, model: str | None = None) -> int:
    graders = _Graders(config)
    # The math-verify workers start in a thread (now: run_in_executor submits at once) while the model loads.
    warming = (asyncio.get_running_loop().run_in_executor(None, graders.warm_up, config.grader_workers)
               if any(b.spec.grader == "math_rule" for b in loaded) else None)
    try:
        engine = given_engine if given_engine is not None else _make_engine(config, model)
    except BaseException:
        if warming is not None:
            await asyncio.gather(warming, return_exceptions=True)
        await asyncio.to_thread(graders.close)
        raise
    if warming is not None:
        await warming
    slots = asyncio.Semaphore(config.concurrency)
    swe_slots = asyncio.Semaphore(config.swe_concurrency)
    # A thread per concurrent sample for environment calls (sandboxed tests wait on processes).
    env_pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="sao-eval-env")
    finished = 0

    async def one(bench_index: int, record: dict, index: int) -> dict[str, Any]:
        bench = loaded[bench_index]
        async with slots:
            try:
                if bench.spec.env == "swe":
                    async with swe_slots:
                        return await _play(config, bench, record, index, engine, engine.tokenizer, graders, env_pool)
                return await _play(config, bench, record, index, engine, engine.tokenizer, graders, env_pool)
            except Exception as err:   # e.g. environment options that do not fit: this sample failed
                log.warning("%s %s sample %d failed: %s: %s", bench.spec.name, record["id"], index,
                            type(err).__name__, err)
                return _failed_sample(config, bench, record, index, f"{type(err).__name__}: {err}")

    pending = [asyncio.ensure_future(one(*item)) for item in todo]
    try:
        for next_done in asyncio.as_completed(pending):
            record = await next_done
            store.append(record)
            finished += 1
            if progress is not None:
                progress(done_before + finished, total)
            if output.upload_due(config.upload_every_s):
                await asyncio.to_thread(output.upload, SAMPLES_FILE)
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        if given_engine is None:
            await engine.close()
        await asyncio.to_thread(graders.close)
        env_pool.shutdown(wait=False)
    return finished


def _check_context(config: EvalConfig, engine: Any) -> None:
    """max_total_tokens must fit a given engine's context, or else (before an engine starts) the model's and a
    vllm max_model_len set in engine_options."""
    from sao_core.models import check_model_context
    from sao_core.rollout.engines import check_context

    try:
        if engine is not None:
            check_context(engine, config.max_total_tokens, "max_total_tokens")
            return
        check_model_context(config.model, config.cache_dir, config.max_total_tokens)
    except ValueError as err:
        raise EvalError(str(err)) from err
    chosen = config.engine_options.get("max_model_len") if config.engine == "vllm" else None
    if chosen and chosen < config.max_total_tokens:
        raise EvalError(f"max_total_tokens {config.max_total_tokens} exceeds the engine's context of {chosen} tokens "
                        "(engine_options max_model_len); raise max_model_len or lower max_total_tokens")


def fit_budget_to_context(config: EvalConfig, explicit: Collection[str]) -> EvalConfig:
    """`config` with its token budget fitted to the model's context (`sao evaluate`): max_total_tokens (and
    max_new_tokens, where it then exceeds it) left at its default and above the context (the model's, or a vllm
    max_model_len in engine_options when lower) is lowered to the context, with one log line; one the user set
    (named in `explicit`) above it raises EvalError naming the setting and both numbers. Unknown context: as is."""
    from sao_core.models.loading import model_context_length

    limits = [n for n in (model_context_length(config.model, config.cache_dir),
                          config.engine_options.get("max_model_len") if config.engine == "vllm" else None)
              if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    if not limits:
        return config
    limit = min(limits)
    changes: dict[str, int] = {}
    for name in ("max_total_tokens", "max_new_tokens"):
        value = getattr(config, name)
        if value <= limit:
            continue
        if name in explicit:
            raise EvalError(f"{name} {value} (set explicitly) exceeds the context of model {config.model!r}: "
                            f"{limit} tokens; set {name} to at most {limit}")
        changes[name] = limit
    if changes:
        log.info("fitting the token budget to the model's %d-token context: %s", limit,
                 ", ".join(f"{name} {getattr(config, name)} -> {value}" for name, value in changes.items()))
        config = dataclasses.replace(config, **changes)
    return config


def _check_swe_settings(config: EvalConfig) -> None:
    options = swe_env_options(config)
    kind = options.get("sandbox_kind", "local")
    if options.get("repo_source") == "local":
        raise EvalError("swe_repo_source 'local' (repositories wherever a data set row's repo_path points on this "
                        "machine) is no longer accepted: rows cannot choose host paths; set swe_repo_source to the "
                        "directory that holds the repositories (repo_path is then a name inside it)")
    if kind == "local" and options.get("sandbox_factory") is None and options.get("repo_source") in (None, "image"):
        raise EvalError("swe_verified with the local sandbox needs the repositories on this machine: set "
                        "swe_repo_source to a directory of git mirrors (<owner>__<name>), or use sandbox=kubernetes "
                        "(each instance runs in its SWE-bench image)")


def _merge_adapter(config: EvalConfig) -> dict[str, Any]:
    """Merge `config.adapter` into `config.model` (`merge_checkpoint`) in a scratch folder under the cache:
    ``{"model": the merged folder, "adapter_sha256", "sha256", "scratch"}``. EvalError before any other work when
    the adapter is missing, unverified, not an adapter or does not fit the model."""
    from sao_core.models import ModelLoadError
    from sao_core.training.merge import merge_checkpoint

    root = Path(config.cache_dir).expanduser() / "scratch"
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise EvalError(f"cannot create the scratch folder {root} for the merged model: {err}") from err
    scratch = Path(tempfile.mkdtemp(prefix="eval-merged-", dir=root))
    unverified = config.unverified or bool(config.engine_options.get("unverified"))
    try:
        merged = merge_checkpoint(config.model, config.adapter, str(scratch / "model"), config.cache_dir,
                                  unverified=unverified)
    except (ValueError, ModelLoadError, storage.StorageError) as err:
        shutil.rmtree(scratch, ignore_errors=True)
        raise EvalError(f"cannot apply the adapter: {err}") from err
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    log.info("evaluating %s with adapter %s merged in (%s)", config.model, config.adapter, merged["model"])
    return {**merged, "scratch": scratch}


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def evaluate(config: EvalConfig, progress: Progress | None = None, *, engine: Any = None) -> dict[str, Any]:
    """Run an evaluation and write its outputs (see the module docstring); returns the summary.

    `progress(done, total)` is called after every finished sample (counts of samples, reused ones
    included). `engine` (optional) is an already started `sao_core.rollout.engines.Engine` with a
    ``tokenizer`` attribute to generate with instead of starting ``config.engine`` on ``config.model``
    (e.g. a colocated service's engine); it is not closed. `config.model` still names the run. The summary is the content of ``summary.json``: ``model, adapter,
    adapter_sha256`` (None without an adapter; with one also ``merged_model_sha256``), ``engine, started_at,
    finished_at, seconds`` (wall time), ``samples_generated, samples_reused, config, benchmarks``
    (per benchmark: ``title, dataset, problems, k, samples, scores, counts, graders, groups, tokens,
    per_problem, unsettled, errors``), ``metrics`` (flat name -> float, as in ``metrics.json``),
    ``comparison`` (None or ``{"previous", "model", "metrics": {name: {current, previous, delta}}}``)
    and ``files`` (where each output went). Raises EvalError for bad settings, unreadable data or
    previous summary, a model that cannot be loaded, an adapter that cannot be merged into it (before any other
    work), or when every sample failed.
    """
    started, started_at = time.monotonic(), _now()
    specs = _checked_specs(config, engine)
    merged = _merge_adapter(config) if config.adapter else None
    try:
        output = _Output(config.output)
    except BaseException:
        if merged is not None:
            shutil.rmtree(merged["scratch"], ignore_errors=True)
        raise
    try:
        previous = load_summary(config.previous_summary) if config.previous_summary else None
        loaded = [
            load_benchmark(spec, config.source_for(spec.name), config.splits.get(spec.name), config.limit,
                           config.max_reject_fraction, output.local / DATASETS_DIR / spec.name)
            for spec in specs
        ]
        settings = run_settings(config, loaded, merged["adapter_sha256"] if merged else None)
        _start_run_files(output, settings, config.resume)
        samples, generated, total, reused = _run_samples(config, loaded, output, progress, engine,
                                                         merged["model"] if merged else None)
        summary = summarize(config, loaded, samples, previous, equivalent=_voting_equivalence(config, loaded))
        if engine is not None:
            summary["engine"] = f"{type(engine).__name__} (given)"
        if merged is not None:
            summary.update(adapter_sha256=merged["adapter_sha256"], merged_model_sha256=merged["sha256"])
        summary.update(started_at=started_at, finished_at=_now(), seconds=round(time.monotonic() - started, 3),
                       samples_generated=generated, samples_reused=reused,
                       files={key: output.uri_of(name) for key, name in (
                           ("samples", SAMPLES_FILE), ("summary", SUMMARY_FILE), ("metrics", METRICS_FILE),
                           ("report", REPORT_FILE), ("run", RUN_FILE), ("datasets", DATASETS_DIR))})
        _write_outputs(output, summary, [s for b in loaded for s in samples[b.spec.name]], previous)
    finally:
        output.close()
        if merged is not None:
            shutil.rmtree(merged["scratch"], ignore_errors=True)
    _check_not_all_failed(config, summary, total)
    return summary


def _checked_specs(config: EvalConfig, engine: Any) -> list[Any]:
    """The benchmark specs of `config`, after every check that needs no data: the settings, the SWE settings,
    the context, and no adapter with a given engine."""
    try:
        config.validate()
    except EvalError:
        raise
    except (TypeError, ValueError) as err:
        raise EvalError(f"bad evaluation settings: {err}") from err
    specs = [get_benchmark(name) for name in config.benchmark_list]
    if any(spec.env == "swe" for spec in specs):
        _check_swe_settings(config)
    _check_context(config, engine)
    if config.adapter and engine is not None:
        raise EvalError("adapter cannot be applied to a given engine: evaluate with the engine's own weights, or "
                        "without engine= so the merged model gets its own")
    return specs


def _start_run_files(output: _Output, settings: dict[str, Any], resume: bool) -> None:
    """Fetch the earlier run's files when resuming (and check they belong to this run), then write run.json."""
    if resume:
        output.fetch(RUN_FILE)
        output.fetch(SAMPLES_FILE)
    _check_resume(output, settings, resume)
    (output.local / RUN_FILE).write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


def _run_samples(config: EvalConfig, loaded: list[LoadedBenchmark], output: _Output, progress: Progress | None,
                 engine: Any, model: str | None) -> tuple[dict[str, list[dict[str, Any]]], int, int, int]:
    """Generate and grade every sample not done yet (appended to samples.jsonl); return (this run's samples by
    benchmark, samples generated, samples in all, samples reused)."""
    store = _SampleStore(output.local / SAMPLES_FILE)
    try:
        todo, total, reused = _plan_samples(config, loaded, store)
        log.info("evaluating %s%s on %s: %d samples to generate, %d reused", config.model,
                 f" + adapter {config.adapter}" if config.adapter else "", ", ".join(b.spec.name for b in loaded),
                 len(todo), reused)
        if progress is not None:
            progress(reused, total)
        generated = asyncio.run(_generate(config, loaded, todo, store, output, progress, total, reused,
                                          engine, model)) if todo else 0
    finally:
        store.close()
    samples = {b.spec.name: _in_scope(b, store.of(b.spec.name), config.k) for b in loaded}
    return samples, generated, total, reused


def _plan_samples(config: EvalConfig, loaded: list[LoadedBenchmark],
                  store: _SampleStore) -> tuple[list[tuple[int, dict, int]], int, int]:
    """(samples to generate as (benchmark index, record, sample index), samples in all, samples reused)."""
    todo, total, reused = [], 0, 0
    for index in range(config.k):             # sample 0 of every problem first: early results are balanced
        for b, bench in enumerate(loaded):
            for record in bench.records:
                total += 1
                if store.done((bench.spec.name, str(record["id"]), index)):
                    reused += 1
                else:
                    todo.append((b, record, index))
    return todo, total, reused


def _write_outputs(output: _Output, summary: dict[str, Any], samples: list[dict[str, Any]],
                   previous: dict[str, Any] | None) -> None:
    """summary.json, metrics.json and the report, then upload every output (s3://)."""
    from sao_core.eval.report import write_report

    (output.local / SUMMARY_FILE).write_text(json.dumps(summary, indent=2, ensure_ascii=False, default=str) + "\n",
                                             encoding="utf-8")
    (output.local / METRICS_FILE).write_text(json.dumps(summary["metrics"], indent=2, sort_keys=True) + "\n",
                                             encoding="utf-8")
    write_report(summary, samples, str(output.local), previous)
    output.upload(SAMPLES_FILE, RUN_FILE, SUMMARY_FILE, METRICS_FILE, REPORT_FILE, DATASETS_DIR)


def _check_not_all_failed(config: EvalConfig, summary: dict[str, Any], total: int) -> None:
    errors = sum(bench["counts"].get("error", 0) for bench in summary["benchmarks"].values())
    if total and errors == total:
        first = next((b["errors"][0] for b in summary["benchmarks"].values() if b["errors"]), {})
        raise EvalError(f"all {total} samples failed (outputs written to {config.output}); first: "
                        f"{first.get('benchmark')} {first.get('id')}: {first.get('detail')}")


def _in_scope(bench: LoadedBenchmark, samples: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
    """The samples of this run's problems and sample indices (a resumed folder may hold more)."""
    ids = {str(r["id"]) for r in bench.records}
    return [s for s in samples if str(s.get("id")) in ids and isinstance(s.get("sample"), int) and s["sample"] < k]


class _Voting:
    """The IMO-AnswerBench maj@k equivalence: two answers are one vote when the exact rules match them
    (`ImoGrader.rule`, in math-grader workers started on first use; closed by `close`)."""

    def __init__(self, config: EvalConfig):
        self.config = config
        self.grader: Any = None

    def __call__(self, a: str, b: str) -> bool:
        from sao_core.envs.grading import MathGrader

        if self.grader is None:
            self.grader = MathGrader(max_workers=1, timeout_s=self.config.grade_timeout_s)
        return ImoGrader(self.grader, self.config.grade_timeout_s).rule(a, b).correct

    def close(self) -> None:
        if self.grader is not None:
            self.grader.close()


def _voting_equivalence(config: EvalConfig, loaded: list[LoadedBenchmark]) -> dict[str, Any]:
    return {b.spec.name: _Voting(config) for b in loaded if b.spec.grader == "math_rule" and b.spec.majority}


def summarize(config: EvalConfig, loaded: list[LoadedBenchmark], samples: dict[str, list[dict[str, Any]]],
              previous: dict[str, Any] | None = None,
              equivalent: dict[str, Any] | None = None) -> dict[str, Any]:
    """The summary of graded samples (without the timing and file fields `evaluate` adds). `equivalent`
    maps a benchmark to its maj@k equivalence (`sao_core.eval.metrics.majority_correct`; objects with a
    ``close()`` are closed here); without one, votes are grouped by normalised text."""
    try:
        return _summarize(config, loaded, samples, previous, equivalent or {})
    finally:
        for same in (equivalent or {}).values():
            if hasattr(same, "close"):
                same.close()


def _summarize(config: EvalConfig, loaded: list[LoadedBenchmark], samples: dict[str, list[dict[str, Any]]],
               previous: dict[str, Any] | None, equivalent: dict[str, Any]) -> dict[str, Any]:
    benchmarks: dict[str, Any] = {}
    for bench in loaded:
        spec = bench.spec
        current = _in_scope(bench, samples.get(spec.name, []), config.k)
        metrics = benchmark_metrics(bench.records, current, config.k, spec.groups, spec.majority,
                                    integer=spec.grader == "exact_int", equivalent=equivalent.get(spec.name))
        unsettled = [{"id": s["id"], "sample": s["sample"], "answer": s.get("answer"), "detail": s.get("detail")}
                     for s in current if s.get("settled") is False and s.get("status") == "graded"]
        errors = [{"benchmark": spec.name, "id": s["id"], "sample": s["sample"], "detail": s.get("detail")}
                  for s in current if s.get("status") == "error"]
        benchmarks[spec.name] = {
            "title": spec.title,
            "grader": spec.grader,
            "library_versions": versions_for_grader(spec.grader),
            "dataset": bench.dataset.to_dict(),
            **metrics,
            "unsettled_total": len(unsettled),
            "unsettled": unsettled[:_MAX_LISTED],
            "errors_total": len(errors),
            "errors": errors[:_MAX_LISTED],
        }
    flat = flat_metrics(benchmarks)
    public = dataclasses.asdict(config)
    comparison = None
    if previous is not None:
        comparison = {"model": previous.get("model"), "finished_at": previous.get("finished_at"),
                      "previous": config.previous_summary, "metrics": compare(flat, previous.get("metrics", {}))}
    return {"schema": SUMMARY_SCHEMA, "model": config.model, "adapter": config.adapter or None,
            "adapter_sha256": None, "engine": config.engine, "config": public,
            "benchmarks": benchmarks, "metrics": flat, "comparison": comparison}
