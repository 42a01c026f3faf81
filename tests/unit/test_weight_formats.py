"""Weight formats: labels, the quantizer, the kernels, GGUF rows unpermuted,
manifests that name a format, and quantized spans (model/formats.py, quantize.py,
kernels.py, gguf_native.py, blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compushare.errors import FrameError, UsageError
from compushare.model.batched import decode_batch
from compushare.model.blocks import SpanRunner
from compushare.model.catalog import import_path
from compushare.model.formats import FORMATS, WeightFormat, format_from_manifest, parse_format
from compushare.model.gguf_native import unpermute
from compushare.model.head import ConsumerHead
from compushare.model.kernels import DequantizedLinear, Int4CpuLinear, Int8Linear, embedding_rows, linear
from compushare.model.manifest import parse
from compushare.model.quantize import dequantize, pack_nibbles, quantize, quantize_int8, quantize_q4, unpack_nibbles
from compushare.proofs.inference import TOLERANCES, relative_error

PROJ = "model.layers.3.mlp.down_proj.weight"


def test_labels_parse_and_print():
    assert [parse_format(t).label for t in ("fp32", "BF16", "int8", "q4", "q4/g32", "q4/g128")] == \
        ["fp32", "bf16", "int8", "q4/g64", "q4/g32", "q4/g128"]
    for bad in ("fp16", "q4/g48", "q4/gx", "int8/g32", "q8"):
        with pytest.raises(UsageError):
            parse_format(bad)
    assert parse_format("q4").head_format() == parse_format("int8")  # the LM head stays at 8 bits
    # Every format a span can compute in has a spot-check tolerance in the protocol's table.
    assert {parse_format(f).label for f in ("fp32", "bf16", "int8", "q4/g32", "q4/g64", "q4/g128")} <= set(TOLERANCES)
    assert set(FORMATS) == {"fp32", "bf16", "int8", "q4", "gguf"} and "gguf" in TOLERANCES


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 8), st.integers(1, 16), st.integers(0, 2**32 - 1))
def test_nibbles_pack_and_unpack(rows, pairs, seed):
    q = torch.randint(0, 16, (rows, 2 * pairs), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    packed = pack_nibbles(q)
    assert packed.shape == (rows, pairs) and torch.equal(unpack_nibbles(packed), q)


def test_quantizers_are_accurate_and_deterministic():
    weight = torch.randn(96, 256, generator=torch.Generator().manual_seed(1)) * 0.05
    int8 = quantize_int8(weight)
    assert int8[""].dtype == torch.int8 and int8["_scale"].shape == (96,)
    assert relative_error(dequantize(int8).numpy(), weight.numpy()) < 0.01
    for group, bound in ((32, 0.09), (64, 0.10), (128, 0.11)):
        q4 = quantize_q4(weight, group)
        assert q4[""].shape == (96, 128) and q4["_scale"].dtype == q4["_min"].dtype == torch.float16
        assert relative_error(dequantize(q4).numpy(), weight.numpy()) < bound
        again = quantize_q4(weight.clone(), group)
        assert all(torch.equal(q4[k], again[k]) for k in q4)  # same weights, same bytes, same model id
    with pytest.raises(UsageError, match="divisible"):
        quantize_q4(torch.zeros(4, 96), 64)


def test_a_grid_is_recovered_exactly():
    """Weights already on a 4-bit grid (a dequantized Q4_1 file: SmolLM2's fp32) come
    back bit for bit at the same group size: so `@q4/g32` of SmolLM2 is its GGUF's own."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (8, 64), generator=gen)
    q[:, ::32], q[:, 1::32] = 0, 15  # every group uses its whole range, as Q4_1's quantizer makes it
    scale = (torch.rand(8, 2, generator=gen) * 0.01 + 0.001).half()
    minimum = (torch.randn(8, 2, generator=gen) * 0.05).half()
    weight = dequantize({"": pack_nibbles(q.to(torch.uint8)), "_scale": scale, "_min": minimum})
    assert torch.equal(dequantize(quantize_q4(weight, 32)), weight)


def test_what_each_format_quantizes():
    w = torch.randn(64, 64)
    assert set(quantize(parse_format("int8"), PROJ, w)) == {PROJ, PROJ + "_scale"}
    gate = PROJ.replace("down_proj", "gate_proj")
    assert set(quantize(parse_format("q4"), gate, w)) == {gate, gate + "_scale", gate + "_min"}
    assert set(quantize(parse_format("q4"), PROJ, w)) == {PROJ, PROJ + "_scale"}  # down stays at int8 in q4
    embed = "model.embed_tokens.weight"
    assert set(quantize(parse_format("q4"), embed, w)) == {embed, embed + "_scale"}  # int8 head
    norm = "model.layers.3.input_layernorm.weight"
    assert quantize(parse_format("q4"), norm, torch.ones(64))[norm].dtype == torch.float32
    assert quantize(parse_format("bf16"), norm, torch.ones(64))[norm].dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 3])
