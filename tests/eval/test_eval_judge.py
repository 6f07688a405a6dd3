"""The LLM judge's transports, cache and agreement check (sao_core/eval/judge.py): a SAO rollout service as the
judge over real HTTP with its bearer token (the embedded model: the plumbing, not the quality), a fake
OpenAI-compatible and a fake /v1/generate judge whose verdicts are known, rulings cached per (reference,
answer), and the agreement over a labelled set with every disagreement listed."""

from __future__ import annotations

import json
import re

import pytest
from fake_http import FakeServer

from sao_core.eval.judge import LabelledPair, LLMJudge, judge_agreement, read_labelled

TOKEN = "judge-token-0123456789abcdef0123456789"
BLOCK = re.compile(r"^<<<(?P<name>[A-Z ]+) (?P<tag>[0-9a-f]{16})>>>\n(?P<text>.*?)\n<<<END (?P=name) (?P=tag)>>>$",
                   re.MULTILINE | re.DOTALL)


def prompt_blocks(user: str) -> dict[str, str]:
    """The texts of the user message's tagged blocks (see `JUDGE_USER`): {"PROBLEM", "REFERENCE ANSWER",
    "CANDIDATE ANSWER"}; every block's end marker carries the same tag as its start."""
    found = {m["name"]: m["text"] for m in BLOCK.finditer(user)}
    assert set(found) == {"PROBLEM", "REFERENCE ANSWER", "CANDIDATE ANSWER"}, user
    return found


def _verdict_by_text(messages: list[dict]) -> str:
    """A judge that calls an answer equal when its text is the reference's (a known, imperfect judge)."""
    blocks = prompt_blocks(messages[-1]["content"])
    same = blocks["REFERENCE ANSWER"].replace(" ", "") == blocks["CANDIDATE ANSWER"].replace(" ", "")
    return "\nVERDICT: EQUIVALENT" if same else "\nVERDICT: NOT_EQUIVALENT"


@pytest.fixture
def generate_judge():
    seen = []

    def answer(request):
        seen.append(request)
        if request.headers.get("Authorization") != f"Bearer {TOKEN}":
            return 401, {"detail": "missing or wrong bearer token"}
        body = request.json()
        return 200, {"results": [[{"text": "Comparing. " + _verdict_by_text(body["prompts"][0]), "token_ids": [],
                                   "logprobs": [], "finish_reason": "stop", "version": 0}]]}

    server = FakeServer(answer)
    server.seen = seen
    yield server
    server.stop()


def test_the_rollout_transport_sends_the_prompt_deterministically_and_caches_rulings(generate_judge):
    judge = LLMJudge(generate_judge.url, "cluster-judge", api_key=TOKEN, api="rollout", sleep=lambda s: None)
    first = judge.judge("Find all x.", "(-\\infty, 0]", "(-\\infty, 0]")
    assert (first.correct, first.verdict, first.cached) == (True, "CORRECT", False)
    body = generate_judge.seen[-1].json()
    assert generate_judge.seen[-1].route == "/v1/generate"
    assert body["temperature"] == 0.0 and body["n"] == 1 and body["prompts"][0][0]["role"] == "system"
    again = judge.judge("another problem", "(-\\infty, 0]", "(-\\infty, 0]")
    assert again.correct is True and again.cached and judge.calls == 1 and len(generate_judge.seen) == 1
    assert judge.judge("", "x \\le 0", "x < 0").correct is False
    wrong = LLMJudge(generate_judge.url, "cluster-judge", api_key="nope", api="rollout", sleep=lambda s: None)
    refused = wrong.judge("", "1", "1")
    assert refused.correct is None and "HTTP 401" in refused.error
    assert wrong.judge("", "1", "1").cached is False   # a failed call is not cached
    with pytest.raises(ValueError, match="judge api must be one of openai, rollout"):
        LLMJudge(generate_judge.url, "m", api="grpc")


def test_agreement_over_a_labelled_set_lists_every_disagreement(generate_judge, tmp_path):
    pairs = [LabelledPair("5, -3", "5, -3", True), LabelledPair("5, -3", "x=5, x=-3", True, note="solution list"),
             LabelledPair("(-\\infty, 0]", "x < 0", False, note="strict"), LabelledPair("3", "4", False)]
    judge = LLMJudge(generate_judge.url, "cluster-judge", api_key=TOKEN, api="rollout", sleep=lambda s: None)
    report = judge_agreement(judge, pairs)
    assert (report["pairs"], report["agreed"], report["agreement"]) == (4, 3, 0.75)
    assert report["by_label"] == {"equal": {"pairs": 2, "agreed": 1}, "different": {"pairs": 2, "agreed": 2}}
    assert report["false_accepts"] == 0 and report["no_verdict"] == 0
    assert [d["note"] for d in report["disagreements"]] == ["solution list"]
    path = tmp_path / "labelled.jsonl"
    path.write_text("".join(json.dumps({"reference": p.reference, "answer": p.answer, "equal": p.equal}) + "\n"
                            for p in pairs))
    assert read_labelled(path) == [LabelledPair(p.reference, p.answer, p.equal) for p in pairs]
    path.write_text('{"reference": "1", "answer": "1", "equal": "yes"}\n')
    with pytest.raises(ValueError, match=r"labelled.jsonl:1: field 'equal' must be a bool"):
        read_labelled(path)


