"""Circuit relay v2 (py-libp2p's CircuitV2Protocol) with CompuShare's quotas.

py-libp2p's relay carries the protocol: reservations, vouchers, the STOP side that
turns an incoming circuit into a connection. What it lacks is enforced here, in
three overrides, each asking net/relay_quota.RelayLedger first:

  _handle_reserve   a slot only while this node serves as a relay (publicly
                    reachable, relaying on), within the reservation quota; the slot
                    is the connection's own peer's (the message's `peer` field is
                    not trusted); py-libp2p's own reservation table follows the
                    ledger (a slot the ledger freed is gone from it too)
  _handle_connect   a circuit only within the circuit and byte quotas, refused with
                    RESOURCE_LIMIT_EXCEEDED (NO_RESERVATION when the target holds none)
  _relay_data       every chunk accounted before it is passed on; over the circuit's
                    bytes or duration the circuit is reset, both directions at once
                    (its quota is free then, not at its duration's end). It closes
                    only its own circuit's streams (py-libp2p's closes whatever
                    circuit last registered under the same peer) and passes a
                    half-close on.

and a fourth, `_handle_hop_stream`, that never leaves a HOP stream open after it.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable

import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.protocol import CircuitV2Protocol
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode
from libp2p.relay.circuit_v2.resources import RelayLimits

from .relay_quota import KINDS, RelayLedger, RelayQuotas, Refusal

log = logging.getLogger(__name__)

CHUNK = 64 * 1024
WRITE_TIMEOUT_S = 15.0
HALF_CLOSE_GRACE_S = 5.0  # after one end closes its side, the other has this long to finish
WATCH_S = 5.0  # how often a circuit checks that both its ends are still connected
HALF_CLOSED = Refusal("half_closed", "one end closed its side")  # no quota involved: _carry's EOF


class QuotaRelay(CircuitV2Protocol):
    def __init__(self, host: IHost, quotas: RelayQuotas, *, offer: Callable[[], bool]) -> None:
        limits = RelayLimits(duration=quotas.circuit_duration_s, data=quotas.circuit_bytes,
                             max_circuit_conns=quotas.circuits_per_peer, max_reservations=quotas.reservations,
                             reservation_ttl=quotas.reservation_ttl_s)
        super().__init__(host, limits=limits, allow_hop=True)
        self.ledger = RelayLedger(quotas)
        self.offer = offer  # whether this node relays now (publicly reachable and relaying on)
        self._circuit_of: dict[int, int] = {}  # id(source stream) -> ledger circuit id
        self._directions: dict[int, list[trio.CancelScope]] = {}  # circuit -> its two relaying directions
        self._half_closed: set[int] = set()  # circuits one end of which has closed its side
        self._ended: set[int] = set()  # circuits one direction of which was refused or failed

    async def _handle_hop_stream(self, stream: INetStream) -> None:
        # py-libp2p's handler leaves the stream open when it stops on a malformed
        # message, and a peer could keep such streams parked on the node.
        try:
            await super()._handle_hop_stream(stream)
        finally:
            await _reset(stream)

    async def _handle_reserve(self, stream: INetStream, msg) -> None:
        peer = stream.muxed_conn.peer_id
        msg.ClearField("peer")  # a slot is for the peer on the connection, never one it names
        if not self.offer():
            await self._refuse(stream, StatusCode.PERMISSION_DENIED, "this node does not relay now "
                               "(not publicly reachable, or relaying is off)")
            return
        # A slot lives only as long as its holder's connection (the spec's rule): the
        # slots of peers that left are free again before the quota is checked.
        connections = self.host.get_network().connections
        for holder in list(self.ledger.reservations):
            if not connections.get(ID.from_base58(holder)):
                self.ledger.release_reservation(holder)
        granted = self.ledger.reserve(peer.to_base58(), trio.current_time())
        self._follow_ledger()
        if isinstance(granted, Refusal):
            await self._refuse(stream, StatusCode.RESOURCE_LIMIT_EXCEEDED, granted.reason)
            return
        await super()._handle_reserve(stream, msg)

    def _follow_ledger(self) -> None:
        """py-libp2p's own reservation table drops every slot the ledger no longer
        holds (its holder left, or it expired): that table keeps a slot for its whole
        hour whatever becomes of the holder, and its own limit would refuse newcomers."""
        table = self.resource_manager._reservations  # private in the pinned 0.8.1
        for peer in [p for p in table if p.to_base58() not in self.ledger.reservations]:
            del table[peer]

    async def _handle_connect(self, stream: INetStream, msg) -> None:
        if not self.offer():
            await self._refuse(stream, StatusCode.PERMISSION_DENIED, "this node does not relay now")
            return
        src = stream.muxed_conn.peer_id.to_base58()
        try:
            dst = ID(msg.peer.id).to_base58()
        except Exception:
            await self._refuse(stream, StatusCode.MALFORMED_MESSAGE, "CONNECT names no valid peer")
            return
        opened = self.ledger.open(src, dst, trio.current_time())
        if isinstance(opened, Refusal):
            code = (StatusCode.RESOURCE_LIMIT_EXCEEDED if opened.kind in KINDS else
                    StatusCode.NO_RESERVATION if opened.kind == "no_reservation" else StatusCode.PERMISSION_DENIED)
            await self._refuse(stream, code, opened.reason)
            return
        self._circuit_of[id(stream)] = opened
        try:
            await super()._handle_connect(stream, msg)
        finally:
            self._circuit_of.pop(id(stream), None)
            self._directions.pop(opened, None)
            self._half_closed.discard(opened)
            self._ended.discard(opened)
            self.ledger.close(opened)
            # py-libp2p's own _relay_data (replaced here) was the only one to forget
            # the circuits its _handle_connect registers: each held a dead connection.
            for peer in (stream.muxed_conn.peer_id, ID(msg.peer.id)):
                if self._active_relays.get(peer, (None,))[0] is stream:
                    del self._active_relays[peer]

    async def _relay_data(self, src_stream: INetStream, dst_stream: INetStream, peer_id: ID,
                          deadline: float | None = None, circuit_data_limit: list[int] | None = None) -> None:
        circuit = self._circuit_of.get(id(src_stream), self._circuit_of.get(id(dst_stream)))
        if circuit is None:  # not opened through _handle_connect: nothing accounts for it
            await _reset(src_stream, dst_stream)
            return
        refusal: Refusal | None = None
        scope = trio.CancelScope(deadline=self.ledger.deadline(circuit))
        self._directions.setdefault(circuit, []).append(scope)
        try:
            with scope:
                async with trio.open_nursery() as watch:
                    # A read is cancelled only once the circuit is dead anyway (a cancelled
                    # py-libp2p yamux read can drop bytes it already took from its buffer).
                    with trio.CancelScope() as carrying:
                        watch.start_soon(self._watch, circuit, carrying)
                        try:
                            refusal = await self._carry(circuit, scope, src_stream, dst_stream)
                        finally:
                            watch.cancel_scope.cancel()
                if refusal is HALF_CLOSED:
                    return  # the other direction goes on
            if scope.cancelled_caught and circuit not in self._half_closed | self._ended:
                refusal = self.ledger.carry(circuit, 0, trio.current_time())  # counts the duration refusal
        except Exception as exc:  # a reset or closed end, a stalled writer: the circuit is over
            log.debug("circuit from %s ends: %s", peer_id, exc)
        finally:
            with contextlib.suppress(ValueError):
                self._directions.get(circuit, []).remove(scope)
        if refusal is not None:
            log.warning("relay: circuit from %s closed: %s (%s quota)", peer_id, refusal.reason, refusal.kind)
        # The circuit is over: its other direction, waiting on a read that a reset does
        # not always end in py-libp2p, stops now, and the circuit's quota is free at once.
        self._ended.add(circuit)
        for other in self._directions.get(circuit, ()):
            other.cancel()
        await _reset(src_stream, dst_stream)

    async def _carry(self, circuit: int, scope: trio.CancelScope, src_stream: INetStream,
                     dst_stream: INetStream):
        """One direction of a circuit until its EOF (HALF_CLOSED), a refusal, or an error."""
        while True:
            data = await src_stream.read(CHUNK)
            if not data:
                # The half-close goes on; the other direction may still finish, within
                # HALF_CLOSE_GRACE_S (a peer that never closes its side would hold the
                # circuit, and its quota, for good).
                await dst_stream.close()
                self._half_closed.add(circuit)
                for other in self._directions.get(circuit, ()):
                    if other is not scope:
                        other.deadline = min(other.deadline, trio.current_time() + HALF_CLOSE_GRACE_S)
                return HALF_CLOSED
            refusal = self.ledger.carry(circuit, len(data), trio.current_time())
            if refusal is not None:
                return refusal
            with trio.fail_after(WRITE_TIMEOUT_S):
                await dst_stream.write(data)

    async def _watch(self, circuit: int, carrying: trio.CancelScope) -> None:
        """End a direction of a circuit once either end has lost its connection to this
        relay: a dead process's relayed streams wait in py-libp2p (a read on them,
        even after a reset, never returns)."""
        while True:
            await trio.sleep(WATCH_S)
            if not self._ends_connected(circuit):
                carrying.cancel()
                return

    def _ends_connected(self, circuit: int) -> bool:
        """Whether both ends of `circuit` still have a connection to this relay (a
        process that died leaves its streams here waiting, not ended, in py-libp2p)."""
        ends = self.ledger.ends_of(circuit)
        connections = self.host.get_network().connections
        return ends is not None and all(connections.get(ID.from_base58(peer)) for peer in ends)

    async def _refuse(self, stream: INetStream, code: StatusCode, reason: str) -> None:
        log.info("relay: refused %s: %s", stream.muxed_conn.peer_id, reason)
        await self._send_status(stream, code, reason)
        with trio.move_on_after(0.5):  # let the status reach the peer before the reset
            await stream.read(1)
        await _reset(stream)


async def _reset(*streams: INetStream) -> None:
    for stream in streams:
        try:
            await stream.reset()
        except Exception:  # already gone
            pass
