"""The quantizer (model/formats.py says what each format stores). Deterministic:
round to nearest, ties to even; int8's per-row scale, and q4's per-group search in
float64, so every node quantizing the same fp32 model writes the same bytes and gets
the same id (in principle two CPUs could sum a near-tie in q4's search differently;
a node that did would serve a model id of its own, never a mixed chain)."""

from __future__ import annotations

import math

import torch

from ..errors import UsageError
from .formats import HEAD_MATRICES, MIN_SUFFIX, SCALE_SUFFIX, WeightFormat, is_quantized_matrix, projection_of


SEARCH_ROWS = 256  # rows quantize_q4 searches at once


def quantize_int8(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Symmetric per-row int8: {"": q (I8 [out, in]), "_scale": float32 [out]}."""
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero row
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return {"": q.contiguous(), SCALE_SUFFIX: scale.contiguous()}


def quantize_q4(weight: torch.Tensor, group_size: int, *, steps: int = 20) -> dict[str, torch.Tensor]:
    """Asymmetric 4-bit in groups along the input dimension, w ~ q * scale + min with q
    in 0..15, choosing each group's scale and min to minimise its squared error (the
    search llama.cpp's k-quants make): for each of `steps` + 1 candidate scales around
    (max - min) / 15, round the group, fit scale and min to that rounding by least
    squares, round them to float16, re-round the group against those, keep the best.
    Weights already on a 4-bit grid come back exactly. Float64 throughout, so the
    choice does not hang on float32 rounding. Rows go SEARCH_ROWS at a time, so the
    search holds ~40 MB whatever the matrix (a 7B model's 11008 x 4096 took 1.6 GB
    at once)."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise UsageError(f"q4/g{group_size} needs an input dimension divisible by {group_size}, not {in_features}")
    if weight.device.type == "meta":  # shapes only (layout.py's specs): the search on meta costs ~0.2 s a matrix
        groups = in_features // group_size
        return {"": torch.empty(out_features, in_features // 2, dtype=torch.uint8, device="meta"),
                SCALE_SUFFIX: torch.empty(out_features, groups, dtype=torch.float16, device="meta"),
                MIN_SUFFIX: torch.empty(out_features, groups, dtype=torch.float16, device="meta")}
    chunks = [_search_q4(weight[row:row + SEARCH_ROWS], group_size, steps)
              for row in range(0, out_features, SEARCH_ROWS)]
    q, scale, minimum = (torch.cat(part, dim=0) for part in zip(*chunks))
    return {"": pack_nibbles(q), SCALE_SUFFIX: scale.contiguous(), MIN_SUFFIX: minimum.contiguous()}


def _search_q4(weight: torch.Tensor, group_size: int, steps: int) -> tuple[torch.Tensor, ...]:
    """quantize_q4's search for some rows: (levels uint8 [rows, in], scale, min float16)."""
    w = weight.double()
    out_features, in_features = w.shape
    x = w.reshape(out_features, in_features // group_size, group_size)
    low, high = x.amin(dim=2, keepdim=True), x.amax(dim=2, keepdim=True)
    span = (high - low).clamp(min=1e-30)
    best_error = torch.full_like(low, math.inf)
    best_scale, best_min = _fp16(span / 15.0), _fp16(low)
    for step in range(steps + 1):
        levels = torch.round((x - low) * ((14.0 + 0.1 * step) / span)).clamp_(0, 15)
        n, s_l, s_w = group_size, levels.sum(2, keepdim=True), x.sum(2, keepdim=True)
        s_ll, s_lw = (levels * levels).sum(2, keepdim=True), (levels * x).sum(2, keepdim=True)
        det = n * s_ll - s_l * s_l
        scale = torch.where(det > 0, (n * s_lw - s_l * s_w) / det.clamp(min=1e-30), span / 15.0)
        scale, minimum = _fp16(scale), _fp16((s_w - scale * s_l) / n)
        error = ((_levels(x, scale, minimum) * scale + minimum - x) ** 2).sum(2, keepdim=True)
        better = error < best_error
        best_error = torch.where(better, error, best_error)
        best_scale, best_min = torch.where(better, scale, best_scale), torch.where(better, minimum, best_min)
    q = _levels(x, best_scale, best_min).to(torch.uint8).reshape(out_features, in_features)
    return q, best_scale.squeeze(2).half(), best_min.squeeze(2).half()


def random_parts(fmt: WeightFormat, name: str, weight: torch.Tensor, generator: torch.Generator
                 ) -> dict[str, torch.Tensor]:
    """Stored tensors of `name` under `fmt` with random codes, as quantize() lays them out
    but without its search: for timing blocks not held (values do not change speed)."""
    own = fmt.head_format() if name in HEAD_MATRICES else fmt
    if own.name != "q4" or not is_quantized_matrix(name) or projection_of(name) in own.int8:
        return quantize(fmt, name, weight)  # dense, or int8: no search to skip
    out_features, in_features = weight.shape
    packed = torch.randint(0, 256, (out_features, in_features // 2), dtype=torch.uint8, generator=generator)
    groups = in_features // own.group_size
    return {name: packed, name + SCALE_SUFFIX: torch.full((out_features, groups), 0.01, dtype=torch.float16),
            name + MIN_SUFFIX: torch.full((out_features, groups), -0.08, dtype=torch.float16)}


def _fp16(values: torch.Tensor) -> torch.Tensor:
    """`values` rounded to what float16 stores (finite), back in float64."""
    limit = torch.finfo(torch.float16).max
    return values.clamp(-limit, limit).half().double()


def _levels(x: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """The 4-bit levels of `x` against a stored scale and min."""
    return torch.round((x - minimum) / torch.where(scale > 0, scale, torch.ones_like(scale))).clamp_(0, 15)


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
    if own.name == "q4" and projection_of(name) in own.int8:
        own = fmt.head_format()  # the projections this q4 keeps at int8
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
