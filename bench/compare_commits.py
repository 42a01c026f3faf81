"""Two commits side by side: the same benchmarks from two worktrees, interleaved.

    .venv/bin/python bench/compare_commits.py --old REF --new REF [--rounds 2]
        [--bench pipeline_overhead --bench failover --bench wan] [-- extra args per bench]

For a change meant to leave behaviour and speed alone (a refactor), this is the
check: each round runs every chosen benchmark once from the old commit's tree and
once from the new one's, alternating which goes first (ABBA), so that the machine's
drift (other load, thermal state, page cache) falls on both alike. Each run is the
worktree's own `bench/<name>.py` with `PYTHONPATH=<worktree>/src`, so its node
processes (`python -m compushare ...`) import that commit's code; both share this
venv and the converted-weights cache.

Ratios are new/old of each benchmark's headline figures (higher is better for
speeds, lower for times), taken over the per-round medians. Worktrees live in a
temporary directory and are removed on every exit path.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# Headline figures per benchmark: (key in its JSON summary, "higher" or "lower" is better).
FIGURES = {
    "pipeline_overhead": [("swarm_tok_s", "higher"), ("swarm_vs_ring", "higher"), ("ratio", "higher")],
    "failover": [("detect_p50_s", "lower"), ("detect_p95_s", "lower"), ("recovery_p50_s", "lower"),
                 ("recovery_p95_s", "lower"), ("reference_tok_s", "higher")],
    "wan": [("direct_tok_s", "higher"), ("relay_tok_s", "higher"), ("spec_tok_s", "higher"),
            ("concurrent8_tok_s", "higher")],
}
DEFAULT_ARGS = {
    "pipeline_overhead": ["--trials", "3"],
    "failover": ["--early-faults", "6", "--long-faults", "4"],
    "wan": ["--delays", "20", "--trials", "1", "--results", ""],  # one lab: 20 ms each way
}
# Must hold in every run, whatever the speed.
INVARIANTS = {"pipeline_overhead": ["tokens_match"], "failover": ["identical"], "wan": ["identical"]}
BENCH_TIMEOUT_S = 1200


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()


def run_bench(tree: Path, name: str, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree / "src"))
    began = time.perf_counter()
    done = subprocess.run([sys.executable, str(tree / "bench" / f"{name}.py"), *extra], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{name} in {tree} failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads(lines[-1])
    print(f"  {tree.name:4s} {name}: {time.perf_counter() - began:.0f} s, "
          + ", ".join(f"{key}={summary.get(key)}" for key, _ in FIGURES[name]), flush=True)
    return summary


def ratio(new: float | None, old: float | None) -> float | None:
    if new is None or old is None or old == 0:
        return None
    return round(new / old, 4)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="the commit before the change")
    parser.add_argument("--new", default="HEAD", help="the commit after it")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--bench", action="append", choices=sorted(FIGURES), help="default: all")
    args = parser.parse_args()
    benches = args.bench or sorted(FIGURES)
    commits = {"old": git("rev-parse", args.old), "new": git("rev-parse", args.new)}
    runs: dict[str, dict[str, list[dict]]] = {b: {"old": [], "new": []} for b in benches}
    with tempfile.TemporaryDirectory(prefix="compushare-compare-") as tmp:
        trees = {side: Path(tmp) / side for side in commits}
        try:
            for side, commit in commits.items():
                git("worktree", "add", "--detach", str(trees[side]), commit)
            print(f"old {commits['old'][:10]}, new {commits['new'][:10]}; {args.rounds} rounds of "
                  f"{', '.join(benches)}", flush=True)
            for round_index in range(args.rounds):
                order = ["old", "new"] if round_index % 2 == 0 else ["new", "old"]
                print(f"round {round_index + 1}: {' then '.join(order)}", flush=True)
                for name in benches:
                    for side in order:
                        runs[name][side].append(run_bench(trees[side], name, DEFAULT_ARGS[name]))
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO,
                               capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)

    result: dict = {"old": commits["old"], "new": commits["new"], "rounds": args.rounds, "ratios": {},
                    "invariants": {}, "runs": runs}
    in_band = True
    for name in benches:
        for key, better in FIGURES[name]:
            medians = {side: statistics.median([r[key] for r in runs[name][side] if r.get(key) is not None] or [0])
                       for side in ("old", "new")}
            value = ratio(medians["new"], medians["old"])
            result["ratios"][f"{name}.{key}"] = value
            ok = value is not None and 0.9 <= value <= 1.1
            in_band &= ok
            print(f"{name}.{key}: old {medians['old']}, new {medians['new']}, new/old {value} "
                  f"({better} is better){'' if ok else '  OUTSIDE 0.9..1.1'}", flush=True)
        for key in INVARIANTS[name]:
            held = all(r.get(key) is True for side in ("old", "new") for r in runs[name][side])
            result["invariants"][f"{name}.{key}"] = held
            in_band &= held
    result["all_ratios_in_0.9_1.1"] = in_band
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
