"""The consumer's side of /compushare/infer/1.0.0: one stream per hop, reused for
every step of the session; every request has a deadline."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator

import multiaddr
import torch
import trio
from libp2p.abc import IHost
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from ..errors import HopUnavailable, PeerMisbehaved, RemoteError, ServerBusy
from ..net.codec import DEFAULT_MAX_FRAME
from ..net.framing import FramedStream
from ..net.tensors import decode_tensor, encode_tensor
from . import protocol
from .routing import Hop

CONNECT_TIMEOUT_S = 5.0
STEP_TIMEOUT_S = 30.0


def peer_info(hop: Hop) -> PeerInfo:
    addrs = []
    for text in hop.record.addrs:
        addr = multiaddr.Multiaddr(text)
        with contextlib.suppress(Exception):
            addr = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{hop.peer_id}"))
        addrs.append(addr)
    return PeerInfo(ID.from_base58(hop.peer_id), addrs)


class RemoteHop:
    def __init__(self, hop: Hop, framed: FramedStream, hidden_size: int) -> None:
        self.hop = hop
        self.framed = framed
        self.hidden_size = hidden_size

    async def request(self, message: dict, timeout: float = STEP_TIMEOUT_S) -> dict:
        peer = self.hop.peer_id
        try:
            with trio.fail_after(timeout):
                await self.framed.send(message)
                reply = await self.framed.receive()
        except trio.TooSlowError:
            raise RemoteError("timeout", f"{peer} (blocks {self.hop.start}:{self.hop.end}) did not answer "
                                         f"within {timeout:.0f}s") from None
        except StreamError as exc:
            raise RemoteError("connection_lost", f"lost the stream to {peer} (blocks {self.hop.start}:"
                                                 f"{self.hop.end}): {str(exc) or type(exc).__name__}") from None
        if reply is None:
            raise RemoteError("closed", f"{self.hop.peer_id} closed the stream")
        if reply.get("type") == "error":
            cls = ServerBusy if reply.get("code") == protocol.BUSY else RemoteError
            raise cls(str(reply.get("code")), str(reply.get("message")))
        return reply

    async def step(self, session_id: bytes, hidden: torch.Tensor, position: int) -> torch.Tensor:
        reply = await self.request(
            {"type": "step", "session": session_id, "position": position, "hidden": encode_tensor(hidden)}
        )
        if reply.get("type") != "result" or reply.get("position") != position:
            raise PeerMisbehaved(f"{self.hop.peer_id} answered step {position} with {reply.get('type')}")
        tokens = hidden.shape[1]
        output = decode_tensor(reply.get("hidden"), hidden_size=self.hidden_size, max_tokens=tokens)
        if output.shape[1] != tokens:
            raise PeerMisbehaved(f"{self.hop.peer_id} returned {output.shape[1]} tokens for {tokens}")
        return output


class InferenceChain:
    """An open session on every hop of a chain."""

    def __init__(self, hops: list[RemoteHop], session_id: bytes) -> None:
        self.hops = hops
        self.session_id = session_id
        self.position = 0

    async def step(self, hidden: torch.Tensor) -> torch.Tensor:
        """Run `hidden` [1, n, H] through every hop; the chain's position advances by n."""
        for hop in self.hops:
            hidden = await hop.step(self.session_id, hidden, self.position)
        self.position += hidden.shape[1]
        return hidden


async def _open_hop(host: IHost, hop: Hop, model_id: str, session_id: bytes, max_tokens: int,
                    hidden_size: int) -> RemoteHop:
    with trio.fail_after(CONNECT_TIMEOUT_S):
        info = peer_info(hop)
        await host.connect(info)
        stream = await host.new_stream(info.peer_id, [protocol.INFER_PROTOCOL])
    remote = RemoteHop(hop, FramedStream(stream, DEFAULT_MAX_FRAME), hidden_size)
    await remote.request(
        {"type": "open", "session": session_id, "model": model_id, "start": hop.start, "end": hop.end,
         "max_tokens": max_tokens},
        timeout=CONNECT_TIMEOUT_S,
    )
    return remote


@contextlib.asynccontextmanager
async def open_chain(host: IHost, hops: list[Hop], model_id: str, *, max_tokens: int,
                     hidden_size: int) -> AsyncIterator[InferenceChain]:
    session_id = os.urandom(protocol.SESSION_ID_BYTES)
    opened: dict[int, RemoteHop] = {}

    async def open_one(index: int, hop: Hop) -> None:
        try:
            opened[index] = await _open_hop(host, hop, model_id, session_id, max_tokens, hidden_size)
        except RemoteError as exc:
            raise HopUnavailable(hop.peer_id, exc.code, f"{hop.peer_id} (blocks {hop.start}:{hop.end}): "
                                                        f"{exc.message}") from None
        except Exception as exc:  # dial and stream failures come in many types
            raise HopUnavailable(hop.peer_id, "unreachable", f"could not reach {hop.peer_id} (blocks "
                                 f"{hop.start}:{hop.end}): {str(exc) or type(exc).__name__}") from None

    try:
        try:
            async with trio.open_nursery() as nursery:
                for index, hop in enumerate(hops):
                    nursery.start_soon(open_one, index, hop)
        except BaseExceptionGroup as group:  # report one failed hop, not a group
            failed = group.subgroup(HopUnavailable)
            if failed is None:
                raise
            first = failed
            while isinstance(first, BaseExceptionGroup):
                first = first.exceptions[0]
            raise first from None
        yield InferenceChain([opened[i] for i in range(len(hops))], session_id)
    finally:
        with trio.CancelScope(shield=True), trio.move_on_after(2):
            for remote in opened.values():
                with contextlib.suppress(Exception):
                    await remote.request({"type": "close", "session": session_id}, timeout=1)
                    await remote.framed.close()
