"""Row readers: local files, ``s3://`` objects and Hugging Face datasets, one dict per row.

:func:`iter_rows` opens a source and returns a :class:`RowSource`: iterate it for :class:`Row`
tuples ``(index, value, line)`` where ``value`` is the row's ``dict`` or a :class:`RowReadError`
for a row that could not be read (a malformed JSON line, a CSV record with too many fields). A
source that cannot be read at all raises :class:`~sao_core.data.schemas.DataError`.

Row numbering: ``index`` is the 0-based data row (blank lines and, for CSV, the header are not
counted); ``line`` is the 1-based physical line where the row starts (JSON lines and CSV; a CSV
record may span several lines), ``None`` for other formats.

Supported sources:

- local ``.jsonl``/``.ndjson`` (one JSON object per line), ``.json`` (an array of objects, or JSON
  lines), ``.csv`` (UTF-8, header row; an empty cell reads as null), ``.parquet``;
- ``s3://bucket/key.<ext>`` with one of those extensions (downloaded to a temporary folder);
- a folder written by ``datasets.Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``;
- a Hugging Face dataset id, ``org/name`` or ``hf://org/name`` (``datasets.load_dataset``).
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from sao_core import storage
from sao_core.closing import close_on_error
from sao_core.data.schemas import DataError

EXTENSIONS: dict[str, str] = {
    ".jsonl": "jsonl",
    ".ndjson": "jsonl",
    ".json": "json",
    ".csv": "csv",
    ".parquet": "parquet",
}
_HF_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_CSV_FIELD_LIMIT = 2**31 - 1  # SWE-bench patches exceed csv's default 128 KiB field limit


class RowReadError(ValueError):
    """A row that could not be read; ``reason`` is one of the rejection reasons."""

    def __init__(self, reason: str, detail: str, field: str | None = None):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail
        self.field = field


class Row(NamedTuple):
    index: int
    value: dict[str, Any] | RowReadError
    line: int | None = None


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _supported() -> str:
    return ", ".join(EXTENSIONS)


def _is_saved_dataset(path: Path) -> bool:
    return any((path / name).is_file() for name in ("dataset_info.json", "state.json", "dataset_dict.json"))


def _hf_id(source: str) -> str | None:
    """The Hugging Face id named by ``source``, or None when it names a file."""
    if source.startswith("hf://"):
        rest = source[len("hf://") :].strip("/")
        return rest[len("datasets/") :] if rest.startswith("datasets/") else rest
    if _HF_ID.fullmatch(source) and Path(source).suffix.lower() not in EXTENSIONS:
        return source
    return None


class RowSource:
    """An opened source. Iterate for :class:`Row`; ``name`` is the source as given (used in reject
    reports), ``format`` one of jsonl/json/csv/parquet/hf, ``version`` a fingerprint of the data
    (``sha256:<hex>`` of a file, ``<id>@<fingerprint>`` of a Hugging Face dataset)."""

    def __init__(self, source: str, split: str = "train"):
        self.name = source
        self.split = split
        self.format = ""
        self.version = ""
        self.path: Path | None = None
        self._dataset: Any = None
        self._tmp: str | None = None
        with close_on_error(self):
            self._open(source, split)

    # -- opening ---------------------------------------------------------------------------

    def _open(self, source: str, split: str) -> None:
        if not isinstance(source, str) or not source.strip():
            raise DataError(
                "data source is empty: give a file path, an s3:// URI or a Hugging Face dataset id"
            )
        if storage.is_s3_uri(source):
            self._open_s3(source)
            return
        hf_id = _hf_id(source)
        if source.startswith("hf://"):
            self._open_hf(hf_id or "", split)
            return
        path = Path(source).expanduser()
        if path.is_dir():
            if not _is_saved_dataset(path):
                raise DataError(
                    f"data source {source} is a folder but not a saved dataset (no dataset_info.json, state.json "
                    f"or dataset_dict.json); give a file ({_supported()}) or a save_to_disk folder"
                )
            self._open_disk(path, split)
            return
        if path.is_file():
            self._open_file(path, source)
            return
        if hf_id is not None:
            self._open_hf(hf_id, split)
            return
        raise DataError(f"data file not found: {source}")

    def _open_file(self, path: Path, shown: str) -> None:
        fmt = EXTENSIONS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(
                f"unsupported data file extension {path.suffix or '(none)'!r} for {shown}; supported: {_supported()}"
            )
        self.path, self.format = path, fmt
        try:
            self.version = _sha256_file(path)
        except OSError as exc:
            raise DataError(f"cannot read data file {shown}: {exc}") from exc
        if fmt == "parquet":
            self._parquet_file().close()  # fail now, not mid-way, on a file that is not parquet
        elif fmt == "csv":
            self._check_csv()

    def _open_s3(self, uri: str) -> None:

        key_name = uri.rstrip("/").rsplit("/", 1)[-1]
        suffix = Path(key_name).suffix.lower()
        if suffix not in EXTENSIONS:
            raise DataError(
                f"unsupported data file extension {suffix or '(none)'!r} for {uri}; supported: {_supported()} "
                "(an s3 source must name one object, not a prefix)"
            )
        self._tmp = tempfile.mkdtemp(prefix="sao-data-")
        local = Path(self._tmp) / key_name
        try:
            storage.download_file(uri, str(local))
        except storage.StorageError as exc:
            raise DataError(f"cannot read data source {uri}: {exc}") from exc
        self._open_file(local, uri)

    def _open_hf(self, dataset_id: str, split: str) -> None:
        if not _HF_ID.fullmatch(dataset_id):
            raise DataError(
                f"not a Hugging Face dataset id: {self.name!r} (expected 'org/name' or 'hf://org/name')"
            )
        import datasets

        try:
            ds = datasets.load_dataset(dataset_id, split=split)
        except Exception as exc:  # the hub raises many types (ConnectionError, DatasetNotFoundError, ...)
            raise DataError(
                f"cannot load Hugging Face dataset {dataset_id!r} (split {split!r}): {type(exc).__name__}: {exc}. "
                f"There is no local file named {self.name!r} either. If this machine is offline, fetch the "
                "data where there is network and pass a local file, a save_to_disk folder or an s3:// URI."
            ) from exc
        self._use_dataset(ds, dataset_id)

    def _open_disk(self, path: Path, split: str) -> None:
        import datasets

        try:
            ds = datasets.load_from_disk(str(path))
        except Exception as exc:
            raise DataError(f"cannot load saved dataset {self.name}: {type(exc).__name__}: {exc}") from exc
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"saved dataset {self.name} has no split {split!r}; splits: {', '.join(ds)}")
            ds = ds[split]
        self._use_dataset(ds, str(path))

    def _use_dataset(self, ds: Any, label: str) -> None:
        if not hasattr(ds, "__iter__") or not hasattr(ds, "column_names"):
            raise DataError(f"{self.name} did not load as one table (got {type(ds).__name__})")
        self._dataset, self.format = ds, "hf"
        fingerprint = getattr(ds, "_fingerprint", None) or "unknown"
        self.version = f"{label}@{fingerprint}"

    # -- reading ---------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Row]:
        readers = {
            "jsonl": self._rows_jsonl,
            "json": self._rows_json,
            "csv": self._rows_csv,
            "parquet": self._rows_parquet,
            "hf": self._rows_dataset,
        }
        return readers[self.format]()

    def _rows_jsonl(self) -> Iterator[Row]:
        assert self.path is not None
        index = 0
        with open(self.path, "rb") as fh:
            for line_no, raw in enumerate(fh, start=1):
                if not raw.strip():
                    continue
                yield Row(index, _parse_json_line(raw), line_no)
                index += 1

    def _rows_json(self) -> Iterator[Row]:
        assert self.path is not None
        try:
            text = self.path.read_text(encoding="utf-8-sig")
        except UnicodeDecodeError as exc:
            raise DataError(f"data file {self.name} is not UTF-8 text: {exc}") from exc
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            if exc.msg == "Extra data":  # several JSON values: read it as JSON lines
                yield from self._rows_jsonl()
                return
            raise DataError(f"data file {self.name} is not valid JSON: {exc}") from exc
        if isinstance(data, dict):  # a file holding one object is one row
            yield Row(0, data)
            return
        if not isinstance(data, list):
            raise DataError(
                f"data file {self.name} holds a JSON {type(data).__name__}; expected an array of objects"
            )
        for index, item in enumerate(data):
            if isinstance(item, dict):
                yield Row(index, item)
            else:
                yield Row(
                    index,
                    RowReadError("wrong_type", f"array element is a {type(item).__name__}, not an object"),
                )

    def _rows_csv(self) -> Iterator[Row]:
        assert self.path is not None
        old_limit = csv.field_size_limit()
        csv.field_size_limit(max(old_limit, _CSV_FIELD_LIMIT))
        try:
            with open(self.path, encoding="utf-8-sig", newline="") as fh:
                reader = csv.reader(fh)
                try:
                    header = self._csv_header(reader)
                    index, end_line = 0, reader.line_num
                    for record in reader:
                        start_line, end_line = end_line + 1, reader.line_num
                        if not record:
                            continue
                        if len(record) > len(header):
                            value: dict[str, Any] | RowReadError = RowReadError(
                                "bad_csv",
                                f"{len(record)} fields, the header has {len(header)} (an unquoted comma?)",
                            )
                        else:  # a short record leaves its last columns absent
                            value = {
                                h: (v if v != "" else None) for h, v in zip(header, record, strict=False)
                            }
                        yield Row(index, value, start_line)
                        index += 1
                except UnicodeDecodeError as exc:
                    raise DataError(
                        f"CSV file {self.name} is not UTF-8 text (near line {reader.line_num + 1}): {exc}"
                    ) from exc
                except csv.Error as exc:
                    raise DataError(
                        f"cannot parse CSV file {self.name} at line {reader.line_num}: {exc}"
                    ) from exc
        finally:
            csv.field_size_limit(old_limit)

    def _csv_header(self, reader: Any) -> list[str]:
        header = next(reader, None)
        if not header or not any(h.strip() for h in header):
            raise DataError(f"CSV file {self.name} is empty or has no header row")
        header = [h.strip() for h in header]
        dupes = sorted({h for h in header if header.count(h) > 1})
        if dupes:
            raise DataError(f"CSV file {self.name} repeats header column(s): {', '.join(dupes)}")
        return header

    def _check_csv(self) -> None:
        assert self.path is not None
        old_limit = csv.field_size_limit()
        csv.field_size_limit(max(old_limit, _CSV_FIELD_LIMIT))
        try:
            with open(self.path, encoding="utf-8-sig", newline="") as fh:
                self._csv_header(csv.reader(fh))
        except (UnicodeDecodeError, csv.Error) as exc:
            raise DataError(f"cannot read the header of CSV file {self.name}: {exc}") from exc
        finally:
            csv.field_size_limit(old_limit)

    def _parquet_file(self) -> Any:
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except Exception as exc:  # pyarrow raises ArrowInvalid / OSError for a damaged file
            raise DataError(f"cannot read parquet file {self.name}: {type(exc).__name__}: {exc}") from exc

    def _rows_parquet(self) -> Iterator[Row]:
        pf = self._parquet_file()
        index = 0
        try:
            for batch in pf.iter_batches(batch_size=1024):
                for item in batch.to_pylist():
                    yield Row(index, item)
                    index += 1
        except DataError:
            raise
        except Exception as exc:
            raise DataError(
                f"cannot read parquet file {self.name} after row {index}: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            pf.close()

    def _rows_dataset(self) -> Iterator[Row]:
        for index, item in enumerate(self._dataset):
            yield Row(index, dict(item))

    # -- cleanup ---------------------------------------------------------------------------

    def close(self) -> None:
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> RowSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse_json_line(raw: bytes) -> dict[str, Any] | RowReadError:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        return RowReadError("bad_json", f"line is not UTF-8: {exc}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return RowReadError("bad_json", f"{exc.msg} at column {exc.colno}: {text.strip()[:80]!r}")
    if not isinstance(value, dict):
        return RowReadError("wrong_type", f"line holds a JSON {type(value).__name__}, not an object")
    return value


def iter_rows(source: str, split: str = "train") -> RowSource:
    """Open ``source`` and return its rows (see the module docstring). Use as a context manager
    (``with iter_rows(src) as rows: for row in rows: ...``) so a downloaded s3 copy is removed."""
    return RowSource(source, split)


__all__ = ["EXTENSIONS", "Row", "RowReadError", "RowSource", "iter_rows"]
