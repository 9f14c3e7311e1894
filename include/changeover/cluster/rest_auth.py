"""Signed submissions to the masters' REST servers (Spark 4's JWSFilter): a shared HMAC key, and tokens signed
with it. Without a valid token the REST server refuses every create, status and kill request."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import re
import secrets
import time
from pathlib import Path

from changeover.errors import ChangeoverError
from changeover.private_file import write_private

FILTER = "org.apache.spark.ui.JWSFilter"
TOKEN_SECONDS = 300  # a token's lifetime: a copied header stops working soon after
_BASE64URL = re.compile(r"[A-Za-z0-9_-]+")


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def key_bytes(key: str) -> bytes:
    """The HMAC key as the filter decodes it (jjwt's base64url)."""
    return base64.urlsafe_b64decode(key + "=" * (-len(key) % 4))


def load_key(path: Path) -> str:
    """A key a user configured: refused, naming the file, unless it is base64url of at least 32 bytes."""
    if not path.exists():
        raise ChangeoverError(f"the REST signing key file {path}", "it does not exist",
                              "point rest_key_file (or CHANGEOVER_REST_KEY_FILE) at the key the masters were "
                              "started with, or leave it unset to use the one under the Changeover home")
    key = path.read_text().strip()
    if not _BASE64URL.fullmatch(key) or len(key_bytes(key)) < 32:
        raise ChangeoverError(f"the REST signing key in {path}", "it is not base64url of 32 bytes or more, as "
                              "HS256 needs", "write one: python -c 'import base64,os; "
                              "print(base64.urlsafe_b64encode(os.urandom(33)).decode())'")
    return key


def load_or_create_key(path: Path) -> str:
    """The key, base64 as the filter reads it, from a file only this user can read; created on first use.
    Its alphabet is the one standard and URL-safe base64 share, so either decoder gives the same bytes."""
    if path.exists():
        return load_key(path)
    while True:
        key = base64.b64encode(secrets.token_bytes(33)).decode()  # 264 bits, no padding
        if "+" not in key and "/" not in key:
            break
    write_private(path, key, keep_existing=True)  # the first writer wins; a racing one reads the winner's key
    return path.read_text().strip()


def signed_token(key: str, subject: str = "changeover", now: float | None = None) -> str:
    """A compact HS256 JWS the filter verifies with the same key."""
    issued = int(now if now is not None else time.time())
    header = _b64url(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())
    claims = _b64url(json.dumps({"sub": subject, "iat": issued, "exp": issued + TOKEN_SECONDS},
                                separators=(",", ":")).encode())
    signature = hmac.new(key_bytes(key), f"{header}.{claims}".encode(), hashlib.sha256).digest()
    return f"{header}.{claims}.{_b64url(signature)}"


def master_properties(key: str) -> str:
    """The lines of a master's properties file that turn the filter on for its REST server."""
    return f"spark.master.rest.filters={FILTER}\nspark.{FILTER}.param.secretKey={key}\n"
