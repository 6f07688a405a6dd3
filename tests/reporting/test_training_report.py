"""The training report (sao_core/reporting/training.py): every method's page plots exactly the values of its
metrics.jsonl (real short SFT and SAO runs, which also refresh the page while they run, and metrics lines of
the other methods with the keys their loops write), the CLI on local and s3:// runs, the error paths, and the
page in headless Chromium (no console errors, every plot present)."""

from __future__ import annotations

import json
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from rl_data import tool_arith_rl  # noqa: E402  (tests/rl_data.py: the one builder of prepared rl datasets)

from sao_core import storage
from sao_core.cli import main
from sao_core.reporting.training import (
    SECTIONS,
    TRAINING_REPORT,
    ReportError,
    build_training_report,
    chart_data,
    constant_series,
    moving_average,
    parse_metrics,
    write_training_report,
)

_BLOCK = re.compile(r'<script type="application/json" class="plot-data">(.*?)</script>', re.S)


def plot_blocks(html: str) -> dict[str, dict]:
    """The embedded data of every plot of a page, by plot id."""
    blocks = [json.loads(b) for b in _BLOCK.findall(html)]
    return {b["id"]: b for b in blocks}


def _wait_share(row: dict) -> float:
    parts = [row.get(k, 0.0) for k in ("learner_wait_s", "update_s", "weight_push_s")]
    return parts[0] / sum(parts) if sum(parts) else 0.0


#: plots of dict-valued metrics -> the metric
_DICT_PLOTS = {"staleness": "staleness", "drops": "dropped_by_reason", "token_lag": "token_lag",
               "token_lag_by_turns": "token_lag_by_turns", "dis_kept_by_lag": "dis_kept_by_lag"}


def check_values(html: str, rows: list[dict]) -> dict[str, dict]:
    """Every plotted value equals the metrics line of its step (dict metrics per entry, 0 where absent); the
    moving averages are trailing means of the plotted values; returns the blocks."""
    blocks = plot_blocks(html)
    by_step = {r["step"]: r for r in rows}
    assert len(by_step) == len(rows), "one line per step in these runs"
    for plot_id, block in blocks.items():
        for name, values in block["series"].items():
            assert len(values) == len(block["x"]), plot_id
            for step, value in zip(block["x"], values, strict=True):
                row = by_step[step]
                if plot_id in _DICT_PLOTS:
                    expected = row.get(_DICT_PLOTS[plot_id], {}).get(name, 0)
                elif name == "learner_wait_share" and name not in row:
                    expected = _wait_share(row)
                else:
                    expected = row.get(name)
                assert value == expected, (plot_id, name, step, value, expected)
            # The x axis: exactly the steps that have the series (or, for several series, any of them).
        keys = list(block["series"])
        if plot_id not in (*_DICT_PLOTS, "learner_wait"):
            assert block["x"] == [r["step"] for r in rows if any(k in r for k in keys)], plot_id
        for name, values in (block.get("smoothed") or {}).items():
            assert values == pytest.approx(moving_average(block["series"][name], block["window"])), plot_id
    return blocks


# ----------------------------------------------------------------------------- metrics lines of each method
def _trainer_rows(method: str, steps: int = 30) -> list[dict]:
    """Lines with the keys `training/trainer.py` writes (loss, the method's own metrics, lr, seconds, grad_norm)."""
    rng = random.Random(method)
    rows = []
    for step in range(1, steps + 1):
        row = {"loss": 2.0 / step + rng.random() * 0.1, "tokens": float(rng.randint(200, 400))}
        if method == "dpo":
            row.update(reward_accuracy=rng.random(), reward_margin=rng.uniform(-1, 1), chosen_reward=rng.uniform(-1, 1),
                       rejected_reward=rng.uniform(-1, 1))
        row.update(step=step, lr=1e-3 * min(1.0, step / 10), seconds=0.5 * step, grad_norm=rng.uniform(0.1, 3))
        rows.append(row)
    return rows


