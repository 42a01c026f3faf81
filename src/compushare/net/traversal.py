"""NAT traversal for one host, built from py-libp2p's own parts:

  AutoNAT     (libp2p.host.autonat)            whether peers can dial us back
  relay v2    (libp2p.relay.circuit_v2)        net/relay.QuotaRelay: slots and circuits for
                                               NAT'd peers, within net/relay_quota's quotas
  transport   (CircuitV2Transport)             dialling a NAT'd peer through its relay
  DCUtR       (libp2p.relay.circuit_v2.dcutr)  upgrading a relayed connection to a direct one
                                               by hole punching (TCP simultaneous open):
                                               net/hole_punch.PatientDCUtR, within
                                               net/punch_budget's budget

A node (`Traversal(..., serve=True)`) asks connected peers for AutoNAT verdicts
until net/reachability.Verdicts decides, and again every AUTONAT_PERIOD_S or when
its addresses change. Publicly reachable, it relays for others (unless relaying is
off). NAT'd, it holds reservations on WANT_RELAYS relays from the swarm's view,
replaces one within RELAY_CHECK_S of losing it, and advertises circuit addresses
through them (`addrs()`, read by ads, server records and karma records).

Every process's dials go through net/dial.dial, which finds its host's running
Traversal through net/relayed_dialers (where `run` registers it): a peer that advertises circuit addresses is dialled through its
relay at once; DCUtR then upgrades the connection (both ends drive it: the library
tries each relayed peer every 2 s), and new streams prefer the direct connection.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Sequence

import multiaddr
import trio
from libp2p.abc import IHost
from libp2p.host.autonat.autonat import AutoNATService
from libp2p.host.autonat.pb.autonat_pb2 import Message as AutoNATMessage
from libp2p.identity.identify_push.identify_push import push_identify_to_peers
from libp2p.kad_dht.kad_dht import DHTMode
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.config import RelayConfig, RelayRole
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.transport import CircuitV2Transport
from libp2p.tools.anyio_service import background_trio_service

from . import relayed_dialers
from .dial import dial
from .hole_punch import DCUTR_DIAL_TIMEOUT_S, PatientDCUtR
from .punch_budget import PunchLimits
from .reachability import (
    PRIVATE,
    PUBLIC,
    RelayCandidate,
    Verdicts,
    advertised_addrs,
    choose_relays,
    circuit_addrs,
    is_circuit,
    servers_to_ask,
)
from .relay import QuotaRelay
from .relay_quota import RelayQuotas

log = logging.getLogger(__name__)

AUTONAT_ASK = 4  # servers asked per round
AUTONAT_UNKNOWN_S = 2.0  # between rounds while undecided
AUTONAT_PERIOD_S = 120.0  # between rounds once decided
AUTONAT_TIMEOUT_S = 10.0  # one server's answer
DIAL_BACK_TIMEOUT_S = 5.0  # one dial-back a server makes (a NAT drops the SYN: no refusal comes)
DIAL_BACK_CONCURRENCY = 4  # dial-backs a server makes at once, for everyone together
WANT_RELAYS = 2
RELAY_CHECK_S = 2.0
RELAY_AVOID_S = 60.0  # a relay that refused or was lost is not asked again for this long
RESERVE_TIMEOUT_S = 10.0
REFRESH_AT = 0.8  # share of a reservation's lifetime after which it is renewed
CIRCUIT_DIAL_TIMEOUT_S = 10.0
PROTECT_TAG = "compushare-relay"  # connections to our relays are never pruned by the connection manager
# After reaching a peer through its relay, how long a dial waits for the hole punch
# before the caller opens its streams (on the relayed connection if the punch is not
# done by then): a punch takes a few round trips, or one SYN retransmission (1 s) when
# the first SYN reached the far NAT before that side's own SYN had opened it.
PUNCH_WAIT_S = 3.0
PUNCH_MARGIN_S = 0.5

_ASKER: contextvars.ContextVar[ID | None] = contextvars.ContextVar("autonat_asker", default=None)  # per handler task


def traversal_of(host: IHost) -> Traversal | None:
    """The Traversal running for `host`, if any (the one relayed_dialers holds)."""
    dialer = relayed_dialers.relayed_dialer_of(host)
    return dialer if isinstance(dialer, Traversal) else None


@contextlib.asynccontextmanager
async def client_traversal(host: IHost) -> AsyncIterator[Traversal]:
    """A short-lived client's traversal (`run`, `chat`, `models fetch`): it reaches
    NAT'd peers through their relays and hole-punches; it neither relays nor reserves."""
    async with trio.open_nursery() as nursery:
        traversal = Traversal(host, serve=False)
        await nursery.start(traversal.run)
        yield traversal
        nursery.cancel_scope.cancel()


