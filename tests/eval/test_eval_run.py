"""The evaluation runner end to end: the embedded model on a slice of each benchmark (HF engine, real
sandboxes), the report opened and checked, resuming, scores by hand with scripted answers and the LLM
judge over HTTP, s3:// output, the comparison with a previous run, bad inputs, and `sao evaluate`."""

from __future__ import annotations

import csv
import json
import re
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest
from eval_fixtures import (  # noqa: F401  (fixtures)
    HAVE_BWRAP,
    ScriptedEngine,
    judge_server,
    swe_repos,
    swe_sandbox_options,
)

from sao_core.eval import EvalConfig, EvalError, evaluate, write_report
from sao_core.eval.run import sample_seed

DATA = Path(__file__).parents[1] / "data" / "eval"
BEYOND = DATA / "beyond_aime_sample.jsonl"
SVG = "{http://www.w3.org/2000/svg}"
SAMPLE_FIELDS = {"benchmark", "id", "sample", "status", "correct", "grade", "grader", "settled", "rule", "answer", "detail",
                 "finish_reason", "timed_out", "tokens", "prompt_tokens", "turns", "seconds", "generation_seconds",
                 "tool_seconds", "grade_seconds", "seed", "groups", "response"}


class _Text(HTMLParser):
    def __init__(self):
        super().__init__()
        self.parts: list[str] = []
        self.ids: list[str] = []
        self._skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in ("style", "svg"):
            self._skip += 1
        self.ids += [v for k, v in attrs if k == "id"]

    def handle_endtag(self, tag):
        if tag in ("style", "svg"):
            self._skip -= 1

    def handle_data(self, data):
        if not self._skip:
            self.parts.append(data)


def open_report(path: Path) -> tuple[str, list[str], list[ET.Element]]:
    """(visible text, element ids, parsed SVG charts) of a report; every chart must be well-formed SVG."""
    html = path.read_text(encoding="utf-8")
    assert html.startswith("<!DOCTYPE html>") and "<script" not in html.lower()
    assert not re.search(r'(?:src|href)\s*=\s*"https?:', html)       # self-contained: nothing fetched
    parser = _Text()
    parser.feed(html)
    charts = [ET.fromstring(svg) for svg in re.findall(r"<svg\b.*?</svg>", html, re.S)]
    for chart in charts:
        assert chart.tag == SVG + "svg" and chart.get("role") == "img"
        assert float(chart.get("width")) > 0 and float(chart.get("height")) > 0
        assert chart.find(SVG + "title").text
    return " ".join(" ".join(parser.parts).split()), parser.ids, charts


def chart(charts: list[ET.Element], title: str) -> ET.Element:
    found = [c for c in charts if c.find(SVG + "title").text == title]
    assert len(found) == 1, [c.find(SVG + "title").text for c in charts]
    return found[0]


def marks(svg: ET.Element, kind: str = "rect") -> list[dict[str, str]]:
    return [dict(e.attrib) for e in svg.iter(SVG + kind) if e.get("class") in ("bar", "point")]


