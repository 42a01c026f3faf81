"""Server-to-server pushes: a hop's output goes straight to the next server of the
consumer's chain, which starts computing on it before the consumer's copy arrives.

The consumer still sends every hop its input and gets every hop's output (its
history, failover and spot checks need them); a push only lets the next server
start early. Its result is used only if the consumer's step carries the very same
bytes at the same position; otherwise it is rolled back and the consumer's input
computed instead. So a lying or stale upstream costs compute, never correctness.
This removes two of the six transits a 3-hop decode step makes on its critical
path (consumer -> A -> B -> C -> consumer instead of returning to the consumer
between hops), as in Petals' server-to-server pushes.
"""

from __future__ import annotations

import contextlib
import logging

import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from ...net.dial import dial
from ...net.reachability import is_circuit
from ...net.framing import FramedStream
from .. import protocol
from ..messages import Downstream, PushRequest, WireTensor

log = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 5.0
REDIAL_S = 5.0  # a downstream that could not be dialled is tried again after this
PUSH_MAX_BYTES = protocol.PUSH_MAX_BYTES
MAX_PUSH_PEERS = 64
# Pushes waiting for one downstream server, shared by the sessions linked there: with
# direct return a lost push costs its step the consumer's wait for `no_input` and a
# relayed retry, so concurrent sessions' pushes queue (bounded in count and bytes)
# rather than drop.
PUSH_QUEUE = 32
PUSH_QUEUE_BYTES = 2 << 20
PUSH_MAX_FRAME = 1 << 16  # what comes back on a push stream: error replies only


class _Link:
    def __init__(self, framed: FramedStream) -> None:
        self.framed = framed
        # A downstream that cannot keep up loses pushes beyond the queue's bounds and
        # holds a reply back by `flushed`'s bound at most.
        self.send, self.queue = trio.open_memory_channel(PUSH_QUEUE)
        self.queued = self.written = 0
        self.queued_bytes = 0  # of pushes not yet written
        self.progress = trio.Event()  # set (and replaced) after each write, and when the link ends

    def _wrote(self) -> None:
        self.progress.set()
        self.progress = trio.Event()