async def dial_back(host: IHost, peer_id: ID, addr: multiaddr.Multiaddr) -> bool:
    """A fresh connection to `peer_id` at `addr`, up to its security handshake (which
    proves the peer id), then hung up: never one the swarm already has."""
    network = host.get_network()
    with contextlib.suppress(Exception):
        addr = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{peer_id.to_base58()}"))
    transport = network.transport_manager.transport_for_dialing(addr)
    if transport is None or is_circuit(str(addr)):
        return False
    raw = secured = None
    try:
        with trio.fail_after(DIAL_BACK_TIMEOUT_S):
            raw = await transport.dial(addr)
            secured = await network.upgrader.upgrade_security(raw, True, peer_id)
        return True
    except Exception:  # refused, dropped (timeout), or someone else answered
        return False
    finally:
        for conn in (secured, raw):
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()


class DialBackAutoNAT(AutoNATService):
    """py-libp2p's AutoNAT server answers a request through host.connect(), which
    returns at once when the asker is connected, as it always is (it asked over that
    connection): every node would look public. This one dials back afresh
    (`dial_back`), a few at a time for everyone together and one at a time per peer."""

    def __init__(self, host: IHost) -> None:
        super().__init__(host, serve=True)
        self._slots = trio.Semaphore(DIAL_BACK_CONCURRENCY)
        self._busy: set[bytes] = set()

    async def handle_stream(self, stream) -> None:
        _ASKER.set(stream.muxed_conn.peer_id)  # the connection's own peer, not the one a request names
        await super().handle_stream(stream)

    async def _handle_dial(self, message, observed_ip, is_relayed):
        asker = bytes(message.dial.peer.id)
        connection = _ASKER.get()
        if connection is None or asker != connection.to_bytes() or asker in self._busy or self._slots.value == 0:
            response = AutoNATMessage()
            response.type = AutoNATMessage.DIAL_RESPONSE
            response.dialResponse.status = AutoNATMessage.E_DIAL_REFUSED
            response.dialResponse.statusText = "busy"
            return response
        self._busy.add(asker)
        try:
            async with self._slots:
                return await super()._handle_dial(message, observed_ip, is_relayed)
        finally:
            self._busy.discard(asker)

    async def _try_dial(self, peer_id: ID, addrs: list[bytes]) -> bytes | None:
        for raw in addrs[:4]:
            try:
                addr = multiaddr.Multiaddr(raw)
            except Exception:
                continue
            if await dial_back(self.host, peer_id, addr):
                return bytes(raw)
        return None


def has_direct(host: IHost, peer_id: ID) -> bool:
    return any(not any(is_circuit(str(a)) for a in conn.get_transport_addresses())
               for conn in host.get_network().connections.get(peer_id, []))


