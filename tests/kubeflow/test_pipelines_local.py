"""The pipelines run end to end on this machine with KFP's local runner (`kfp.local.SubprocessRunner`,
every step a subprocess running the component's compiled command): post_training's sft and sao
branches (the sao one with a warm start and the evaluation), the evaluation pipeline's ParallelFor over
two benchmarks with one report, an unknown method (and placement=trainjob with a local output_root)
stopped by the argument check before any data is prepared, the standalone rollout service, and
`make demo`'s path through `sao_rl` at a few steps (its learning at the demo's settings: CI runs `make demo`
and scripts/check_demo.py). Every run that trains uses placement=single_pod, which
never enters the TrainJob branch."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from sao_core import storage
from sao_core.data.synthetic import tool_arith_sft_rows
from sao_core.envs.tool_arith import tool_arith_tasks
from sao_core.kfp.local import LocalRunError, run_pipeline

TINY_SAO = {"critic_warmup_steps": 1, "max_new_tokens_per_turn": 24, "max_total_tokens": 128}
TINY_EVAL = dict(c_eval_k=1, c_eval_limit=2, c_eval_max_new_tokens=16, c_eval_max_total_tokens=256,
                 c_eval_sandbox="local", c_eval_options={"grader_workers": 1})


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("inputs")
    sft = root / "sft.jsonl"
    sft.write_text("".join(json.dumps(r) + "\n" for r in tool_arith_sft_rows(80, seed=1)))
    rl = root / "rl.jsonl"
    rl.write_text("".join(json.dumps({"id": t.id, "prompt": t.prompt, "env": t.env, "answer": t.answer}) + "\n"
                          for t in tool_arith_tasks(100, seed=3, p_more=1.0)))
    beyond = root / "beyond_aime.jsonl"
    beyond.write_text("".join(json.dumps({"problem": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                              for i in range(1, 4)))
    return {"sft": str(sft), "rl": str(rl), "beyond_aime": str(beyond)}


def _run(pipeline, arguments, tmp_path, sao_cache):
    return run_pipeline(pipeline, arguments, tmp_path / "root", cache_dir=sao_cache, threads=1)


def _only_run(root: Path) -> Path:
    (run,) = [p for p in root.iterdir() if p.is_dir()]
    return run


def test_post_training_sft_branch(tmp_path, inputs, sao_cache):
    from pipelines.post_training import post_training

    model_uri = _run(post_training, dict(a0_train_source=inputs["sft"], a0_output_root=str(tmp_path / "runs"),
                                         a_method="sft", b_steps=3, b_batch_size=4, b_learning_rate=1e-3,
                                         b_max_tokens=128, c_run_evaluation=False), tmp_path, sao_cache)
    run = _only_run(tmp_path / "runs")
    assert model_uri == str(run / "sft" / "model")
    assert storage.is_complete_checkpoint(model_uri)
    assert sorted(p.name for p in run.iterdir()) == ["sft"]  # only the chosen branch ran, no evaluation
    assert json.loads((run / "sft" / "summary.json").read_text())["steps"] == 3
    assert 'data-plot="loss"' in (run / "sft" / "training_report.html").read_text()  # the step's HTML artifact too


@pytest.mark.slow
def test_post_training_sao_branch_with_warm_start_and_evaluation(tmp_path, inputs, sao_cache):
    from pipelines.post_training import post_training

    model_uri = _run(post_training, dict(
        a0_train_source=inputs["rl"], a0_output_root=str(tmp_path / "runs"), a_method="sao", b_steps=2, b_batch_size=4,
        b_learning_rate=1e-4, b_max_tokens=128, b_engine="hf",
        b_method_options={**TINY_SAO, "admission": "version_order"}, a_warm_start_source=inputs["sft"],
        b_warm_start_steps=3, b_warm_start_lr=1e-3, c_eval_benchmarks=["imo_answerbench"], **TINY_EVAL),
        tmp_path, sao_cache)
    run = _only_run(tmp_path / "runs")
    assert model_uri == str(run / "sao" / "model")
    assert sorted(p.name for p in run.iterdir()) == ["eval-imo_answerbench", "report", "sao", "sft"]
    sao = json.loads((run / "sao" / "summary.json").read_text())
    assert sao["method"] == "sao" and sao["steps"] == 2 and sao["critic"]
    # SAO started from the warm-start model, not from the base model.
    learner = json.loads(storage.read_text(storage.join(sao["checkpoint"], "trainer_state.json")))
    assert learner["config"]["model"] == str(run / "sft" / "model")
    # post_training passes SAO's admission rule through method_options (sao_rl has a dropdown for it)
    assert learner["config"]["admission"] == sao["admission"] == "version_order"
    summary = json.loads((run / "report" / "summary.json").read_text())
    assert summary["model"] == model_uri and list(summary["benchmarks"]) == ["imo_answerbench"]
    assert (run / "report" / "report.html").read_text().count("IMO-AnswerBench") >= 1


def test_evaluation_pipeline_runs_benchmarks_in_parallel_steps(tmp_path, inputs, sao_cache):
    from pipelines.evaluation import evaluation

    report_uri = _run(evaluation, dict(
        a0_model="embedded:tiny", a0_output_root=str(tmp_path / "runs"), c_benchmarks=["imo_answerbench", "beyond_aime"],
        c_k=2, c_limit=2, c_engine="hf", c_max_new_tokens=16, c_max_total_tokens=256, c_sandbox="local",
        c_eval_options={"beyond_aime_source": inputs["beyond_aime"], "grader_workers": 1}), tmp_path, sao_cache)
    run = _only_run(tmp_path / "runs")
    assert report_uri == str(run / "report" / "report.html")
    assert sorted(p.name for p in run.iterdir()) == ["eval-beyond_aime", "eval-imo_answerbench", "report"]
    merged = json.loads((run / "report" / "summary.json").read_text())
    assert sorted(merged["benchmarks"]) == ["beyond_aime", "imo_answerbench"]
    assert merged["samples_generated"] == 2 * 2 + 2 * 2
    assert "beyond_aime/avg@2" in merged["metrics"] and "imo_answerbench/pass@2" in merged["metrics"]
    html = Path(report_uri).read_text()
    assert "BeyondAIME" in html and "IMO-AnswerBench" in html


def test_unknown_method_stops_at_the_check_before_any_data(tmp_path, inputs, sao_cache):
    from pipelines.post_training import post_training

    with pytest.raises(LocalRunError, match="check-post-training-arguments"):
        _run(post_training, dict(a0_train_source=inputs["sft"], a0_output_root=str(tmp_path / "runs"), a_method="ppo"),
             tmp_path, sao_cache)
    assert not (tmp_path / "runs").exists()
    assert not list((tmp_path / "root").rglob("prepare-data*")), "no data step may start after a failed check"


def test_trainjob_placement_with_a_local_output_root_stops_at_the_check(tmp_path, inputs, sao_cache):
    from pipelines.post_training import post_training

    with pytest.raises(LocalRunError, match="check-post-training-arguments"):
        _run(post_training, dict(a0_train_source=inputs["rl"], a0_output_root=str(tmp_path / "runs"), a_method="sao",
                                 d_placement="trainjob"), tmp_path, sao_cache)
    assert not (tmp_path / "runs").exists()
    assert not list((tmp_path / "root").rglob("prepare-data*")), "no data step may start after a failed check"
    assert not list((tmp_path / "root").rglob("launch-trainjob*")), "no TrainJob may be launched"


def test_sao_rl_refuses_an_unknown_options_key_by_name_at_its_first_step(tmp_path, inputs, sao_cache, capfd):
    """A misspelt b_options key fails sao_rl's check step, naming the key, before the data step starts."""
    from pipelines.sao_rl import sao_rl

    with pytest.raises(LocalRunError, match="check-sao-rl-arguments"):
        _run(sao_rl, dict(a0_rl_source=inputs["rl"], a0_output_root=str(tmp_path / "runs"), b_engine="hf",
                          b_options={"critic_lrr": 1e-5}), tmp_path, sao_cache)
    out, err = capfd.readouterr()   # the step's own output (the local runner's subprocess)
    assert "unknown field(s) critic_lrr for RLConfig" in out + err
    assert not (tmp_path / "runs").exists()
    assert not list((tmp_path / "root").rglob("prepare-data*")), "no data step may start after a failed check"


