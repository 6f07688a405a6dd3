"""report: one HTML report from the evaluation steps of a pipeline run (one per benchmark), with the
training run's report next to it when the pipeline trained the model.

Joins their summaries (:func:`sao_core.kfp.evaluation.merge_summaries`), compares with a previous
run's summary when one is given, and calls :func:`sao_core.eval.report.write_report`. The report
(score per benchmark, per category, pass@k curve, response lengths, the comparison) is the HTML
artifact; the merged summary and report are also written to ``OUTPUT_ROOT/RUN_ID/report``.
"""

from typing import NamedTuple

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Metrics, Output

from sao_core.images import image


@dsl.component(base_image=image("cpu"), install_kfp_package=False)
def report(
    summaries: Input[list[Artifact]],
    output_root: str,
    report: Output[HTML],
    metrics: Output[Metrics],
    previous_summary: str = "",
    run_id: str = "",
    trained_model: str = "",
) -> NamedTuple("ReportOutputs", report_uri=str, summary_uri=str):
    """Write one HTML report (and merged summary) from the evaluation steps of a run.

    Args:
        summaries: summary.json artifacts of the evaluation steps (one model, disjoint benchmarks).
        output_root: Where runs are written: s3://bucket/prefix in a cluster, a local directory for local runs.
        report: The HTML report.
        metrics: All benchmarks' flat metrics.
        previous_summary: summary.json of an earlier run (path or s3://) to compare against ('' = none).
        run_id: Run folder name under output_root (pipelines pass the run id; empty: a timestamp).
        trained_model: The model this run trained ('' = none): its training run (the model's parent folder) is shown next to the evaluation.
    """
    import json

    from sao_core import storage
    from sao_core.eval.report import write_report
    from sao_core.eval.summary import load_summary
    from sao_core.kfp import artifacts, evaluation

    loaded = []
    for item in summaries:
        with open(item.path, encoding="utf-8") as handle:
            loaded.append(json.load(handle))
    previous = load_summary(previous_summary) if previous_summary else None
    merged = evaluation.merge_summaries(loaded, previous, previous_summary or None)
    samples = [row for summary in loaded for row in evaluation.load_samples(summary)]
    run = artifacts.run_dir(output_root, run_id, "report")
    summary_uri = storage.join(run, "summary.json")
    storage.write_text(summary_uri, json.dumps(merged, indent=2, ensure_ascii=False, default=str) + "\n")
    training_run = evaluation.training_run_of(trained_model) if trained_model else None
    report_uri = write_report(merged, samples, run, previous, training_run=training_run)
    artifacts.write_text_artifact(report, storage.read_text(report_uri))
    artifacts.log_numbers(metrics, merged["metrics"])
    return (report_uri, summary_uri)  # the NamedTuple outputs, in order
