"""net/libp2p_patches.py's yamux defences on py-libp2p's own muxer, driven frame by
frame from a raw socket (no Noise): a peer may send exactly the credit it was given
(256 KiB, plus every WINDOW_UPDATE), one byte more resets that stream and drops what
it buffered while the connection goes on; a reset stream's data is dropped at once;
a peer holds at most MAX_INBOUND_STREAMS
streams on a connection. Each defence, switched off, lets the attack through."""

from __future__ import annotations

import struct

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.io.trio import TrioTCPStream
from libp2p.peer.id import ID
from libp2p.stream_muxer.yamux import yamux

import compushare.net.libp2p_patches as patches
from compushare import defences

patches.apply()  # what open_host does before its first host

FMT, WINDOW = yamux.YAMUX_HEADER_FORMAT, yamux.DEFAULT_WINDOW_SIZE
DATA, UPDATE = yamux.TYPE_DATA, yamux.TYPE_WINDOW_UPDATE
SYN, RST = yamux.FLAG_SYN, yamux.FLAG_RST
WAIT_S = 30  # a bound on each wait, not a speed: a loaded machine took over 5 s once (hundreds of frames)


class Peer:
    """The remote side: writes raw frames, and reads the node's, tallying the credit
    each of its streams was given and the streams the node reset."""

    def __init__(self, sock: trio.SocketStream) -> None:
        self.sock = sock
        self.credit: dict[int, int] = {}
        self.resets: set[int] = set()
        self.frame = trio.Event()  # set on every frame from the node

    async def send(self, typ: int, flags: int, sid: int, payload: bytes = b"", length: int | None = None) -> None:
        await self.sock.send_all(struct.pack(FMT, 0, typ, flags, sid, len(payload) if length is None else length)
                                 + payload)

    async def open(self, sid: int) -> None:
        self.credit[sid] = WINDOW
        await self.send(UPDATE, SYN, sid)

    async def data(self, sid: int, n: int) -> None:
        self.credit[sid] -= n
        await self.send(DATA, 0, sid, bytes(n))

    async def read_frames(self) -> None:
        pending = b""
        while chunk := await self.sock.receive_some(1 << 16):
            pending += chunk
            while len(pending) >= 12:
                _, typ, flags, sid, length = struct.unpack(FMT, pending[:12])
                body = length if typ == DATA else 0
                if len(pending) < 12 + body:
                    break
                pending = pending[12 + body:]
                if typ == UPDATE and sid in self.credit:
                    self.credit[sid] += length
                if flags & RST:
                    self.resets.add(sid)
                self.frame.set()
                self.frame = trio.Event()

    async def until(self, condition) -> None:
        with trio.fail_after(WAIT_S):
            while not condition():
                await self.frame.wait()

    async def settle(self) -> None:
        """Until the node has sent what it will (a ping round trip: frames are in order)."""
        before = self.frame
        await self.send(yamux.TYPE_PING, SYN, 0, length=7)
        with trio.fail_after(WAIT_S):
            await before.wait()


async def _node_and_peer(nursery):
    a, b = trio.socket.socketpair()
    node = yamux.Yamux(TrioTCPStream(trio.SocketStream(a)), ID.from_pubkey(create_new_key_pair().public_key),
                       is_initiator=False)
    nursery.start_soon(node.start)
    with trio.fail_after(WAIT_S):
        await node.event_started.wait()
    peer = Peer(trio.SocketStream(b))
    nursery.start_soon(peer.read_frames)
    return node, peer


async def _accept(node, sid: int):
    with trio.fail_after(WAIT_S):
        stream = await node.accept_stream()
    assert stream.stream_id == sid
    return stream


