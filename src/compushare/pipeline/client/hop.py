"""One session on one server of a chain, over /compushare/infer: the consumer's hop I/O.

One stream per hop carries every step of the session. Every request has a deadline
that follows the hop's observed latency, so a hung server is noticed in about a
second, not after a fixed 30 s; a "rate limited" reply is retried within it. Every
failure is a HopFailed naming the server. Receipts (karma) are signed and
countersigned here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import multiaddr
import torch
import trio
from libp2p.abc import IHost
from libp2p.network.stream.exceptions import StreamError
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo

from ...errors import FrameError, HopFailed, HopUnavailable, PeerMisbehaved, RemoteError, ServerBusy
from ...karma.receipts import Receipt, parse_receipt, sign_receipt
from ...net.codec import DEFAULT_MAX_FRAME
from ...net.framing import FramedStream
from ...net.tensors import decode_tensor, encode_tensor
from .. import protocol
from .routing import Hop

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
MIN_DEADLINE_S = 1.0  # no step is given less (scheduling hiccups on a loaded machine)
DEADLINE_LATENCIES = 5.0  # a step may take this many times the hop's usual latency per chunk...
DEADLINE_PER_TOKEN_S = 0.01  # ... plus this much per token it carries
LATENCY_EWMA = 0.2
RECEIPT_TIMEOUT_S = 2.0


def peer_info(hop: Hop) -> PeerInfo:
    addrs = []
    for text in hop.record.addrs:
        addr = multiaddr.Multiaddr(text)
        with contextlib.suppress(Exception):
            addr = addr.decapsulate(multiaddr.Multiaddr(f"/p2p/{hop.peer_id}"))
        addrs.append(addr)
    return PeerInfo(ID.from_base58(hop.peer_id), addrs)


@dataclasses.dataclass
class Usage:
    """A session's steps since its last receipt, as the consumer saw them."""

    seq: int = 0
    tokens: int = 0
    compute_ms: float = 0.0  # what the server reported, each step capped by its wall time
    wall_ms: float = 0.0

    def add(self, tokens: int, compute_ms: float, wall_ms: float) -> None:
        self.tokens += tokens
        self.compute_ms += min(max(compute_ms, 0.0), wall_ms)
        self.wall_ms += wall_ms


@dataclasses.dataclass(frozen=True)
class StepResult:
    output: torch.Tensor  # [1, n, H] (all chunks, or the last one with last_only)
    data: bytes  # the output's wire bytes (what the proof signs)
    dtype: str
    proof: dict | None


