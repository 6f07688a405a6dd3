"""The training report: one self-contained HTML page per run (inline SVG, no scripts that run, no network;
every value of the run's files is escaped, see :mod:`sao_core.reporting.html`).

:func:`write_training_report` writes ``<output>/training_report.html`` (a folder or an ``s3://`` prefix).
The trainer (sft, cpt, dpo, gkd) and the RL learner (sao, grpo, ...) call it every `report_every` steps
where they sync their metrics, and at the end of the run; ``sao report training RUN_DIR`` renders it from
a run directory; the KFP training components return it as their HTML artifact.

The page leads with the result: its title names the run (:func:`run_title`: method, starting model, steps,
e.g. "SAO on embedded:tiny + SFT, 100 steps"), then the one-line headline and the held-out reward (greedy
and sampled on one chart, when the run evaluates during training); then the run's state (method, steps, last
update), the summary (once the run has finished; readable rows, :func:`field_rows`), one chart per group of
metrics found in ``metrics.jsonl`` (a chart whose metrics the run does not log is left out; one whose every
series holds a single value is listed as one line per series instead, :func:`constant_series`), the run's
config and the checkpoints and models written so far. Loss and reward curves carry a trailing
moving average. Every chart is a ``<figure class="plot" data-plot=ID>`` (its element id ``plot-`` and the
:func:`~sao_core.reporting.html.slug` of ID, as ID may be any metric's name) holding its SVG and a
``<script type="application/json" class="plot-data">`` block with exactly the values plotted (the steps
``x``, each series' values, ``null`` where a step has none, and the moving averages), so a test or a script
can check them against the metrics file.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote

from sao_core import storage
from sao_core.reporting import plots
from sao_core.reporting.html import Raw, esc, link, num, page, pct, script_json, slug, table

log = logging.getLogger(__name__)

TRAINING_REPORT = "training_report.html"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
RL_METHODS = ("sao", "grpo", "grpo_async", "grpo_dis", "running_mean")


class ReportError(ValueError):
    """The report cannot be made; the message names the run, file and line."""


@dataclass(frozen=True)
class Chart:
    """One chart: metric `keys` (the series, in order) plotted over the steps that have any of them."""

    id: str
    title: str
    keys: tuple[str, ...]
    percent: bool = False
    smooth: bool = False      # draw a trailing moving average over the raw values
    note: str = ""


#: the section of the run's result: the held-out rewards of the evaluation during training, first on the page
RESULT_SECTION = "Held-out reward"
#: charts drawn however flat their values (the run's result: held-out reward, batch reward, loss), never
#: collapsed into a line
_ALWAYS_CHARTED = {"heldout_reward", "reward", "loss"}

# Sections of the page and their charts, in order. A chart appears when at least one of its keys is in the file.
SECTIONS: tuple[tuple[str, tuple[Chart, ...]], ...] = (
    (RESULT_SECTION, (
        Chart("heldout_reward", "Held-out reward (evaluation during training)",
              ("eval_greedy_reward", "eval_sampled_reward"),
              note="the mean reward on the held-out prompts at the weights of that step: greedy and sampled"),
    )),
    ("Loss and reward", (
        Chart("loss", "Training loss", ("loss",), smooth=True),
        Chart("reward", "Reward (batch mean)", ("reward_mean",), smooth=True),
        Chart("dpo_reward", "DPO implicit rewards", ("chosen_reward", "rejected_reward", "reward_margin"), smooth=True),
        Chart("dpo_accuracy", "DPO reward accuracy (chosen above rejected)", ("reward_accuracy",), percent=True,
              smooth=True),
        Chart("policy_loss", "Policy loss", ("policy_loss",), smooth=True),
        Chart("critic_loss", "Critic loss (value MSE)", ("critic_loss",), smooth=True),
        Chart("explained_variance", "Critic explained variance", ("explained_variance",)),
        Chart("entropy", "Policy entropy (action tokens)", ("entropy",)),
        Chart("advantage", "Mean advantage", ("advantage_mean",)),
    )),
    ("Off-policy correction", (
        Chart("dis", "DIS mask: share of action tokens", ("policy_kept", "policy_masked_low", "policy_masked_high"),
              percent=True),
        Chart("dis_pos", "DIS mask, advantage > 0 (share of all action tokens)",
              ("policy_kept_pos", "policy_masked_low_pos", "policy_masked_high_pos"), percent=True),
        Chart("dis_neg", "DIS mask, advantage < 0 (share of all action tokens)",
              ("policy_kept_neg", "policy_masked_low_neg", "policy_masked_high_neg"), percent=True),
        Chart("clip", "PPO clip fractions", ("policy_clip_frac_low", "policy_clip_frac_high", "policy_clip_frac"),
              percent=True),
        Chart("ratio", "Mean importance ratio", ("policy_ratio_mean",)),
        Chart("logp_diff", "|logp − rollout logp| on action tokens", ("logp_diff_mean", "logp_diff_max")),
    )),
    ("Staleness and drops", (
        Chart("staleness", "Staleness of the trained trajectories (versions behind)", ("staleness",)),
        Chart("drops", "Dropped trajectories by reason (whole run)", ("dropped_by_reason",)),
        Chart("drops_total", "Dropped and re-queued trajectories (whole run)", ("dropped_total", "requeued_total")),
    )),
    ("Token lag", (
        Chart("token_lag", "Lag of the trained tokens (versions between sampling and training), per step",
              ("token_lag",)),
        Chart("token_lag_percentiles", "Token lag: median, 99th percentile, maximum (versions)",
              ("token_lag_p50", "token_lag_p99", "token_lag_max")),
        Chart("tokens_beyond_bound", "Trained tokens lagging more than max_staleness (share)",
              ("tokens_beyond_bound",), percent=True),
        Chart("token_lag_by_turns", "Mean token lag by episode length (turns bucket)", ("token_lag_by_turns",)),
        Chart("dis_kept_by_lag", "DIS kept share by token lag (the last key: every lag beyond max_staleness)",
              ("dis_kept_by_lag",)),
        Chart("fragments", "Fragments: pieces in the batch that are not an episode's last, pieces per episode",
              ("fragments", "fragments_per_episode"),
              note="admission fragments: long episodes trained in pieces, advantages bootstrapped from the critic"),
        Chart("bootstrap_value", "Critic value at the fragments' cuts (mean)", ("bootstrap_value_mean",)),
    )),
    ("Turn ends", (
        Chart("turn_cut", "Turns cut at the token cap, and tool errors (share of the batch's trajectories)",
              ("turn_cut_share", "turn_cut_correct_share", "tool_error_share"), percent=True,
              note="turn_cut_correct_share: of the cut turns, those that already held the right answer"),
        Chart("end_of_turn_logprob", "End-of-turn token log-prob (sampled end-of-turn tokens)",
              ("end_of_turn_logprob", "end_of_turn_learner_logprob"),
              note="end_of_turn_logprob: the engine's when it sampled them; learner: the policy's at the update"),
        Chart("end_of_turn_update", "End-of-turn tokens at the update: DIS kept share, mean advantage",
              ("end_of_turn_kept", "end_of_turn_advantage")),
    )),
    ("Episode length", (
        Chart("length_turns", "Episode length in turns: trained vs offered", ("trained_turns_mean", "arrived_turns_mean"),
              note="offered: every episode that reached the learner (trained or dropped)"),
        Chart("length_tokens", "Episode length in sampled tokens: trained vs offered",
              ("trained_tokens_mean", "arrived_tokens_mean")),
    )),
    ("Throughput and waiting", (
        Chart("trajectories_per_s", "Trajectories per second (trained)", ("trajectories_per_s",)),
        Chart("tokens_per_s", "Tokens per second (trained action tokens)", ("tokens_per_s",)),
        Chart("generator_idle", "Generator idle share", ("generator_idle_share",), percent=True),
        Chart("learner_wait", "Learner wait share", ("learner_wait_share",), percent=True,
              note="when the run does not log learner_wait_share: learner_wait_s / (learner_wait_s + update_s + "
                   "weight_push_s) of each step"),
        Chart("step_seconds", "Seconds per step: waiting, updating, pushing weights",
              ("learner_wait_s", "update_s", "weight_push_s")),
        Chart("weight_push", "Weight push seconds", ("weight_push_s",)),
    )),
    ("Optimisation", (
        Chart("lr", "Learning rate", ("lr", "policy_lr", "critic_lr")),
        Chart("grad_norm", "Gradient norm (before clipping)", ("grad_norm", "policy_grad_norm", "critic_grad_norm")),
    )),
)

TRAINING_CSS = """
div.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 4px 16px; }
figure.plot { margin: 0; } figure.plot svg.chart { width: 100%; height: auto; margin: 4px 0; }
figcaption { font-size: 12px; margin: -4px 0 8px 8px; }
"""

# Not charted on their own: the x axis, and bookkeeping the page shows elsewhere.
_NOT_CHARTED = {"step", "replayed", "world_size"}
#: metrics whose value is a dict: stacked (counts by a numeric key) or one line per key
_DICT_CHARTS = {"staleness": "stacked", "dropped_by_reason": "line", "token_lag": "stacked",
                "token_lag_by_turns": "line", "dis_kept_by_lag": "line"}


# ----------------------------------------------------------------------------- reading a run
def parse_metrics(text: str, source: str) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` text. A last line without its newline that is not JSON (the writer
    is still writing it) is left out; any other line that is not a JSON object with an integer ``step`` is a
    ReportError naming `source` and the line number."""
    rows = []
    lines = text.split("\n")
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:
            if number == len(lines):       # no newline after it: an unfinished last line
                log.info("%s: leaving out the unfinished last line %d", source, number)
                continue
            raise ReportError(f"{source}, line {number}: not JSON ({err.args[0] if err.args else err})") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int) or isinstance(record["step"], bool):
            raise ReportError(f"{source}, line {number}: not a metrics record (a JSON object with an integer "
                              "\"step\")")
        rows.append(record)
    if not rows:
        raise ReportError(f"{source}: no metrics lines yet (the run has not logged a step)")
    return rows


