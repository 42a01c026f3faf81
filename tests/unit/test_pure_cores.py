"""The pure cores are listed once (pyproject.toml's import-linter contract, which
checks they do no I/O): the package maps call exactly those modules pure, and none
imports libp2p beyond its keys and peer ids."""

from __future__ import annotations

import ast
import re
import shutil
import sys
from pathlib import Path

import pytest

from test_package_maps import ENTRY, SOURCE

pytestmark = pytest.mark.unit

ROOT = SOURCE.parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from pure_cores import pure_cores, source_file  # noqa: E402

LIBP2P_ALLOWED = ("libp2p.crypto", "libp2p.peer.id", "libp2p.records.validator")  # keys, ids, the validator interface


def called_pure() -> set[str]:
    """The modules whose package-map entry calls them pure."""
    found = set()
    for init in SOURCE.rglob("__init__.py"):
        package = init.parent.relative_to(SOURCE.parent).parts
        for line in (ast.get_docstring(ast.parse(init.read_text()), clean=False) or "").splitlines():
            match = ENTRY.match(line)
            if match and re.search(r"\bpure\b", line[match.end():], re.I):
                found |= {".".join(package + (name.strip()[:-3],)) for name in match.group(1).split(",")
                          if name.strip().endswith(".py")}
    return found


def test_the_maps_call_pure_exactly_the_listed_cores():
    listed = set(pure_cores())
    assert sorted(listed - called_pure()) == [], "listed as pure cores, not called pure by their package map"
    assert sorted(called_pure() - listed) == [], "called pure by their package map, not in pyproject's list"


def libp2p_imports(root: Path = ROOT) -> list[str]:
    """The pure cores' direct imports of libp2p beyond LIBP2P_ALLOWED."""
    found = []
    for module in pure_cores(root):
        for node in ast.walk(ast.parse(source_file(module, root).read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{module}: {name}" for name in names
                      if name.split(".")[0] == "libp2p" and not name.startswith(LIBP2P_ALLOWED)]
    return found


def test_pure_cores_import_no_libp2p_beyond_keys_and_ids(tmp_path):
    assert libp2p_imports() == []
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "src", copy / "src", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    rules = copy / "src" / "compushare" / "karma" / "rules.py"
    rules.write_text(rules.read_text() + "from libp2p.host.basic_host import BasicHost\n")
    assert libp2p_imports(copy) == ["compushare.karma.rules: libp2p.host.basic_host"]