def read_samples(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "samples.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------------------------------ the real model

@pytest.mark.slow
@pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) is not installed: apt-get install -y bubblewrap")
def test_embedded_model_on_a_slice_of_each_benchmark(tmp_path, sao_cache, swe_repos, swe_sandbox_options):  # noqa: F811
    mirrors, _, rows = swe_repos
    out = tmp_path / "run"
    base = dict(model="embedded:tiny", output=str(out), k=2, limit=2, beyond_aime_source=str(BEYOND),
                swe_verified_source=str(rows), swe_repo_source=str(mirrors), env_options={"swe": swe_sandbox_options},
                swe_max_turns=2, max_new_tokens=12, max_total_tokens=1024, concurrency=8, cache_dir=str(sao_cache))
    progress: list[tuple[int, int]] = []
    summary = evaluate(EvalConfig(**base), progress=lambda done, total: progress.append((done, total)))

    assert summary["samples_generated"] == 12 and summary["samples_reused"] == 0 and summary["engine"] == "hf"
    assert progress[0] == (0, 12) and progress[-1] == (12, 12) and len(progress) == 13
    for name in ("samples.jsonl", "summary.json", "metrics.json", "report.html", "run.json",
                 "datasets/imo_answerbench/data.jsonl", "datasets/beyond_aime/stats.json", "datasets/swe_verified/rejects.jsonl"):
        assert (out / name).is_file(), name
    samples = read_samples(out)
    assert len(samples) == 12
    assert {(s["benchmark"], s["sample"]) for s in samples} == {(b, i) for b in ("swe_verified", "beyond_aime",
                                                                                 "imo_answerbench") for i in (0, 1)}
    for s in samples:
        assert SAMPLE_FIELDS <= set(s), SAMPLE_FIELDS - set(s)
        assert s["status"] == "graded" and isinstance(s["correct"], bool) and 1 <= s["tokens"] <= 24
        assert s["seconds"] > 0 and s["prompt_tokens"] > 10
    math = [s for s in samples if s["benchmark"] != "swe_verified"]
    assert {s["grader"] for s in math} <= {"rule", "exact_int"} and all(s["turns"] == 1 for s in math)
    assert {s["grader"] for s in samples if s["benchmark"] == "imo_answerbench"} == {"rule"}
    assert {s["groups"]["category"] for s in samples if s["benchmark"] == "imo_answerbench"} == {"Algebra"}
    swe = [s for s in samples if s["benchmark"] == "swe_verified"]
    assert all(s["grade"] == "no_submission" and not s["correct"] for s in swe)   # the tiny model never submits

    assert json.loads((out / "summary.json").read_text())["metrics"] == summary["metrics"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics == summary["metrics"] and all(isinstance(v, float) for v in metrics.values())
    for name in ("imo_answerbench/avg@2", "imo_answerbench/pass@2", "imo_answerbench/maj@2", "beyond_aime/pass@1",
                 "swe_verified/resolved_rate", "imo_answerbench/category/algebra/avg@2", "swe_verified/repo/acme_geometry/avg@2"):
        assert 0.0 <= metrics[name] <= 1.0, name
    imo = summary["benchmarks"]["imo_answerbench"]
    assert imo["problems"] == 2 and imo["k"] == 2 and imo["samples"] == 4
    assert imo["dataset"]["rows_read"] == 400 and imo["dataset"]["problems_used"] == 2
    assert imo["dataset"]["version"].startswith("sha256:")
    assert sum(imo["counts"].values()) == 4 and sum(summary["benchmarks"]["swe_verified"]["counts"].values()) == 4

    text, ids, charts = open_report(out / "report.html")
    assert "Evaluation of embedded:tiny" in text
    assert {"swe_verified", "beyond_aime", "imo_answerbench"} <= set(ids)
    for words in ("SWE-Bench Verified", "BeyondAIME", "IMO-AnswerBench", "Who decided", "CC-BY-4.0",
                  imo["dataset"]["version"], "imo-bench-algebra-001"):
        assert words in text, words
    scores = chart(charts, "Score per benchmark")
    bars = {(b["data-series"], b["data-label"]): float(b["data-value"]) for b in marks(scores)}
    for b in summary["benchmarks"].values():
        assert bars[("avg@k", b["title"])] == pytest.approx(b["scores"]["avg@2"], abs=1e-6)
        assert bars[("pass@k", b["title"])] == pytest.approx(b["scores"]["pass@2"], abs=1e-6)
    assert ("maj@k", "SWE-Bench Verified") not in bars and ("maj@k", "IMO-AnswerBench") in bars
    curve = marks(chart(charts, "pass@k"), "circle")
    assert len(curve) == 3 * 2                                        # pass@1 and pass@2 per benchmark
    for b in summary["benchmarks"].values():
        lengths = marks(chart(charts, f"{b['title']}: response length"))
        assert sum(int(m["data-value"]) for m in lengths) == 4       # every sample is in the histogram
    assert len(marks(chart(charts, "IMO-AnswerBench: avg@2 per category"))) == 1
    assert len(marks(chart(charts, "SWE-Bench Verified: avg@2 per repo"))) == 2

    # resume: nothing is generated again; more samples per problem generate only the new ones
    again = evaluate(EvalConfig(**base))
    assert (again["samples_generated"], again["samples_reused"]) == (0, 12)
    assert again["metrics"] == summary["metrics"]
    with pytest.raises(EvalError, match=r"holds samples of a different run \(sampling: .*temperature.*1\.0.*0\.5"):
        evaluate(EvalConfig(**{**base, "temperature": 0.5}))


# ------------------------------------------------------------------------------------------ scripted answers

IMO_ROWS = [
    ["t-alg-1", "Find the number of real roots of $x^3 - 3x = 0$.", "3", "Algebra", "Polynomial", "self-made"],
    ["t-nt-1", "For which $n$ is $n^2 + 1$ even?", "odd $n$", "Number theory", "Parity", "self-made"],
    ["t-geo-1", "A point is chosen uniformly in a square; what is the chance it is closer to the left side?",
     "$\\frac{1}{2}$", "Geometry", "Probability", "self-made"],
]


def _imo_csv(path: Path) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["Problem ID", "Problem", "Short Answer", "Category", "Subcategory", "Source"])
        writer.writerows(IMO_ROWS)
    return path


