"""SWE-Bench Verified through the evaluator on three self-made repositories in real bubblewrap sandboxes:
the loader reads the raw rows, the grader applies each patch in a fresh sandbox and runs the instance's
tests; then the runner plays agent episodes (scripted turns, real `swe` environment) and scores them."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from eval_fixtures import ScriptedEngine, needs_bwrap, swe_repos, swe_sandbox_options  # noqa: F401  (fixtures)

from sao_core.envs.swebench_harness import SWEBENCH_PIN, swebench_version
from sao_core.eval.benchmarks import get_benchmark, load_benchmark
from sao_core.eval.config import EvalConfig, EvalError
from sao_core.eval.graders import grade_swe_patch
from sao_core.eval.run import evaluate, sample_seed, swe_env_options


@needs_bwrap
def test_gold_empty_breaking_and_bad_patches(swe_repos, swe_sandbox_options):  # noqa: F811
    mirrors, cases, rows = swe_repos
    bench = load_benchmark(get_benchmark("swe_verified"), str(rows))
    options = {**swe_sandbox_options, "repo_source": str(mirrors), "test_timeout_s": 120}
    assert len(bench.records) == 3
    jobs = [(case, record, kind) for case, record in zip(cases, bench.records, strict=True)
            for kind in ("gold", "empty", "breaking", "bad")]
    with ThreadPoolExecutor(max_workers=4) as pool:      # each grade waits on its sandbox's processes
        verdicts = list(pool.map(lambda job: grade_swe_patch(job[1], "" if job[2] == "empty" else job[0].patches[job[2]],
                                                             options), jobs))
    results = {(case.instance_id, kind): v for (case, _, kind), v in zip(jobs, verdicts, strict=True)}
    for case in cases:
        gold = results[(case.instance_id, "gold")]
        assert (gold.correct, gold.grade, gold.grader) == (True, "resolved", "swe_tests"), (case.instance_id, gold)
        assert gold.extra["fail_to_pass_passed"] == len(case.fail_to_pass)
        assert gold.extra["pass_to_pass_passed"] == len(case.pass_to_pass)

        empty = results[(case.instance_id, "empty")]
        assert (empty.correct, empty.grade) == (False, "empty_patch"), (case.instance_id, empty)
        assert empty.extra["tests_run"] and empty.extra["fail_to_pass_failed"] == case.fail_to_pass
        assert empty.extra["pass_to_pass_failed"] == []

        breaking = results[(case.instance_id, "breaking")]
        assert (breaking.correct, breaking.grade) == (False, "unresolved"), (case.instance_id, breaking)
        assert breaking.extra["fail_to_pass_failed"] == [] and breaking.extra["patch_applied"]
        assert breaking.extra["pass_to_pass_failed"] == case.broken_p2p

        bad = results[(case.instance_id, "bad")]
        assert (bad.correct, bad.grade) == (False, "patch_does_not_apply"), (case.instance_id, bad)
        assert bad.detail.startswith("the patch does not apply") and not bad.extra["tests_run"]


def _apply(patch: str) -> str:
    call = {"name": "bash", "arguments": {"command": "git apply <<'EOF'\n" + patch + "EOF\ngit diff --stat"}}
    return "Let me apply my fix.\n<tool_call>" + json.dumps(call) + "</tool_call>"


@needs_bwrap
def test_runner_plays_and_grades_agent_episodes(tmp_path, swe_repos, swe_sandbox_options, tiny_model_dir):  # noqa: F811
    from sao_core.models import load_tokenizer

    mirrors, cases, rows = swe_repos
    geometry, textkit, inventory = cases
    submit = "The fix is complete. <submit/>"
    turns = {
        (geometry.instance_id, 0): [_apply(geometry.patches["gold"]), submit],
        (geometry.instance_id, 1): [submit],                                   # submits without a change
        (textkit.instance_id, 0): [_apply(textkit.patches["breaking"]), submit],
        (textkit.instance_id, 1): ["Hmm.", "Still thinking.", "No idea."],     # never submits: max turns
        (inventory.instance_id, 0): [_apply(inventory.patches["gold"]), submit],
        (inventory.instance_id, 1): [_apply(inventory.patches["breaking"]), submit],
    }
    script = {sample_seed(0, "swe_verified", pid, i): texts for (pid, i), texts in turns.items()}
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir, tmp_path), script)
    config = EvalConfig(model="scripted-agent", output=str(tmp_path / "run"), benchmarks=["swe_verified"], k=2,
                        swe_verified_source=str(rows), swe_repo_source=str(mirrors), swe_max_turns=3,
                        env_options={"swe": swe_sandbox_options}, max_new_tokens=1024, max_total_tokens=8192,
                        swe_concurrency=3, cache_dir=str(tmp_path))
    summary = evaluate(config, engine=engine)
    swe = summary["benchmarks"]["swe_verified"]
    assert swe["scores"]["avg@2"] == pytest.approx(1 / 3)
    assert swe["scores"]["pass@1"] == pytest.approx(1 / 3)
    assert swe["scores"]["pass@2"] == pytest.approx(2 / 3)
    assert summary["metrics"]["swe_verified/resolved_rate"] == pytest.approx(1 / 3)
    assert swe["groups"]["repo"]["acme/geometry"]["avg@2"] == 0.5
    assert swe["groups"]["repo"]["acme/textkit"]["pass@2"] == 0.0
    assert summary["metrics"]["swe_verified/repo/acme_inventory/pass@2"] == 1.0
    samples = {(s["id"], s["sample"]): s for s in map(json.loads, (tmp_path / "run" / "samples.jsonl").read_text().splitlines())}
    assert len(samples) == 6
    expected = [(geometry, 0, "resolved"), (geometry, 1, "empty_patch"), (textkit, 0, "unresolved"),
                (textkit, 1, "no_submission"), (inventory, 0, "resolved"), (inventory, 1, "unresolved")]
    for case, i, grade in expected:
        s = samples[(case.instance_id, i)]
        assert s["grade"] == grade and s["correct"] == (grade == "resolved"), s
        assert s["status"] == "graded" and s["groups"] == {"repo": case.repo}
    won = samples[(geometry.instance_id, 0)]
    assert won["grader"] == "swe_tests" and won["turns"] == 2 and "raise ValueError" in won["patch"]
    assert won["tests"] == {"fail_to_pass_total": 1, "fail_to_pass_passed": 1, "fail_to_pass_failed": [],
                            "pass_to_pass_total": 2, "pass_to_pass_passed": 2, "pass_to_pass_failed": []}
    assert won["harness"] == {"harness": f"swebench {swebench_version()}", "log_parser": "parse_log_pytest",
                              "resolution": "RESOLVED_FULL", "log_valid": True,
                              "test_command": "fallback"}      # the rows have no eval_script: our commands ran
    lost = samples[(inventory.instance_id, 1)]
    assert lost["tests"]["pass_to_pass_failed"] == inventory.broken_p2p
    assert lost["harness"]["resolution"] == "RESOLVED_NO"
    gave_up = samples[(textkit.instance_id, 1)]
    assert gave_up["grader"] is None and gave_up["finish_reason"] == "length" and gave_up["turns"] == 3
    assert swe["counts"]["correct"] == 2 and swe["counts"]["empty"] == 1 and swe["counts"]["length"] == 1
    assert swe["graders"] == {"swe_tests": 5}
    report = (tmp_path / "run" / "report.html").read_text()
    assert "Resolved rate over all 3 instances (avg@2): <b>33.3%</b>" in report
    assert "SWE-Bench Verified: avg@2 per repo" in report and "patch_does_not_apply" not in report
    assert "(<code>make_test_spec</code>): 0 sample(s); by our fallback commands: 5." in report
    # the grading library's version: in run.json, in the summary and in the report
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["library_versions"]["swebench"] == swebench_version() == SWEBENCH_PIN
    assert set(run["library_versions"]) >= {"swebench", "math-verify", "sympy", "latex2sympy2_extended"}
    assert swe["library_versions"] == {"swebench": SWEBENCH_PIN}
    assert f"<code>swebench {SWEBENCH_PIN}</code>" in report and "official SWE-bench harness" in report


def test_kubernetes_sandbox_without_a_cluster_fails_every_sample_clearly(tmp_path, swe_repos, tiny_model_dir,  # noqa: F811
                                                                         monkeypatch):
    from sao_core.models import load_tokenizer

    for name in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))            # no ~/.kube/config
    _, _, rows = swe_repos
    config = EvalConfig(model="scripted-agent", output=str(tmp_path / "run"), benchmarks=["swe_verified"], k=1,
                        swe_verified_source=str(rows), sandbox="kubernetes",
                        env_options={"swe": {"sandbox_options": {"namespace": "eval"}}}, max_new_tokens=64,
                        max_total_tokens=1024, cache_dir=str(tmp_path))
    assert swe_env_options(config) == {"sandbox_kind": "kubernetes", "max_turns": 40, "command_timeout_s": 60.0,
                                       "test_timeout_s": 1800.0, "repo_source": None,
                                       "sandbox_options": {"namespace": "eval"}}
    engine = ScriptedEngine(load_tokenizer(tiny_model_dir, tmp_path), {})
    with pytest.raises(EvalError, match=r"all 3 samples failed \(outputs written to .*\); first: swe_verified "
                                        r"acme__\S+: SandboxError: no Kubernetes configuration"):
        evaluate(config, engine=engine)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 3 and {(s["status"], s["finish_reason"], s["grader"]) for s in samples} == {
        ("error", "env_error", None)}
    assert engine.calls == []                      # the episodes stopped before the model was asked anything
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["benchmarks"]["swe_verified"]["errors_total"] == 3
    assert summary["metrics"]["swe_verified/error_rate"] == 1.0
