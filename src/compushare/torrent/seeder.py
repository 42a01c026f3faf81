"""The seeding side of /compushare/pieces/1.0.0: serve the pieces this node holds.

Every stream is one downloader: its requests queue up (at most MAX_REQUESTS and
MAX_QUEUED_BYTES at once; more are rejected with "too_many_requests"), a writer
sends them in order, and a cancel drops a queued request that has not gone out.
Pieces the node gains while the stream is open are announced with `have`.
"""

from __future__ import annotations

import collections
import logging

import trio
from libp2p.abc import INetStream

from .. import wire
from ..errors import FrameError
from ..net.framing import FramedStream
from ..net.serve import GuardedHandler, peer_of
from .protocol import MAX_CONTROL_FRAME, encode_bitfield, parse_request, piece_frame, piece_frame_head
from .storage import Library, ModelPieces

log = logging.getLogger(__name__)

MAX_STREAMS = 64  # downloaders served at once
MAX_STREAMS_PER_PEER = 2
MAX_REQUESTS = 64  # queued requests per stream
MAX_QUEUED_BYTES = 64 * 1024 * 1024
IDLE_TIMEOUT_S = 60.0  # a stream with nothing queued and nothing said is closed
SEND_TIMEOUT_S = 60.0  # a downloader that stops reading is dropped


class UploadLimit:
    """At most `rate` bytes/s over all downloaders: a token bucket holding one second's
    worth; a sender that overdraws it sleeps off its debt before sending."""

    def __init__(self, rate: float) -> None:
        if rate <= 0:
            raise ValueError("an upload limit must be positive")
        self.rate, self.allowance, self.last = rate, rate, None

    async def take(self, size: int) -> None:
        now = trio.current_time()
        if self.last is not None:
            self.allowance = min(self.rate, self.allowance + (now - self.last) * self.rate)
        self.last = now
        self.allowance -= size
        if self.allowance < 0:
            await trio.sleep(-self.allowance / self.rate)


class Seeder:
    def __init__(self, library: Library, upload_limit: float | None = None) -> None:
        self.library = library
        self.limit = UploadLimit(upload_limit) if upload_limit else None
        self.sent_bytes: collections.Counter[str] = collections.Counter()  # peer id -> piece bytes sent
        # The stream handler (host.set_stream_handler(PIECES_PROTOCOL, seeder.handle)):
        # MAX_STREAMS downloads at once, MAX_STREAMS_PER_PEER of one peer.
        self.handle = GuardedHandler(self._serve, per_peer=MAX_STREAMS_PER_PEER, total=MAX_STREAMS,
                                     refuse=self._refuse)

    async def _serve(self, stream: INetStream) -> None:
        peer = peer_of(stream)
        framed = FramedStream(stream, MAX_CONTROL_FRAME)
        try:
            await _Upload(self, framed, peer).run()
        except FrameError as exc:
            await self._error_and_close(framed, exc.code, str(exc))
        except Exception as exc:  # the peer went away or broke the stream: its problem
            log.debug("pieces stream with %s ended: %r", peer[:12], exc)
            await _quietly(framed.reset)

    async def _refuse(self, stream: INetStream, _why: str) -> None:
        await self._error_and_close(FramedStream(stream, MAX_CONTROL_FRAME), "busy",
                                    "too many downloads at once; try later")

    @staticmethod
    async def _error_and_close(framed: FramedStream, code: str, message: str) -> None:
        with trio.move_on_after(5):
            await _quietly(framed.send, {"type": "error", "code": code, "message": message})
        await _quietly(framed.close)


async def _quietly(fn, *args) -> None:
    try:
        await fn(*args)
    except Exception:  # the stream is going away anyway
        pass