def _beyond_ids(tmp_path: Path) -> list[str]:
    from sao_core.eval.benchmarks import get_benchmark, load_benchmark

    return [r["id"] for r in load_benchmark(get_benchmark("beyond_aime"), str(BEYOND)).records]


def _box(answer: str) -> str:
    return f"<think>Let me work it out.</think>The answer is $\\boxed{{{answer}}}$."


def _scripted_math(tmp_path: Path, tokenizer, judge_url: str | None = None, **changes):
    """IMO (3 self-made problems, k = 4) and BeyondAIME (5 self-made problems) with known answers."""
    imo_answers = {
        "t-alg-1": [_box("3"), _box("3"), _box("4"), "I give up."],                         # c = 2
        "t-nt-1": [_box("all odd n"), _box("n odd"), _box("all even n"), _box("odd $n$")],  # c = 3 (2 by the judge)
        "t-geo-1": [_box("0.5"), _box("1/3"), _box("1/3"), _box("\\frac{1}{3}")],           # c = 1
    }
    beyond = _beyond_ids(tmp_path)
    beyond_answers = {beyond[0]: "15", beyond[1]: "9", beyond[2]: "466", beyond[3]: "seven"}
    script = {sample_seed(0, "imo_answerbench", pid, i): [text] for pid, texts in imo_answers.items()
              for i, text in enumerate(texts)}
    for pid, answer in beyond_answers.items():
        script.update({sample_seed(0, "beyond_aime", pid, i): [_box(answer)] for i in range(4)})
    # the last BeyondAIME problem: the right box, then far more text than max_new_tokens
    script.update({sample_seed(0, "beyond_aime", beyond[4], i): ["\\boxed{18}" + " and so on" * 400] for i in range(4)})
    engine = ScriptedEngine(tokenizer, script)
    config = EvalConfig(**{"model": "scripted-math", "output": str(tmp_path / "run"),
                           "benchmarks": ["beyond_aime", "imo_answerbench"], "k": 4, "beyond_aime_source": str(BEYOND),
                           "imo_answerbench_source": str(_imo_csv(tmp_path / "imo.csv")), "max_new_tokens": 256,
                           "max_total_tokens": 4096, "judge_url": judge_url, "judge_model": "judge-x" if judge_url else None,
                           "cache_dir": str(tmp_path), **changes})
    return config, engine, beyond


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir, tmp_path_factory):
    from sao_core.models import load_tokenizer

    return load_tokenizer(tiny_model_dir, tmp_path_factory.mktemp("tok"))


