"""Private sessions' waits follow the work (protocol 2.1.0), on a virtual clock: the
provider (pipeline/server/private.py) closes a silent session after 60 s, or what
the consumer's `wait` announced plus a grace, and never past MAX_QUIET_S without a
request, saying `idle`; it says `busy` while it works on an answer, never to a 2.0.0
consumer. The consumer's session (pipeline/client/private_session.py)
announces its waits when quiet, skips `busy` frames, fails a provider silent too long,
and marks a request sent after it was quiet past what the provider expected."""

from __future__ import annotations

import hashlib
import types

import pytest
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair

from compushare import wire
from compushare.he.ckks import DEFAULT_PARAMETERS
from compushare.net.framing import FramedStream
from compushare.pipeline.client import private_session
from compushare.pipeline.client.private_session import (ANNOUNCED_WAIT_S, KEEPALIVE_S, REQUEST_TIMEOUT_PER_TOKEN_S,
                                                      REQUEST_TIMEOUT_S, PrivateSession, Request)
from compushare.pipeline.private_wire import (BUSY_PERIOD_S, MAX_FRAME_BYTES, Open, Project, decode_wait, wait)
from compushare.pipeline.server.private import IDLE_TIMEOUT_S, MAX_QUIET_S, WAIT_GRACE_S, PrivateServer

pytestmark = pytest.mark.unit

KEY = create_new_key_pair()
DIGEST = hashlib.sha256(b"keys").hexdigest()
OPEN = Open("m" * 64, 0, 2, DEFAULT_PARAMETERS, DIGEST, 10)
COMPUTE_S = 35.0  # the fake worker's time for one request: 3 busy periods


class End:
    """One end of an in-memory stream: what it writes, the other end reads."""

    def __init__(self, protocol: str) -> None:
        self.protocol = protocol
        self.muxed_conn = types.SimpleNamespace(peer_id="consumer")
        self.inbox_send, self.inbox = trio.open_memory_channel(1000)
        self.other: End | None = None

    def get_protocol(self) -> str:
        return self.protocol

    async def read(self, n: int = -1) -> bytes:
        try:
            return await self.inbox.receive()
        except trio.EndOfChannel:
            return b""

    async def write(self, data: bytes) -> None:
        await self.other.inbox_send.send(data)

    async def close(self) -> None:
        await self.other.inbox_send.aclose()


def stream_pair(protocol: str = wire.PRIVATE) -> tuple[End, End]:
    a, b = End(protocol), End(protocol)
    a.other, b.other = b, a
    return a, b


class Worker:
    """The HE worker as the server uses it: holds every key set; a product takes COMPUTE_S."""

    params = DEFAULT_PARAMETERS
    restarts = 0
    held_bytes = 0

    def has_keys(self, digest: str) -> bool:
        return True

    async def project(self, span, digest, layer, group, tokens, cts):
        await trio.sleep(COMPUTE_S)
        return [[b"out"]], COMPUTE_S


def provider_server(**kwargs) -> PrivateServer:
    provider = types.SimpleNamespace(span=types.SimpleNamespace(start=0, end=2), server=None,
                                     model=types.SimpleNamespace(model_id=OPEN.model_id))
    return PrivateServer(provider, Worker(), KEY, **kwargs)


async def opened_session(nursery, server: PrivateServer, protocol: str = wire.PRIVATE) -> FramedStream:
    """A session served by `server` (its keys held), opened: the consumer's end."""
    server_end, consumer_end = stream_pair(protocol)
    nursery.start_soon(server._serve, server_end)
    consumer = FramedStream(consumer_end, MAX_FRAME_BYTES)
    await consumer.send(OPEN.to_wire())
    assert (await consumer.receive())["type"] == "opened"
    return consumer


async def closed_after(consumer: FramedStream) -> float:
    """Seconds until the provider says `idle` and ends the stream."""
    began = trio.current_time()
    reply = await consumer.receive()
    assert reply["type"] == "error" and reply["code"] == wire.IDLE, reply
    assert await consumer.receive() is None
    return trio.current_time() - began


async def test_a_silent_session_is_closed_with_idle_after_the_unannounced_limit(autojump_clock):
    server = provider_server()
    async with trio.open_nursery() as nursery:
        consumer = await opened_session(nursery, server)
        assert await closed_after(consumer) == pytest.approx(IDLE_TIMEOUT_S, abs=0.01)
        old = await opened_session(nursery, server, wire.PRIVATE_V2_0)  # 2.0.0: closed without a word
        began = trio.current_time()
        assert await old.receive() is None and trio.current_time() - began == pytest.approx(IDLE_TIMEOUT_S, abs=0.01)
    assert server.refused == {"idle": 2}


