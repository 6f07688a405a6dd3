"""Data preparation: read a source, normalise each row for its kind, write the result.

:func:`prepare` writes three files to ``config.output`` (a local folder or an ``s3://`` prefix):

- ``data.jsonl``: one normalised record per line (schemas in :mod:`sao_core.data.schemas`), each
  with a stable ``"id"``;
- ``rejects.jsonl``: one line per row that was not written, ``{"file", "row", "line", "field",
  "reason", "detail"}``. ``row`` is the 0-based data row (for CSV the header is not counted; blank
  JSON lines are not counted), ``line`` the 1-based physical line where the row starts (JSON lines
  and CSV only, else null), ``field`` a path such as ``messages[2].role`` (null for the whole row);
  rows rejected for their length also carry ``length``, ``limit`` and ``unit`` (tokens or characters);
- ``stats.json``: :class:`PrepareStats` as JSON, plus the configuration.

Exact duplicates (same normalised record apart from its id) are dropped when ``dedup`` is on;
they go to ``rejects.jsonl`` with reason ``duplicate`` but are counted in ``duplicates``, not in
``rows_rejected``: ``rows_read = rows_written + rows_rejected + duplicates``.

**Prompt budget.** Rows of the training kinds with a prompt (``sft``: the messages before the first
assistant turn; ``dpo`` and ``rl``: ``prompt``) whose prompt is longer than ``max_prompt_tokens`` are
rejected as ``prompt_too_long``. With a ``tokenizer`` the prompt is measured in tokens, rendered with
the tokenizer's chat template (plus the generation prompt); without one it is measured in characters
against ``max_prompt_tokens × CHARS_PER_TOKEN`` (8: generous on purpose, English text averages about 4
characters a token under common BPE tokenizers, so only prompts that cannot fit under any usual
tokenizer are dropped; give a tokenizer for an exact count). Benchmark kinds are never cut: a dropped
problem would change a benchmark's score.

**Failed means unusable.** Everything is written to a staging place first (a ``.prepare-*`` folder in
the output folder; for ``s3://`` a local temporary folder uploaded to a ``.prepare-*`` staging prefix)
and published only when the preparation succeeded. A preparation fails when the source holds no rows,
when no row is written, or when ``rows_rejected / rows_read`` exceeds ``max_reject_fraction``; then the
earlier ``data.jsonl`` / ``rejects.jsonl`` / ``stats.json`` in the output (if any) stay as they were,
the failed attempt's ``rejects.jsonl`` and ``stats.json`` (``"status": "failed"``) go to
``failed/``, a ``FAILED`` marker (the reason, as text) is written, and :class:`DataError` is raised.
:func:`sao_core.data.prepared.open_prepared`, which every reader of a prepared dataset uses, refuses
a folder with a ``FAILED`` marker. Publishing writes ``FAILED`` ("publication in progress") first,
then the three files (``stats.json`` last), then removes ``failed/`` and ``FAILED``: a publication
that is cut short leaves the folder marked, never a mix that looks good.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sao_core import storage
from sao_core.data import schemas
from sao_core.data.readers import RowReadError, iter_rows
from sao_core.data.schemas import KINDS, DataError, RowError

log = logging.getLogger(__name__)

DATA_FILE = "data.jsonl"
REJECTS_FILE = "rejects.jsonl"
STATS_FILE = "stats.json"
FAILED_MARKER = "FAILED"  # present while the output is unusable: its last preparation failed (or is publishing)
FAILED_DIR = "failed"  # the failed attempt's rejects.jsonl and stats.json
STAGING_PREFIX = ".prepare-"
#: Default prompt budget, in tokens: RLConfig.max_total_tokens' default (a longer prompt leaves no room for
#: a single action token in an RL episode of that length).
DEFAULT_MAX_PROMPT_TOKENS = 4096
#: Without a tokenizer a prompt may have up to max_prompt_tokens × CHARS_PER_TOKEN characters (see above).
CHARS_PER_TOKEN = 8
PROGRESS_EVERY = 1000
_MAX_LISTED_REPAIRS = 100


@dataclass
class PrepareConfig:
    source: str                              # Hugging Face id, local jsonl/json/parquet/csv file or s3:// object
    kind: str                                # sft | cpt | dpo | rl | swe_bench_verified | beyond_aime | imo_answerbench
    output: str                              # folder or s3:// prefix to publish data.jsonl, rejects.jsonl, stats.json to
    split: str = "train"
    max_reject_fraction: float = 0.05        # fail when more than this share of the rows is rejected (0 to 1)
    tokenizer: str | None = None             # tokenizer folder: count tokens (max_tokens, max_prompt_tokens)
    max_tokens: int | None = None            # reject rows longer than this many tokens (needs tokenizer)
    max_prompt_tokens: int | None = DEFAULT_MAX_PROMPT_TOKENS  # prompt budget of sft/dpo/rl rows: tokens with a tokenizer (chat template), else 8 characters a token; none: no budget
    dedup: bool = True
    environments: tuple[str, ...] = ("math", "math_python", "swe", "tool_arith")
    limit: int | None = None


@dataclass
class PrepareStats:
    source: str
    kind: str
    output: str
    rows_read: int = 0
    rows_written: int = 0
    rows_rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    duplicates: int = 0
    repaired: int = 0
    files: dict[str, str] = field(default_factory=dict)
    dataset_version: str = ""
    seconds: float = 0.0
    status: str = "ok"
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------- helpers


def _check_config(config: PrepareConfig) -> tuple[str, ...]:
    if config.kind not in KINDS:
        raise DataError(f"unknown data kind {config.kind!r}; choose one of: {', '.join(KINDS)}")
    if not isinstance(config.output, str) or not config.output.strip():
        raise DataError("output is empty: give a local folder or an s3:// prefix")
    frac = config.max_reject_fraction
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 <= frac <= 1.0:
        raise DataError(f"max_reject_fraction must be a number in [0, 1], got {frac!r}")
    limit = config.limit
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise DataError(f"limit must be a positive integer or None (no limit), got {limit!r}")
    budget = config.max_prompt_tokens
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
        raise DataError(f"max_prompt_tokens must be a positive integer or None (no budget), got {budget!r}")
    if config.max_tokens is not None:
        if (
            isinstance(config.max_tokens, bool)
            or not isinstance(config.max_tokens, int)
            or config.max_tokens <= 0
        ):
            raise DataError(f"max_tokens must be a positive integer or None, got {config.max_tokens!r}")
        if not config.tokenizer:
            raise DataError(
                "max_tokens is set but tokenizer is not: give the tokenizer folder to count tokens with"
            )
    envs = config.environments
    if isinstance(envs, str) or not all(isinstance(e, str) and e for e in envs) or not envs:
        raise DataError(f"environments must be a non-empty sequence of names, got {envs!r}")
    return tuple(envs)


def _load_tokenizer(config: PrepareConfig) -> Any:
    """The tokenizer when one is given and a limit needs it (max_tokens, or a prompt budget for this kind)."""
    if not config.tokenizer:
        return None
    if config.max_tokens is None and (config.max_prompt_tokens is None or config.kind not in schemas.PROMPT_KINDS):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(config.tokenizer)
    except Exception as exc:
        raise DataError(
            f"cannot load tokenizer from {config.tokenizer}: {type(exc).__name__}: {exc}"
        ) from exc


def _ids_len(encoded: Any) -> int:
    if hasattr(encoded, "keys") and "input_ids" in encoded:
        encoded = encoded["input_ids"]
    return len(encoded)


def _plain(messages: list[dict]) -> str:
    parts = []
    for m in messages:
        calls = "".join(
            json.dumps(c, ensure_ascii=False, sort_keys=True) for c in m.get("tool_calls", ())
        )
        parts.append(f"{m['role']}: {m['content'] or ''}{calls}")
    return "\n".join(parts)


def _token_counter(tok: Any, generation_prompt: bool = False) -> Callable[[str | list[dict]], int]:
    """Tokens of a text, or of a conversation rendered with the chat template (a plain rendering when the
    tokenizer has none or it cannot render this conversation, e.g. tool calls)."""

    def count(item: str | list[dict]) -> int:
        if isinstance(item, str):
            return _ids_len(tok(item)["input_ids"])
        if getattr(tok, "chat_template", None):
            try:
                return _ids_len(tok.apply_chat_template(item, tokenize=True, add_generation_prompt=generation_prompt))
            except Exception:  # a template that cannot render this conversation (e.g. tool calls)
                pass
        return _ids_len(tok(_plain(item))["input_ids"])

    return count


def _characters(item: str | list[dict]) -> int:
    if isinstance(item, str):
        return len(item)
    return sum(len(m.get("content") or "") + sum(len(json.dumps(c, ensure_ascii=False)) for c in m.get("tool_calls", ()))
               for m in item)


def _prompt_check(config: PrepareConfig, tok: Any) -> Callable[[dict], tuple[str, int, int, str] | None] | None:
    """A function giving ``(field, length, limit, unit)`` for a record whose prompt is over the budget."""
    if config.max_prompt_tokens is None or config.kind not in schemas.PROMPT_KINDS:
        return None
    if tok is not None:
        measure, limit, unit = _token_counter(tok, generation_prompt=True), config.max_prompt_tokens, "tokens"
    else:
        measure, limit, unit = _characters, config.max_prompt_tokens * CHARS_PER_TOKEN, "characters"

    def check(record: dict) -> tuple[str, int, int, str] | None:
        prompt = schemas.prompt_of(config.kind, record)
        if prompt is None:
            return None
        fld, item = prompt
        n = measure(item)
        return (fld, n, limit, unit) if n > limit else None

    return check


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=str)


def _rejects_said(stats: PrepareStats, first: dict[str, Any] | None) -> tuple[str, str]:
    """The top rejection reasons and where the first rejected row is, as the failure messages say them."""
    top = Counter(stats.rejected_by_reason).most_common(5)
    reasons = ", ".join(f"{reason} {n}" for reason, n in top) or "none"
    where = ""
    if first is not None:
        line = f" (line {first['line']})" if first.get("line") is not None else ""
        where = f"; first: row {first['row']}{line} field {first['field']!r}: {first['reason']}: {first['detail']}"
    return reasons, where


def _summary(stats: PrepareStats, frac: float, first: dict[str, Any] | None) -> str:
    reasons, where = _rejects_said(stats, first)
    return (
        f"{stats.rows_rejected} of {stats.rows_read} rows rejected ({stats.rows_rejected / stats.rows_read:.1%}) from "
        f"{stats.source}, above max_reject_fraction {frac} ({frac:.1%}); top reasons: {reasons}{where}. "
        f"Every rejected row is listed in {stats.files['rejects']}; counts in {stats.files['stats']}"
    )


# --------------------------------------------------------------------------- prepare


def prepare(config: PrepareConfig, progress: Callable[[int], None] | None = None) -> PrepareStats:
    """Prepare ``config.source`` as ``config.kind`` into ``config.output``; see the module docstring.

    ``progress`` is called with the number of rows read so far, every 1000 rows and at the end.
    Raises :class:`DataError` for a bad configuration, an unreadable source, or too many rejects.
    """
    started = time.monotonic()
    environments = _check_config(config)
    normalize = schemas.normalizer(config.kind, environments=environments)
    tok = _load_tokenizer(config)
    count_tokens = _token_counter(tok) if tok is not None and config.max_tokens is not None else None
    prompt_check = _prompt_check(config, tok)
    out_s3 = storage.is_s3_uri(config.output)
    stats = PrepareStats(source=config.source, kind=config.kind, output=config.output)
    stats.files = _published_files(config.output)

    with iter_rows(config.source, config.split) as rows:  # opened first: a bad source leaves no output
        stats.dataset_version = rows.version
        staging = _make_staging(config.output, out_s3)
        try:
            try:
                first_reject, repairs = _run(config, rows, normalize, count_tokens, prompt_check, stats, staging,
                                             progress)
            except Exception as exc:  # a source that breaks half-way, a tokenizer that fails: nothing is published
                _mark_failed(config.output, f"{type(exc).__name__}: {exc}", None)
                raise
            _judge(config, stats, first_reject)
            stats.seconds = round(time.monotonic() - started, 3)
            _write_stats(staging, stats, config, repairs)
            if stats.status == "ok":
                _publish(staging, config.output, out_s3)
            else:
                _mark_failed(config.output, stats.error, staging)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    log.info(
        "prepared %s as %s: %d read, %d written, %d rejected, %d duplicates -> %s%s",
        config.source,
        config.kind,
        stats.rows_read,
        stats.rows_written,
        stats.rows_rejected,
        stats.duplicates,
        config.output,
        "" if stats.status == "ok" else " (FAILED, not published)",
    )
    if stats.status != "ok":
        raise DataError(stats.error)
    return stats


def _make_staging(output: str, out_s3: bool) -> Path:
    """A fresh staging folder: a local temporary one for s3:// outputs, else a hidden one inside the output
    folder (created if needed; an output that is a file is an error)."""
    if out_s3:
        return Path(tempfile.mkdtemp(prefix="sao-prepare-"))
    out_dir = Path(output).expanduser()
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"output {output} exists and is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=out_dir))


def _judge(config: PrepareConfig, stats: PrepareStats, first_reject: dict[str, Any] | None) -> None:
    """Mark `stats` failed, with its error and the failed attempt's file locations, when no row was read, too
    many were rejected, or none was written."""
    frac = float(config.max_reject_fraction)
    too_many = stats.rows_read > 0 and stats.rows_rejected / stats.rows_read > frac
    if stats.rows_read and not too_many and stats.rows_written:
        return
    stats.status = "failed"
    stats.files = _failed_files(config.output)   # set first: the messages point at the failed attempt's files
    if stats.rows_read == 0:
        error = f"no rows read from {config.source}"
    elif too_many:
        error = _summary(stats, frac, first_reject)
    else:
        error = _nothing_written(stats, first_reject)
    stats.error = error + (f". Nothing was published: {config.output} keeps its earlier data (if any), unused "
                           f"while {stats.files['failed']} exists (removed by the next successful preparation)")


def _write_stats(staging: Path, stats: PrepareStats, config: PrepareConfig, repairs: list[dict[str, Any]]) -> None:
    report = {
        **stats.to_dict(),
        "config": dataclasses.asdict(config),
        "repairs": repairs,
        "row_numbering": "row: 0-based data row (CSV header and blank lines not counted); "
        "line: 1-based physical line where the row starts (jsonl, csv)",
    }
    (staging / STATS_FILE).write_text(
        json.dumps(report, indent=2, ensure_ascii=False, default=str) + "\n", encoding="utf-8"
    )


def _published_files(output: str) -> dict[str, str]:
    return {key: storage.join(output, name)
            for key, name in (("data", DATA_FILE), ("rejects", REJECTS_FILE), ("stats", STATS_FILE))}


def _failed_files(output: str) -> dict[str, str]:
    return {"rejects": storage.join(output, FAILED_DIR, REJECTS_FILE),
            "stats": storage.join(output, FAILED_DIR, STATS_FILE),
            "failed": storage.join(output, FAILED_MARKER)}


def _nothing_written(stats: PrepareStats, first: dict[str, Any] | None) -> str:
    reasons, where = _rejects_said(stats, first)
    return (f"no rows written: all {stats.rows_read} rows read from {stats.source} were rejected "
            f"({stats.rows_rejected}) or duplicates ({stats.duplicates}); top reasons: {reasons}{where}. Every "
            f"rejected row is listed in {stats.files['rejects']}")


def _run(
    config: PrepareConfig,
    rows: Any,
    normalize: Callable[..., dict[str, Any]],
    count_tokens: Callable[[str | list[dict]], int] | None,
    prompt_check: Callable[[dict], tuple[str, int, int, str] | None] | None,
    stats: PrepareStats,
    staging: Path,
    progress: Callable[[int], None] | None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """Read up to `config.limit` rows into the staged data.jsonl and rejects.jsonl, counting into `stats`;
    return (the first reject that is not a duplicate, or None; the listed repairs)."""
    with (
        open(staging / DATA_FILE, "w", encoding="utf-8") as data_fh,
        open(staging / REJECTS_FILE, "w", encoding="utf-8") as rej_fh,
    ):
        sink = _RowSink(config, rows.name, stats, data_fh, rej_fh)
        for row in rows:
            if config.limit is not None and stats.rows_read >= config.limit:
                break
            stats.rows_read += 1
            if progress is not None and stats.rows_read % PROGRESS_EVERY == 0:
                progress(stats.rows_read)
            sink.add(row, normalize, count_tokens, prompt_check)
    stats.rejected_by_reason = dict(sink.reasons.most_common())
    if progress is not None:
        progress(stats.rows_read)
    return sink.first_reject, sink.repairs


class _RowSink:
    """Where each read row goes: data.jsonl when it normalises and passes the length and duplicate checks,
    else rejects.jsonl with its reason."""

    def __init__(self, config: PrepareConfig, file_name: str, stats: PrepareStats, data_fh: Any, rej_fh: Any):
        self.config, self.file_name, self.stats = config, file_name, stats
        self.data_fh, self.rej_fh = data_fh, rej_fh
        self.seen_content: dict[str, int] = {}      # content hash -> data row written with it
        self.seen_ids: dict[str, int] = {}          # id -> data row written with it
        self.reasons: Counter[str] = Counter()
        self.first_reject: dict[str, Any] | None = None
        self.repairs: list[dict[str, Any]] = []

    def add(
        self,
        row: Any,
        normalize: Callable[..., dict[str, Any]],
        count_tokens: Callable[[str | list[dict]], int] | None,
        prompt_check: Callable[[dict], tuple[str, int, int, str] | None] | None,
    ) -> None:
        if isinstance(row.value, RowReadError):
            self.reject(row, row.value.field, row.value.reason, row.value.detail)
            return
        notes: list[str] = []
        try:
            record = normalize(row.value, notes)
        except RowError as err:
            self.reject(row, err.field, err.reason, err.detail)
            return
        if self.prompt_too_long(row, record, prompt_check) or self.too_many_tokens(row, record, count_tokens):
            return
        if self.config.dedup and self.duplicate_content(row, record):
            return
        record = self.with_unique_id(row, record)
        if record is not None:
            self.write(row, record, notes)

    def reject(self, row: Any, fld: str | None, reason: str, detail: str, **extra: Any) -> None:
        entry = {
            "file": self.file_name,
            "row": row.index,
            "line": row.line,
            "field": fld,
            "reason": reason,
            "detail": detail,
            **extra,
        }
        self.rej_fh.write(_dump(entry) + "\n")
        if reason == schemas.DUPLICATE:
            self.stats.duplicates += 1
            return
        self.stats.rows_rejected += 1
        self.reasons[reason] += 1
        if self.first_reject is None:
            self.first_reject = entry

    def prompt_too_long(self, row: Any, record: dict[str, Any],
                        prompt_check: Callable[[dict], tuple[str, int, int, str] | None] | None) -> bool:
        over = prompt_check(record) if prompt_check is not None else None
        if over is None:
            return False
        fld, n, limit, unit = over
        max_prompt = self.config.max_prompt_tokens
        budget = (f"max_prompt_tokens {max_prompt}" if unit == "tokens" else
                  f"max_prompt_tokens {max_prompt} x {CHARS_PER_TOKEN} characters a token; "
                  "give a tokenizer to count tokens")
        self.reject(row, fld, "prompt_too_long", f"prompt of {n} {unit} > {limit} ({budget})",
                    length=n, limit=limit, unit=unit)
        return True

    def too_many_tokens(self, row: Any, record: dict[str, Any],
                        count_tokens: Callable[[str | list[dict]], int] | None) -> bool:
        if count_tokens is None:
            return False
        max_tokens = self.config.max_tokens
        for fld, item in schemas.model_texts(self.config.kind, record):
            n = count_tokens(item)
            if n > max_tokens:
                self.reject(row, fld, "too_long", f"{n} tokens > max_tokens {max_tokens}",
                            length=n, limit=max_tokens, unit="tokens")
                return True
        return False

    def duplicate_content(self, row: Any, record: dict[str, Any]) -> bool:
        digest = schemas.content_hash(record)
        if digest in self.seen_content:
            self.reject(row, None, schemas.DUPLICATE,
                        f"same record as data row {self.seen_content[digest]} (id {record['id']!r})")
            return True
        self.seen_content[digest] = row.index
        return False

    def with_unique_id(self, row: Any, record: dict[str, Any]) -> dict[str, Any] | None:
        """The record, its id numbered when it is a copy kept on purpose; None (rejected) when another record
        already holds its id."""
        if (
            record["id"] in self.seen_ids
            and not self.config.dedup
            and record["id"] == schemas.make_id(self.config.kind, record)
        ):
            # duplicates kept on purpose share their content-hash id: number the copies
            n = 1
            while f"{record['id']}-{n}" in self.seen_ids:
                n += 1
            record = {**record, "id": f"{record['id']}-{n}"}
        if record["id"] in self.seen_ids:
            self.reject(row, "id", "duplicate_id",
                        f"id {record['id']!r} already used by data row {self.seen_ids[record['id']]} with different "
                        "content")
            return None
        return record

    def write(self, row: Any, record: dict[str, Any], notes: list[str]) -> None:
        self.seen_ids[record["id"]] = row.index
        self.data_fh.write(_dump(record) + "\n")
        self.stats.rows_written += 1
        if notes:
            self.stats.repaired += 1
            if len(self.repairs) < _MAX_LISTED_REPAIRS:
                self.repairs.extend({"row": row.index, "id": record["id"], "note": note} for note in notes)


def _publish(staging: Path, output: str, out_s3: bool) -> None:
    """Replace the output's three files with the staged ones (only called for a successful preparation).

    ``FAILED`` ("publication in progress") is written first and removed last, so a publication cut short
    leaves the output marked unusable. On S3 the files are uploaded to a staging prefix first and then
    copied server-side: a failed upload leaves the earlier files untouched.
    """
    names = (DATA_FILE, REJECTS_FILE, STATS_FILE)  # stats.json last
    marker = storage.join(output, FAILED_MARKER)
    note = (f"prepare-data: publication in progress since {_now()}; if this file stays, the publication was "
            "interrupted: run prepare-data again\n")
    if out_s3:
        staged = storage.join(output, STAGING_PREFIX.rstrip("-") + "-" + uuid.uuid4().hex[:12])
        try:
            for name in names:
                storage.upload_file(str(staging / name), storage.join(staged, name))
            storage.write_text(marker, note)
            for name in names:
                storage.copy_file(storage.join(staged, name), storage.join(output, name))
        finally:
            storage.delete_dir(staged)
    else:
        out_dir = Path(output).expanduser()
        storage.write_text(str(out_dir / FAILED_MARKER), note)
        for name in names:
            os.replace(staging / name, out_dir / name)
    storage.delete_dir(storage.join(output, FAILED_DIR))
    storage.delete_file(marker)


def _mark_failed(output: str, error: str, staging: Path | None) -> None:
    """Write the ``FAILED`` marker (first: from then on the output is unusable), then the failed attempt's
    rejects.jsonl and stats.json (when there are some) to ``failed/``; the published files stay as they were."""
    failed_dir = storage.join(output, FAILED_DIR)
    text = (f"prepare-data failed at {_now()}: {error}\n"
            f"The failed attempt's reports: {storage.join(failed_dir, STATS_FILE)}, "
            f"{storage.join(failed_dir, REJECTS_FILE)}. The data.jsonl / stats.json next to this file, if any, are "
            "from an earlier successful preparation and are not used while this file exists; run prepare-data "
            "again (or delete this file to use the earlier data as it is).\n")
    try:
        storage.write_text(storage.join(output, FAILED_MARKER), text)
        storage.delete_dir(failed_dir)
        if staging is not None:
            for name in (REJECTS_FILE, STATS_FILE):
                if (staging / name).is_file():
                    storage.upload_file(str(staging / name), storage.join(failed_dir, name))
    except storage.StorageError as err:
        log.error("could not mark %s as failed: %s", output, err)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