class _Upload:
    """One downloader's stream."""

    def __init__(self, seeder: Seeder, framed: FramedStream, peer: str) -> None:
        self.seeder, self.framed, self.peer = seeder, framed, peer
        self.pieces: ModelPieces | None = None
        self.queue: collections.OrderedDict[int, int] = collections.OrderedDict()  # index -> length
        self.haves: collections.deque[int] = collections.deque()
        self.wake = trio.Event()
        self.send_lock = trio.Lock()  # reader and writer both send; frames must not interleave
        self.last_request = trio.current_time()

    def _wake(self) -> None:
        self.wake.set()

    def _on_have(self, index: int) -> None:
        self.haves.append(index)
        self._wake()

    async def run(self) -> None:
        model_id = None
        while model_id is None:
            message = await self._receive()
            if message is None:  # closed (or idle) before hello: close our side too
                await _quietly(self.framed.close)
                return
            kind, model_id = parse_request(message, None)
        pieces = self.pieces = await self.seeder.library.open(model_id)
        if pieces is None:
            raise FrameError(wire.UNKNOWN_MODEL, f"this node holds no pieces of {model_id[:12]}")
        pieces.listeners.add(self._on_have)
        try:
            await self.framed.send({"type": "bitfield", "pieces": pieces.num_pieces,
                                    "have": encode_bitfield(set(pieces.have), pieces.num_pieces)})
            error = None
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._writer)
                try:
                    await self._reader()
                except FrameError as exc:  # raised here, not from the nursery (which would wrap it)
                    error = exc
                nursery.cancel_scope.cancel()
            if error is not None:
                raise error
        finally:
            pieces.listeners.discard(self._on_have)
        await _quietly(self.framed.close)

    async def _receive(self) -> dict | None:
        """The next message; None when the peer closed, or when it has asked for no
        piece for IDLE_TIMEOUT_S and nothing is queued (chatter without requests
        does not keep one of the limited slots)."""
        while True:
            with trio.move_on_after(max(0.0, self.last_request + IDLE_TIMEOUT_S - trio.current_time())):
                return await self.framed.receive()
            if not self.queue:
                log.debug("closing idle pieces stream with %s", self.peer[:12])
                return None
            self.last_request = trio.current_time()  # still sending: wait another period

    async def _reader(self) -> None:
        pieces = self.pieces
        while (message := await self._receive()) is not None:
            kind, value = parse_request(message, pieces.num_pieces)
            if kind == "manifest":
                await self._send({"type": "manifest", "data": pieces.manifest.raw})
            elif kind == "cancel":
                self.queue.pop(value, None)
            elif kind == "request" and value not in self.queue:
                self.last_request = trio.current_time()
                length = pieces.manifest.pieces[value].length
                if len(self.queue) >= MAX_REQUESTS or sum(self.queue.values()) + length > MAX_QUEUED_BYTES:
                    await self._send({"type": "reject", "index": value, "code": wire.TOO_MANY_REQUESTS})
                elif value not in pieces.have:
                    await self._send({"type": "reject", "index": value, "code": "not_held"})
                else:
                    self.queue[value] = length
                    self._wake()
            elif kind == "hello":
                raise FrameError("bad_message", "one hello per stream")

    async def _writer(self) -> None:
        pieces = self.pieces
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            while self.haves:
                await self._send({"type": "have", "index": self.haves.popleft()})
            while self.queue:
                index = next(iter(self.queue))
                length = pieces.manifest.pieces[index].length
                head = piece_frame_head(index, length)
                try:
                    frame = pieces.read_cached(index, headroom=len(head))
                    if frame is None:  # not in the page cache: wait for the disk in a thread
                        frame = piece_frame(index, await trio.to_thread.run_sync(pieces.read, index))
                    else:
                        frame[:len(head)] = head
                except (KeyError, OSError) as exc:
                    log.warning("cannot read piece %d of %s: %r", index, pieces.model.model_id[:12], exc)
                    self.queue.pop(index, None)
                    await self._send({"type": "reject", "index": index, "code": "not_held"})
                    continue
                if self.seeder.limit is not None:
                    await self.seeder.limit.take(length)
                if self.queue.pop(index, None) is None:
                    continue  # cancelled while it was being read (or while waiting its turn)
                # A view: yamux slices it into frames without copying each slice first.
                await self._send(memoryview(frame))
                self.seeder.sent_bytes[self.peer] += length
                while self.haves:
                    await self._send({"type": "have", "index": self.haves.popleft()})

    async def _send(self, message: dict | memoryview) -> None:
        """Send a message (or an already encoded frame)."""
        async with self.send_lock:
            with trio.fail_after(SEND_TIMEOUT_S):
                if isinstance(message, dict):
                    await self.framed.send(message)
                else:
                    await self.framed.stream.write(message)