def test_exactly_the_credit_is_taken_one_byte_more_resets_the_stream_alone():
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            await peer.open(1)
            await peer.open(3)
            one, three = await _accept(node, 1), await _accept(node, 3)
            await peer.data(1, WINDOW - 1000)
            await peer.data(1, 1000)  # the whole window: taken
            await peer.data(3, 100)
            await peer.settle()
            assert len(node.stream_buffers[1]) == WINDOW and not one.reset_received and not peer.resets
            before = patches.overruns
            await peer.data(1, 1)  # one byte past its credit
            await peer.until(lambda: 1 in peer.resets)  # sent by a task of its own: maybe after a ping's answer
            await peer.settle()
            assert patches.overruns == before + 1
            assert peer.resets == {1} and 1 not in node.streams and 1 not in node.stream_buffers
            assert one.reset_received
            await peer.data(1, 50_000)  # more on the reset stream: read and dropped
            # The connection and the other stream go on.
            await peer.data(3, 100)
            await peer.settle()
            assert await three.read(1000) == bytes(200) and not node.event_shutting_down.is_set()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_data_sent_with_syn_beyond_the_window_resets_the_stream():
    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            await peer.send(DATA, SYN, 5, bytes(WINDOW + 1))
            stream = await _accept(node, 5)
            await peer.until(lambda: 5 in peer.resets)
            assert stream.reset_received
            with trio.fail_after(WAIT_S):
                while 5 in node.streams:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_peer_that_keeps_overrunning_loses_the_connection():
    """Each reset costs the peer nothing while every byte it sends costs a decryption."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            for i in range(patches.MAX_OVERRUNS_PER_CONNECTION - 1):
                await peer.send(DATA, SYN, 2 * i + 1, bytes(WINDOW + 1))
                await peer.until(lambda sid=2 * i + 1: sid in peer.resets)
            assert not node.event_shutting_down.is_set()
            await peer.send(DATA, SYN, 99, bytes(WINDOW + 1))  # one overrun more
            with trio.fail_after(WAIT_S):
                await node.event_closed.wait()
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_a_stream_reset_by_its_peer_drops_its_unread_data_at_once():
    """py-libp2p kept it for its sweeper, 60-90 s: a peer filling and resetting
    streams would park a window each for that long."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            await peer.open(1)
            stream = await _accept(node, 1)
            await peer.data(1, WINDOW)
            await peer.send(UPDATE, RST, 1)
            await peer.settle()
            assert 1 not in node.streams and 1 not in node.stream_buffers and stream.reset_received
            nursery.cancel_scope.cancel()

    trio.run(main)


@settings(max_examples=25, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["send", "read"]), st.integers(1, 200_000)), min_size=1,
                      max_size=30),
       widen=st.one_of(st.none(), st.integers(WINDOW, 4 * WINDOW)))
def test_a_sender_within_its_credit_is_never_reset(steps, widen):
    """Any interleaving of sends within the credit granted so far and reads by the
    node (which credit the sender at half a window, and may widen the window as a
    downloader does) is taken; the credit the peer has left is what the node counts."""

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            await peer.open(1)
            stream = await _accept(node, 1)
            if widen is not None:
                await patches.widen_receive_window(type("Net", (), {"muxed_stream": stream})(), widen)
                await peer.settle()
            for kind, n in steps:
                if kind == "send":
                    n = min(n, peer.credit[1])
                    if n:
                        await peer.data(1, n)
                        await peer.settle()
                elif node.stream_buffers.get(1):
                    await stream.read(n)
                    await peer.settle()
                assert stream.recv_window == peer.credit[1]
            assert not peer.resets and not stream.reset_received
            nursery.cancel_scope.cancel()

    trio.run(main)


