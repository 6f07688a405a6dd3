"""The rollout service's control-plane credentials: one bearer token per run.

Every endpoint that changes the service or costs compute (weights, plans, pause / resume, take / ack,
generate, shutdown, status) needs ``Authorization: Bearer <token>``; ``/healthz``, ``/metrics`` and the
OpenAPI schema stay open. The token comes from, in order:

1. an explicit value (a colocated learner makes a random one per run and hands it to its own service);
2. a file named by ``token_file`` (``sao rollout serve --token-file``, ``train-rl --service-token-file``),
   e.g. a mounted Kubernetes Secret;
3. ``$SAO_ROLLOUT_TOKEN``;
4. a file named by ``$SAO_ROLLOUT_TOKEN_FILE``.

Without a token the service starts only on a loopback address (127.0.0.1, ::1, localhost) or when told
``insecure``; it then accepts every request. The token is compared in constant time and never written to
logs, errors, reprs or status answers: messages name where it came from, never what it is.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

ENV_TOKEN = "SAO_ROLLOUT_TOKEN"
ENV_TOKEN_FILE = "SAO_ROLLOUT_TOKEN_FILE"
MIN_TOKEN_CHARS = 16
#: the realm of the WWW-Authenticate challenge of a 401
REALM = "sao-rollout"


class TokenError(ValueError):
    """The token cannot be read or is unusable; the message names the source, never the token."""


def is_loopback(host: str) -> bool:
    """True for localhost and loopback IP addresses (127.0.0.0/8, ::1)."""
    host = host.strip().strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def new_token() -> str:
    """A random token (256 bits, URL-safe) for one run."""
    return secrets.token_urlsafe(32)


def check_token(token: str, source: str) -> str:
    """`token` if usable as a bearer token; TokenError naming `source` otherwise."""
    if len(token) < MIN_TOKEN_CHARS:
        raise TokenError(f"the rollout token from {source} is too short ({len(token)} characters; at least "
                         f"{MIN_TOKEN_CHARS}, e.g. `openssl rand -hex 32`)")
    if not all(33 <= ord(c) < 127 for c in token):
        raise TokenError(f"the rollout token from {source} must be printable ASCII without spaces")
    return token


def _read(path: str, source: str) -> str:
    try:
        mode = os.stat(path).st_mode
    except OSError:
        mode = 0
    if mode & 0o077:   # a Kubernetes Secret volume: set its defaultMode to 0400
        log.warning("the rollout token file %s (%s) is readable by other users (mode %o); chmod 600 it", path,
                    source, mode & 0o777)
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as err:
        raise TokenError(f"cannot read the rollout token file {path} ({source}): {type(err).__name__}") from None
    token = text.strip()
    if not token:
        raise TokenError(f"the rollout token file {path} ({source}) is empty")
    return check_token(token, f"{path} ({source})")


def resolve_token(token: str | None = None, token_file: str = "",
                  environ: Mapping[str, str] | None = None) -> str | None:
    """The token from the first source that is set (see the module docstring); None when none is."""
    environ = os.environ if environ is None else environ
    if token:
        return check_token(token, "the caller")
    if token_file:
        return _read(token_file, "token_file")
    if environ.get(ENV_TOKEN, "").strip():
        return check_token(environ[ENV_TOKEN].strip(), f"${ENV_TOKEN}")
    if environ.get(ENV_TOKEN_FILE, "").strip():
        return _read(environ[ENV_TOKEN_FILE].strip(), f"${ENV_TOKEN_FILE}")
    return None


def same_token(offered: str, expected: str) -> bool:
    """Constant-time comparison (the time taken does not tell how much of `offered` was right)."""
    return hmac.compare_digest(offered.encode("utf-8", "surrogateescape"), expected.encode())


def _s3_parts(uri: str) -> tuple[str, list[str]] | None:
    """(bucket, key segments) of an s3:// URI, or None when its key has an empty, `.` or `..` segment (one
    trailing `/` is allowed): such a key is refused, never normalised, since S3 reads it verbatim (`a//b` is
    not `a/b` there)."""
    from sao_core import storage

    try:
        bucket, key = storage.parse_s3_uri(uri)
    except storage.StorageError:
        return None
    key = key[:-1] if key.endswith("/") else key
    parts = key.split("/") if key else []
    if any(p in ("", ".", "..") for p in parts):
        return None
    return bucket, parts


def resolve_within_roots(uri: str, roots: list[str]) -> str | None:
    """The one reading of a weight URI: its canonical form when it lies inside one of `roots`, else None.

    Local paths (plain or file://) resolve to their real path (symlinks and `..` followed once, here); s3://
    URIs are compared by bucket and whole key segments and come back rebuilt from those segments (a key with
    an empty, `.` or `..` segment never matches). The caller reads the checkpoint only through the returned
    form, so the check and the read cannot see two different places."""
    from sao_core import storage

    if storage.is_s3_uri(uri):
        target = _s3_parts(uri)
        if target is None:
            return None
        for root in roots:
            allowed = _s3_parts(root) if storage.is_s3_uri(root) else None
            if allowed is not None and allowed[0] == target[0] and target[1][:len(allowed[1])] == allowed[1]:
                return "s3://" + "/".join([target[0], *target[1]])
        return None
    try:
        path = os.path.realpath(storage._local_path(uri))
    except (storage.StorageError, OSError, ValueError):
        return None
    for root in roots:
        if storage.is_s3_uri(root):
            continue
        try:
            base = os.path.realpath(storage._local_path(root))
        except (storage.StorageError, OSError, ValueError):
            continue
        if os.path.commonpath([path, base]) == base:
            return path
    return None


def within_roots(uri: str, roots: list[str]) -> bool:
    """True when `uri` lies inside one of `roots` (see `resolve_within_roots`)."""
    return resolve_within_roots(uri, roots) is not None


def files_outside(directory: str, roots: list[str]) -> list[str]:
    """Files and folders under a local checkpoint `directory` whose real path (after symlinks) leaves every
    local root: a symlinked file inside a checkpoint must not pull bytes from elsewhere."""
    from sao_core import storage

    bases = []
    for root in roots:
        if not storage.is_s3_uri(root):
            try:
                bases.append(os.path.realpath(storage._local_path(root)))
            except (storage.StorageError, OSError, ValueError):
                continue
    outside = []
    for folder, dirs, files in os.walk(directory):
        for name in dirs + files:
            real = os.path.realpath(os.path.join(folder, name))
            if not any(os.path.commonpath([real, base]) == base for base in bases):
                outside.append(os.path.relpath(os.path.join(folder, name), directory))
    return sorted(outside)
