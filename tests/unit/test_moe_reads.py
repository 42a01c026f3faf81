"""A mixture of experts' ggml span reads only the experts its tokens chose
(spans/ggml/span.py, WeightReads): a decode step reads every dense tensor and at most
`used` experts a layer, so no more than the active parameters; a prompt reads each
chosen expert once for all its tokens, so no more than every expert once. On the tiny
Qwen3-MoE file llama.cpp's converter wrote (8 experts, 2 a token)."""

from __future__ import annotations

from pathlib import Path

import pytest

from compushare.model.catalog import import_path
from compushare.spans.ggml.load import load_ggml_span
from compushare.spans import load_head

DATA = Path(__file__).resolve().parents[1] / "data" / "gguf"
PROMPT = [1, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]


@pytest.fixture
def span(tmp_path, monkeypatch):
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    model = import_path(DATA / "tiny-qwen3_moe-f32.gguf", tmp_path / "data", alias="moe")
    return load_ggml_span(model.path, 0, model.num_blocks), load_head(model.path)


def test_a_decode_step_reads_at_most_the_active_parameters_and_a_prompt_each_expert_once(span):
    span, head = span
    reads, used, count = span.reads, span.recipe.experts.used, span.recipe.experts.count
    layers = span.end - span.start
    one_expert = sum(reads.expert.values()) // layers
    dense = sum(reads.dense.values())
    everything = dense + count * sum(reads.expert.values())
    assert 0.9 * span.weight_bytes <= everything <= span.weight_bytes  # every tensor counted (buffers pad)
    cache = span.new_cache()
    hidden = span.forward(head.embed_tokens(PROMPT), cache, 0)
    # 16 tokens choose most of the 8 experts, each read once: more than a token's share, at most all.
    assert dense + used * layers * one_expert < reads.last <= everything
    steps = []
    for _ in range(8):
        token = int(head.logits(hidden).argmax())
        hidden = span.forward(head.embed_tokens([token]), cache, span.cached_length(cache))
        steps.append(reads.last)
    assert all(step == reads.active_bytes(used) for step in steps)  # one token: exactly `used` distinct experts
    assert reads.forwards == 9 and reads.tokens == len(PROMPT) + 8


def test_the_norms_file_holds_no_experts(tmp_path, monkeypatch):
    """The norms file (what a private-mode consumer fetches with the head) keeps a block's
    small tensors; a mixture's expert stacks and biases are most of its bytes and stay in
    the block files only."""
    from compushare.model.manifest import NORMS_FILE

    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    model = import_path(DATA / "tiny-gpt_oss-f32.gguf", tmp_path / "data", alias="oss")
    [norms] = [f for f in model.manifest.files if f.name == NORMS_FILE]
    assert norms.tensors and not [name for name in norms.tensors if ".mlp.experts." in name]
    assert "model.layers.0.self_attn.sinks" in norms.tensors
    blocks = {name for f in model.manifest.files if f.role == "block" for name in f.tensors}
    assert "model.layers.0.mlp.experts.gate_proj_bias" in blocks and "model.layers.3.mlp.experts.down_proj" in blocks


@pytest.mark.parametrize("used", [0, 9, "2"])
def test_a_config_asking_for_experts_it_lacks_is_refused_before_ggml(used):
    """ggml aborts the process on a top-k past its experts: the recipe refuses such a
    config (one a publisher wrote) with an error instead."""
    from compushare.spans.ggml.recipe import recipe_of
    from tiny_families import tiny_config

    bad = tiny_config("qwen3_moe").to_dict() | {"num_experts_per_tok": used}
    with pytest.raises(ValueError, match="experts a token of"):
        recipe_of(bad)
