"""Benchmark loaders: the real IMO-AnswerBench CSV, BeyondAIME and SWE-Bench Verified rows from local
files (jsonl, csv, parquet), s3:// objects and prepared folders; Hugging Face ids offline; bad data and
bad settings with clear messages."""

from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pytest
from eval_fixtures import swe_repos  # noqa: F401  (fixture)

from sao_core.data.prepare import PrepareConfig, prepare
from sao_core.eval.benchmarks import BENCHMARKS, IMO_ANSWERBENCH_CSV, get_benchmark, load_benchmark, task_for
from sao_core.eval.config import DEFAULT_MATH_PROMPT, EvalConfig, EvalError

DATA = Path(__file__).parents[1] / "data" / "eval"
BEYOND = DATA / "beyond_aime_sample.jsonl"


def test_specs_and_unknown_names():
    assert list(BENCHMARKS) == ["swe_verified", "beyond_aime", "imo_answerbench"]
    assert get_benchmark("beyond_aime").default_source == "ByteDance-Seed/BeyondAIME"
    assert get_benchmark("swe_verified").default_source == "SWE-bench/SWE-bench_Verified"
    with pytest.raises(EvalError, match="unknown benchmark 'aime25'; choose from swe_verified, beyond_aime, "
                                        "imo_answerbench"):
        get_benchmark("aime25")


def test_imo_answerbench_real_csv(tmp_path):
    bench = load_benchmark(get_benchmark("imo_answerbench"), workdir=tmp_path / "imo")
    info = bench.dataset
    digest = "sha256:" + hashlib.sha256(IMO_ANSWERBENCH_CSV.read_bytes()).hexdigest()
    assert (info.source, info.version, info.rows_read, info.rows_rejected) == (str(IMO_ANSWERBENCH_CSV), digest, 400, 0)
    assert info.repaired == 1 and info.problems_used == info.problems_available == 400
    assert info.license == "CC-BY-4.0" and "Towards Robust Mathematical Reasoning" in info.citation
    assert [r["id"] for r in bench.records[:2]] == ["imo-bench-algebra-001", "imo-bench-algebra-002"]
    first = bench.records[0]
    assert first["answer"] == "3" and first["category"] == "Algebra" and first["subcategory"] == "Operation"
    assert (tmp_path / "imo" / "data.jsonl").exists() and (tmp_path / "imo" / "stats.json").exists()
    # the prompt: {problem} replaced literally, \boxed{} kept
    task = task_for(bench.spec, first, DEFAULT_MATH_PROMPT, system_prompt="Be brief.")
    assert task.env == "math" and task.answer == "3" and task.metadata["category"] == "Algebra"
    assert task.prompt[0] == {"role": "system", "content": "Be brief."}
    assert task.prompt[1]["content"].startswith("For a given positive integer $N$")
    assert task.prompt[1]["content"].endswith("put your final answer within \\boxed{}.")
    limited = load_benchmark(get_benchmark("imo_answerbench"), limit=5)
    assert [r["id"] for r in limited.records] == [r["id"] for r in bench.records[:5]]
    assert limited.dataset.problems_used == 5 and limited.dataset.problems_available == 400


def _beyond_rows() -> list[dict]:
    return [json.loads(line) for line in BEYOND.read_text().splitlines()]


def test_beyond_aime_from_jsonl_csv_and_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    spec = get_benchmark("beyond_aime")
    rows = _beyond_rows()
    csv_path = tmp_path / "beyond.csv"
    with open(csv_path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=["problem", "answer"])
        writer.writeheader()
        writer.writerows(rows)
    parquet_path = tmp_path / "beyond.parquet"
    pq.write_table(pa.Table.from_pylist([{"problem": r["problem"], "answer": int(r["answer"])} for r in rows]),
                   parquet_path)
    loaded = [load_benchmark(spec, str(path)) for path in (BEYOND, csv_path, parquet_path)]
    for bench in loaded:
        assert [r["answer"] for r in bench.records] == [15, 9, 467, 7, 18]
        assert all(r["id"].startswith("beyond_aime-") for r in bench.records)   # content-hash ids
        assert bench.dataset.version.startswith("sha256:")
    assert [r["id"] for r in loaded[0].records] == [r["id"] for r in loaded[2].records]
    task = task_for(spec, loaded[0].records[1], "Q: {problem}")
    assert task.answer == "9" and task.prompt == [{"role": "user", "content": "Q: What is the remainder when $7^{100}$ "
                                                                              "is divided by $13$?"}]


def test_hugging_face_id_offline_names_the_dataset():
    with pytest.raises(EvalError) as err:
        load_benchmark(get_benchmark("beyond_aime"))
    text = str(err.value)
    assert text.startswith("benchmark beyond_aime: cannot load dataset ByteDance-Seed/BeyondAIME")
    assert "split 'test'" in text and "offline" in text


def test_s3_source_and_prepared_folder(tmp_path, moto_s3):
    spec = get_benchmark("beyond_aime")
    moto_s3.client().upload_file(str(BEYOND), moto_s3.bucket, "bench/beyond.jsonl")
    bench = load_benchmark(spec, moto_s3.uri("bench/beyond.jsonl"))
    assert [r["answer"] for r in bench.records] == [15, 9, 467, 7, 18]
    assert bench.dataset.source == moto_s3.uri("bench/beyond.jsonl")
    # a folder written by `sao prepare-data --kind beyond_aime`, locally and on s3
    prepare(PrepareConfig(source=str(BEYOND), kind="beyond_aime", output=str(tmp_path / "prepared")))
    from_folder = load_benchmark(spec, str(tmp_path / "prepared"))
    assert from_folder.records == bench.records and from_folder.dataset.version == bench.dataset.version
    prepare(PrepareConfig(source=str(BEYOND), kind="beyond_aime", output=moto_s3.uri("prepared")))
    assert load_benchmark(spec, moto_s3.uri("prepared")).records == bench.records
    with pytest.raises(EvalError, match="was prepared with --kind beyond_aime; this benchmark needs --kind imo_answerbench"):
        load_benchmark(get_benchmark("imo_answerbench"), str(tmp_path / "prepared"))
    with pytest.raises(EvalError, match="cannot load dataset s3://.*/bench/missing.jsonl"):
        load_benchmark(spec, moto_s3.uri("bench/missing.jsonl"))