def _rl_rows(method: str, steps: int = 40) -> list[dict]:
    """Lines with the keys `learner/loop.py` and `learner/updates.py` write for `method`."""
    rng = random.Random(method)
    rows = []
    drops: dict[str, int] = {}
    for step in range(1, steps + 1):
        row: dict = {"step": step, "version": step, "action_tokens": float(rng.randint(500, 900))}
        if method == "sao":
            row.update(critic_loss=rng.random(), explained_variance=rng.uniform(-0.5, 0.9), critic_grad_norm=rng.random(),
                       lambda_mean=0.9, critic_lr=5e-6)
        if method in ("grpo", "grpo_async"):
            row.update(policy_clip_frac_low=rng.random() * 0.1, policy_clip_frac_high=rng.random() * 0.1,
                       policy_clip_frac=rng.random() * 0.2)
        else:
            kept = rng.uniform(0.9, 1.0)
            row.update(policy_kept=kept, policy_masked_low=(1 - kept) / 2, policy_masked_high=(1 - kept) / 2,
                       policy_kept_pos=kept / 2, policy_masked_low_pos=0.01, policy_masked_high_pos=0.02,
                       policy_kept_neg=kept / 2, policy_masked_low_neg=0.03, policy_masked_high_neg=0.0)
        row.update(entropy=rng.uniform(0.5, 2), logp_diff_mean=rng.random() * 0.01, logp_diff_max=rng.random(),
                   policy_loss=rng.uniform(-0.2, 0.2), policy_ratio_mean=1.0, policy_lr=1e-6,
                   policy_grad_norm=rng.random(), advantage_mean=rng.uniform(-0.1, 0.1), reward_mean=0.2 + step / 100)
        if rng.random() < 0.3:
            reason = rng.choice(["stale", "no_action_tokens", "engine_error"])
            drops[reason] = drops.get(reason, 0) + 1
        row.update(staleness={str(k): rng.randint(0, 8) for k in range(rng.randint(1, 4))},
                   dropped_total=sum(drops.values()), dropped_by_reason=dict(drops), requeued_total=0,
                   positions_owed=0, stream_low_water_mark=step * 16,
                   drop_rate_by_turns={"1": 0.0}, drop_rate_by_tokens={"5-8": 0.0},
                   trained_turns_mean=rng.uniform(1, 3), arrived_turns_mean=rng.uniform(1, 4),
                   trained_tokens_mean=rng.uniform(10, 30), arrived_tokens_mean=rng.uniform(10, 40),
                   arrived_by_turns={"1": 4}, dropped_by_turns={}, learner_wait_s=rng.random(),
                   update_s=rng.random(), weight_push_s=rng.random() * 0.1, trajectories_per_s=rng.uniform(5, 9),
                   tokens_per_s=rng.uniform(100, 200), seconds=step * 0.8, world_size=1,
                   generator_idle_share=rng.random())
        row.update(turn_cut_share=rng.random() * 0.1, tool_error_share=rng.random() * 0.4,
                   end_of_turn_logprob=-rng.random() * 0.1, end_of_turn_learner_logprob=-rng.random() * 0.2,
                   end_of_turn_advantage=rng.uniform(-0.2, 0.2))
        if row["turn_cut_share"] > 0.05:   # only where some turn was cut
            row["turn_cut_correct_share"] = rng.random()
        if method != "grpo":
            row["end_of_turn_kept"] = rng.uniform(0.9, 1.0)
            row["dis_kept_by_lag"] = {"0": 1.0, "1": rng.uniform(0.9, 1.0), "5+": rng.uniform(0.8, 1.0)}
        row.update(token_lag={str(k): rng.randint(0, 30) for k in range(rng.randint(1, 6))},
                   token_lag_p50=1, token_lag_p99=4, token_lag_max=rng.randint(4, 6),
                   tokens_beyond_bound=rng.random() * 0.02, token_lag_by_turns={"1": 0.5, "3-4": 1.5, "17-32": 3.0},
                   fragments=rng.randint(0, 3), fragments_per_episode=rng.uniform(1, 2))
        if method == "sao" and row["fragments"]:
            row["bootstrap_value_mean"] = rng.random()
        if step % 10 == 0:   # held-out evaluation every few steps (keys eval_*)
            row.update(eval_sampled_reward=rng.random(), eval_greedy_reward=rng.random())
        rows.append(row)
    return rows


