"""The pure cores' source files, one per line, from the one list of them (pyproject.toml's
import-linter contract "Pure cores do no I/O"): what `make test` type-checks.

    .venv/bin/python tools/pure_cores.py
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONTRACT = "Pure cores do no I/O"


def pure_cores(root: Path = ROOT) -> list[str]:
    """The pure cores' module names, as pyproject.toml lists them."""
    config = tomllib.loads((root / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    (contract,) = [c for c in contracts if c["name"].startswith(CONTRACT)]
    return list(contract["source_modules"])


def source_file(module: str, root: Path = ROOT) -> Path:
    return root / "src" / (module.replace(".", "/") + ".py")


if __name__ == "__main__":
    print("\n".join(str(source_file(m).relative_to(ROOT)) for m in pure_cores()))
