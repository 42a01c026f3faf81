"""An infer stream on the serving side: frames in, in order, one reply each.

A stream that sends nothing for the stream idle timeout (or stalls mid-frame) is
reset (`idle_timeout_s`: a protocol whose consumer waits between two requests for
longer, as training's, says its own). The sessions opened on a stream end with it (`ended`): their KV caches do
not outlive a consumer that went away. A frame that does not decode gets an error reply and the stream goes on,
except an oversized one, whose remaining bytes cannot be skipped safely: the stream
is closed after its error reply. The per-peer stream cap is net/serve.GuardedHandler's.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import INetStream
from libp2p.network.stream.exceptions import StreamError

from ...config import ServerLimits
from ... import wire
from ...errors import FrameError
from ...net.framing import FramedStream
from ...net.serve import peer_of
from .. import protocol

log = logging.getLogger(__name__)

REPLY_TIMEOUT_S = 10.0
OVERSIZE_GRACE_S = 0.5

# (message, peer, frame bytes, the ids of sessions opened on this stream) -> the reply, or None
Handle = Callable[[dict, str, int, set[bytes]], Awaitable["dict | None"]]


async def serve_stream(stream: INetStream, *, handle: Handle, limits: ServerLimits,
                       ended: Callable[[set[bytes]], None] = lambda _opened: None,
                       idle_timeout_s: float | None = None) -> None:
    """One stream's frames, in order (task boundary: logs and swallows unexpected errors)."""
    framed, peer = FramedStream(stream, limits.max_frame_bytes), peer_of(stream)
    idle_s = limits.stream_idle_timeout_s if idle_timeout_s is None else idle_timeout_s
    opened: set[bytes] = set()
    try:
        while True:
            try:
                # A stalled or silent stream (half a frame, then nothing) is closed.
                with trio.move_on_after(idle_s) as idle:
                    message = await framed.receive()
            except FrameError as exc:
                await _reply(framed, protocol.error(exc.code, exc.message))
                if exc.code == wire.FRAME_TOO_LARGE:
                    # The rest of that frame cannot be skipped: end the stream, but give
                    # the error reply a moment to arrive before the reset discards it.
                    await framed.close()
                    await trio.sleep(OVERSIZE_GRACE_S)
                    return await _quiet_reset(framed)
                continue
            if idle.cancelled_caught:
                log.info("closing a stream of %s: idle for %.0f s", peer, idle_s)
                return await _quiet_reset(framed)
            if message is None:
                return await framed.close()
            reply = await handle(message, peer, framed.last_frame_bytes, opened)
            if reply is not None:  # a push that was taken gets no reply
                await _reply(framed, reply)
    except StreamError as exc:
        log.debug("infer stream ended: %s", exc)
    except Exception:
        log.exception("infer handler failed")
        await _quiet_reset(framed)
    finally:
        ended(opened)


async def refuse_stream(stream: INetStream, why: str, *, limits: ServerLimits) -> None:
    """A stream over the per-peer cap: a "busy" error reply, then closed."""
    log.info("refused an infer stream from %s: %s", peer_of(stream), why)
    framed = FramedStream(stream, limits.max_frame_bytes)
    try:
        await _reply(framed, protocol.error(protocol.BUSY, why))
        await framed.close()
    except Exception as exc:  # never into py-libp2p's connection task
        log.debug("could not refuse an infer stream: %s", exc)
        await _quiet_reset(framed)


async def _reply(framed: FramedStream, reply: dict) -> None:
    with trio.fail_after(REPLY_TIMEOUT_S):
        await framed.send(reply)


async def _quiet_reset(framed: FramedStream) -> None:
    try:
        await framed.reset()
    except Exception:
        pass
