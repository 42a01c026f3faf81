"""LoRA adapters in the KV-cached inference path: batched sessions carrying different
adapters (or none) agree with each alone, and a server session opened with an
adapter applies it to every step, signs proofs naming it, refuses bad ones and
bounds what adapters hold."""

from __future__ import annotations

import os

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from compushare.config import ServerLimits
from compushare.model.arch import load_config
from compushare.model.batched import decode_batch
from compushare.model.blocks import SpanRunner
from compushare.model.head import ConsumerHead
from compushare.net.tensors import decode_tensor, encode_tensor
from compushare.pipeline.adapter_wire import adapter_to_wire
from compushare.pipeline.server.adapters import SessionAdapters
from compushare.pipeline.server.inference import InferenceServer
from compushare.proofs.inference import DEFAULT_MODE, Statement, adapted_model, relative_error
from helpers import random_adapter

KEY = create_new_key_pair()
PEER = ID.from_pubkey(KEY.public_key).to_base58()


@pytest.fixture(scope="module")
def config(tiny_model):
    return load_config(tiny_model)


@pytest.fixture(scope="module")
def runner(tiny_model):
    return SpanRunner.load(tiny_model, 0, 2)


def test_batched_sessions_with_different_adapters_agree_with_each_alone(tiny_model, config):
    head, runner = ConsumerHead.load(tiny_model), SpanRunner.load(tiny_model, 0, 4)
    adapters = [random_adapter(config, seed=1), None,
                random_adapter(config, seed=2, rank=2, targets=("k_proj", "gate_proj", "up_proj"))]
    prompts = [[1, 5, 9, 13], [1, 200, 3], [1, 7, 7, 40]]

    def prefilled():
        caches = []
        for prompt, adapter in zip(prompts, adapters):
            caches.append(runner.new_cache())
            runner.forward(head.embed_tokens(prompt), caches[-1], 0, adapter=adapter)
        return caches

    alone, batched = prefilled(), prefilled()
    worst, moved = 0.0, 0.0
    for step in range(4):
        xs = [head.embed_tokens([20 + step + i]) for i in range(len(prompts))]
        positions = [runner.cached_length(c) for c in batched]
        outs = decode_batch(runner, xs, batched, positions, 0, 4, adapters)
        for x, cache, out, position, adapter in zip(xs, alone, outs, positions, adapters):
            expected = runner.forward(x, cache, position, adapter=adapter)
            worst = max(worst, relative_error(out.numpy(), expected.numpy()))
            if adapter is not None:  # the adapter changes the output: the check is not vacuous
                plain = runner.forward(x, runner.new_cache(), 0)
                moved = max(moved, relative_error(plain.numpy(), runner.forward(x, runner.new_cache(), 0,
                                                                               adapter=adapter).numpy()))
    assert worst < 1e-5, worst  # matrix-product rounding only, as without adapters
    assert moved > 1e-2, moved


async def _open(server, adapter_wire=None, *, start=0, end=2, peer=PEER):
    session = os.urandom(16)
    message = {"type": "open", "session": session, "model": "model-x", "start": start, "end": end,
               "max_tokens": 32}
    if adapter_wire is not None:
        message["adapter"] = adapter_wire
    return session, await server.handle(message, peer)


async def _step(server, session, position, hidden, peer=PEER):
    reply = await server.handle({"type": "step", "session": session, "position": position,
                                 "hidden": encode_tensor(hidden)}, peer)
    assert reply["type"] == "result", reply
    return reply, decode_tensor(reply["hidden"], hidden_size=64, max_tokens=64)


def test_a_session_opened_with_an_adapter_applies_it_and_its_proofs_name_it(runner, config):
    server = InferenceServer(runner, "model-x", ServerLimits(), key_pair=KEY)
    adapter = random_adapter(config, range(0, 2), seed=3)
    wire = adapter_to_wire(adapter, with_tensors=True)
    x, y = torch.randn(1, 3, 64), torch.randn(1, 1, 64)

    async def drive():
        adapted, reply = await _open(server, wire)
        assert reply["type"] == "opened" and reply["adapter"] == wire["digest"]
        plain, reply = await _open(server)
        assert reply["type"] == "opened" and "adapter" not in reply
        outputs = {}
        for name, session in (("adapted", adapted), ("plain", plain)):
            first, out_x = await _step(server, session, 0, x)
            _, out_y = await _step(server, session, 3, y)
            outputs[name] = (first, out_x, out_y)
        return outputs

    outputs = trio.run(drive)
    for name, use in (("adapted", adapter), ("plain", None)):
        cache = runner.new_cache()
        first, out_x, out_y = outputs[name]
        assert torch.equal(out_x, runner.forward(x, cache, 0, adapter=use))
        assert torch.equal(out_y, runner.forward(y, cache, 3, adapter=use))
        proof = first["proof"]
        statement = Statement(DEFAULT_MODE, adapted_model("model-x", use and wire["digest"]), 0, 2,
                              proof["position"], proof["tokens"], proof["prefix"], proof["input"], proof["output"],
                              proof["rt"], proof["forwards"])
        assert statement.verify(PEER, proof["sig"]), name
    assert not torch.equal(outputs["adapted"][1], outputs["plain"][1])


