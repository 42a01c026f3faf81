"""Spans and kernels on a CUDA device against the same on CPU (marked gpu: `make test`
leaves them out, and says so once, where torch sees no CUDA device).

Self-contained (a tiny random Llama built here, no tests/helpers): they also run where
only torch and transformers are installed, as on the device machine:
`PYTHONPATH=src python3 -m pytest -q --noconftest -p no:cacheprovider tests/gpu`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compushare.model import gguf_native, kernels
from compushare.model.batched import decode_batch
from compushare.model.blocks import SpanRunner
from compushare.model.formats import parse_format
from compushare.model.quantize import dequantize, quantize, quantize_int8, quantize_q4

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def test_the_int4_kernel_is_found():
    assert kernels.cuda_int4_form(CUDA) in ("uint8", "int32")


@pytest.mark.parametrize("label", ["q4", "int8", "Q4_K", "Q8_0", "Q5_K"])
def test_kernels_give_the_dequantized_product(label):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(256, 512, generator=generator) * 0.05
    x = torch.randn(3, 512, generator=generator)
    if label in ("q4", "int8"):
        parts = quantize_q4(weight, 64) if label == "q4" else quantize_int8(weight)
        module, reference = kernels.linear(parts, CUDA), dequantize(parts)
    else:
        raw = torch.from_numpy(gguf_native.random_rows(label, 256, 512, np.random.default_rng(0)))
        module = kernels.linear({"": raw}, CUDA, gguf_type=label)
        reference = torch.from_numpy(gguf_native.dequantize(raw.numpy(), label)).float()
    assert isinstance(module, kernels.CudaInt4Linear)
    got = module(x.to(CUDA))
    assert got.device == CUDA
    assert relative(got.cpu(), x.to(kernels.ACTIVATION).float() @ reference.t()) < 0.02


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama's config and decoder weights (3 layers, hidden 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    return config, {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("model.layers.")}


def _state(weights: dict[str, torch.Tensor], fmt_text: str) -> dict[str, torch.Tensor]:
    fmt, state = parse_format(fmt_text), {}
    for name, tensor in weights.items():
        state |= quantize(fmt, name, tensor)
    return state


@pytest.mark.parametrize(("fmt", "tolerance"), [("fp32", 1e-4), ("bf16", 0.05), ("q4", 0.03)])
def test_a_span_on_cuda_gives_the_cpu_spans_outputs(tiny, fmt, tolerance):
    config, state = tiny[0], _state(tiny[1], fmt)
    dtype = torch.bfloat16 if fmt == "bf16" else torch.float32
    on_cuda = SpanRunner(config, 0, config.num_hidden_layers, dict(state), dtype, device="cuda")
    on_cpu = SpanRunner(config, 0, config.num_hidden_layers, dict(state), dtype)
    assert on_cuda.device == CUDA
    assert all(t.device == CUDA for layer in on_cuda.layers.values() for t in layer.state_dict().values())
    if fmt == "q4":
        assert any(isinstance(m, kernels.CudaInt4Linear) for m in on_cuda.layers[0].modules())
    generator = torch.Generator().manual_seed(0)
    caches = on_cuda.new_cache(), on_cpu.new_cache()
    hidden = torch.randn(1, 7, config.hidden_size, generator=generator)
    for position in (0, 7, 8, 9):
        got, expected = (runner.forward(hidden, cache, position) for runner, cache in zip((on_cuda, on_cpu), caches))
        assert got.device.type == "cpu" and got.dtype == expected.dtype  # the wire's side of the edge
        assert relative(got, expected) < tolerance
        hidden = torch.randn(1, 1, config.hidden_size, generator=generator)


def test_batched_decode_on_cuda_gives_each_sessions_own(tiny):
    config = tiny[0]
    runner = SpanRunner(config, 0, config.num_hidden_layers, _state(tiny[1], "q4"), device="cuda")
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randn(1, n, config.hidden_size, generator=generator) for n in (3, 5)]
    tokens = [torch.randn(1, 1, config.hidden_size, generator=generator) for _ in prompts]
    alone, batched = [], [runner.new_cache() for _ in prompts]
    for prompt, token, cache in zip(prompts, tokens, batched):
        own = runner.new_cache()
        runner.forward(prompt, own, 0)
        runner.forward(prompt, cache, 0)
        alone.append(runner.forward(token, own, prompt.shape[1]))
    outs = decode_batch(runner, tokens, batched, [p.shape[1] for p in prompts], 0, config.num_hidden_layers)
    for out, own in zip(outs, alone):
        assert out.device.type == "cpu"
        assert relative(out, own) < 0.02