class RemoteHop:
    """One open session: its own id, so that one server can hold a hop and a spot
    check (or a replacement) of the same chain."""

    def __init__(self, hop: Hop, framed: FramedStream, hidden_size: int, session_id: bytes) -> None:
        self.hop = hop
        self.session_id = session_id
        self.framed = framed
        self.hidden_size = hidden_size
        self.latency = max(hop.expected_s, 0.005)  # seconds per decode step, observed
        self.usage = Usage()  # what the next receipt covers

    @property
    def peer_id(self) -> str:
        return self.hop.peer_id

    def _where(self) -> str:
        return f"{self.peer_id} (blocks {self.hop.start}:{self.hop.end})"

    def deadline(self, tokens: int, chunks: int = 1) -> float:
        return MIN_DEADLINE_S + DEADLINE_LATENCIES * self.latency * chunks + DEADLINE_PER_TOKEN_S * tokens

    async def request(self, message: dict, timeout: float) -> dict:
        """Send, await the reply; a "rate limited" reply is retried within the deadline.
        Every failure is a HopFailed naming this server."""
        try:
            with trio.fail_after(timeout):
                while True:
                    await self.framed.send(message)
                    reply = await self.framed.receive()
                    if reply is None or reply.get("type") != "error" or reply.get("code") != protocol.RATE_LIMITED:
                        break
                    wait = reply.get("retry_after_s")
                    await trio.sleep(min(float(wait), 5.0) if isinstance(wait, float | int) else 0.1)
        except trio.TooSlowError:
            raise HopFailed(self.peer_id, "timeout", f"{self._where()} did not answer within {timeout:.1f}s") \
                from None
        except (StreamError, FrameError) as exc:
            raise HopFailed(self.peer_id, "connection_lost",
                            f"lost the stream to {self._where()}: {str(exc) or type(exc).__name__}") from None
        if reply is None:
            raise HopFailed(self.peer_id, "closed", f"{self._where()} closed the stream")
        if reply.get("type") == "error":
            code, text = str(reply.get("code")), str(reply.get("message"))
            if code == protocol.BUSY:
                raise ServerBusy(code, f"{self._where()}: {text}")
            raise HopFailed(self.peer_id, code, f"{self._where()}: {text}")
        return reply

    async def step(self, hidden: torch.Tensor, position: int, *,
                   chunks: list[int] | None = None, last_only: bool = False) -> StepResult:
        tokens = hidden.shape[1]
        message = {"type": "step", "session": self.session_id, "position": position, "hidden": encode_tensor(hidden)}
        if chunks is not None and len(chunks) > 1:
            message["chunks"] = chunks
        if last_only:
            message["last_only"] = True
        began = time.perf_counter()
        try:
            reply = await self.request(message, self.deadline(tokens, len(chunks or [tokens])))
        except ServerBusy as exc:  # busy mid-session: as good as gone for this session
            raise HopFailed(self.peer_id, exc.code, exc.message) from None
        expect = chunks[-1] if last_only and chunks else tokens
        try:
            if reply.get("type") != "result" or reply.get("position") != position:
                raise PeerMisbehaved(f"answered step {position} with {reply.get('type')}")
            wire = reply.get("hidden")
            output = decode_tensor(wire, hidden_size=self.hidden_size, max_tokens=expect)
            if output.shape[1] != expect:
                raise PeerMisbehaved(f"returned {output.shape[1]} tokens for {expect}")
        except PeerMisbehaved as exc:
            raise HopFailed(self.peer_id, "bad_reply", f"{self._where()}: {exc}") from None
        wall = time.perf_counter() - began
        if tokens == 1:
            self.latency = (1 - LATENCY_EWMA) * self.latency + LATENCY_EWMA * wall
        compute_ms = reply.get("compute_ms")
        self.usage.add(tokens, float(compute_ms) if isinstance(compute_ms, float | int) else 0.0, wall * 1000)
        proof = reply.get("proof")
        return StepResult(output, wire["data"], wire["dtype"], proof if isinstance(proof, dict) else None)

    async def link(self, upstream: str | None, downstream: RemoteHop | None) -> None:
        """Tell the server its neighbours, so it pushes its output straight to the next
        hop (pipeline/server/push.py). A refusal only costs the time pushes save."""
        message = {"type": "link", "session": self.session_id, "upstream": upstream, "downstream": None}
        if downstream is not None:
            message["downstream"] = {"peer": downstream.peer_id, "addrs": list(downstream.hop.record.addrs),
                                     "session": downstream.session_id}
        try:
            await self.request(message, self.deadline(1))
        except RemoteError as exc:  # refused (busy, bad request...): the chain works without pushes
            log.debug("%s will not push: %s", self.peer_id, exc)
            if isinstance(exc, HopFailed) and exc.code in ("timeout", "connection_lost", "closed"):
                await self.abort()  # a late reply would desync the stream: its next step fails over

    async def send_receipt(self, host: IHost, model_id: str) -> None:
        """Sign what this session has run since the last receipt and have the server
        countersign it (its karma). A refusal costs the server only its own credit;
        a hop that does not answer in time is aborted (its stream could deliver the
        late reply in place of the next step's): the next step fails over."""
        usage = self.usage
        if not usage.tokens:
            return
        receipt = Receipt(self.peer_id, host.get_id().to_string(), model_id, self.hop.start, self.hop.end,
                          self.session_id, usage.seq, usage.tokens, min(usage.compute_ms, usage.wall_ms),
                          usage.wall_ms, time.time())
        wire = sign_receipt(receipt, host.get_private_key())
        self.usage = Usage(seq=usage.seq)  # those steps are settled, accepted or not
        try:
            reply = await self.request({"type": "receipt", "session": self.session_id, "receipt": wire},
                                       RECEIPT_TIMEOUT_S)
            parse_receipt(reply.get("receipt"))  # countersigned by the server it names
        except RemoteError as exc:  # HopFailed, or a (misplaced) busy
            if exc.code in (protocol.BAD_RECEIPT, protocol.BAD_REQUEST, protocol.INTERNAL, protocol.BUSY):
                log.info("%s did not countersign a receipt: %s", self._where(), exc)
                return  # refused: the server's seq did not move, neither does ours
            log.info("no answer to a receipt from %s: %s", self._where(), exc)
            await self.abort()
            return
        except PeerMisbehaved as exc:
            log.info("%s answered a receipt with a bad countersignature: %s", self._where(), exc)
        self.usage.seq = usage.seq + 1

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await self.request({"type": "close", "session": self.session_id}, timeout=1)
            await self.framed.close()

    async def abort(self) -> None:
        with contextlib.suppress(Exception):
            await self.framed.reset()


async def open_hop(host: IHost, hop: Hop, model_id: str, max_tokens: int, hidden_size: int) -> RemoteHop:
    """Dial the server and open a new session on it; every failure is a HopUnavailable."""
    session_id = os.urandom(protocol.SESSION_ID_BYTES)
    try:
        with trio.fail_after(CONNECT_TIMEOUT_S):
            info = peer_info(hop)
            # py-libp2p refuses to redial, for a while, a peer whose addresses failed
            # once: a server restarted on a new port must be reachable at once.
            with contextlib.suppress(Exception):
                host.get_network().unblock_peer(info.peer_id)
            await host.connect(info)
            stream = await host.new_stream(info.peer_id, [protocol.INFER_PROTOCOL])
        remote = RemoteHop(hop, FramedStream(stream, DEFAULT_MAX_FRAME), hidden_size, session_id)
        await remote.request(
            {"type": "open", "session": session_id, "model": model_id, "start": hop.start, "end": hop.end,
             "max_tokens": max_tokens},
            timeout=CONNECT_TIMEOUT_S,
        )
        return remote
    except RemoteError as exc:
        raise HopUnavailable(hop.peer_id, exc.code, exc.message) from None
    except Exception as exc:  # dial and stream failures come in many types
        raise HopUnavailable(hop.peer_id, "unreachable", f"could not reach {hop.peer_id} (blocks "
                             f"{hop.start}:{hop.end}): {str(exc) or type(exc).__name__}") from None
