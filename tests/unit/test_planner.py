"""pipeline/client/planner.py: a look-up that finds no server has the candidates
refreshed early (a restarted replica is a standby again within a second or so of
being seen), not REFRESH_S later; and says why each known server was no candidate."""

from __future__ import annotations

import math
import time

import trio

from compushare.net.records import ServerRecord
from compushare.pipeline.client.planner import SwarmPlanner


def record(peer: str, start: int = 0, end: int = 4) -> ServerRecord:
    return ServerRecord(peer, "m", start, end, "float32", (), math.inf, 0)


async def test_a_look_up_finding_nobody_refreshes_the_candidates_early(autojump_clock, caplog):
    planner = SwarmPlanner(None, None, "m", 4)
    refreshed: list[float] = []

    async def refresh() -> None:
        refreshed.append(trio.current_time())
        planner.records = [record("primary"), record("back-again")]

    planner.refresh = refresh
    planner.records = [record("primary")]
    planner.penalties.fault("penalised", time.monotonic())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(planner.refresh_loop)
        began = trio.current_time()
        with caplog.at_level("INFO"):
            assert planner.verifier(0, 4, {"primary"}) is None
        assert "primary in the chain" in caplog.text
        while not refreshed:
            await trio.sleep(0.1)
        assert refreshed[0] - began <= SwarmPlanner.WANTED_S + 0.2  # not REFRESH_S later
        assert planner.verifier(0, 4, {"primary"}).peer_id == "back-again"
        await trio.sleep(SwarmPlanner.REFRESH_S + 0.5)  # then the usual period
        assert len(refreshed) == 2 and refreshed[1] - refreshed[0] >= SwarmPlanner.REFRESH_S
        nursery.cancel_scope.cancel()