def test_kernels_compute_the_dequantized_product(rows):
    """Within bfloat16 rounding of the activations (the kernels' input), whatever the
    kernel; the dense fallback for devices without kernels agrees too."""
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(192, 128, generator=gen) * 0.05, torch.randn(rows, 128, generator=gen)
    for parts, kind in ((quantize_int8(weight), Int8Linear), (quantize_q4(weight, 32), Int4CpuLinear),
                        (quantize_q4(weight, 64), Int4CpuLinear)):
        expected = x @ dequantize(parts).T
        module = linear(parts)
        assert isinstance(module, kind)
        for got in (module(x), DequantizedLinear(parts)(x)):
            assert got.dtype == torch.float32 and got.shape == (rows, 192)
            assert relative_error(got.numpy(), expected.numpy()) < 1e-2
    ids = torch.tensor([[5, 0, 191]])
    for parts in (quantize_int8(weight), quantize_q4(weight, 32)):
        assert torch.equal(embedding_rows(parts, ids, torch.float32), dequantize(parts)[ids])


def test_gguf_rows_unpermute_like_transformers():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(32 * 3, dtype=np.float32).reshape(32, 3)
    assert np.array_equal(unpermute(rows, 4), LlamaTensorProcessor()._reverse_permute_weights(rows, 4, 4))


def test_a_manifest_names_its_format(tiny_model, tmp_path):
    fp32 = import_path(tiny_model, tmp_path / "a", alias="tiny")
    q4 = import_path(tiny_model, tmp_path / "b", alias="tiny", fmt="q4/g32")
    assert fp32.format.label == "fp32" and fp32.manifest.weights is None  # older ids are unchanged
    assert q4.format.label == "q4/g32" and q4.manifest.weights == {
        "format": "q4", "group_size": 32, "int8": ["mlp.down_proj", "self_attn.k_proj", "self_attn.v_proj"]}
    assert parse(q4.manifest.raw, expected_id=q4.model_id).format == q4.format
    assert import_path(tiny_model, tmp_path / "c", alias="tiny", fmt="q4/g32").model_id == q4.model_id
    ratio = max(q4.manifest.block_bytes().values()) / max(fp32.manifest.block_bytes().values())
    assert ratio < 0.2  # 4 bits + a float16 scale and minimum per 32 weights, norms in fp32
    raw = q4.manifest.raw.decode()
    spec = '{"format":"q4","group_size":32,"int8":["mlp.down_proj","self_attn.k_proj","self_attn.v_proj"]}'
    assert spec in raw
    for bad in ('{"format":"fp32"}', '{"format":"q4","group_size":48}', '{"format":"int8","bits":8}',
                '{"format":"q4","group_size":"32"}', '"q4"', '{"format":"q4","group_size":32,"int8":["lm_head"]}',
                '{"format":"int8","int8":["mlp.down_proj"]}', '{"format":"q4","group_size":32,"int8":"mlp"}'):
        with pytest.raises(FrameError):
            parse(raw.replace(spec, bad).encode())
    assert format_from_manifest(None, {"BF16"}) == WeightFormat("bf16")


