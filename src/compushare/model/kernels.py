"""The matrix products of each weight format, behind one interface: `linear(...)`.

Measured on this project's CPUs (AVX-512, torch 2.13, 1 thread; a SmolLM2 576x1536
matrix-vector product with the weights hot in cache): fp32 45 us, bf16 62 us; torch's
own weight-only kernels `_weight_int8pack_mm` 24 us and `_weight_int4pack_mm_for_cpu`
24 us, but only with bfloat16 activations (with float32 ones they fall back to
reference loops: 575 us and 1,280 us). In a real decode the weights stream from
memory (30 blocks of fp32 SmolLM2 are 400 MB), where 4-bit reads 6x fewer bytes.
torchao's CPU int8 / int4 weight-only paths call these same two kernels, so it would
add a dependency (and a torch-version coupling) without speed; they are called here
directly. Activations enter the quantized kernels as bfloat16 and leave as float32:
the residual stream, norms and attention stay float32.

A build for another device registers its own kernels in KERNELS under its device
type ("cuda": torch's `_weight_int4pack_mm` with `_convert_weight_to_int4pack`;
"mps": `_weight_int4pack_mm_with_scales_and_zeros`); until it does, it gets
DequantizedLinear, which is correct everywhere and fast nowhere.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .formats import MIN_SUFFIX, SCALE_SUFFIX
from .quantize import dequantize, unpack_nibbles

ACTIVATION = torch.bfloat16  # what torch's weight-only CPU kernels are fast with


def aligned(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` in fresh, contiguous storage from torch's allocator (64-byte aligned)."""
    return tensor.contiguous().clone() if tensor.data_ptr() % 64 else tensor.contiguous()


class Int8Linear(torch.nn.Module):
    """y = x @ (q * scale).T with per-row scales, through `_weight_int8pack_mm`."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        # A copy of its own: a tensor read from a safetensors file may start at any
        # byte, and the kernel's multi-row path faults on int8 weights that are not
        # 64-byte aligned (seen: 8 bytes off, segfault at 5 rows, fine at 1).
        self.register_buffer("q", aligned(q))
        self.register_buffer("scale", aligned(scale.to(ACTIVATION)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACTIVATION)
        out = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class Int4CpuLinear(torch.nn.Module):
    """y = x @ (q * scale + min).T in groups, through `_weight_int4pack_mm_for_cpu`,
    whose weights are (q - 8) * scale + zero: so zero = min + 8 * scale."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> None:
        super().__init__()
        q = unpack_nibbles(packed).to(torch.int32)
        self.out_features, self.in_features = q.shape
        self.group_size = self.in_features // scale.shape[1]
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        zero = minimum.float() + 8.0 * scale.float()
        self.register_buffer("scales_and_zeros", torch.stack([scale.float().t(), zero.t()], dim=-1)
                             .to(ACTIVATION).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(ACTIVATION)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group_size, self.scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


class DequantizedLinear(torch.nn.Linear):
    """Any quantized matrix as a dense bfloat16 one: the fallback for devices with no kernel."""

    def __init__(self, parts: dict[str, torch.Tensor]) -> None:
        weight = dequantize(parts).to(ACTIVATION)
        super().__init__(weight.shape[1], weight.shape[0], bias=False, device="meta")
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(ACTIVATION)).to(x.dtype)


def _int8(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
    return Int8Linear(parts[""], parts[SCALE_SUFFIX])


def _q4_cpu(parts: dict[str, torch.Tensor]) -> torch.nn.Module:
    if parts[""].shape[0] % 16:  # the packed layout wants output rows in tiles of 16
        return DequantizedLinear(parts)
    return Int4CpuLinear(parts[""], parts[SCALE_SUFFIX], parts[MIN_SUFFIX])


# (device type, format name) -> constructor from a matrix's stored parts.
KERNELS: dict[tuple[str, str], Callable[[dict[str, torch.Tensor]], torch.nn.Module]] = {
    ("cpu", "int8"): _int8,
    ("cpu", "q4"): _q4_cpu,
}


class WithBias(torch.nn.Module):
    """A quantized product plus a float32 bias (Qwen2's q, k and v projections have one)."""

    def __init__(self, product: torch.nn.Module, bias: torch.Tensor) -> None:
        super().__init__()
        self.product = product
        self.register_buffer("bias", bias.float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x) + self.bias


def linear(parts: dict[str, torch.Tensor], device: str = "cpu", bias: torch.Tensor | None = None) -> torch.nn.Module:
    """A module computing x @ W.T (+ bias) for the stored matrix `parts` ({"": weight}
    when dense; plus "_scale" / "_min" when quantized). Dense weights give a plain
    nn.Linear, op for op what transformers runs."""
    if bias is not None:
        return WithBias(linear(parts, device), bias)
    if SCALE_SUFFIX not in parts:
        weight = parts[""]
        module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
        module.weight = torch.nn.Parameter(weight, requires_grad=False)
        return module
    own = "q4" if MIN_SUFFIX in parts else "int8"
    make = KERNELS.get((device, own))
    return make(parts) if make is not None else DequantizedLinear(parts)


def embedding_rows(parts: dict[str, torch.Tensor], ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `ids` of an embedding matrix in any format, dequantizing only those rows."""
    if SCALE_SUFFIX not in parts:
        return torch.nn.functional.embedding(ids, parts[""]).to(dtype)
    rows = {suffix: tensor[ids.reshape(-1)] for suffix, tensor in parts.items()}
    return dequantize(rows).to(dtype).reshape(*ids.shape, -1)
