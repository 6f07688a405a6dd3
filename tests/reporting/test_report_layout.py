"""The report leads with the result (issue 40): a training report titled by its run (method, model, steps), the
held-out reward (greedy and sampled on one chart) as its first chart, metrics that never change listed as one
line each instead of flat charts, a summary of readable rows (no raw JSON, rounded numbers, no empty rows),
and the evaluation report of a pipeline with the training section before the benchmarks, whose all-zero
results say so in one line. Checked on the markup and, for document order as a browser sees it, in headless
Chromium (skipped without it). Run folders and the browser come from the helpers of
tests/reporting/test_training_report.py."""

from __future__ import annotations

import html as _html
import json
import re
from pathlib import Path

from test_training_report import _chromium, _load, _rl_rows, _write_run, plot_blocks

from sao_core import storage
from sao_core.reporting.training import (
    build_training_report,
    constant_series,
    field_rows,
    run_title,
    write_training_report,
)

_FIGURE = re.compile(r'<figure class="plot" id="plot-[^"]+" data-plot="([^"]+)"')
LONG_FLOAT = 7.526751268999988
CONFIG = {"method": "sao", "steps": 40, "model": "embedded:tiny", "policy_lr": 1e-6, "eval_data": None,
          "lora_target_modules": [], "options": {}}


def _summary(rows: list[dict]) -> dict:
    """A finished SAO run's summary.json with what made the old table raw JSON: nested dicts, empty dicts and
    lists, None, long floats and a list of records."""
    evaluations = [{k: r[k] for k in ("step", "eval_prompts", "eval_greedy_reward", "eval_sampled_reward")}
                   for r in rows if "eval_prompts" in r]
    return {"method": "sao", "steps": 40, "reward_last": LONG_FLOAT, "dropped_by_reason": {}, "resumed_from": None,
            "tags": [], "length_bias": {"drop_rate_by_turns": {"1": 0.0, "3-4": 0.0}, "trained_turns_mean": 2.0013,
                                        "dropped_by_turns": {}},
            "stream": {"low_water_mark": 320, "owed": 0, "outcomes": {"trained": 320}},
            "evaluations": evaluations, "eval_prompts": 128}


def _run(root: Path) -> tuple[Path, list[dict]]:
    """A finished 40-step SAO run (the test_training_report lines, held-out evaluations every 10 steps with the
    constant eval_prompts 128) whose newest checkpoint holds its config, as the learner leaves it."""
    rows = _rl_rows("sao", 40)
    for row in rows:
        if "eval_sampled_reward" in row:
            row["eval_prompts"] = 128
    run = _write_run(root, rows, _summary(rows))
    checkpoint = run / "checkpoints" / "step-000040"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps({"method": "sao", "config": CONFIG}))
    storage.seal_checkpoint(checkpoint, metadata={"step": 40})
    return run, rows


def _summary_cells(page: str) -> list[tuple[str, str]]:
    """(field, value text) of the training summary table's rows (an inner table's text joined)."""
    table = page[page.index('<table class="summary">'):]
    table = table[:table.index("<h")]
    rows = []
    for row in re.findall(r"<tr><td>(.*?)</td><td>(.*?)</td></tr>(?=<tr><td>|</tbody></table>$)", table, re.S):
        rows.append(tuple(" ".join(_html.unescape(re.sub(r"<[^>]+>", " ", cell)).split()) for cell in row))
    return rows


def _imo_all_zero() -> tuple[dict, list[dict]]:
    """(evaluation summary, samples) of IMO-AnswerBench where nothing is solved, as the demo's tiny model does."""
    from sao_core.eval.metrics import benchmark_metrics

    problems = [{"id": f"p{i}", "category": "Algebra"} for i in range(4)]
    samples = [{"benchmark": "imo_answerbench", "id": p["id"], "sample": j, "correct": False, "grade": "mismatch",
                "grader": "rule", "status": "graded", "settled": True, "answer": "3", "tokens": 20 + j,
                "groups": {"category": "Algebra"}} for p in problems for j in range(2)]
    bench = dict(benchmark_metrics(problems, samples, k=2, groups=("category",)), title="IMO-AnswerBench",
                 grader="math_rule")
    return {"model": "/tmp/x/sao/model", "benchmarks": {"imo_answerbench": bench}}, samples


