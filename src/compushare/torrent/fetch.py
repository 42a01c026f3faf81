"""The downloading side of /compushare/pieces/1.0.0: fetch pieces from many seeders at once.

One `Download` drives one model: a task per seeder keeps that seeder's request
pipeline full with what the picker (torrent/picker.py) chooses, every piece is
checked against the manifest before it is kept, and new seeders found while the
download runs join it. A seeder that sends corrupted pieces is banned for the
node's lifetime (see `Bans`), so it is not asked again by the next download.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Callable

import trio
from libp2p.abc import IHost
from libp2p.peer.peerinfo import PeerInfo

from .. import wire
from ..errors import CompushareError, FrameError
from ..net.dial import dial
from ..net.framing import FramedStream
from ..net.libp2p_patches import widen_receive_window
from ..model.manifest import Manifest, parse
from .picker import Picker
from .protocol import MAX_DATA_FRAME, PIECES_PROTOCOL, parse_reply
from .storage import Library, ModelPieces

log = logging.getLogger(__name__)

PIPELINE_BYTES = 8 * 1024 * 1024  # requested but not yet received, per seeder
MAX_PIPELINE = 32
CONNECT_TIMEOUT_S = 10.0
REQUEST_TIMEOUT_S = 30.0
STALL_TIMEOUT_S = 30.0  # no piece, and no seeder that could send one: give up
NO_PROGRESS_LIMIT_S = 300.0  # no piece at all, whatever the seeders claim: give up
DISCOVERY_PERIOD_S = 5.0
FIRST_ROUND_WAIT_S = 2.0

Discover = Callable[[], Awaitable[list[PeerInfo]]]


class FetchError(CompushareError):
    """A download could not complete (no seeder holds what is missing, or all failed)."""


class Bans:
    """Seeders caught sending corrupted pieces; a node keeps them for its lifetime."""

    def __init__(self) -> None:
        self.peers: set[str] = set()

    def __contains__(self, peer: str) -> bool:
        return peer in self.peers

    def add(self, peer: str) -> None:
        self.peers.add(peer)


@dataclasses.dataclass
class FetchResult:
    model_id: str
    pieces: int  # fetched in this run
    bytes: int
    seconds: float
    already_held: int  # wanted pieces that were already on disk
    bytes_from: dict[str, int]  # seeder peer id -> bytes of accepted pieces
    banned: list[str]

    @property
    def rate_mbps(self) -> float:
        return self.bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


Progress = Callable[[int, int], None]  # (bytes done, bytes wanted)


async def _open(host: IHost, info: PeerInfo) -> FramedStream:
    with trio.fail_after(CONNECT_TIMEOUT_S):
        if info.addrs:
            await dial(host, info.peer_id, info.addrs, timeout=CONNECT_TIMEOUT_S)
        stream = await host.new_stream(info.peer_id, [PIECES_PROTOCOL])
        # What may be in flight: the requested pieces, plus one frame of slack.
        await widen_receive_window(stream, PIPELINE_BYTES + MAX_DATA_FRAME)
    return FramedStream(stream, MAX_DATA_FRAME)


async def _hello(framed: FramedStream, model_id: str, num_pieces: int | None) -> tuple[int, set[int]]:
    await framed.send({"type": "hello", "model": model_id})
    with trio.fail_after(CONNECT_TIMEOUT_S):
        message = await framed.receive()
    if message is None:
        raise FrameError("closed", "the seeder closed the stream")
    kind, value = parse_reply(message, num_pieces)
    if kind == "error":
        raise FrameError("refused", str(value))
    if kind != "bitfield":
        raise FrameError("bad_message", f"expected a bitfield, got {kind}")
    return value


async def fetch_manifest(host: IHost, model_id: str, seeders: list[PeerInfo]) -> Manifest:
    """The manifest of `model_id` from the first seeder that has a valid one."""
    reasons = []
    for info in seeders:
        try:
            framed = await _open(host, info)
            try:
                await _hello(framed, model_id, None)
                await framed.send({"type": "manifest"})
                with trio.fail_after(CONNECT_TIMEOUT_S):
                    message = await framed.receive()
                if message is None:
                    raise FrameError("closed", "the seeder closed the stream")
                kind, value = parse_reply(message, None)
                if kind != "manifest":
                    raise FrameError("bad_message", f"expected the manifest, got {kind}")
                return parse(value, expected_id=model_id)
            finally:
                await _close(framed)
        except (Exception, trio.TooSlowError) as exc:
            reasons.append(f"{info.peer_id.to_string()[:12]}: {exc}")
    raise FetchError(f"no seeder gave the manifest of {model_id[:12]}"
                     + (f" ({'; '.join(reasons)})" if reasons else " (no seeders found)"))


async def _close(framed: FramedStream) -> None:
    try:
        await framed.close()
    except Exception:
        pass


class Download:
    def __init__(self, host: IHost, pieces: ModelPieces, wanted: set[int], discover: Discover, *,
                 bans: Bans | None = None, progress: Progress | None = None, rng=None) -> None:
        self.host, self.pieces, self.discover = host, pieces, discover
        self.manifest = pieces.manifest
        self.bans = bans if bans is not None else Bans()
        self.progress = progress or (lambda done, total: None)
        self.already_held = len(wanted & pieces.have)
        self.wanted = wanted - pieces.have
        depth = max(2, min(MAX_PIPELINE, math.ceil(PIPELINE_BYTES / self.manifest.piece_size)))
        self.picker = Picker(self.wanted, depth=depth, rng=rng)
        self.total_bytes = sum(self.manifest.pieces[i].length for i in self.wanted)
        self.done_bytes = 0
        self.bytes_from: collections.Counter[str] = collections.Counter()
        self.sent_at: dict[tuple[str, int], float] = {}
        self.outboxes: dict[str, collections.deque] = {}  # peer -> cancels to send
        self.connected: set[str] = set()
        self.attempted: dict[str, float] = {}  # peer -> when we last tried it
        self.changed = trio.Event()  # any progress or peer change (the main loop waits on it)
        self.wakes: dict[str, trio.Event] = {}  # per seeder: it may have requests to send
        self.last_progress = time.monotonic()
        # Requests start once the first seeders found have all answered hello (or
        # after FIRST_ROUND_WAIT_S): the first to answer would otherwise take the
        # whole of a small download.
        self.ready = trio.Event()
        self.greeting = 0  # hellos in progress
        self.disk_error: str | None = None

    def _changed(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    def _wake(self, peers) -> None:
        """Let these seeders' requesters run: each re-picking costs a scan of the
        missing pieces, so only those whose options changed are woken."""
        for peer in peers:
            event = self.wakes.get(peer)
            if event is not None:
                event.set()

    async def run(self) -> FetchResult:
        began = time.monotonic()
        self.progress(0, self.total_bytes)
        stalled = None
        if not self.picker.done:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._discovery_loop, nursery)
                while not self.picker.done and stalled is None:
                    with trio.move_on_after(1.0):
                        await self.changed.wait()
                    stalled = self._stalled()
                nursery.cancel_scope.cancel()
        if stalled:
            raise FetchError(stalled)
        return FetchResult(self.manifest.model_id, len(self.wanted), self.total_bytes, time.monotonic() - began,
                           self.already_held, dict(self.bytes_from), sorted(self.picker.banned))

    def _stalled(self) -> str | None:
        """Why the download cannot go on, if it cannot."""
        if self.disk_error:
            return self.disk_error
        quiet = time.monotonic() - self.last_progress
        if quiet < STALL_TIMEOUT_S:
            return None
        missing = self.picker.unavailable()
        if not missing and self.connected and quiet < NO_PROGRESS_LIMIT_S:
            return None
        return (f"download of {self.manifest.model_id[:12]} stalled: {len(self.picker.missing)} pieces missing, "
                f"{len(missing)} of them held by no reachable seeder ({len(self.connected)} connected)")

    async def _discovery_loop(self, nursery: trio.Nursery) -> None:
        me = self.host.get_id()
        while True:
            try:
                found = await self.discover()
            except Exception as exc:
                log.warning("seeder discovery failed: %r", exc)
                found = []
            now = time.monotonic()
            for info in found:
                peer = info.peer_id.to_string()
                if info.peer_id == me or peer in self.connected or peer in self.bans or peer in self.picker.banned:
                    continue
                if now - self.attempted.get(peer, -math.inf) < 4 * DISCOVERY_PERIOD_S:
                    continue  # failed recently: give it a moment
                self.attempted[peer] = now
                self.connected.add(peer)
                self.greeting += 1
                nursery.start_soon(self._seeder, info)
            if not self.ready.is_set():
                with trio.move_on_after(FIRST_ROUND_WAIT_S):
                    while self.greeting:
                        await self.changed.wait()
                self.ready.set()
            await trio.sleep(DISCOVERY_PERIOD_S)

    async def _seeder(self, info: PeerInfo) -> None:
        peer = info.peer_id.to_string()
        framed = None
        greeted = False
        try:
            framed = await _open(self.host, info)
            _count, have = await _hello(framed, self.manifest.model_id, len(self.manifest.pieces))
            greeted = True
            self.greeting -= 1
            if not self.picker.add_peer(peer, have):
                return
            self.outboxes[peer] = collections.deque()
            self.wakes[peer] = trio.Event()
            self._changed()
            await self.ready.wait()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._requester, peer, framed)
                await self._receiver(peer, framed)
                nursery.cancel_scope.cancel()
        except (Exception, trio.TooSlowError) as exc:
            log.info("seeder %s dropped: %s", peer[:12], exc)
        finally:
            if not greeted:
                self.greeting -= 1
            self.picker.remove_peer(peer)
            self.outboxes.pop(peer, None)
            self.wakes.pop(peer, None)
            self.connected.discard(peer)
            self._changed()
            self._wake(list(self.wakes))  # its requests are free for others
            if framed is not None:
                with trio.CancelScope(shield=True), trio.move_on_after(2):
                    await _close(framed)

    async def _requester(self, peer: str, framed: FramedStream) -> None:
        while True:
            self.wakes[peer] = wake = trio.Event()
            now = time.monotonic()
            for index in self.picker.inflight(peer):
                if now - self.sent_at.get((peer, index), now) > REQUEST_TIMEOUT_S:
                    self.picker.timed_out(peer, index)
                    self.sent_at.pop((peer, index), None)
                    self.outboxes[peer].append(index)
            outbox = self.outboxes[peer]
            messages = [{"type": "cancel", "index": outbox.popleft()} for _ in range(len(outbox))]
            now = time.monotonic()
            for index in self.picker.pick(peer):
                self.sent_at[(peer, index)] = now
                messages.append({"type": "request", "index": index})
            await framed.send_many(messages)  # one write for all of them
            with trio.move_on_after(1.0):  # also the tick that finds timed-out requests
                await wake.wait()

    async def _receiver(self, peer: str, framed: FramedStream) -> None:
        num_pieces = len(self.manifest.pieces)
        while True:
            message = await framed.receive()
            if message is None:
                return
            kind, value = parse_reply(message, num_pieces)
            if kind == "piece":
                if await self._piece(peer, *value):
                    return  # banned
            elif kind == "have":
                self.picker.peer_has(peer, value)
            elif kind == "reject":
                index, code = value
                self.sent_at.pop((peer, index), None)
                self.picker.rejected(peer, index, not_held=code == wire.NOT_HELD)
            elif kind == "error":
                raise FrameError("seeder_error", str(value))
            else:
                raise FrameError("bad_message", f"unexpected {kind}")
            self._wake([peer])

    async def _piece(self, peer: str, index: int, data: bytes) -> bool:
        """Check and keep one piece; True if its sender is now banned. The check and the
        write are one trip to a worker thread: a valid duplicate rewrites the same bytes."""
        self.sent_at.pop((peer, index), None)
        try:
            valid = await trio.to_thread.run_sync(self.pieces.write, index, data)
        except OSError as exc:  # our disk, not the seeder: stop with the real reason
            self.disk_error = f"cannot write piece {index} of {self.manifest.model_id[:12]} to disk: {exc}"
            self._changed()
            raise
        outcome = self.picker.received(peer, index, valid)
        if not valid:
            log.warning("piece %d from %s failed its hash check (%d failures)", index, peer[:12],
                        self.picker.failures(peer))
        if outcome.banned:
            log.warning("banned seeder %s: %d corrupted pieces", peer, self.picker.max_failures)
            self.bans.add(peer)
            return True
        for other, indexes in outcome.cancel.items():
            if other in self.outboxes:
                self.outboxes[other].extend(indexes)
            for i in indexes:
                self.sent_at.pop((other, i), None)
        self._wake(outcome.cancel)
        if not valid or all(i in self.picker.requested for i in self.picker.missing):
            # A piece to fetch elsewhere, or the endgame: idle seeders may take it.
            self._wake(list(self.wakes))
        if outcome.accepted:
            self._changed()
            self.pieces.announce(index)
            self.bytes_from[peer] += len(data)
            self.done_bytes += len(data)
            self.last_progress = time.monotonic()
            self.progress(self.done_bytes, self.total_bytes)
        return False


async def fetch_model(host: IHost, library: Library, model_id: str, discover: Discover, *,
                      blocks: tuple[int, int] | None = None, head: bool = False, everything: bool = False,
                      bans: Bans | None = None, progress: Progress | None = None,
                      alias: str | None = None) -> FetchResult:
    """Fetch the pieces of a span (`blocks`), of the consumer's part (`head`), or of the
    whole model (`everything`), getting the manifest first if this node lacks it."""
    pieces = await library.open(model_id)
    if pieces is None:
        seeders = await discover()
        if not seeders:
            raise FetchError(f"no seeder of {model_id[:12]} found in the swarm")
        manifest = await fetch_manifest(host, model_id, seeders)
        library.models.add_manifest(manifest, alias=alias)
        pieces = await library.open(model_id)
    elif alias:
        library.models.set_alias(alias, model_id)
    manifest = pieces.manifest
    wanted = manifest.all_pieces() if everything else manifest.pieces_for(blocks=blocks, head=head)
    return await Download(host, pieces, wanted, discover, bans=bans, progress=progress).run()