def test_with_the_defence_off_the_overrun_is_buffered(monkeypatch):
    monkeypatch.setenv(defences.ENV, "yamux_window")

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            await peer.open(1)
            await _accept(node, 1)
            for _ in range(8):
                await peer.data(1, WINDOW)
            await peer.settle()
            assert len(node.stream_buffers[1]) == 8 * WINDOW and not peer.resets
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("caps", ["on", "off"])
def test_a_peer_holds_at_most_max_inbound_streams_per_connection(caps, monkeypatch):
    if caps == "off":
        monkeypatch.setenv(defences.ENV, "stream_caps")
    total = patches.MAX_INBOUND_STREAMS + 10

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            accepted = []

            async def accept_all() -> None:
                while True:
                    accepted.append(await node.accept_stream())

            nursery.start_soon(accept_all)
            for i in range(total):
                await peer.send(DATA, SYN, 2 * i + 1, bytes(1000))  # each parks 1,000 bytes
            await peer.settle()
            await trio.sleep(0.2)
            await peer.settle()
            held = [s for s in node.streams.values() if not s.is_initiator]
            if caps == "on":
                assert len(held) == patches.MAX_INBOUND_STREAMS == len(accepted)
                assert peer.resets == {2 * i + 1 for i in range(patches.MAX_INBOUND_STREAMS, total)}
                assert sum(len(b) for b in node.stream_buffers.values()) == 1000 * patches.MAX_INBOUND_STREAMS
                # One held stream ends: the peer may open another.
                await accepted[0].reset()
                await peer.send(DATA, SYN, 2 * total + 1, bytes(10))
                await peer.settle()
                assert 2 * total + 1 in node.streams and 2 * total + 1 not in peer.resets
            else:
                assert len(held) == total and not peer.resets
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("caps", ["on", "off"])
def test_answered_streams_the_peer_leaves_open_are_bounded_oldest_reset_first(caps, monkeypatch):
    """Streams the node answered and closed its side of, that the peer keeps open
    and fills with data nobody will read (py-libp2p kept each until the connection ended)."""
    if caps == "off":
        monkeypatch.setenv(defences.ENV, "stream_caps")
    total = patches.MAX_ANSWERED_STREAMS + 8

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            node, peer = await _node_and_peer(nursery)
            for i in range(total):
                sid = 2 * i + 1
                await peer.open(sid)
                stream = await _accept(node, sid)
                await stream.close()  # answered
                await peer.data(sid, WINDOW)  # parked: nothing reads it
            await peer.settle()
            parked = sum(len(b) for b in node.stream_buffers.values())
            if caps == "on":
                assert peer.resets == {2 * i + 1 for i in range(total - patches.MAX_ANSWERED_STREAMS)}
                assert parked == patches.MAX_ANSWERED_STREAMS * WINDOW
                # Closed by the peer after filling it, an answered stream still counts
                # (py-libp2p would keep its data 60-90 s); drained, it is gone.
                last = 2 * total - 1
                await peer.send(UPDATE, yamux.FLAG_FIN, last)
                await peer.open(2 * total + 1)
                stream = await _accept(node, 2 * total + 1)
                await stream.close()
                oldest_left = 2 * (total - patches.MAX_ANSWERED_STREAMS) + 1
                await peer.until(lambda: oldest_left in peer.resets)
                assert last in node.streams
            else:
                assert not peer.resets and parked == total * WINDOW
            nursery.cancel_scope.cancel()

    trio.run(main)


@pytest.mark.parametrize("caps", ["on", "off"])
def test_a_negotiation_message_longer_than_the_cap_fails_before_its_body_is_read(caps, monkeypatch):
    """py-libp2p read a multistream message of any announced length (crediting the
    stream as it read): one stream could make the node hold gigabytes for the 10 s
    of its negotiation deadline."""
    from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
    from libp2p.utils import encode_uvarint

    if caps == "off":
        monkeypatch.setenv(defences.ENV, "stream_caps")

    class Reader:
        def __init__(self, data: bytes) -> None:
            self.data, self.taken = data, 0

        async def read(self, n: int | None = None) -> bytes:
            chunk = self.data[self.taken:self.taken + (n or len(self.data))]
            self.taken += len(chunk)
            return chunk

    async def main() -> None:
        ok = Reader(encode_uvarint(19) + b"/multistream/1.0.0\n")
        assert await MultiselectCommunicator(ok).read() == "/multistream/1.0.0"
        line = b"/" + b"x" * (1 << 20) + b"\n"
        huge = Reader(encode_uvarint(len(line)) + line)
        if caps == "on":
            with pytest.raises(MultiselectCommunicatorError):
                await MultiselectCommunicator(huge).read()
            assert huge.taken < 16  # the length prefix only
        else:
            assert len(await MultiselectCommunicator(huge).read()) == len(line) - 1

    trio.run(main)


@pytest.mark.parametrize("caps", ["on", "off"])
def test_a_guarded_handler_given_the_switch_lifts_its_caps_when_it_is_off(caps, monkeypatch):
    """How the view protocol is served (net/gossip.py): 4 streams of one peer at once."""
    from compushare.net.serve import GuardedHandler

    if caps == "off":
        monkeypatch.setenv(defences.ENV, "stream_caps")
    served, refused = [], []

    class Stream:
        muxed_conn = type("Conn", (), {"peer_id": "peer"})()

    async def main() -> None:
        release = trio.Event()

        async def serve(stream) -> None:
            served.append(stream)
            await release.wait()

        async def refuse(stream, why: str) -> None:
            refused.append(why)

        handler = GuardedHandler(serve, per_peer=4, total=64, refuse=refuse, defence="stream_caps")
        async with trio.open_nursery() as nursery:
            for _ in range(6):
                nursery.start_soon(handler, Stream())
            await trio.sleep(0.1)
            release.set()

    trio.run(main)
    assert (len(served), len(refused)) == ((4, 2) if caps == "on" else (6, 0))
