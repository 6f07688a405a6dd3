"""The benchmarks in bench/: smoke runs of every script with tiny settings so that they cannot rot (the
simulator's own cases are in tests/sim/test_sim.py). No timing assertions: the numbers are measured by the scripts."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from sao_core.sim import predict_measured

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import simulator  # noqa: E402


# ----------------------------------------------------------------------------------------- script smoke runs
@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """The scripts set one torch thread for their process; give the rest of the session its setting back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_learner_step_smoke(tmp_path, sao_cache, monkeypatch):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import learner_step

    assert learner_step.main(["--quick", "--batch-size", "3", "--reps", "1", "--p-more", "1.0",
                              "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "learner_step.json").read_text())
    assert result["overhead_ratio"] > 0 and result["settings"]["batch_rows"] == 3
    assert (tmp_path / "learner_step.png").stat().st_size > 0


def test_weight_push_smoke(tmp_path, sao_cache, monkeypatch):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import weight_push

    assert weight_push.main(["--quick", "--reps", "1", "--output", str(tmp_path)]) == 0
    case = json.loads((tmp_path / "weight_push.json").read_text())["cases"][0]
    assert case["engine"] == "hf" and case["final_version"] == 2 and case["bytes"] > 0


def test_async_vs_sync_smoke_and_simulator_validation(tmp_path, sao_cache, monkeypatch):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import async_vs_sync

    assert async_vs_sync.main(["--model", "embedded:tiny", "--tails", "none", "--batch-size", "4",
                               "--group-size", "2", "--steps", "2", "--max-new-tokens-per-turn", "6",
                               "--max-total-tokens", "96", "--service", "thread", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "async_vs_sync.json").read_text())
    arms = result["tails"][0]["arms"]
    assert set(arms) == {"sync_grpo", "sao_eqC", "async_grpo", "sao", "sao_version_order", "sao_requeue",
                         "sao_bound4x", "sao_no_drop", "sao_fragments", "gen_only", "train_only_sao",
                         "train_only_grpo"}
    assert all(r["trajectories"] == 8 for r in arms.values())
    rules = ("sao", "sao_version_order", "sao_requeue", "sao_bound4x", "sao_no_drop", "sao_fragments")
    assert [arms[a]["admission"] for a in rules] == [
        "window", "version_order", "requeue", "window", "no_drop", "fragments"] and arms["sao_bound4x"]["max_staleness"] == 16
    for arm in rules:   # per-token lag from the journal: a histogram whose count is the trained action tokens
        lag = arms[arm]["token_lag"]
        assert sum(lag.values()) == arms[arm]["action_tokens"] > 0, arm
        assert 0 <= arms[arm]["token_lag_p50"] <= arms[arm]["token_lag_p99"] <= arms[arm]["token_lag_max"]
        assert 0 <= arms[arm]["tokens_beyond_bound"] <= 1 and arms[arm]["pieces_per_episode"] >= 1
    for arm in ("sync_grpo", "sao", "sao_version_order"):   # one operation per task here: the ratio is exactly 1
        bias = arms[arm]["length_bias"]
        assert bias["length_ratio"] == pytest.approx(1.0) and bias["task_ops_mean"] == 1.0
        assert 0 <= bias["untrained_token_share"] < 1 and bias["owed_at_end"] >= 0
    # cores per process: the thread service shares this process (not separable), the learner used some CPU
    assert arms["sao"]["cores"]["service"] is None and arms["sao"]["cores"]["learner"] > 0
    assert arms["train_only_sao"]["cores"]["learner"] > 0
    derived = result["tails"][0]["derived"]["steady"]
    assert derived["sync_grpo"]["vs_sync_grpo"] == pytest.approx(1.0) and "limit" in derived["sao"]
    validation = predict_measured(result)
    assert {r["arm"] for r in validation["rows"]} == {"sync_grpo", "sao_eqC", "async_grpo", "sao"}
    assert all(r["predicted"] > 0 for r in validation["rows"])
    # the script's validate command: the same figures, table and plot next to the result
    assert simulator.main(["validate", str(tmp_path / "async_vs_sync.json")]) == 0
    written = json.loads((tmp_path / "simulator_validation.json").read_text())
    assert [r["predicted"] for r in written["rows"]] == pytest.approx([r["predicted"] for r in validation["rows"]])
    assert (tmp_path / "simulator_validation.png").stat().st_size > 0


def test_process_cpu_seconds_counts_a_service_and_its_children():
    """A service's CPU includes its live child processes (vLLM runs its engine core in one): a parent that
    sleeps while its child spins is charged the child's CPU."""
    import os
    import signal
    import subprocess
    import time

    import _setup

    spinner = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, "
                                "'-c', 'while True: pass']); time.sleep(60)"], start_new_session=True)
    try:
        # The parent only sleeps: CPU seconds beyond its own ~0.05 can only be its child's. Waits on the
        # condition (a loaded machine gives the spinner less CPU per second), not for a fixed time.
        deadline = time.monotonic() + 120
        while _setup.process_cpu_seconds(spinner.pid) <= 0.5:
            assert time.monotonic() < deadline, "the child's CPU never showed in the parent's"
            time.sleep(0.1)
        assert _setup.process_cpu_seconds() > 0
    finally:
        os.killpg(spinner.pid, signal.SIGKILL)
        spinner.wait()


