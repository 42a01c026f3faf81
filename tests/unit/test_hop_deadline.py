"""A hop's deadline: a prompt's tokens are given the span's compute per token, not the
link's round trip (paid once a step)."""

import math

import pytest

from compushare.pipeline.client.hop import MIN_DEADLINE_S, RemoteHop
from compushare.pipeline.client.routing import Hop
from compushare.net.records import ServerRecord


def remote(rtt_s: float, compute_s: float) -> RemoteHop:
    hop = Hop(ServerRecord("12D3KooWpeer", "ab" * 32, 0, 4, "float32", (), math.inf, 0), 0, 4, rtt_s, compute_s)
    return RemoteHop(hop, framed=None, hidden_size=8, session_id=b"s")


def test_a_prompt_on_a_slow_link_is_given_compute_per_token_not_round_trips():
    far = remote(rtt_s=0.3, compute_s=0.02)
    near = remote(rtt_s=0.001, compute_s=0.02)
    # 100 prompt tokens: one step's latency allowance, then the compute per token.
    assert far.deadline(100) - near.deadline(100) == pytest.approx(5 * (far.latency - near.latency))
    assert near.deadline(100) == pytest.approx(MIN_DEADLINE_S + 5 * near.latency + 100 * 0.02)


def test_a_heavy_span_gives_each_prompt_token_a_decode_steps_compute():
    heavy = remote(rtt_s=0.001, compute_s=0.15)  # 11 blocks of an 8B-shaped model, one thread
    assert heavy.deadline(31) > 31 * 0.15
    light = remote(rtt_s=0.001, compute_s=0.0001)
    assert light.deadline(31) == pytest.approx(MIN_DEADLINE_S + 5 * light.latency + 31 * 0.01)