# the held-out reward (greedy and sampled) is one chart; "ratio" (policy_ratio_mean 1.0) and "lr" (policy_lr and
# critic_lr constant) are flat in these lines, so they are listed as constant metrics instead (_CONSTANT_RL)
_RL_PLOTS = {"reward", "policy_loss", "entropy", "advantage", "logp_diff", "staleness", "drops", "drops_total",
             "length_turns", "length_tokens", "trajectories_per_s", "tokens_per_s", "generator_idle", "learner_wait",
             "step_seconds", "weight_push", "grad_norm", "heldout_reward",
             "turn_cut", "end_of_turn_logprob", "end_of_turn_update", "token_lag", "token_lag_percentiles",
             "tokens_beyond_bound", "token_lag_by_turns", "fragments"}
EXPECTED = {
    "sft": {"loss", "lr", "grad_norm", "other-tokens", "other-seconds"},
    "cpt": {"loss", "lr", "grad_norm", "other-tokens", "other-seconds"},
    "gkd": {"loss", "lr", "grad_norm", "other-tokens", "other-seconds"},
    "dpo": {"loss", "dpo_reward", "dpo_accuracy", "lr", "grad_norm", "other-tokens", "other-seconds"},
    "sao": _RL_PLOTS | {"critic_loss", "explained_variance", "dis", "dis_pos", "dis_neg", "dis_kept_by_lag",
                        "bootstrap_value"},
    "grpo": _RL_PLOTS | {"clip"},
    "grpo_dis": _RL_PLOTS | {"dis", "dis_pos", "dis_neg", "dis_kept_by_lag"},
}
_RL = ("sao", "grpo", "grpo_dis")
_OTHER_RL = {"other-version", "other-action_tokens", "other-stream_low_water_mark", "other-seconds"}
#: series of _rl_rows that hold one value throughout: one line each, no chart
_CONSTANT_RL = {"policy_ratio_mean", "policy_lr", "positions_owed"}
_CONSTANT_SAO = _CONSTANT_RL | {"critic_lr", "lambda_mean"}


def _write_run(root: Path, rows: list[dict], summary: dict | None = None) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    if summary is not None:
        (root / "summary.json").write_text(json.dumps(summary))
    return root


@pytest.mark.parametrize("method", list(EXPECTED))
def test_every_method_plots_exactly_its_metrics(method, tmp_path):
    rows = _trainer_rows(method) if method in ("sft", "cpt", "dpo", "gkd") else _rl_rows(method)
    run = _write_run(tmp_path / "run", rows, {"method": method, "steps": len(rows)})
    written = write_training_report(str(run), config={"method": method, "steps": len(rows), "lr": 1e-3})
    assert written == str(run / TRAINING_REPORT)
    html = Path(written).read_text()
    blocks = check_values(html, rows)
    assert (set(blocks) - _OTHER_RL if method in _RL else set(blocks)) == EXPECTED[method]
    assert "loss" in blocks or "reward" in blocks
    assert blocks.get("loss", blocks.get("reward"))["smoothed"], "loss / reward curves carry a moving average"
    assert f'id="plot-{next(iter(blocks))}"' in html and html.count("<svg") == len(blocks)
    # One self-contained file: no external assets, no script that runs.
    assert not re.search(r"<link|<img|\ssrc=|(?<!xmlns=\")https?://|<script(?! type=\"application/json\")", html)
    assert "finished: step" in html and "Summary" in html and "<td>lr</td>" in html
    if method in _RL:
        constant = {name for name, _ in constant_series(rows)}
        assert constant == (_CONSTANT_SAO if method == "sao" else _CONSTANT_RL), constant
        assert "<li><code>positions_owed</code>: 0 throughout (steps 1–40, 40 logged)</li>" in html
    if method == "sao":
        assert "Not in this run" not in html, "every RL chart is there"


def test_missing_rl_metrics_are_named(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("generator_idle_share", "weight_push_s")} for r in _rl_rows("sao")]
    html = build_training_report(str(_write_run(tmp_path / "run", rows)), config={"method": "sao"})
    assert "Not in this run's metrics (no chart): Generator idle share; Weight push seconds." in html
    check_values(html, rows)