class PushLinks:
    """One outbound push stream per downstream server, shared by every session that
    pushes there. Dialled in the background when a session is linked (a link reply
    never waits for a dial); a sender task per stream writes the pushes, so a slow
    or stalled downstream costs dropped pushes and replies delayed by `flushed`'s
    bound at most, and no write is ever cancelled halfway (which would break the
    shared secure connection)."""

    def __init__(self, host: IHost, nursery: trio.Nursery) -> None:
        self.host = host
        self.nursery = nursery
        self._links: dict[str, _Link] = {}
        self._dialling: set[str] = set()
        self._last_dial: dict[str, float] = {}
        self._early: dict[str, list[dict]] = {}  # pushes queued while their stream is being dialled
        self.sent = 0
        self.dropped = 0

    def ensure(self, target: Downstream) -> None:
        """Start dialling `target` unless a stream is there, being dialled, or was
        tried in the last REDIAL_S."""
        peer = target.peer
        if peer in self._links or peer in self._dialling:
            return
        if len(self._links) + len(self._dialling) >= MAX_PUSH_PEERS:
            log.debug("not pushing to %s: %d push streams open already", peer, MAX_PUSH_PEERS)
            return
        now = trio.current_time()
        if now - self._last_dial.get(peer, -REDIAL_S) < REDIAL_S:
            return
        self._last_dial[peer] = now
        self._dialling.add(peer)
        self.nursery.start_soon(self._dial, target)

    def push(self, target: Downstream, position: int, hidden: WireTensor) -> bool:
        """Queue one push (never blocks); False when it cannot go now."""
        link = self._links.get(target.peer)
        message = PushRequest(target.session, position, hidden).to_wire()
        if link is None:
            self.ensure(target)  # a dropped stream is dialled again, at most every REDIAL_S
            early = self._early.setdefault(target.peer, []) if target.peer in self._dialling else None
            if early is None or len(early) >= PUSH_QUEUE or \
                    sum(len(m["hidden"]["data"]) for m in early) + len(hidden.data) > PUSH_QUEUE_BYTES:
                return False
            early.append(message)  # the first step after a (re)link: written once the stream is open
            return True
        if link.queued_bytes + len(hidden.data) > PUSH_QUEUE_BYTES:
            self.dropped += 1
            return False
        try:
            link.send.send_nowait(message)
        except trio.WouldBlock:  # PUSH_QUEUE pushes are still waiting to be written
            self.dropped += 1
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            # The stream broke (the next hop died) and its sender is gone; the link is
            # dropped once the stream is reset. The step this push belongs to goes on:
            # failing it would make this server look like the one that died.
            self.dropped += 1
            return False
        link.queued += 1
        link.queued_bytes += len(hidden.data)
        return True

    async def flushed(self, peer: str, timeout: float) -> None:
        """Wait until the pushes queued for `peer` are written, at most `timeout`. A
        server sends its reply to the consumer after its push: the push is on the
        token's critical path, the reply is not (the consumer's copy only confirms a
        step the next server is already computing). Waiting never cancels a write."""
        link = self._links.get(peer)
        if link is None or link.written >= link.queued:  # the usual case: written already, no scope
            return
        with trio.move_on_after(timeout):
            while link.written < link.queued and self._links.get(peer) is link:
                await link.progress.wait()

    async def _dial(self, target: Downstream) -> None:
        peer = target.peer
        try:
            peer_id = ID.from_base58(peer)
            with trio.fail_after(DIAL_TIMEOUT_S):
                # Addresses the node already knows for that peer (its DHT routing table,
                # its connections) come first: a consumer's addresses are only a hint,
                # dialled when nothing is known. Of those, a NAT'd downstream's circuits
                # (from its server record) are added even then: its own addresses,
                # learnt when it connected here, lead nowhere.
                known = []
                with contextlib.suppress(Exception):  # PeerStoreError: never heard of it
                    known = [str(a) for a in self.host.get_peerstore().addrs(peer_id)]
                hint = list(target.addrs) if not known else [a for a in target.addrs if is_circuit(a)]
                await dial(self.host, peer_id, [*known, *hint], timeout=DIAL_TIMEOUT_S)
                stream = await self.host.new_stream(peer_id, [protocol.INFER_PROTOCOL])
        except Exception as exc:  # a push is only ever a saving: the chain works without it
            log.debug("cannot open a push stream to %s: %s", peer, str(exc) or type(exc).__name__)
            self.dropped += len(self._early.pop(peer, ()))
            return
        finally:
            self._dialling.discard(peer)
        await self.serve_link(peer, stream)

    async def serve_link(self, peer: str, stream) -> None:
        """Write the pushes queued for `peer` to `stream` until either ends (tests run
        it on a stream of their own)."""
        link = self._links[peer] = _Link(FramedStream(stream, PUSH_MAX_FRAME))
        for message in self._early.pop(peer, ()):
            link.send.send_nowait(message)  # at most PUSH_QUEUE: room for them all
            link.queued += 1
            link.queued_bytes += len(message["hidden"]["data"])
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._drain, peer, link.framed, nursery.cancel_scope)
                async with link.queue:
                    async for message in link.queue:
                        await link.framed.send(message)
                        self.sent += 1
                        link.written += 1
                        link.queued_bytes -= len(message["hidden"]["data"])
                        link._wrote()
                nursery.cancel_scope.cancel()
        except Exception as exc:
            log.debug("push stream to %s ended: %s", peer, exc)
        finally:
            if self._links.get(peer) is link:
                del self._links[peer]
            link.send.close()
            link._wrote()  # nobody waits for a link that is gone
            with trio.move_on_after(1) as scope:
                scope.shield = True
                await _reset(stream)

    async def _drain(self, peer: str, framed: FramedStream, scope: trio.CancelScope) -> None:
        """A push gets no reply when it is taken; a refused one gets an error (stale
        position, a session relinked elsewhere...), which is normal after a failover."""
        try:
            while True:
                message = await framed.receive()
                if message is None:
                    break
                log.debug("push to %s refused: %s", peer, message.get("message"))
        except Exception as exc:
            log.debug("push stream to %s ended: %s", peer, exc)
        scope.cancel()  # the stream is gone: so is the sender


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:
        pass