def test_standalone_rollout_service_serves_until_shutdown(tmp_path, sao_cache):
    from kfp import local

    from components.rollout_service import rollout_service

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"))
    outcome: dict = {}

    def serve():
        import os

        os.environ["SAO_CACHE_DIR"] = str(sao_cache)
        try:
            outcome["task"] = rollout_service(model="embedded:tiny", engine="hf", host="127.0.0.1", port=port)
        except Exception as err:  # reported below
            outcome["error"] = err

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.5)
    else:
        pytest.fail(f"the rollout service did not come up: {outcome}")
    generated = httpx.post(f"{url}/v1/generate", json={"prompts": [[{"role": "user", "content": "Compute 2 + 3"}]],
                                                       "n": 1, "max_new_tokens": 4, "seed": 0}, timeout=60)
    assert generated.status_code == 200, generated.text
    assert httpx.post(f"{url}/v1/shutdown", json={"grace_s": 1}, timeout=10).status_code == 200
    thread.join(timeout=60)
    assert not thread.is_alive() and "error" not in outcome, outcome


def test_the_demo_path_runs_end_to_end_and_its_check_reads_the_outcome(tmp_path, sao_cache):
    """`make demo`'s path (`run_sao_rl_demo`: inputs, the sao_rl pipeline with a warm start, SAO with
    held-out evaluation during training, the benchmark evaluation, the report with the training run's curves) at
    a few steps: its plumbing, not its learning. That the demo's own settings learn (a rise of the held-out
    sampled reward of at least DEMO_MARGIN, calibrated in sao_core/demo.py) is what CI checks on the real `make
    demo` run with scripts/check_demo.py (`demo_problems`, tested below on this run's summary); that SAO
    learns is tests/learner/test_learner.py::test_rl_raises_the_reward[sao]."""
    from sao_core.demo import (
        DEMO_EVAL_EVERY,
        DEMO_HELD_OUT,
        DEMO_MARGIN,
        DEMO_SAO_STEPS,
        demo_problems,
        run_sao_rl_demo,
    )

    said: list[str] = []
    # the smallest run that still has the demo's shape: SAO past its critic warm-up (5 steps), so the policy
    # trains and is pushed, and held-out evaluations at the start, in the middle and at the end
    result = run_sao_rl_demo(tmp_path / "demo", sao_cache, warm_start_steps=3, warm_start_rows=32, sao_steps=6,
                             batch_size=4, held_out=4, eval_every=3, eval_limit=2, threads=1, say=said.append)
    assert [line[:5] for line in said] == ["[1/3]", "[2/3]", "[3/3]"]
    assert result["sft_model_verified"] and result["sao_model_verified"]
    assert result["sao"]["steps"] == 6
    page = Path(result["report"]).read_text()
    assert "IMO-AnswerBench" in page and "Training report: sao" in page   # the training run next to the evaluation
    assert "<b>Training: held-out sampled reward " in page                 # and its outcome at the top
    plotted = {m["id"]: m for m in (json.loads(b) for b in re.findall(
        r'<script type="application/json" class="plot-data">(.*?)</script>', page, re.S))}
    assert {"reward", "heldout_reward", "staleness"} <= set(plotted), sorted(plotted)
    # (a full SAO run's critic and DIS curves: tests/reporting/test_training_report.py, on a real SAO run's page)
    sampled = plotted["heldout_reward"]
    assert sampled["x"] == result["held_out"]["steps"] == [0, 3, 6]
    assert sampled["series"]["eval_sampled_reward"] == [e["eval_sampled_reward"] for e in result["held_out"]["by_step"]]
    assert "imo_answerbench/avg@2" in result["evaluation_metrics"]
    summary = json.loads(Path(result["summary_file"]).read_text())
    assert summary["report"] == result["report"]
    held = summary["held_out"]
    assert held["prompts"] == 4 and held["samples_per_prompt"] == 2
    for key in ("sampled_before", "sampled_after", "greedy_before", "greedy_after"):
        assert 0.0 <= held[key] <= 1.0
    # The check CI runs after `make demo`, on this summary: six steps are not the demo's settings, and a rise
    # below the margin is named with its numbers; the same summary with the demo's shape and a rise passes.
    problems = demo_problems(summary)
    assert any(f"SAO ran {DEMO_SAO_STEPS} steps (ran 6)" in p for p in problems), problems

    shaped = {**summary, "sao": {**summary["sao"], "steps": DEMO_SAO_STEPS},
              "held_out": {**held, "prompts": DEMO_HELD_OUT, "steps": list(range(0, DEMO_SAO_STEPS + 1, DEMO_EVAL_EVERY)),
                           "sampled_before": 0.2, "sampled_after": 0.2 + DEMO_MARGIN + 0.01}}
    assert demo_problems(shaped) == []
    flat = {**shaped, "held_out": {**shaped["held_out"], "sampled_after": 0.25}}
    assert demo_problems(flat) == [f"expected: the held-out sampled reward rises by at least {DEMO_MARGIN} "
                                   "(0.200 -> 0.250)"]