# ----------------------------------------------------------------------------- real runs
def test_a_real_sft_run_writes_and_refreshes_its_report(tmp_path, sao_cache):
    from sao_core.data.prepare import PrepareConfig, prepare
    from sao_core.data.synthetic import tool_arith_sft_rows
    from sao_core.training.config import SFTConfig
    from sao_core.training.trainer import train

    raw = tmp_path / "raw.jsonl"
    raw.write_text("".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(24, seed=3)))
    prepare(PrepareConfig(source=str(raw), kind="sft", output=str(tmp_path / "data")))
    out = tmp_path / "run"
    seen = {}

    def progress(step, metrics):   # after the step's refresh: the page the run shows while it runs
        page = out / TRAINING_REPORT
        seen[step] = plot_blocks(page.read_text())["loss"]["x"] if page.exists() else None

    summary = train("sft", SFTConfig(data=str(tmp_path / "data"), output=str(out), steps=3, batch_size=4, lr=1e-3,
                                     max_tokens=64, log_every=1, report_every=2, warmup_steps=0,
                                     checkpoint_every=2, cache_dir=str(sao_cache)), progress=progress)
    assert seen == {1: None, 2: [1, 2], 3: [1, 2]}
    html = (out / TRAINING_REPORT).read_text()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    blocks = check_values(html, rows)
    assert blocks["loss"]["series"]["loss"] == [r["loss"] for r in rows]
    assert blocks["loss"]["x"] == [1, 2, 3], "the end of the run writes the last lines too"
    assert "finished: step 3 of 3" in html and "<td>max_tokens</td><td>64</td>" in html
    assert 'href="checkpoints/step-000002/"' in html and 'href="checkpoints/step-000003/"' in html
    assert f"<code>{summary['model']}</code>" in html
    assert "<td>weights trained</td><td>all (full fine-tuning)</td>" in html


def test_the_report_names_a_lora_adapter():
    from sao_core.reporting.training import weights_trained

    lora = {"rank": 8, "alpha": 16.0, "target_modules": "all-linear", "trainable_parameters": 1200,
            "parameters": 90000}
    assert weights_trained({}, {"lora": lora}) == \
        "LoRA adapter: rank 8, alpha 16.0, targets all-linear; 1,200 of 90,000 parameters"
    assert weights_trained({"lora_rank": 4, "lora_alpha": 16.0, "lora_target_modules": ""}, None) == \
        "LoRA adapter: rank 4, alpha 16.0, targets (peft default)"
    assert weights_trained({"lora_rank": 0}, {"lora": None}) == "all (full fine-tuning)"


def test_a_real_sao_run_reports_its_health_curves(tmp_path, sao_cache, tiny_model_dir):
    from sao_core.learner.config import RLConfig
    from sao_core.learner.loop import train_rl

    tool_arith_rl(tmp_path / "rl", 64, seed=3)
    out = tmp_path / "run"
    train_rl(RLConfig(data=str(tmp_path / "rl"), output=str(out), model=tiny_model_dir, method="sao", steps=3,
                      batch_size=8, critic_warmup_steps=1, max_new_tokens_per_turn=16, max_total_tokens=128,
                      report_every=2, cache_dir=str(sao_cache)))
    html = (out / TRAINING_REPORT).read_text()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    blocks = check_values(html, rows)
    # 3 steps: a curve that holds one value (or was logged once) is listed as a constant metric, not charted
    constant = dict(constant_series(rows))
    keys = {c.id: c.keys for _, charts in SECTIONS for c in charts}
    for plot in ("reward", "critic_loss", "explained_variance", "dis", "dis_pos", "dis_neg", "staleness",
                 "logp_diff", "entropy", "length_turns", "trajectories_per_s", "tokens_per_s", "generator_idle",
                 "learner_wait", "weight_push"):
        logged = [k for k in keys[plot] if any(k in r for r in rows)] or [plot]
        assert plot in blocks or (logged and all(k in constant and f"<code>{k}</code>" in html for k in logged)), plot
    assert "reward" in blocks                          # the result's curve is drawn however flat
    assert blocks["reward"]["series"]["reward_mean"] == [r["reward_mean"] for r in rows]
    # the DIS mask is logged from the first policy step (after the warm-up): charted, or constant over steps 2-3
    assert (blocks["dis"]["x"] == [2, 3]) if "dis" in blocks else "(steps 2–3, 2 logged)" in constant["policy_kept"]
    assert "finished: step 3 of 3" in html and "<td>method</td><td>sao</td>" in html and "critic" in html


