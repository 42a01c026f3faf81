"""What every script in bench/ does first (`from _common import REPO`): run this
checkout's code, and share the conversion cache (SmolLM2 is converted once)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    try:
        import compushare  # noqa: F401  (installed editable in the venv)
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))


def save_result(result: dict, path: Path) -> None:
    """Append `result` to the benchmark's JSON-lines history (bench/results/README.md),
    numbered, dated and with the commit its working tree sits on."""
    import datetime
    import json
    import subprocess

    commit = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, timeout=10).stdout.strip()
    runs = sum(1 for line in path.read_text().splitlines() if line.strip()) if path.exists() else 0
    entry = {"run": runs + 1, "date": datetime.date.today().isoformat(), **result,
             **({"commit": commit, "note": f"working tree over {commit}"} if commit else {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as out:
        out.write(json.dumps(entry) + "\n")
    print(f"appended as run {entry['run']} to {path}", flush=True)


def finish(result: dict, results_path: str | None) -> int:
    """A benchmark's last words: its result saved (unless `--results ''`), then as the
    last line of output, one JSON object."""
    import json

    if results_path:
        save_result(result, Path(results_path))
    print(json.dumps(result), flush=True)
    return 0


def stop_lab(procs: list, lab, root: Path, *, failed: bool, keep: bool, logs: str, log) -> None:
    """Tear a netlab benchmark down on every exit path: its node processes (by pid), the
    lab's namespaces, and its temp dir (kept with --keep); on failure, the tail of each
    node's log."""
    import contextlib
    import shutil

    from compushare.app.swarm import stop_pids

    stop_pids([p.pid for p in procs if p.poll() is None], timeout=10)
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(timeout=5)
    lab.close()
    if failed:
        for node_log in sorted(root.glob(logs)):
            with contextlib.suppress(OSError):
                log(f"--- {node_log} (last 1500 characters)\n{node_log.read_text(errors='replace')[-1500:]}")
    if keep:
        log(f"kept {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