def test_a_local_run_gives_back_print_and_the_root_logger_that_kfp_swaps_without_a_lock():
    """KFP's local runner swaps `print` and the root logger's handlers around each task without a lock; a
    ParallelFor runs two tasks on two threads. Here the two tasks' contexts (KFP's own) enter and leave in the
    order that leaks when the first task to start also ends first (it happened on CI: every later `print` of
    the process was indented). The guard every `run_pipeline` runs under gives both back."""
    import builtins
    import contextlib
    import logging

    from kfp.local import logging_utils

    from sao_core.kfp.local import _process_state_kept

    root = logging.getLogger()
    before_print, before_handlers = builtins.print, root.handlers[:]

    def two_overlapping_tasks():
        first, second = contextlib.ExitStack(), contextlib.ExitStack()
        for stack in (first, second):   # task 1 starts, task 2 starts
            stack.enter_context(logging_utils.local_logger_context())
            stack.enter_context(logging_utils.indented_print())
        first.close()                   # task 1 ends first
        second.close()

    try:
        two_overlapping_tasks()         # KFP alone: the leak this guards against (fails if KFP fixes it)
        assert builtins.print is not before_print and root.handlers != before_handlers
    finally:
        builtins.print, root.handlers[:] = before_print, before_handlers
    with _process_state_kept():
        two_overlapping_tasks()
    assert builtins.print is before_print and root.handlers == before_handlers
