"""`compushare train start|join|status` as a user runs them: two processes train a
run to its end and agree on the outer weights."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from compushare.app.swarm import start_node, wait_ready
from compushare.config import LISTEN_FILE, TRAIN_DIR, TRAIN_STATE_FILE

from helpers import wait_until

pytestmark = pytest.mark.integration

TIMEOUT_S = 240
START_IN_S = 60


def _train(home, *args: str) -> list[str]:
    return [sys.executable, "-m", "compushare", "train", *args, "--home", str(home),
            "--listen", "/ip4/127.0.0.1/tcp/0", "--log-level", "info"]


def _state(home) -> dict | None:
    try:
        return json.loads((home / TRAIN_DIR / TRAIN_STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def test_two_processes_train_a_run_and_status_shows_it(processes, tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(b"the quick brown fox jumps over the lazy dog. " * 3000)
    small = ["--steps", "2", "--rounds", "2", "--batch", "1", "--gather-s", "20"]
    a_home, b_home = tmp_path / "a", tmp_path / "b"
    # Round 0 begins START_IN_S after A makes the run; B must be up by then. With 15 s, a B
    # slow to start on a loaded machine (CI stop 59) found A's rounds all done alone and A
    # gone: its `join` then retries the bootstrap peer for ever, as a joiner does.
    a = start_node(_train(a_home, "start", "--corpus", str(corpus), "--start-in", str(START_IN_S), *small),
                   a_home)
    processes.procs.append(a)
    listen = wait_ready(a, a_home, timeout=120, file=f"{TRAIN_DIR}/{LISTEN_FILE}")
    run = wait_until(lambda: (_state(a_home) or {}).get("run"), "the run's id", timeout=TIMEOUT_S)
    boot = next(x for x in listen["addrs"] if "/ip4/127.0.0.1/" in x)
    b = start_node(_train(b_home, "join", run, "--corpus", str(corpus), "--bootstrap", boot), b_home)
    processes.procs.append(b)
    for proc in (a, b):
        assert proc.wait(timeout=TIMEOUT_S) == 0
    states = [_state(home) for home in (a_home, b_home)]
    # B normally joins before round 0 and both average both rounds; a B slow to start
    # joins round 1 instead (A's round 0 alone), and they still end on one set of weights.
    assert all(s["finished"] and s["round"] == 2 and s["averaged"] >= 1 for s in states)
    assert states[0]["base"] == states[1]["base"]
    assert sorted(states[0]["members"]) == sorted([states[0]["peer_id"], states[1]["peer_id"]])
    assert states[0]["receipts"] >= 1  # from the other member, one per round averaged
    shown_json = json.loads(subprocess.run(_status(b_home), capture_output=True, text=True, timeout=60,
                                           check=True).stdout)
    assert shown_json["run"] == run and shown_json["peer_id"] == states[1]["peer_id"]
    shown = subprocess.run(_status(a_home)[:-1], capture_output=True, text=True, timeout=60, check=True).stdout
    assert f"run {run[:12]}" in shown and "round 2 of 2 (finished)" in shown and "rounds averaged" in shown


def _status(home) -> list[str]:
    return [sys.executable, "-m", "compushare", "train", "status", "--home", str(home), "--json"]