class Traversal:
    """The NAT traversal of one host. `serve`: a long-running node (AutoNAT server
    and client, relay when public, reservations when NAT'd); otherwise a client
    that only dials (circuits, hole punching)."""

    def __init__(self, host: IHost, *, serve: bool, relay: bool = True, quotas: RelayQuotas = RelayQuotas(),
                 relay_candidates: Callable[[], Sequence[RelayCandidate]] = lambda: (),
                 own_addrs: Callable[[], list[str]] = lambda: [], max_addrs: int = 8,
                 on_change: Callable[[], None] = lambda: None, want_relays: int = WANT_RELAYS,
                 confirmations: int = 3, dht=None, punch: bool = True,
                 punch_limits: PunchLimits = PunchLimits()) -> None:
        self.host, self.serve, self.relaying = host, serve, relay
        self.relay_candidates, self.own_addrs, self.max_addrs = relay_candidates, own_addrs, max_addrs
        self.on_change, self.want_relays = on_change, want_relays
        self.dht = dht  # a node's KadDHT: served only while this node is dialable
        self.punch = punch  # hole punching (DCUtR) on: off, every connection to a NAT'd peer stays relayed
        self.verdicts = Verdicts(confirmations=confirmations)
        self.protocol: CircuitV2Protocol = (QuotaRelay(host, quotas, offer=self.offers_relay) if serve
                                            else CircuitV2Protocol(host, allow_hop=False))
        # Dialling side only: py-libp2p's CLIENT role reserves a slot on every relay it
        # dials through, which a consumer must not take.
        self.transport = CircuitV2Transport(host, self.protocol, RelayConfig(roles=RelayRole.STOP))
        self.dcutr = PatientDCUtR(host, limits=punch_limits, dial_timeout=DCUTR_DIAL_TIMEOUT_S)
        self.autonat = DialBackAutoNAT(host) if serve else None
        # relay -> (reservation expiry in trio time, its lifetime, our circuit addresses through it)
        self.held: dict[str, tuple[float, float, list[str]]] = {}
        self._avoid: dict[str, float] = {}  # relay -> until (trio time)
        self._relay_addrs: dict[str, list[str]] = {}  # relay -> its own addresses, as we reached it
        self._last_own: list[str] = []
        self.relayed_dials = 0  # connections this host opened through a relay
        self.punched = 0  # of those, upgraded to a direct connection within PUNCH_WAIT_S
        self._nursery: trio.Nursery | None = None

    @property
    def status(self) -> str:
        return self.verdicts.status

    def offers_relay(self) -> bool:
        return self.serve and self.relaying and self.status == PUBLIC

    def addrs(self) -> list[str]:
        """What this node advertises (net/reachability.advertised_addrs)."""
        relayed = [a for _expiry, _ttl, addrs in self.held.values() for a in addrs]
        return advertised_addrs(self.status, self.own_addrs(), relayed, self.max_addrs)

    def stats(self) -> dict:
        out = {"reachability": self.status, "relays": sorted(self.held), "relayed_dials": self.relayed_dials,
               "punched": self.punched, "hole_punching": self.punch, "relay_offered": self.offers_relay(),
               "hole_punch": self.dcutr.budget.stats()}
        if isinstance(self.protocol, QuotaRelay):
            out["relay"] = self.protocol.ledger.stats()
        return out

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        relayed_dialers.register(self.host, self)
        try:
            async with contextlib.AsyncExitStack() as services:
                await services.enter_async_context(background_trio_service(self.protocol))
                if self.punch:
                    await services.enter_async_context(background_trio_service(self.dcutr))
                nursery = await services.enter_async_context(trio.open_nursery())
                self._nursery = nursery
                if self.serve:
                    nursery.start_soon(self._reachability_loop)
                    nursery.start_soon(self._relay_loop)
                task_status.started()
                await trio.sleep_forever()
        finally:
            relayed_dialers.unregister(self.host, self)

    # -- dialling -------------------------------------------------------------

    async def dial_relayed(self, peer_id: ID, addrs: Sequence[str]) -> None:
        """A connection to `peer_id` through the first of its circuit addresses (tried
        in a random order) that answers (ConnectionError with the last failure if none
        does), then up to PUNCH_WAIT_S for the hole punch that makes it direct."""
        failure: Exception | None = None
        # In a random order: the peer's consumers spread over its relays' quotas.
        order = random.sample(list(addrs), len(addrs))
        for left, addr in zip(range(len(order), 0, -1), order):
            # A relay that vanished without a word must not eat the whole dial's time.
            budget = (trio.current_effective_deadline() - trio.current_time()) / left
            try:
                with trio.fail_after(min(CIRCUIT_DIAL_TIMEOUT_S, budget)):
                    await self.transport.dial(multiaddr.Multiaddr(addr))
                self.relayed_dials += 1
                break
            except Exception as exc:  # that relay is gone, refused, or the peer holds no slot there
                failure = exc
        else:
            raise ConnectionError(f"no relay reached {peer_id}: {failure}")
        if self._nursery is None or not self.punch:
            return
        # Both ends drive the punch (py-libp2p's DCUtR also tries every relayed peer
        # every 2 s); whichever gets through first gives the direct connection. Ours
        # ending without one (the peer runs no DCUtR, or its NAT defeated it) ends the wait.
        ours_done = trio.Event()

        async def punch() -> None:
            try:
                await self.dcutr.initiate_hole_punch(peer_id)
            finally:
                ours_done.set()

        self._nursery.start_soon(punch)
        # Within the caller's own deadline, with time left to open its stream.
        wait = min(PUNCH_WAIT_S, trio.current_effective_deadline() - trio.current_time() - PUNCH_MARGIN_S)
        with trio.move_on_after(max(0.0, wait)):
            while not has_direct(self.host, peer_id) and not ours_done.is_set():
                await trio.sleep(0.02)
        if has_direct(self.host, peer_id):
            self.punched += 1

    # -- AutoNAT ----------------------------------------------------------------

    def _direct_peers(self) -> list[str]:
        peers = list(self.host.get_network().connections)
        return sorted(peer.to_base58() for peer in peers if has_direct(self.host, peer))

    async def _ask_addrs(self) -> list[bytes]:
        """Our listen addresses and, NAT'd, where the NAT maps them (as DCUtR predicts
        it: the observed external IP with our listen port)."""
        own = [multiaddr.Multiaddr(a.split("/p2p/")[0]).to_bytes() for a in self.own_addrs() if not is_circuit(a)]
        predicted = await self.dcutr._get_observed_addrs()
        return list(dict.fromkeys(own + list(predicted)))

    async def _reachability_loop(self) -> None:
        while True:
            before = self.status
            own = sorted(self.own_addrs())
            if own != self._last_own:
                if self._last_own:
                    log.info("our addresses changed: reachability checked again")
                self._last_own = own
                self.verdicts.forget()
            servers = self._direct_peers()
            random.shuffle(servers)  # no peer can grind an id that is always asked first
            now = trio.current_time()
            ask = servers_to_ask(servers, self.verdicts.asked(now), AUTONAT_ASK)
            if ask:
                addrs = await self._ask_addrs()
                async with trio.open_nursery() as nursery:
                    for server in ask:
                        nursery.start_soon(self._ask, server, addrs)
                self.verdicts.decide(trio.current_time(), len(servers))
            if self.status != before:
                log.info("reachability: %s (AutoNAT, %d servers asked)", self.status, len(ask))
                if self.status != PRIVATE:
                    for relay in list(self.held):
                        self._drop(relay)
                if self.dht is not None:
                    # Peers would put a NAT'd node's unreachable addresses in their routing
                    # tables and wait on them in every look-up: it serves the DHT no more.
                    await self.dht.switch_mode(DHTMode.CLIENT if self.status == PRIVATE else DHTMode.SERVER)
                    with contextlib.suppress(Exception), trio.move_on_after(AUTONAT_TIMEOUT_S):
                        await push_identify_to_peers(self.host)  # peers learn it now, not at their next identify
                self.on_change()
            await trio.sleep(AUTONAT_PERIOD_S if self.status in (PUBLIC, PRIVATE) else AUTONAT_UNKNOWN_S)

    async def _ask(self, server: str, addrs: list[bytes]) -> None:
        try:
            status, _addr = await self.autonat.query_server(ID.from_base58(server), addrs, timeout=AUTONAT_TIMEOUT_S)
        except Exception as exc:  # the server is gone or does not speak AutoNAT: no verdict
            log.debug("AutoNAT: %s gave no answer: %s", server, exc)
            return
        if status == AutoNATMessage.OK:
            self.verdicts.record(server, True, trio.current_time())
        elif status == AutoNATMessage.E_DIAL_ERROR:
            self.verdicts.record(server, False, trio.current_time())
        # E_DIAL_REFUSED, E_BAD_REQUEST, E_INTERNAL_ERROR: that server did not try

    # -- reservations -----------------------------------------------------------

    async def _relay_loop(self) -> None:
        while True:
            await trio.sleep(RELAY_CHECK_S)
            if self.status != PRIVATE:
                continue
            now = trio.current_time()
            changed = False
            connected = self.host.get_network().connections
            for relay, (expiry, ttl, _addrs) in list(self.held.items()):
                if self.status != PRIVATE:  # changed while we awaited a reservation
                    break
                if not connected.get(ID.from_base58(relay)) or expiry <= now:
                    log.warning("relay %s lost: finding another", relay)
                    self._drop(relay)
                    self._avoid[relay] = now + RELAY_AVOID_S
                    changed = True
                elif expiry - now < (1 - REFRESH_AT) * ttl:
                    await self._reserve(relay, self._relay_addrs.get(relay, []))
            self._avoid = {r: until for r, until in self._avoid.items() if until > now}
            for candidate in choose_relays(list(self.held), self.relay_candidates(), self.want_relays,
                                           avoid=self._avoid):
                if self.status != PRIVATE:
                    break
                if await self._reserve(candidate.peer_id, list(candidate.addrs)):
                    changed = True
                else:
                    self._avoid[candidate.peer_id] = trio.current_time() + RELAY_AVOID_S
            if changed:
                self.on_change()

    def _drop(self, relay: str) -> None:
        self.held.pop(relay, None)
        with contextlib.suppress(Exception):
            self.host.get_network().unprotect(ID.from_base58(relay), PROTECT_TAG)

    async def _reserve(self, relay: str, addrs: list[str]) -> bool:
        peer = ID.from_base58(relay)
        try:
            await dial(self.host, peer, [a for a in addrs if not is_circuit(a)], timeout=RESERVE_TIMEOUT_S)
            with trio.fail_after(RESERVE_TIMEOUT_S):
                stream = await self.host.new_stream(peer, [HOP_PROTOCOL])
                try:
                    ok = await self.transport._make_reservation(stream, peer)  # private in the pinned 0.8.1
                finally:
                    with contextlib.suppress(Exception):
                        await stream.close()
        except Exception as exc:
            log.info("relay %s: no reservation: %s", relay, exc)
            return False
        if not ok:
            log.info("relay %s refused a reservation", relay)
            return False
        if self.status != PRIVATE:  # found public while it was being made: not needed
            return False
        expires_unix = self.transport._reservations.get(peer, 0)  # private in the pinned 0.8.1
        ttl = max(60.0, expires_unix - time.time())
        relay_addrs = [a for a in addrs if not is_circuit(a)]
        self._relay_addrs[relay] = relay_addrs
        with contextlib.suppress(Exception):  # the slot lives as long as this connection: never prune it
            self.host.get_network().protect(peer, PROTECT_TAG)
        self.held[relay] = (trio.current_time() + ttl, ttl, circuit_addrs(relay, relay_addrs, self.host.get_id().to_base58()))
        log.info("reserved a relay slot on %s for %.0f s", relay, ttl)
        return True
