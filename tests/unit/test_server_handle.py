"""The server's request handler answers any decoded frame with a reply, never raises."""

import dataclasses
import os
import threading

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compushare.config import ServerLimits
from compushare.model.blocks import SpanRunner
from compushare.net.tensors import decode_tensor, encode_tensor
from compushare.proofs.inference import DEFAULT_MODE, InputChain, Statement, step_digest, token_digests
from compushare.pipeline import protocol
from compushare.pipeline.server import inference
from compushare.pipeline.server.inference import InferenceServer
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

KEY = create_new_key_pair()

SESSION = os.urandom(16)
leaf = st.one_of(st.none(), st.booleans(), st.integers(-3, 10), st.floats(allow_nan=True), st.text(max_size=8),
                 st.binary(max_size=16), st.just(SESSION))
value = st.recursive(leaf, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(st.text(max_size=6), inner, max_size=4)),
                     max_leaves=12)
tensorish = st.fixed_dictionaries({"dtype": st.one_of(value, st.sampled_from(["float32", "bfloat16"])),
                                   "shape": st.one_of(value, st.just([1, 1, 64])),
                                   "data": st.one_of(value, st.just(bytes(256)))})
message = st.fixed_dictionaries(
    {"type": st.sampled_from(["open", "step", "truncate", "receipt", "link", "push", "close", "bogus"])},
    optional={"session": st.one_of(st.just(SESSION), value), "position": value, "start": value, "end": value,
              "max_tokens": value, "model": value, "hidden": st.one_of(tensorish, value), "receipt": value,
              "upstream": st.one_of(value, st.just(ID.from_pubkey(KEY.public_key).to_base58())),
              "downstream": value, "adapter": value},
)


@pytest.fixture(scope="module")
def server(tiny_model):
    return InferenceServer(SpanRunner.load(tiny_model, 0, 2), "model-x", ServerLimits(kv_budget_tokens=64), key_pair=KEY)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=6))
def test_any_message_gets_a_reply(server, messages):
    async def drive():
        for msg in messages:
            reply = await server.handle(msg)
            assert isinstance(reply, dict)
            assert reply["type"] in {"opened", "result", "truncated", "closed", "error"}  # no pushes here
            if reply["type"] == "error":
                assert isinstance(reply["code"], str) and reply["message"]
        server.sessions.close(SESSION)

    trio.run(drive)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=6))
def test_a_server_taking_pushes_answers_anything_or_takes_the_push(server, messages):
    async def drive():
        async with trio.open_nursery() as nursery:
            server.enable_push(None, nursery)
            try:
                for msg in messages:  # from the server's own id: it may be named upstream, and push
                    reply = await server.handle(msg, PEER_ID)
                    if reply is None:  # a push taken: only "push" may go unanswered
                        assert msg["type"] == "push"
                        continue
                    assert reply["type"] in {"opened", "result", "truncated", "closed", "linked", "error"}
            finally:
                server.sessions.close(SESSION)
                server.pushed = None

    trio.run(drive)


def test_valid_sequence_still_works_after_garbage(server):
    async def drive():
        assert (await server.handle({"type": "open", "session": SESSION, "model": "model-x", "start": 0,
                                     "end": 2, "max_tokens": 8}))["type"] == "opened"
        hidden = encode_tensor(torch.randn(1, 2, 64))
        reply = await server.handle({"type": "step", "session": SESSION, "position": 0, "hidden": hidden})
        assert reply["type"] == "result" and reply["position"] == 0
        reply = await server.handle({"type": "truncate", "session": SESSION, "position": 1})
        assert reply == {"type": "truncated", "session": SESSION, "position": 1}
        reply = await server.handle({"type": "step", "session": SESSION, "position": 1,
                                     "hidden": encode_tensor(torch.randn(1, 1, 64))})
        assert reply["type"] == "result"
        assert (await server.handle({"type": "close", "session": SESSION}))["type"] == "closed"

    trio.run(drive)


def test_a_request_kind_the_dispatch_forgets_is_refused_not_left_unanswered(server, monkeypatch):
    """A kind decode_request knows but _dispatch does not gets bad_request: no reply
    (None) would read as a push taken, and its sender would wait out its deadline."""
    @dataclasses.dataclass(frozen=True)
    class NewKind:
        session: bytes

    monkeypatch.setattr(inference, "decode_request", lambda message: NewKind(SESSION))
    reply = trio.run(server.handle, {"type": "new", "session": SESSION})
    assert reply["type"] == "error" and reply["code"] == protocol.BAD_REQUEST and reply["session"] == SESSION


# ---------------------------------------------------------------- chunks, last_only, proofs, limits

PEER_ID = ID.from_pubkey(KEY.public_key).to_base58()


@pytest.fixture(scope="module")
def runner(tiny_model):
    return SpanRunner.load(tiny_model, 0, 2)


def fresh(runner, **limits) -> InferenceServer:
    return InferenceServer(runner, "model-x", ServerLimits(**limits), key_pair=KEY)


