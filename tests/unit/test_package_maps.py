"""Maps that cannot drift: every package's docstring lists each of its modules and
subpackages (a line per entry, or several names before the description), and names
none that is not there."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SOURCE = Path(__file__).resolve().parents[2] / "src" / "compushare"
# An entry: indented, one or more names ("x.py", "sub/", comma-separated), then its description.
ENTRY = re.compile(r"^ {2,}((?:\w+(?:\.py|/))(?:, ?\w+(?:\.py|/))*),?(?: {2,}|:? |$)")


def mapped(package: Path) -> set[str]:
    """The names a package's map lists: "x.py" and "sub/"."""
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text()), clean=False) or ""
    names = set()
    for line in doc.splitlines():
        match = ENTRY.match(line)
        if match:
            names |= {name.strip() for name in match.group(1).split(",")}
    return names


def present(package: Path) -> set[str]:
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    return modules | {f"{p.name}/" for p in package.iterdir() if (p / "__init__.py").exists()}


def map_problems(root: Path) -> list[str]:
    """What the maps under `root` leave out or name wrongly, one line each."""
    problems = []
    for init in sorted(root.rglob("__init__.py")):
        package, where = init.parent, init.parent.relative_to(root.parent)
        listed, there = mapped(package), present(package)
        problems += [f"{where}/{name} is in no line of {where}/__init__.py's map" for name in sorted(there - listed)]
        problems += [f"{where}/__init__.py maps {name}, which is not there" for name in sorted(listed - there)]
    return problems


def test_every_package_maps_exactly_its_modules():
    assert map_problems(SOURCE) == []


def test_a_module_left_out_of_its_map_is_caught(tmp_path):
    copy = shutil.copytree(SOURCE, tmp_path / "compushare", ignore=shutil.ignore_patterns("__pycache__"))
    init = copy / "torrent" / "__init__.py"
    init.write_text("".join(line for line in init.read_text().splitlines(keepends=True)
                            if not line.lstrip().startswith("picker.py")))
    (copy / "karma" / "merkle.py").rename(copy / "karma" / "merkle_tree.py")
    assert map_problems(copy) == ["compushare/karma/merkle_tree.py is in no line of compushare/karma/__init__.py's map",
                                  "compushare/karma/__init__.py maps merkle.py, which is not there",
                                  "compushare/torrent/picker.py is in no line of compushare/torrent/__init__.py's map"]
