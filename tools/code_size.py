"""The largest module, class and function under src/ (lines, blank and comment lines
included), against the limits the code keeps: 500, 250 and 60.

    .venv/bin/python tools/code_size.py [--top N] [--check]

--check exits 1 when any limit is passed. Prints one JSON object as its last line."""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
LIMITS = {"module": 500, "class": 250, "function": 60}


def measure(root: Path = ROOT) -> dict[str, list[tuple[int, str]]]:
    """{kind: [(lines, where)] largest first} for every module, class and function."""
    sizes: dict[str, list[tuple[int, str]]] = {kind: [] for kind in LIMITS}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root))
        sizes["module"].append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                kind = "class"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                kind = "function"
            else:
                continue
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            sizes[kind].append((node.end_lineno - first + 1, f"{name}:{node.lineno} {node.name}"))
    return {kind: sorted(found, reverse=True) for kind, found in sizes.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    sizes = measure()
    over = {kind: [f"{lines} {where}" for lines, where in found if lines > LIMITS[kind]]
            for kind, found in sizes.items()}
    for kind, found in sizes.items():
        print(f"{kind} (limit {LIMITS[kind]}): {len(over[kind])} over")
        for lines, where in found[:args.top]:
            print(f"  {lines:5d}  {where}")
    print(json.dumps({f"largest_{kind}": found[0][0] for kind, found in sizes.items()}
                     | {f"over_{kind}_limit": len(over[kind]) for kind in LIMITS}))
    if args.check and any(over.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
