"""Settings of one evaluation run (`sao evaluate`, the evaluation KFP component)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sao_core.config import setting
from sao_core.eval.judge import JUDGE_APIS

#: Benchmark names, in the order a report lists them.
BENCHMARK_NAMES: tuple[str, ...] = ("swe_verified", "beyond_aime", "imo_answerbench")
ENGINES: tuple[str, ...] = ("hf", "vllm")
SANDBOXES: tuple[str, ...] = ("local", "kubernetes")
JUDGE_POLICIES: tuple[str, ...] = ("unsettled", "rejected")

DEFAULT_MATH_PROMPT = "{problem}\n\nPlease reason step by step, and put your final answer within \\boxed{}."


class EvalError(ValueError):
    """An evaluation cannot run or cannot go on; the message names the benchmark, file, row or field."""


@dataclass
class EvalConfig:
    """One evaluation: `k` samples of every problem of each benchmark, graded, aggregated, reported.

    Lengths are in tokens, times in seconds. Dataset sources may be a Hugging Face id (``org/name``),
    a local file (jsonl, json, csv, parquet), a ``save_to_disk`` folder or an ``s3://`` object.
    """

    model: str = setting(help="model reference: embedded:tiny, a directory, s3:// checkpoint, hub id",
                         section="eval_run")
    output: str = setting(help="run directory: local path or s3:// prefix", section="eval_run")
    adapter: str = setting("", 'LoRA adapter (peft folder with a manifest, or s3://) applied to model: the merged '
                           'model is evaluated; "" none', section="eval_run")
    benchmarks: list[str] = setting(factory=lambda: list(BENCHMARK_NAMES), section="datasets",
                                    help="comma-separated: swe_verified,beyond_aime,imo_answerbench")
    k: int = setting(4, "samples per problem", section="datasets")
    limit: int | None = setting(None, "evaluate only the first N problems of each benchmark", section="datasets")
    engine: str = setting("hf", "hf | vllm", section="eval_run")
    engine_options: dict = setting(factory=dict, section="eval_run", help='extra engine settings, e.g. '
                                   '{"max_batch": 16}; vllm max_model_len defaults to max_total_tokens')
    max_new_tokens: int = setting(4096, "tokens per model turn", section="sampling")
    max_total_tokens: int = setting(32768, "tokens of a whole episode (prompt, turns, observations)",
                                    section="sampling")
    temperature: float = setting(1.0, "sampling temperature (0: greedy)", section="sampling")
    top_p: float = setting(1.0, "nucleus sampling: keep the most likely tokens up to this total probability "
                           "(1: all)", section="sampling")
    top_k: int = setting(0, "0: no top-k", section="sampling")
    seed: int = setting(0, "per-sample seeds derive from it (a resumed run samples the same)", section="eval_run")
    concurrency: int = setting(16, "episodes in flight at once (the engine batches them)", section="eval_run")
    swe_concurrency: int = setting(4, "of those, SWE episodes (each holds a sandbox)", section="swe")
    sample_timeout_s: float = setting(3600.0, "wall-clock limit of one sample (generation, tools, grading); "
                                      "0: none", section="sampling")
    math_prompt: str = setting(DEFAULT_MATH_PROMPT, "user message of the math benchmarks; {problem} is replaced",
                               section="sampling")
    system_prompt: str | None = setting(None, "math benchmarks: optional system message", section="sampling")
    swe_verified_source: str | None = setting(None, "dataset override [default: SWE-bench/SWE-bench_Verified]",
                                              section="datasets")
    beyond_aime_source: str | None = setting(None, "dataset override [default: ByteDance-Seed/BeyondAIME]",
                                             section="datasets")
    imo_answerbench_source: str | None = setting(None, "dataset override [default: the bundled IMO-AnswerBench "
                                                 "v2 CSV]", section="datasets")
    splits: dict = setting(factory=dict, section="datasets", help='split per benchmark for Hugging Face ids, e.g. '
                           '{"beyond_aime": "test"}')
    max_reject_fraction: float = setting(0.0, "share of malformed dataset rows tolerated (they are listed, not "
                                         "evaluated)", section="datasets")
    sandbox: str = setting("local", "SWE sandboxes: local (bubblewrap) | kubernetes (the instance's SWE-bench "
                           "image)", section="swe")
    swe_repo_source: str | None = setting(None, "SWE repositories: directory holding them (a row's repo_path is a "
                                          "name inside it; mirrors owner__name) or 'image'", section="swe")
    swe_max_turns: int = setting(40, "SWE agent turns", section="swe")
    swe_command_timeout_s: float = setting(60.0, "one bash command of the SWE agent", section="swe")
    swe_test_timeout_s: float = setting(1800.0, "running an instance's tests when grading a patch", section="swe")
    env_options: dict = setting(factory=dict, section="swe", help='extra options per environment, e.g. '
                                '{"swe": {"sandbox_options": {"namespace": "eval"}}}')
    grader_workers: int = setting(2, "math-verify worker processes", section="grading")
    grade_timeout_s: float = setting(10.0, "math-verify time per answer", section="grading")
    judge_url: str | None = setting(None, "LLM judge for IMO answers rules cannot settle: an OpenAI-compatible API "
                                    "base (…/v1), or a SAO rollout service (judge_api rollout)", section="grading")
    judge_model: str | None = setting(None, "model name sent to the judge (rollout: only a label)",
                                      section="grading")
    judge_api: str = setting("openai", "openai: /chat/completions | rollout: a SAO rollout service's /v1/generate "
                             "(its bearer token in judge_api_key_env)", section="grading")
    judge_api_key_env: str = setting("SAO_JUDGE_API_KEY", "environment variable holding the judge's API key "
                                     "(unset: no key)", section="grading")
    judge_policy: str = setting("unsettled", "unsettled: judge only answers rules cannot settle | rejected: also "
                                "rule mismatches", section="grading")
    judge_timeout_s: float = setting(120.0, "one judge request", section="grading")
    judge_concurrency: int = setting(4, "judge requests at once", section="grading")
    previous_summary: str | None = setting(None, "summary.json of an earlier run (path or s3://) to compare "
                                           "against", section="eval_run")
    resume: bool = setting(True, "reuse the graded samples in OUTPUT/samples.jsonl (same model and settings)",
                           section="eval_run")
    response_chars: int = setting(4000, "characters of each response (its end) kept in samples.jsonl",
                                  section="eval_run")
    upload_every_s: float = setting(60.0, "s3:// output: upload the samples file this often while running",
                                    section="eval_run")
    cache_dir: str = setting(factory=lambda: str(Path.home() / ".cache" / "sao"), section="eval_run",
                             help="where built and downloaded models live ($SAO_CACHE_DIR, else ~/.cache/sao)")
    unverified: bool = setting(False, "load a local model folder without a manifest.json as it is",
                               section="eval_run")

    def validate(self) -> None:
        """Raise EvalError naming the first bad field."""
        self._check_run()
        self._check_benchmarks()
        self._check_sizes()
        self._check_sampling()
        self._check_times()
        self._check_grading()
        self._check_mappings()

    def _check_run(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise EvalError("model is empty: give a model reference (embedded:tiny, a directory, s3://, org/name)")
        if not isinstance(self.adapter, str):
            raise EvalError(f"adapter must be a folder or s3:// URI of a LoRA adapter ('' = none), got {self.adapter!r}")
        if not isinstance(self.output, str) or not self.output.strip():
            raise EvalError("output is empty: give a local folder or an s3:// prefix")

    def _check_benchmarks(self) -> None:
        names = list(self.benchmarks) if not isinstance(self.benchmarks, str) else [self.benchmarks]
        if not names:
            raise EvalError(f"benchmarks is empty; choose from {', '.join(BENCHMARK_NAMES)}")
        unknown = [n for n in names if n not in BENCHMARK_NAMES]
        if unknown:
            raise EvalError(f"unknown benchmark {unknown[0]!r}; choose from {', '.join(BENCHMARK_NAMES)}")
        if len(set(names)) != len(names):
            raise EvalError(f"benchmarks lists a name twice: {', '.join(names)}")

    def _check_sizes(self) -> None:
        """Counts, token budgets and concurrency (and the engine's name)."""
        _positive_int("k", self.k)
        if self.limit is not None:
            _positive_int("limit", self.limit)
        if self.engine not in ENGINES:
            raise EvalError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        for name in ("max_new_tokens", "max_total_tokens", "concurrency", "swe_concurrency", "swe_max_turns",
                     "grader_workers", "judge_concurrency", "response_chars"):
            _positive_int(name, getattr(self, name))
        if self.max_new_tokens > self.max_total_tokens:
            raise EvalError(f"max_new_tokens ({self.max_new_tokens}) exceeds max_total_tokens ({self.max_total_tokens})")

    def _check_sampling(self) -> None:
        if not _number(self.temperature) or self.temperature < 0:
            raise EvalError(f"temperature must be >= 0, got {self.temperature!r}")
        if not _number(self.top_p) or not 0 < self.top_p <= 1:
            raise EvalError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise EvalError(f"top_k must be an integer >= 0, got {self.top_k!r}")

    def _check_times(self) -> None:
        """Time limits (seconds), the tolerated reject share and the math prompt."""
        for name in ("sample_timeout_s", "upload_every_s"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                raise EvalError(f"{name} must be a number >= 0 (0: none), got {value!r}")
        for name in ("swe_command_timeout_s", "swe_test_timeout_s", "grade_timeout_s", "judge_timeout_s"):
            value = getattr(self, name)
            if not _number(value) or value <= 0:
                raise EvalError(f"{name} must be a number > 0, got {value!r}")
        if not _number(self.max_reject_fraction) or not 0 <= self.max_reject_fraction <= 1:
            raise EvalError(f"max_reject_fraction must be in [0, 1], got {self.max_reject_fraction!r}")
        if "{problem}" not in self.math_prompt:
            raise EvalError("math_prompt must contain {problem} (where the problem text goes)")

    def _check_grading(self) -> None:
        """The SWE sandbox and the LLM judge."""
        if self.sandbox not in SANDBOXES:
            raise EvalError(f"sandbox must be one of {', '.join(SANDBOXES)}, got {self.sandbox!r}")
        if self.judge_policy not in JUDGE_POLICIES:
            raise EvalError(f"judge_policy must be one of {', '.join(JUDGE_POLICIES)}, got {self.judge_policy!r}")
        if self.judge_api not in JUDGE_APIS:
            raise EvalError(f"judge_api must be one of {', '.join(JUDGE_APIS)}, got {self.judge_api!r}")
        if bool(self.judge_url) != bool(self.judge_model):
            raise EvalError("judge_url and judge_model go together: give both to use an LLM judge, or neither")
        if self.judge_url and not str(self.judge_url).startswith(("http://", "https://")):
            raise EvalError(f"judge_url must be an http(s):// URL, got {self.judge_url!r}")

    def _check_mappings(self) -> None:
        for name in ("splits", "env_options", "engine_options"):
            if not isinstance(getattr(self, name), dict):
                raise EvalError(f"{name} must be a mapping, got {getattr(self, name)!r}")
        bad = [key for key in self.splits if key not in BENCHMARK_NAMES]
        if bad:
            raise EvalError(f"splits names unknown benchmark {bad[0]!r}; choose from {', '.join(BENCHMARK_NAMES)}")

    @property
    def benchmark_list(self) -> list[str]:
        return [self.benchmarks] if isinstance(self.benchmarks, str) else list(self.benchmarks)

    def source_for(self, benchmark: str) -> str | None:
        """The dataset override of `benchmark` (None: the benchmark's default source)."""
        value: Any = getattr(self, f"{benchmark}_source")
        return value or None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EvalError(f"{name} must be an integer >= 1, got {value!r}")