# ----------------------------------------------------------------------------- CLI, s3://, errors
def test_cli_writes_the_report_of_a_run_dir(tmp_path, capsys):
    rows = _trainer_rows("sft", 5)
    run = _write_run(tmp_path / "run", rows)
    assert main(["report", "training", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / TRAINING_REPORT)
    check_values((run / TRAINING_REPORT).read_text(), rows)
    target = tmp_path / "elsewhere" / "page.html"
    assert main(["report", "training", str(run), "--output", str(target)]) == 0
    assert "running: step 5" in target.read_text(), "no summary.json yet: a running run"


def test_cli_on_an_s3_run(moto_s3, capsys):
    rows = _rl_rows("grpo", 6)
    run = moto_s3.uri("runs/r1/grpo")
    storage.write_text(storage.join(run, "metrics.jsonl"), "".join(json.dumps(r) + "\n" for r in rows))
    assert main(["report", "training", run]) == 0
    assert capsys.readouterr().out.strip() == storage.join(run, TRAINING_REPORT)
    check_values(storage.read_text(storage.join(run, TRAINING_REPORT)), rows)


@pytest.mark.parametrize("case, message", [
    ("no_dir", "no such run directory"),
    ("no_metrics", "metrics.jsonl: no such metrics file"),
    ("empty", "metrics.jsonl: no metrics lines yet"),
    ("corrupt", "metrics.jsonl, line 2: not JSON"),
    ("not_a_record", "metrics.jsonl, line 3: not a metrics record"),
])
def test_errors_name_the_run_file_and_line(case, message, tmp_path, capsys):
    run = tmp_path / "run"
    if case != "no_dir":
        run.mkdir()
    lines = {"empty": "\n", "corrupt": '{"step": 1, "loss": 1}\n{"step": 2, "loss": \n{"step": 3}\n',
             "not_a_record": '{"step": 1}\n{"step": 2}\n[1, 2]\n'}
    if case in lines:
        (run / "metrics.jsonl").write_text(lines[case])
    with pytest.raises(ReportError, match=re.escape(message)) as caught:
        build_training_report(str(run))
    assert str(run) in str(caught.value)
    if case == "corrupt":   # the CLI: one line on stderr, exit code 2
        assert main(["report", "training", str(run)]) == 2
        err = capsys.readouterr().err
        assert err == f"sao report: error: {caught.value}\n"


def test_an_unfinished_last_line_is_left_out_and_a_failed_refresh_only_warns(tmp_path, caplog):
    rows = parse_metrics('{"step": 1, "loss": 2.0}\n{"step": 2, "loss": 1.5}\n{"step": 3, "lo', "m")
    assert [r["step"] for r in rows] == [1, 2]
    assert [c.id for _, c, _ in chart_data(rows)] == ["loss"]
    # In a training loop: only on multiples of report_every, and a failure does not stop the run.
    assert write_training_report(str(tmp_path / "missing"), step=3, every=2) is None
    assert not caplog.records
    assert write_training_report(str(tmp_path / "missing"), step=4, every=2) is None
    assert "training report not refreshed at step 4" in caplog.text
    assert write_training_report(str(tmp_path / "missing"), step=4, every=0) is None


# ----------------------------------------------------------------------------- in a browser
def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.skip("chromium is not installed (`make system-deps` installs Debian's chromium as root: "
                "apt-get install -y chromium); the training report's browser test needs it")


def _load(chromium: str, page: Path, profile: Path) -> tuple[str, str]:
    """(DOM after load, browser log) of `page` in headless Chromium."""
    done = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                           "--disable-extensions", "--disable-dev-shm-usage", f"--user-data-dir={profile}",
                           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=2000", "--dump-dom",
                           page.as_uri()], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout, done.stderr


