"""The seams to py-libp2p: the version guard of the patches, address conversion,
and the per-peer stream caps of a served protocol."""

from __future__ import annotations

import importlib.metadata
import time
import types

import multiaddr
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.errors import PeerMisbehaved, UnsupportedLibp2p, UsageError
from compushare.karma.record import KARMA_NAMESPACE, karma_key, karma_validators, make_record
from compushare.net import libp2p_patches
from compushare.net.dial import parse_peer_addr, peer_info
from compushare.net.serve import GuardedHandler

KEY = create_new_key_pair()
PEER = ID.from_pubkey(KEY.public_key).to_base58()


def test_the_patches_refuse_another_libp2p_version_and_name_what_to_review(monkeypatch):
    libp2p_patches.check_version()  # the installed one is the pinned one
    monkeypatch.setattr(libp2p_patches, "_applied", False)
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.9.0")
    with pytest.raises(UnsupportedLibp2p) as caught:
        libp2p_patches.apply()
    message = str(caught.value)
    assert "0.9.0" in message and libp2p_patches.PINNED_VERSION in message
    assert all(patch in message for patch in libp2p_patches.PATCHES)


def test_applying_the_patches_twice_changes_nothing():
    from libp2p.io.trio import TrioTCPStream

    libp2p_patches.apply()
    read = TrioTCPStream.read
    libp2p_patches.apply()
    assert TrioTCPStream.read is read is libp2p_patches._read_buffered


def test_peer_info_drops_the_peers_own_suffix_and_skips_what_does_not_parse():
    info = peer_info(PEER, [f"/ip4/10.0.0.1/tcp/4001/p2p/{PEER}", "/ip4/10.0.0.2/tcp/4002", "not an address",
                            multiaddr.Multiaddr("/ip4/10.0.0.3/tcp/4003")])
    assert info.peer_id == ID.from_base58(PEER)
    assert [str(a) for a in info.addrs] == ["/ip4/10.0.0.1/tcp/4001", "/ip4/10.0.0.2/tcp/4002",
                                            "/ip4/10.0.0.3/tcp/4003"]
    assert peer_info(ID.from_base58(PEER), []).addrs == []


def test_a_bootstrap_address_must_name_its_peer():
    info = parse_peer_addr(f"/ip4/10.0.0.1/tcp/4001/p2p/{PEER}")
    assert info.peer_id.to_base58() == PEER and [str(a) for a in info.addrs] == ["/ip4/10.0.0.1/tcp/4001"]
    with pytest.raises(UsageError, match="/p2p/"):
        parse_peer_addr("/ip4/10.0.0.1/tcp/4001")


def _stream(peer: str):
    stream = types.SimpleNamespace(muxed_conn=types.SimpleNamespace(peer_id=peer), resets=0)

    async def reset():
        stream.resets += 1

    stream.reset = reset
    return stream


def test_guarded_handler_caps_streams_per_peer_and_in_total_and_always_uncounts():
    async def main():
        release = trio.Event()
        refused: list[tuple[str, str]] = []

        async def serve(stream) -> None:
            await release.wait()
            if stream.muxed_conn.peer_id == "crash":
                raise RuntimeError("a handler that raises is still uncounted")

        async def refuse(stream, why: str) -> None:
            refused.append((stream.muxed_conn.peer_id, why))

        async def crashing() -> None:
            with pytest.raises(RuntimeError):
                await guarded(_stream("crash"))

        guarded = GuardedHandler(serve, per_peer=2, total=3, refuse=refuse)
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(guarded, _stream("a"))
            nursery.start_soon(crashing)
            await trio.testing.wait_all_tasks_blocked()
            assert guarded.open == {"a": 2, "crash": 1} and guarded.open_total == 3
            await guarded(_stream("a"))  # over a's cap
            await guarded(_stream("b"))  # over the total
            assert refused == [("a", "2 streams of this peer are open already"), ("b", "3 streams are open already")]
            release.set()
        assert not guarded.open and guarded.open_total == 0

    trio.run(main)


def test_the_default_refusal_resets_the_stream():
    async def main():
        started = trio.Event()

        async def serve(stream) -> None:
            started.set()
            await trio.sleep_forever()

        guarded = GuardedHandler(serve, per_peer=1)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(guarded, _stream("a"))
            await started.wait()
            extra = _stream("a")
            await guarded(extra)
            assert extra.resets == 1 and guarded.open == {"a": 1}
            nursery.cancel_scope.cancel()
        assert not guarded.open

    trio.run(main)


def test_the_karma_validator_takes_signed_records_only():
    validator = karma_validators()[KARMA_NAMESPACE]
    value = make_record(PEER, [], seq=1, now=time.time(), ttl_s=600).sign(KEY)
    key = karma_key(PEER)
    with pytest.raises(PeerMisbehaved):
        validator.validate(key, value[:-1] + bytes([value[-1] ^ 1]))
    assert validator.select(key, [b"junk", value]) == 1


async def test_a_handler_removed_while_its_stream_negotiates_fails_that_stream_not_the_node():
    """A NAT'd node leaves DHT server mode (the handler goes) while a peer negotiates
    the DHT on a stream: py-libp2p raised KeyError, which ended the node."""
    from libp2p.protocol_muxer.exceptions import MultiselectError
    from libp2p.protocol_muxer.multiselect import Multiselect

    libp2p_patches.apply()

    async def handler(stream) -> None:
        pass

    muxer = Multiselect({"/x/1.0.0": handler})

    class Peer:  # the peer's side of the negotiation, scripted
        lines = ["/multistream/1.0.0", "/x/1.0.0"]

        async def read(self) -> str:
            return self.lines.pop(0)

        async def write(self, line: str) -> None:
            if line == "/x/1.0.0":  # accepted... and the handler is removed before it is looked up
                muxer.remove_handler("/x/1.0.0")

    with pytest.raises(MultiselectError, match="removed during negotiation"):
        await muxer.negotiate(Peer())
