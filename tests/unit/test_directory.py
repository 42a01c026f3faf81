"""net/directory.py: the swarm beyond the models a node follows, pulled from its
neighbours' views only while its user looks, and shown for a while after."""

from __future__ import annotations

import time
from types import SimpleNamespace

import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.hardware import Hardware
from compushare.net import directory
from compushare.net.ads import Serving, make_ad
from compushare.net.view import SwarmView

HW = Hardware(cpu_cores=2, ram_mb=24000, ram_free_mb=20000, gpu=None, gpu_mb=0)


def _ad(model: str, ttl_s: float = 3.0):
    key = create_new_key_pair()
    return make_ad(key, ID.from_pubkey(key.public_key).to_base58(), [], HW,
                   [Serving(model, 0, 2, "float32", free_tokens=1, load=0.0, block_rate=1.0)], "0.1.0", ttl_s=ttl_s)


def test_pulls_only_while_looked_at_and_shows_what_it_pulled(monkeypatch):
    own, other = _ad("ab" * 32), _ad("cd" * 32)
    asked = []

    async def fake_fetch(host, peer, view, model_id=None):
        asked.append(peer)
        view.replace(other, time.time())
        return 1

    monkeypatch.setattr(directory, "fetch_view", fake_fetch)
    host = SimpleNamespace(get_network=lambda: SimpleNamespace(connections={"p1": 0, "p2": 0}))
    view = SwarmView(policy=False)
    view.replace(own, time.time())

    async def main() -> None:
        found = directory.Directory(host, view)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(found.run)
            await trio.sleep(5 * directory.PERIOD_S)
            assert asked == []  # nobody looked: no pull
            assert {ad.peer_id for ad in found.picture().live(time.time())} == {own.peer_id}
            await trio.sleep(1)  # the first look pulls at once
            assert sorted(asked) == ["p1", "p2"]
            peers = {ad.peer_id for ad in found.picture(look=False).live(time.time())}
            assert peers == {own.peer_id, other.peer_id}  # shown though its own 3 s lifetime may end first
            await trio.sleep(directory.DEMAND_S + 3 * directory.PERIOD_S)
            pulls = len(asked)
            await trio.sleep(5 * directory.PERIOD_S)
            assert len(asked) == pulls  # the look is over: no more pulls
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
