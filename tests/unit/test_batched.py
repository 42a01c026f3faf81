"""model/batched.py: several sessions' decode steps as one forward. One session's is
bit-identical to SpanRunner.forward; several sessions' agree with each one alone
within the rounding of a matrix product (measured here on the tiny model), and
their caches hold the same tokens."""

from __future__ import annotations

import pytest
import torch

from compushare.model.batched import decode_batch, supports_batching
from compushare.model.blocks import SpanRunner
from compushare.model.head import ConsumerHead
from compushare.proofs.inference import relative_error

PROMPTS = [[1, 5, 9, 13], [1, 200, 3], [1, 7, 7, 7, 7, 7, 40], [1, 99]]


@pytest.fixture(scope="module")
def parts(tiny_model):
    return ConsumerHead.load(tiny_model), SpanRunner.load(tiny_model, 1, 4)


def prefilled(head, runner, prompt):
    cache = runner.new_cache()
    runner.forward(head.embed_tokens(prompt), cache, 0)
    return cache


def test_one_session_is_bit_identical_to_the_plain_forward(parts):
    head, runner = parts
    assert supports_batching(runner)
    alone, batched = prefilled(head, runner, PROMPTS[0]), prefilled(head, runner, PROMPTS[0])
    for token in (11, 12, 13):
        x = head.embed_tokens([token])
        expected = runner.forward(x, alone, runner.cached_length(alone))
        [out] = decode_batch(runner, [x], [batched], [runner.cached_length(batched)], runner.start, runner.end)
        assert torch.equal(out, expected)


def test_sessions_batched_agree_with_each_alone(parts):
    head, runner = parts
    alone = [prefilled(head, runner, p) for p in PROMPTS]
    batched = [prefilled(head, runner, p) for p in PROMPTS]
    worst = 0.0
    for step in range(4):
        xs = [head.embed_tokens([20 + step + i]) for i in range(len(PROMPTS))]
        positions = [runner.cached_length(c) for c in batched]
        outs = decode_batch(runner, xs, batched, positions, runner.start, runner.end)
        for x, cache, out, position in zip(xs, alone, outs, positions):
            expected = runner.forward(x, cache, position)
            worst = max(worst, relative_error(out.numpy(), expected.numpy()))
    assert worst < 1e-5, worst  # matrix-product rounding only; the protocol's fp32 tolerance is 1e-3
    for a, b in zip(alone, batched):
        assert runner.cached_length(a) == runner.cached_length(b)


def test_a_sub_span_of_the_runner(parts):
    head, runner = parts
    cache = runner.new_cache()
    runner.forward(head.embed_tokens(PROMPTS[1]), cache, 0, 2, 4)
    other = runner.new_cache()
    runner.forward(head.embed_tokens(PROMPTS[1]), other, 0, 2, 4)
    x = head.embed_tokens([5])
    [out] = decode_batch(runner, [x], [cache], [3], 2, 4)
    assert torch.equal(out, runner.forward(x, other, 3, 2, 4))
