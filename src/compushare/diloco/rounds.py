"""Forming a round's group without a coordinator.

A participant done with its inner steps provides the round's DHT key
(group.round_key), then looks the key up until it sees every peer it expects (the
last round's members, or the run's participants before the first round) or the run's
gather_s passes. The lowest ticket among the peers it sees leads: every other one
sends it a `join`; the leader admits joins with its own outer weights (base) until
everyone it sees and expects has joined, or gather_s after it got ready, then answers
every join with the sorted member list. A join sent to a peer that sees a lower
ticket is told `not_leader` and which peer leads (one redirect is followed). A peer
that is left out (late, or no leader answered) applies its own pseudo-gradient.
"""

from __future__ import annotations

import dataclasses
import logging
import trio
from libp2p.abc import IHost
from libp2p.kad_dht.kad_dht import KadDHT

from .. import wire
from ..net.dht import find_provider_infos_fresh
from . import messages
from .allreduce import ask
from .group import leader, round_key
from .run import RunRecord

log = logging.getLogger(__name__)

POLL_S = 1.0
LATE_FACTOR = 3  # a leader waits at most this many gather_s for a majority of the peers it expects
LONELY_FACTOR = 10  # the first peer ready waits at most this many gather_s for a second
DIAL_TIMEOUT_S = 10.0


@dataclasses.dataclass
class Lead:
    base: bytes
    joined: set[str]
    closed: trio.Event = dataclasses.field(default_factory=trio.Event)
    changed: trio.Event = dataclasses.field(default_factory=trio.Event)
    members: list[str] | None = None

    def add(self, peer: str) -> None:
        self.joined.add(peer)
        self.changed.set()
        self.changed = trio.Event()


@dataclasses.dataclass(frozen=True)
class Formed:
    members: list[str] | None  # None: no group (the member applies its own pseudo-gradient)
    resync: bool = False  # the leader holds other outer weights: fetch the run's state
    leader: str = ""


