"""The evaluator: SWE-Bench Verified, BeyondAIME and IMO-AnswerBench through the rollout engines and
environments, with graders, metrics and an HTML report.

Public API (stable; the KFP evaluation component calls these two functions):

- :func:`evaluate` (`sao_core.eval.run`): ``evaluate(config: EvalConfig, progress=None) -> dict`` runs
  the evaluation and writes ``samples.jsonl``, ``summary.json``, ``metrics.json`` and ``report.html``
  to ``config.output``; returns the summary.
- :func:`write_report` (`sao_core.eval.report`): ``write_report(summary, samples, output, previous=None)
  -> str`` writes ``report.html`` and returns its path or URI.
"""

from sao_core.eval.benchmarks import BENCHMARKS, BenchmarkSpec, get_benchmark, load_benchmark
from sao_core.eval.config import BENCHMARK_NAMES, EvalConfig, EvalError
from sao_core.eval.metrics import pass_at_k
from sao_core.eval.report import write_report
from sao_core.eval.run import evaluate
from sao_core.eval.summary import load_summary

__all__ = [
    "BENCHMARKS",
    "BENCHMARK_NAMES",
    "BenchmarkSpec",
    "EvalConfig",
    "EvalError",
    "evaluate",
    "get_benchmark",
    "load_benchmark",
    "load_summary",
    "pass_at_k",
    "write_report",
]
