"""The swarm beyond the models a node follows, for its user's eyes only.

Since protocol revision 22 a node hears the ads of the models it serves or consumes,
not the others' (net/ad_intake.py). Its dashboard and its chat page's model picker
still show the whole swarm as its neighbours know it: while they are looked at (and
DEMAND_S after), a Directory pulls the views of up to PEERS connected peers every
PERIOD_S (at once on the first look after a quiet spell). The pulled ads go into a
picture of their own, never into the node's view: they are not handed out again by
/compushare/view, nor used for routing or placement, and the picture shows each until
SHOWN_S after it was last pulled even where its own lifetime is shorter ("as a
neighbour knew it lately"); at most MAX_PEERS of them. Each pulled ad is checked once per digest (net/gossip.RELAYED_ADS), so a
quiet UI costs nothing and a watched one at most PEERS view replies a period.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time

import trio
from libp2p.abc import IHost

from .gossip import fetch_view
from .ads import CapabilityAd
from .view import MAX_PEERS, SwarmView

PERIOD_S = 10.0
PEERS = 4
DEMAND_S = 120.0
SHOWN_S = 3 * PERIOD_S


class Directory:
    def __init__(self, host: IHost, view: SwarmView) -> None:
        self.host = host
        self.view = view  # the node's own (fed by gossip)
        self.pulled: dict[str, tuple[CapabilityAd, float]] = {}  # peer id -> its ad, shown until (unix s)
        self._wanted_at = -float("inf")
        self._now = trio.Event()

    def picture(self, *, look: bool = True) -> SwarmView:
        """The node's view and the pulled ads together (a fresh view; the node's ads win
        ties). `look`: a user looks at it now, so keep pulling (the dashboard's
        periodic samples pass False)."""
        if look:
            if trio.current_time() - self._wanted_at > DEMAND_S:
                self._now.set()  # the first look after a quiet spell: pull at once
            self._wanted_at = trio.current_time()
        now = time.time()
        picture = SwarmView(policy=False)
        for ad in self.view.live(now):
            picture.replace(ad, now)
        for ad, shown_until in list(self.pulled.values()):
            if now < shown_until:
                picture.replace(dataclasses.replace(ad, expires=max(ad.expires, shown_until)), now)
        return picture

    async def run(self) -> None:
        while True:
            if trio.current_time() - self._wanted_at <= DEMAND_S:
                await self.pull()
            with trio.move_on_after(PERIOD_S):
                await self._now.wait()
            self._now = trio.Event()

    async def pull(self) -> None:
        connected, pulled = list(self.host.get_network().connections), SwarmView(policy=False)
        async with trio.open_nursery() as nursery:
            for peer in random.sample(connected, min(PEERS, len(connected))):
                nursery.start_soon(self._one, peer, pulled)
        now = time.time()
        for ad in pulled.live(now):
            known = self.pulled.get(ad.peer_id)
            if known is None or ad.seq >= known[0].seq:
                self.pulled[ad.peer_id] = (ad, now + SHOWN_S)
        self.pulled = {peer: item for peer, item in self.pulled.items() if now < item[1]}
        if len(self.pulled) > MAX_PEERS:  # the latest shown first
            self.pulled = dict(sorted(self.pulled.items(), key=lambda item: -item[1][1])[:MAX_PEERS])

    async def _one(self, peer, pulled: SwarmView) -> None:
        with contextlib.suppress(Exception):  # a peer that does not answer is asked again next period
            await fetch_view(self.host, peer, pulled)
