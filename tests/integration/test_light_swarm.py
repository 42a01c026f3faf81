"""bench/light_swarm.py, the many-nodes-per-process harness bench/scale.py runs: its
nodes are real libp2p hosts running the project's membership code, every node hears
the ads of its own model's topic and no other, and every process it starts is ended."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

from light_swarm import LightSwarm, role  # noqa: E402

from compushare.hardware import detect_hardware  # noqa: E402

pytestmark = pytest.mark.xdist_group("light_swarm")
WAIT_S = 120.0


def wait_for(condition, timeout: float = WAIT_S, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


def test_light_nodes_hear_their_models_ads_and_no_others(tmp_path: Path) -> None:
    swarm = LightSwarm(tmp_path, models=2, hardware_json=json.dumps(detect_hardware().to_wire()))
    try:
        swarm.add(6)
        swarm.wait_ready(WAIT_S)
        swarm.add(6)
        swarm.add(3, quiet=True)
        swarm.wait_ready(WAIT_S)
        nodes = {entry["index"]: entry for entry in swarm.ready_nodes()}
        assert len(nodes) == 15 and len({e["peer"] for e in nodes.values()}) == 15
        models = {i: role(i, 2, 10)[0][:8] for i in range(12)}
        publishers = {e["peer"]: i for i, e in nodes.items() if e["provider"] and i < 12}

        def heard() -> dict[int, set[int]]:
            """Receiver -> the publishers it accepted ads of."""
            found: dict[int, set[int]] = {}
            for member in swarm.members:
                for event in member.events():
                    if event["e"] == "recv":
                        found.setdefault(event["n"], set()).add(publishers.get(event["p"], -1))
            return found

        def everyone_heard_their_topic():
            found = heard()
            return found if all(found.get(i, set()) >= {p for p in publishers.values() if p != i
                                                        and models[p] == models[i]} for i in range(12)) else None

        found = wait_for(everyone_heard_their_topic, what="every node to hear every publisher of its model")
        for receiver, senders in found.items():
            assert receiver < 12, "a quiet node (its model has no provider) accepted an ad"
            assert all(s >= 0 and models[s] == models[receiver] for s in senders), \
                f"node {receiver} accepted an ad of another model's topic: {senders}"
        assert len(swarm.pids()) == 3
    finally:
        swarm.close()
    assert all(member.proc.returncode is not None for member in swarm.members), "a member outlived close()"
