"""What a consumer measures before choosing a route: a ping to every candidate
server, and their live load, free KV tokens and speed from capability ads.

A short-lived client has not been on the gossip topic for a period, so it asks the
peers it is connected to for their views (net/gossip.fetch_view): every ad is
re-checked against its own signer, so a relaying peer cannot invent load figures.
"""

from __future__ import annotations

import logging
import time

import trio
from libp2p.abc import IHost
from libp2p.host.ping import PingService

from ...net.dial import dial
from ...net.gossip import learn_views
from ...net.records import ServerRecord
from ...net.view import SwarmView
from .routing import Measure

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 2.0
MAX_PINGS = 64


async def ping_rtt(host: IHost, record: ServerRecord) -> float:
    """One round trip on an open ping stream (the first ping also pays for the stream)."""
    info = await dial(host, record.peer_id, record.addrs, timeout=PING_TIMEOUT_S)
    stamps = []
    async for _rtt in PingService(host).ping_iter(info.peer_id, ping_amt=2):
        stamps.append(time.perf_counter())
    began = stamps[0]
    return stamps[1] - began


async def measure_servers(host: IHost, records: list[ServerRecord], view: SwarmView, *,
                          learn: bool = True) -> tuple[dict[str, Measure], set[str]]:
    """Measures per peer id, and the peers not to use: those that did not answer a
    ping, and those whose live ad no longer serves the span their DHT record names
    (they moved, or are loading a move; the record lags by up to a TTL)."""
    rtts: dict[str, float] = {}
    unreachable: set[str] = set()
    peers = {r.peer_id: r for r in records}

    async def ping(record: ServerRecord) -> None:
        try:
            with trio.fail_after(PING_TIMEOUT_S):
                rtts[record.peer_id] = await ping_rtt(host, record)
        except Exception as exc:
            log.info("server %s did not answer a ping: %s", record.peer_id, exc)
            unreachable.add(record.peer_id)

    async with trio.open_nursery() as nursery:
        if learn:  # (the caller may have just done so)
            nursery.start_soon(learn_views, host, view)
        for record in list(peers.values())[:MAX_PINGS]:
            nursery.start_soon(ping, record)
    now = time.time()
    measures = {}
    for peer, record in peers.items():
        ad = view.get(peer, now)
        serving = None
        if ad is not None:
            serving = next((s for s in ad.serving_of(record.model_id) if s.state == "serving"
                            and (s.start, s.end) == (record.start, record.end)), None)
            if serving is None:
                unreachable.add(peer)
        measures[peer] = Measure(
            rtt_s=rtts.get(peer),
            block_rate=serving.block_rate if serving else 0.0,
            load=serving.load if serving else 0.0,
            free_tokens=serving.free_tokens if serving else None,
        )
    return measures, unreachable
