"""The seeder side of /compushare/pieces/1.0.0 against a hand-driven downloader on real
libp2p hosts: limits answer with clear replies, bad input closes only its own stream."""

from __future__ import annotations

import contextlib

import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.peerinfo import PeerInfo

from compushare.model.catalog import import_path
from compushare.net.codec import LENGTH
from compushare.net.framing import FramedStream
from compushare.net.host import open_host
from compushare.torrent import seeder as seeder_module
from compushare.torrent.protocol import MAX_DATA_FRAME, PIECES_PROTOCOL, decode_bitfield
from compushare.torrent.seeder import Seeder
from compushare.torrent.storage import Library


@contextlib.asynccontextmanager
async def seeder_and_client(data_dir, **kwargs):
    seeder = Seeder(Library(data_dir), **kwargs)
    async with open_host(create_new_key_pair(), ["/ip4/127.0.0.1/tcp/0"]) as server, \
            open_host(create_new_key_pair(), []) as client:
        server.set_stream_handler(PIECES_PROTOCOL, seeder.handle)
        await client.connect(PeerInfo(server.get_id(), server.get_addrs()))

        async def open_stream() -> FramedStream:
            return FramedStream(await client.new_stream(server.get_id(), [PIECES_PROTOCOL]), MAX_DATA_FRAME)

        yield seeder, open_stream


async def receive(framed: FramedStream) -> dict | None:
    with trio.fail_after(10):
        return await framed.receive()


@pytest.fixture
def stored(tiny_model, tmp_path):
    return import_path(tiny_model, tmp_path / "seeder", alias="tiny")


async def test_hello_bitfield_manifest_and_pieces(stored, tmp_path):
    async with seeder_and_client(tmp_path / "seeder") as (seeder, open_stream):
        framed = await open_stream()
        await framed.send({"type": "hello", "model": stored.model_id})
        bitfield = await receive(framed)
        n = len(stored.manifest.pieces)
        assert bitfield["type"] == "bitfield" and bitfield["pieces"] == n
        assert decode_bitfield(bitfield["have"], n) == set(range(n))
        await framed.send({"type": "manifest"})
        assert (await receive(framed))["data"] == stored.manifest.raw
        await framed.send({"type": "request", "index": 3})
        piece = await receive(framed)
        expected = stored.manifest.pieces[3]
        assert piece["index"] == 3 and len(piece["data"]) == expected.length
        assert seeder.sent_bytes[next(iter(seeder.sent_bytes))] == expected.length


@pytest.mark.parametrize("first, code", [
    ({"type": "request", "index": 0}, "bad_message"),  # before hello
    ({"type": "hello", "model": "ab" * 32}, "unknown_model"),
    ({"type": "hello", "model": "not-an-id"}, "bad_message"),
])
async def test_bad_openings_get_an_error_and_the_seeder_keeps_serving(stored, tmp_path, first, code):
    async with seeder_and_client(tmp_path / "seeder") as (_seeder, open_stream):
        framed = await open_stream()
        await framed.send(first)
        reply = await receive(framed)
        assert reply["type"] == "error" and reply["code"] == code
        assert await receive(framed) is None  # closed
        good = await open_stream()
        await good.send({"type": "hello", "model": stored.model_id})
        assert (await receive(good))["type"] == "bitfield"


@pytest.mark.parametrize("bad", [{"type": "request", "index": 10**6}, {"type": "hello", "model": "ab" * 32},
                                 {"type": "surprise"}])
async def test_bad_messages_after_hello_get_an_error_reply(stored, tmp_path, bad):
    async with seeder_and_client(tmp_path / "seeder") as (_seeder, open_stream):
        framed = await open_stream()
        await framed.send({"type": "hello", "model": stored.model_id})
        await receive(framed)
        await framed.send(bad)
        reply = await receive(framed)
        assert reply["type"] == "error" and reply["code"] == "bad_message"


async def test_garbage_and_oversized_frames_close_only_their_stream(stored, tmp_path):
    async with seeder_and_client(tmp_path / "seeder") as (_seeder, open_stream):
        garbage = await open_stream()
        await garbage.stream.write(LENGTH.pack(5) + b"\xc1\xc1\xc1\xc1\xc1")
        assert (await receive(garbage))["code"] == "bad_frame"
        huge = await open_stream()
        await huge.stream.write(LENGTH.pack(1 << 30))
        assert (await receive(huge))["code"] == "frame_too_large"
        good = await open_stream()
        await good.send({"type": "hello", "model": stored.model_id})
        assert (await receive(good))["type"] == "bitfield"


async def test_too_many_queued_requests_are_rejected_and_cancel_drops_a_queued_one(stored, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.setattr(seeder_module, "MAX_REQUESTS", 4)
    # 16 KiB/s: the first piece goes at once, the next waits a second: the queue fills.
    async with seeder_and_client(tmp_path / "seeder", upload_limit=16 * 1024) as (_seeder, open_stream):
        framed = await open_stream()
        await framed.send({"type": "hello", "model": stored.model_id})
        await receive(framed)
        for index in range(8):
            await framed.send({"type": "request", "index": index})
        await framed.send({"type": "cancel", "index": 3})
        replies = []
        with trio.move_on_after(8):
            while len(replies) < 7:
                replies.append(await receive(framed))
        rejected = sorted(r["index"] for r in replies if r["type"] == "reject")
        sent = sorted(r["index"] for r in replies if r["type"] == "piece")
        assert all(r["code"] == "too_many_requests" for r in replies if r["type"] == "reject")
        assert 3 not in sent  # cancelled while queued
        assert len(rejected) >= 3 and set(rejected).isdisjoint(sent)
        assert set(sent) | set(rejected) | {3} == set(range(8))


async def test_a_peer_gets_at_most_two_streams(stored, tmp_path):
    async with seeder_and_client(tmp_path / "seeder") as (_seeder, open_stream):
        streams = [await open_stream() for _ in range(2)]
        for framed in streams:
            await framed.send({"type": "hello", "model": stored.model_id})
            assert (await receive(framed))["type"] == "bitfield"
        third = await open_stream()
        reply = await receive(third)
        assert reply["type"] == "error" and reply["code"] == "busy"
