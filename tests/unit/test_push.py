"""Server-to-server pushes (pipeline/server/push.py) on the receiving server: a pushed step
is used only when the consumer's step carries the same input; anything else is
rolled back, so a wrong push never changes an answer."""

import os

import pytest
import torch
import trio
import trio.testing
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.config import ServerLimits
from compushare.model.blocks import SpanRunner
from compushare.net.tensors import decode_tensor, encode_tensor
from compushare.pipeline.server.inference import InferenceServer
from compushare.pipeline.server.session import State

KEY = create_new_key_pair()
OWNER = ID.from_pubkey(create_new_key_pair().public_key).to_base58()  # the consumer
UPSTREAM = ID.from_pubkey(create_new_key_pair().public_key).to_base58()  # the previous hop
STRANGER = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
SESSION = os.urandom(16)


@pytest.fixture
def make_server(tiny_model):
    runner = SpanRunner.load(tiny_model, 0, 2)
    return lambda: InferenceServer(runner, "model-x", ServerLimits(kv_budget_tokens=256), key_pair=KEY)


def inputs(seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(1, n, 64, generator=generator) for n in (3, 1, 1, 1)]


async def open_session(server: InferenceServer, *, link: bool = True) -> None:
    reply = await server.handle({"type": "open", "session": SESSION, "model": "model-x", "start": 0, "end": 2,
                                 "max_tokens": 64}, OWNER)
    assert reply["type"] == "opened"
    if link:
        reply = await server.handle({"type": "link", "session": SESSION, "upstream": UPSTREAM, "downstream": None},
                                    OWNER)
        assert reply == {"type": "linked", "session": SESSION}


async def step(server: InferenceServer, hidden: torch.Tensor, position: int) -> torch.Tensor:
    reply = await server.handle({"type": "step", "session": SESSION, "position": position,
                                 "hidden": encode_tensor(hidden)}, OWNER)
    assert reply["type"] == "result", reply
    return decode_tensor(reply["hidden"], hidden_size=64, max_tokens=64)


async def push(server: InferenceServer, hidden: torch.Tensor, position: int, peer: str = UPSTREAM):
    return await server.handle({"type": "push", "session": SESSION, "position": position,
                                "hidden": encode_tensor(hidden)}, peer)


async def reference(make_server, steps: list[torch.Tensor]) -> list[torch.Tensor]:
    server = make_server()
    await open_session(server, link=False)
    out, position = [], 0
    for hidden in steps:
        out.append(await step(server, hidden, position))
        position += hidden.shape[1]
    return out


@pytest.mark.parametrize("lying", [False, True], ids=["honest", "lying-every-other-step"])
def test_a_push_never_changes_an_answer(make_server, lying):
    """An honest upstream's pushes are used; a lying (or stale) one's are rolled back
    and the consumer's input computed. Either way the answers are the reference's."""

    async def main():
        steps = inputs()
        expected = await reference(make_server, steps)
        server = make_server()
        async with trio.open_nursery() as nursery:
            server.enable_push(None, nursery)
            await open_session(server)
            position = 0
            for index, (hidden, want) in enumerate(zip(steps, expected)):
                pushed = hidden + 1.0 if lying and index % 2 == 0 else hidden
                assert await push(server, pushed, position) is None  # taken: no reply
                assert torch.equal(await step(server, hidden, position), want)
                position += hidden.shape[1]
        assert (server.push_hits, server.push_misses) == ((2, 2) if lying else (len(steps), 0))
        assert server.tokens_served == position  # counted once, not once per copy
        assert server.runner.cached_length(server.sessions.get(SESSION).cache) == position

    trio.run(main)


