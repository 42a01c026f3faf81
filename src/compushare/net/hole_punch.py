"""Hole punching: py-libp2p's DCUtR (libp2p.relay.circuit_v2.dcutr) with what a
stranger must not be able to turn it into. Any peer that reaches a node over a
circuit (a STOP stream from any directly connected peer will do) can start DCUtR
and name the addresses the node then dials. Here a punch

  - dials only the addresses the punched peer names in this session's CONNECT
    (TCP, no circuits, at most MAX_PUNCH_ADDRS, less its relay's own), once each
    per round: never the peerstore's (py-libp2p adds every address it holds for
    the peer, and writes each CONNECT's addresses there for 10 minutes, so each
    punch dialled all the earlier ones too, with the swarm's retries);
  - writes nothing into the peerstore, and makes no dial before the punch
    (py-libp2p first dials every peerstore address of the peer);
  - starts only within net/punch_budget's budget, per peer and in all; refusals are
    logged at debug and counted (Traversal.stats()["hole_punch"]);

and a peer's relayed connections close once they carry no stream of CompuShare's
own protocols (py-libp2p's close them 60 s after a punch, a session on them or not).
"""

from __future__ import annotations

import contextlib
import logging

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.dcutr import DCUtRProtocol, _local_tcp_listen_addrs

from .punch_budget import PunchBudget, PunchLimits
from .reachability import is_circuit

log = logging.getLogger(__name__)

DCUTR_DIAL_TIMEOUT_S = 3  # each direct dial of a hole punch (py-libp2p: 10 s)
MAX_PUNCH_ADDRS = 4  # addresses of a peer a hole punch dials at most
PUNCH_ROUNDS = 3  # the spec's retries: both sides must dial within the same window
ROUND_TIMEOUT_S = 5.0  # one round, at most
ROUND_GRACE_S = 1.0  # after our dials of a round failed, for the peer's own dial to reach us
ROUND_GAP_S = 2.0
RELAY_CLOSE_GRACE_S = 10.0  # after a punch, the relayed connection lives on this long, then until idle