def test_bad_data_stops_with_file_row_and_field(tmp_path):
    spec = get_benchmark("beyond_aime")
    with pytest.raises(EvalError, match=r"cannot load dataset .*nope\.jsonl: data file not found"):
        load_benchmark(spec, str(tmp_path / "nope.jsonl"))
    no_answer = tmp_path / "no_answer.csv"
    no_answer.write_text("problem,solution\nWhat is 1+1?,2\nWhat is 2+2?,4\n")
    with pytest.raises(EvalError) as err:
        load_benchmark(spec, str(no_answer))
    assert "2 of 2 rows rejected" in str(err.value)
    assert "first: row 0 (line 2) field 'answer': missing_field: row has no 'answer'" in str(err.value)
    mixed = tmp_path / "mixed.jsonl"
    lines = BEYOND.read_text().splitlines()
    mixed.write_text("\n".join([lines[0], '{"problem": "x", "answer": "4.5"}', "{not json", *lines[1:]]) + "\n")
    with pytest.raises(EvalError, match=r"first: row 1 \(line 2\) field 'answer': not_integer: '4.5' is not an integer"):
        load_benchmark(spec, str(mixed))
    # tolerated when asked: the rejected rows are listed with file, row, line and field
    bench = load_benchmark(spec, str(mixed), max_reject_fraction=0.5)
    assert len(bench.records) == 5 and bench.dataset.rows_rejected == 2
    assert [(r["row"], r["line"], r["field"], r["reason"]) for r in bench.dataset.rejects] == [
        (1, 2, "answer", "not_integer"), (2, 3, None, "bad_json")]
    assert bench.dataset.rejects[0]["file"] == str(mixed)
    imo_short = tmp_path / "imo.csv"
    imo_short.write_text("Problem ID,Problem,Short Answer,Category\nq1,Find x.,3,Algebra\n")
    with pytest.raises(EvalError, match="field 'Subcategory': missing_field"):
        load_benchmark(get_benchmark("imo_answerbench"), str(imo_short))


def test_swe_rows_in_the_raw_layout(tmp_path, swe_repos):  # noqa: F811
    _, cases, rows_path = swe_repos
    bench = load_benchmark(get_benchmark("swe_verified"), str(rows_path))
    assert [r["id"] for r in bench.records] == [c.instance_id for c in cases]
    record = bench.records[1]
    assert record["fail_to_pass"] == cases[1].fail_to_pass and record["pass_to_pass"] == cases[1].pass_to_pass
    assert record["repo"] == "acme/textkit" and record["gold_patch"] == cases[1].patches["gold"]
    task = task_for(bench.spec, record, DEFAULT_MATH_PROMPT)
    assert task.env == "swe" and task.tests == cases[1].fail_to_pass and "lower case" in task.prompt[0]["content"]
    broken = tmp_path / "broken.jsonl"
    row = cases[0].row()
    row["FAIL_TO_PASS"] = '["tests/test_shapes.py::test_rect_negative"'     # cut JSON, as a bad export would
    broken.write_text(json.dumps(row) + "\n")
    with pytest.raises(EvalError, match="field 'FAIL_TO_PASS': bad_json: not a JSON list of strings"):
        load_benchmark(get_benchmark("swe_verified"), str(broken))


@pytest.mark.parametrize("changes,message", [
    ({"benchmarks": ["imo_answerbench", "gsm8k"]}, "unknown benchmark 'gsm8k'; choose from swe_verified, beyond_aime"),
    ({"benchmarks": []}, "benchmarks is empty"),
    ({"benchmarks": ["beyond_aime", "beyond_aime"]}, "lists a name twice"),
    ({"k": 0}, "k must be an integer >= 1, got 0"),
    ({"k": -2}, "k must be an integer >= 1, got -2"),
    ({"limit": 0}, "limit must be an integer >= 1, got 0"),
    ({"engine": "tgi"}, "engine must be one of hf, vllm"),
    ({"top_p": 0.0}, "top_p must be in (0, 1]"),
    ({"temperature": -1.0}, "temperature must be >= 0"),
    ({"max_new_tokens": 5000, "max_total_tokens": 4096}, "max_new_tokens (5000) exceeds max_total_tokens (4096)"),
    ({"math_prompt": "Solve it."}, "math_prompt must contain {problem}"),
    ({"judge_url": "http://127.0.0.1:9/v1"}, "judge_url and judge_model go together"),
    ({"judge_url": "127.0.0.1:9", "judge_model": "m"}, "judge_url must be an http(s):// URL"),
    ({"judge_policy": "always"}, "judge_policy must be one of unsettled, rejected"),
    ({"sandbox": "docker"}, "sandbox must be one of local, kubernetes"),
    ({"splits": {"aime": "test"}}, "splits names unknown benchmark 'aime'"),
    ({"model": " "}, "model is empty"),
    ({"output": ""}, "output is empty"),
])
def test_config_validation(changes, message):
    config = EvalConfig(**{"model": "embedded:tiny", "output": "/tmp/x", **changes})
    with pytest.raises(EvalError) as err:
        config.validate()
    assert message in str(err.value)
