"""Tests for sao_core.data (readers, schemas, prepare)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sao_core.data import KINDS, REASONS, DataError, PrepareConfig, iter_rows, prepare
from sao_core.data.readers import RowReadError

IMO_CSV = Path(__file__).resolve().parents[2] / "sao_core" / "data" / "assets" / "imo_answerbench_v2.csv"

# --------------------------------------------------------------------------- helpers


def write_jsonl(path: Path, rows: list) -> Path:
    """Rows may be dicts (dumped) or raw strings (written as they are)."""
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def run(tmp_path: Path, source: Path | str, kind: str, **kw):
    out = tmp_path / "out"
    stats = prepare(PrepareConfig(source=str(source), kind=kind, output=str(out), **kw))
    return stats, read_out(out)


def read_out(out: Path):
    data = [json.loads(x) for x in (out / "data.jsonl").read_text().splitlines()]
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    return data, rejects


def msgs(*pairs):
    return [{"role": r, "content": c} for r, c in pairs]


GOOD_CHAT = msgs(("user", "hi"), ("assistant", "hello"))

# --------------------------------------------------------------------------- every kind


def test_sft_jsonl(tmp_path):
    rows = [
        {"id": "a1", "messages": msgs(("system", "be brief"), ("user", "2+2?"), ("assistant", "4"))},
        {"prompt": "Say hi", "completion": "hi"},
        {"prompt": msgs(("user", "Say bye")), "response": "bye"},
        {
            "messages": [
                {"role": "user", "content": "add 2 3"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [{"name": "calc", "arguments": '{"a": 2, "b": 3}'}],
                },
                {"role": "tool", "name": "calc", "content": "5"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"type": "function", "function": {"name": "done", "arguments": {"v": 5}}}],
                },
                {"role": "assistant", "content": "5"},
            ]
        },
    ]
    src = write_jsonl(tmp_path / "sft.jsonl", rows)
    stats, (data, rejects) = run(tmp_path, src, "sft")
    assert (stats.rows_read, stats.rows_written, stats.rows_rejected) == (4, 4, 0)
    assert rejects == []
    assert data[0] == {"id": "a1", "messages": rows[0]["messages"]}
    assert data[1]["messages"] == msgs(("user", "Say hi"), ("assistant", "hi"))
    assert data[1]["id"].startswith("sft-") and len(data[1]["id"]) == len("sft-") + 16
    assert data[2]["messages"] == msgs(("user", "Say bye"), ("assistant", "bye"))
    tool = data[3]["messages"]
    assert tool[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"name": "calc", "arguments": {"a": 2, "b": 3}}],
    }
    assert tool[2] == {"role": "tool", "content": "5", "name": "calc"}
    assert tool[3]["tool_calls"] == [{"name": "done", "arguments": {"v": 5}}]
    assert set(json.loads((tmp_path / "out" / "stats.json").read_text())) >= {
        "rows_read",
        "rows_written",
        "rows_rejected",
        "rejected_by_reason",
        "duplicates",
        "source",
        "kind",
        "files",
        "dataset_version",
        "seconds",
    }
    assert stats.dataset_version.startswith("sha256:")
    # ids are stable across runs
    stats2 = prepare(PrepareConfig(source=str(src), kind="sft", output=str(tmp_path / "again")))
    assert read_out(tmp_path / "again")[0] == data
    assert stats2.dataset_version == stats.dataset_version


def test_cpt_json_array_and_json_lines_in_dot_json(tmp_path):
    src = tmp_path / "cpt.json"
    src.write_text(json.dumps([{"text": "alpha beta"}, {"content": "gamma"}, {"text": "  "}, 5]))
    stats, (data, rejects) = run(tmp_path, src, "cpt", max_reject_fraction=1.0)
    assert [d["text"] for d in data] == ["alpha beta", "gamma"]
    assert all(d["id"].startswith("cpt-") for d in data)
    assert [(r["row"], r["field"], r["reason"]) for r in rejects] == [
        (2, "text", "empty"),
        (3, None, "wrong_type"),
    ]
    assert all(r["file"] == str(src) and r["line"] is None for r in rejects)
    # a .json file that holds JSON lines is read line by line
    src2 = write_jsonl(tmp_path / "lines.json", [{"text": "one"}, {"text": "two"}])
    stats2 = prepare(PrepareConfig(source=str(src2), kind="cpt", output=str(tmp_path / "o2")))
    assert stats2.rows_written == 2


def test_dpo_parquet(tmp_path):
    rows = [
        {"prompt": "Q1", "chosen": "good", "rejected": "bad"},
        {"prompt": "Q2", "chosen": "same", "rejected": "same"},
    ]
    src = write_parquet(tmp_path / "dpo.parquet", rows)
    _, (data, rejects) = run(tmp_path, src, "dpo", max_reject_fraction=1.0)
    assert data == [{"id": data[0]["id"], "prompt": "Q1", "chosen": "good", "rejected": "bad"}]
    assert [(r["row"], r["field"], r["reason"]) for r in rejects] == [
        (1, "rejected", "chosen_equals_rejected")
    ]
    # conversational form
    conv = [
        {
            "id": 7,
            "prompt": msgs(("user", "Q")),
            "chosen": msgs(("assistant", "A")),
            "rejected": msgs(("assistant", "B")),
        }
    ]
    src2 = write_jsonl(tmp_path / "dpo.jsonl", conv)
    prepare(PrepareConfig(source=str(src2), kind="dpo", output=str(tmp_path / "o2")))
    data2, _ = read_out(tmp_path / "o2")
    assert data2 == [
        {"id": "7", "prompt": conv[0]["prompt"], "chosen": conv[0]["chosen"], "rejected": conv[0]["rejected"]}
    ]


def test_rl_csv(tmp_path):
    src = write_csv(
        tmp_path / "rl.csv",
        ["prompt", "env", "answer", "tests", "level"],
        [
            ["What is 2+2?", "math", "4", "", "easy"],
            ["Fix the bug", "swe", "", json.dumps(["tests/test_a.py::test_x"]), "hard"],
            ["Compute 3*4", "tool_arith", "12", "", ""],
            ["Hmm", "chess", "1", "", ""],
        ],
    )
    stats, (data, rejects) = run(tmp_path, src, "rl", max_reject_fraction=1.0)
    assert stats.rows_written == 3
    assert data[0]["prompt"] == msgs(("user", "What is 2+2?"))
    assert (data[0]["env"], data[0]["answer"], data[0]["tests"], data[0]["metadata"]) == (
        "math",
        "4",
        None,
        {"level": "easy"},
    )
    assert (data[1]["answer"], data[1]["tests"]) == (None, ["tests/test_a.py::test_x"])
    assert data[2]["metadata"] == {}
    # csv rows are data rows (header excluded); line is the physical line
    assert rejects == [
        {
            "file": str(src),
            "row": 3,
            "line": 5,
            "field": "env",
            "reason": "unknown_environment",
            "detail": rejects[0]["detail"],
        }
    ]
    assert "chess" in rejects[0]["detail"]
    # numbers become answer strings; environments are configurable
    src2 = write_jsonl(
        tmp_path / "rl.jsonl", [{"prompt": "x", "environment": "chess", "answer": 3.0, "metadata": {"k": 1}}]
    )
    prepare(PrepareConfig(source=str(src2), kind="rl", output=str(tmp_path / "o2"), environments=("chess",)))
    d2, _ = read_out(tmp_path / "o2")
    assert (d2[0]["env"], d2[0]["answer"], d2[0]["metadata"]) == ("chess", "3", {"k": 1})


def swe_row(i: int, **over) -> dict:
    row = {
        "instance_id": f"astropy__astropy-{1000 + i}",
        "repo": "astropy/astropy",
        "base_commit": "abc123",
        "problem_statement": f"Bug {i}",
        "patch": "diff --git a/x b/x\n",
        "test_patch": "diff --git a/t b/t\n",
        "FAIL_TO_PASS": json.dumps(["t::test_fail"]),
        "PASS_TO_PASS": json.dumps(["t::test_ok", "t::test_ok2"]),
        "version": "4.3",
        "environment_setup_commit": "def456",
        "hints_text": "",
        "created_at": "2023-01-01T00:00:00Z",
        "difficulty": "<15 min fix",
    }
    row.update(over)
    return row


def test_swe_bench_verified_parquet(tmp_path):
    rows = [
        swe_row(0),
        swe_row(1, FAIL_TO_PASS='["t::a", ', PASS_TO_PASS="[]"),
        swe_row(2, FAIL_TO_PASS="[]"),
    ]
    src = write_parquet(tmp_path / "swe.parquet", rows)
    stats, (data, rejects) = run(tmp_path, src, "swe_bench_verified", max_reject_fraction=1.0)
    assert data == [
        {
            "id": "astropy__astropy-1000",
            "repo": "astropy/astropy",
            "base_commit": "abc123",
            "problem_statement": "Bug 0",
            "gold_patch": "diff --git a/x b/x\n",
            "test_patch": "diff --git a/t b/t\n",
            "fail_to_pass": ["t::test_fail"],
            "pass_to_pass": ["t::test_ok", "t::test_ok2"],
            "version": "4.3",
            "environment_setup_commit": "def456",
            "hints_text": "",
            "created_at": "2023-01-01T00:00:00Z",
            "difficulty": "<15 min fix",
        }
    ]
    assert [(r["row"], r["field"], r["reason"]) for r in rejects] == [
        (1, "FAIL_TO_PASS", "bad_json"),
        (2, "FAIL_TO_PASS", "empty"),
    ]
    # real lists are accepted too
    src2 = write_jsonl(tmp_path / "swe.jsonl", [swe_row(3, FAIL_TO_PASS=["a"], PASS_TO_PASS=[])])
    prepare(PrepareConfig(source=str(src2), kind="swe_bench_verified", output=str(tmp_path / "o2")))
    d2, _ = read_out(tmp_path / "o2")
    assert (d2[0]["fail_to_pass"], d2[0]["pass_to_pass"]) == (["a"], [])


def test_beyond_aime(tmp_path):
    rows = [
        {"problem": "P1", "answer": "123"},
        {"problem": "P2", "answer": 45.0},
        {"problem": "P3", "answer": 6},
        {"problem": "P4", "answer": 12.5},
        {"problem": "P5", "answer": "x=3"},
    ]
    src = write_jsonl(tmp_path / "ba.jsonl", rows)
    _, (data, rejects) = run(tmp_path, src, "beyond_aime", max_reject_fraction=1.0)
    assert [(d["problem"], d["answer"]) for d in data] == [("P1", 123), ("P2", 45), ("P3", 6)]
    assert all(type(d["answer"]) is int and d["id"].startswith("beyond_aime-") for d in data)
    assert [(r["row"], r["line"], r["field"], r["reason"]) for r in rejects] == [
        (3, 4, "answer", "not_integer"),
        (4, 5, "answer", "not_integer"),
    ]


IMO_HEADER = ["Problem ID", "Problem", "Short Answer", "Category", "Subcategory", "Source"]


def test_imo_answerbench_small_csv(tmp_path):
    src = write_csv(
        tmp_path / "imo.csv",
        IMO_HEADER,
        [
            ["imo-1", "Find $x$.\nMultiline, with commas.", "$3$", "Algebra", "Inequality", "IMO 2020"],
            ["imo-2", "Find $y$.", "", "Geometry", "Circles", "ISL"],
        ],
    )
    _, (data, rejects) = run(tmp_path, src, "imo_answerbench", max_reject_fraction=1.0)
    assert data == [
        {
            "id": "imo-1",
            "problem": "Find $x$.\nMultiline, with commas.",
            "answer": "$3$",
            "category": "Algebra",
            "subcategory": "Inequality",
            "source": "IMO 2020",
        }
    ]
    assert [(r["row"], r["line"], r["field"], r["reason"]) for r in rejects] == [
        (1, 4, "Short Answer", "missing_field")
    ]


def test_imo_answerbench_real_file(tmp_path):
    # IMO-AnswerBench v2, CC-BY-4.0, Google DeepMind ("Towards Robust Mathematical Reasoning", EMNLP 2025)
    stats, (data, rejects) = run(tmp_path, IMO_CSV, "imo_answerbench")
    assert (stats.rows_read, stats.rows_written, stats.rows_rejected, stats.duplicates) == (400, 400, 0, 0)
    assert rejects == []
    assert len({d["id"] for d in data}) == 400
    cats = {d["category"] for d in data}
    assert cats == {"Algebra", "Combinatorics", "Geometry", "Number theory"}
    # the record with the missing closing quote upstream is realigned, not mis-read
    fixed = next(d for d in data if d["id"] == "imo-bench-algebra-036")
    assert fixed["answer"] == r"$Y(x)=A+\frac{B}{x}-x$"
    assert (fixed["category"], fixed["subcategory"], fixed["source"]) == (
        "Algebra",
        "Functional Equation",
        "Iran 2002",
    )
    assert fixed["problem"].endswith(r"\]")
    assert stats.repaired == 1
    assert all(d["problem"] and d["answer"] for d in data)


# --------------------------------------------------------------------------- every reason

# (kind, row or raw jsonl line, expected field, expected reason)
REASON_CASES = [
    ("sft", "{not json", None, "bad_json"),
    ("sft", "[1, 2]", None, "wrong_type"),
    ("sft", {"text": "no messages"}, "messages", "missing_field"),
    ("sft", {"messages": "hi"}, "messages", "wrong_type"),
    ("sft", {"messages": []}, "messages", "empty"),
    (
        "sft",
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "messages[0].role",
        "bad_role",
    ),
    ("sft", {"messages": msgs(("user", "hi"))}, "messages", "no_assistant_turn"),
    (
        "sft",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": 5}]},
        "messages[1].content",
        "wrong_type",
    ),
    (
        "sft",
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": "{oops"}]},
            ]
        },
        "messages[1].tool_calls[0].arguments",
        "bad_json",
    ),
    ("sft", {"prompt": "hi"}, "completion", "missing_field"),
    ("cpt", {"content": ""}, "content", "empty"),
    ("cpt", {"title": "x"}, "text", "missing_field"),
    ("dpo", {"prompt": "q", "chosen": "a", "rejected": "a"}, "rejected", "chosen_equals_rejected"),
    ("dpo", {"prompt": "q", "chosen": msgs(("user", "a")), "rejected": "b"}, "chosen", "no_assistant_turn"),
    ("dpo", {"prompt": "q", "chosen": 3, "rejected": "b"}, "chosen", "wrong_type"),
    ("rl", {"prompt": "q", "env": "nope", "answer": "1"}, "env", "unknown_environment"),
    ("rl", {"prompt": "q", "env": "math"}, "answer", "missing_field"),
    ("rl", {"prompt": "q", "env": "math", "answer": "", "tests": []}, "answer", "empty"),
    ("rl", {"prompt": "q", "env": "math", "tests": [1]}, "tests[0]", "wrong_type"),
    ("swe_bench_verified", swe_row(0, FAIL_TO_PASS="not json"), "FAIL_TO_PASS", "bad_json"),
    ("swe_bench_verified", swe_row(1, FAIL_TO_PASS="[]"), "FAIL_TO_PASS", "empty"),
    ("swe_bench_verified", {k: v for k, v in swe_row(2).items() if k != "patch"}, "patch", "missing_field"),
    ("beyond_aime", {"problem": "p", "answer": "twelve"}, "answer", "not_integer"),
    ("beyond_aime", {"problem": "p", "answer": 1.5}, "answer", "not_integer"),
    (
        "imo_answerbench",
        {"Problem ID": "x", "Problem": "p", "Category": "A", "Subcategory": "B", "Source": "C"},
        "Short Answer",
        "missing_field",
    ),
]


@pytest.mark.parametrize("kind", sorted({c[0] for c in REASON_CASES}))
def test_rejection_reasons_reported(tmp_path, kind):
    cases = [c for c in REASON_CASES if c[0] == kind]
    src = write_jsonl(tmp_path / f"{kind}.jsonl", [c[1] for c in cases])
    out = tmp_path / "out"
    with pytest.raises(DataError, match=f"no rows written: all {len(cases)} rows read"):  # every row is bad
        prepare(PrepareConfig(source=str(src), kind=kind, output=str(out), max_reject_fraction=1.0))
    assert not (out / "data.jsonl").exists() and (out / "FAILED").is_file()
    stats = json.loads((out / "failed" / "stats.json").read_text())
    rejects = [json.loads(x) for x in (out / "failed" / "rejects.jsonl").read_text().splitlines()]
    assert stats["status"] == "failed" and stats["rows_written"] == 0
    assert stats["rows_rejected"] == len(cases)
    got = [(r["file"], r["row"], r["line"], r["field"], r["reason"]) for r in rejects]
    assert got == [(str(src), i, i + 1, c[2], c[3]) for i, c in enumerate(cases)]
    assert all(isinstance(r["detail"], str) and r["detail"] for r in rejects)
    for reason in {c[3] for c in cases}:
        assert stats["rejected_by_reason"][reason] == sum(c[3] == reason for c in cases)


def test_reason_vocabulary_is_covered():
    covered = {c[3] for c in REASON_CASES} | {"too_long", "bad_csv", "duplicate_id", "prompt_too_long"}  # below
    assert covered == set(REASONS)
    assert set(KINDS) == {c[0] for c in REASON_CASES} | {"cpt"}


def test_csv_bad_record_and_line_numbers(tmp_path):
    src = tmp_path / "c.csv"
    src.write_text('text,source\n"first\nspans two lines",a\n\nsecond,b,EXTRA\nthird,c\n', encoding="utf-8")
    stats, (data, rejects) = run(tmp_path, src, "cpt", max_reject_fraction=1.0)
    assert [d["text"] for d in data] == ["first\nspans two lines", "third"]
    assert [(r["row"], r["line"], r["reason"]) for r in rejects] == [(1, 5, "bad_csv")]
    with iter_rows(str(src)) as rows:
        got = [(r.index, r.line, type(r.value)) for r in rows]
    assert got == [(0, 2, dict), (1, 5, RowReadError), (2, 6, dict)]


# --------------------------------------------------------------------------- dedup, limits


def test_dedup(tmp_path):
    rows = [
        {"text": "same"},
        {"text": "other"},
        {"text": "same"},
        {"id": "k", "text": "same"},  # same content under a source id: still a duplicate
        {"id": "m", "text": "m1"},
        {"id": "m", "text": "m2"},  # a reused id with different content
    ]
    src = write_jsonl(tmp_path / "d.jsonl", rows)
    stats, (data, rejects) = run(tmp_path, src, "cpt", max_reject_fraction=0.2)
    assert [d["text"] for d in data] == ["same", "other", "m1"]
    assert (stats.rows_read, stats.rows_written, stats.duplicates, stats.rows_rejected) == (6, 3, 2, 1)
    assert "duplicate" not in stats.rejected_by_reason and stats.rejected_by_reason == {"duplicate_id": 1}
    assert [(r["row"], r["field"], r["reason"]) for r in rejects] == [
        (2, None, "duplicate"),
        (3, None, "duplicate"),
        (5, "id", "duplicate_id"),
    ]
    assert "data row 0" in rejects[0]["detail"]

    stats2 = prepare(
        PrepareConfig(
            source=str(src),
            kind="cpt",
            output=str(tmp_path / "nodedup"),
            dedup=False,
            max_reject_fraction=1.0,
        )
    )
    assert (stats2.rows_written, stats2.duplicates) == (5, 0)
    assert stats2.rejected_by_reason == {"duplicate_id": 1}
    ids = [d["id"] for d in read_out(tmp_path / "nodedup")[0]]
    assert ids[2] == ids[0] + "-1" and ids[3] == "k"  # kept copies get numbered hash ids


def test_limit_and_progress(tmp_path):
    src = write_jsonl(tmp_path / "l.jsonl", [{"text": f"t{i}"} for i in range(2500)])
    seen: list[int] = []
    stats = prepare(
        PrepareConfig(source=str(src), kind="cpt", output=str(tmp_path / "o")), progress=seen.append
    )
    assert stats.rows_written == 2500 and seen == [1000, 2000, 2500]
    stats = prepare(PrepareConfig(source=str(src), kind="cpt", output=str(tmp_path / "o2"), limit=10))
    assert (stats.rows_read, stats.rows_written) == (10, 10)


@pytest.fixture(scope="module")
def tiny_tokenizer(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(
        ["the quick brown fox jumps over the lazy dog", "hello world, hello tokens"], trainer
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    path = tmp_path_factory.mktemp("tok")
    fast.save_pretrained(path)
    return str(path)


def test_too_long_with_tokenizer(tmp_path, tiny_tokenizer):
    rows = [{"text": "the quick brown fox"}, {"text": "the quick brown fox jumps over the lazy dog " * 20}]
    src = write_jsonl(tmp_path / "t.jsonl", rows)
    stats, (data, rejects) = run(
        tmp_path, src, "cpt", tokenizer=tiny_tokenizer, max_tokens=32, max_reject_fraction=1.0
    )
    assert [d["text"] for d in data] == ["the quick brown fox"]
    assert [(r["row"], r["field"], r["reason"]) for r in rejects] == [(1, "text", "too_long")]
    assert "> max_tokens 32" in rejects[0]["detail"]
    # chat rows are measured through the chat template
    chat = [{"messages": GOOD_CHAT}, {"messages": msgs(("user", "hello world " * 40), ("assistant", "ok"))}]
    src2 = write_jsonl(tmp_path / "c.jsonl", chat)
    stats2 = prepare(
        PrepareConfig(
            source=str(src2),
            kind="sft",
            output=str(tmp_path / "o2"),
            tokenizer=tiny_tokenizer,
            max_tokens=40,
            max_reject_fraction=1.0,
        )
    )
    assert stats2.rows_written == 1 and stats2.rejected_by_reason == {"too_long": 1}
    _, rej2 = read_out(tmp_path / "o2")
    assert rej2[0]["field"] == "messages"


# --------------------------------------------------------------------------- threshold


def test_threshold_exceeded_keeps_reports(tmp_path):
    rows = [{"text": f"ok {i}"} for i in range(7)] + ["{broken", {"title": "x"}, {"text": ""}]
    src = write_jsonl(tmp_path / "t.jsonl", rows)
    out = tmp_path / "out"
    with pytest.raises(DataError) as info:
        prepare(PrepareConfig(source=str(src), kind="cpt", output=str(out)))
    msg = str(info.value)
    assert "3 of 10 rows rejected" in msg and "0.05" in msg
    assert "bad_json 1" in msg and "missing_field 1" in msg and "empty 1" in msg
    assert str(out / "failed" / "rejects.jsonl") in msg and str(out / "FAILED") in msg
    assert not (out / "data.jsonl").exists() and not (out / "stats.json").exists()  # nothing published
    rejects = [json.loads(x) for x in (out / "failed" / "rejects.jsonl").read_text().splitlines()]
    assert len(rejects) == 3
    report = json.loads((out / "failed" / "stats.json").read_text())
    assert report["status"] == "failed" and report["rows_rejected"] == 3 and report["error"] == msg
    assert (out / "FAILED").read_text().startswith("prepare-data failed at ")
    assert not any(p.name.startswith(".prepare-") for p in out.iterdir())


def test_threshold_ok(tmp_path):
    rows = [{"text": f"ok {i}"} for i in range(24)] + [{"text": 1}]
    src = write_jsonl(tmp_path / "t.jsonl", rows)
    stats, (data, rejects) = run(tmp_path, src, "cpt")  # 1/25 = 4% <= 5%
    assert stats.status == "ok" and stats.rows_written == 24 and stats.rejected_by_reason == {"wrong_type": 1}


# --------------------------------------------------------------------------- source errors


def test_source_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    (tmp_path / "notes.txt").write_text("hello")
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet at all")
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "plain_dir").mkdir()
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "x"}])
    cases = [
        (str(tmp_path / "missing.jsonl"), "cpt", "data file not found"),
        (str(tmp_path / "notes.txt"), "cpt", "unsupported data file extension '.txt'"),
        (str(tmp_path / "bad.parquet"), "cpt", "cannot read parquet file"),
        (str(tmp_path / "empty.csv"), "cpt", "empty or has no header"),
        (str(tmp_path / "plain_dir"), "cpt", "not a saved dataset"),
        (str(good), "pretraining", "unknown data kind 'pretraining'"),
        (
            "no-such-org/no-such-dataset",
            "cpt",
            "cannot load Hugging Face dataset 'no-such-org/no-such-dataset'",
        ),
        ("hf://no-such-org/other", "cpt", "offline"),
    ]
    for i, (source, kind, expected) in enumerate(cases):
        out = tmp_path / f"out{i}"
        with pytest.raises(DataError) as info:
            prepare(PrepareConfig(source=source, kind=kind, output=str(out)))
        assert expected in str(info.value), (source, str(info.value))
        assert not out.exists()  # nothing is written for a source that cannot be read
    with pytest.raises(DataError, match="max_tokens is set but tokenizer is not"):
        prepare(PrepareConfig(source=str(good), kind="cpt", output=str(tmp_path / "o"), max_tokens=10))
    with pytest.raises(DataError, match="max_reject_fraction"):
        prepare(
            PrepareConfig(source=str(good), kind="cpt", output=str(tmp_path / "o"), max_reject_fraction=2)
        )
    empty = write_jsonl(tmp_path / "blank.jsonl", [])
    with pytest.raises(DataError, match="no rows read"):
        prepare(PrepareConfig(source=str(empty), kind="cpt", output=str(tmp_path / "o3")))


def test_saved_dataset_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(
                [{"problem": "p1", "answer": "7"}, {"problem": "p2", "answer": "8"}]
            ),
            "test": datasets.Dataset.from_list([{"problem": "p3", "answer": "9"}]),
        }
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    stats, (data, _) = run(tmp_path, tmp_path / "saved", "beyond_aime", split="test")
    assert [d["answer"] for d in data] == [9] and "@" in stats.dataset_version
    with pytest.raises(DataError, match="no split 'validation'"):
        prepare(
            PrepareConfig(
                source=str(tmp_path / "saved"),
                kind="beyond_aime",
                output=str(tmp_path / "o"),
                split="validation",
            )
        )


# --------------------------------------------------------------------------- s3


def test_s3_source_and_output_round_trip(tmp_path, moto_s3):
    from sao_core import storage

    lines = "\n".join(json.dumps({"problem": f"p{i}", "answer": str(i)}) for i in range(5)) + "\n{bad\n"
    src = moto_s3.uri("raw/beyond.jsonl")
    storage.write_bytes(src, lines.encode())
    out = moto_s3.uri("prepared/beyond")
    stats = prepare(PrepareConfig(source=src, kind="beyond_aime", output=out, max_reject_fraction=0.5))
    assert (stats.rows_written, stats.rows_rejected) == (5, 1)
    assert stats.files == {
        "data": storage.join(out, "data.jsonl"),
        "rejects": storage.join(out, "rejects.jsonl"),
        "stats": storage.join(out, "stats.json"),
    }
    data = [json.loads(x) for x in storage.read_bytes(stats.files["data"]).decode().splitlines()]
    assert [d["answer"] for d in data] == [0, 1, 2, 3, 4]
    rejects = [json.loads(x) for x in storage.read_bytes(stats.files["rejects"]).decode().splitlines()]
    assert rejects == [
        {
            "file": src,
            "row": 5,
            "line": 6,
            "field": None,
            "reason": "bad_json",
            "detail": rejects[0]["detail"],
        }
    ]
    report = json.loads(storage.read_bytes(stats.files["stats"]))
    assert report["rows_written"] == 5 and report["dataset_version"].startswith("sha256:")
    # failure on s3: the reports go to failed/, a FAILED marker is written, nothing is published
    with pytest.raises(DataError, match="failed/rejects.jsonl"):
        prepare(PrepareConfig(source=src, kind="beyond_aime", output=moto_s3.uri("prepared/strict")))
    assert json.loads(storage.read_bytes(moto_s3.uri("prepared/strict/failed/stats.json")))["status"] == "failed"
    assert storage.list_files(moto_s3.uri("prepared/strict")) == ["FAILED", "failed/rejects.jsonl",
                                                                 "failed/stats.json"]
    with pytest.raises(DataError, match="cannot read data source"):
        prepare(
            PrepareConfig(source=moto_s3.uri("raw/missing.jsonl"), kind="cpt", output=str(tmp_path / "o"))
        )
    with pytest.raises(DataError, match="unsupported data file extension"):
        prepare(PrepareConfig(source=moto_s3.uri("raw/"), kind="cpt", output=str(tmp_path / "o")))


# --------------------------------------------------------------------------- prompt budget


def rl_row(i: int, prompt: str | None = None) -> dict:
    return {"prompt": prompt or f"What is {i} + {i}?", "env": "math", "answer": str(2 * i)}


def test_a_200k_character_prompt_is_rejected_and_the_other_rows_kept(tmp_path):
    rows = [rl_row(0), rl_row(1, "x" * 200_000), rl_row(2), rl_row(3)]
    src = write_jsonl(tmp_path / "rl.jsonl", rows)
    stats, (data, rejects) = run(tmp_path, src, "rl", max_reject_fraction=0.5)  # default max_prompt_tokens 4096
    assert [d["answer"] for d in data] == ["0", "4", "6"]
    assert stats.rejected_by_reason == {"prompt_too_long": 1}
    (entry,) = rejects
    assert (entry["file"], entry["row"], entry["line"], entry["field"], entry["reason"]) == (
        str(src), 1, 2, "prompt", "prompt_too_long")
    assert (entry["length"], entry["limit"], entry["unit"]) == (200_000, 4096 * 8, "characters")
    assert "200000 characters > 32768" in entry["detail"] and "max_prompt_tokens 4096" in entry["detail"]
    # the budget is a parameter; none turns it off
    stats, (data, _) = run(tmp_path, src, "rl", max_prompt_tokens=None)
    assert stats.rows_written == 4


def test_prompt_budget_counts_tokens_of_the_chat_template(tmp_path, tiny_tokenizer):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_tokenizer)
    long_prompt = "hello world " * 10
    encoded = tok.apply_chat_template([{"role": "user", "content": long_prompt}], tokenize=True,
                                      add_generation_prompt=True)
    rendered = len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)
    plain = len(tok(long_prompt)["input_ids"])
    assert rendered > plain  # the template's role tags count
    src = write_jsonl(tmp_path / "rl.jsonl", [rl_row(1), rl_row(2, long_prompt)])
    stats, (data, rejects) = run(tmp_path, src, "rl", tokenizer=tiny_tokenizer, max_prompt_tokens=plain,
                                 max_reject_fraction=0.5)
    assert len(data) == 1
    assert [(r["row"], r["field"], r["reason"], r["length"], r["limit"], r["unit"]) for r in rejects] == [
        (1, "prompt", "prompt_too_long", rendered, plain, "tokens")]
    # sft: the prompt is what comes before the first assistant turn (a long answer is not a long prompt)
    chat = [{"messages": msgs(("user", "hi"), ("assistant", "hello world " * 40))},
            {"messages": msgs(("system", "hello world " * 40), ("user", "hi"), ("assistant", "ok"))}]
    src2 = write_jsonl(tmp_path / "c.jsonl", chat)
    with pytest.raises(DataError, match="1 of 2 rows rejected"):
        prepare(PrepareConfig(source=str(src2), kind="sft", output=str(tmp_path / "o2"), tokenizer=tiny_tokenizer,
                              max_prompt_tokens=40))
    rej = [json.loads(x) for x in (tmp_path / "o2" / "failed" / "rejects.jsonl").read_text().splitlines()]
    assert [(r["row"], r["field"], r["reason"]) for r in rej] == [(1, "messages", "prompt_too_long")]


def test_prompt_budget_is_checked(tmp_path):
    src = write_jsonl(tmp_path / "rl.jsonl", [rl_row(1)])
    for bad in (0, -5, True, 1.5):
        with pytest.raises(DataError, match="max_prompt_tokens must be a positive integer"):
            prepare(PrepareConfig(source=str(src), kind="rl", output=str(tmp_path / "o"), max_prompt_tokens=bad))
    assert _default_budget() == 4096


def _default_budget() -> int:
    from sao_core.data.prepare import DEFAULT_MAX_PROMPT_TOKENS
    from sao_core.learner.config import RLConfig

    assert DEFAULT_MAX_PROMPT_TOKENS == RLConfig.max_total_tokens  # the budget follows the RL context default
    return DEFAULT_MAX_PROMPT_TOKENS


# --------------------------------------------------------------------------- failed means unusable


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_failed_preparation_keeps_the_earlier_data_and_marks_the_folder(tmp_path):
    from sao_core.data.prepared import PreparedDataError, open_prepared

    out = tmp_path / "out"
    good = write_jsonl(tmp_path / "good.jsonl", [rl_row(i) for i in range(20)])
    prepare(PrepareConfig(source=str(good), kind="rl", output=str(out)))
    before = _snapshot(out)
    assert set(before) == {"data.jsonl", "rejects.jsonl", "stats.json"}
    assert len(open_prepared(str(out)).rows) == 20

    bad = write_jsonl(tmp_path / "bad.jsonl", [rl_row(0), "{broken", {"prompt": "q"}])
    with pytest.raises(DataError, match="2 of 3 rows rejected"):
        prepare(PrepareConfig(source=str(bad), kind="rl", output=str(out)))
    after = _snapshot(out)
    assert {k: v for k, v in after.items() if k in before} == before  # the earlier data is intact
    assert set(after) - set(before) == {"FAILED", "failed/rejects.jsonl", "failed/stats.json"}
    assert json.loads(after["failed/stats.json"])["status"] == "failed"
    for target in (out, out / "data.jsonl"):
        with pytest.raises(PreparedDataError, match=f"dataset {out} is unusable: it has a FAILED marker.*2 of 3 rows"):
            open_prepared(str(target))

    with pytest.raises(DataError, match="no rows read"):  # an empty source fails too, and keeps the data
        prepare(PrepareConfig(source=str(write_jsonl(tmp_path / "e.jsonl", [])), kind="rl", output=str(out)))
    assert {k: v for k, v in _snapshot(out).items() if k in before} == before

    prepare(PrepareConfig(source=str(good), kind="rl", output=str(out)))  # a success removes the marker
    assert set(_snapshot(out)) == {"data.jsonl", "rejects.jsonl", "stats.json"}
    assert len(open_prepared(str(out)).rows) == 20


def test_open_prepared_refuses_unusable_folders(tmp_path):
    from sao_core.data.prepared import PreparedDataError, open_prepared

    def folder(name: str, data: str, stats: dict | None) -> str:
        path = tmp_path / name
        path.mkdir()
        (path / "data.jsonl").write_text(data)
        if stats is not None:
            (path / "stats.json").write_text(json.dumps(stats))
        return str(path)

    row = json.dumps({"id": "a", "text": "x"}) + "\n"
    cases = [
        (folder("empty", "\n", {"kind": "cpt", "status": "ok", "rows_written": 0}), "holds no rows"),
        (folder("old_failed", row, {"kind": "cpt", "status": "failed", "error": "too many"}),
         "says status 'failed': too many"),
        (folder("partial", row, {"kind": "cpt", "status": "ok", "rows_written": 5}), "holds 1 rows but .* says 5"),
        (folder("not_json", row + "{oops\n", None), "data.jsonl line 2 is not JSON"),
        (folder("not_object", "[1, 2]\n", None), "line 1 is not a JSON object"),
    ]
    for path, message in cases:
        with pytest.raises(PreparedDataError, match=message) as info:
            open_prepared(path)
        assert path in str(info.value)
    ok = open_prepared(folder("by_hand", row, None))  # a data.jsonl written by hand: kind unknown
    assert ok.kind is None and ok.rows == [{"id": "a", "text": "x"}]


def test_the_evaluator_refuses_a_failed_prepared_folder(tmp_path):
    from sao_core.eval.benchmarks import EvalError, get_benchmark, load_benchmark

    out = tmp_path / "beyond"
    bad = write_jsonl(tmp_path / "b.jsonl", [{"problem": "p", "answer": "twelve"}])
    with pytest.raises(DataError, match="no rows written"):
        prepare(PrepareConfig(source=str(bad), kind="beyond_aime", output=str(out), max_reject_fraction=1.0))
    with pytest.raises(EvalError, match=f"cannot use prepared dataset {out}.*FAILED marker"):
        load_benchmark(get_benchmark("beyond_aime"), source=str(out))


def test_s3_failed_preparation_keeps_the_earlier_data(tmp_path, moto_s3):
    from sao_core import storage
    from sao_core.data.prepared import PreparedDataError, open_prepared

    out = moto_s3.uri("prepared/rl")
    good = write_jsonl(tmp_path / "good.jsonl", [rl_row(i) for i in range(5)])
    prepare(PrepareConfig(source=str(good), kind="rl", output=out))
    names = ["data.jsonl", "rejects.jsonl", "stats.json"]
    before = {n: storage.read_bytes(storage.join(out, n)) for n in names}
    bad = write_jsonl(tmp_path / "bad.jsonl", ["{broken"] * 3)
    with pytest.raises(DataError, match="no rows written"):
        prepare(PrepareConfig(source=str(bad), kind="rl", output=out, max_reject_fraction=1.0))
    assert {n: storage.read_bytes(storage.join(out, n)) for n in names} == before
    assert storage.list_files(out) == ["FAILED", "data.jsonl", "failed/rejects.jsonl", "failed/stats.json",
                                       "rejects.jsonl", "stats.json"]
    with pytest.raises(PreparedDataError, match=f"dataset {out} is unusable: it has a FAILED marker"):
        open_prepared(out)
    prepare(PrepareConfig(source=str(good), kind="rl", output=out))  # staged, copied, marker and reports removed
    assert storage.list_files(out) == names
    assert len(open_prepared(out).rows) == 5
