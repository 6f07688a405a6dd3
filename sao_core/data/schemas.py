"""Normalised record schemas, one ``normalize_<kind>(row) -> dict`` per data kind.

Every normaliser takes one raw row (a ``dict`` read from a file or a Hugging Face dataset) and
returns the normalised record, or raises :class:`RowError` naming the offending field, a reason
from :data:`REASONS` and a human-readable detail. Normalisers do no I/O.

Records carry a stable ``"id"``: the source's own id where the row has one (``id``,
``instance_id``, ``Problem ID``), otherwise ``"<kind>-<first 16 hex of sha256(record)>"`` where
the hash is over the canonical JSON of the record without its id (:func:`content_hash`).

Schemas (output keys):

- ``sft``: ``id, messages`` (messages: ``role`` in system/user/assistant/tool, ``content`` str,
  optional ``name``, optional ``tool_calls`` = ``[{"name", "arguments": dict}]``).
- ``cpt``: ``id, text``.
- ``dpo``: ``id, prompt, chosen, rejected``; each a string or a message list, as given.
- ``rl``: ``id, prompt`` (always a message list), ``env, answer`` (str or None), ``tests`` (list of
  str or None), ``metadata`` (dict of the row's other columns).
- ``swe_bench_verified``: ``id`` (= instance_id), ``repo, base_commit, problem_statement,
  gold_patch, test_patch, fail_to_pass, pass_to_pass, version, environment_setup_commit,
  hints_text, created_at, difficulty``, and, only when the row has them (swebench 5.x rows), the
  harness's ``eval_script, image, log_parser, eval_type`` (strings; the grader then runs that
  eval script, see `sao_core.envs.swe`).
- ``beyond_aime``: ``id, problem, answer`` (int).
- ``imo_answerbench``: ``id, problem, answer, category, subcategory, source``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

KINDS: tuple[str, ...] = (
    "sft",
    "cpt",
    "dpo",
    "rl",
    "swe_bench_verified",
    "beyond_aime",
    "imo_answerbench",
)

#: Rejection reasons. ``duplicate`` is counted separately from rejections.
REASONS: tuple[str, ...] = (
    "missing_field",  # a required field is absent or null
    "wrong_type",  # a field has the wrong JSON type (or a row is not an object)
    "empty",  # a required string/list is empty
    "bad_role",  # a message role outside system/user/assistant/tool
    "no_assistant_turn",  # a conversation with no assistant message
    "chosen_equals_rejected",  # a DPO pair whose two answers are identical
    "unknown_environment",  # an RL env name not in the allowed list
    "not_integer",  # an answer that must be an integer is not
    "bad_json",  # a malformed JSON line, or a field that must hold JSON and does not
    "bad_csv",  # a CSV record with more fields than the header
    "too_long",  # longer than max_tokens under the given tokenizer
    "prompt_too_long",  # a prompt over max_prompt_tokens (tokens with a tokenizer, else characters)
    "duplicate_id",  # a second, different record with an id already written
)
DUPLICATE = "duplicate"

ROLES: tuple[str, ...] = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A data set cannot be prepared: unreadable source, bad configuration, too many rejects."""


class RowError(ValueError):
    """One row is unusable: ``field`` (a path such as ``messages[2].role``), ``reason``, ``detail``."""

    def __init__(self, field: str | None, reason: str, detail: str):
        super().__init__(f"{field or '<row>'}: {reason}: {detail}")
        self.field = field
        self.reason = reason
        self.detail = detail


# --------------------------------------------------------------------------- helpers


def canonical_json(obj: Any) -> str:
    """Deterministic JSON text (sorted keys, no spaces, UTF-8 kept); non-JSON values via ``str``."""
    return json.dumps(obj, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)


def content_hash(record: Mapping[str, Any]) -> str:
    """sha256 hex of the canonical JSON of ``record`` without its ``id``."""
    body = {k: v for k, v in record.items() if k != "id"}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def make_id(kind: str, record: Mapping[str, Any]) -> str:
    return f"{kind}-{content_hash(record)[:16]}"


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any, n: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def _first_key(row: Mapping[str, Any], names: Iterable[str]) -> str | None:
    """The first of ``names`` present in ``row`` with a non-null value."""
    for name in names:
        if row.get(name) is not None:
            return name
    return None


def _require(row: Mapping[str, Any], names: str | tuple[str, ...]) -> tuple[str, Any]:
    names = (names,) if isinstance(names, str) else names
    key = _first_key(row, names)
    if key is None:
        shown = " or ".join(repr(n) for n in names)
        raise RowError(names[0], "missing_field", f"row has no {shown}")
    return key, row[key]