@pytest.mark.parametrize("fmt", ["int8", "q4", "q4/g32"])
def test_quantized_spans_split_exactly_and_batch_exactly(tiny_model, tmp_path, fmt):
    """A quantized model split into two spans gives the very bytes one span gives,
    and a batched decode step equals each session's own: the same kernels, the same
    rows, whatever the split or the company."""
    model = import_path(tiny_model, tmp_path, alias="tiny", fmt=fmt)
    head = ConsumerHead.load(model.path)
    whole, first, second = (SpanRunner.load(model.path, a, b) for a, b in ((0, 4), (0, 1), (1, 4)))
    assert whole.format_label == model.format.label and whole.dtype == torch.float32
    assert whole.weight_bytes < 0.35 * SpanRunner.load(tiny_model, 0, 4).weight_bytes
    x = head.embed_tokens([1, 5, 9, 13])
    alone = whole.forward(x, whole.new_cache(), 0)
    caches = [first.new_cache(), second.new_cache()]
    split = second.forward(first.forward(x, caches[0], 0), caches[1], 0)
    assert torch.equal(alone, split)
    sessions = [whole.new_cache() for _ in range(3)]
    own = [whole.new_cache() for _ in range(3)]
    for cache in sessions + own:
        whole.forward(x, cache, 0)
    steps = [head.embed_tokens([20 + i]) for i in range(3)]
    batched = decode_batch(whole, steps, sessions, [4, 4, 4], 0, 4)
    for step, cache, out in zip(steps, own, batched):
        assert torch.equal(out, whole.forward(step, cache, 4))
    logits = head.logits(alone)
    assert logits.dtype == torch.float32 and logits.shape == (256,)


def test_a_quantized_span_is_close_to_fp32(tiny_model, tmp_path):
    """The formats' accuracy on the tiny model's last hidden states (SmolLM2's
    perplexities are bench/node_compute.py's)."""
    reference = SpanRunner.load(tiny_model, 0, 4)
    x = ConsumerHead.load(tiny_model).embed_tokens(list(range(1, 30)))
    expected = reference.forward(x, reference.new_cache(), 0)
    for fmt, bound in (("bf16", 0.02), ("int8", 0.02), ("q4/g32", 0.15)):
        model = import_path(tiny_model, tmp_path / fmt.replace("/", "_"), alias="tiny", fmt=fmt)
        runner = SpanRunner.load(model.path, 0, 4)
        got = runner.forward(x, runner.new_cache(), 0)
        assert relative_error(got.float().numpy(), expected.numpy()) < bound, fmt


def test_the_memory_budget_counts_weights_in_their_format_and_the_kv_budget():
    from types import SimpleNamespace

    from compushare.pipeline.server.provider import MB, block_cost, blocks_for_budget, kv_bytes_per_token

    config = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}  # SmolLM2-135M
    blocks = {"fp32": 14_160_384, "int8": 3_564_288, "q4/g64": 1_995_264}  # their manifests' block bytes

    def model(label: str):
        return SimpleNamespace(num_blocks=1000, block_bytes=blocks[label], manifest=SimpleNamespace(config=config),
                               format=parse_format(label))

    assert kv_bytes_per_token(model("q4/g64")) == 2 * 3 * 64 * 4
    fit = {label: blocks_for_budget(model(label), max_blocks=None, memory_budget_mb=1024, free_mb=0)
           for label in blocks}
    assert fit["fp32"] == 1024 * MB // blocks["fp32"] == 75
    assert fit["q4/g64"] >= 7 * fit["fp32"] and fit["int8"] >= 3.9 * fit["fp32"]
    with_kv = blocks_for_budget(model("q4/g64"), max_blocks=None, memory_budget_mb=1024, free_mb=0, kv_tokens=8192)
    assert with_kv == 1024 * MB // block_cost(model("q4/g64"), 8192) < fit["q4/g64"]
    assert blocks_for_budget(model("q4/g64"), max_blocks=10, memory_budget_mb=1024, free_mb=0) == 10


def test_the_self_benchmark_runs_the_models_own_format(tiny_model, tmp_path):
    """Random weights for blocks not held yet, quantized like the model's: a q4 node
    advertises its q4 speed, not fp32's."""
    model = import_path(tiny_model, tmp_path, alias="tiny", fmt="q4")
    runner = SpanRunner.random(model.path, 0, 2)
    assert runner.format_label == "q4/g64"
    attn = runner.layers[0].self_attn
    assert isinstance(attn.q_proj, Int4CpuLinear) and isinstance(attn.kv_proj, Int8Linear)
    assert isinstance(runner.layers[0].mlp.gate_up_proj, Int4CpuLinear)


