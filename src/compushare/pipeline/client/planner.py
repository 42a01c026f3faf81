"""Where a consumer's chains find servers (SwarmPlanner): the model's server records
from the DHT and the ads, measured, refreshed in the background, and planned into
routes (routing.plan_route) around the peers this consumer avoids."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import trio

from ...errors import RouteError
from ...karma.service import KarmaBook
from ...net.gossip import learn_views
from ...net.records import ServerRecord
from ...net.view import SwarmView
from .discovery import KARMA_LOOKUP_S, discover_servers
from .measure import measure_servers
from .routing import Hop, Measure, plan_route
from .spotcheck import Penalties

log = logging.getLogger(__name__)

DISCOVERY_WAIT_S = 6.0  # a swarm that is still settling: wait this long for a full route


def in_format(records: list[ServerRecord], fmt: str | None) -> list[ServerRecord]:
    """The records naming `fmt` (the model id's weight format): a chain never mixes
    formats. A record naming none is fp32's (older nodes', and fp32 servers leave it
    unsaid); the session's Opened reply is checked too (pipeline/client/hop.open_hop)."""
    if fmt is None:
        return records
    dropped = [r for r in records if (r.fmt or "fp32") != fmt]
    if dropped:
        log.warning("left out %d server(s) whose records name another weight format than %s: %s", len(dropped), fmt,
                    ", ".join(f"{r.peer_id[-8:]} ({r.fmt})" for r in dropped[:4]))
    return [r for r in records if (r.fmt or "fp32") == fmt]


def records_from_ads(view: SwarmView, model_id: str, now: float) -> list[tuple[ServerRecord, Measure]]:
    """Server records made from live capability ads (each signed by its server) of
    peers serving a span of `model_id`, with what the ads say of their speed and
    room: a second way to learn of servers."""
    found = []
    for ad in view.live(now):
        for serving in ad.serving_of(model_id):
            if serving.state == "serving" and ad.addrs:
                record = ServerRecord(peer_id=ad.peer_id, model_id=model_id, start=serving.start,
                                      end=serving.end, dtype=serving.dtype, addrs=ad.addrs,
                                      expires=ad.expires, seq=0, fmt=serving.fmt)
                found.append((record, Measure(block_rate=serving.block_rate, load=serving.load,
                                              free_tokens=serving.free_tokens)))
    return found


