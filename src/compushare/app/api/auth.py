"""The local API's token: `<data dir>/api.token`, 0600, made on first use. Whoever
can read the node's data dir may use its API; nobody else on the machine can."""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

TOKEN_FILE = "api.token"


def load_or_create_token(data_dir: Path) -> str:
    path = data_dir / TOKEN_FILE
    if path.exists():
        token = path.read_text().strip()
        if token:
            return token
    token = secrets.token_urlsafe(32)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(token + "\n")
    os.replace(tmp, path)
    return token


def bearer_ok(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries the token (constant-time compare)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].strip().encode(), token.encode())