def test_simulator_script_run(tmp_path, capsys):
    assert simulator.main(["run", "--group-size", "8", "--batch-size", "16", "--rollout-gpus", "2",
                           "--trajectories", "32", "--colocated-sync", "--output", str(tmp_path)]) == 0
    assert "SAO / sync = " in capsys.readouterr().out
    assert set(json.loads((tmp_path / "simulate.json").read_text())) == {"settings", "sync", "sao"}


def test_real_model_smoke_and_bad_arguments(tmp_path, sao_cache, monkeypatch, capsys):
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import real_model

    assert real_model.main(["--model", "embedded:tiny", "--max-steps", "3", "--batch-size", "4", "--group-size", "2",
                            "--critic-warmup-steps", "1", "--eval-problems", "4", "--train-problems", "40",
                            "--max-new-tokens", "6", "--service", "thread", "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "real_model.json").read_text())
    assert set(result["arms"]) == {"sao", "sync_grpo"}
    for arm in result["arms"].values():
        assert arm["learner_steps"] == 3 and arm["trained_trajectories"] == 12 and arm["stopped_by"] == "max_steps"
        assert [s["step"] for s in arm["steps"]] == [1, 2, 3] and all(s["t_s"] > 0 for s in arm["steps"])
        assert 0.0 <= arm["eval_end"]["accuracy"] <= 1.0 and arm["trajectories_per_s"] > 0
        assert arm["conditions"]["before"]["loadavg_1_5_15"]
    assert result["arms"]["sao"]["policy_versions"] == 2 and result["arms"]["sync_grpo"]["policy_versions"] == 3
    assert result["eval_start"]["problems"] == 4 and result["settings"]["batch_size"] == 4
    assert set(result["derived"]["ratios_sao_over_grpo"]) >= {"trajectories_per_s", "reward_last"}
    assert (tmp_path / "real_model.png").stat().st_size > 0
    assert "SAO / GRPO" in (tmp_path / "real_model.txt").read_text()
    for bad, message in ((["--batch-size", "6", "--group-size", "4"], "--group-size must be >= 2 and divide"),
                         (["--minutes-per-arm", "0"], "--minutes-per-arm must be > 0"),
                         (["--arms", "sao,ppo"], "--arms: unknown"),
                         (["--operations", "*", "--max-steps-per-problem", "2"], "needs '+' or '-'"),
                         (["--critic-warmup-steps", "5", "--max-steps", "5"], "SAO never updates the policy")):
        with pytest.raises(SystemExit) as exit_info:
            real_model.main(["--model", "embedded:tiny", "--output", str(tmp_path / "bad"), *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_learner_memory_smoke(tmp_path, monkeypatch):
    """The script end to end (its main here, each configuration's worker in its own process through the script's
    command line) for the current code, with a "before" configuration over `--max-logits-gb` reported as skipped;
    then the "before" worker itself (the previous release's full-logits forward) in this process, on the same
    seeded model and batch: the same entropy. (One worker process less than running both modes through the script:
    it is the same worker either way.) Two rows of 128 action tokens: the script runs and writes what it
    promises; the sizes that matter are the full run's."""
    import learner_memory
    import torch

    import sao_core.learner.updates as updates

    out = tmp_path / "learner_memory.json"
    assert learner_memory.main(["--tokens", "256", "--row-tokens", "128", "--vocabs", "1000", "--threads", "1",
                                "--max-logits-gb", "0", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    rows = {r["mode"]: r for r in report["results"]}
    assert set(rows) == {"before", "after"} and rows["before"]["action_tokens"] == 256
    assert "one float32 [N, V] logits tensor is" in rows["before"]["skipped"] and "peak_rss_mb" not in rows["before"]
    assert "error" not in rows["after"], rows["after"]
    assert rows["after"]["action_tokens"] == 256 and rows["after"]["peak_rss_mb"] > 0
    assert rows["after"]["step_over_bare"] > 0 and report["row_action_tokens"] == 128
    # the worker swaps the legacy forward into the learner and seeds torch: both undone after this test
    monkeypatch.setattr(updates, "_policy_forward", updates._policy_forward)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with torch.random.fork_rng():
        before = learner_memory.worker("before", 1000, 256, row_actions=128)
    assert updates._policy_forward is learner_memory.legacy_policy_forward   # it ran the previous release's forward
    assert before["action_tokens"] == 256 and before["step_over_bare"] > 0
    assert before["entropy"] == pytest.approx(rows["after"]["entropy"], rel=1e-4)   # same statistic


def test_learning_runs_smoke_and_bad_arguments(tmp_path, sao_cache, capsys):
    """A short run of the learning test's computation (4 steps of 8 episodes, one per quarter): its line, the
    summary and the JSON with the run's health quarters; an unknown method is refused."""
    import learning_runs

    assert learning_runs.main(["--method", "sao", "--runs", "1", "--first-seed", "3", "--steps", "4",
                               "--batch-size", "8", "--critic-warmup", "2", "--sft-steps", "10",
                               "--output", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "learning_runs.json").read_text())
    assert [r["seed"] for r in result["runs"]] == [3] and result["summary"]["runs"] == 1
    assert set(result["runs"][0]["quarters"]) == set(learning_runs.HEALTH)
    assert len(result["runs"][0]["quarters"]["turn_cut_share"]) == 4
    assert result["summary"]["settings"]["critic_warmup"] == 2 and "seed   3:" in capsys.readouterr().out
    summary = json.loads((tmp_path / "seed-3" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["trained_trajectories"] == 4 * 8   # the run got the script's settings
    with pytest.raises(SystemExit):
        learning_runs.main(["--method", "ppo", "--output", str(tmp_path / "x")])


def test_gpu_real_loop_smoke(tmp_path):
    """The GPU real-loop script's CPU smoke run: SAO through train_rl, in-memory pushes, every figure recorded."""
    import gpu_real_loop

    out = tmp_path / "loop.json"
    assert gpu_real_loop.main(["--smoke", "--out", str(out), "--workdir", str(tmp_path / "work")]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["pushes"] == 2 and report["delivery_logp_diff_mean"]["max"] < 1e-4
    assert 0 < report["push_share_of_step"]["median"] < 1 and report["durable_wait_s"]["n"] == 2


def test_weight_transport_smoke(tmp_path, sao_cache, monkeypatch):
    """bench/weight_transport.py at the tiny shape: memory, files, copy, gloo and durable figures, side by side."""
    monkeypatch.setenv("SAO_CACHE_DIR", str(sao_cache))
    import weight_transport

    assert weight_transport.main(["--quick", "--no-step", "--output", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "weight_transport.json").read_text())["cases"]
    assert [c["engine_dtype"] for c in cases] == ["float32", "bfloat16"]
    for case in cases:
        assert {"memory", "files", "copy", "gloo", "durable"} <= set(case["median_s"]) and case["memory_over_copy"] > 0
