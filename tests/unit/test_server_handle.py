"""The server's request handler answers any decoded frame with a reply, never raises."""

import os

import pytest
import torch
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compushare.config import ServerLimits
from compushare.model.blocks import SpanRunner
from compushare.net.tensors import encode_tensor
from compushare.pipeline.server import InferenceServer
from libp2p.crypto.ed25519 import create_new_key_pair

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
    {"type": st.sampled_from(["open", "step", "truncate", "close", "bogus"])},
    optional={"session": st.one_of(st.just(SESSION), value), "position": value, "start": value, "end": value,
              "max_tokens": value, "model": value, "hidden": st.one_of(tensorish, value)},
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
            assert reply["type"] in {"opened", "result", "truncated", "closed", "error"}
            if reply["type"] == "error":
                assert isinstance(reply["code"], str) and reply["message"]
        server.sessions.close(SESSION)

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
