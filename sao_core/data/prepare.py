"""Data preparation: read a source, normalise each row for its kind, write the result.

:func:`prepare` writes three files to ``config.output`` (a local folder or an ``s3://`` prefix):

- ``data.jsonl``: one normalised record per line (schemas in :mod:`sao_core.data.schemas`), each
  with a stable ``"id"``;
- ``rejects.jsonl``: one line per row that was not written, ``{"file", "row", "line", "field",
  "reason", "detail"}``. ``row`` is the 0-based data row (for CSV the header is not counted; blank
  JSON lines are not counted), ``line`` the 1-based physical line where the row starts (JSON lines
  and CSV only, else null), ``field`` a path such as ``messages[2].role`` (null for the whole row);
- ``stats.json``: :class:`PrepareStats` as JSON, plus the configuration.

Exact duplicates (same normalised record apart from its id) are dropped when ``dedup`` is on;
they go to ``rejects.jsonl`` with reason ``duplicate`` but are counted in ``duplicates``, not in
``rows_rejected``: ``rows_read = rows_written + rows_rejected + duplicates``.

When ``rows_rejected / rows_read`` exceeds ``max_reject_fraction`` all three files are still
written (``stats.json`` says ``"status": "failed"``) and :class:`DataError` is raised.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
import time
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
PROGRESS_EVERY = 1000
_MAX_LISTED_REPAIRS = 100


@dataclass
class PrepareConfig:
    source: str
    kind: str
    output: str
    split: str = "train"
    max_reject_fraction: float = 0.05
    tokenizer: str | None = None
    max_tokens: int | None = None
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


def _token_counter(config: PrepareConfig) -> Callable[[str | list[dict]], int] | None:
    if config.max_tokens is None or not config.tokenizer:
        return None
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(config.tokenizer)
    except Exception as exc:
        raise DataError(
            f"cannot load tokenizer from {config.tokenizer}: {type(exc).__name__}: {exc}"
        ) from exc

    def ids_len(encoded: Any) -> int:
        if hasattr(encoded, "keys") and "input_ids" in encoded:
            encoded = encoded["input_ids"]
        return len(encoded)

    def plain(messages: list[dict]) -> str:
        parts = []
        for m in messages:
            calls = "".join(
                json.dumps(c, ensure_ascii=False, sort_keys=True) for c in m.get("tool_calls", ())
            )
            parts.append(f"{m['role']}: {m['content']}{calls}")
        return "\n".join(parts)

    def count(item: str | list[dict]) -> int:
        if isinstance(item, str):
            return ids_len(tok(item)["input_ids"])
        if getattr(tok, "chat_template", None):
            try:
                return ids_len(tok.apply_chat_template(item, tokenize=True))
            except Exception:  # a template that cannot render this conversation (e.g. tool calls)
                pass
        return ids_len(tok(plain(item))["input_ids"])

    return count


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, default=str)


def _summary(stats: PrepareStats, frac: float, first: dict[str, Any] | None) -> str:
    top = Counter(stats.rejected_by_reason).most_common(5)
    reasons = ", ".join(f"{reason} {n}" for reason, n in top) or "none"
    where = ""
    if first is not None:
        line = f" (line {first['line']})" if first.get("line") is not None else ""
        where = f"; first: row {first['row']}{line} field {first['field']!r}: {first['reason']}: {first['detail']}"
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
    count_tokens = _token_counter(config)
    out_s3 = storage.is_s3_uri(config.output)
    stats = PrepareStats(source=config.source, kind=config.kind, output=config.output)
    stats.files = {
        key: storage.join(config.output, name)
        for key, name in (("data", DATA_FILE), ("rejects", REJECTS_FILE), ("stats", STATS_FILE))
    }

    with iter_rows(config.source, config.split) as rows:  # opened first: a bad source leaves no output
        stats.dataset_version = rows.version
        if out_s3:
            staging = Path(tempfile.mkdtemp(prefix="sao-prepare-"))
        else:
            out_dir = Path(config.output).expanduser()
            if out_dir.exists() and not out_dir.is_dir():
                raise DataError(f"output {config.output} exists and is not a folder")
            out_dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir))
        try:
            first_reject, repairs = _run(config, rows, normalize, count_tokens, stats, staging, progress)
            frac = float(config.max_reject_fraction)
            if stats.rows_read == 0:
                stats.status, stats.error = "failed", f"no rows read from {config.source}"
            elif stats.rows_rejected / stats.rows_read > frac:
                stats.status, stats.error = "failed", _summary(stats, frac, first_reject)
            stats.seconds = round(time.monotonic() - started, 3)
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
            _publish(staging, config.output, out_s3)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    log.info(
        "prepared %s as %s: %d read, %d written, %d rejected, %d duplicates -> %s",
        config.source,
        config.kind,
        stats.rows_read,
        stats.rows_written,
        stats.rows_rejected,
        stats.duplicates,
        config.output,
    )
    if stats.status != "ok":
        raise DataError(stats.error)
    return stats


def _run(
    config: PrepareConfig,
    rows: Any,
    normalize: Callable[..., dict[str, Any]],
    count_tokens: Callable[[str | list[dict]], int] | None,
    stats: PrepareStats,
    staging: Path,
    progress: Callable[[int], None] | None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    seen_content: dict[str, int] = {}
    seen_ids: dict[str, int] = {}
    reasons: Counter[str] = Counter()
    first_reject: dict[str, Any] | None = None
    repairs: list[dict[str, Any]] = []

    with (
        open(staging / DATA_FILE, "w", encoding="utf-8") as data_fh,
        open(staging / REJECTS_FILE, "w", encoding="utf-8") as rej_fh,
    ):

        def reject(row: Any, fld: str | None, reason: str, detail: str) -> None:
            nonlocal first_reject
            entry = {
                "file": rows.name,
                "row": row.index,
                "line": row.line,
                "field": fld,
                "reason": reason,
                "detail": detail,
            }
            rej_fh.write(_dump(entry) + "\n")
            if reason == schemas.DUPLICATE:
                stats.duplicates += 1
                return
            stats.rows_rejected += 1
            reasons[reason] += 1
            if first_reject is None:
                first_reject = entry

        for row in rows:
            if config.limit is not None and stats.rows_read >= config.limit:
                break
            stats.rows_read += 1
            if progress is not None and stats.rows_read % PROGRESS_EVERY == 0:
                progress(stats.rows_read)
            if isinstance(row.value, RowReadError):
                reject(row, row.value.field, row.value.reason, row.value.detail)
                continue
            notes: list[str] = []
            try:
                record = normalize(row.value, notes)
            except RowError as err:
                reject(row, err.field, err.reason, err.detail)
                continue
            if count_tokens is not None:
                too_long = None
                for fld, item in schemas.model_texts(config.kind, record):
                    n = count_tokens(item)
                    if n > config.max_tokens:
                        too_long = (fld, n)
                        break
                if too_long is not None:
                    reject(
                        row, too_long[0], "too_long", f"{too_long[1]} tokens > max_tokens {config.max_tokens}"
                    )
                    continue
            if config.dedup:
                digest = schemas.content_hash(record)
                if digest in seen_content:
                    reject(
                        row,
                        None,
                        schemas.DUPLICATE,
                        f"same record as data row {seen_content[digest]} (id {record['id']!r})",
                    )
                    continue
                seen_content[digest] = row.index
            if (
                record["id"] in seen_ids
                and not config.dedup
                and record["id"] == schemas.make_id(config.kind, record)
            ):
                # duplicates kept on purpose share their content-hash id: number the copies
                n = 1
                while f"{record['id']}-{n}" in seen_ids:
                    n += 1
                record = {**record, "id": f"{record['id']}-{n}"}
            if record["id"] in seen_ids:
                reject(
                    row,
                    "id",
                    "duplicate_id",
                    f"id {record['id']!r} already used by data row {seen_ids[record['id']]} with different content",
                )
                continue
            seen_ids[record["id"]] = row.index
            data_fh.write(_dump(record) + "\n")
            stats.rows_written += 1
            if notes:
                stats.repaired += 1
                if len(repairs) < _MAX_LISTED_REPAIRS:
                    repairs.extend({"row": row.index, "id": record["id"], "note": note} for note in notes)
    stats.rejected_by_reason = dict(reasons.most_common())
    if progress is not None:
        progress(stats.rows_read)
    return first_reject, repairs


def _publish(staging: Path, output: str, out_s3: bool) -> None:
    names = (DATA_FILE, REJECTS_FILE, STATS_FILE)
    if out_s3:

        for name in names:
            storage.upload_file(str(staging / name), storage.join(output, name))
        return
    out_dir = Path(output).expanduser()
    for name in names:
        os.replace(staging / name, out_dir / name)