def test_scores_by_hand_with_judge(tmp_path, tiny_tokenizer, judge_server):  # noqa: F811
    config, engine, beyond = _scripted_math(tmp_path, tiny_tokenizer, judge_server.url)
    summary = evaluate(config, engine=engine)
    imo = summary["benchmarks"]["imo_answerbench"]
    # c = 2, 3, 1 of k = 4
    assert imo["scores"]["avg@4"] == pytest.approx((2 + 3 + 1) / 12)
    assert imo["scores"]["pass@1"] == pytest.approx(0.5)
    assert imo["scores"]["pass@2"] == pytest.approx((1 - 1 / 6 + 1 + 1 - 3 / 6) / 3)
    assert imo["scores"]["pass@4"] == pytest.approx(1.0)
    assert imo["scores"]["maj@4"] == pytest.approx(2 / 3)            # t-geo-1: "1/3" outvotes the right answer
    assert imo["graders"] == {"rule": 9, "llm_judge": 3}
    assert imo["counts"]["correct"] == 6 and imo["counts"]["empty"] == 1 and imo["counts"]["unsettled"] == 0
    assert imo["groups"]["category"]["Number theory"]["avg@4"] == 0.75
    assert imo["groups"]["subcategory"]["Probability"]["pass@4"] == 1.0
    assert summary["metrics"]["imo_answerbench/category/geometry/avg@4"] == 0.25
    assert len(judge_server.requests) == 3
    by = {(s["benchmark"], s["id"], s["sample"]): s for s in read_samples(tmp_path / "run")}
    judged = by[("imo_answerbench", "t-nt-1", 0)]
    assert (judged["grader"], judged["correct"], judged["rule_grade"]) == ("llm_judge", True, "unsettled")
    assert judged["judge"]["verdict"] == "CORRECT" and judged["judge"]["model"] == "judge-x"
    assert by[("imo_answerbench", "t-nt-1", 3)]["grader"] == "rule"      # same text: no judge needed

    ba = summary["benchmarks"]["beyond_aime"]
    assert ba["scores"]["avg@4"] == pytest.approx(3 / 5) and ba["scores"]["maj@4"] == pytest.approx(3 / 5)
    assert ba["counts"]["unparseable"] == 4 and ba["graders"] == {"exact_int": 20}
    cut = by[("beyond_aime", beyond[4], 0)]
    assert (cut["finish_reason"], cut["correct"], cut["answer"], cut["tokens"]) == ("length", True, "18", 256)

    text, _, charts = open_report(tmp_path / "run" / "report.html")
    assert "llm_judge" in text and "judge-x" in text
    assert "LLM judge rulings: 3" in text     # every ruling listed (answer, what the rules said, verdict, cached)
    bars = {b["data-label"]: float(b["data-value"]) for b in marks(chart(charts, "IMO-AnswerBench: avg@4 per category"))}
    assert bars == {"Algebra": 0.5, "Geometry": 0.25, "Number theory": 0.75}
    assert len(marks(chart(charts, "pass@k"), "circle")) == 3 + 3          # pass@1, 2, 4 of two benchmarks


def test_unsettled_timeouts_errors_and_resume(tmp_path, tiny_tokenizer):
    config, engine, _ = _scripted_math(tmp_path, tiny_tokenizer, benchmarks=["imo_answerbench"],
                                       sample_timeout_s=3.0)
    slow = sample_seed(0, "imo_answerbench", "t-alg-1", 1)
    engine.delays[slow] = 30.0
    summary = evaluate(config, engine=engine)
    imo = summary["benchmarks"]["imo_answerbench"]
    # no judge: the two prose answers that are not the same text stay unsettled (wrong, listed)
    assert imo["counts"]["unsettled"] == 3 and imo["unsettled_total"] == 3
    assert {(u["id"], u["answer"]) for u in imo["unsettled"]} == {("t-nt-1", "all odd n"), ("t-nt-1", "n odd"),
                                                                  ("t-nt-1", "all even n")}
    assert imo["counts"]["timeout"] == 1 and summary["metrics"]["imo_answerbench/timeout_rate"] == pytest.approx(1 / 12)
    assert imo["scores"]["avg@4"] == pytest.approx((1 + 1 + 1) / 12)
    samples = read_samples(tmp_path / "run")
    timed_out = next(s for s in samples if s["seed"] == slow)
    assert (timed_out["status"], timed_out["timed_out"], timed_out["correct"]) == ("timeout", True, False)
    text, _, _ = open_report(tmp_path / "run" / "report.html")
    assert "Answers no grader could settle (counted as wrong): 3" in text

    # an errored sample (here: marked so in the file) is redone on resume; graded and timed-out ones are not
    lines = (tmp_path / "run" / "samples.jsonl").read_text().splitlines()
    victim = json.loads(lines[0])
    lines[0] = json.dumps({**victim, "status": "error", "correct": False, "grade": "error", "detail": "sandbox lost"})
    (tmp_path / "run" / "samples.jsonl").write_text("\n".join(lines) + "\n" + '{"benchmark": "imo_answ')  # torn line
    engine.calls.clear()
    engine.script = {}                                # the model now answers the default text
    # ... and more samples per problem generate only the new sample indices
    again = evaluate(EvalConfig(**{**config.__dict__, "k": 5}), engine=engine)
    assert (again["samples_generated"], again["samples_reused"]) == (1 + 3, 11)
    assert sorted(engine.calls) == sorted([victim["seed"]] + [sample_seed(0, "imo_answerbench", pid, 4)
                                                              for pid in ("t-alg-1", "t-nt-1", "t-geo-1")])
    assert all(json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines())
    assert sorted({s["sample"] for s in read_samples(tmp_path / "run")}) == [0, 1, 2, 3, 4]
    assert "imo_answerbench/pass@5" in again["metrics"] and "imo_answerbench/pass@4" in again["metrics"]
    assert again["benchmarks"]["imo_answerbench"]["counts"]["timeout"] == 1
    # another model's samples are never mixed in; resume=false starts over
    with pytest.raises(EvalError, match=r"holds samples of a different run \(model: 'scripted-math' there, 'other' now\)"):
        evaluate(EvalConfig(**{**config.__dict__, "model": "other"}), engine=engine)
    fresh = evaluate(EvalConfig(**{**config.__dict__, "resume": False, "k": 1, "benchmarks": ["beyond_aime"]}),
                     engine=engine)
    assert (fresh["samples_generated"], fresh["samples_reused"]) == (5, 0)
    assert {s["benchmark"] for s in read_samples(tmp_path / "run")} == {"beyond_aime"}