async def test_a_wait_extends_the_limit_by_what_it_announces_and_never_below_the_floor(autojump_clock):
    server = provider_server()
    async with trio.open_nursery() as nursery:
        consumer = await opened_session(nursery, server)
        await consumer.send(wait(300))
        assert await closed_after(consumer) == pytest.approx(300 + WAIT_GRACE_S, abs=0.01)
        consumer = await opened_session(nursery, server)
        await consumer.send(wait(1))  # less than the floor: the floor holds
        assert await closed_after(consumer) == pytest.approx(IDLE_TIMEOUT_S, abs=0.01)


async def test_waits_alone_keep_a_session_at_most_max_quiet_s(autojump_clock):
    server = provider_server()
    async with trio.open_nursery() as nursery:
        consumer = await opened_session(nursery, server)
        began = trio.current_time()

        async def keep_announcing() -> None:
            while True:
                await consumer.send(wait(60))
                await trio.sleep(30)

        nursery.start_soon(keep_announcing)
        assert (await consumer.receive())["code"] == wire.IDLE
        assert trio.current_time() - began == pytest.approx(MAX_QUIET_S, abs=0.01)
        nursery.cancel_scope.cancel()


async def test_a_malformed_wait_ends_the_session_as_malformed(autojump_clock):
    server = provider_server()
    async with trio.open_nursery() as nursery:
        consumer = await opened_session(nursery, server)
        await consumer.send({"type": "wait", "s": 1e9})
        reply = await consumer.receive()
        assert reply["code"] == wire.MALFORMED and "wait" in reply["message"]
        assert await consumer.receive() is None


def project() -> dict:
    return Project(0, "o", 1, (b"ct",)).to_wire()


