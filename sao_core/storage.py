"""Storage for local paths and ``s3://`` URIs, plus atomic checkpoint publishing.

Every function accepts a plain local path, a ``file://`` URI or an ``s3://bucket/key`` URI. S3 goes
through boto3; this module never reads environment variables itself, so the endpoint and credentials
come from :class:`S3Settings` or from boto3's own resolution (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, config files, ...).

Checkpoint layout (a local directory or an S3 prefix)::

    <files...>       written first
    manifest.json    {"format": 1, "files": {relpath: {"sha256", "size"}}, "created_unix", "metadata"}
    _COMPLETE        written last; readers ignore a checkpoint without it

`verify_checkpoint` checks every listed file's sha256 and size and refuses a file the manifest does not list.

Every failure raises :class:`StorageError` (or :class:`CheckpointError`) with a message that names
the URI and says what to do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import pathlib
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

try:
    import boto3
    from boto3.exceptions import S3UploadFailedError
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    from botocore.exceptions import (
        BotoCoreError,
        ClientError,
        ConnectTimeoutError,
        EndpointConnectionError,
        NoCredentialsError,
        ReadTimeoutError,
    )
except ImportError:  # local paths need no S3 client (e.g. the GPU check kit's bare environment); s3:// does
    boto3 = None

    class _NoBoto(Exception):
        """Never raised: stands in for botocore's exception types when boto3 is not installed."""

    S3UploadFailedError = BotoCoreError = ClientError = ConnectTimeoutError = _NoBoto
    EndpointConnectionError = NoCredentialsError = ReadTimeoutError = _NoBoto
    TransferConfig = Config = None

MANIFEST_NAME = "manifest.json"
COMPLETE_MARKER = "_COMPLETE"
_MANIFEST_FORMAT = 1
_DIR_WORKERS = 8  # files transferred concurrently by upload_dir / download_dir / fetch_checkpoint
_CREDENTIAL_CODES = {"InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "403",
                     "InvalidToken", "ExpiredToken", "InvalidClientTokenId"}
_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SCHEME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")

PathLike = str | os.PathLike[str]
log = logging.getLogger(__name__)


class StorageError(RuntimeError):
    """Any storage failure; the message says what failed, on which URI, and what to do."""


class CheckpointError(StorageError):
    """A checkpoint is incomplete or corrupt; the message names the offending file."""


@dataclass(frozen=True)
class S3Settings:
    """How to reach S3. ``endpoint_url=None`` uses boto3's resolution (``AWS_ENDPOINT_URL`` etc.)."""

    endpoint_url: str | None = None
    connect_timeout_s: float = 5.0  # seconds to open a TCP connection
    read_timeout_s: float = 60.0  # seconds to wait for data on an open connection
    max_attempts: int = 3  # total attempts per request (botocore 'standard' retry mode)
    multipart_threshold_bytes: int = 64 * 2**20  # files at least this large upload in parts
    multipart_chunk_bytes: int = 16 * 2**20  # size of each part, bytes


# ---------------------------------------------------------------------------------------------- URIs


def is_s3_uri(uri: str) -> bool:
    """True if ``uri`` starts with ``s3://``."""
    return isinstance(uri, str) and uri.startswith("s3://")


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into ``(bucket, key)``; the key may be ``""`` (bucket root)."""
    if not is_s3_uri(uri):
        raise StorageError(f"not an S3 URI: {uri!r}; expected the form s3://bucket/key")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise StorageError(f"S3 URI has no bucket: {uri!r}; expected the form s3://bucket/key")
    if not _BUCKET_RE.match(bucket) or ".." in bucket or re.fullmatch(r"[\d.]+", bucket):
        raise StorageError(
            f"invalid S3 bucket name {bucket!r} in {uri!r}; bucket names are 3-63 characters of "
            "lowercase letters, digits, '.' and '-', starting and ending with a letter or digit"
        )
    return bucket, key


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or URI with ``/``; leading/trailing slashes of parts are dropped."""
    clean = [p.strip("/") for p in parts if p.strip("/")]
    if not clean:
        return str(uri)
    return str(uri).rstrip("/") + "/" + "/".join(clean)