class PatientDCUtR(DCUtRProtocol):
    def __init__(self, host: IHost, *, limits: PunchLimits = PunchLimits(), **kwargs) -> None:
        super().__init__(_WithoutAddressWrites(host), **kwargs)
        host._dcutr_protocol = self  # py-libp2p's disconnect hook finds it there (private in the pinned 0.8.1)
        self.budget = PunchBudget(limits)

    def _decode_observed_addrs(self, addr_bytes: list[bytes]) -> list[multiaddr.Multiaddr]:
        # A few TCP addresses are all a punch needs, never a list that aims the node at others.
        tcp = [a for a in super()._decode_observed_addrs(addr_bytes[:MAX_PUNCH_ADDRS * 4])
               if "/tcp/" in str(a) and not is_circuit(str(a))]
        return tcp[:MAX_PUNCH_ADDRS]

    async def _try_unilateral_upgrade(self, peer_id: ID) -> bool:
        # py-libp2p first dials every address of the peer in the peerstore (anyone's,
        # for all it knows). A peer that can be dialled directly is reached by the
        # punch of its own DCUtR session (this node dials its CONNECT's addresses).
        return False

    async def _perform_hole_punch(self, peer_id: ID, addrs: list[multiaddr.Multiaddr],
                                  as_responder: bool = False) -> bool:
        targets = self._punch_targets(peer_id, addrs)
        if not targets:
            return False
        if not self.budget.punch(peer_id.to_base58(), trio.current_time()):
            log.debug("hole punch to %s refused: past its budget of punches", peer_id)
            return False
        source = next(((ip, port) for _family, ip, port in _local_tcp_listen_addrs(self.host)), None)
        for round_ in range(PUNCH_ROUNDS):
            if round_:
                await trio.sleep(ROUND_GAP_S)
            if await self._verify_direct_connection(peer_id):
                break
            if not self.budget.dial(len(targets), trio.current_time()):
                log.debug("hole punch to %s stopped: past the node's budget of dials", peer_id)
                return False
            await self._round(peer_id, targets, source, as_responder)
        if not await self._verify_direct_connection(peer_id):
            return False
        self._direct_connections.add(peer_id)
        self._schedule_relay_close(peer_id)
        return True

    def _punch_targets(self, peer_id: ID, addrs: list[multiaddr.Multiaddr]) -> list[multiaddr.Multiaddr]:
        """The CONNECT's addresses (already filtered) less the relay's own: a peer's
        observed addresses may name the relay it is reached through."""
        relays = set()
        for conn in self.host.get_network().connections.get(peer_id, []):
            for addr in conn.get_transport_addresses():
                text = str(addr)
                if is_circuit(text) and "/p2p-circuit/p2p/" in text:
                    with contextlib.suppress(Exception):
                        relay = ID.from_base58(text.split("/p2p-circuit/p2p/")[1].split("/")[0])
                        relays.update(str(a) for a in self.host.get_peerstore().addrs(relay))
        return [a for a in addrs if not is_circuit(str(a)) and str(a) not in relays][:MAX_PUNCH_ADDRS]

    async def _round(self, peer_id: ID, targets, source, as_responder: bool) -> None:
        """One dial of each target at once; over once a direct connection is up, or
        ROUND_GRACE_S after our dials ended without one, or after ROUND_TIMEOUT_S."""
        with trio.move_on_after(ROUND_TIMEOUT_S):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._dial_all, peer_id, targets, source, as_responder, nursery.cancel_scope)
                while not await self._verify_direct_connection(peer_id):
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()

    async def _dial_all(self, peer_id: ID, targets, source, as_responder: bool, round_: trio.CancelScope) -> None:
        async with trio.open_nursery() as dials:
            for addr in targets:
                dials.start_soon(self._dial_once, peer_id, addr, source, as_responder)
        await trio.sleep(ROUND_GRACE_S)  # the peer's own dial may still reach us
        round_.cancel()

    async def _dial_once(self, peer_id: ID, addr: multiaddr.Multiaddr, source, as_responder: bool) -> None:
        """A single attempt (the swarm's dial_addr retries 3 more times)."""
        network = self.host.get_network()
        try:
            with trio.fail_after(self.dial_timeout):
                if as_responder:
                    await network.dial_addr_as_responder(addr, peer_id, source)
                else:
                    await network._dial_addr_single_attempt(addr, peer_id, source)  # private in the pinned 0.8.1
        except Exception as exc:  # refused, dropped, someone else answered
            log.debug("hole punch dial to %s at %s failed: %s", peer_id, addr, exc)

    async def _close_relayed_conns_after_grace(self, peer_id: ID, grace: float = RELAY_CLOSE_GRACE_S) -> None:
        while True:
            await trio.sleep(RELAY_CLOSE_GRACE_S)
            if not await self._verify_direct_connection(peer_id):
                return  # the direct connection went: keep the relayed one
            relayed = [conn for conn in self.host.get_network().connections.get(peer_id, [])
                       if all(is_circuit(str(a)) for a in conn.get_transport_addresses())]
            busy = 0
            for conn in relayed:
                if any(_carries_work(stream) for stream in conn.get_streams()):
                    busy += 1
                else:
                    with contextlib.suppress(Exception):
                        await conn.close()
            if not busy:
                return


class _WithoutAddressWrites:
    """The host as DCUtR sees it: the addresses a CONNECT names are not written into
    the peerstore (py-libp2p keeps them 10 minutes, for every later dial of that
    peer to try); everything else is the host itself."""

    def __init__(self, host: IHost) -> None:
        self._host = host

    def __getattr__(self, name: str):
        return getattr(self._host, name)

    def get_peerstore(self):
        return _PeerstoreWithoutAddressWrites(self._host.get_peerstore())


class _PeerstoreWithoutAddressWrites:
    def __init__(self, peerstore) -> None:
        self._peerstore = peerstore

    def __getattr__(self, name: str):
        return getattr(self._peerstore, name)

    def add_addrs(self, peer_id: ID, addrs, ttl: int) -> None:
        log.debug("DCUtR: %d addresses of %s not kept", len(addrs), peer_id)


def _carries_work(stream) -> bool:
    """A stream of CompuShare's own protocols (a session, a download): libp2p's own
    (identify, DHT, DCUtR...) are short or reopen on the direct connection."""
    try:
        return str(stream.get_protocol() or "").startswith("/compushare/")
    except Exception:  # not negotiated yet: count it as work
        return True
