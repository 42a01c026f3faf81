"""The control API from the other side: `status` and the tray ask the node running
on a data dir, with the token kept there."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

from .auth import load_or_create_token

TIMEOUT_S = 5.0


def call(data_dir: Path, api: str, path: str, method: str = "GET") -> dict:
    """`method path` on the node's API at `api`; its JSON answer (raises OSError)."""
    request = urllib.request.Request(f"{api}{path}", method=method,
                                     headers={"Authorization": f"Bearer {load_or_create_token(data_dir)}"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())