def test_comparison_with_a_previous_run(tmp_path, tiny_tokenizer):
    config, engine, beyond = _scripted_math(tmp_path, tiny_tokenizer, benchmarks=["beyond_aime"], k=1)
    first = evaluate(config, engine=engine)
    assert first["metrics"]["beyond_aime/avg@1"] == pytest.approx(0.6)
    later = EvalConfig(**{**config.__dict__, "output": str(tmp_path / "later"), "model": "scripted-math-v2",
                          "previous_summary": str(tmp_path / "run")})
    script = {sample_seed(0, "beyond_aime", pid, 0): [_box(ans)] for pid, ans in zip(beyond, ("15", "9", "467", "7", "18"),
                                                                                       strict=True)}
    second = evaluate(later, engine=ScriptedEngine(tiny_tokenizer, script))
    assert second["benchmarks"]["beyond_aime"]["scores"]["avg@1"] == 1.0
    diff = second["comparison"]["metrics"]["beyond_aime/avg@1"]
    assert diff == {"current": 1.0, "previous": pytest.approx(0.6), "delta": pytest.approx(0.4)}
    assert second["comparison"]["model"] == "scripted-math"
    assert second["comparison"]["metrics"]["beyond_aime/unparseable_rate"]["delta"] == pytest.approx(-0.2)
    text, _, charts = open_report(tmp_path / "later" / "report.html")
    assert "Comparison with the previous run" in text and "scripted-math" in text and "+0.4" in text
    bars = {(b["data-series"], b["data-label"]): float(b["data-value"]) for b in marks(chart(charts, "Previous vs current"))}
    assert bars[("previous", "BeyondAIME avg@1")] == pytest.approx(0.6) and bars[("current", "BeyondAIME avg@1")] == 1.0
    # write_report on its own, with the previous run given as a path
    samples = read_samples(tmp_path / "later")
    target = write_report(second, samples, str(tmp_path / "alone"), previous=str(tmp_path / "run" / "summary.json"))
    assert target == str(tmp_path / "alone" / "report.html")
    assert "Comparison with the previous run" in open_report(Path(target))[0]
    with pytest.raises(EvalError, match="cannot read the previous summary"):
        evaluate(EvalConfig(**{**later.__dict__, "previous_summary": str(tmp_path / "nowhere")}))


def test_s3_output_resumes_from_the_bucket(tmp_path, tiny_tokenizer, moto_s3):
    config, engine, _ = _scripted_math(tmp_path, tiny_tokenizer, benchmarks=["beyond_aime"], k=1,
                                       output=moto_s3.uri("evals/run-1"))
    summary = evaluate(config, engine=engine)
    keys = {o["Key"] for o in moto_s3.client().list_objects_v2(Bucket=moto_s3.bucket)["Contents"]}
    assert {f"evals/run-1/{n}" for n in ("samples.jsonl", "summary.json", "metrics.json", "report.html", "run.json",
                                         "datasets/beyond_aime/data.jsonl")} <= keys
    assert summary["files"]["report"] == moto_s3.uri("evals/run-1/report.html")
    again = evaluate(config, engine=engine)
    assert (again["samples_generated"], again["samples_reused"]) == (0, 5)
    assert again["metrics"] == summary["metrics"]


