"""Framed messages over a libp2p stream. Callers put deadlines around each call."""

from __future__ import annotations

import contextlib

from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from libp2p.network.stream.exceptions import StreamEOF

from .codec import FrameDecoder, encode_frame

READ_CHUNK = 1 << 20


class FramedStream:
    """Send and receive codec frames on one stream (not safe for concurrent receivers)."""

    def __init__(self, stream: INetStream, max_frame_bytes: int) -> None:
        self.stream = stream
        self._decoder = FrameDecoder(max_frame_bytes)

    @property
    def last_frame_bytes(self) -> int:
        return self._decoder.last_frame_bytes

    async def receive(self) -> dict | None:
        """The next message, or None when the peer closed its side cleanly.

        Raises FrameError for a malformed or oversized frame, StreamError if the
        stream breaks.
        """
        while True:
            message = self._decoder.next_message()
            if message is not None:
                return message
            self._decoder.needed()  # raises at once for an oversized length prefix
            try:
                # Take whatever has arrived: reading the prefix and the body separately
                # doubles yamux's bookkeeping (and window updates) per message.
                data = await self.stream.read(READ_CHUNK)
            except StreamEOF:
                data = b""
            if not data:
                return None
            self._decoder.feed(data)

    async def send(self, message: dict) -> None:
        await self.stream.write(encode_frame(message))

    async def send_many(self, messages: list[dict]) -> None:
        """Several messages in one write: one yamux frame, one encryption and one
        socket write for all of them (each costs a few hundred microseconds of
        py-libp2p, whatever its size)."""
        if messages:
            await self.stream.write(b"".join(encode_frame(message) for message in messages))

    async def close(self) -> None:
        await self.stream.close()

    async def reset(self) -> None:
        await self.stream.reset()


async def request_reply(host: IHost, peer_id: ID, protocol: str, request: dict, max_frame_bytes: int) -> dict | None:
    """One request frame and its one reply on a new stream (the protocols whose every
    request has a stream of its own); None if the peer closed without answering.
    The caller bounds the time and dials first where needed."""
    framed = FramedStream(await host.new_stream(peer_id, [protocol]), max_frame_bytes)
    try:
        await framed.send(request)
        return await framed.receive()
    finally:
        with contextlib.suppress(Exception):
            await framed.close()