def _string(value: Any, field: str, *, allow_empty: bool = False) -> str:
    if not isinstance(value, str):
        raise RowError(field, "wrong_type", f"expected a string, got {_type_name(value)}")
    if not allow_empty and not value.strip():
        raise RowError(field, "empty", "string is empty")
    return value


def _required_string(row: Mapping[str, Any], names: str | tuple[str, ...]) -> str:
    key, value = _require(row, names)
    return _string(value, key)


def _optional_string(row: Mapping[str, Any], names: str | tuple[str, ...]) -> str | None:
    names = (names,) if isinstance(names, str) else names
    key = _first_key(row, names)
    if key is None:
        return None
    value = row[key]
    if isinstance(value, str):
        return value
    if isinstance(value, bool) or isinstance(value, (dict, list)):
        raise RowError(key, "wrong_type", f"expected a string, got {_type_name(value)}")
    return str(value)  # numbers, dates (e.g. a parquet timestamp) -> text


def _source_id(row: Mapping[str, Any], names: tuple[str, ...] = ("id",)) -> str | None:
    key = _first_key(row, names)
    if key is None:
        return None
    value = row[key]
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(key, "wrong_type", f"id must be a string or integer, got {_type_name(value)}")
    text = str(value).strip()
    if not text:
        raise RowError(key, "empty", "id is empty")
    return text


def _with_id(kind: str, record: dict[str, Any], source_id: str | None) -> dict[str, Any]:
    return {"id": source_id if source_id is not None else make_id(kind, record), **record}


# --------------------------------------------------------------------------- messages


