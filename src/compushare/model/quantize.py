"""The quantizer (model/formats.py says what each format stores). Deterministic:
round to nearest, ties to even, in a fixed order of float32 operations, so every
node quantizing the same fp32 model writes the same bytes and gets the same id."""

from __future__ import annotations

import torch

from ..errors import UsageError
from .formats import HEAD_MATRICES, MIN_SUFFIX, SCALE_SUFFIX, WeightFormat, is_quantized_matrix


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per-row int8: {"": q (I8 [out, in]), "_scale": float32 [out]}."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"": q.contiguous(), SCALE_SUFFIX: scale.contiguous()}


def quantize_q4(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """Asymmetric 4-bit in groups along the input dimension (GGUF Q4_1's rule:
    scale = (max - min) / 15, q = round((w - min) / scale)), the scale and min
    rounded to float16 first so q is chosen against the values stored."""
    w = weight.float()
    out_features, in_features = w.shape
    if in_features % group_size:
        raise UsageError(f"q4/g{group_size} needs an input dimension divisible by {group_size}, not {in_features}")
    groups = w.reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    limit = torch.finfo(torch.float16).max
    scale = ((high - low) / 15.0).clamp(max=limit).to(torch.float16)
    minimum = low.clamp(-limit, limit).to(torch.float16)
    step = scale.float().unsqueeze(2)
    q = torch.round((groups - minimum.float().unsqueeze(2)) / torch.where(step > 0, step, torch.ones_like(step)))
    q = q.clamp_(0, 15).to(torch.uint8).reshape(out_features, in_features)
    return {"": pack_nibbles(q), SCALE_SUFFIX: scale.contiguous(), MIN_SUFFIX: minimum.contiguous()}


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] values 0..15 -> [out, in / 2] bytes, element 2j low, 2j+1 high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """pack_nibbles' inverse, as uint8 [out, in]."""
    out = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.uint8)
    out[:, 0::2] = packed & 0x0F
    out[:, 1::2] = packed >> 4
    return out


def quantize(fmt: WeightFormat, name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stored tensors of `name` under `fmt`: {stored name: tensor}."""
    if fmt.name == "fp32":
        return {name: weight.float().contiguous()}
    if fmt.name == "bf16":
        return {name: weight.to(torch.bfloat16).contiguous()}
    if not is_quantized_matrix(name):
        return {name: weight.float().contiguous()}
    own = fmt.head_format() if name in HEAD_MATRICES else fmt
    parts = quantize_int8(weight) if own.name == "int8" else quantize_q4(weight, own.group_size)
    return {name + suffix: tensor for suffix, tensor in parts.items()}


def dequantize(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 weights from a quantized matrix's stored parts ({"", "_scale"[, "_min"]})."""
    q, scale = parts[""], parts[SCALE_SUFFIX]
    if MIN_SUFFIX not in parts:
        return q.float() * scale.float()[:, None]
    values = unpack_nibbles(q).float()
    group = values.shape[1] // scale.shape[1]
    return values * scale.float().repeat_interleave(group, dim=1) + parts[MIN_SUFFIX].float().repeat_interleave(
        group, dim=1)


def matrix_parts(state: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The stored parts of matrix `name` from a state dict ({"": the tensor} when dense)."""
    return {suffix: state[name + suffix] for suffix in ("", SCALE_SUFFIX, MIN_SUFFIX) if name + suffix in state}


def stack_rows(matrices: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Quantized matrices with the same input, as one with their rows stacked (exact:
    every scale belongs to its row)."""
    return {suffix: torch.cat([m[suffix] for m in matrices], dim=0) for suffix in matrices[0]}
