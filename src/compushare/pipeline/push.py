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

import dataclasses
import logging

import multiaddr
import torch
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from ..errors import FrameError
from ..net.framing import FramedStream
from . import protocol
from .session import Rejected

log = logging.getLogger(__name__)

DIAL_TIMEOUT_S = 5.0
SEND_TIMEOUT_S = 0.5  # a push never holds up the reply to the consumer for longer
MAX_ADDRS = 8
MAX_ADDR_CHARS = 256
MAX_PUSH_PEERS = 64
PUSH_MAX_FRAME = 1 << 16  # what comes back on a push stream: error replies only


@dataclasses.dataclass(frozen=True)
class Downstream:
    """Where a session's outputs go: the next hop's server and its session."""

    peer: str
    addrs: tuple[str, ...]
    session: bytes

    def to_wire(self) -> dict:
        return {"peer": self.peer, "addrs": list(self.addrs), "session": self.session}


def parse_peer(value: object, name: str) -> str:
    if not isinstance(value, str) or len(value) > 128:
        raise Rejected(protocol.BAD_REQUEST, f"{name!r} must be a peer id")
    try:
        ID.from_base58(value)
    except Exception:
        raise Rejected(protocol.BAD_REQUEST, f"{name!r} is not a valid peer id") from None
    return value


def parse_downstream(value: object) -> Downstream | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise Rejected(protocol.BAD_REQUEST, "'downstream' must be a map or nil")
    peer = parse_peer(value.get("peer"), "downstream.peer")
    addrs, session = value.get("addrs"), value.get("session")
    if (not isinstance(addrs, list) or len(addrs) > MAX_ADDRS
            or not all(isinstance(a, str) and len(a) <= MAX_ADDR_CHARS for a in addrs)):
        raise Rejected(protocol.BAD_REQUEST, f"'downstream.addrs' must be at most {MAX_ADDRS} multiaddr strings")
    if not isinstance(session, bytes) or len(session) != protocol.SESSION_ID_BYTES:
        raise Rejected(protocol.BAD_REQUEST, f"'downstream.session' must be {protocol.SESSION_ID_BYTES} bytes")
    return Downstream(peer, tuple(addrs), session)


class Speculation:
    """A step computed from a push, waiting for the consumer's copy of its input."""

    def __init__(self, position: int, tokens: int, data: bytes, dtype: str) -> None:
        self.position, self.tokens, self.data, self.dtype = position, tokens, data, dtype
        self.done = trio.Event()
        self.output: torch.Tensor | None = None
        self.seconds = 0.0
        self.finished = False  # computed (or failed): the session may expire while it waits

    def matches(self, position: int, data: bytes, dtype: str, chunks: list[int]) -> bool:
        return (self.output is not None and position == self.position and len(chunks) == 1
                and dtype == self.dtype and data == self.data)


class PushLinks:
    """One outbound push stream per downstream server, shared by every session that
    pushes there. Sends are serialised per stream (a frame must not interleave with
    another), bounded in time, and a stream that fails is dropped, not retried: the
    consumer's own steps carry on without it."""

    def __init__(self, host: IHost, nursery: trio.Nursery) -> None:
        self.host = host
        self.nursery = nursery
        self._streams: dict[str, tuple[FramedStream, trio.Lock]] = {}
        self.sent = 0
        self.failed = 0

    async def connect(self, target: Downstream) -> None:
        """Have a push stream to `target` ready (the consumer links a session before
        its first step, so dialling never delays one)."""
        if target.peer in self._streams:
            return
        if len(self._streams) >= MAX_PUSH_PEERS:
            raise Rejected(protocol.BUSY, f"this server already pushes to {MAX_PUSH_PEERS} servers")
        addrs = []
        for text in target.addrs:
            try:
                addrs.append(multiaddr.Multiaddr(text).decapsulate(multiaddr.Multiaddr(f"/p2p/{target.peer}")))
            except Exception:
                raise Rejected(protocol.BAD_REQUEST, f"not a multiaddr: {text[:64]!r}") from None
        try:
            with trio.fail_after(DIAL_TIMEOUT_S):
                info = PeerInfo(ID.from_base58(target.peer), addrs)
                if addrs:
                    await self.host.connect(info)
                stream = await self.host.new_stream(info.peer_id, [protocol.INFER_PROTOCOL])
        except Exception as exc:
            raise Rejected(protocol.UNREACHABLE, f"cannot reach downstream {target.peer}: "
                                                 f"{str(exc) or type(exc).__name__}") from None
        if target.peer in self._streams:  # another session dialled it meanwhile
            await _reset(stream)
            return
        framed = FramedStream(stream, PUSH_MAX_FRAME)
        self._streams[target.peer] = (framed, trio.Lock())
        self.nursery.start_soon(self._drain, target.peer, framed)

    async def push(self, target: Downstream, position: int, hidden_wire: dict) -> bool:
        entry = self._streams.get(target.peer)
        if entry is None:
            return False
        framed, lock = entry
        message = {"type": "push", "session": target.session, "position": position, "hidden": hidden_wire}
        with trio.move_on_after(SEND_TIMEOUT_S) as scope:
            try:
                async with lock:
                    await framed.send(message)
                self.sent += 1
                return True
            except Exception as exc:
                log.debug("push to %s failed: %s", target.peer, exc)
        if scope.cancelled_caught:
            log.debug("push to %s timed out", target.peer)
        self.failed += 1
        await self._drop(target.peer, framed)
        return False

    async def _drain(self, peer: str, framed: FramedStream) -> None:
        """A push gets no reply when it is taken; a refused one gets an error (stale
        position, unlinked session...), which is normal after a failover."""
        try:
            while True:
                message = await framed.receive()
                if message is None:
                    break
                log.debug("push to %s refused: %s", peer, message.get("message"))
        except (FrameError, Exception) as exc:
            log.debug("push stream to %s ended: %s", peer, exc)
        await self._drop(peer, framed)

    async def _drop(self, peer: str, framed: FramedStream) -> None:
        entry = self._streams.get(peer)
        if entry is not None and entry[0] is framed:
            del self._streams[peer]
        await _reset(framed.stream)


async def _reset(stream) -> None:
    try:
        await stream.reset()
    except Exception:
        pass