def _arguments(value: Any, field: str) -> dict[str, Any]:
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as exc:
            raise RowError(field, "bad_json", f"arguments string is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise RowError(field, "wrong_type", f"arguments must be an object, got {_type_name(value)}")
    return value


def _tool_calls(value: Any, field: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise RowError(field, "wrong_type", f"tool_calls must be a list, got {_type_name(value)}")
    calls = []
    for j, call in enumerate(value):
        path = f"{field}[{j}]"
        if not isinstance(call, dict):
            raise RowError(path, "wrong_type", f"a tool call must be an object, got {_type_name(call)}")
        if isinstance(call.get("function"), dict):  # OpenAI form {"type": "function", "function": {...}}
            call = call["function"]
        if call.get("name") is None:
            raise RowError(f"{path}.name", "missing_field", "tool call has no name")
        name = _string(call["name"], f"{path}.name")
        args = _arguments(call.get("arguments", {}), f"{path}.arguments")
        calls.append({"name": name, "arguments": args})
    return calls


def normalize_messages(value: Any, field: str = "messages", *, need_assistant: bool = True) -> list[dict]:
    """Validate a chat message list; returns clean copies (role, content[, name][, tool_calls])."""
    if not isinstance(value, list):
        raise RowError(field, "wrong_type", f"expected a list of messages, got {_type_name(value)}")
    if not value:
        raise RowError(field, "empty", "message list is empty")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(value):
        path = f"{field}[{i}]"
        if not isinstance(msg, dict):
            raise RowError(path, "wrong_type", f"a message must be an object, got {_type_name(msg)}")
        if msg.get("role") is None:
            raise RowError(f"{path}.role", "missing_field", "message has no role")
        role = msg["role"]
        if not isinstance(role, str):
            raise RowError(f"{path}.role", "wrong_type", f"role must be a string, got {_type_name(role)}")
        if role not in ROLES:
            raise RowError(f"{path}.role", "bad_role", f"role {role!r} is not one of {', '.join(ROLES)}")
        clean: dict[str, Any] = {"role": role}
        calls = None
        if msg.get("tool_calls") is not None:
            if role != "assistant":
                raise RowError(
                    f"{path}.tool_calls", "bad_role", f"only assistant messages may call tools, not {role!r}"
                )
            calls = _tool_calls(msg["tool_calls"], f"{path}.tool_calls")
        content = msg.get("content")
        if content is None:
            if not calls:
                raise RowError(f"{path}.content", "missing_field", "message has no content")
            content = ""
        if not isinstance(content, str):
            raise RowError(
                f"{path}.content", "wrong_type", f"content must be a string, got {_type_name(content)}"
            )
        if not content.strip() and not calls and role != "tool":
            raise RowError(f"{path}.content", "empty", f"{role} message has empty content")
        clean["content"] = content
        if msg.get("name") is not None:
            clean["name"] = _string(msg["name"], f"{path}.name")
        if calls:
            clean["tool_calls"] = calls
        out.append(clean)
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise RowError(field, "no_assistant_turn", f"{len(out)} message(s), none from the assistant")
    return out


def _text_or_messages(value: Any, field: str, *, need_assistant: bool) -> str | list[dict]:
    if isinstance(value, str):
        return _string(value, field)
    if isinstance(value, list):
        return normalize_messages(value, field, need_assistant=need_assistant)
    raise RowError(field, "wrong_type", f"expected a string or a message list, got {_type_name(value)}")


# --------------------------------------------------------------------------- kinds


def normalize_sft(row: Mapping[str, Any]) -> dict[str, Any]:
    """``messages`` or ``prompt`` + ``completion``/``response`` -> ``{"id", "messages"}``."""
    sid = _source_id(row)
    if row.get("messages") is not None:
        messages = normalize_messages(row["messages"], "messages")
    else:
        if row.get("prompt") is None:
            raise RowError(
                "messages", "missing_field", "row has neither 'messages' nor 'prompt' + 'completion'"
            )
        prompt = _text_or_messages(row["prompt"], "prompt", need_assistant=False)
        ckey, completion = _require(row, ("completion", "response"))
        if isinstance(completion, list):
            answer = normalize_messages(completion, ckey)
        else:
            answer = [{"role": "assistant", "content": _string(completion, ckey)}]
        head = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        messages = head + answer
    return _with_id("sft", {"messages": messages}, sid)


def normalize_cpt(row: Mapping[str, Any]) -> dict[str, Any]:
    """``text`` (or ``content``) -> ``{"id", "text"}``."""
    sid = _source_id(row)
    text = _required_string(row, ("text", "content"))
    return _with_id("cpt", {"text": text}, sid)


def normalize_dpo(row: Mapping[str, Any]) -> dict[str, Any]:
    """``prompt``, ``chosen``, ``rejected`` (strings or message lists) -> same keys + id."""
    sid = _source_id(row)
    _, prompt = _require(row, "prompt")
    prompt = _text_or_messages(prompt, "prompt", need_assistant=False)
    _, chosen = _require(row, "chosen")
    chosen = _text_or_messages(chosen, "chosen", need_assistant=True)
    _, rejected = _require(row, "rejected")
    rejected = _text_or_messages(rejected, "rejected", need_assistant=True)
    if canonical_json(chosen) == canonical_json(rejected):
        raise RowError("rejected", "chosen_equals_rejected", "chosen and rejected are identical")
    return _with_id("dpo", {"prompt": prompt, "chosen": chosen, "rejected": rejected}, sid)


def _answer_text(value: Any, field: str) -> str:
    if isinstance(value, bool):
        raise RowError(field, "wrong_type", "answer must be a string or number, got bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise RowError(field, "wrong_type", f"answer is {value}")
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        return value.strip()
    raise RowError(field, "wrong_type", f"answer must be a string or number, got {_type_name(value)}")


def _string_list(value: Any, field: str) -> list[str]:
    """A list of strings, or a JSON-encoded one (as in SWE-bench's FAIL_TO_PASS)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise RowError(field, "bad_json", f"not a JSON list of strings: {exc}") from None
    if not isinstance(value, (list, tuple)):
        raise RowError(field, "wrong_type", f"expected a list of strings, got {_type_name(value)}")
    for j, item in enumerate(value):
        if not isinstance(item, str):
            raise RowError(f"{field}[{j}]", "wrong_type", f"expected a string, got {_type_name(item)}")
    return list(value)


_RL_CONSUMED = {"id", "prompt", "env", "environment", "answer", "tests", "metadata"}


def normalize_rl(row: Mapping[str, Any], environments: Iterable[str] | None = None) -> dict[str, Any]:
    """``prompt``, ``env``/``environment``, ``answer`` and/or ``tests`` -> rl record.

    ``environments`` is the allowed env names (``None`` allows any). ``prompt`` becomes a message
    list (a string prompt is one user message). Columns not consumed go to ``metadata``.
    """
    sid = _source_id(row)
    _, prompt = _require(row, "prompt")
    prompt = _text_or_messages(prompt, "prompt", need_assistant=False)
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    ekey, env = _require(row, ("env", "environment"))
    env = _string(env, ekey).strip()
    allowed = tuple(environments) if environments is not None else None
    if allowed is not None and env not in allowed:
        raise RowError(ekey, "unknown_environment", f"env {env!r} is not one of {', '.join(allowed)}")
    answer = _answer_text(row["answer"], "answer") if row.get("answer") is not None else None
    tests = _string_list(row["tests"], "tests") if row.get("tests") is not None else None
    if answer is None and tests is None:
        raise RowError("answer", "missing_field", "row has neither 'answer' nor 'tests'")
    if not answer and not tests:
        field = "answer" if answer is not None else "tests"
        raise RowError(field, "empty", "answer is empty and there are no tests")
    metadata: dict[str, Any] = {}
    if row.get("metadata") is not None:
        if not isinstance(row["metadata"], dict):
            raise RowError(
                "metadata", "wrong_type", f"metadata must be an object, got {_type_name(row['metadata'])}"
            )
        metadata.update(row["metadata"])
    for key, value in row.items():
        if key not in _RL_CONSUMED and value is not None:
            metadata.setdefault(key, value)
    record = {
        "prompt": prompt,
        "env": env,
        "answer": answer or None,
        "tests": tests or None,
        "metadata": metadata,
    }
    return _with_id("rl", record, sid)


#: The swebench 5.x columns the SWE grader runs and grades with (`sao_core.envs.swebench_harness.HARNESS_ROW_FIELDS`).
SWE_HARNESS_FIELDS = ("eval_script", "image", "log_parser", "eval_type")


def normalize_swe_bench_verified(row: Mapping[str, Any]) -> dict[str, Any]:
    """SWE-bench Verified columns -> swe record (``id`` = ``instance_id``)."""
    instance_id = _required_string(row, "instance_id").strip()
    record: dict[str, Any] = {
        "repo": _required_string(row, "repo"),
        "base_commit": _required_string(row, "base_commit"),
        "problem_statement": _required_string(row, "problem_statement"),
        "gold_patch": _required_string(row, "patch"),
        "test_patch": _required_string(row, "test_patch"),
    }
    _, f2p = _require(row, "FAIL_TO_PASS")
    record["fail_to_pass"] = _string_list(f2p, "FAIL_TO_PASS")
    if not record["fail_to_pass"]:
        raise RowError("FAIL_TO_PASS", "empty", "no FAIL_TO_PASS tests: nothing to grade against")
    _, p2p = _require(row, "PASS_TO_PASS")
    record["pass_to_pass"] = _string_list(p2p, "PASS_TO_PASS")
    for key in ("version", "environment_setup_commit", "hints_text", "created_at", "difficulty"):
        record[key] = _optional_string(row, key)
    for key in SWE_HARNESS_FIELDS:      # kept only when there: older rows' records stay as they were
        value = _optional_string(row, key)
        if value:
            record[key] = value
    return {"id": instance_id, **record}


_INT_TEXT = re.compile(r"[+-]?\d+")


def _integer(value: Any, field: str) -> int:
    if isinstance(value, bool):
        raise RowError(field, "not_integer", "answer is a boolean")
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            return int(value)
        raise RowError(field, "not_integer", f"{value!r} is not an integer")
    if isinstance(value, str):
        text = value.strip()
        if _INT_TEXT.fullmatch(text):
            return int(text)
        raise RowError(field, "not_integer", f"{_short(value)} is not an integer")
    raise RowError(field, "not_integer", f"expected an integer, got {_type_name(value)}")


def normalize_beyond_aime(row: Mapping[str, Any]) -> dict[str, Any]:
    """``problem``, integer ``answer`` -> ``{"id", "problem", "answer": int}``."""
    sid = _source_id(row)
    problem = _required_string(row, "problem").strip()
    _, answer = _require(row, "answer")
    return _with_id("beyond_aime", {"problem": problem, "answer": _integer(answer, "answer")}, sid)


_IMO_COLUMNS = {
    "id": ("Problem ID", "problem_id", "id"),
    "problem": ("Problem", "problem"),
    "answer": ("Short Answer", "short_answer", "answer"),
    "category": ("Category", "category"),
    "subcategory": ("Subcategory", "subcategory"),
    "source": ("Source", "source"),
}
# The released answerbench_v2.csv has one record (imo-bench-algebra-036) whose Problem field lacks
# its closing quote, so a CSV reader folds the Short Answer into the Problem ("...\n,ANSWER\"") and
# shifts the later columns left by one (upstream google-deepmind/superhuman issue #13).
_IMO_FOLDED = re.compile(r"(?s)\A(?P<problem>.*)\n,(?P<answer>[^\n]+)\"\Z")


def _imo_repair(row: Mapping[str, Any], notes: list[str] | None) -> dict[str, Any] | None:
    source_key = _first_key(row, _IMO_COLUMNS["source"])
    problem_key = _first_key(row, _IMO_COLUMNS["problem"])
    if source_key is not None or problem_key is None or not isinstance(row[problem_key], str):
        return None
    match = _IMO_FOLDED.match(row[problem_key])
    if match is None:
        return None
    shifted = [row.get(_first_key(row, _IMO_COLUMNS[k]) or "") for k in ("answer", "category", "subcategory")]
    if not all(isinstance(v, str) and v.strip() for v in shifted):
        return None
    fixed = dict(row)
    for key in ("problem", "answer", "category", "subcategory", "source"):
        for name in _IMO_COLUMNS[key]:
            fixed.pop(name, None)
    fixed.update(
        {
            "Problem": match["problem"],
            "Short Answer": match["answer"],
            "Category": shifted[0],
            "Subcategory": shifted[1],
            "Source": shifted[2],
        }
    )
    if notes is not None:
        notes.append(
            "realigned a CSV record whose Problem field lacks its closing quote (superhuman issue #13)"
        )
    return fixed


def normalize_imo_answerbench(row: Mapping[str, Any], notes: list[str] | None = None) -> dict[str, Any]:
    """IMO-AnswerBench CSV columns -> ``{"id", "problem", "answer", "category", "subcategory", "source"}``.

    ``notes`` (optional) receives a line for each repair applied to the row.
    """
    row = _imo_repair(row, notes) or row
    sid = _source_id(row, _IMO_COLUMNS["id"])
    if sid is None:
        raise RowError("Problem ID", "missing_field", "row has no 'Problem ID'")
    record = {
        "problem": _required_string(row, _IMO_COLUMNS["problem"]).strip(),
        "answer": _answer_text(_require(row, _IMO_COLUMNS["answer"])[1], "Short Answer"),
    }
    if not record["answer"]:
        raise RowError("Short Answer", "empty", "answer is empty")
    for key in ("category", "subcategory", "source"):
        names = _IMO_COLUMNS[key]
        if not any(name in row for name in names):
            raise RowError(names[0], "missing_field", f"row has no {names[0]!r} column (short CSV record?)")
        value = _optional_string(row, names)
        record[key] = value.strip() if value and value.strip() else None
    return {"id": sid, **record}


def normalizer(kind: str, *, environments: Iterable[str] | None = None) -> Callable[..., dict[str, Any]]:
    """The normaliser for ``kind`` as a one-argument callable ``(row, notes=None) -> record``."""
    if kind == "rl":
        allowed = tuple(environments) if environments is not None else None
        return lambda row, notes=None: normalize_rl(row, allowed)
    if kind == "imo_answerbench":
        return normalize_imo_answerbench
    table: dict[str, Callable[[Mapping[str, Any]], dict[str, Any]]] = {
        "sft": normalize_sft,
        "cpt": normalize_cpt,
        "dpo": normalize_dpo,
        "swe_bench_verified": normalize_swe_bench_verified,
        "beyond_aime": normalize_beyond_aime,
    }
    if kind not in table:
        raise KeyError(kind)
    fn = table[kind]
    return lambda row, notes=None: fn(row)


def model_texts(kind: str, record: Mapping[str, Any]) -> list[tuple[str, str | list[dict]]]:
    """What a model reads (and, for sft/dpo, writes) for this record, for token-length limits:
    ``(field, text or message list)`` pairs, each counted separately against the limit."""
    if kind == "sft":
        return [("messages", record["messages"])]
    if kind == "cpt":
        return [("text", record["text"])]
    if kind == "dpo":

        def joined(prompt: Any, answer: Any) -> str | list[dict]:
            if isinstance(prompt, list) or isinstance(answer, list):
                p = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
                a = answer if isinstance(answer, list) else [{"role": "assistant", "content": answer}]
                return p + a
            return prompt + answer

        return [
            ("chosen", joined(record["prompt"], record["chosen"])),
            ("rejected", joined(record["prompt"], record["rejected"])),
        ]
    if kind == "rl":
        return [("prompt", record["prompt"])]
    if kind == "swe_bench_verified":
        return [("problem_statement", record["problem_statement"])]
    return [("problem", record["problem"])]


#: Kinds whose rows have a prompt that the prompt budget (``max_prompt_tokens``) applies to.
PROMPT_KINDS: tuple[str, ...] = ("sft", "dpo", "rl")


def prompt_of(kind: str, record: Mapping[str, Any]) -> tuple[str, str | list[dict]] | None:
    """``(field, prompt)`` of a normalised record of a training kind: what the model reads before it first
    answers (``sft``: the messages before the first assistant turn; ``dpo`` and ``rl``: ``prompt``); None for
    other kinds or an sft conversation that opens with the assistant."""
    if kind == "sft":
        messages = record["messages"]
        first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
        return ("messages", messages[:first]) if first else None
    if kind in ("dpo", "rl"):
        return ("prompt", record["prompt"])
    return None
