"""Route choice with real node processes: of two servers for the same span, the
consumer routes through the fast one (issue 3)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import trio
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.model.catalog import import_path
from compushare.karma.record import karma_validators
from compushare.net.peer import open_swarm_host
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.planner import SwarmPlanner
from compushare.pipeline.client.sampling import SamplingParams

SLOWDOWN = "100"  # its compute takes 100x as long: tens of ms per step instead of a fraction of one


async def test_routes_avoid_the_slow_server(processes, tiny_model, tmp_path):
    (a,) = processes.nodes([("a", "0:2")], tiny_model)
    boot = a["addrs"][:1]
    fast_proc, _ = processes.node("fast", tiny_model, "2:4", bootstrap=boot, wait=False)
    slow_proc, _ = processes.node("slow", tiny_model, "2:4", bootstrap=boot, wait=False,
                                  extra=["--debug-slowdown", SLOWDOWN])
    fast, slow = processes.ready("fast", fast_proc), processes.ready("slow", slow_proc)

    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               listen=["/ip4/127.0.0.1/tcp/0"], bootstrap=boot) as swarm:
        host, dht = swarm.host, swarm.dht
        with trio.fail_after(60):
            for _ in range(3):
                route = await SwarmPlanner(host, dht, a["model_id"], 4).first_route()
                assert [(h.peer_id, h.start, h.end) for h in route] == [(a["peer_id"], 0, 2),
                                                                        (fast["peer_id"], 2, 4)]

    client = tmp_path / "client"
    import_path(tiny_model, client, alias="tiny")
    with trio.fail_after(60):
        outcome = await run_prompt(client, tuple(boot), RunRequest(
            model="tiny", prompt=[1, 5, 9], params=SamplingParams(max_new_tokens=4, stop_at_eos=False)))
    used = [h.peer_id for h in outcome.route]
    assert fast["peer_id"] in used and slow["peer_id"] not in used
    assert len(outcome.tokens) == 4

    # `compushare status` shows the three servers, one bar per block, and the roles.
    # Polled: a server publishes its first ad while loading and its "serving" ad no
    # sooner than 1 s later (the publishing interval), and the test gets here sooner.
    deadline = time.monotonic() + 30
    while True:
        shown = subprocess.run([sys.executable, "-m", "compushare", "status", "--bootstrap", boot[0],
                                "--home", str(tmp_path / "status")],
                               capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))
        assert shown.returncode == 0, shown.stderr
        bars = [line for line in shown.stdout.splitlines() if "█" in line]
        if "loading" not in shown.stdout or time.monotonic() > deadline:
            break
    assert "this node: consumer" in shown.stdout and "3 peers" in shown.stdout
    for node in (a, fast, slow):
        assert node["peer_id"][-12:] in shown.stdout
    assert len(bars) == 4 and bars[0].split()[-1] == "1" and bars[3].split()[-1] == "2"