def read_metrics(uri: str) -> list[dict[str, Any]]:
    """The records of a metrics file (path or ``s3://``); ReportError when it is missing, empty or corrupt."""
    try:
        if not storage.exists(uri):
            raise ReportError(f"{uri}: no such metrics file (has the run logged a step yet?)")
        text = storage.read_text(uri)
    except storage.StorageError as err:
        raise ReportError(f"cannot read {uri}: {err}") from err
    except UnicodeDecodeError as err:
        raise ReportError(f"{uri}: not a text file ({err})") from err
    return parse_metrics(text, uri)


def _read_json(uri: str) -> dict[str, Any] | None:
    try:
        if not storage.exists(uri):
            return None
        value = json.loads(storage.read_text(uri))
    except (storage.StorageError, ValueError, UnicodeDecodeError) as err:
        log.warning("%s: left out of the report (%s)", uri, err)
        return None
    return value if isinstance(value, dict) else None


def _latest_state(run: str) -> dict[str, Any] | None:
    """``trainer_state.json`` of the newest complete checkpoint (it holds the method and the config)."""
    try:
        latest = storage.latest_checkpoint(storage.join(run, "checkpoints"))
    except storage.StorageError as err:
        log.warning("%s: checkpoints not listed (%s)", run, err)
        return None
    return _read_json(storage.join(latest, "trainer_state.json")) if latest else None


