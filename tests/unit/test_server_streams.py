"""The server's infer streams (pipeline/server/streams.py behind net/serve.GuardedHandler):
one reply per frame in order, a stream cap per peer answered "busy", silent and
oversized streams ended, and a bad frame costing only its error reply."""

from __future__ import annotations

import os
import types

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare.config import ServerLimits
from compushare.model.blocks import SpanRunner
from compushare.net.codec import LENGTH, FrameDecoder, encode_frame
from compushare.pipeline.server.inference import InferenceServer

KEY = create_new_key_pair()


class Stream:
    """One side of an infer stream, in memory: what the peer sends is fed to `read`,
    what the server writes is decoded into `replies`."""

    def __init__(self, peer: str) -> None:
        self.muxed_conn = types.SimpleNamespace(peer_id=peer)
        self.send, self.receive = trio.open_memory_channel(100)
        self.decoder = FrameDecoder()
        self.replies: list[dict] = []
        self.closed = self.was_reset = False

    async def read(self, n: int = -1) -> bytes:
        try:
            return await self.receive.receive()
        except trio.EndOfChannel:
            return b""

    async def write(self, data: bytes) -> None:
        self.decoder.feed(data)
        while (message := self.decoder.next_message()) is not None:
            self.replies.append(message)

    async def close(self) -> None:
        self.closed = True

    async def reset(self) -> None:
        self.was_reset = True


@pytest.fixture
def server(tiny_model):
    limits = ServerLimits(max_streams_per_peer=2, stream_idle_timeout_s=5.0, max_frame_bytes=1 << 16)
    return InferenceServer(SpanRunner.load(tiny_model, 0, 2), "m", limits, key_pair=KEY)


async def test_frames_are_answered_in_order_and_a_bad_one_costs_its_reply(server):
    session = os.urandom(16)
    stream = Stream("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.rpc_infer, stream)
        for message in ({"type": "open", "session": session, "model": "m", "start": 0, "end": 2, "max_tokens": 4},
                        {"type": "bogus", "session": session}, {"type": "close", "session": session}):
            await stream.send.send(encode_frame(message))
        await stream.send.send(LENGTH.pack(3) + b"\xc1\xc1\xc1")  # not msgpack
        await stream.send.send(encode_frame({"type": "close", "session": session}))
        await stream.send.aclose()  # the peer closes its side: so does the server
    assert [r["type"] for r in stream.replies] == ["opened", "error", "closed", "error", "closed"]
    assert [r.get("code") for r in stream.replies[1::2]] == ["bad_request", "bad_frame"]
    assert stream.closed and not stream.was_reset and not server.rpc_infer.open


async def test_the_sessions_opened_on_a_stream_end_with_it(server):
    """A consumer that went away does not leave its KV reservations behind until the
    idle timeout: the sessions opened on a stream are closed when it ends (those of
    another stream of the same peer are not)."""
    ours, other = os.urandom(16), os.urandom(16)
    first, second = Stream("a"), Stream("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.rpc_infer, first)
        nursery.start_soon(server.rpc_infer, second)
        for stream, session in ((first, ours), (second, other)):
            await stream.send.send(encode_frame({"type": "open", "session": session, "model": "m", "start": 0,
                                                 "end": 2, "max_tokens": 4}))
        await trio.testing.wait_all_tasks_blocked()
        assert ours in server.sessions and other in server.sessions
        await first.send.aclose()
        await trio.testing.wait_all_tasks_blocked()
        assert ours not in server.sessions and other in server.sessions
        await second.send.aclose()
    assert len(server.sessions) == 0


async def test_a_peer_gets_its_stream_cap_then_busy(server):
    streams = [Stream("a") for _ in range(3)]
    async with trio.open_nursery() as nursery:
        for stream in streams:
            nursery.start_soon(server.rpc_infer, stream)
            await trio.testing.wait_all_tasks_blocked()
        assert server.rpc_infer.open == {"a": 2}
        refused = streams[2]
        assert refused.replies == [{"type": "error", "code": "busy",
                                    "message": "2 streams of this peer are open already"}] and refused.closed
        other = Stream("b")  # another peer is not affected
        nursery.start_soon(server.rpc_infer, other)
        await trio.testing.wait_all_tasks_blocked()
        assert other.replies == [] and server.rpc_infer.open == {"a": 2, "b": 1}
        for stream in (*streams[:2], other):
            await stream.send.aclose()
    assert not server.rpc_infer.open


async def test_silent_and_oversized_streams_are_ended(server, autojump_clock):
    silent, huge = Stream("a"), Stream("b")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(server.rpc_infer, silent)
        nursery.start_soon(server.rpc_infer, huge)
        await huge.send.send(LENGTH.pack(1 << 30) + b"x" * 10)
        began = trio.current_time()
    assert silent.was_reset and silent.replies == [] and trio.current_time() - began >= 5.0
    assert [r["code"] for r in huge.replies] == ["frame_too_large"] and huge.closed and huge.was_reset
    assert not server.rpc_infer.open


async def test_a_training_stream_may_idle_as_long_as_a_training_session(server, autojump_clock):
    """A consumer's stream to a training stage waits, between a microbatch's forward
    and its backward, for every later stage: past the infer streams' idle limit (5 s
    here), up to a training session's (SESSION_IDLE_S), then it is reset."""
    from compushare.pipeline.server.training import SESSION_IDLE_S, TrainingServer

    training = TrainingServer(server, memory_bytes=1 << 30)
    stream = Stream("a")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(training.rpc_train, stream)
        began = trio.current_time()
        await trio.sleep(server.limits.stream_idle_timeout_s * 4)
        assert not stream.was_reset  # an infer stream would be gone by now
    assert stream.was_reset and trio.current_time() - began >= SESSION_IDLE_S
