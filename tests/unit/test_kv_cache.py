"""The block-grown KV cache gives bit-identical outputs to transformers' DynamicCache
through prefill pieces, decode steps and truncates, and never holds more than one
block of unused room per layer."""

from __future__ import annotations

import torch
from hypothesis import given, settings, strategies as st
from transformers.cache_utils import DynamicLayer

from compushare.model.blocks import SpanRunner
from compushare.model.kv_cache import GROW_TOKENS, BlockGrownLayer, new_cache


def _run(runner: SpanRunner, cache, script, inputs) -> list[torch.Tensor]:
    outputs, position = [], 0
    for kind, n in script:
        if kind == "step":
            outputs.append(runner.forward(inputs[position:position + n].unsqueeze(0), cache, position))
            position += n
        else:  # truncate back by n tokens
            position = max(0, position - n)
            runner.truncate(cache, position)
    return outputs


@settings(max_examples=25, deadline=None)
@given(st.lists(st.one_of(st.tuples(st.just("step"), st.integers(1, 300)),
                          st.tuples(st.just("truncate"), st.integers(0, 200))), min_size=1, max_size=8))
def test_outputs_equal_dynamic_cache_bit_for_bit(tiny_model, script):
    runner = SpanRunner.load(tiny_model, 1, 4)
    total = sum(n for kind, n in script if kind == "step")
    inputs = torch.randn(total, runner.hidden_size, generator=torch.Generator().manual_seed(total))
    ours = _run(runner, runner.new_cache(), script, inputs)
    reference = new_cache(runner.config)
    reference.layers = [DynamicLayer() for _ in reference.layers]
    theirs = _run(runner, reference, script, inputs)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


def test_room_grows_by_blocks_and_a_truncate_keeps_it(tiny_model):
    runner = SpanRunner.load(tiny_model, 0, 4)
    cache = runner.new_cache()
    assert all(isinstance(layer, BlockGrownLayer) for layer in cache.layers)
    hidden = runner.hidden_size
    runner.forward(torch.randn(1, 10, hidden), cache, 0)
    assert {layer.room() for layer in cache.layers} == {GROW_TOKENS}
    for position in range(10, GROW_TOKENS + 1):
        runner.forward(torch.randn(1, 1, hidden), cache, position)
    assert runner.cached_length(cache) == GROW_TOKENS + 1
    assert {layer.room() for layer in cache.layers} == {2 * GROW_TOKENS}
    runner.truncate(cache, 5)
    assert runner.cached_length(cache) == 5
    assert {layer.room() for layer in cache.layers} == {2 * GROW_TOKENS}