def test_pushes_refused_get_an_error_and_change_nothing(make_server):
    async def main():
        steps = inputs()
        expected = await reference(make_server, steps)
        server = make_server()
        await open_session(server, link=False)
        assert (await push(server, steps[0], 0))["code"] == "bad_request"  # no nursery: takes no pushes
        async with trio.open_nursery() as nursery:
            server.enable_push(None, nursery)
            assert (await push(server, steps[0], 0))["code"] == "bad_request"  # not linked
            reply = await server.handle({"type": "link", "session": SESSION, "upstream": UPSTREAM,
                                         "downstream": None}, STRANGER)
            assert reply["code"] == "bad_request" and "only the consumer" in reply["message"]
            await open_session_link_only(server)
            assert (await push(server, steps[0], 0, peer=STRANGER))["code"] == "bad_request"
            assert (await push(server, steps[0], 5))["code"] == "out_of_order"
            reply = await server.handle({"type": "link", "session": SESSION, "upstream": "not a peer id",
                                         "downstream": None}, OWNER)
            assert reply["code"] == "bad_request"
            reply = await server.handle({"type": "link", "session": SESSION, "upstream": None,
                                         "downstream": {"peer": UPSTREAM, "addrs": "x", "session": SESSION}}, OWNER)
            assert reply["code"] == "bad_request"
            assert torch.equal(await step(server, steps[0], 0), expected[0])
        assert server.push_hits == server.push_misses == 0

    trio.run(main)


async def open_session_link_only(server: InferenceServer) -> None:
    reply = await server.handle({"type": "link", "session": SESSION, "upstream": UPSTREAM, "downstream": None}, OWNER)
    assert reply["type"] == "linked"


def test_truncate_discards_a_pushed_step(make_server):
    async def main():
        steps = inputs()
        expected = await reference(make_server, steps[:2])
        server = make_server()
        async with trio.open_nursery() as nursery:
            server.enable_push(None, nursery)
            await open_session(server)
            assert torch.equal(await step(server, steps[0], 0), expected[0])
            await push(server, steps[1] * 3, 3)
            reply = await server.handle({"type": "truncate", "session": SESSION, "position": 3}, OWNER)
            assert reply["type"] == "truncated"
            assert torch.equal(await step(server, steps[1], 3), expected[1])

    trio.run(main)


def test_a_pushed_step_never_confirmed_lets_its_session_expire(make_server):
    async def main():
        server = make_server()
        async with trio.open_nursery() as nursery:
            server.enable_push(None, nursery)
            await open_session(server)
            await push(server, inputs()[0], 0)
            with trio.fail_after(10):
                while server.sessions.get(SESSION).state is not State.PUSH_COMPUTED:
                    await trio.sleep(0.01)
        table = server.sessions
        expired = table.expire(table.get(SESSION).last_used + table.idle_timeout_s + 1)
        assert [s.session_id for s in expired] == [SESSION]

    trio.run(main)


def test_a_pushed_step_that_fails_leaves_the_consumers_step_to_compute(make_server):
    async def main():
        steps = inputs()
        expected = await reference(make_server, steps[:2])
        server = make_server()
        runner, failures = server.runner, []
        real_forward = runner.forward

        def forward_failing_once(*args, **kwargs):
            if not failures:
                failures.append(1)
                raise RuntimeError("injected: out of memory")
            return real_forward(*args, **kwargs)

        runner.forward = forward_failing_once
        try:
            async with trio.open_nursery() as nursery:
                server.enable_push(None, nursery)
                await open_session(server)
                await push(server, steps[0], 0)  # its compute fails: rolled back, step ended
                assert torch.equal(await step(server, steps[0], 0), expected[0])
                await push(server, steps[1], 3)
                assert torch.equal(await step(server, steps[1], 3), expected[1])
        finally:
            del runner.forward  # the fixture's runner is shared
        assert failures and (server.push_hits, server.push_misses) == (1, 0)

    trio.run(main)


DOWNSTREAM = ID.from_pubkey(create_new_key_pair().public_key).to_base58()  # the next hop