# Evaluation on vLLM (was test_vllm_engine here, with an engine of its own): on the vLLM module engine,
# tests/rollout/test_vllm_in_memory.py::test_evaluation_samples_on_the_vllm_engine.


# ------------------------------------------------------------------------------------------ bad inputs

class _NeverCalled:
    tokenizer = None

    async def generate(self, prompt_ids, params):
        raise AssertionError("the engine must not be asked")

def test_bad_inputs_stop_with_clear_messages(tmp_path, sao_cache):
    # max_total_tokens within the embedded model's context (4096; the default 32768 is refused, see
    # tests/rollout/test_context_and_dtype.py)
    base = dict(model="embedded:tiny", output=str(tmp_path / "out"), benchmarks=["imo_answerbench"], k=1, limit=1,
                max_new_tokens=8, max_total_tokens=1024, cache_dir=str(sao_cache))
    cases = [
        ({"benchmarks": ["imo_answerbench", "aime"]}, "unknown benchmark 'aime'; choose from"),
        ({"k": 0}, "k must be an integer >= 1, got 0"),
        ({"limit": -1}, "limit must be an integer >= 1, got -1"),
        ({"imo_answerbench_source": str(tmp_path / "missing.csv")}, "cannot load dataset .*missing.csv: data file not found"),
        ({"model": str(tmp_path / "no-such-model")}, "cannot load the model: model '.*no-such-model': no such directory"),
        ({"benchmarks": ["swe_verified"]}, "swe_verified with the local sandbox needs the repositories"),
        ({"engine_options": {"max_batsh": 4}}, "engine_options .* do not fit the hf engine"),
    ]
    for changes, message in cases:
        with pytest.raises(EvalError, match=message):
            evaluate(EvalConfig(**{**base, **changes}))
    # a sample that cannot even start (environment options that do not fit) fails; when all do, the run stops
    with pytest.raises(EvalError, match=r"all 1 samples failed .*first: imo_answerbench imo-bench-algebra-001: "
                                        r"TypeError: .*unexpected keyword argument 'max_turnz'"):
        evaluate(EvalConfig(**{**base, "env_options": {"math": {"max_turnz": 3}}}), engine=_NeverCalled())
    (tmp_path / "afile").write_text("x")
    with pytest.raises(EvalError, match="output .*afile exists and is not a folder"):
        evaluate(EvalConfig(**{**base, "output": str(tmp_path / "afile")}))


# ------------------------------------------------------------------------------------------ CLI

def test_cli_evaluate(tmp_path, sao_cache, capsys):
    from sao_core.cli import main

    out = tmp_path / "cli"
    code = main(["--quiet", "--cache-dir", str(sao_cache), "evaluate", "--model", "embedded:tiny", "--benchmarks",
                 "imo_answerbench", "--k", "2", "--limit", "4", "--output", str(out), "--max-new-tokens", "8",
                 "--max-total-tokens", "1024"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    printed = json.loads(captured.out.split("\n\nreport:")[0])
    assert printed == json.loads((out / "metrics.json").read_text())
    assert f"report: {out / 'report.html'}" in captured.out
    assert len(read_samples(out)) == 8 and (out / "report.html").is_file()
    for argv, message in (
        (["--benchmarks", "imo_answerbench,aime"], "unknown benchmark 'aime'"),
        (["--k", "0"], "k must be an integer >= 1, got 0"),
        (["--k", "two"], "field 'k': expected int, got 'two'"),
    ):
        code = main(["--quiet", "--cache-dir", str(sao_cache), "evaluate", "--model", "embedded:tiny",
                     "--output", str(tmp_path / "bad"), *argv])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and err[-1].startswith("sao evaluate: error: ") and message in err[-1], err
    code = main(["--quiet", "evaluate", "--output", str(tmp_path / "bad")])
    assert code == 2 and "missing required field(s) model" in capsys.readouterr().err