def _artifacts(run: str, summary: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    """(what, URI) of the checkpoints, models and critic written so far."""
    out = []
    try:
        for name in storage.list_dirs(storage.join(run, "checkpoints")):
            out.append((f"checkpoint {name}", storage.join(run, "checkpoints", name)))
    except storage.StorageError as err:
        log.warning("%s: checkpoints not listed (%s)", run, err)
    for key in ("model", "critic"):
        uri = (summary or {}).get(key)
        if isinstance(uri, str) and uri:
            out.append((key, uri))
    return out


# ----------------------------------------------------------------------------- chart data
def moving_average(values: Sequence[float | None], window: int) -> list[float | None]:
    """Trailing mean over the last `window` steps' values (fewer at the start; None where a step has none)."""
    out: list[float | None] = []
    for i, v in enumerate(values):
        if v is None:
            out.append(None)
            continue
        recent = [u for u in values[max(0, i - window + 1):i + 1] if u is not None]
        out.append(sum(recent) / len(recent))
    return out


def smoothing_window(points: int) -> int:
    """The moving average's window: about a tenth of the points, 2 to 50 steps."""
    return min(50, max(2, points // 10))


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _with_derived(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The rows plus the learner wait share of each step, where the run logs its parts but not the share."""
    out = []
    for row in rows:
        row = dict(row)
        if "learner_wait_share" not in row and _number(row.get("learner_wait_s")) is not None:
            parts = [_number(row.get(k)) or 0.0 for k in ("learner_wait_s", "update_s", "weight_push_s")]
            row["learner_wait_share"] = parts[0] / sum(parts) if sum(parts) > 0 else 0.0
        out.append(row)
    return out


def _line_data(rows: Sequence[Mapping[str, Any]], keys: Sequence[str], smooth: bool) -> dict[str, Any] | None:
    present = [k for k in keys if any(_number(r.get(k)) is not None for r in rows)]
    if not present:
        return None
    used = [r for r in rows if any(_number(r.get(k)) is not None for k in present)]
    data: dict[str, Any] = {"kind": "line", "x": [r["step"] for r in used],
                            "series": {k: [_number(r.get(k)) for r in used] for k in present}}
    if smooth and len(used) >= 4:
        window = smoothing_window(len(used))
        data["window"] = window
        data["smoothed"] = {k: moving_average(v, window) for k, v in data["series"].items()}
    return data


def _leading_number(name: str) -> tuple[float, str]:
    """Sort key of a dict chart's series: by the number a name starts with ("3-4", "5+"), names without one last."""
    digits = re.match(r"\d+(\.\d+)?", name)
    return (float(digits.group()) if digits else math.inf, name)


def _dict_data(rows: Sequence[Mapping[str, Any]], key: str, stacked: bool) -> dict[str, Any] | None:
    used = [r for r in rows if isinstance(r.get(key), dict)]
    if not used:
        return None
    names: set[str] = set()
    for r in used:
        names |= {str(k) for k, v in r[key].items() if _number(v) is not None}
    if not names:
        return None
    order = sorted(names, key=_leading_number)
    return {"kind": "stacked" if stacked else "line", "x": [r["step"] for r in used],
            "series": {n: [_number(r[key].get(n)) or 0.0 for r in used] for n in order}}


#: most points a chart draws (and embeds) per series; a longer run is plotted in buckets of steps
MAX_POINTS = 500


def _mean(values: Sequence[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def bucketed(data: dict[str, Any], max_points: int = MAX_POINTS) -> dict[str, Any]:
    """`data` with at most `max_points` points per series: consecutive points in buckets of ``bucket`` =
    ceil(points / max_points), each plotted at its last step with the mean of the bucket's values (None
    where the bucket has none) and, for moving averages, the average at that last step. Unchanged when it
    already fits. This bounds a page's size and render time however long the run (a 5,000-step SAO run
    embedded every value: 7.8 MB, 1.2 s per refresh)."""
    n = len(data["x"])
    if n <= max_points:
        return data
    size = math.ceil(n / max_points)
    spans = [(i, min(n, i + size)) for i in range(0, n, size)]
    out = dict(data, bucket=size, steps_total=n, x=[data["x"][b - 1] for _, b in spans])
    out["series"] = {k: [_mean(v[a:b]) for a, b in spans] for k, v in data["series"].items()}
    if "smoothed" in data:
        out["smoothed"] = {k: [v[b - 1] for _, b in spans] for k, v in data["smoothed"].items()}
    return out


def chart_data(rows: Sequence[Mapping[str, Any]], max_points: int = MAX_POINTS
               ) -> list[tuple[str, Chart, dict[str, Any]]]:
    """(section, chart, data) of every chart the page draws: the fixed sections (the held-out reward first),
    held-out evaluation (every other ``eval_*`` number), then any other number the rows carry, one chart
    each; each chart's data in buckets of steps beyond `max_points` points (:func:`bucketed`). A chart whose
    every series is constant is not drawn but listed as one line per series (:func:`constant_series`)."""
    return [(section, chart, bucketed(data, max_points)) for section, chart, data in _layout(rows)[0]]


def constant_series(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, str]]:
    """(metric, what it was) of the series not charted because they hold one value at every logged step,
    e.g. ``("eval_prompts", "128 throughout (steps 0–100)")``, in the page's order."""
    return [line for _, _, lines in _layout(rows)[1] for line in lines]


def _layout(rows: Sequence[Mapping[str, Any]]
            ) -> tuple[list[tuple[str, Chart, dict[str, Any]]], list[tuple[str, Chart, list[tuple[str, str]]]]]:
    """The charts to draw (unbucketed data) and the charts collapsed into lines (:func:`_flat_lines`)."""
    drawn, flat = [], []
    for section, chart, data in _all_chart_data(rows):
        lines = _flat_lines(chart, data)
        if lines is None:
            drawn.append((section, chart, data))
        else:
            flat.append((section, chart, lines))
    return drawn, flat


def _constant(values: Sequence[float | None]) -> float | None:
    """The one value of `values` (None ignored) when they hold one (up to float noise), else None."""
    known = [v for v in values if v is not None]
    if not known:
        return None
    first = known[0]
    return first if all(math.isclose(v, first, rel_tol=1e-9, abs_tol=1e-12) for v in known) else None


def _flat_lines(chart: Chart, data: Mapping[str, Any]) -> list[tuple[str, str]] | None:
    """(series, text) per series when every series of a line chart is constant (a chart would be a flat
    line: ``eval_prompts`` 128, a constant learning rate, a count that stays 0), else None. Dict charts and
    the result's charts (:data:`_ALWAYS_CHARTED`) are always drawn."""
    if chart.id in _ALWAYS_CHARTED or chart.keys[0] in _DICT_CHARTS or data.get("kind") != "line":
        return None
    lines = []
    for name, values in data["series"].items():
        value = _constant(values)
        if value is None:
            return None
        steps = [x for x, v in zip(data["x"], values, strict=True) if v is not None]
        shown = pct(value) if chart.percent and not chart.id.startswith("eval-") else num(value)
        when = (f"at step {steps[0]} only" if len(steps) == 1
                else f"throughout (steps {steps[0]}–{steps[-1]}, {len(steps)} logged)")
        lines.append((name, f"{shown} {when}"))
    return lines


def _all_chart_data(rows: Sequence[Mapping[str, Any]]) -> list[tuple[str, Chart, dict[str, Any]]]:
    rows = _with_derived(rows)
    out: list[tuple[str, Chart, dict[str, Any]]] = []
    used: set[str] = set()
    for section, charts in SECTIONS:
        for chart in charts:
            if chart.keys[0] in _DICT_CHARTS:
                data = _dict_data(rows, chart.keys[0], stacked=_DICT_CHARTS[chart.keys[0]] == "stacked")
            else:
                data = _line_data(rows, chart.keys, chart.smooth)
            used |= set(chart.keys)
            if data is not None:
                out.append((section, chart, data))
    numbers = sorted({k for r in rows for k, v in r.items() if _number(v) is not None} - used - _NOT_CHARTED)
    held_out = [k for k in numbers if k.startswith("eval_")]
    for key in held_out:
        percent = all(0.0 <= (_number(r.get(key)) if _number(r.get(key)) is not None else 0.0) <= 1.0 for r in rows)
        chart = Chart(f"eval-{key}", f"Held-out evaluation: {key}", (key,), percent=percent and "loss" not in key)
        out.append(("Held-out evaluation", chart, _line_data(rows, chart.keys, False)))
    for key in numbers:
        if key not in held_out:
            chart = Chart(f"other-{key}", key, (key,))
            out.append(("Other metrics", chart, _line_data(rows, chart.keys, False)))
    return out


def missing_charts(method: str, shown: Sequence[Chart]) -> list[str]:
    """Titles of the charts a run of `method` is expected to have but whose metrics its lines lack (RL only:
    every RL chart but the other family's policy-loss health chart; the held-out reward is optional). `shown`:
    the charts drawn or collapsed into lines."""
    if method not in RL_METHODS:
        return []
    skip = {"loss", "dpo_reward", "dpo_accuracy", "heldout_reward"} | ({"dis", "dis_pos", "dis_neg"} if method in ("grpo", "grpo_async")
                                                     else {"clip"})
    if method != "sao":
        skip |= {"critic_loss", "explained_variance"}
    have = {c.id for c in shown}
    return [c.title for _, charts in SECTIONS for c in charts if c.id not in skip | have]


# ----------------------------------------------------------------------------- rendering
def _figure(chart: Chart, data: Mapping[str, Any]) -> str:
    """One chart's ``<figure>``: its SVG, caption and JSON data block. Its ids come from :func:`slug` (a
    chart of an unknown metric is named after the metric's key, which the run's metrics file chooses);
    the data block is written by :func:`script_json`, so no key or value can end the script element."""
    if data["kind"] == "stacked":
        svg = plots.stacked_steps(chart.title, data["x"], data["series"], chart_id=f"svg-{slug(chart.id)}")
    else:
        svg = plots.step_chart(chart.title, data["x"], data["series"], smoothed=data.get("smoothed"),
                               percent=chart.percent, chart_id=f"svg-{slug(chart.id)}")
    blob = script_json({"id": chart.id, "title": chart.title, **data})
    note = chart.note
    if data.get("bucket"):
        note = (f"{note} " if note else "") + (f"Each point: the mean of {data['bucket']} consecutive logged steps "
                                               f"({data['steps_total']} in all).")
    caption = f"<figcaption class=\"muted\">{esc(note)}</figcaption>" if note else ""
    window = f' data-window="{esc(data["window"])}"' if "window" in data else ""
    return (f'<figure class="plot" id="plot-{slug(chart.id)}" data-plot="{esc(chart.id)}"{window}>{svg}{caption}'
            f'<script type="application/json" class="plot-data">{blob}</script></figure>')


def _empty(value: Any) -> bool:
    return value is None or value == "" or (isinstance(value, Mapping | list | tuple) and not value)


def _text(value: Any) -> str:
    """`value` as plain text: numbers by :func:`~sao_core.reporting.html.num`, booleans yes / no, lists
    joined by commas, mappings as ``key: value`` pairs (empty parts left out); never JSON."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int | float):
        return num(value)
    if isinstance(value, Mapping):
        return "; ".join(f"{k}: {_text(v)}" for k, v in value.items() if not _empty(v))
    if isinstance(value, list | tuple):
        return ", ".join(_text(v) for v in value if not _empty(v))
    return "" if value is None else str(value)


def _cell(value: Any) -> str | Raw:
    """A field's value cell: a list of records (the summary's ``evaluations``) as a small table, else
    :func:`_text`."""
    if isinstance(value, list | tuple) and value and all(isinstance(v, Mapping) for v in value):
        keys = list(dict.fromkeys(k for v in value for k in v))
        rows = [[_text(v.get(k)) for k in keys] for v in value]
        numeric = [i for i, k in enumerate(keys) if all(isinstance(v.get(k), int | float) for v in value)]
        return Raw(table([str(k) for k in keys], rows, numeric=numeric, cls="inner"))
    return _text(value)


_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def field_rows(fields: Mapping[str, Any], prefix: str = "") -> list[list[Any]]:
    """(name, value) rows of a summary or config for people: nested mappings of named fields flattened into
    ``key.sub`` rows, a histogram (plain values by bucket: ``{"1": 0.0, "3-4": 0.0}``) as one row of
    ``bucket: value`` pairs, numbers rounded to 4 significant digits, lists of records as small tables, and
    no row for an empty value (None, "", {}, [])."""
    rows: list[list[Any]] = []
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if _empty(value):
            continue
        if isinstance(value, Mapping) and (any(_WORD.fullmatch(str(k)) for k in value)
                                           or any(isinstance(v, Mapping | list | tuple) for v in value.values())):
            rows += field_rows(value, f"{name}.")
            continue
        cell = _cell(value)
        if cell != "":
            rows.append([name, cell])
    return rows


def _link(uri: str, run: str) -> Raw:
    """`uri` (a checkpoint or model of the run) as code, linked when it lies inside the local run folder
    (:func:`_href_in_run`); an s3:// URI or a path elsewhere is shown as text only."""
    return link(_href_in_run(uri, run), Raw(f"<code>{esc(uri)}</code>"))


def _href_in_run(uri: str, run: str) -> str | None:
    """The link from the report (in `run`) to the folder `uri`: its path below `run`, percent-encoded, so
    a folder named ``javascript:…`` is a relative path (``javascript%3A…``) and never a URL scheme. None
    for s3:// and for paths outside the run (a ``file:`` link is not one the report makes)."""
    if storage.is_s3_uri(uri) or storage.is_s3_uri(run):
        return None
    try:
        below = Path(uri).resolve().relative_to(Path(run).resolve()).as_posix()
    except ValueError:
        return None
    return "./" if below == "." else quote(below) + "/"


def _model_name(model: Any, depth: int = 0) -> str:
    """How the title names the model a run started from: a model id as written (``embedded:tiny``,
    ``Qwen/Qwen3-0.6B``); a local ``<run>/model`` folder of an earlier run (the demo's SFT warm start) as
    that run's own starting model plus its method (``embedded:tiny + SFT``); any other path or s3:// URI by
    its last two parts. "" when there is none."""
    if not isinstance(model, str) or not model.strip():
        return ""
    if storage.is_s3_uri(model):
        return "…/" + "/".join(model.rstrip("/").split("/")[-2:])
    path = Path(model).expanduser()
    try:
        is_dir = path.is_dir()
    except OSError:
        is_dir = False
    if is_dir and depth < 3:
        state = _latest_state(str(path.parent)) or {}
        earlier = _read_json(str(path.parent / SUMMARY_FILE)) or {}
        config = state.get("config") if isinstance(state.get("config"), dict) else {}
        method = state.get("method") or earlier.get("method") or config.get("method")
        base = _model_name(config.get("model"), depth + 1)
        if base and isinstance(method, str):
            return f"{base} + {method.upper()}"
    if is_dir or model.startswith(("/", "~", "./", "../")):
        return "…/" + "/".join(path.parts[-2:])
    return model


def run_title(method: Any, config: Mapping[str, Any] | None, summary: Mapping[str, Any] | None) -> str:
    """The run named for a title: method, starting model and steps, e.g. ``SAO on embedded:tiny + SFT, 100
    steps`` (steps done when it has finished, else those configured). "" when the model is not known."""
    config = config or {}
    model = _model_name(config.get("model"))
    if not model or not method or method == "?":
        return ""
    steps = (summary or {}).get("steps") or config.get("steps")
    return f"{str(method).upper()} on {model}" + (f", {steps} steps" if steps else "")


def weights_trained(config: Mapping[str, Any], summary: Mapping[str, Any] | None) -> str:
    """"all (full fine-tuning)" or the LoRA adapter's settings, from the summary's `lora` or the config."""
    lora = (summary or {}).get("lora")
    if isinstance(lora, Mapping):
        share = ""
        if lora.get("parameters"):
            share = f"; {lora.get('trainable_parameters', 0):,} of {lora['parameters']:,} parameters"
        return (f"LoRA adapter: rank {lora.get('rank')}, alpha {lora.get('alpha')}, targets "
                f"{lora.get('target_modules')}{share}")
    if config.get("lora_rank"):
        return (f"LoRA adapter: rank {config['lora_rank']}, alpha {config.get('lora_alpha')}, targets "
                f"{config.get('lora_target_modules') or '(peft default)'}")
    return "all (full fine-tuning)"


def training_body(rows: Sequence[Mapping[str, Any]], *, run: str, method: str | None = None,
                  config: Mapping[str, Any] | None = None, summary: Mapping[str, Any] | None = None,
                  artifacts: Sequence[tuple[str, str]] = (), level: int = 1) -> list[str]:
    """The training report's HTML parts (no page frame): its title as ``<h{level}>`` and its sections one
    level below. :func:`render_training_report` frames them as a page (`level` 1); the evaluation report of a
    pipeline embeds them (level 2) under its own title. Needs :data:`TRAINING_CSS` on the page."""
    def heading(n: int, text: str) -> str:
        return f"<h{min(6, n)}>{esc(text)}</h{min(6, n)}>"

    config = dict(config or {})
    method = method or (summary or {}).get("method") or config.get("method") or "?"
    last = rows[-1] if rows else {}
    steps = (summary or {}).get("steps") or config.get("steps")
    status = ("finished" if summary else "running") + f": step {last.get('step', 0)}" + (f" of {steps}" if steps else "")
    now = _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    meta = [["run", Raw(f"<code>{esc(run)}</code>")], ["method", method], ["status", status],
            ["metrics lines", len(rows)], ["report written", now],
            ["model", config.get("model", "")], ["weights trained", weights_trained(config, summary)]]
    if isinstance(last.get("seconds"), int | float):
        meta.append(["seconds at the last line", f"{float(last['seconds']):.1f}"])
    sub = level + 1
    title = run_title(method, config, summary)
    # the page's own title names the run; embedded in the evaluation report (whose title names it) the
    # section keeps its plain name
    body = [heading(level, f"Training report: {title}" if title and level == 1 else f"Training report: {method}")]
    headline = training_headline(rows)
    if headline and level == 1:      # embedded, the page above opens with it
        body.append(f'<p class="headline"><b>{esc(headline[0].upper() + headline[1:])}.</b></p>')
    drawn, flat = _layout(rows)
    charts = [(name, chart, bucketed(data)) for name, chart, data in drawn]
    lead = [c for c in charts if c[0] == RESULT_SECTION]     # the result first: the held-out reward
    rest = [c for c in charts if c[0] != RESULT_SECTION]
    if lead:
        body.append(heading(sub, RESULT_SECTION) + '<div class="plots">' + "".join(_figure(c, d) for _, c, d in lead)
                    + "</div>")
    body.append(table(["run", ""], meta))
    if summary:
        body += [heading(sub, "Summary"), table(["field", "value"], field_rows(summary), cls="summary")]
    links = [f'<a href="#plot-{slug(c.id)}">{esc(c.title)}</a>' for _, c, _ in charts]
    if flat:
        links.append('<a href="#constant">constant metrics</a>')
    body.append(heading(sub, "Contents") + "<p>" + ", ".join(links) + "</p>")
    section = None
    for name, chart, data in rest:
        if name != section:
            body.append(("</div>" if section else "") + heading(sub, name) + '<div class="plots">')
            section = name
        body.append(_figure(chart, data))
    if section:
        body.append("</div>")
    if flat:
        items = "".join(f"<li><code>{esc(name)}</code>: {esc(text)}</li>"
                        for _, _, lines in flat for name, text in lines)
        body.append(f'<h{min(6, sub)} id="constant">Constant metrics (one line each instead of a flat chart)'
                    f'</h{min(6, sub)}><ul class="constant">{items}</ul>')
    missing = missing_charts(method, [c for _, c, _ in charts] + [c for _, c, _ in flat])
    if missing:
        body.append('<p class="muted missing">Not in this run\'s metrics (no chart): ' + esc("; ".join(missing))
                    + ".</p>")
    body.append(heading(sub, "Checkpoints and models"))
    if artifacts:
        body.append(table(["what", "where"], [[what, _link(uri, run)] for what, uri in artifacts], cls="artifacts"))
    else:
        body.append('<p class="muted">None written yet.</p>')
    body.append(heading(sub, "Config"))
    if config:
        body.append(table(["field", "value"], field_rows(config), cls="config"))
    else:
        body.append('<p class="muted">Not recorded yet (the config is kept in each checkpoint).</p>')
    body.append('<p class="muted">Generated by sao_core.reporting.training from metrics.jsonl.</p>')
    return body


def render_training_report(rows: Sequence[Mapping[str, Any]], *, run: str, method: str | None = None,
                           config: Mapping[str, Any] | None = None, summary: Mapping[str, Any] | None = None,
                           artifacts: Sequence[tuple[str, str]] = ()) -> str:
    """The training report as an HTML string (see the module docstring)."""
    body = training_body(rows, run=run, method=method, config=config, summary=summary, artifacts=artifacts)
    method = method or (summary or {}).get("method") or dict(config or {}).get("method") or "?"
    title = run_title(method, config, summary)
    return page(f"Training report: {title or method}", body, extra_css=TRAINING_CSS)


def _run_parts(run: str, metrics: str | Path | None, config: Mapping[str, Any] | None,
               summary: Mapping[str, Any] | None, method: str | None) -> dict[str, Any]:
    """What :func:`training_body` needs for the run at `run`, read from its files (see build_training_report)."""
    if not storage.is_s3_uri(run) and not Path(run).expanduser().is_dir():
        raise ReportError(f"{run}: no such run directory")
    rows = read_metrics(str(metrics) if metrics is not None else storage.join(run, METRICS_FILE))
    if summary is None:
        summary = _read_json(storage.join(run, SUMMARY_FILE))
    if config is None:
        state = _latest_state(run) or {}
        config = state.get("config") if isinstance(state.get("config"), dict) else None
        method = method or state.get("method")
    return dict(rows=rows, run=run, method=method, config=config, summary=summary,
                artifacts=_artifacts(run, summary))


class TrainingSection(NamedTuple):
    """A run's training report as a section of another page, its one-line headline and the run's name for
    a title (:func:`run_title`; "" when its model is not known)."""

    html: str
    headline: str
    title: str = ""


def training_section(run: str) -> TrainingSection:
    """The report of the finished or running run at `run` (a folder or an ``s3://`` prefix) as one
    ``<section id="training">`` for another page (title ``<h2>``; the page needs :data:`TRAINING_CSS`), with
    its :func:`training_headline`. ReportError when the run has no metrics."""
    parts = _run_parts(run, None, None, None, None)
    html = '<section id="training">' + "\n".join(training_body(**parts, level=2)) + "</section>"
    method = parts["method"] or (parts["summary"] or {}).get("method") or (parts["config"] or {}).get("method")
    return TrainingSection(html, training_headline(parts["rows"]), run_title(method, parts["config"], parts["summary"]))


def training_headline(rows: Sequence[Mapping[str, Any]]) -> str:
    """One line on what the run achieved so far, from its metrics lines: the held-out rewards at the first and
    the last evaluation during training (when it has evaluations), else the mean batch reward (RL) or loss
    of the first and the last tenth of its logged steps. "" for no lines."""
    if not rows:
        return ""
    parts = []
    for kind in ("sampled", "greedy"):
        key = f"eval_{kind}_reward"
        seen = [(r["step"], v) for r in rows if (v := _number(r.get(key))) is not None]
        if seen:
            (s0, v0), (s1, v1) = seen[0], seen[-1]
            parts.append(f"held-out {kind} reward {v0:.3f} (step {s0}) → {v1:.3f} (step {s1})")
    if parts:
        count = sum(1 for r in rows if any(_number(r.get(f"eval_{k}_reward")) is not None for k in ("sampled", "greedy")))
        return "; ".join(parts) + f" over {count} evaluations"
    for key, what in (("reward_mean", "mean batch reward"), ("loss", "mean loss")):
        values = [v for r in rows if (v := _number(r.get(key))) is not None]
        if values:
            tenth = max(1, len(values) // 10)
            return (f"{what} {sum(values[:tenth]) / tenth:.3f} over the first {tenth} logged steps → "
                    f"{sum(values[-tenth:]) / tenth:.3f} over the last {tenth}")
    return ""


def build_training_report(run: str, *, metrics: str | Path | None = None, config: Mapping[str, Any] | None = None,
                          summary: Mapping[str, Any] | None = None, method: str | None = None) -> str:
    """The report of the run at `run` (a folder or an ``s3://`` prefix) as HTML. `metrics` is where its
    ``metrics.jsonl`` is read (default ``<run>/metrics.jsonl``; a local copy for s3:// runs); `config` and
    `summary` default to the newest checkpoint's config and ``<run>/summary.json`` when there are any."""
    return render_training_report(**_run_parts(run, metrics, config, summary, method))


def write_training_report(output: str, *, metrics: str | Path | None = None, config: Any = None,
                          summary: Mapping[str, Any] | None = None, method: str | None = None,
                          step: int | None = None, every: int = 0, target: str | None = None) -> str | None:
    """Write the report of the run at `output` to `target` (default ``<output>/training_report.html``) and
    return where it went.

    The training loops call it where they sync metrics with the current `step` and `every` (their
    ``report_every``): it then writes only on steps that are a multiple of `every` (never with every = 0),
    and a failure there is logged as a warning so the run goes on. Called without `step` (the end of a run,
    the CLI) it always writes and raises ReportError / StorageError. `config` may be a dataclass."""
    if step is not None and (not every or step % every):
        return None
    if config is not None and not isinstance(config, Mapping):
        import dataclasses

        config = json.loads(json.dumps(dataclasses.asdict(config), default=list))
    target = target or storage.join(output, TRAINING_REPORT)
    try:
        text = build_training_report(output, metrics=metrics, config=config, summary=summary, method=method)
        if not storage.is_s3_uri(target):
            Path(target).expanduser().parent.mkdir(parents=True, exist_ok=True)
        storage.write_text(target, text)
    except (ReportError, storage.StorageError, OSError) as err:
        if step is None:
            raise
        log.warning("training report not refreshed at step %d (the run goes on): %s", step, err)
        return None
    return target
