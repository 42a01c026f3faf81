"""net/libp2p_patches.py's transport changes on two real libp2p hosts over loopback: receive
credit granted up front, and bulk data intact through the read buffer and the
one-Noise-message yamux frames; an inbound connection's slot freed when it closes."""

from __future__ import annotations

import contextlib
import hashlib
import os

import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.noise.io import MAX_PLAINTEXT_LENGTH

from compushare.net.host import open_host, parse_peer_addr
from compushare.net.libp2p_patches import widen_receive_window

PROTOCOL = "/compushare-test/bulk/1.0.0"
SIZE = 3 * 1024 * 1024


@contextlib.asynccontextmanager
async def sender_and_stream(payload: bytes):
    """A host that writes `payload` on each new stream (then sets `written`), and a
    stream to it from a second host."""
    written = trio.Event()

    async def handler(stream) -> None:
        await stream.write(payload)
        written.set()
        await stream.close()

    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as server, \
            open_host(create_new_key_pair(), []) as client:
        server.set_stream_handler(PROTOCOL, handler)
        await client.connect(PeerInfo(server.get_id(), server.get_addrs()))
        stream = await client.new_stream(server.get_id(), [PROTOCOL])
        await stream.write(b"go")  # the handler runs once the stream is negotiated
        yield stream, written


async def read_all(stream) -> bytes:
    from libp2p.network.stream.exceptions import StreamEOF

    got = bytearray()
    with trio.fail_after(20):
        while True:
            try:
                data = await stream.read(1 << 20)
            except StreamEOF:
                break
            if not data:
                break
            got += data
    return bytes(got)


async def test_a_widened_window_lets_the_peer_send_that_much_before_any_read():
    payload = os.urandom(SIZE)
    async with sender_and_stream(payload) as (stream, written):
        await widen_receive_window(stream, SIZE + 64 * 1024)
        with trio.fail_after(10):
            await written.wait()  # all 3 MiB sent while nothing was read
        assert hashlib.sha256(await read_all(stream)).digest() == hashlib.sha256(payload).digest()


async def test_without_widening_the_peer_waits_for_reads():
    """The control: yamux's initial 256 KiB of credit holds a 3 MiB write back until
    the reader reads, which is what the grant above removes."""
    payload = os.urandom(SIZE)
    async with sender_and_stream(payload) as (stream, written):
        with trio.move_on_after(1.0):
            await written.wait()
        assert not written.is_set()
        assert await read_all(stream) == payload
        assert written.is_set()


async def test_bulk_bytes_arrive_intact_in_frames_of_one_noise_message():
    from libp2p.stream_muxer.yamux import yamux

    assert yamux.MAX_MESSAGE_SIZE == MAX_PLAINTEXT_LENGTH  # header + payload fill one Noise message
    payload = os.urandom(SIZE + 12345)  # not a multiple of any frame size
    async with sender_and_stream(payload) as (stream, _written):
        await widen_receive_window(stream, 1 << 20)
        assert await read_all(stream) == payload


async def test_a_closed_inbound_connection_gives_its_slot_back():
    """py-libp2p held each inbound connection's slot of the swarm's inbound cap (296)
    until the node stopped: after that many connections in its life, a node refused
    every new one. With the cap at 3 here, 8 connections one after another all work."""
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as server:
        swarm = server.get_network()
        swarm._inbound_limiter.total_tokens = 3  # private in the pinned 0.8.1
        addr = f"{server.get_addrs()[0]}"
        for _ in range(8):
            async with open_host(create_new_key_pair(), []) as client:
                with trio.fail_after(10):
                    await client.connect(parse_peer_addr(addr))
                    while client.get_id() not in swarm.connections:
                        await trio.sleep(0.05)
                    await client.disconnect(server.get_id())  # leaving the host alone keeps its socket
            with trio.fail_after(10):
                while swarm._inbound_limiter.borrowed_tokens:
                    await trio.sleep(0.05)
