"""The evaluation report: one self-contained HTML file with inline SVG charts (no scripts, no network;
every value of the summary and the samples is escaped, see :mod:`sao_core.reporting.html`).

:func:`write_report` is the public entry point (the evaluation KFP component calls it). With the
training run of the evaluated model (the pipelines' final report) the page is titled by that run and shows
its training section (held-out reward first) before the benchmarks. The benchmarks part shows the run's
settings, an overview table, the score per benchmark, pass@k curves, the score per
category / subcategory (IMO-AnswerBench) and per repository (SWE-Bench Verified), the response-length
histogram (correct vs wrong), which grader decided how many answers, the answers no grader could
settle, errors, the data sets used, a per-problem table, and the comparison with a previous run's
summary when one is given.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

from sao_core import storage
from sao_core.eval.metrics import compare, pass_k_values
from sao_core.reporting import plots
from sao_core.reporting.html import Raw as _Raw
from sao_core.reporting.html import esc as _esc
from sao_core.reporting.html import page as _page
from sao_core.reporting.html import pct as _pct
from sao_core.reporting.html import slug as _slug
from sao_core.reporting.html import table as _table
from sao_core.reporting.training import TRAINING_CSS, ReportError, TrainingSection, training_section

REPORT_FILE = "report.html"


def _headline(bench: Mapping[str, Any]) -> dict[str, float | None]:
    k = int(bench["k"])
    scores = bench.get("scores", {})
    return {f"avg@{k}": scores.get(f"avg@{k}"), f"pass@{k}": scores.get(f"pass@{k}"), f"maj@{k}": scores.get(f"maj@{k}")}


def _overview(benchmarks: Mapping[str, Mapping[str, Any]]) -> str:
    rows = []
    for name, b in benchmarks.items():
        k = int(b["k"])
        s, c = b.get("scores", {}), b.get("counts", {})
        rows.append([b.get("title", name), b["problems"], k, _pct(s.get(f"avg@{k}")), _pct(s.get("pass@1")),
                     _pct(s.get(f"pass@{k}")), _pct(s.get(f"maj@{k}")), c.get("correct", 0), c.get("wrong", 0),
                     c.get("empty", 0), c.get("unparseable", 0), c.get("unsettled", 0), c.get("timeout", 0),
                     c.get("length", 0), c.get("error", 0), f"{b.get('tokens', {}).get('mean', 0):.0f}"])
    return _table(["benchmark", "problems", "k", "avg@k", "pass@1", "pass@k", "maj@k", "correct", "wrong", "empty",
                   "unparseable", "unsettled", "timed out", "cut at length", "errors", "mean tokens"],
                  rows, numeric=range(1, 16), cls="overview")


def _score_chart(benchmarks: Mapping[str, Mapping[str, Any]]) -> str:
    labels = [b.get("title", n) for n, b in benchmarks.items()]
    series: dict[str, list[float | None]] = {"avg@k": [], "pass@k": [], "maj@k": []}
    for b in benchmarks.values():
        k = int(b["k"])
        s = b.get("scores", {})
        series["avg@k"].append(s.get(f"avg@{k}"))
        series["pass@k"].append(s.get(f"pass@{k}"))
        series["maj@k"].append(s.get(f"maj@{k}"))
    if all(v is None for v in series["maj@k"]):
        del series["maj@k"]
    return plots.bar_chart("Score per benchmark", labels, series, y_label="score")


def _pass_curve(benchmarks: Mapping[str, Mapping[str, Any]]) -> str:
    series = {}
    for name, b in benchmarks.items():
        scores = b.get("scores", {})
        series[b.get("title", name)] = [(float(j), float(scores[f"pass@{j}"])) for j in pass_k_values(int(b["k"]))
                                        if f"pass@{j}" in scores]
    return plots.line_chart("pass@k", series, x_label="k (samples)")


def _length_histogram(title: str, samples: Sequence[Mapping[str, Any]]) -> str:
    graded = [s for s in samples if s.get("status") != "error"]
    series = {"correct": [float(s.get("tokens") or 0) for s in graded if s.get("correct")],
              "wrong": [float(s.get("tokens") or 0) for s in graded if not s.get("correct")]}
    return plots.histogram(f"{title}: response length", series, x_label="generated tokens per sample")


def _all_zero(benchmarks: Mapping[str, Mapping[str, Any]]) -> bool:
    """Whether no benchmark has a score above 0 (nothing solved: the charts would be empty)."""
    return bool(benchmarks) and not any(float(v or 0) > 0 for b in benchmarks.values()
                                        for v in (b.get("scores") or {}).values() if isinstance(v, int | float))


def _folded(what: str, charts: Sequence[str]) -> str:
    """Charts of nothing but zeros, kept (their data stay on the page) but folded away."""
    return f"<details><summary>{_esc(what)}</summary>{''.join(charts)}</details>"


def _groups_section(name: str, b: Mapping[str, Any]) -> str:
    k = int(b["k"])
    parts = []
    for level, values in (b.get("groups") or {}).items():
        if not values:
            continue
        labels = list(values)
        scores = [float(values[v].get(f"avg@{k}", 0.0)) for v in labels]
        counts = [int(values[v].get("problems", 0)) for v in labels]
        chart = plots.hbar_chart(f"{b.get('title', name)}: avg@{k} per {level}", labels, scores, counts=counts)
        parts.append(chart if any(scores) else _folded(f"avg@{k} per {level}: 0 in every {level} (chart)", [chart]))
        rows = [[v, values[v]["problems"], _pct(values[v].get(f"avg@{k}")), _pct(values[v].get("pass@1")),
                 _pct(values[v].get(f"pass@{k}")), _pct(values[v].get(f"maj@{k}"))] for v in labels]
        table = _table([level, "problems", f"avg@{k}", "pass@1", f"pass@{k}", f"maj@{k}"], rows, numeric=range(1, 6))
        parts.append(f"<details><summary>{_esc(level)} table ({len(labels)})</summary>{table}</details>")
    return "\n".join(parts)


def _dataset_table(b: Mapping[str, Any]) -> str:
    d = b.get("dataset") or {}
    rows = [["source", d.get("source")], ["split", d.get("split")], ["version", _Raw(f"<code>{_esc(str(d.get('version')))}</code>")],
            ["rows read", d.get("rows_read")], ["rows rejected", d.get("rows_rejected")],
            ["rows repaired", d.get("repaired")], ["problems evaluated", f"{d.get('problems_used')} of {d.get('problems_available')}"],
            ["licence", d.get("license")], ["cite", d.get("citation")]]
    html = _table(["data set", ""], rows)
    rejects = d.get("rejects") or []
    if rejects:
        html += "<details><summary>rejected rows</summary>" + _table(
            ["file", "row", "line", "field", "reason", "detail"],
            [[r.get("file"), r.get("row"), r.get("line"), r.get("field"), r.get("reason"), r.get("detail")] for r in rejects]
        ) + "</details>"
    return html


def _decided_table(b: Mapping[str, Any]) -> str:
    """How many samples the rules (each rule), the judge or nobody decided (``decided`` of the metrics)."""
    d = b.get("decided") or {}
    if not d:
        return ""
    rows = [[f"rule: {name}", n] for name, n in (d.get("rules") or {}).items()]
    rows += [["LLM judge", d.get("judge", 0)], ["nobody (unsettled: counted wrong, listed below)", d.get("nobody", 0)],
             ["not graded (no answer, timed out, error)", d.get("not_graded", 0)]]
    return _table(["decided by", "samples"], rows, numeric=[1], cls="decided")


def _graders_table(b: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]) -> str:
    by = Counter((s.get("grader") or "(not graded)", s.get("grade")) for s in samples)
    rows = [[grader, grade, n] for (grader, grade), n in sorted(by.items(), key=lambda kv: (-kv[1], kv[0]))]
    return _decided_table(b) + _table(["decided by", "outcome", "samples"], rows, numeric=[2])


def _problem_table(b: Mapping[str, Any], samples: Sequence[Mapping[str, Any]]) -> str:
    k = int(b["k"])
    by_id: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in samples:
        by_id[str(s["id"])].append(s)
    rows = []
    for pid, result in (b.get("per_problem") or {}).items():
        mine = sorted(by_id.get(pid, []), key=lambda s: s.get("sample", 0))
        groups = ", ".join(str(v) for v in (mine[0].get("groups") or {}).values()) if mine else ""
        marks = "".join("✓" if s.get("correct") else ("!" if s.get("status") == "error" else "✗") for s in mine)
        answers = Counter(str(s.get("answer")) for s in mine if s.get("answer") not in (None, ""))
        shown = "; ".join(f"{a[:60]} ×{n}" for a, n in answers.most_common(3))
        rows.append([pid, groups, f"{result['correct']}/{k}", marks, shown])
    table = _table(["id", "group", "correct", "samples", "most frequent answers"], rows, numeric=[2])
    return f"<details><summary>per problem ({len(rows)})</summary>{table}</details>"


def _judge_listing(samples: Sequence[Mapping[str, Any]]) -> str:
    """Every ruling of the LLM judge: the answer, what the rules said, the judge's verdict (or its error), and
    whether it was a cached ruling on the same (reference, answer)."""
    judged = [s for s in samples if isinstance(s.get("judge"), Mapping)]
    items = [{"id": s.get("id"), "sample": s.get("sample"), "answer": s.get("answer"), "rules": s.get("rule_grade"),
              "judge": s["judge"].get("verdict") or f"no verdict: {s['judge'].get('error')}",
              "cached": "yes" if s["judge"].get("cached") else "no"} for s in judged]
    return _listing("LLM judge rulings", items[:200], len(items), ("id", "sample", "answer", "rules", "judge", "cached"))


def _listing(title: str, items: Sequence[Mapping[str, Any]], total: int, keys: Sequence[str]) -> str:
    if not total:
        return ""
    rows = [[str(item.get(key, ""))[:300] for key in keys] for item in items]
    more = f" (first {len(items)} of {total})" if total > len(items) else ""
    return f"<details><summary>{_esc(title)}: {total}{more}</summary>{_table(list(keys), rows)}</details>"


def _comparison(summary: Mapping[str, Any], previous: Mapping[str, Any] | None) -> str:
    if previous is not None:
        table = compare(summary.get("metrics", {}), previous.get("metrics", {}))
        who = previous.get("model")
        when = previous.get("finished_at")
    elif summary.get("comparison"):
        table = summary["comparison"].get("metrics", {})
        who = summary["comparison"].get("model")
        when = summary["comparison"].get("finished_at")
    else:
        return ""
    html = [f"<h2>Comparison with the previous run</h2><p>Previous run: model <code>{_esc(str(who))}</code>, "
            f"finished {_esc(str(when))}. Deltas are current − previous.</p>"]
    if not table:
        html.append('<p class="muted">The two runs have no metric in common.</p>')
        return "\n".join(html)
    headline = []
    for name, b in summary.get("benchmarks", {}).items():
        for score in _headline(b):
            key = f"{name}/{score}"
            if key in table:
                headline.append((f"{b.get('title', name)} {score}", table[key]))
    if headline:
        html.append(plots.bar_chart("Previous vs current", [label for label, _ in headline],
                                    {"previous": [row["previous"] for _, row in headline],
                                     "current": [row["current"] for _, row in headline]}, y_label="score"))
    rows = []
    for name, row in sorted(table.items()):
        delta = row["delta"]
        cls = "up" if delta > 1e-12 else "down" if delta < -1e-12 else "muted"
        rows.append([name, f"{row['previous']:.4g}", f"{row['current']:.4g}",
                     _Raw(f'<span class="{cls}">{delta:+.4g}</span>')])
    html.append(_table(["metric", "previous", "current", "delta"], rows, numeric=[1, 2, 3], cls="comparison"))
    return "\n".join(html)


def _intro(name: str, b: Mapping[str, Any], samples: Sequence[Mapping[str, Any]] = ()) -> str:
    k = int(b["k"])
    text = (f"<p>{_esc(b['problems'])} problems × {k} samples; graded by <code>{_esc(b.get('grader'))}</code>")
    versions = b.get("library_versions") or {}
    if versions:
        text += " with " + ", ".join(f"<code>{_esc(str(lib))} {_esc(str(v) if v else '(not installed)')}</code>"
                                     for lib, v in versions.items())
    text += "."
    if b.get("grader") == "swe_tests":
        text += (" Resolved as the official SWE-bench harness decides (<code>swebench.harness.grading."
                 "get_eval_report</code> on the captured test log).")
        ran = Counter((s.get("harness") or {}).get("test_command") for s in samples if s.get("harness"))
        if ran:
            text += (f" Tests run by the record's own eval script (<code>make_test_spec</code>): {_esc(ran['harness'])} "
                     f"sample(s); by our fallback commands: {_esc(ran['fallback'])}.")
    if name == "swe_verified":
        rate = (b.get("scores") or {}).get(f"avg@{k}")
        text += f" Resolved rate over all {_esc(b['problems'])} instances (avg@{k}): <b>{_esc(_pct(rate))}</b>."
    return text + "</p>"


def render_report(summary: Mapping[str, Any], samples: Sequence[Mapping[str, Any]],
                  previous: Mapping[str, Any] | None = None, training: TrainingSection | None = None) -> str:
    """The report as an HTML string (see :func:`write_report`); `training` is the training run's section
    (:func:`sao_core.reporting.training.training_section`): the page is then titled by the run (method,
    model, steps) when its model is known, its headline opens the page and the training section (its
    held-out reward first) comes before the benchmarks, which follow as the held-out evaluation of the
    final model. Benchmarks where nothing was solved say so in one line; their all-zero charts are folded."""
    benchmarks = summary.get("benchmarks", {})
    config = summary.get("config", {})
    by_bench: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for s in samples:
        by_bench[str(s.get("benchmark"))].append(s)
    title = f"Evaluation of {summary.get('model', '?')}"
    if training and training.title:
        title = f"{training.title}: training and evaluation"
    meta = [["model", summary.get("model")]]
    if summary.get("adapter"):
        title += " + LoRA adapter"
        digest = summary.get("adapter_sha256")
        meta.append(["LoRA adapter (merged into the model)",
                     f"{summary['adapter']} (manifest sha256 {digest})" if digest else f"{summary['adapter']} (unverified)"])
    meta += [["engine", summary.get("engine")],
             ["started", summary.get("started_at")], ["finished", summary.get("finished_at")],
             ["wall time", f"{float(summary.get('seconds') or 0):.1f} s"],
             ["samples generated / reused", f"{summary.get('samples_generated', 0)} / {summary.get('samples_reused', 0)}"],
             ["sampling", f"temperature {config.get('temperature')}, top_p {config.get('top_p')}, top_k {config.get('top_k')}, "
                          f"max_new_tokens {config.get('max_new_tokens')}, max_total_tokens {config.get('max_total_tokens')}, "
                          f"seed {config.get('seed')}"],
             ["LLM judge", f"{config.get('judge_model')} at {config.get('judge_url')} ({config.get('judge_policy')})"
              if config.get("judge_url") else "none (answers rules cannot settle count as wrong and are listed)"]]
    html = [f"<h1>{_esc(title)}</h1>"]
    if training:
        # the training result first: its headline, then the training section (held-out reward on top);
        # the evaluation's settings move down to the benchmarks
        html.append(f'<p>Evaluated model: <code>{_esc(summary.get("model"))}</code></p>')
        if training.headline:
            html.append(f'<p class="headline"><b>Training: {_esc(training.headline)}.</b></p>')
        html.append('<p class="contents">Contents: <a href="#training">the training run</a> (held-out reward, '
                    'curves, health, checkpoints), then <a href="#benchmarks">the benchmarks</a>: '
                    + ", ".join(f'<a href="#{_slug(n)}">{_esc(b.get("title", n))}</a>' for n, b in benchmarks.items())
                    + ".</p>")
        html.append(training.html)
    what = "the final model" if training else "the model"
    html.append(f'<h2 id="benchmarks">Benchmarks (held-out evaluation of {what})</h2>')
    html.append(_table(["run", ""], meta))
    if benchmarks:
        html.append(_overview(benchmarks))
        charts = [_score_chart(benchmarks), _pass_curve(benchmarks)]
        if _all_zero(benchmarks):
            solved = "; ".join(f"{_esc(b.get('title', n))}: {_esc(b.get('problems'))} problems × {_esc(b.get('k'))} "
                               "samples" for n, b in benchmarks.items())
            html.append(f'<p class="zero"><b>No benchmark problem was solved</b> (every score 0: {solved}).</p>')
            html.append(_folded("score and pass@k charts (all 0)", charts))
        else:
            html += charts
    else:
        html.append('<p class="muted">No benchmark results.</p>')
    html.append(_comparison(summary, previous))
    for name, b in benchmarks.items():
        mine = by_bench.get(name, [])
        html += [f'<h2 id="{_slug(name)}">{_esc(b.get("title", name))}</h2>',
                 _intro(name, b, mine),
                 _groups_section(name, b), _length_histogram(b.get("title", name), mine),
                 "<h3>Who decided</h3>", _graders_table(b, mine),
                 _judge_listing(mine),
                 _listing("Answers no grader could settle (counted as wrong)", b.get("unsettled", []),
                          int(b.get("unsettled_total", 0)), ("id", "sample", "answer", "detail")),
                 _listing("Samples that failed (sandbox or engine errors; redone on resume)", b.get("errors", []),
                          int(b.get("errors_total", 0)), ("id", "sample", "detail")),
                 "<h3>Data set</h3>", _dataset_table(b), _problem_table(b, mine)]
    html.append('<p class="muted">IMO-AnswerBench: Google DeepMind, CC-BY-4.0 (Luong et al., "Towards Robust '
                'Mathematical Reasoning", EMNLP 2025). Generated by sao_core.eval.</p>')
    # The shared frame: the same Content-Security-Policy and style sheet as the training report.
    return _page(title, html, extra_css=TRAINING_CSS if training else "")


def write_report(summary: Mapping[str, Any], samples: Sequence[Mapping[str, Any]], output: str,
                 previous: Mapping[str, Any] | str | None = None, training_run: str | None = None) -> str:
    """Write ``report.html`` into `output` (a folder or an ``s3://`` prefix) and return its path / URI.

    `summary` is the dict :func:`sao_core.eval.run.evaluate` returns (or a loaded ``summary.json``);
    `samples` the per-sample records (``samples.jsonl`` lines); `previous` an earlier run's summary
    (a dict, or a path / URI of its ``summary.json`` or run folder) to compare with; without it the
    summary's own ``comparison`` is shown when it has one. `training_run` is the folder (or ``s3://``
    prefix) of the run that trained the model: its training report is shown next to the evaluation; a run
    without metrics is named in a note instead (ReportError is not raised: the evaluation stands alone).
    """
    if isinstance(previous, str):
        from sao_core.eval.summary import load_summary

        previous = load_summary(previous)
    training = None
    if training_run:
        try:
            training = training_section(training_run)
        except ReportError as err:
            training = TrainingSection(f'<section id="training"><h2>Training run</h2><p class="muted">No training '
                                       f'report: {_esc(str(err))}</p></section>', "")
    text = render_report(summary, samples, previous, training)
    target = storage.join(output, REPORT_FILE)
    if not storage.is_s3_uri(output):
        from pathlib import Path

        Path(output).expanduser().mkdir(parents=True, exist_ok=True)
    storage.write_text(target, text)
    return target