# ----------------------------------------------------------------------------- the training report
def test_the_training_report_leads_with_the_held_out_reward(tmp_path):
    run, rows = _run(tmp_path / "run")
    page = Path(write_training_report(str(run))).read_text()      # the config from the checkpoint
    # The title names the run, not a path.
    assert "<h1>Training report: SAO on embedded:tiny, 40 steps</h1>" in page
    assert "<title>Training report: SAO on embedded:tiny, 40 steps</title>" in page
    # The first chart is the held-out reward, greedy and sampled on one chart, above the run table and summary.
    figures = _FIGURE.findall(page)
    assert figures[0] == "heldout_reward"
    first = plot_blocks(page)["heldout_reward"]
    assert list(first["series"]) == ["eval_greedy_reward", "eval_sampled_reward"]
    assert first["x"] == [10, 20, 30, 40]
    assert first["series"]["eval_sampled_reward"] == [r["eval_sampled_reward"] for r in rows if "eval_prompts" in r]
    assert page.index('data-plot="heldout_reward"') < page.index("<table") < page.index("<h2>Summary</h2>")
    assert "eval-eval_sampled_reward" not in figures and "eval-eval_greedy_reward" not in figures


def test_constant_series_are_one_line_each_not_charts(tmp_path):
    run, rows = _run(tmp_path / "run")
    page = build_training_report(str(run))
    figures = set(_FIGURE.findall(page))
    constant = dict(constant_series(rows))
    assert constant["eval_prompts"] == "128 throughout (steps 10–40, 4 logged)"
    for name in ("eval_prompts", "policy_ratio_mean", "positions_owed", "lambda_mean", "policy_lr", "critic_lr"):
        assert name in constant, name
        assert f"<li><code>{name}</code>: " in page, name
    for chart in ("eval-eval_prompts", "ratio", "other-positions_owed", "other-lambda_mean", "lr"):
        assert chart not in figures, chart
    listing = page[page.index('id="constant"'):]
    listing = listing[:listing.index("</ul>")]
    assert '<ul class="constant">' in listing and listing.count("<li>") == len(constant)
    assert '<a href="#constant">constant metrics</a>' in page
    # Curves that move are still charts (and the result's, however flat, always).
    assert {"heldout_reward", "reward", "entropy", "critic_loss"} <= figures


def test_the_summary_is_readable_rows(tmp_path):
    run, _ = _run(tmp_path / "run")
    page = build_training_report(str(run))
    cells = _summary_cells(page)
    fields = dict(cells)
    assert cells and all(value for _, value in cells), "no empty rows"
    assert not [c for c in cells if c[1].startswith(("{", "["))], "no raw JSON values"
    assert fields["reward_last"] == "7.527" and str(LONG_FLOAT) not in page
    assert fields["length_bias.trained_turns_mean"] == "2.001"
    assert fields["length_bias.drop_rate_by_turns"] == "1: 0; 3-4: 0"          # a histogram: one row
    assert fields["stream.low_water_mark"] == "320" and fields["stream.outcomes.trained"] == "320"
    for empty in ("dropped_by_reason", "resumed_from", "tags", "length_bias.dropped_by_turns"):
        assert empty not in fields, empty
    assert fields["evaluations"].startswith("step eval_prompts eval_greedy_reward eval_sampled_reward 10 128 ")
    assert '<table class="inner">' in page
    config = page[page.index('<table class="config">'):]
    assert "<td>policy_lr</td><td>1e-06</td>" in config and "eval_data" not in config and "options" not in config


def test_field_rows_flatten_round_and_drop_empties():
    rows = field_rows({"a": 1.23456789, "b": {"c": 2, "d": {}}, "e": [], "f": None, "g": "", "h": [1, 2.5],
                       "hist": {"1": 0.5, "5-8": 1e-7}, "ok": True, "big": 12345678.9, "whole": 3.0})
    assert rows == [["a", "1.235"], ["b.c", "2"], ["h", "1, 2.5"], ["hist", "1: 0.5; 5-8: 1e-07"], ["ok", "yes"],
                    ["big", "1.235e+07"], ["whole", "3"]]


