"""evaluate: score a model on SWE-Bench Verified, BeyondAIME and / or IMO-AnswerBench.

Calls :func:`sao_core.eval.run.evaluate` (with ``adapter``: on the model with that LoRA adapter merged
in): k samples per problem through the rollout engine (vLLM or HF), graded the way each benchmark
defines it; writes ``samples.jsonl``, ``summary.json``, ``metrics.json`` and ``report.html`` to
``OUTPUT_ROOT/RUN_ID/eval-BENCHMARKS`` and resumes from the graded samples there when the task is
retried. Outputs: the summary (JSON), the flat metrics (``imo_answerbench/avg@4``, ...) and the HTML
report, shown in the KFP UI.
"""

from typing import NamedTuple, Optional

from kfp import dsl
from kfp.dsl import HTML, Artifact, Metrics, Output

from sao_core.images import image


@dsl.component(base_image=image("rollout"), install_kfp_package=False)
def evaluate(
    model: str,
    output_root: str,
    summary: Output[Artifact],
    metrics: Output[Metrics],
    report: Output[HTML],
    adapter: str = "",
    benchmarks: str = "swe_verified,beyond_aime,imo_answerbench",
    k: int = 4,
    limit: int = 0,
    engine: str = "vllm",
    max_new_tokens: int = 4096,
    max_total_tokens: int = 32768,
    temperature: float = 1.0,
    sandbox: str = "local",
    previous_summary: str = "",
    options: Optional[dict] = None,  # noqa: UP045 (KFP reads typing.Optional, not X | None)
    run_id: str = "",
) -> NamedTuple("EvalOutputs", summary_uri=str, report_uri=str):
    """Evaluate a model on benchmarks; write samples, summary, metrics and an HTML report.

    Args:
        model: Model reference: an s3:// checkpoint, a directory, embedded:tiny or a Hugging Face id.
        output_root: Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs.
        summary: The run's summary.json.
        metrics: Flat metrics (avg@k, pass@k, maj@k per benchmark and category, rates of empty / unsettled / failed samples).
        report: The HTML report.
        adapter: LoRA adapter applied to model (a peft folder with a manifest or an s3:// checkpoint, e.g. a LoRA run's OUTPUT_ROOT/RUN_ID/sao/weights/vNNNNNN): the merged model is evaluated ('' = none).
        benchmarks: Comma-separated benchmark names: swe_verified, beyond_aime, imo_answerbench.
        k: Samples per problem.
        limit: Evaluate only the first N problems of each benchmark (0 = all).
        engine: vllm (GPU) or hf (transformers).
        max_new_tokens: Tokens per model turn.
        max_total_tokens: Tokens of a whole episode.
        temperature: Sampling temperature.
        sandbox: Where SWE tool calls and tests run: local (bubblewrap) or kubernetes (one pod per episode).
        previous_summary: summary.json of an earlier run (path or s3://) to compare against ('' = none).
        options: Any other EvalConfig field, e.g. {"imo_answerbench_source": "s3://...", "judge_url": "...", "concurrency": 32}.
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
    """
    import json
    import shutil

    from sao_core import storage
    from sao_core.eval.config import EvalConfig
    from sao_core.eval.run import evaluate as run_evaluation
    from sao_core.kfp import artifacts

    artifacts.quiet_http_logs()
    names = [b.strip() for b in benchmarks.split(",") if b.strip()]
    run = artifacts.run_dir(output_root, run_id, "eval-" + "-".join(names))
    config = artifacts.build(EvalConfig, {
        "model": model, "adapter": adapter, "output": run, "benchmarks": names, "k": k, "limit": limit or None,
        "engine": engine, "max_new_tokens": max_new_tokens, "max_total_tokens": max_total_tokens,
        "temperature": temperature, "sandbox": sandbox, "previous_summary": previous_summary or None, "resume": True,
        "cache_dir": artifacts.cache_dir()}, options, source="evaluate")
    result = run_evaluation(config)
    artifacts.write_text_artifact(summary, json.dumps(result, indent=2, ensure_ascii=False, default=str) + "\n")
    summary.metadata.update({"model": model, "adapter": adapter, "benchmarks": names, "k": k, "run_dir": run})
    artifacts.log_numbers(metrics, result["metrics"])
    report_uri = result["files"]["report"]
    if storage.is_s3_uri(report_uri):
        artifacts.write_text_artifact(report, storage.read_text(report_uri))
    else:
        shutil.copyfile(report_uri, report.path)
    return (result["files"]["summary"], report_uri)  # the NamedTuple outputs, in order