def test_a_rollout_service_with_the_embedded_model_is_a_judge_behind_its_token(tiny_model_dir, sao_cache):
    """The plumbing with a real model behind a real service: the tiny model's replies carry no verdict (it is
    not a judge), which the ruling says; a wrong token is refused with 401."""
    from sao_core.rollout.server import RolloutServer, ServeConfig

    server = RolloutServer(ServeConfig(model=str(tiny_model_dir), port=0, cache_dir=str(sao_cache), max_batch=2),
                           token=TOKEN).start()
    try:
        judge = LLMJudge(server.url, "embedded-tiny", api_key=TOKEN, api="rollout", max_tokens=16,
                         sleep=lambda s: None)
        ruling = judge.judge("Find x.", "3", "three")
        assert ruling.attempts == 1 and (ruling.correct is not None or "has no verdict" in ruling.error), ruling
        report = judge_agreement(judge, [LabelledPair("3", "three", True), LabelledPair("3", "4", False)])
        assert report["pairs"] == 2 and report["calls"] == 3 and report["agreed"] + len(report["disagreements"]) == 2
        refused = LLMJudge(server.url, "embedded-tiny", api_key="wrong-token", api="rollout", max_tokens=16,
                           sleep=lambda s: None).judge("", "3", "4")
        assert refused.correct is None and "HTTP 401" in refused.error
    finally:
        server.stop()


def test_the_cli_reports_agreement_and_writes_the_disagreements(generate_judge, tmp_path, monkeypatch, capsys):
    from sao_core.cli import main
    from sao_core.eval.config import JUDGE_APIS as CONFIG_APIS
    from sao_core.eval.judge import JUDGE_APIS

    assert CONFIG_APIS == JUDGE_APIS
    labelled = tmp_path / "set.jsonl"
    labelled.write_text('{"reference": "7", "answer": "7", "equal": true}\n'
                        '{"reference": "\\\\frac12", "answer": "0.5", "equal": true, "note": "decimal"}\n')
    monkeypatch.setenv("MY_JUDGE_TOKEN", TOKEN)
    out = tmp_path / "agreement.json"
    code = main(["judge-agreement", "--judge-url", generate_judge.url, "--judge-api", "rollout", "--judge-api-key-env",
                 "MY_JUDGE_TOKEN", "--labelled", str(labelled), "--output", str(out)])
    assert code == 0
    written = json.loads(out.read_text())
    assert written["agreement"] == 0.5 and [d["note"] for d in written["disagreements"]] == ["decimal"]
    assert "1 disagreements" in capsys.readouterr().out
    labelled.write_text("not json\n")
    assert main(["judge-agreement", "--judge-url", generate_judge.url, "--labelled", str(labelled)]) == 2
    assert "set.jsonl:1 is not valid JSON" in capsys.readouterr().err


def test_the_built_in_labelled_set_is_current_and_its_labels_agree_with_the_rules_wherever_they_settle(tmp_path):
    """sao_core/eval/judge_labelled.jsonl = scripts/build_judge_labelled.py's output (the hand-written structural
    sets of tests/data/eval and hand-written prose pairs for IMO-AnswerBench's prose answers); and where the rule
    grader settles a pair, it says what the label says (a check of the labels, and of the rules)."""
    import subprocess
    import sys
    from collections import Counter
    from pathlib import Path

    from sao_core.envs.grading import MathGrader
    from sao_core.eval.graders import ImoGrader
    from sao_core.eval.judge import LABELLED_SET

    root = Path(__file__).resolve().parents[2]
    before = LABELLED_SET.read_bytes()
    built = subprocess.run([sys.executable, str(root / "scripts" / "build_judge_labelled.py")], capture_output=True,
                           text=True, timeout=60)
    assert built.returncode == 0, built.stderr
    assert LABELLED_SET.read_bytes() == before, "regenerate with scripts/build_judge_labelled.py"
    pairs = read_labelled(LABELLED_SET)
    assert len(pairs) == 251 and sum(p.equal for p in pairs) == 120
    outcomes = Counter()
    with MathGrader(max_workers=2, timeout_s=10) as math_grader:
        grader = ImoGrader(math_grader, timeout_s=10)
        for pair in pairs:
            verdict = grader.rule(pair.answer, pair.reference)
            outcomes[(pair.equal, verdict.grade)] += 1
            if verdict.settled:
                assert verdict.correct is pair.equal, (pair, verdict)
    assert outcomes[(False, "match")] == 0