def test_the_title_names_the_starting_model_through_a_warm_start(tmp_path):
    """The demo's SAO starts from its SFT run's model folder: the title follows it to embedded:tiny."""
    sft = tmp_path / "runs" / "1" / "sft"
    checkpoint = sft / "checkpoints" / "step-000190"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text(json.dumps(
        {"method": "sft", "config": {"method": "sft", "model": "embedded:tiny"}}))
    storage.seal_checkpoint(checkpoint, metadata={"step": 190})
    (sft / "model").mkdir()
    assert run_title("sao", {"model": str(sft / "model")}, {"steps": 100}) == "SAO on embedded:tiny + SFT, 100 steps"
    assert run_title("grpo", {"model": "Qwen/Qwen3-0.6B", "steps": 5}, None) == "GRPO on Qwen/Qwen3-0.6B, 5 steps"
    assert run_title("sao", {"model": "s3://bucket/runs/1/sft/model/"}, None) == "SAO on …/sft/model"
    assert run_title("sao", {}, {"steps": 3}) == ""                          # no model known: no run title


# ----------------------------------------------------------------------------- the evaluation report
def test_the_evaluation_report_puts_the_training_before_the_benchmarks(tmp_path):
    from sao_core.eval.report import write_report

    run, _ = _run(tmp_path / "runs" / "1" / "sao")
    summary, samples = _imo_all_zero()
    page = Path(write_report(summary, samples, str(tmp_path / "report"), training_run=str(run))).read_text()
    assert "<h1>SAO on embedded:tiny, 40 steps: training and evaluation</h1>" in page
    assert "Evaluation of" not in page
    training = page.index('<section id="training">')
    benchmarks = page.index('<h2 id="benchmarks">Benchmarks (held-out evaluation of the final model)</h2>')
    assert training < page.index('data-plot="heldout_reward"') < benchmarks < page.index('<h2 id="imo_answerbench">')
    assert _FIGURE.findall(page)[0] == "heldout_reward"
    # Nothing solved: one line says so; the all-zero charts are folded away, not shown first.
    zero = page.index("<b>No benchmark problem was solved</b>")
    assert benchmarks < zero < page.index("<summary>score and pass@k charts (all 0)</summary>")
    assert page.index("<summary>score and pass@k charts (all 0)</summary>") < page.index("Score per benchmark")
    assert "<summary>avg@2 per category: 0 in every category (chart)</summary>" in page


def test_the_first_screen_in_chromium_is_the_training_result(tmp_path):
    """Document order as the browser builds it: the run's title, then the training section whose first chart
    is the held-out reward, then the benchmarks."""
    from sao_core.eval.report import write_report

    chromium = _chromium()
    run, _ = _run(tmp_path / "runs" / "1" / "sao")
    summary, samples = _imo_all_zero()
    page = Path(write_report(summary, samples, str(tmp_path / "report"), training_run=str(run)))
    dom, log = _load(chromium, page, tmp_path / "profile")
    assert not [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    headings = re.findall(r"<h([12])[^>]*>(.*?)</h\1>", dom)
    assert headings[:2] == [("1", "SAO on embedded:tiny, 40 steps: training and evaluation"),
                            ("2", "Training report: sao")]
    assert [text for level, text in headings if level == "2"].index(
        "Benchmarks (held-out evaluation of the final model)") > 0
    figures = re.findall(r'<figure class="plot" id="plot-[^"]+" data-plot="([^"]+)"[^>]*><svg ', dom)
    assert figures[0] == "heldout_reward"
    assert dom.index('data-plot="heldout_reward"') < dom.index('id="benchmarks"')

    alone = Path(write_training_report(str(run)))
    dom, _ = _load(chromium, alone, tmp_path / "profile-alone")
    assert re.findall(r'<figure class="plot" id="plot-[^"]+" data-plot="([^"]+)"', dom)[0] == "heldout_reward"
    assert "<h1>Training report: SAO on embedded:tiny, 40 steps</h1>" in dom