def test_the_page_loads_in_headless_chromium_with_every_plot(tmp_path):
    chromium = _chromium()
    # The check itself: a console error on a page is seen in the browser's log.
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><html><body><script>console.error("report-check-error")</script></body></html>')
    _, log = _load(chromium, bad, tmp_path / "profile-bad")
    assert "report-check-error" in log and "CONSOLE" in log

    rows = _rl_rows("sao", 60)
    run = _write_run(tmp_path / "run", rows, {"method": "sao", "steps": 60})
    page = Path(write_training_report(str(run), config={"method": "sao", "steps": 60}))
    expected = set(plot_blocks(page.read_text()))
    dom, log = _load(chromium, page, tmp_path / "profile")
    console = [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    figures = re.findall(r'<figure class="plot" id="plot-([^"]+)" data-plot="[^"]+"[^>]*><svg ', dom)
    assert set(figures) == expected and len(figures) == len(expected)
    assert dom.count("<path class=\"line") >= len(expected) - 2   # stacked bars have no line
    assert "Training report: sao" in dom

    # The pipelines' final report: the evaluation with the training run next to it.
    from sao_core.eval.report import write_report
    combined = Path(write_report({"model": str(run / "model"), "benchmarks": {}}, [], str(tmp_path / "report"),
                                 training_run=str(run)))
    dom, log = _load(chromium, combined, tmp_path / "profile-combined")
    console = [line for line in log.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, console
    figures = re.findall(r'<figure class="plot" id="plot-([^"]+)" data-plot="[^"]+"[^>]*><svg ', dom)
    assert set(figures) == expected and '<section id="training">' in dom and "Evaluation of" in dom


@pytest.mark.parametrize("lo, hi", [(0.3, 0.30000000000000004), (1.0, 1.0 + 1e-12), (0.0, 0.0), (2e-20, 2e-20),
                                    (-1e9, -1e9 + 1e-7), (7.0, 7.0)])
def test_ticks_of_a_range_as_narrow_as_float_noise_end(lo, hi):
    """A metric constant up to float noise (a GRPO run's 100 steps had one) once made the tick loop add a
    step below the values' resolution forever, growing the learner to 15 GB mid-run."""
    from sao_core.reporting.plots import nice_ticks, step_chart
    ticks = nice_ticks(lo, hi)
    assert 2 <= len(ticks) <= 8 and ticks[0] <= lo and ticks[-1] >= hi and ticks == sorted(set(ticks))
    svg = step_chart("flat", [0, 1, 2], {"m": [lo, hi, lo]})
    assert svg.count("<circle") == 3


def test_ticks_stay_round_and_cover_the_range():
    from sao_core.reporting.plots import nice_ticks
    assert nice_ticks(0.0, 1.0) == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert nice_ticks(0.28, 0.51) == [0.25, 0.3, 0.35, 0.4, 0.45, 0.5, 0.55]
    assert nice_ticks(0.001, 0.0012) == [0.001, 0.00105, 0.0011, 0.00115, 0.0012]
    assert nice_ticks(float("nan"), 1.0) == [0.0, 1.0]


def test_the_evaluation_report_shows_the_training_run_next_to_it(tmp_path):
    """The report step of sao_rl / post_training gets the trained model; its run's curves join the page."""
    from sao_core.eval.report import render_report, write_report
    from sao_core.kfp.evaluation import training_run_of

    rows = _rl_rows("sao", 30)
    run = _write_run(tmp_path / "runs" / "r1" / "sao", rows, {"method": "sao", "steps": 30})
    assert training_run_of(str(run / "model")) == str(run)
    assert training_run_of("s3://bucket/runs/r1/sao/model/") == "s3://bucket/runs/r1/sao"
    summary = {"model": str(run / "model"), "benchmarks": {}}
    page = Path(write_report(summary, [], str(tmp_path / "report"), training_run=str(run))).read_text()
    check_values(page, rows)           # the embedded curves are the run's metrics
    assert set(plot_blocks(page)) == EXPECTED["sao"] | _OTHER_RL
    assert page.index("<h1>Evaluation of") < page.index('<section id="training">')
    assert "<h2>Training report: sao</h2>" in page and 'href="#training"' in page and "div.plots" in page
    evals = [r for r in rows if "eval_sampled_reward" in r]     # steps 10, 20, 30
    first, last = evals[0], evals[-1]
    headline = (f"held-out sampled reward {first['eval_sampled_reward']:.3f} (step 10) → "
                f"{last['eval_sampled_reward']:.3f} (step 30); held-out greedy reward "
                f"{first['eval_greedy_reward']:.3f} (step 10) → {last['eval_greedy_reward']:.3f} (step 30) over 3 "
                "evaluations")
    assert f"<b>Training: {headline}.</b>" in page                  # at the top of the evaluation page
    assert f"<b>H{headline[1:]}.</b>" not in page                   # once: not again under the section's title
    assert "Training report" not in render_report(summary, [])     # no training run: the page as before

    missing = Path(write_report(summary, [], str(tmp_path / "report2"),
                                training_run=str(tmp_path / "nowhere"))).read_text()
    assert "No training report" in missing and "nowhere: no such run directory" in missing


def test_a_long_run_is_plotted_in_buckets_of_steps(tmp_path):
    """3,000 SAO steps: every chart draws at most MAX_POINTS points per series, each the mean of its bucket of
    consecutive logged steps (checked against the metrics file), moving averages sampled at the bucket's last
    step; the page stays small (it embedded every value before: 7.8 MB at 5,000 steps)."""
    from sao_core.reporting.training import MAX_POINTS, bucketed

    rows = _rl_rows("sao", 3000)
    run = _write_run(tmp_path / "run", rows, {"method": "sao", "steps": 3000})
    page = Path(write_training_report(str(run), config={"method": "sao", "steps": 3000})).read_text()
    blocks = plot_blocks(page)
    assert set(blocks) == EXPECTED["sao"] | _OTHER_RL
    by_step = {r["step"]: r for r in rows}
    full = {c.id: d for _, c, d in chart_data(rows, max_points=10**9)}
    for plot_id, block in blocks.items():
        n = len(full[plot_id]["x"])
        if n <= MAX_POINTS:                # e.g. the held-out evaluation every 10 steps: 300 points
            assert "bucket" not in block and block["x"] == full[plot_id]["x"], plot_id
            continue
        size = block["bucket"]
        assert size == -(-n // MAX_POINTS) and len(block["x"]) <= MAX_POINTS and block["steps_total"] == n, plot_id
        assert f"the mean of {size} consecutive logged steps ({n} in all)" in page
        steps = full[plot_id]["x"]
        for i, x in enumerate(block["x"]):
            bucket = steps[i * size:(i + 1) * size]
            assert x == bucket[-1], plot_id
            for name, values in block["series"].items():
                if plot_id in _DICT_PLOTS:
                    raw = [by_step[s].get(_DICT_PLOTS[plot_id], {}).get(name, 0) for s in bucket]
                elif name == "learner_wait_share":
                    raw = [_wait_share(by_step[s]) for s in bucket]
                else:
                    raw = [by_step[s][name] for s in bucket if name in by_step[s]]
                # a sparse key (e.g. turn_cut_correct_share) may be absent from a whole bucket: None there
                assert values[i] == (pytest.approx(sum(raw) / len(raw)) if raw else None), (plot_id, name, x)
        for name, values in (block.get("smoothed") or {}).items():
            whole = full[plot_id]["smoothed"][name]
            assert values == [whole[min(n, (i + 1) * size) - 1] for i in range(len(values))], plot_id
    assert len(page) < 3_000_000, len(page)
    small = {"x": [1, 2, 3], "series": {"a": [1.0, None, 3.0]}}
    assert bucketed(small, max_points=3) is small
    assert bucketed(small, max_points=2)["series"] == {"a": [1.0, 3.0]}
    assert bucketed({"x": [1, 2, 3, 4], "series": {"a": [None, None, 2.0, 4.0]}}, 2)["series"] == {"a": [None, 3.0]}


def test_the_headline_says_what_the_run_achieved():
    from sao_core.reporting.training import training_headline

    assert training_headline([]) == ""
    sft = [{"step": i, "loss": 3.0 - i / 10} for i in range(1, 21)]     # tenths of 2 steps
    assert training_headline(sft) == "mean loss 2.850 over the first 2 logged steps → 1.050 over the last 2"
    rl = [{"step": i, "version": i, "reward_mean": i / 100} for i in range(1, 11)]
    assert training_headline(rl) == "mean batch reward 0.010 over the first 1 logged steps → 0.100 over the last 1"
    rl[0]["eval_sampled_reward"], rl[9]["eval_sampled_reward"] = 0.125, 0.5
    assert training_headline(rl) == "held-out sampled reward 0.125 (step 1) → 0.500 (step 10) over 2 evaluations"
