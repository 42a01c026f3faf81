"""What every script in bench/ does first (`from _common import REPO`): run this
checkout's code, and share the conversion cache (SmolLM2 is converted once)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    try:
        import compushare  # noqa: F401  (installed editable in the venv)
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("COMPUSHARE_CACHE", str(REPO / ".cache" / "compushare"))
