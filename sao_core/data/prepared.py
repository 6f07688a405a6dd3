"""Open a dataset written by ``sao prepare-data``: the one reader every consumer uses.

:func:`open_prepared` is what the trainers (``sao train``), the RL learner (``sao train-rl``), the rollout
service's plans and the evaluator call to read a prepared folder (or ``s3://`` prefix, or its
``data.jsonl``). It refuses, naming the folder, a dataset that must not be used:

- a ``FAILED`` marker is present (its last preparation failed, or its publication was cut short; the
  marker's first line says why);
- ``stats.json`` says ``"status": "failed"`` (written by an older version that published failed data);
- ``data.jsonl`` is missing, holds a line that is not a JSON object, or holds no rows;
- ``data.jsonl`` does not hold the ``rows_written`` rows ``stats.json`` records (a partial copy).

A ``data.jsonl`` without ``stats.json`` (written by hand) is read, with ``kind`` None.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sao_core import storage
from sao_core.data.prepare import DATA_FILE, FAILED_MARKER, STATS_FILE
from sao_core.data.schemas import DataError


class PreparedDataError(DataError):
    """A prepared dataset cannot be used; the message names the folder and says what to do."""


@dataclass
class PreparedDataset:
    folder: str                    # the prepared folder or s3:// prefix
    data_uri: str                  # its data.jsonl
    rows: list[dict[str, Any]]     # the records, in file order
    stats: dict[str, Any] | None   # stats.json, None when there is none
    kind: str | None               # the kind it was prepared with (from stats.json), None when unknown


def locate(data: str) -> tuple[str, str]:
    """``(folder, data.jsonl URI)`` of a prepared folder, ``s3://`` prefix or ``data.jsonl`` path."""
    data = str(data)
    if data.endswith(".jsonl"):
        folder = data.rsplit("/", 1)[0] if "/" in data else "."
        return folder, data
    return data.rstrip("/") or data, storage.join(data, DATA_FILE)


def failure_of(folder: str, settings: storage.S3Settings | None = None) -> str | None:
    """The first line of ``folder``'s ``FAILED`` marker (why it is unusable), or None when there is none."""
    marker = storage.join(folder, FAILED_MARKER)
    if not storage.exists(marker, settings):
        return None
    try:
        text = storage.read_text(marker, settings).strip()
    except storage.StorageError as err:
        text = f"(unreadable marker: {err})"
    return text.splitlines()[0] if text else "(empty marker)"


def open_prepared(data: str, settings: storage.S3Settings | None = None) -> PreparedDataset:
    """Read a prepared dataset after checking it is usable (see the module docstring).

    Raises :class:`PreparedDataError` naming the folder (and the file and line where one is at fault).
    """
    if "\x00" in str(data):  # os calls would raise a bare ValueError ("embedded null byte")
        raise PreparedDataError(f"cannot read the dataset {str(data)!r}: the path holds a NUL byte")
    folder, uri = locate(data)
    try:
        reason = failure_of(folder, settings)
    except storage.StorageError as err:
        raise PreparedDataError(f"cannot read the dataset {folder}: {err}") from err
    if reason is not None:
        raise PreparedDataError(
            f"dataset {folder} is unusable: it has a {FAILED_MARKER} marker ({storage.join(folder, FAILED_MARKER)}): "
            f"{reason}. Fix the source and run prepare-data into {folder} again")
    stats_uri = storage.join(folder, STATS_FILE)
    stats = None
    try:
        if storage.exists(stats_uri, settings):
            stats = json.loads(storage.read_text(stats_uri, settings))
        text = storage.read_text(uri, settings)
    except ValueError as err:
        raise PreparedDataError(f"dataset {folder}: {stats_uri} is not JSON ({err}); was it written by "
                                "sao prepare-data? Run prepare-data again") from err
    except storage.StorageError as err:
        raise PreparedDataError(f"cannot read the dataset {folder}: {err}") from err
    if stats is not None and not isinstance(stats, dict):
        raise PreparedDataError(f"dataset {folder}: {stats_uri} is not a JSON object; run prepare-data again")
    if stats is not None and stats.get("status", "ok") != "ok":
        raise PreparedDataError(
            f"dataset {folder} is unusable: its {STATS_FILE} says status {stats.get('status')!r}"
            f"{': ' + str(stats['error']) if stats.get('error') else ''}. Fix the source and run prepare-data again")
    rows: list[dict[str, Any]] = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise PreparedDataError(f"dataset {folder}: {uri} line {line_no} is not JSON ({err.msg}); was it "
                                    "written by sao prepare-data?") from err
        if not isinstance(row, dict):
            raise PreparedDataError(f"dataset {folder}: {uri} line {line_no} is not a JSON object; was it "
                                    "written by sao prepare-data?")
        rows.append(row)
    if not rows:
        raise PreparedDataError(f"dataset {folder} is unusable: {uri} holds no rows")
    expected = stats.get("rows_written") if stats is not None else None
    if isinstance(expected, int) and not isinstance(expected, bool) and expected != len(rows):
        raise PreparedDataError(
            f"dataset {folder} is unusable: {uri} holds {len(rows)} rows but {stats_uri} says {expected} were "
            "written (a partial or changed copy); run prepare-data again")
    kind = stats.get("kind") if stats is not None else None
    return PreparedDataset(folder=folder, data_uri=uri, rows=rows, stats=stats,
                           kind=kind if isinstance(kind, str) else None)