@pytest.mark.parametrize("protocol, busy", [(wire.PRIVATE, int(COMPUTE_S // BUSY_PERIOD_S)), (wire.PRIVATE_V2_0, 0)])
async def test_the_provider_says_busy_while_it_works_to_a_2_1_consumer_only(autojump_clock, protocol, busy):
    server = provider_server()
    async with trio.open_nursery() as nursery:
        consumer = await opened_session(nursery, server, protocol)
        await consumer.send(project())
        replies = [await consumer.receive()]
        while replies[-1]["type"] == "busy":
            replies.append(await consumer.receive())
        # (signing the answer runs in a thread, during which the virtual clock may run on)
        assert replies[-1]["type"] == "projected" and len(replies) - 1 >= busy
        assert len(replies) == 1 or protocol == wire.PRIVATE
        # The idle limit counts from the answer, not from the request.
        answered = trio.current_time()
        reply = await consumer.receive()
        assert (reply["code"] == wire.IDLE) if protocol == wire.PRIVATE else reply is None
        assert trio.current_time() - answered == pytest.approx(IDLE_TIMEOUT_S, abs=0.01)


async def test_debug_slow_steps_delay_the_private_requests_they_name(autojump_clock):
    server = provider_server(slow_steps=(1, 1, 50.0))
    async with trio.open_nursery() as nursery:
        consumer = await opened_session(nursery, server, wire.PRIVATE_V2_0)
        took = []
        for _ in range(3):
            began = trio.current_time()
            await consumer.send(project())
            assert (await consumer.receive())["type"] == "projected"
            took.append(trio.current_time() - began)
        nursery.cancel_scope.cancel()
    assert took == pytest.approx([COMPUTE_S, COMPUTE_S + 50.0, COMPUTE_S], abs=0.01)


# -- the consumer's side --

async def consumer_session(protocol: str = wire.PRIVATE) -> tuple[PrivateSession, FramedStream]:
    ours, theirs = stream_pair(protocol)
    hop = types.SimpleNamespace(peer_id="provider", start=0, end=2)
    session = PrivateSession(hop, FramedStream(ours, MAX_FRAME_BYTES), ("m", DEFAULT_PARAMETERS, DIGEST),
                             announces=protocol == wire.PRIVATE)
    session._quiet(private_session.PROVIDER_PATIENCE_S)  # as its handshake ends
    return session, FramedStream(theirs, MAX_FRAME_BYTES)


async def test_a_quiet_session_announces_its_next_wait_and_a_2_0_one_does_not(autojump_clock):
    session, provider = await consumer_session()
    await session.keep_alive()  # not quiet long enough yet
    await trio.sleep(KEEPALIVE_S)
    await session.keep_alive()
    assert decode_wait(await provider.receive()) == ANNOUNCED_WAIT_S
    await session.keep_alive()  # just announced: nothing more yet
    old, provider = await consumer_session(wire.PRIVATE_V2_0)
    await trio.sleep(KEEPALIVE_S * 3)
    await old.keep_alive()
    await session.keep_alive()
    await old.framed.close()
    await session.framed.close()
    assert await provider.receive() is None  # the 2.0.0 session sent nothing


def request(tokens: int = 1) -> Request:
    plan = types.SimpleNamespace(groups=lambda tokens: 1)
    return Request(tokens, plan, (b"ct",))


async def test_busy_frames_keep_a_request_waiting_and_silence_fails_it(autojump_clock, monkeypatch):
    monkeypatch.setattr(private_session, "signed_reply", lambda *args: "signed")
    silence = REQUEST_TIMEOUT_S + REQUEST_TIMEOUT_PER_TOKEN_S
    session, provider = await consumer_session()
    async with trio.open_nursery() as nursery:
        async def answer_late() -> None:
            assert (await provider.receive())["type"] == "project"
            for _ in range(10):  # 10 x 30 s of work, well past one silence
                await trio.sleep(30)
                await provider.send({"type": "busy"})
            await provider.send({"type": "projected", "cts": [[b"out"]], "compute_s": 300.0})
            assert (await provider.receive())["type"] == "project"  # and then silence

        nursery.start_soon(answer_late)
        outs, compute_s, signed = await session.project(0, "o", request())
        assert outs == [[b"out"]] and compute_s == 300.0 and signed == "signed"
        began = trio.current_time()
        with pytest.raises(trio.TooSlowError):
            await session.project(0, "o", request())
        assert trio.current_time() - began == pytest.approx(silence, abs=0.01)


async def test_a_request_after_a_quiet_past_the_providers_patience_is_late(autojump_clock, monkeypatch):
    monkeypatch.setattr(private_session, "signed_reply", lambda *args: "signed")
    session, provider = await consumer_session(wire.PRIVATE_V2_0)

    async def answer() -> None:
        while (message := await provider.receive()) is not None:
            assert message["type"] == "project"
            await provider.send({"type": "projected", "cts": [[b"out"]], "compute_s": 0.1})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(answer)
        await session.project(0, "o", request())
        assert not session.late
        await trio.sleep(IDLE_TIMEOUT_S - 15)
        await session.project(0, "o", request())
        assert not session.late
        await trio.sleep(IDLE_TIMEOUT_S - 5)  # within the margin of the provider's 60 s
        await session.project(0, "o", request())
        assert session.late
        await session.framed.close()


# -- the chain: a close after our own quiet costs no failover --

class ScriptedSession:
    """A session that answers, or fails once as a provider closing it would."""

    def __init__(self, hop, *, late: bool, fails: bool) -> None:
        self.hop, self.late, self.fails, self.closed = hop, late, fails, False

    async def project(self, layer, group, request):
        if self.fails:
            raise wire_closed(self.hop.peer_id)
        return [[b"out"]], 0.1, "signed"

    async def close(self) -> None:
        self.closed = True


def wire_closed(peer: str):
    from compushare.errors import CLOSED, HopFailed  # noqa: PLC0415

    return HopFailed(peer, CLOSED, f"{peer} closed the private session")


@pytest.fixture(scope="module")
def chain_parts(tiny_model):
    from compushare.he.ckks import SecretContext  # noqa: PLC0415
    from compushare.model.private_layers import PrivateLayers  # noqa: PLC0415

    return PrivateLayers.load(tiny_model, project=None), SecretContext()


@pytest.mark.parametrize("late", [True, False])
async def test_a_session_closed_after_our_own_quiet_is_reopened_unpenalised(chain_parts, late):
    from compushare.errors import HopFailed  # noqa: PLC0415
    from compushare.pipeline.client.private_chain import PrivateChain  # noqa: PLC0415

    layers, secret = chain_parts
    hop = types.SimpleNamespace(peer_id="provider", start=0, end=4)
    chain = PrivateChain(None, [hop], "m", layers, secret, b"keys")  # no planner: a failover would raise
    first = ScriptedSession(hop, late=late, fails=True)
    chain.sessions[0] = first
    opened = []

    async def open_hop(index: int) -> None:
        opened.append(index)
        chain.sessions[index] = ScriptedSession(hop, late=False, fails=False)

    chain._open_hop = open_hop
    if late:
        assert await chain._roundtrip(1, "o", request()) == ([[b"out"]], "signed")
        assert first.closed and opened == [0] and chain.stats.reopened == 1 and chain.failovers == []
    else:  # the provider closed while we were within what we announced: its failure
        with pytest.raises(HopFailed, match="no planner can replace it"):
            await chain._roundtrip(1, "o", request())
        assert opened == [] and chain.stats.reopened == 0