async def opened(server, peer: str = "", start: int = 0, end: int = 2, max_tokens: int = 32) -> bytes:
    session = os.urandom(16)
    reply = await server.handle({"type": "open", "session": session, "model": "model-x", "start": start,
                                 "end": end, "max_tokens": max_tokens}, peer)
    assert reply["type"] == "opened", reply
    return session


async def step(server, session: bytes, position: int, hidden: torch.Tensor, **extra) -> dict:
    return await server.handle({"type": "step", "session": session, "position": position,
                                "hidden": encode_tensor(hidden)} | extra)


def output(reply: dict) -> torch.Tensor:
    assert reply["type"] == "result", reply
    return decode_tensor(reply["hidden"], hidden_size=64, max_tokens=64)


def assert_proof(reply: dict, start: int, end: int, inputs: bytes, dtype: str = "float32") -> None:
    """The proof signs the last chunk's output after the chain of every input before
    it, and the last chunk's input (all as sent)."""
    proof = reply["proof"]
    position, tokens = proof["position"], proof["tokens"]
    chain = InputChain()
    chain.extend(token_digests(dtype, inputs, position + tokens))
    assert proof["mode"] == DEFAULT_MODE
    assert proof["prefix"] == chain.at(position) and proof["input"] == chain.digest(position, tokens)
    data = reply["hidden"]["data"]
    last = data[len(data) - len(data) // reply["hidden"]["shape"][1] * tokens:]
    assert proof["output"] == step_digest(reply["hidden"]["dtype"], last, tokens)
    assert proof["rt"].startswith("torch/") and len(proof["forwards"]) == 32
    statement = Statement(DEFAULT_MODE, "model-x", start, end, position, tokens, proof["prefix"], proof["input"],
                          proof["output"], proof["rt"], proof["forwards"])
    assert statement.verify(PEER_ID, proof["sig"])
    other = ID.from_pubkey(create_new_key_pair().public_key).to_base58()
    assert not statement.verify(other, proof["sig"])


def test_chunked_step_is_bit_identical_to_separate_steps(runner):
    """A replacement server replaying a history as chunks rebuilds exactly the KV cache
    and outputs of the original steps, so failover replay is exact."""
    server = fresh(runner)
    x = torch.randn(1, 5, 64)

    async def drive():
        chunked = await opened(server)
        whole = await step(server, chunked, 0, x, chunks=[3, 1, 1])
        separate = await opened(server)
        parts = [await step(server, separate, 0, x[:, :3]), await step(server, separate, 3, x[:, 3:4]),
                 await step(server, separate, 4, x[:, 4:5])]
        assert torch.equal(output(whole), torch.cat([output(p) for p in parts], dim=1))
        # the proofs match too: same last chunk, same input stream, whatever the chunking
        assert whole["proof"]["position"] == 4 and whole["proof"]["tokens"] == 1
        assert whole["proof"] == parts[-1]["proof"]
        assert_proof(whole, 0, 2, x.numpy().tobytes())
        # which names the forwards the cache was built in: 3, 1, 1 here, not one of five
        built = InputChain()
        built.extend(token_digests("float32", x.numpy().tobytes(), 5), (3, 1, 1))
        assert whole["proof"]["forwards"] == built.forwards(5)
        assert (await step(server, await opened(server), 0, x))["proof"]["forwards"] != built.forwards(5)
        # and the next step continues both caches identically
        y = torch.randn(1, 1, 64)
        assert torch.equal(output(await step(server, chunked, 5, y)), output(await step(server, separate, 5, y)))

    trio.run(drive)


@pytest.mark.parametrize("chunks", [[2, 2], [3, 3], [5, 0], [6, -1], [True, 4], [4, True], [], [5.0], "5", 5,
                                    {"a": 5}, [None]])
def test_bad_chunks_are_a_bad_request_and_change_nothing(runner, chunks):
    server = fresh(runner)
    x = torch.randn(1, 5, 64)

    async def drive():
        session = await opened(server)
        reply = await step(server, session, 0, x, chunks=chunks)
        assert reply["type"] == "error" and reply["code"] == "bad_request" and reply["session"] == session
        # the session did not advance, and the refused input is not in the digest
        good = await step(server, session, 0, x[:, :2], chunks=[1, 1])
        assert output(good).shape == (1, 2, 64)
        assert_proof(good, 0, 2, x[:, :2].numpy().tobytes())

    trio.run(drive)


def test_last_only_returns_the_last_chunk(runner):
    server = fresh(runner)
    x = torch.randn(1, 5, 64)

    async def drive():
        full = await step(server, await opened(server), 0, x, chunks=[3, 2])
        last = await step(server, await opened(server), 0, x, chunks=[3, 2], last_only=True)
        assert output(last).shape == (1, 2, 64)
        assert torch.equal(output(last), output(full)[:, 3:])
        assert last["proof"] == full["proof"] and last["proof"]["position"] == 3 and last["proof"]["tokens"] == 2
        assert_proof(last, 0, 2, x.numpy().tobytes())
        one = await step(server, await opened(server), 0, x, last_only=True)  # one chunk: every token
        assert torch.equal(output(one), output(await step(server, await opened(server), 0, x)))
        bogus = await step(server, await opened(server), 0, x, last_only="yes")  # only True counts
        assert output(bogus).shape == (1, 5, 64)

    trio.run(drive)


def test_every_result_carries_a_proof_over_all_inputs_so_far(runner):
    server = fresh(runner)

    async def drive():
        for start, end in [(0, 2), (1, 2), (0, 1)]:
            session = await opened(server, start=start, end=end)
            inputs, position = b"", 0
            for tokens in (4, 1, 1, 2):
                x = torch.randn(1, tokens, 64)
                reply = await step(server, session, position, x)
                inputs += x.numpy().tobytes()
                assert reply["proof"]["position"] == position and reply["proof"]["tokens"] == tokens
                assert_proof(reply, start, end, inputs)
                position += tokens

    trio.run(drive)


def test_half_precision_inputs_are_digested_as_sent(runner):
    server = fresh(runner)
    x = torch.randn(1, 3, 64, dtype=torch.float16)

    async def drive():
        reply = await step(server, await opened(server), 0, x, chunks=[2, 1])
        assert reply["hidden"]["dtype"] == "float16"
        assert_proof(reply, 0, 2, x.numpy().tobytes(), "float16")

    trio.run(drive)


def test_a_burst_beyond_the_rate_is_rate_limited_per_peer(runner):
    server = fresh(runner, peer_requests_per_s=1.0)  # a burst of 2 requests

    async def drive():
        replies = [await server.handle({"type": "close", "session": SESSION}, "greedy") for _ in range(4)]
        assert [r["type"] for r in replies[:2]] == ["closed", "closed"]
        for reply in replies[2:]:
            assert reply["type"] == "error" and reply["code"] == "rate_limited"
            assert isinstance(reply["retry_after_s"], float) and 0 < reply["retry_after_s"] <= 1.0
        assert (await server.handle({"type": "close", "session": SESSION}, "polite"))["type"] == "closed"

    trio.run(drive)


def test_bytes_beyond_the_rate_are_rate_limited(runner):
    server = fresh(runner, peer_bytes_per_s=1000.0, max_frame_bytes=2000)  # a burst of 2000 bytes

    async def drive():
        close = {"type": "close", "session": SESSION}
        assert (await server.handle(close, "p", 1500))["type"] == "closed"
        reply = await server.handle(close, "p", 1500)
        assert reply["code"] == "rate_limited" and 0 < reply["retry_after_s"] <= 1.0
        assert (await server.handle(close, "p", 400))["type"] == "closed"  # the refusal took nothing

    trio.run(drive)


def test_sessions_per_peer_are_limited(runner):
    server = fresh(runner, max_sessions_per_peer=2)

    async def drive():
        first = await opened(server, "a")
        await opened(server, "a")
        reply = await server.handle({"type": "open", "session": os.urandom(16), "model": "model-x", "start": 0,
                                     "end": 2, "max_tokens": 8}, "a")
        assert reply["type"] == "error" and reply["code"] == "busy"
        await opened(server, "b")  # another peer is not affected
        await server.handle({"type": "close", "session": first}, "a")
        await opened(server, "a")  # a closed session frees its slot

    trio.run(drive)


def test_sessions_are_limited_in_total(runner):
    server = fresh(runner, max_sessions=2)

    async def drive():
        first = await opened(server, "a")
        await opened(server, "b")
        for peer in ("a", "b", "c"):
            reply = await server.handle({"type": "open", "session": os.urandom(16), "model": "model-x",
                                         "start": 0, "end": 2, "max_tokens": 8}, peer)
            assert reply["type"] == "error" and reply["code"] == "busy"
        await server.handle({"type": "close", "session": first}, "a")
        await opened(server, "c")

    trio.run(drive)


def test_short_decode_steps_run_on_the_loop_and_the_rest_in_worker_threads(runner, monkeypatch):
    """A one-token step that the measured rate predicts short runs on the event loop
    (no GIL shared with the loop's own network work); a prefill, a server that has not
    measured its rate yet, several compute threads and a slowed runner use worker
    threads. Both give the very same outputs."""
    on_loop: list[bool] = []
    forward = runner.forward

    def spy(*args, **kwargs):
        on_loop.append(threading.current_thread() is threading.main_thread())
        return forward(*args, **kwargs)

    monkeypatch.setattr(runner, "forward", spy)
    torch.manual_seed(3)
    inputs = [torch.randn(1, 4, 64), torch.randn(1, 1, 64), torch.randn(1, 1, 64)]

    def run(server) -> list[torch.Tensor]:
        async def drive():
            session = await opened(server)
            outs, position = [], 0
            for hidden in inputs:
                outs.append(output(await step(server, session, position, hidden)))
                position += hidden.shape[1]
            return outs

        on_loop.clear()
        return trio.run(drive)

    inline = run(fresh(runner))
    assert on_loop == [False, False, True]  # the prefill; unmeasured; measured by the step before
    threaded = run(fresh(runner, compute_threads=2))
    assert on_loop == [False, False, False]
    assert all(torch.equal(a, b) for a, b in zip(inline, threaded))
    monkeypatch.setattr(runner, "slowdown", 1.5)
    run(fresh(runner))
    assert on_loop == [False, False, False]