class PushStream:
    """The stream to the next hop: each write takes `delay` seconds (None: it never
    finishes); nothing ever comes back."""

    def __init__(self, delay: float | None) -> None:
        self.delay = delay
        self.written_at: list[float] = []

    async def write(self, data: bytes) -> None:
        if self.delay is None:
            await trio.sleep_forever()
        await trio.sleep(self.delay)
        self.written_at.append(trio.current_time())

    async def read(self, n: int = -1) -> bytes:
        await trio.sleep_forever()

    async def reset(self) -> None:
        pass


async def _linked_downstream(server: InferenceServer, nursery: trio.Nursery, stream: PushStream) -> None:
    import trio.testing

    server.enable_push(None, nursery)
    nursery.start_soon(server.pushes.serve_link, DOWNSTREAM, stream)
    await trio.testing.wait_all_tasks_blocked()
    await open_session(server, link=False)
    reply = await server.handle({"type": "link", "session": SESSION, "upstream": None,
                                 "downstream": {"peer": DOWNSTREAM, "addrs": [], "session": os.urandom(16)}}, OWNER)
    assert reply == {"type": "linked", "session": SESSION}


async def test_a_step_is_pushed_on_before_its_reply_goes_back(make_server):
    # The push is on the token's critical path, the consumer's reply is not.
    server = make_server()
    stream = PushStream(0.005)
    async with trio.open_nursery() as nursery:
        await _linked_downstream(server, nursery, stream)
        position = 0
        for hidden in inputs():
            await step(server, hidden, position)
            position += hidden.shape[1]
            assert len(stream.written_at) == server.pushes.sent and stream.written_at[-1] <= trio.current_time()
        assert server.pushes.sent == 4
        nursery.cancel_scope.cancel()


async def test_a_stalled_push_holds_a_reply_back_only_briefly(make_server):
    from compushare.pipeline.server.pushed import PUSH_FIRST_MAX_S

    server = make_server()
    stream = PushStream(None)
    async with trio.open_nursery() as nursery:
        await _linked_downstream(server, nursery, stream)
        position = 0
        for hidden in inputs()[:2]:  # the 2nd push waits in the queue behind the stalled 1st
            began = trio.current_time()
            await step(server, hidden, position)
            assert PUSH_FIRST_MAX_S <= trio.current_time() - began < PUSH_FIRST_MAX_S + 1.0
            position += hidden.shape[1]
        assert stream.written_at == [] and server.pushes.sent == 0
        nursery.cancel_scope.cancel()


class DeadEndStream(PushStream):
    """The stream to a next hop that was killed: a write fails at once, and the stream
    takes a moment to end on this side (py-libp2p's reset is not instant)."""

    def __init__(self) -> None:
        super().__init__(0.0)
        self.failed = trio.Event()
        self.reset = trio.Event()  # set by the test once its steps are done

    async def write(self, data: bytes) -> None:
        self.failed.set()
        raise trio.BrokenResourceError("the next hop's connection was reset")

    async def read(self, n: int = -1) -> bytes:
        await self.failed.wait()
        with trio.CancelScope(shield=True):
            await self.reset.wait()
        return b""


async def test_a_step_pushed_to_a_dead_next_hop_is_answered_all_the_same(make_server):
    # The push stream to a killed server breaks while a step is being computed: the
    # step's push is dropped (a push is only a saving), and its reply goes back. A
    # step that failed here instead closed this hop's own stream, and the consumer
    # blamed this server for its neighbour's death.
    server = make_server()
    stream = DeadEndStream()
    async with trio.open_nursery() as nursery:
        await _linked_downstream(server, nursery, stream)
        position = 0
        try:
            for hidden in inputs():
                await step(server, hidden, position)  # a result: `step` checks it
                position += hidden.shape[1]
                await trio.testing.wait_all_tasks_blocked()  # the broken link's sender has run
        finally:
            stream.reset.set()  # the stream ends only now: every step came while the link was broken
        assert stream.failed.is_set() and server.pushes.sent == 0
        nursery.cancel_scope.cancel()