def test_batched_server_steps_apply_each_sessions_adapter(runner, config):
    """Decode steps of sessions with different adapters, sent at once, are batched
    (the server counts it) and each equals its session's forward alone."""
    server = InferenceServer(runner, "model-x", ServerLimits(), key_pair=KEY)
    adapters = [random_adapter(config, range(0, 2), seed=4), None, random_adapter(config, range(0, 2), seed=5)]
    prompt, token = torch.randn(1, 2, 64), torch.randn(1, 1, 64)

    async def drive():
        sessions, outs = [], [None] * len(adapters)
        for adapter in adapters:
            session, reply = await _open(server, adapter and adapter_to_wire(adapter, with_tensors=True))
            assert reply["type"] == "opened", reply
            await _step(server, session, 0, prompt)
            sessions.append(session)

        async def one(i):
            outs[i] = (await _step(server, sessions[i], 2, token))[1]

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for i in range(len(sessions)):
                    nursery.start_soon(one, i)
        return outs

    outs = trio.run(drive)
    assert server.compute.batched_steps >= 2
    for adapter, out in zip(adapters, outs):
        cache = runner.new_cache()
        runner.forward(prompt, cache, 0, adapter=adapter)
        expected = runner.forward(token, cache, 2, adapter=adapter)
        assert relative_error(out.numpy(), expected.numpy()) < 1e-5


def test_bad_adapters_are_refused_and_the_server_keeps_serving(runner, config):
    server = InferenceServer(runner, "model-x", ServerLimits(), key_pair=KEY)
    adapter = random_adapter(config, range(0, 2), seed=6)
    good = adapter_to_wire(adapter, with_tensors=True)
    tampered = dict(good, digest=bytes(32))
    outside = adapter_to_wire(random_adapter(config, range(0, 4), seed=6), with_tensors=True)  # layers 2, 3 too
    wrong_shape = adapter_to_wire(random_adapter(load_config_with(config, hidden_size=32, intermediate_size=64),
                                                 range(0, 2)), with_tensors=True)

    async def drive():
        for bad in (tampered, outside, wrong_shape, {"digest": b"x"}, "not a map"):
            session, reply = await _open(server, bad)
            assert reply["type"] == "error" and reply["code"] == "bad_adapter", reply
            assert session not in server.sessions
        _, reply = await _open(server, {"digest": os.urandom(32), "spec": good["spec"]})
        assert reply["code"] == "unknown_adapter"
        session, reply = await _open(server, good)
        assert reply["type"] == "opened"
        await _step(server, session, 0, torch.randn(1, 1, 64))
        # Named by its digest alone once held: the same adapter, no tensors sent again.
        _, reply = await _open(server, {"digest": good["digest"], "spec": good["spec"]})
        assert reply["type"] == "opened" and reply["adapter"] == good["digest"]

    trio.run(drive)


def load_config_with(config, **changes):
    import copy

    other = copy.deepcopy(config)
    for key, value in changes.items():
        setattr(other, key, value)
    return other


def test_what_open_sessions_hold_of_adapters_is_bounded_per_peer(runner, config):
    one, two = (random_adapter(config, range(0, 2), seed=s) for s in (7, 8))
    server = InferenceServer(runner, "model-x", ServerLimits(), key_pair=KEY)
    server.adapters = SessionAdapters(peer_bytes=one.nbytes * 3 // 2, total_bytes=one.nbytes * 5 // 2)
    wires = [adapter_to_wire(a, with_tensors=True) for a in (one, two)]

    async def drive():
        first, reply = await _open(server, wires[0])
        assert reply["type"] == "opened"
        _, reply = await _open(server, wires[0])  # the same adapter: shared, costs nothing more
        assert reply["type"] == "opened"
        _, reply = await _open(server, wires[1])
        assert reply["code"] == "busy" and "adapters" in reply["message"]
        _, reply = await _open(server, wires[1], peer="another-peer")  # another peer's share
        assert reply["type"] == "opened"
        _, reply = await _open(server, wires[0], peer="a-third-peer")
        assert reply["code"] == "busy"  # the server's total
        for session in list(server.sessions._sessions):
            await server.handle({"type": "close", "session": session}, PEER)
        _, reply = await _open(server, wires[1])
        assert reply["type"] == "opened"

    trio.run(drive)
