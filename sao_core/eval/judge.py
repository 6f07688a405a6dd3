"""The LLM judge of IMO-AnswerBench answers that the exact rules cannot settle, and its agreement check.

The judge is asked, deterministically (temperature 0), whether a candidate's final answer is equivalent to
the reference answer — the same number, expression, set, interval, tuple or condition, written any way — with
no partial credit, in the manner of the benchmark's own autograder (our wording). Two transports:

- ``openai``: any OpenAI-compatible ``/chat/completions`` endpoint (`url` is the API base, ``…/v1``);
- ``rollout``: a SAO rollout service's ``POST /v1/generate`` (`url` is the service, ``http://host:8000``), so a
  cluster can judge with its own model behind the service's bearer token.

Rulings are cached per (reference, answer) for the judge's lifetime (an evaluation run): the same pair is asked
once, later rulings say ``cached``. `judge_agreement` runs the judge over a labelled set (pairs known equal or
different) and reports the agreement and every pair where the judge disagreed or gave no verdict.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sao_core.envs.grading import answer_region, extract_boxed

JUDGE_APIS = ("openai", "rollout")
#: the built-in labelled set (pairs of IMO-style answers known equal or not; see its first lines)
LABELLED_SET = Path(__file__).with_name("judge_labelled.jsonl")

JUDGE_SYSTEM = (
    "You are a strict, deterministic grader of final answers to olympiad mathematics problems. You receive a "
    "problem, its reference answer and a candidate's final answer. Your only task is to decide whether the "
    "candidate's final answer is mathematically equivalent to the reference answer. Treat as equivalent: "
    "algebraically equal expressions, equal numbers in any exact form, equal sets, intervals or unions given "
    "in any notation (a relation such as x <= 0 describes the interval (-infinity, 0]), the same solutions "
    "listed in any order or with the variable named, the same tuple, the same condition stated in words or "
    "symbols. Treat as not equivalent: a different value, a missing or an extra solution, a wrong endpoint or "
    "a strict inequality where the reference has a non-strict one, an approximation of an exact value, an "
    "answer that is only partly right. There is no partial credit. Do not solve the problem and do not judge "
    "any reasoning: compare the two final answers only."
)
JUDGE_USER = (
    "Problem:\n{problem}\n\nReference answer:\n{reference}\n\nCandidate's final answer:\n{answer}\n\n"
    "Is the candidate's final answer equivalent to the reference answer? End your reply with exactly one of "
    "\\boxed{{CORRECT}} or \\boxed{{INCORRECT}}."
)
_VERDICTS = {"correct": True, "incorrect": False, "equivalent": True, "not equivalent": False, "yes": True,
             "no": False, "true": True, "false": False}
_VERDICT_LINE = re.compile(r"(?i)\b(?:verdict|answer|grade)\s*[:=]\s*\**\s*(correct|incorrect)\b")


@dataclass
class JudgeRuling:
    """One judge ruling: `correct` is None when the judge could not be asked or its reply had no verdict;
    `cached` when an earlier ruling on the same (reference, answer) was reused."""

    correct: bool | None
    verdict: str = ""
    reply: str = ""
    model: str = ""
    seconds: float = 0.0
    attempts: int = 0
    error: str | None = None
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reply"] = out["reply"][-2000:]
        return out


def parse_judge_reply(text: str) -> bool | None:
    """The verdict in a judge's reply (after any reasoning block): the last ``\\boxed{CORRECT}`` /
    ``\\boxed{INCORRECT}`` (also yes/no, equivalent/not equivalent), else a ``Verdict: CORRECT`` line."""
    boxed = extract_boxed(text)
    if boxed is not None:
        word = re.sub(r"\\text\s*\{([^{}]*)\}", r"\1", boxed).strip().strip("*").strip().lower()
        if word in _VERDICTS:
            return _VERDICTS[word]
    region = answer_region(text) or ""
    found = _VERDICT_LINE.findall(region)
    if found:
        return found[-1].lower() == "correct"
    return None


class LLMJudge:
    """A chat model that decides answer equivalence (thread-safe); see the module docstring.

    `api`: ``openai`` (`url` the API base, ``http://host:8000/v1``; ``/chat/completions`` is appended) or
    ``rollout`` (`url` a SAO rollout service; ``/v1/generate`` is appended; `model` is only a label there).
    Requests use temperature 0; connection errors, HTTP 429 and 5xx are retried `retries` times with a
    back-off of 1, 2, 4... seconds. At most `concurrency` requests run at once. `api_key` goes in an
    ``Authorization: Bearer`` header when given (the rollout service's token). `max_tokens`: the reply's
    length limit in tokens.
    """

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 120.0,
                 retries: int = 2, concurrency: int = 4, max_tokens: int = 4096, api: str = "openai",
                 sleep: Callable[[float], None] = time.sleep):
        import httpx

        if api not in JUDGE_APIS:
            raise ValueError(f"judge api must be one of {', '.join(JUDGE_APIS)}, got {api!r}")
        self.api = api
        self.url = url.rstrip("/")
        self.endpoint = self.url + ("/chat/completions" if api == "openai" else "/v1/generate")
        self.model = model
        self.retries = retries
        self.max_tokens = max_tokens
        self._sleep = sleep
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(timeout=timeout_s, headers=headers, trust_env=False)
        self.concurrency = concurrency
        self._slots = threading.BoundedSemaphore(concurrency)
        self._cache: dict[tuple[str, str], JudgeRuling] = {}
        self._cache_lock = threading.Lock()
        self.calls = 0

    def messages(self, problem: str, reference: str, answer: str) -> list[dict[str, str]]:
        return [{"role": "system", "content": JUDGE_SYSTEM},
                {"role": "user", "content": JUDGE_USER.format(problem=problem.strip() or "(not given)",
                                                              reference=reference, answer=answer)}]

    def _body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        if self.api == "openai":
            return {"model": self.model, "messages": messages, "temperature": 0.0, "max_tokens": self.max_tokens}
        return {"prompts": [messages], "n": 1, "temperature": 0.0, "max_new_tokens": self.max_tokens}

    def _reply_text(self, data: Any) -> str:
        if self.api == "openai":
            return data["choices"][0]["message"]["content"] or ""
        return data["results"][0][0]["text"] or ""

    def judge(self, problem: str, reference: str, answer: str) -> JudgeRuling:
        """Whether `answer` is equivalent to `reference` (for `problem`). Never raises for HTTP or reply
        problems: `JudgeRuling.error` says what went wrong and `correct` is None. A verdict on the same
        (reference, answer) is reused (`cached`); a failed call is not cached."""
        key = (reference.strip(), answer.strip())
        with self._cache_lock:
            earlier = self._cache.get(key)
        if earlier is not None:
            return replace(earlier, cached=True, seconds=0.0, attempts=0)
        ruling = self._ask(problem, reference, answer)
        if ruling.correct is not None:
            with self._cache_lock:
                self._cache.setdefault(key, ruling)
        return ruling

    def _ask(self, problem: str, reference: str, answer: str) -> JudgeRuling:
        import httpx

        body = self._body(self.messages(problem, reference, answer))
        started = time.monotonic()
        error = "not attempted"
        attempt = 0
        with self._slots:
            for attempt in range(1, self.retries + 2):
                try:
                    response = self._client.post(self.endpoint, json=body)
                except httpx.HTTPError as exc:
                    error = f"cannot reach the judge at {self.endpoint}: {type(exc).__name__}: {exc}"
                else:
                    if response.status_code == 429 or response.status_code >= 500:
                        error = f"judge answered HTTP {response.status_code}: {response.text[:300]}"
                    elif response.status_code != 200:
                        error = f"judge refused the request: HTTP {response.status_code}: {response.text[:300]}"
                        break
                    else:
                        self.calls += 1
                        return self._ruling(response, started, attempt)
                if attempt <= self.retries:
                    self._sleep(2.0 ** (attempt - 1))
        return JudgeRuling(None, model=self.model, seconds=time.monotonic() - started, attempts=attempt, error=error)

    def _ruling(self, response: Any, started: float, attempts: int) -> JudgeRuling:
        seconds = time.monotonic() - started
        try:
            reply = self._reply_text(response.json())
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            kind = "a chat completion" if self.api == "openai" else "a /v1/generate answer"
            return JudgeRuling(None, model=self.model, seconds=seconds, attempts=attempts,
                               error=f"the judge's reply is not {kind} ({type(exc).__name__}: "
                                     f"{response.text[:200]})")
        correct = parse_judge_reply(reply)
        if correct is None:
            return JudgeRuling(None, reply=reply, model=self.model, seconds=seconds, attempts=attempts,
                               error="the judge's reply has no verdict (\\boxed{CORRECT} or \\boxed{INCORRECT})")
        return JudgeRuling(correct, "CORRECT" if correct else "INCORRECT", reply, self.model, seconds, attempts)

    def close(self) -> None:
        self._client.close()


# ------------------------------------------------------------------------------------------ agreement
@dataclass(frozen=True)
class LabelledPair:
    """A (reference, answer) pair known to be equivalent (`equal` True) or not; `problem` may be empty."""

    reference: str
    answer: str
    equal: bool
    problem: str = ""
    note: str = ""


def read_labelled(path: str | Path) -> list[LabelledPair]:
    """A labelled set: JSON lines of {"reference", "answer", "equal": true|false, "problem"?, "note"?};
    ValueError naming the file, line and field of a bad row."""
    pairs = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as err:
            raise ValueError(f"{path}:{number}: not JSON ({err})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{number}: expected an object, got {type(row).__name__}")
        for name, kind in (("reference", str), ("answer", str), ("equal", bool)):
            if not isinstance(row.get(name), kind):
                raise ValueError(f"{path}:{number}: field {name!r} must be a {kind.__name__}, got {row.get(name)!r}")
        pairs.append(LabelledPair(row["reference"], row["answer"], row["equal"], str(row.get("problem", "")),
                                  str(row.get("note", ""))))
    if not pairs:
        raise ValueError(f"{path}: no labelled pairs")
    return pairs


def judge_agreement(judge: LLMJudge, pairs: Iterable[LabelledPair]) -> dict[str, Any]:
    """Run `judge` over `pairs`: {"pairs", "agreed", "agreement" (agreed / pairs; a pair without a verdict
    counts as a disagreement), "no_verdict", "by_label" {equal, different: {pairs, agreed}},
    "false_accepts" (different pairs the judge called equal), "disagreements" (every pair the judge got
    wrong or gave no verdict on, with its ruling)}."""
    from concurrent.futures import ThreadPoolExecutor

    pairs = list(pairs)
    disagreements = []
    by_label = {"equal": {"pairs": 0, "agreed": 0}, "different": {"pairs": 0, "agreed": 0}}
    agreed = no_verdict = false_accepts = 0
    # the judge bounds its own requests in flight (`concurrency`); results are read in the set's order
    with ThreadPoolExecutor(max_workers=judge.concurrency) as pool:
        rulings = list(pool.map(lambda p: judge.judge(p.problem, p.reference, p.answer), pairs))
    for pair, ruling in zip(pairs, rulings, strict=True):
        label = "equal" if pair.equal else "different"
        by_label[label]["pairs"] += 1
        if ruling.correct is pair.equal:
            agreed += 1
            by_label[label]["agreed"] += 1
            continue
        no_verdict += ruling.correct is None
        false_accepts += ruling.correct is True and not pair.equal
        disagreements.append({"reference": pair.reference, "answer": pair.answer, "equal": pair.equal,
                              "note": pair.note, "judge": ruling.verdict or None, "error": ruling.error,
                              "reply": ruling.reply[-500:]})
    return {"pairs": len(pairs), "agreed": agreed, "agreement": agreed / len(pairs) if pairs else None,
            "no_verdict": no_verdict, "false_accepts": false_accepts, "by_label": by_label,
            "judge": {"api": judge.api, "url": judge.url, "model": judge.model}, "calls": judge.calls,
            "disagreements": disagreements}


def labelled_from_mapping(rows: Iterable[Mapping[str, Any]]) -> list[LabelledPair]:
    """LabelledPairs from {"reference"/"gold", "answer", "equal"} mappings (the hand-written test sets)."""
    return [LabelledPair(str(r.get("reference", r.get("gold"))), str(r["answer"]), bool(r["equal"]),
                         str(r.get("problem", "")), str(r.get("note", ""))) for r in rows]