class Rounds:
    def __init__(self, host: IHost, dht: KadDHT, run: RunRecord, excluded: set[str],
                 addrs: dict[str, list]) -> None:
        self.host, self.dht, self.run, self.excluded, self.addrs = host, dht, run, excluded, addrs
        self.me = host.get_id().to_string()
        self.leads: dict[int, Lead] = {}
        self.decided: dict[int, str] = {}  # round -> the leader this peer chose
        self.decided_changed = trio.Event()
        self.current = -1  # the round being formed, or last formed
        self.announced: set[int] = set()  # rounds whose key this peer provided

    async def announce(self, round_: int) -> None:
        """Say in the DHT that this peer is ready to average `round_`."""
        if round_ not in self.announced:
            with trio.move_on_after(self.run.gather_s):
                await self.dht.provide(round_key(self.run.run_id, round_))
            self.announced = {r for r in self.announced if r > round_ - 4} | {round_}

    async def form(self, round_: int, base: bytes, expected: set[str]) -> Formed:
        self.current = round_
        key = round_key(self.run.run_id, round_)
        await self.announce(round_)
        view, deadline = await self._gather(key, expected)
        chosen = leader(self.run.run_id, round_, view)
        self._decide(round_, chosen)
        if chosen == self.me:
            self.leads[round_] = lead = Lead(base, {self.me})
            members = await self._lead(lead, key, expected, deadline)
            if len(members) < 2:  # nobody came (it was early, say): later comers choose again
                self.decided.pop(round_, None)
                self.leads.pop(round_, None)
            return Formed(members, leader=self.me)
        return await self._join(chosen, round_, base, deadline + LATE_FACTOR * self.run.gather_s)

    def _decide(self, round_: int, chosen: str) -> None:
        self.decided[round_] = chosen
        for old in [r for r in self.decided if r < round_ - 2]:
            self.decided.pop(old, None)
            self.leads.pop(old, None)
        self.decided_changed.set()
        self.decided_changed = trio.Event()

    async def providers(self, key: str) -> set[str]:
        """The peers providing `key` (a round's, or the run's), their addresses noted."""
        found = await find_provider_infos_fresh(self.dht, key)
        for peer_id, info in found.items():
            if info.addrs:
                self.addrs[peer_id.to_string()] = list(info.addrs)
        return {p.to_string() for p in found}

    async def _look(self, key: str) -> set[str]:
        return await self.providers(key) - self.excluded | {self.me}

    async def _gather(self, key: str, expected: set[str]) -> tuple[set[str], float]:
        """The peers ready for the round, once every expected one is, or gather_s after a
        second one was (the first ready waits for company: a joiner, or a fast member, is
        early), or at LONELY_FACTOR gather_s; and the deadline the round's leader keeps."""
        want = expected - self.excluded
        now = trio.current_time()
        deadline, cap = now + self.run.gather_s, now + LONELY_FACTOR * self.run.gather_s
        company = False
        while True:
            view = await self._look(key)
            if len(view) >= 2 and not company:
                company, deadline = True, trio.current_time() + self.run.gather_s
            now = trio.current_time()
            if view >= want or (company and now >= deadline) or now >= cap:
                return view, min(deadline, cap) if company else now
            await trio.sleep(POLL_S)

    async def _lead(self, lead: Lead, key: str, expected: set[str], deadline: float) -> list[str]:
        """Admit joins until everyone seen and expected has joined; past the deadline,
        once a majority of them has (a dead peer is not waited for twice, a slow one
        for up to LATE_FACTOR deadlines)."""
        want = set(expected)
        with trio.move_on_at(deadline + (LATE_FACTOR - 1) * self.run.gather_s):
            while True:
                want |= await self._look(key)
                want -= self.excluded
                if lead.joined >= want:
                    break
                if trio.current_time() >= deadline and 2 * len(lead.joined & want) > len(want):
                    break
                with trio.move_on_after(POLL_S):
                    await lead.changed.wait()
        # The expected first (the last round's members), then newcomers; the leader always.
        others = sorted(lead.joined - self.excluded - {self.me}, key=lambda p: (p not in expected, p))
        lead.members = sorted(others[:self.run.max_group - 1] + [self.me])
        lead.closed.set()
        return lead.members

    async def answer_join(self, peer: str, run_id: str, round_: int, base: bytes) -> dict:
        """A `join` of `peer`: answered once this peer's group for the round closes."""
        with trio.move_on_after(LATE_FACTOR * self.run.gather_s):
            while round_ not in self.decided and self.current <= round_:
                await self.decided_changed.wait()
        chosen = self.decided.get(round_)
        if chosen is None:
            return messages.error(wire.WRONG_ROUND, f"this peer is at round {self.current}, not {round_}")
        if chosen != self.me:
            return messages.error(wire.NOT_LEADER, "another peer leads this round", leader=chosen)
        lead = self.leads[round_]
        if lead.base != base:
            return messages.error(wire.WRONG_ROUND, "the leader's outer weights differ: fetch the run's state")
        if lead.closed.is_set():
            return messages.error(wire.TOO_LATE, "the round's group has closed")
        lead.add(peer)
        with trio.move_on_after((LATE_FACTOR + 1) * self.run.gather_s):
            await lead.closed.wait()
        if lead.members is None or peer not in lead.members:
            return messages.error(wire.TOO_LATE, "the round's group closed without this peer")
        return messages.group_reply(lead.members)

    async def _join(self, chosen: str, round_: int, base: bytes, deadline: float) -> Formed:
        for _redirect in range(2):
            try:
                budget = max(1.0, deadline - trio.current_time()) + self.run.gather_s
                reply = await self.ask(chosen, messages.join_request(self.run.run_id, round_, base), budget)
                if reply.get("type") == "group":
                    members = messages.members_field(reply)
                    return Formed(members if self.me in members else None, leader=chosen)
            except Exception as exc:  # no leader, a dead one, or a malformed group: this round alone
                log.info("round %d: join to %s failed: %s", round_, chosen[:12], exc)
                return Formed(None, leader=chosen)
            code = reply.get("code")
            if code == wire.NOT_LEADER and isinstance(reply.get("leader"), str) and reply["leader"] != chosen:
                chosen = reply["leader"]
                continue
            log.info("round %d: %s refused the join: %s %s", round_, chosen[:12], code, reply.get("message"))
            wrong_base = code == wire.WRONG_ROUND and "differ" in str(reply.get("message"))
            return Formed(None, resync=wrong_base, leader=chosen)
        return Formed(None, leader=chosen)

    async def ask(self, peer: str, request: dict, timeout: float = 60.0) -> dict:
        return await ask(self.host, self.addrs, peer, request, timeout, self.dht)