def test_int8_weights_at_any_byte_offset_compute_safely():
    """A tensor read from a safetensors file may start 8 bytes off a 64-byte boundary;
    torch's int8 kernel faulted on such weights with several rows (a segfault, found
    with int8 down projections in a q4 model): Int8Linear keeps an aligned copy."""
    q = torch.randint(-127, 128, (576, 1536), dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    buffer = torch.empty(q.numel() + 64, dtype=torch.int8)
    offset = next(i for i in range(64) if (buffer.data_ptr() + i) % 64 == 8)
    misaligned = buffer[offset:offset + q.numel()].view(576, 1536)
    misaligned.copy_(q)
    assert misaligned.data_ptr() % 64 == 8
    module = Int8Linear(misaligned, torch.rand(576))
    assert module.q.data_ptr() % 64 == 0
    x = torch.randn(5, 1536)
    expected = x @ (q.float() * module.scale.float()[:, None]).T
    assert relative_error(module(x).numpy(), expected.numpy()) < 1e-2


def test_plain_readers_see_a_quantized_model_dequantized(tiny_model, tmp_path):
    """Private mode's encrypted products and the transformers reference read float
    weights: a quantized matrix comes dequantized, under its own name."""
    from compushare.model.blocks import load_full_model
    from compushare.model.weights import read_dense_tensors, read_tensors

    model = import_path(tiny_model, tmp_path, alias="tiny", fmt="q4/g32")
    dense = read_dense_tensors(model.path, lambda names: [n for n in names if n.startswith("model.layers.1.")])
    raw = read_tensors(model.path, lambda names: names)
    gate = "model.layers.1.mlp.gate_proj.weight"
    assert dense[gate].dtype == torch.float32 and torch.equal(dense[gate], dequantize(
        {s: raw[gate + s] for s in ("", "_scale", "_min")}))
    assert not any(n.endswith(("_scale", "_min")) for n in dense) and len(dense) == 9
    full = load_full_model(model.path)
    assert torch.equal(full.model.layers[1].mlp.gate_proj.weight, dense[gate])


def test_malformed_quantized_weights_fail_at_load_not_at_the_first_step(tiny_model, tmp_path):
    from compushare.model.arch import load_config
    from compushare.model.blocks import span_tensor_names
    from compushare.model.weights import read_tensors

    model = import_path(tiny_model, tmp_path, alias="tiny", fmt="q4/g32")
    state = read_tensors(model.path, lambda names: span_tensor_names(names, 0, 1))
    config = load_config(model.path)
    SpanRunner(config, 0, 1, dict(state))  # as stored: fine
    scale = "model.layers.0.mlp.gate_proj.weight_scale"
    for bad in (state[scale][:, :1], state[scale].float(), state[scale][:-1]):
        with pytest.raises(ValueError, match="no quantized"):
            SpanRunner(config, 0, 1, dict(state) | {scale: bad})
    # Output rows the packed 4-bit kernel cannot tile (not a multiple of 16): the dense fallback.
    assert isinstance(linear(quantize_q4(torch.randn(100, 64), 32)), DequantizedLinear)


@pytest.mark.parametrize("fmt", ["bf16", "int8", "q4", "q4/g32"])
def test_random_blocks_come_in_every_format(tiny_model, tmp_path, fmt):
    model = import_path(tiny_model, tmp_path, alias="tiny", fmt=fmt)
    runner = SpanRunner.random(model.path, 0, 2)
    assert runner.format_label == model.format.label
    assert runner.forward(torch.randn(1, 3, 64), runner.new_cache(), 0).shape == (1, 3, 64)


def test_a_budget_given_is_the_whole_process_and_a_fixed_span_must_fit_it():
    from types import SimpleNamespace

    from compushare.config import Span
    from compushare.errors import UsageError
    from compushare.pipeline.server.provider import MB, block_cost, blocks_for_budget, check_fixed_span

    config = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096}  # Llama-3.1-8B
    model = SimpleNamespace(num_blocks=32, block_bytes=123 * MB, manifest=SimpleNamespace(config=config),
                            format=parse_format("q4/g32"))
    cost = block_cost(model, 1024)
    budget = 400 + 12 * cost // MB + 1  # the process's 400 MB, then room for exactly 12 blocks
    assert blocks_for_budget(model, max_blocks=None, memory_budget_mb=budget, free_mb=0, kv_tokens=1024,
                             held_mb=400) == 12
    assert blocks_for_budget(model, max_blocks=None, memory_budget_mb=budget, free_mb=0, kv_tokens=1024,
                             held_mb=0) > 12
    check_fixed_span(model, Span(0, 12), memory_budget_mb=budget, held_mb=400, kv_tokens=1024)
    with pytest.raises(UsageError, match="at most 12 blocks fit"):
        check_fixed_span(model, Span(0, 13), memory_budget_mb=budget, held_mb=400, kv_tokens=1024)
    check_fixed_span(model, Span(0, 32), memory_budget_mb=None, held_mb=400, kv_tokens=1024)  # no budget, no limit