def _local_path(uri: PathLike) -> pathlib.Path:
    """A plain path or ``file://`` URI as a Path; any other scheme is an error."""
    text = os.fspath(uri)
    if text.startswith("file://"):
        parts = urlsplit(text)
        if parts.netloc not in ("", "localhost"):
            raise StorageError(f"file URI with a remote host is not supported: {text!r}; use file:///path")
        return pathlib.Path(unquote(parts.path))
    if _SCHEME_RE.match(text):
        raise StorageError(f"unsupported URI scheme in {text!r}; use a local path, file:// or s3://")
    return pathlib.Path(text)


# ------------------------------------------------------------------------------------------ S3 plumbing

_CLIENTS: dict[S3Settings, Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _clear_client_cache() -> None:
    """Forget cached boto3 clients (tests call this after changing AWS_* environment variables)."""
    with _CLIENTS_LOCK:
        _CLIENTS.clear()


def _client(settings: S3Settings | None) -> Any:
    """A cached boto3 S3 client for ``settings``; S3-compatible servers get path-style addressing."""
    if boto3 is None:
        raise StorageError("s3:// URIs need boto3, which is not installed: pip install boto3")
    settings = settings or S3Settings()
    with _CLIENTS_LOCK:
        client = _CLIENTS.get(settings)
        if client is None:
            config = Config(
                connect_timeout=settings.connect_timeout_s,
                read_timeout=settings.read_timeout_s,
                retries={"max_attempts": settings.max_attempts, "mode": "standard"},
            )
            session = boto3.session.Session()
            client = session.client("s3", endpoint_url=settings.endpoint_url, config=config)
            host = urlsplit(client.meta.endpoint_url).hostname or ""
            if not host.endswith(".amazonaws.com"):  # MinIO, SeaweedFS, Ceph: no bucket DNS names
                config = config.merge(Config(s3={"addressing_style": "path"}))
                client = session.client("s3", endpoint_url=client.meta.endpoint_url, config=config)
            _CLIENTS[settings] = client
        return client


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _bucket_missing(client: Any, bucket: str) -> bool:
    """True if a HEAD on the bucket says 404 (used to explain a bare 404 from HEAD object)."""
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError as exc:
        return _error_code(exc) in ("404", "NoSuchBucket")
    except BotoCoreError:
        return False
    return False


def _translate(exc: BaseException, client: Any, uri: str, action: str) -> StorageError:
    """Turn a boto3/botocore exception into a StorageError that says what to do."""
    endpoint = client.meta.endpoint_url
    if isinstance(exc, S3UploadFailedError) and isinstance(exc.__cause__ or exc.__context__, Exception):
        exc = exc.__cause__ or exc.__context__  # type: ignore[assignment]
    bucket = uri[len("s3://"):].partition("/")[0]
    if isinstance(exc, EndpointConnectionError | ConnectTimeoutError):
        return StorageError(
            f"S3 endpoint {endpoint} is unreachable while {action} {uri} ({exc}); check the endpoint "
            "URL (S3Settings.endpoint_url or AWS_ENDPOINT_URL) and that the server is running"
        )
    if isinstance(exc, ReadTimeoutError):
        return StorageError(f"S3 endpoint {endpoint} timed out while {action} {uri}; retry or raise "
                            "S3Settings.read_timeout_s")
    if isinstance(exc, NoCredentialsError):
        return StorageError(f"no S3 credentials found while {action} {uri}; set AWS_ACCESS_KEY_ID and "
                            "AWS_SECRET_ACCESS_KEY (e.g. from a Kubernetes secret)")
    if isinstance(exc, ClientError):
        code = _error_code(exc)
        message = exc.response.get("Error", {}).get("Message", "")
        if code in _CREDENTIAL_CODES:
            return StorageError(
                f"S3 credentials were rejected for bucket '{bucket}' at {endpoint} while {action} {uri} "
                f"({code}: {message}); check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's "
                "access policy"
            )
        if code == "NoSuchBucket" or (code in ("404", "NotFound") and _bucket_missing(client, bucket)):
            return StorageError(f"S3 bucket '{bucket}' does not exist at {endpoint} (while {action} {uri}); "
                                "create it or fix the URI")
        if code in ("NoSuchKey", "404", "NotFound"):
            return StorageError(f"not found: {uri} (at {endpoint})")
        return StorageError(f"S3 error while {action} {uri} at {endpoint}: {code}: {message}")
    return StorageError(f"S3 failure while {action} {uri} at {endpoint}: {exc}")


@contextmanager
def _s3(uri: str, settings: S3Settings | None, action: str) -> Iterator[tuple[Any, str, str]]:
    """Yield ``(client, bucket, key)`` for ``uri`` and translate any S3 failure into StorageError."""
    bucket, key = parse_s3_uri(uri)
    client = _client(settings)
    try:
        yield client, bucket, key
    except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
        raise _translate(exc, client, uri, action) from exc


def _object_key(uri: str, key: str) -> str:
    if not key or key.endswith("/"):
        raise StorageError(f"{uri} names an S3 prefix, not an object; add a file name")
    return key


@contextmanager
def _local_errors(path: PathLike, action: str) -> Iterator[None]:
    try:
        yield
    except FileNotFoundError as exc:
        raise StorageError(f"not found: {exc.filename or path} (while {action})") from exc
    except OSError as exc:
        raise StorageError(f"local I/O error while {action} {path}: {exc}") from exc


def _atomic_write_local(path: pathlib.Path, write: Callable[[pathlib.Path], None]) -> None:
    """Create parent dirs, let ``write`` fill a temp file next to ``path``, then rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")  # normal umask permissions
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# ------------------------------------------------------------------------------------ files and dirs


def exists(uri: str, settings: S3Settings | None = None) -> bool:
    """True if a file/directory (local) or an object or non-empty prefix (S3) exists at ``uri``."""
    if not is_s3_uri(uri):
        path = _local_path(uri)
        with _local_errors(path, "checking"):   # e.g. a name too long for the file system: an error, not a 500
            return path.exists()
    with _s3(uri, settings, "checking") as (client, bucket, key):
        try:
            if not key:
                client.head_bucket(Bucket=bucket)
                return True
            client.head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as exc:
            if _error_code(exc) not in ("404", "NotFound", "NoSuchKey", "NoSuchBucket"):
                raise
            if not key:
                return False
        try:
            page = client.list_objects_v2(Bucket=bucket, Prefix=key.rstrip("/") + "/", MaxKeys=1)
        except ClientError as exc:
            if _error_code(exc) == "NoSuchBucket":
                return False
            raise
        return page.get("KeyCount", 0) > 0


def read_bytes(uri: str, settings: S3Settings | None = None) -> bytes:
    """The whole content of one file/object."""
    if not is_s3_uri(uri):
        with _local_errors(uri, "reading"):
            return _local_path(uri).read_bytes()
    with _s3(uri, settings, "reading") as (client, bucket, key):
        return client.get_object(Bucket=bucket, Key=_object_key(uri, key))["Body"].read()


def write_bytes(uri: str, data: bytes, settings: S3Settings | None = None) -> None:
    """Write ``data`` to one file/object (local writes are atomic: temp file + rename)."""
    if not is_s3_uri(uri):
        path = _local_path(uri)
        with _local_errors(uri, "writing"):
            _atomic_write_local(path, lambda tmp: tmp.write_bytes(data))
        return
    with _s3(uri, settings, "writing") as (client, bucket, key):
        client.put_object(Bucket=bucket, Key=_object_key(uri, key), Body=data)


def read_text(uri: str, settings: S3Settings | None = None) -> str:
    """The content of one file/object decoded as UTF-8."""
    data = read_bytes(uri, settings)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise StorageError(f"{uri} is not UTF-8 text ({exc}); read it with read_bytes") from exc


def write_text(uri: str, text: str, settings: S3Settings | None = None) -> None:
    """Write ``text`` as UTF-8 to one file/object."""
    write_bytes(uri, text.encode("utf-8"), settings)


def list_files(uri: str, settings: S3Settings | None = None) -> list[str]:
    """Sorted ``/``-separated relative paths of every file under a directory or S3 prefix.

    A missing local directory or an empty prefix gives ``[]``; a missing bucket is an error.
    """
    if not is_s3_uri(uri):
        root = _local_path(uri)
        if root.is_file():
            raise StorageError(f"{uri} is a file, not a directory; list its parent instead")
        with _local_errors(uri, "listing"):
            return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    with _s3(uri, settings, "listing") as (client, bucket, key):
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        found = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found += [o["Key"][len(prefix):] for o in page.get("Contents", []) if not o["Key"].endswith("/")]
        return sorted(found)


def _transfer_config(settings: S3Settings | None) -> TransferConfig:
    settings = settings or S3Settings()
    return TransferConfig(multipart_threshold=settings.multipart_threshold_bytes,
                          multipart_chunksize=settings.multipart_chunk_bytes)


def upload_file(local_path: PathLike, uri: str, settings: S3Settings | None = None) -> None:
    """Copy a local file to ``uri``; S3 uses boto3's managed transfer (multipart above the threshold)."""
    src = _local_path(local_path)
    if not src.is_file():
        raise StorageError(f"not found: local file {src} (while uploading to {uri})")
    if not is_s3_uri(uri):
        with _local_errors(src, f"copying to {uri}"):
            _atomic_write_local(_local_path(uri), lambda tmp: shutil.copyfile(src, tmp))
        return
    with _s3(uri, settings, "uploading to") as (client, bucket, key):
        client.upload_file(str(src), bucket, _object_key(uri, key), Config=_transfer_config(settings))


def download_file(uri: str, local_path: PathLike, settings: S3Settings | None = None) -> None:
    """Copy one file/object at ``uri`` (S3 or local) to ``local_path``, creating parent dirs."""
    dst = _local_path(local_path)
    if not is_s3_uri(uri):
        src = _local_path(uri)
        with _local_errors(src, f"copying to {dst}"):
            _atomic_write_local(dst, lambda tmp: shutil.copyfile(src, tmp))
        return
    with _s3(uri, settings, "downloading") as (client, bucket, key):
        with _local_errors(dst, f"downloading {uri} to"):
            dst.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(bucket, _object_key(uri, key), str(dst), Config=_transfer_config(settings))


def copy_file(src_uri: str, dst_uri: str, settings: S3Settings | None = None) -> None:
    """Copy one file/object to another place of the same kind: S3 to S3 is a server-side copy (managed, so
    objects above 5 GB copy in parts), local to local an atomic temp file + rename. Mixed kinds: use
    `upload_file` / `download_file`."""
    if is_s3_uri(src_uri) != is_s3_uri(dst_uri):
        raise StorageError(f"copy_file copies S3 to S3 or local to local, not {src_uri} to {dst_uri}; use "
                           "upload_file or download_file")
    if not is_s3_uri(src_uri):
        src = _local_path(src_uri)
        with _local_errors(src, f"copying to {dst_uri}"):
            _atomic_write_local(_local_path(dst_uri), lambda tmp: shutil.copyfile(src, tmp))
        return
    src_bucket, src_key = parse_s3_uri(src_uri)
    with _s3(dst_uri, settings, f"copying {src_uri} to") as (client, bucket, key):
        client.copy({"Bucket": src_bucket, "Key": _object_key(src_uri, src_key)}, bucket, _object_key(dst_uri, key),
                    Config=_transfer_config(settings))


def delete_file(uri: str, settings: S3Settings | None = None) -> None:
    """Delete one file/object; one that does not exist is not an error."""
    _delete(uri, settings)


def delete_dir(uri: str, settings: S3Settings | None = None) -> None:
    """Delete a local directory tree, or every object under an S3 prefix; a missing one is not an error."""
    if not is_s3_uri(uri):
        path = _local_path(uri)
        if path.is_file():
            raise StorageError(f"{uri} is a file, not a directory; not deleted")
        with _local_errors(uri, "deleting"):
            if path.exists():
                shutil.rmtree(path)
        return
    _run_all([lambda r=rel: _delete(join(uri, r), settings) for rel in list_files(uri, settings)])


def _run_all(jobs: list[Callable[[], None]]) -> None:
    """Run small transfer jobs concurrently; the first failure is re-raised."""
    if len(jobs) <= 1:
        for job in jobs:
            job()
        return
    with ThreadPoolExecutor(max_workers=min(_DIR_WORKERS, len(jobs))) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result()


def upload_dir(local_dir: PathLike, uri: str, settings: S3Settings | None = None) -> list[str]:
    """Copy every file under ``local_dir`` to ``uri`` (S3 prefix or local dir); returns relative paths."""
    src = _local_path(local_dir)
    if not src.is_dir():
        raise StorageError(f"not found: local directory {src} (while uploading to {uri})")
    files = list_files(str(src))
    _run_all([lambda r=rel: upload_file(src / r, join(uri, r), settings) for rel in files])
    return files


def download_dir(uri: str, local_dir: PathLike, settings: S3Settings | None = None) -> list[str]:
    """Copy every file under ``uri`` into ``local_dir``; returns relative paths. Nothing there is an error."""
    files = list_files(uri, settings)
    if not files:
        raise StorageError(f"not found: no files under {uri}; check the URI")
    dst = _local_path(local_dir)
    _run_all([lambda r=rel: download_file(join(uri, r), dst / r, settings) for rel in files])
    return files


# ---------------------------------------------------------------------------------------- checkpoints


def _file_entry(path: pathlib.Path) -> dict[str, Any]:
    with _local_errors(path, "hashing"), open(path, "rb") as handle:
        return {"sha256": hashlib.file_digest(handle, "sha256").hexdigest(), "size": path.stat().st_size}


def publish_checkpoint(local_dir: PathLike, dest_uri: str, metadata: dict | None = None,
                       settings: S3Settings | None = None) -> dict:
    """Publish ``local_dir`` to ``dest_uri`` so readers never see a partial checkpoint.

    Order: remove any old ``_COMPLETE`` at the destination, copy every file, delete the files there that are
    not part of this checkpoint (left by an earlier or interrupted publish), write ``manifest.json`` (sha256
    and size in bytes of each file), then write ``_COMPLETE`` last. Returns the manifest.
    """
    try:
        json.dumps(metadata or {})
    except (TypeError, ValueError) as exc:  # refused before anything is written
        raise StorageError(f"checkpoint metadata for {dest_uri} is not JSON-serialisable: {exc}") from exc
    begin_checkpoint(dest_uri, settings)
    return complete_checkpoint(dest_uri, upload_checkpoint_files(local_dir, dest_uri, settings), metadata, settings)


def seal_checkpoint(local_dir: PathLike, metadata: dict | None = None) -> dict:
    """Publish a local directory in place: write the manifest of the files already in it, then ``_COMPLETE``
    (for a model this process has just saved there itself). Returns the manifest."""
    root = _local_path(local_dir)
    if not root.is_dir():
        raise StorageError(f"not found: checkpoint directory {root} (while sealing it)")
    begin_checkpoint(str(root))
    files = [f for f in list_files(str(root)) if f not in (MANIFEST_NAME, COMPLETE_MARKER)]
    return complete_checkpoint(str(root), {rel: _file_entry(root / rel) for rel in files}, metadata)


def begin_checkpoint(dest_uri: str, settings: S3Settings | None = None) -> None:
    """Mark the checkpoint at ``dest_uri`` incomplete (an overwrite is incomplete until it finishes)."""
    _delete(join(dest_uri, COMPLETE_MARKER), settings)


def upload_checkpoint_files(local_dir: PathLike, dest_uri: str, settings: S3Settings | None = None
                            ) -> dict[str, dict[str, Any]]:
    """Copy every file under ``local_dir`` to ``dest_uri`` (same relative paths); returns their manifest
    entries (sha256, size). Several writers (the ranks of a job, each with its own files) may upload into
    one checkpoint between `begin_checkpoint` and `complete_checkpoint`."""
    src = _local_path(local_dir)
    if not src.is_dir():
        raise StorageError(f"not found: checkpoint directory {src} (while publishing to {dest_uri})")
    files = [f for f in list_files(str(src)) if f not in (MANIFEST_NAME, COMPLETE_MARKER)]
    entries = {rel: _file_entry(src / rel) for rel in files}
    _run_all([lambda r=rel: upload_file(src / r, join(dest_uri, r), settings) for rel in files])
    return entries


def complete_checkpoint(dest_uri: str, entries: dict[str, dict[str, Any]], metadata: dict | None = None,
                        settings: S3Settings | None = None) -> dict:
    """Write ``manifest.json`` for the uploaded files ``entries`` and then ``_COMPLETE``; returns the manifest."""
    manifest = {
        "format": _MANIFEST_FORMAT,
        "files": dict(sorted(entries.items())),
        "created_unix": time.time(),
        "metadata": dict(metadata or {}),
    }
    try:
        manifest_text = json.dumps(manifest, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise StorageError(f"checkpoint metadata for {dest_uri} is not JSON-serialisable: {exc}") from exc
    # Files left at the destination by an earlier or interrupted publish (a temporary file of a killed copy,
    # another shard layout) are not part of this checkpoint: they go before it is marked complete.
    leftovers = [rel for rel in list_files(dest_uri, settings)
                 if rel not in entries and rel not in (MANIFEST_NAME, COMPLETE_MARKER)]
    _run_all([lambda r=rel: _delete(join(dest_uri, r), settings) for rel in leftovers])
    write_text(join(dest_uri, MANIFEST_NAME), manifest_text, settings)
    write_text(join(dest_uri, COMPLETE_MARKER), hashlib.sha256(manifest_text.encode()).hexdigest(), settings)
    return manifest


def _delete(uri: str, settings: S3Settings | None) -> None:
    """Delete one file/object if it exists."""
    if not is_s3_uri(uri):
        with _local_errors(uri, "deleting"):
            _local_path(uri).unlink(missing_ok=True)
        return
    with _s3(uri, settings, "deleting") as (client, bucket, key):
        client.delete_object(Bucket=bucket, Key=_object_key(uri, key))


def delete_checkpoint(uri: str, settings: S3Settings | None = None) -> None:
    """Delete a published checkpoint: a local directory, or every object under an S3 prefix.

    ``_COMPLETE`` goes first, so a checkpoint that is only partly deleted (a crash, a failed request)
    is incomplete to every reader, never taken for a complete one. A checkpoint that does not exist is
    not an error; a failure raises StorageError (what is left stays incomplete, delete it again).
    """
    if not is_s3_uri(uri):
        path = _local_path(uri)
        if path.is_file():
            raise StorageError(f"{uri} is a file, not a checkpoint directory; not deleted")
        _delete(join(uri, COMPLETE_MARKER), settings)
        with _local_errors(uri, "deleting"):
            if path.exists():
                shutil.rmtree(path)
        return
    _delete(join(uri, COMPLETE_MARKER), settings)
    files = list_files(uri, settings)  # listed after the marker is gone: nothing is complete any more
    _run_all([lambda r=rel: _delete(join(uri, r), settings) for rel in files])


def is_complete_checkpoint(uri: str, settings: S3Settings | None = None) -> bool:
    """True if the checkpoint at ``uri`` has its ``_COMPLETE`` marker."""
    return exists(join(uri, COMPLETE_MARKER), settings)


def read_manifest(uri: str, settings: S3Settings | None = None) -> dict:
    """The manifest of a complete checkpoint; CheckpointError if it is incomplete or unreadable."""
    if not is_complete_checkpoint(uri, settings):
        raise CheckpointError(f"incomplete checkpoint: {join(uri, COMPLETE_MARKER)} is missing (the "
                              "publisher has not finished or failed); wait, or publish it again")
    manifest_uri = join(uri, MANIFEST_NAME)
    try:
        manifest = json.loads(read_text(manifest_uri, settings))
    except (StorageError, ValueError) as exc:
        raise CheckpointError(f"unreadable checkpoint manifest {manifest_uri}: {exc}") from exc
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (not isinstance(files, dict) or manifest.get("format") != _MANIFEST_FORMAT
            or not all(isinstance(e, dict) and {"sha256", "size"} <= e.keys() for e in files.values())):
        raise CheckpointError(f"corrupt checkpoint manifest {manifest_uri}: expected format "
                              f"{_MANIFEST_FORMAT} with a 'files' map of sha256/size entries")
    unsafe = [rel for rel in files if rel.startswith("/") or ".." in rel.split("/")]
    if unsafe:
        raise CheckpointError(f"corrupt checkpoint manifest {manifest_uri}: unsafe file path {unsafe[0]!r}")
    return manifest


def checkpoint_digest(uri: str, settings: S3Settings | None = None) -> str:
    """sha256 (hex) of a complete checkpoint's ``manifest.json``: one checksum that pins every file."""
    read_manifest(uri, settings)
    return hashlib.sha256(read_text(join(uri, MANIFEST_NAME), settings).encode()).hexdigest()


def _check_against(root: pathlib.Path, manifest: dict, shown_as: str | None = None) -> None:
    """Compare every manifest file under ``root``; errors name the file as ``shown_as/<rel>``."""
    for rel, entry in sorted(manifest["files"].items()):
        path, shown = root / rel, join(shown_as or str(root), rel)
        if not path.is_file():
            raise CheckpointError(f"checkpoint file missing: {shown} (listed in its {MANIFEST_NAME})")
        if path.stat().st_size != entry["size"] or _file_entry(path)["sha256"] != entry["sha256"]:
            raise CheckpointError(f"checkpoint file corrupt: {shown} does not match the size/sha256 in its "
                                  f"{MANIFEST_NAME}; publish the checkpoint again")


def unlisted_files(root: PathLike, manifest: dict) -> list[str]:
    """Files under a local checkpoint directory that its manifest does not list (besides the manifest and
    the ``_COMPLETE`` marker themselves), as sorted relative paths."""
    return [rel for rel in list_files(str(_local_path(root)))
            if rel not in manifest["files"] and rel not in (MANIFEST_NAME, COMPLETE_MARKER)]


def verify_checkpoint(local_dir: PathLike, allow_unlisted: bool = False) -> dict:
    """Recompute sha256 and size of every manifest file, and refuse a file the manifest does not list (unless
    `allow_unlisted`); CheckpointError names the first bad one."""
    root = _local_path(local_dir)
    manifest = read_manifest(str(root))
    extra = [] if allow_unlisted else unlisted_files(root, manifest)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"checkpoint file not in its {MANIFEST_NAME}: {join(str(root), extra[0])}{more}; a "
                              "checkpoint holds only the files its manifest lists: remove it, or publish the "
                              "directory again")
    _check_against(root, manifest)
    return manifest


def has_manifest(folder: pathlib.Path, name: str, use: str, unverified: bool, error: type[Exception]) -> bool:
    """Whether a local `folder` (a model, an adapter) has a manifest to verify it against (`verify_checkpoint`).

    Without one it is refused with `error`, naming the folder and what to do, unless `unverified` lets it be
    used as it is (False, and a warning). `name` names the folder in messages ("model directory /m"); `use` is
    the verb of what is done with it ("load", "merge")."""
    if (folder / MANIFEST_NAME).exists():
        return True
    if not unverified:
        raise error(f"{name} has no {MANIFEST_NAME}, so its files cannot be verified. Publish it with `sao "
                    f"checkpoint publish DEST --source {folder}` (a manifest of every file's sha256) and {use} DEST, "
                    f"or pass --unverified (config field unverified: true) to {use} this folder as it is")
    log.warning("%s has no %s: used as it is, unverified (--unverified)", name, MANIFEST_NAME)
    return False


def fetch_checkpoint(uri: str, cache_dir: PathLike, settings: S3Settings | None = None) -> pathlib.Path:
    """A verified local copy of the complete checkpoint at ``uri``.

    Local checkpoints are verified in place. S3 checkpoints land in ``cache_dir/<hash of uri>/``; a
    copy already there with the same manifest that still verifies is reused without downloading.
    """
    if not is_s3_uri(uri):
        root = _local_path(uri)
        verify_checkpoint(root)
        return root
    manifest = read_manifest(uri, settings)
    cache = _local_path(cache_dir)
    target = cache / hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:24]
    if _is_local_copy_of(target, manifest):
        return target
    staging = cache / f".{target.name}.{uuid.uuid4().hex[:8]}.partial"
    try:
        _run_all([lambda r=rel: download_file(join(uri, r), staging / r, settings) for rel in manifest["files"]])
        with _local_errors(staging, "writing the manifest of a fetched checkpoint"):
            staging.mkdir(parents=True, exist_ok=True)
            (staging / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2, sort_keys=True))
        _check_against(staging, manifest, shown_as=uri)
        with _local_errors(target, "installing a fetched checkpoint"):
            (staging / COMPLETE_MARKER).write_text("ok")
            if not _is_local_copy_of(target, manifest):  # another process may have just installed it
                shutil.rmtree(target, ignore_errors=True)
                os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _is_local_copy_of(root: pathlib.Path, manifest: dict) -> bool:
    """True if ``root`` holds a complete checkpoint with exactly ``manifest`` that still verifies."""
    try:
        return json.loads((root / MANIFEST_NAME).read_text()) == manifest and bool(verify_checkpoint(root))
    except (OSError, ValueError, StorageError):
        return False