class SwarmPlanner:
    """Where a consumer's chains find servers: the model's server records and their
    measurements, refreshed in the background so that a failover plans at once
    instead of waiting on the DHT, and the peers this consumer avoids."""

    REFRESH_S = 5.0
    WANTED_S = 1.0  # a look-up that found nobody has the candidates refreshed this soon (at most this often)
    RETRY_S = 0.5

    def __init__(self, host, dht, model_id: str, num_blocks: int, *, needed_tokens: int = 0,
                 penalties: Penalties | None = None, view: SwarmView | None = None,
                 karma: KarmaBook | None = None, private: bool = False, fmt: str | None = None,
                 follow: Callable[[str], None] | None = None) -> None:
        self.host, self.dht = host, dht
        self.follow = follow  # joins the model's ad topic (a node's gossip), on the first plan
        self.fmt = fmt  # the model's weight format: records naming another are left out
        # Private mode: only servers whose live ad offers encrypted products, rated by
        # that (much slower) rate.
        self.private = private
        self.model_id, self.num_blocks = model_id, num_blocks
        self.needed_tokens = needed_tokens
        self.penalties = penalties or Penalties()
        self.view = SwarmView() if view is None else view
        self.karma = KarmaBook() if karma is None else karma
        self.records: list = []
        self.measures: dict = {}
        self.unreachable: set[str] = set()
        self._wanted = trio.Event()  # set by a look-up that found nobody: refresh early

    async def refresh(self) -> None:
        """Look the servers up again. What a look-up misses is not forgotten: while
        servers restart, the DHT may briefly hold none of a span's records (they
        lived on nodes that went down), and a failover must still have candidates.
        Servers whose capability ads say they serve the model count too."""
        now = time.time()
        known = {r.peer_id: r for r in self.records if r.is_live(now)}
        for record in await discover_servers(self.dht, self.model_id, self.num_blocks):
            if record.peer_id not in known or record.seq >= known[record.peer_id].seq:
                known[record.peer_id] = record
        # A restarted server listens on new addresses; its live ad (at most three of its
        # periods old, signed by it) has them before its next DHT record does. Only this
        # model's ads are asked for: the servers met so far follow its topic.
        await learn_views(self.host, self.view, self.model_id, sample=True)
        records = []
        for record in known.values():
            ad = self.view.get(record.peer_id, now)
            if ad is not None:
                serving = ad.serving_of(self.model_id)
                if serving and not any(s.state == "serving" for s in serving):
                    continue  # paused or moving, says its live ad: it would refuse a session
                if ad.addrs and set(ad.addrs) != set(record.addrs):
                    record = dataclasses.replace(record, addrs=ad.addrs)
            records.append(record)
        # Servers known only from their ads are pinged like the others: a crashed one's
        # ad can outlive its DHT record by up to three (stretched) periods.
        records += [record for record, _ in records_from_ads(self.view, self.model_id, time.time())
                    if record.peer_id not in known]
        measures, unreachable = await measure_servers(self.host, records, self.view, learn=False)
        measures = {peer: dataclasses.replace(m, karma=self.karma.get(peer)) for peer, m in measures.items()}
        if self.private:
            records, measures = self._private_only(records, measures, time.time())
        self.records, self.measures, self.unreachable = in_format(records, self.fmt), measures, unreachable

    def _private_only(self, records, measures, now):
        kept, rated = [], {}
        for record in records:
            ad = self.view.get(record.peer_id, now)
            rates = [s.private_rate for s in (ad.serving_of(self.model_id) if ad is not None else [])
                     if s.start <= record.start and record.end <= s.end and s.private_rate > 0]
            if rates:
                kept.append(record)
                rated[record.peer_id] = dataclasses.replace(measures.get(record.peer_id, Measure()),
                                                            block_rate=max(rates))
        return kept, rated

    async def karma_loop(self) -> None:
        """Keep the candidates' karma checked, in the background: it only breaks ties
        between routes, so no plan ever waits for it (the first one may not have it)."""
        while True:
            await self.karma.refresh(self.host, self.dht, [r.peer_id for r in self.records],
                                     timeout_s=KARMA_LOOKUP_S)
            await trio.sleep(self.REFRESH_S)

    async def refresh_loop(self) -> None:
        """Every REFRESH_S, or WANTED_S after the last refresh when a look-up found
        nobody (a standby or verifier wanted: a restarted server is back as soon as its
        live ad says it serves)."""
        while True:
            with trio.move_on_after(self.REFRESH_S):
                await trio.sleep(self.WANTED_S)
                await self._wanted.wait()
            self._wanted = trio.Event()
            try:
                await self.refresh()
            except Exception as exc:  # a failed refresh keeps the last candidates
                log.info("refreshing the candidate servers failed: %s", exc)

    def _exclude(self) -> frozenset[str]:
        return self.penalties.excluded(time.monotonic()) | frozenset(self.unreachable)

    def plan_now(self, start: int = 0, end: int | None = None) -> list[Hop]:
        def plan(exclude: frozenset[str]) -> list[Hop]:
            return plan_route(self.records, self.num_blocks, now=time.time(), measures=self.measures,
                              needed_tokens=self.needed_tokens, exclude=exclude, start=start, end=end)

        try:
            return plan(self._exclude())
        except RouteError:
            if not self.unreachable:
                raise
        # "Unreachable" may be stale (a missed ping, an ad from before a server was
        # ready): better to try such a server than to have no route at all.
        return plan(self.penalties.excluded(time.monotonic()))

    async def first_route(self, wait_s: float = DISCOVERY_WAIT_S) -> list[Hop]:
        """The first chain through every block: the servers looked up, then planned,
        looking again for up to `wait_s` while a swarm settles. In a node, the model's
        ad topic is joined from here on."""
        if self.follow is not None:
            self.follow(self.model_id)
        await self.refresh()
        return await self.plan(0, self.num_blocks, deadline=trio.current_time() + wait_s)

    async def plan(self, start: int, end: int, *, deadline: float) -> list[Hop]:
        while True:
            try:
                return self.plan_now(start, end)
            except RouteError as exc:
                if trio.current_time() >= deadline:
                    raise
                log.info("no route through blocks %d:%d yet (%s; avoiding %s, unreachable %s); looking again",
                         start, end, exc, sorted(p[-8:] for p in self.penalties.excluded(time.monotonic())),
                         sorted(p[-8:] for p in self.unreachable))
            with trio.move_on_at(deadline):
                await trio.sleep(self.RETRY_S)
                try:
                    await self.refresh()
                except Exception as exc:  # plan with what is known; the deadline bounds the wait
                    log.info("refreshing the candidate servers failed: %s", exc)

    def replaceable(self, start: int, end: int, peer_id: str) -> bool:
        """Whether a route through blocks start..end-1 avoiding `peer_id` (and the
        peers avoided now) is known: a late hop that has none is waited for."""
        try:
            plan_route(self.records, self.num_blocks, now=time.time(), measures=self.measures,
                       needed_tokens=self.needed_tokens, exclude=self._exclude() | {peer_id}, start=start, end=end)
        except RouteError:
            return False
        return True

    def verifier(self, start: int, end: int, exclude: set[str]) -> Hop | None:
        """A server holding start..end-1 outside `exclude`, the closest first; None if
        there is none now (the candidates are then refreshed early: refresh_loop)."""
        now, excluded = time.time(), self._exclude() | exclude
        holders = [r for r in self.records if r.start <= start and end <= r.end and r.is_live(now)
                   and r.peer_id not in excluded]
        if not holders:
            self._wanted.set()
            log.info("no server of blocks %d:%d outside the chain: %s", start, end, self._why_not(start, end, exclude))
            return None

        def rtt(record) -> float:
            measure = self.measures.get(record.peer_id)
            return measure.rtt_s if measure is not None and measure.rtt_s is not None else 1.0

        return Hop(min(holders, key=lambda r: (rtt(r), r.peer_id)), start, end)

    def _why_not(self, start: int, end: int, exclude: set[str]) -> str:
        """Why each known server of start..end-1 is no candidate now (for the log)."""
        now, penalised = time.time(), self.penalties.excluded(time.monotonic())
        reasons = []
        for record in self.records:
            if record.start <= start and end <= record.end:
                why = ("in the chain" if record.peer_id in exclude else "penalised" if record.peer_id in penalised
                       else "unreachable" if record.peer_id in self.unreachable
                       else "record expired" if not record.is_live(now) else "?")
                reasons.append(f"{record.peer_id[-8:]} {why}")
        return ", ".join(reasons) or "none known (a restarted one not seen serving again yet)"
