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
import os
import secrets
from collections.abc import Mapping
from pathlib import Path

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
    from sao_core import storage

    try:
        bucket, key = storage.parse_s3_uri(uri)
    except storage.StorageError:
        return None
    parts = [p for p in key.split("/") if p]
    if any(p in (".", "..") for p in parts):
        return None
    return bucket, parts


def within_roots(uri: str, roots: list[str]) -> bool:
    """True when `uri` lies inside one of `roots`: local paths compared after resolving symlinks and `..`
    (realpath), s3:// URIs by bucket and whole key segments (a key with `.` or `..` segments never matches)."""
    from sao_core import storage

    if storage.is_s3_uri(uri):
        target = _s3_parts(uri)
        if target is None:
            return False
        for root in roots:
            allowed = _s3_parts(root) if storage.is_s3_uri(root) else None
            if allowed is not None and allowed[0] == target[0] and target[1][:len(allowed[1])] == allowed[1]:
                return True
        return False
    try:
        path = os.path.realpath(storage._local_path(uri))
    except (storage.StorageError, OSError, ValueError):
        return False
    for root in roots:
        if storage.is_s3_uri(root):
            continue
        try:
            base = os.path.realpath(storage._local_path(root))
        except (storage.StorageError, OSError, ValueError):
            continue
        if os.path.commonpath([path, base]) == base:
            return True
    return False