def list_dirs(root_uri: str, settings: S3Settings | None = None) -> list[str]:
    """Sorted names of the immediate sub-directories (local) or common prefixes (S3) of ``root_uri``;
    ``[]`` if there is none."""
    if not is_s3_uri(root_uri):
        root = _local_path(root_uri)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    with _s3(root_uri, settings, "listing") as (client, bucket, key):
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        names = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
            names += [p["Prefix"][len(prefix):].rstrip("/") for p in page.get("CommonPrefixes", [])]
        return sorted(names)


def latest_checkpoint(root_uri: str, settings: S3Settings | None = None) -> str | None:
    """URI of the newest complete checkpoint directly under ``root_uri``, or None.

    Newest means the highest ``metadata["step"]``; checkpoints without a step rank below those with
    one, and ties are broken by ``created_unix``. Incomplete checkpoints are ignored.
    """
    best: tuple[float, float] | None = None
    best_uri = None
    for name in list_dirs(root_uri, settings):
        candidate = join(root_uri, name)
        try:
            manifest = read_manifest(candidate, settings)
        except CheckpointError:
            continue
        meta = manifest.get("metadata")
        step = meta.get("step") if isinstance(meta, dict) else None
        rank = (float(step) if isinstance(step, int | float) else -math.inf,
                float(manifest.get("created_unix", 0.0)))
        if best is None or rank > best:
            best, best_uri = rank, candidate
    return best_uri
