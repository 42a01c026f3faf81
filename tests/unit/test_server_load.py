"""The server's live figures for its ads: load over the last window, and the decode
rate refined from served steps; and what a move does to open sessions."""

from __future__ import annotations

import os

import pytest
import torch

from compushare.config import ServerLimits
from compushare.model.blocks import SpanRunner
from compushare.net.tensors import encode_tensor
from compushare.pipeline.server.compute import LOAD_WINDOW_S
from compushare.pipeline.server.inference import InferenceServer
from libp2p.crypto.ed25519 import create_new_key_pair

KEY = create_new_key_pair()


@pytest.fixture
def server(tiny_model):
    return InferenceServer(SpanRunner.load(tiny_model, 0, 2), "m", ServerLimits(), key_pair=KEY, block_rate=100.0)


def test_load_is_the_busy_share_of_the_window(server):
    assert server.load(now=1000.0) == 0.0
    server.compute.busy.extend([(997.0, 2.0, 5), (999.0, 1.0, 1)])
    assert server.load(now=1000.0) == pytest.approx(3.0 / LOAD_WINDOW_S)
    assert server.throughput(now=1000.0) == pytest.approx(6 / LOAD_WINDOW_S)
    # Work that ended before the window counts for nothing; work straddling its start, in part.
    assert server.load(now=1000.0 + LOAD_WINDOW_S - 4.0) == pytest.approx((1.0 + 1.0) / LOAD_WINDOW_S)
    assert server.load(now=1000.0 + LOAD_WINDOW_S + 1) == 0.0 and not server.compute.busy


def test_decode_steps_refine_the_rate_prefill_does_not(server):
    server.compute.observe(tokens=16, blocks=2, seconds=1.0)
    assert server.block_rate == 100.0
    server.compute.observe(tokens=1, blocks=2, seconds=0.1)  # 20 block-steps/s
    assert server.block_rate == pytest.approx(0.8 * 100 + 0.2 * 20)
    fresh = InferenceServer(server.runner, "m", ServerLimits(), key_pair=KEY)
    fresh.compute.observe(tokens=1, blocks=2, seconds=0.1)
    assert fresh.block_rate == pytest.approx(20.0)


async def test_served_steps_are_observed_and_a_move_drops_sessions(server, tiny_model):
    session = os.urandom(16)
    opened = await server.handle({"type": "open", "session": session, "model": "m", "start": 0, "end": 2,
                                  "max_tokens": 8})
    assert opened["type"] == "opened"
    reply = await server.handle({"type": "step", "session": session, "position": 0,
                                 "hidden": encode_tensor(torch.randn(1, 1, 64))})
    assert reply["type"] == "result" and server.load() > 0 and server.block_rate != 100.0
    assert server.replace_runner(SpanRunner.load(tiny_model, 2, 4)) == 1
    gone = await server.handle({"type": "step", "session": session, "position": 1,
                                "hidden": encode_tensor(torch.randn(1, 1, 64))})
    assert gone["type"] == "error" and gone["code"] == "unknown_session"
    assert server.sessions.free_tokens == server.limits.kv_budget_tokens
