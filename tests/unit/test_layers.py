"""The import contracts of pyproject.toml ([tool.importlinter]): the tree keeps them,
and a copy of it with one forbidden import breaks them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(config: Path, src: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(src))  # ahead of the editable install's src/
    return subprocess.run([str(LINT_IMPORTS), "--config", str(config), "--no-cache"], cwd=config.parent, env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_tree_keeps_every_contract():
    done = _lint(ROOT / "pyproject.toml", ROOT / "src")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 broken" in done.stdout


CIRCLES = "No import circles"


@pytest.mark.parametrize(("where", "violation", "contracts"), [
    # A lower layer importing a higher one also closes a circle between the two.
    ("net/_violation.py", "import compushare.pipeline\n", ("Layers", CIRCLES)),
    ("karma/_violation.py", "from compushare.pipeline.client import routing\n", ("Layers", CIRCLES)),
    ("pipeline/client/_violation.py", "import compushare.pipeline.server.session\n", ("are independent",)),
    ("torrent/picker.py", "import trio\n", ("Pure cores do no I/O",)),
    ("pipeline/client/chain_rebuild.py", "from compushare.net import dial\n", ("Pure cores do no I/O",)),
    # Circles within one package, as the three cut in issue 52 were.
    ("pipeline/client/chain_state.py", "from . import chain_core\n", (CIRCLES,)),
    ("net/relayed_dialers.py", "from . import traversal\n", (CIRCLES,)),
    ("diloco/sync.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import participant\n",
     (CIRCLES,)),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, where, violation, contracts):
    shutil.copytree(ROOT / "src" / "compushare", tmp_path / "src" / "compushare",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "compushare" / where
    target.write_text((target.read_text() if target.exists() else "") + violation)
    done = _lint(tmp_path / "pyproject.toml", tmp_path / "src")
    assert done.returncode != 0, done.stdout
    broken = [line for line in done.stdout.splitlines() if line.endswith("BROKEN")]
    assert len(broken) == len(contracts), done.stdout
    assert all(any(contract in line for line in broken) for contract in contracts), done.stdout
