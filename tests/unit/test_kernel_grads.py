"""model/kernel_grads.py: the input's gradient through each frozen quantized kernel
equals grad_y @ W for W as the kernel holds it (int8, q4 and every GGUF type on
torch), with the served forward unchanged, and the packed layouts decode."""

import numpy as np
import pytest
import torch

from compushare.model import gguf_native
from compushare.model.kernel_grads import TILE_ROWS, FrozenProduct, backward_transient_bytes, unpacked_rows
from compushare.model.kernels import linear, pack_int4
from compushare.model.quantize import dequantize, quantize_int8, quantize_q4

GGUF_TYPES = ["Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q5_1", "Q5_K", "Q8_0", "Q6_K", "F16", "BF16"]


def _grad(module, x: torch.Tensor, grad_y: torch.Tensor) -> torch.Tensor:
    leaf = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(module(leaf), leaf, grad_y)
    return grad


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("fmt", ["int8", "q4"])
def test_our_formats_give_the_gradient_of_their_held_weights(fmt):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3 * TILE_ROWS + 64, 192, generator=generator)  # tiles, and a short last one
    parts = quantize_int8(weight) if fmt == "int8" else quantize_q4(weight, 32)
    module = linear(parts)
    assert isinstance(module, FrozenProduct)
    x, grad_y = torch.randn(2, 5, 192, generator=generator), torch.randn(2, 5, weight.shape[0], generator=generator)
    held = module.held_rows(0, weight.shape[0])
    assert _relative(_grad(module, x, grad_y), grad_y @ held) < 1e-5  # the backward is grad_y @ W held
    # W as held is the stored weight within bfloat16's rounding of the scale (kernels.py)
    assert _relative(held, dequantize(parts).float()) < 2 ** -7
    with torch.no_grad():
        assert torch.equal(module(x), module.product(x))  # the served forward, unchanged


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_every_gguf_type_gives_the_gradient_of_the_files_weights(kind):
    raw = torch.from_numpy(gguf_native.random_rows(kind, 512, 256, np.random.default_rng(1)))
    module = linear({"": raw}, gguf_type=kind)
    generator = torch.Generator().manual_seed(1)
    x, grad_y = torch.randn(4, 256, generator=generator), torch.randn(4, 512, generator=generator)
    stored = torch.from_numpy(gguf_native.dequantize(raw.numpy(), kind)).float()
    assert _relative(_grad(module, x, grad_y), grad_y @ stored) < 3e-3  # measured: at most 2.0e-3 (Q5_0)


def test_the_packed_int4_layout_decodes():
    codes = torch.randint(0, 16, (192, 96), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    packed = pack_int4(codes)
    assert torch.equal(unpacked_rows(packed, 0, 192, 96), codes)
    assert torch.equal(unpacked_rows(packed, 64, 128, 96), codes[64:128])


def test_a_backward_holds_one_tile_of_rows_at_most():
    weight = torch.randn(1024, 256)
    layer = torch.nn.ModuleList([linear(quantize_q4(weight, 32)), linear(quantize_int8(weight[:128]))])
    assert backward_transient_bytes([layer]) == 2 * 4 * TILE_ROWS * 256
    assert backward_transient_bytes([torch.nn.Linear(4, 4)]) == 0
